"""Composition through config: hybrid members built by name with their own knobs (built-ins,
lookahead with its window, a third-party plugin's drafter), pools by name, mask builders."""

from __future__ import annotations

import ast
import importlib
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specfree import ConfigError, Engine
from specfree.config import build_strategy, compose
from specfree.cost import CostModel
from specfree.masks.tree import build_layout
from specfree.plugins import build_plugin_manager, registry
from specfree.pools.lru import LRUNGramPool
from specfree.pools.prompt_index import PromptIndex
from specfree.pools.suffix_array import SuffixArrayPool
from specfree.pools.trie import TriePool
from specfree.pricer import Pricer
from specfree.pricing import Plan
from specfree.strategies.base import Outcome, Strategy
from specfree.strategies.hybrid import MEMBER_DEFAULTS, Hybrid
from specfree.strategies.lookahead import Lookahead
from specfree.strategies.prompt_lookup import PromptLookup
from specfree.types import AuxBlock, Proposal, Verdict
from tests.helpers import EXAMPLE_PLUGIN, REPO, run_cli
from tests.tiny_models import reference_greedy, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")
SETTINGS = settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(scope="module")
def plugin_registry():
    """Built-ins plus the example plugin (its drafter ``repeat_last``), as a program registers it."""
    sys.path.insert(0, str(EXAMPLE_PLUGIN))
    try:
        module = importlib.import_module("specfree_example.plugin")
    finally:
        sys.path.remove(str(EXAMPLE_PLUGIN))
    return registry(build_plugin_manager(extra_plugins=(module,), entry_points=False))


# ---- members built by name, with their own knobs -------------------------------------------
def test_members_are_built_through_the_registry_with_their_own_knobs(plugin_registry):
    hybrid = plugin_registry.make("strategy", "hybrid", drafters=[
        "prompt_lookup", {"name": "lookahead", "window": 3, "ngram": 4}, {"name": "trie", "decoding_length": 5},
        {"name": "repeat_last", "k": 3}, {"name": "prompt_lookup", "draft_len": 2}])
    plain, window, trie, plugin, short = hybrid.drafters
    assert isinstance(window, Lookahead) and (window.window, window.ngram) == (3, 4)
    assert window.idle_every == MEMBER_DEFAULTS["lookahead"]["idle_every"]  # the hybrid's default for it
    assert plain.draft_len == MEMBER_DEFAULTS["prompt_lookup"]["draft_len"] and short.draft_len == 2
    assert trie.decoding_length == 5 and trie.branch_length == MEMBER_DEFAULTS["trie"]["branch_length"]
    assert type(plugin).__name__ == "RepeatLast" and plugin.k == 3
    # Two members of one name stay apart in the learned rates and the step records.
    assert hybrid.labels == ["prompt_lookup", "lookahead", "trie", "repeat_last", "prompt_lookup#2"]


def test_a_member_names_its_pool(plugin_registry):
    hybrid = plugin_registry.make("strategy", "hybrid", drafters=[
        {"name": "lookahead", "pool": "trie"}, {"name": "lookahead", "pool": {"name": "lru", "ngram": 5}},
        {"name": "prompt_lookup", "pool": "suffix_array"}])
    trie, lru, lookup = hybrid.drafters
    assert isinstance(trie.pool, TriePool) and isinstance(lru.pool, LRUNGramPool) and lru.pool.ngram == 5
    assert isinstance(lookup.pool, PromptIndex)


def test_engine_from_pretrained_style_knobs_and_configs_build_the_same_members(plugin_registry):
    drafters = ["prompt_lookup", {"name": "lookahead", "window": 2}]
    engine = Engine.from_model(tiny_model("llama"), None, "hybrid", drafters=drafters)
    assert [type(d) for d in engine.strategy.drafters] == [PromptLookup, Lookahead]
    cfg = compose(["strategy=hybrid", "strategy.drafters=[prompt_lookup,{name: lookahead, window: 2}]"],
                  plugin_registry)
    built = build_strategy(cfg, plugin_registry)
    assert [type(d) for d in built.drafters] == [PromptLookup, Lookahead] and built.drafters[1].window == 2


