"""The runner's loop with stand-in systems (no model): interleaving, identity, errors, Ctrl-C, resume."""

from __future__ import annotations

import json

import pytest

from specfree.bench.prompts import PromptItem
from specfree.bench.runner import Conversation, run_records
from specfree.bench.store import RecordStore
from specfree.bench.systems import Turn
from specfree.errors import ConfigError


class Fake:
    """Answers every prompt with ``tokens``; can fail or be 'interrupted' on a given prompt."""

    kind = "fake"

    def __init__(self, label, tokens=(5, 6, 7), fail_on=None, interrupt_on=None, calls=None):
        self.label = self.strategy = label
        self.knobs = self.params = {}
        self.tokens, self.fail_on, self.interrupt_on = list(tokens), fail_on, interrupt_on
        self.calls = calls if calls is not None else []

    def run(self, ids, max_new_tokens):
        self.calls.append((self.label, tuple(ids)))
        if self.interrupt_on is not None and ids[0] == self.interrupt_on:
            raise KeyboardInterrupt
        if self.fail_on is not None and ids[0] == self.fail_on:
            raise RuntimeError("out of memory")
        return Turn(tokens=self.tokens[:max_new_tokens], wall_s=0.5, prompt_tokens=len(ids), steps=3)


ITEMS = [PromptItem("1", "a", ["x"]), PromptItem("2", "b", ["y", "z"]), PromptItem("3", "b", ["w"])]


def conversation(chat=True):
    # ids: [index of the prompt's first letter in the alphabet, number of messages so far]
    def encode(prompt, chat=None):
        first = prompt[0]["content"] if isinstance(prompt, list) else prompt
        return [ord(first[0]) - ord("a"), len(prompt) if isinstance(prompt, list) else 1]

    return Conversation(encode, lambda ids: "answer", chat)


def store(tmp_path, **kw):
    return RecordStore(tmp_path, {"model": "m", "max_new_tokens": 4}, **kw)


def test_interleaves_systems_per_prompt_rotating_who_goes_first_and_continues_conversations(tmp_path):
    calls = []
    systems = [Fake("autoregressive", calls=calls), Fake("other", calls=calls)]
    s = store(tmp_path)
    run_records(ITEMS, systems, conversation(), s, max_new_tokens=4)
    order = [label for label, _ in calls]
    ar, other = "autoregressive", "other"
    assert order == [ar, other, other, other, ar, ar, ar, other]  # a system runs all turns of prompt 2
    # turn 2 of prompt 2 sees 3 messages: user, that system's own answer, user
    assert [ids for label, ids in calls if label == "other"] == [(23, 1), (24, 1), (24, 3), (22, 1)]
    records = json.loads((tmp_path / "bench.json").read_text())["records"]
    assert [(r["prompt_id"], r["system"], len(r["turns"])) for r in records] == [
        ("1", "autoregressive", 1), ("1", "other", 1), ("2", "autoregressive", 2), ("2", "other", 2),
        ("3", "autoregressive", 1), ("3", "other", 1)]
    # "other" ran before the baseline on prompt 2: its identity is settled when the baseline finishes
    assert all(r["identical"] is True for r in records)


def test_identity_flag_catches_a_different_output(tmp_path):
    s = store(tmp_path)
    run_records(ITEMS[:1], [Fake("autoregressive"), Fake("same"), Fake("different", tokens=(5, 6, 8))],
                conversation(), s, max_new_tokens=4)
    flags = {r["system"]: r["identical"] for r in s.records}
    assert flags == {"autoregressive": True, "same": True, "different": False}


def test_an_erroring_prompt_is_recorded_and_the_run_goes_on(tmp_path):
    s = store(tmp_path)
    run_records(ITEMS, [Fake("autoregressive"), Fake("flaky", fail_on=ord("y") - ord("a"))], conversation(), s, 4)
    errors = {(r["prompt_id"], r["system"]): r["error"] for r in s.records}
    assert errors[("2", "flaky")] == "RuntimeError: out of memory"
    assert errors[("3", "flaky")] is None and len(errors) == 6