# ---- lossless with any member mix ----------------------------------------------------------
MEMBERS = st.sampled_from([
    "prompt_lookup", "trie", "recycling", "lookahead", "repeat_last",
    {"name": "lookahead", "window": 3, "ngram": 4, "guesses": 3},
    {"name": "lookahead", "idle_every": 0, "pool": "trie"},
    {"name": "repeat_last", "k": 5},
    {"name": "prompt_lookup", "max_ngram": 2, "draft_len": 4, "pool": "suffix_array"},
])


@SETTINGS
@given(family=st.sampled_from(["llama", "gpt2", "qwen2", "gemma3_text", "falcon"]),
       drafters=st.lists(MEMBERS, min_size=1, max_size=4).filter(
           lambda ds: any("lookahead" in str(d) or "repeat_last" in str(d) for d in ds)),
       max_rows=st.integers(1, 40), pattern=st.lists(st.integers(3, 127), min_size=1, max_size=5),
       repeats=st.integers(1, 5), max_new=st.integers(1, 30))
def test_the_hybrid_with_lookahead_and_a_plugin_drafter_is_plain_greedy(plugin_registry, family, drafters, max_rows,
                                                                        pattern, repeats, max_new):
    model = tiny_model(family)
    strategy = plugin_registry.make("strategy", "hybrid", drafters=drafters, max_rows=max_rows)
    engine = Engine.from_model(model, None, strategy)
    prompt = (pattern * repeats)[:40]
    for _ in range(2):  # a second request meets the pools and rates the first one filled
        result = engine.generate(prompt, max_new, ignore_eos=True)
        assert result.tokens == reference_greedy(model, prompt, max_new, ignore_eos=True)
        # Every accepted draft token is credited to one member, by its label.
        assert set(result.accepted_by) <= set(strategy.labels)
        assert sum(result.accepted_by.values()) == sum(s.accepted for s in result.steps)


# ---- aux rows inside the hybrid ------------------------------------------------------------
class Window(Strategy):
    """Asks for a fixed number of aux rows every step and records the logits it is handed."""

    name = "window"

    def __init__(self, rows: int):
        self.block = AuxBlock(list(range(10, 10 + rows)), list(range(1, rows + 1)),
                              torch.ones(rows, rows, dtype=torch.bool).tril())
        self.seen: list[torch.Tensor | None] = []

    def propose(self, context, max_depth):
        return Proposal([], self.name, self.block)

    def observe(self, outcome):
        self.seen.append(outcome.aux_logits)


class Fixed(Strategy):
    name = "fixed"

    def propose(self, context, max_depth):
        return Proposal([[1, 2, 3]], self.name)


def hybrid_with_windows(*rows: int) -> Hybrid:
    hybrid = Hybrid([Fixed(), *[Window(r) for r in rows]])
    hybrid.begin(np.array([4, 5, 6]))
    return hybrid


def step(hybrid: Hybrid, pricer: Pricer) -> tuple[Proposal, Plan]:
    """One engine step without a model: price, hand each member its window's logits, learn."""
    proposal = hybrid.propose(np.array([4, 5, 6]), max_depth=8)
    plan = pricer.plan(6, proposal, max_depth=8)
    aux_rows = plan.rows - len(plan.tree)
    logits = torch.cat([torch.full((len(plan.tree), 2), -1.0), torch.arange(aux_rows * 2.0).reshape(-1, 2)])
    verdict = Verdict([7], [])
    hybrid.observe(Outcome(plan.tree, verdict, np.array([4, 5, 6, 7]), None, logits[: len(plan.tree)],
                           plan.aux_logits(logits)))
    pricer.observe(proposal, plan, verdict.tokens, 0)
    return proposal, plan


def test_aux_rows_pass_through_and_each_member_gets_only_its_own_logits():
    hybrid = hybrid_with_windows(2, 3)
    proposal, plan = step(hybrid, Pricer(CostModel([1, 2, 64], [1.0, 1.0, 1.0])))  # rows free: every window pays
    assert [owner for owner, _ in plan.parts] == ["window", "window#2"] and plan.windows == [0, 1]
    stacked = plan.aux
    assert stacked.tokens == [10, 11, 10, 11, 12] and plan.rows == 1 + 3 + 5  # root, [1, 2, 3], both windows
    assert not stacked.attends[2:, :2].any() and not stacked.attends[:2, 2:].any()  # blocks apart
    first, second = hybrid.drafters[1].seen[0], hybrid.drafters[2].seen[0]
    assert first.tolist() == [[0, 1], [2, 3]] and second.tolist() == [[4, 5], [6, 7], [8, 9]]


def test_a_window_that_does_not_pay_is_dropped_and_its_member_told():
    hybrid = hybrid_with_windows(4)
    _, plan = step(hybrid, Pricer(CostModel([1, 2, 64], [1.0, 10.0, 400.0])))  # every extra row costs a forward
    assert plan.windows == [] and plan.rows == 1  # a plain one-row step
    assert hybrid.drafters[1].seen == [None]  # the member knows its window was not decoded


def test_a_window_is_dropped_once_its_member_stops_landing_drafts():
    hybrid = hybrid_with_windows(5)
    pricer = Pricer(CostModel([1, 2, 8, 16], [1.0, 1.6, 1.8, 2.0]))  # a CPU-like curve
    decoded = [bool(step(hybrid, pricer)[1].windows) for _ in range(30)]  # the window's member never lands a draft
    assert decoded[0] and not decoded[-1]


def test_lookahead_inside_the_hybrid_runs_its_window_when_it_pays():
    model = tiny_model("llama")
    engine = Engine.from_model(model, None, "hybrid", drafters=["prompt_lookup", "lookahead"],
                               costs=CostModel([1, 2, 64], [1.0, 1.0, 1.0]))  # rows free: the window always pays
    prompt = [5, 6, 7, 8] * 3
    result = engine.generate(prompt, 30, ignore_eos=True)
    assert result.tokens == reference_greedy(model, prompt, 30, ignore_eos=True)
    windows = [s.extra["lookahead.window"] for s in result.steps]
    assert all(w > 0 for w in windows[:-1])  # decoded every step (the last has nothing left to draft)
    assert all(s.rows == 1 + s.drafted + w for s, w in zip(result.steps, windows))  # root, tree and window rows
    assert any(s.drafted and w for s, w in zip(result.steps, windows))  # both in one forward


# ---- pools by name ------------------------------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(prompt=st.lists(st.integers(0, 6), min_size=1, max_size=60), output=st.lists(st.integers(0, 6), max_size=30),
       max_ngram=st.integers(1, 5), match=st.sampled_from(["recent", "longest", "frequent"]))
def test_prompt_lookup_over_a_suffix_array_drafts_exactly_what_the_scan_drafts(prompt, output, max_ngram, match):
    knobs = dict(max_ngram=max_ngram, min_ngram=1, draft_len=6, num_candidates=3, match=match)
    scan, indexed = PromptLookup(**knobs), PromptLookup(**knobs, pool=PromptIndex())
    scan.begin(np.array(prompt))
    indexed.begin(np.array(prompt))
    for end in range(len(prompt), len(prompt) + len(output) + 1):
        context = np.array(prompt + output)[:end]
        a, b = scan.propose(context, 8), indexed.propose(context, 8)
        assert (a.candidates, a.labels) == (b.candidates, b.labels)


@settings(max_examples=100, deadline=None)
@given(context=st.lists(st.integers(0, 3), min_size=2, max_size=60), max_ngram=st.integers(1, 4),
       candidates=st.integers(1, 5))