def test_interrupt_keeps_finished_records_and_resume_skips_them(tmp_path):
    s = store(tmp_path)
    with pytest.raises(KeyboardInterrupt):
        run_records(ITEMS, [Fake("autoregressive"), Fake("other", interrupt_on=ord("y") - ord("a"))],
                    conversation(), s, 4)
    on_disk = json.loads((tmp_path / "bench.json").read_text())["records"]
    assert [(r["prompt_id"], r["system"]) for r in on_disk] == [("1", "autoregressive"), ("1", "other")]
    calls = []
    resumed = store(tmp_path, resume=True)
    run_records(ITEMS, [Fake("autoregressive", calls=calls), Fake("other", calls=calls)], conversation(), resumed, 4)
    assert [(label, ids[0]) for label, ids in calls] == [("other", 24), ("other", 24), ("autoregressive", 24),
                                                          ("autoregressive", 24), ("autoregressive", 22), ("other", 22)]
    assert len(resumed.records) == 6


def test_resume_retries_errors_and_refuses_other_settings(tmp_path):
    s = store(tmp_path)
    run_records(ITEMS[:1], [Fake("autoregressive", fail_on=23)], conversation(), s, 4)
    assert s.records[0]["error"]
    assert store(tmp_path, resume=True).done == set()  # errors are run again
    with pytest.raises(ConfigError, match="already exists"):
        store(tmp_path)
    with pytest.raises(ConfigError, match="max_new_tokens: 4 there, 8 now"):
        RecordStore(tmp_path, {"model": "m", "max_new_tokens": 8}, resume=True)


def test_repeats_are_separate_records(tmp_path):
    s = store(tmp_path)
    run_records(ITEMS[:1], [Fake("autoregressive"), Fake("other")], conversation(), s, 4, repeats=2)
    assert sorted((r["system"], r["repeat"]) for r in s.records) == [
        ("autoregressive", 0), ("autoregressive", 1), ("other", 0), ("other", 1)]


def test_plain_text_conversation_concatenates_turns():
    seen = []
    conv = Conversation(lambda p, chat=None: seen.append(p) or [1], lambda ids: " A.", chat=False)
    conv.run(Fake("s"), ["Q1?", "Q2?"], 4)
    assert seen == ["Q1?", "Q1? A.\n\nQ2?"]


def test_system_labels_name_only_the_knobs_that_differ_from_the_defaults():
    from specfree.bench.systems import SpecfreeSystem
    from tests.tiny_models import tiny_model

    def label(strategy, knobs):
        return SpecfreeSystem.build(tiny_model("llama"), None, strategy, knobs).label

    # a config gives lists where the factory's default is a tuple: still the default
    assert label("hybrid", {"drafters": ["prompt_lookup", "suffix"]}) == "hybrid"
    assert label("hybrid", {"drafters": ["prompt_lookup"]}) == "hybrid(drafters=['prompt_lookup'])"
    assert label("prompt_lookup", {"draft_len": 4}) == "prompt_lookup(draft_len=4)"


def test_one_bench_runs_a_strategy_priced_and_unpriced_as_two_systems():
    from specfree.bench.runner import SystemSpec, build_systems
    from tests.tiny_models import tiny_model

    specs = [SystemSpec("trie", {"priced": True}), SystemSpec("trie", {"priced": False})]
    systems = build_systems(tiny_model("llama"), None, specs, [])
    assert [s.label for s in systems] == ["autoregressive", "trie", "trie(priced=False)"]
    assert [s.engine.priced for s in systems] == [True, True, False]
    assert systems[2].params["priced"] is False and systems[1].params["priced"] is True


def test_the_strategies_of_one_bench_price_on_one_curve(monkeypatch):
    """Each engine reading (and checking) the cached curve on its own gave the systems of one run
    curves measured minutes apart, 8 rows at 1.35x to 1.73x one row on one VM (run AA): the run's
    first priced engine gets the curve, and every other strategy a copy of it."""
    from specfree.bench.runner import SystemSpec, build_systems
    from specfree.cost import CostModel
    from tests.tiny_models import tiny_model

    read = []

    def one_read(cls, adapter, cache_dir):
        read.append(adapter)
        return CostModel([1, 8], [1.0, 1.5 + len(read)])

    monkeypatch.setattr(CostModel, "cached", classmethod(one_read))
    specs = [SystemSpec("prompt_lookup", {}), SystemSpec("suffix", {}), SystemSpec("trie", {"priced": False})]
    systems = build_systems(tiny_model("llama"), None, specs, [])
    first, second = systems[1].engine.costs, systems[2].engine.costs
    assert len(read) == 1 and first.as_dict() == second.as_dict() and first is not second
    assert systems[3].engine.costs is None  # an unpriced strategy prices on nothing