def test_recent_matches_are_the_newest_distinct_continuations_of_the_longest_matched_ngram(context, max_ngram,
                                                                                          candidates):
    lookup = PromptLookup(max_ngram=max_ngram, min_ngram=1, draft_len=4, num_candidates=candidates)
    lookup.begin(np.array(context[:1]))
    proposal = lookup.propose(np.array(context), 8)
    for n in range(min(max_ngram, len(context) - 1), 0, -1):
        starts = [i for i in range(len(context) - n) if context[i : i + n] == context[-n:]][::-1]
        if starts:
            continuations = list(dict.fromkeys(tuple(context[s + n : s + n + 4]) for s in starts))[:candidates]
            assert proposal.candidates == [list(c) for c in continuations]
            return
    assert not proposal.candidates


@settings(max_examples=100, deadline=None)
@given(context=st.lists(st.integers(0, 3), min_size=1, max_size=40), n=st.integers(1, 5), start=st.integers(0, 8))
def test_the_scan_finds_every_earlier_window_equal_to_the_last_n_tokens_newest_first(context, n, start):
    from specfree.strategies.prompt_lookup import _scan

    brute = [i for i in range(start, len(context) - n) if context[i : i + n] == context[-n:]][::-1]
    assert _scan(np.array(context), n, start).tolist() == brute


@pytest.fixture(scope="module")
def tiny_datastore(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("composition") / "store.sfds"
    SuffixArrayPool.build([np.array([5, 6, 7] * 10)]).save(path)
    return str(path)


def test_the_pool_group_reaches_the_built_in_drafters(tiny_datastore):
    reg = registry(build_plugin_manager())
    built = lambda *overrides: build_strategy(compose(list(overrides), reg), reg)  # noqa: E731
    assert isinstance(built("strategy=lookahead", "pool=trie").pool, TriePool)
    assert built("strategy=lookahead", "pool=lru", "pool.max_keys=7").pool.max_keys == 7
    assert built("strategy=trie", "pool=trie", "pool.max_nodes=77").pool.max_nodes == 77
    assert isinstance(built("strategy=prompt_lookup", "pool=suffix_array").pool, PromptIndex)
    assert len(built("strategy=retrieval", "pool=suffix_array", f"pool.path={tiny_datastore}").pool) == 30


@pytest.mark.parametrize("overrides, message", [
    (["strategy=prompt_lookup", "pool=lru"], "prompt_lookup copies from the context itself; the one pool it takes is "
                                             "pool=suffix_array without pool.path"),
    (["strategy=lookahead", "pool=suffix_array"], "lookahead learns n-grams from its window into a pool that keeps "
                                                  "them: use pool=lru or pool=trie, got PromptIndex"),
    (["strategy=trie", "pool=lru"], "the trie strategy drafts from a token trie: use pool=trie"),
    (["strategy=retrieval", "pool=trie"], "retrieval drafts from a datastore: give strategy.datastore=PATH"),
    (["strategy=recycling", "pool=trie"], "strategy 'recycling' does not take a pool from the pool group; "
                                          "remove pool=trie"),
    (["strategy=retrieval", "pool=suffix_array", "pool.path=/no/such.sfds"],
     "^pool=suffix_array: datastore file not found: /no/such.sfds"),
])
def test_a_pool_that_makes_no_sense_for_the_drafter_is_one_line(overrides, message):
    reg = registry(build_plugin_manager())
    with pytest.raises(ConfigError, match=message) as info:
        build_strategy(compose(overrides, reg), reg)
    assert "\n" not in str(info.value)


# ---- mask builders ------------------------------------------------------------------------
class CountingMask:
    from specfree.hookspecs import hookimpl

    calls = 0

    @hookimpl
    def specfree_register(self, registry):
        def counting(offset_check: bool = True):
            def build(tree, aux, root_position):
                CountingMask.calls += 1
                return build_layout(tree, aux, root_position)
            return build
        registry.add("mask", "counting", counting)


def test_the_mask_builder_is_chosen_through_config(tiny_llama_dir):
    model = {"name": "local", "path": str(tiny_llama_dir)}
    engine = Engine.from_config({"model": model}, overrides=["mask=counting"], plugins=[CountingMask()])
    before = CountingMask.calls
    result = engine.generate("the cat the cat the cat", 8)
    assert CountingMask.calls - before == result.forwards
    assert Engine.from_config({"model": model}).mask_builder is build_layout  # mask=tree, the default
    with pytest.raises(ConfigError, match="^unknown mask 'nope'; available: tree$"):
        Engine.from_config({"model": model}, overrides=["mask=nope"])


# ---- the CLI and from_config with the plugin inside the hybrid ------------------------------
def test_the_cli_composes_lookahead_and_a_plugin_drafter_inside_the_hybrid(example_plugin_paths, tiny_llama_dir,
                                                                           tmp_path):
    env = {"PYTHONPATH": os.pathsep.join([*example_plugin_paths, os.environ.get("PYTHONPATH", "")])}
    done = run_cli("decode", "strategy=hybrid",
                   "strategy.drafters=[prompt_lookup,{name: lookahead, window: 2, pool: trie},"
                   "{name: repeat_last, k: 3}]",
                   "model=local", f"model.path={tiny_llama_dir}", "prompt=the cat the cat the cat", "max_new_tokens=12",
                   "ignore_eos=true", f"output={tmp_path / 'r.json'}", f"hydra.run.dir={tmp_path / 'run'}",
                   env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "accepted drafts by member: prompt_lookup " in done.stderr and " · repeat_last " in done.stderr
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["strategy"]["drafters"][2] == {"name": "repeat_last", "k": 3}
    assert set(result["summary"]["accepted_by"]) <= {"prompt_lookup", "lookahead", "repeat_last"}
    bad = run_cli("decode", "strategy=hybrid", "strategy.drafters=[prompt_lookup,{name: lookahead, window: wide}]",
                  "prompt=hi", env=env, cwd=tmp_path)
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [
        "error: hybrid.drafters[1] (lookahead): window: expected int, got 'wide'"]


def test_engine_from_config_uses_the_plugin_drafter_inside_the_hybrid(plugin_registry, tiny_llama_dir):
    module = sys.modules["specfree_example.plugin"]
    model = {"name": "local", "path": str(tiny_llama_dir)}
    engine = Engine.from_config({"model": model, "strategy": {"name": "hybrid", "drafters": [
        "trie", {"name": "repeat_last", "k": 4}, "lookahead"]}}, plugins=[module])
    assert [d.name for d in engine.strategy.drafters] == ["trie", "repeat_last", "lookahead"]
    plain = Engine.from_config({"model": model, "strategy": {"name": "autoregressive"}})
    prompt = "the the the the cat cat cat"
    assert engine.generate(prompt, 16).tokens == plain.generate(prompt, 16).tokens


def test_plugins_lists_which_strategies_can_be_hybrid_members():
    out = subprocess.run([sys.executable, "-m", "specfree", "plugins"], capture_output=True, text=True,
                         env={**os.environ, "COLUMNS": "250"})
    rows = {line.split("│")[2].strip(): line for line in out.stdout.splitlines() if line.count("│") > 4}
    assert "no (holds members)" in rows["hybrid"] and "│ yes" in rows["lookahead"]


def specfree_imports() -> dict[str, set[str]]:
    """Module -> the specfree modules it imports anywhere (in functions and TYPE_CHECKING blocks too)."""
    root = REPO / "specfree"
    names = {".".join(p.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__"): p
             for p in root.rglob("*.py")}
    graph = {}
    for name, path in names.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:
                found |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in names else node.module
                          for a in node.names}
        graph[name] = {m for m in found if m in names and m != "specfree"}  # the package's __init__ re-exports
    return graph


def test_no_module_imports_itself_through_others():
    """No import circles (plugins -> builtin -> hookspecs -> plugins and config <-> engine were two)."""
    graph = specfree_imports()
    assert "specfree.plugins" not in graph["specfree.hookspecs"] and "specfree.engine" not in graph["specfree.config"]
    done: set[str] = set()

    def visit(module: str, path: tuple[str, ...]) -> None:
        if module in path:
            raise AssertionError("import circle: " + " -> ".join(path[path.index(module):] + (module,)))
        if module not in done:
            for imported in sorted(graph[module]):
                visit(imported, path + (module,))
            done.add(module)

    for module in sorted(graph):
        visit(module, ())
