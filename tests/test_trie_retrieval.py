"""Trie and retrieval drafting: lossless, learning across requests, datastore files."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specfree import ConfigError, Engine
from specfree.bench.prompts import PromptItem
from specfree.datastore import answer_prompts, answers_path, build_datastore
from specfree.datastore import main as datastore_command
from specfree.pools import PoolFileError
from tests.test_lossless import prompts
from tests.tiny_models import FAMILIES, reference_greedy, tiny_model, tiny_tokenizer

SETTINGS = settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def trie_knobs(draw) -> dict:
    return dict(decoding_length=draw(st.integers(1, 24)), branch_length=draw(st.integers(1, 10)),
                max_query_length=draw(st.integers(1, 6)), max_nodes=draw(st.integers(8, 400)),
                persist=draw(st.booleans()))


@SETTINGS
@given(family=st.sampled_from(FAMILIES), requests=st.lists(prompts(), min_size=1, max_size=3),
       knobs=trie_knobs(), max_new=st.integers(1, 30))
def test_trie_greedy_is_lossless_across_requests(family, requests, knobs, max_new):
    model = tiny_model(family)
    engine = Engine.from_model(model, None, "trie", **knobs)
    for prompt in requests:  # the pool persists between these requests when persist=True
        assert engine.generate(prompt, max_new).tokens == reference_greedy(model, prompt, max_new)
        assert len(engine.strategy.pool) <= knobs["max_nodes"]


@SETTINGS
@given(family=st.sampled_from(FAMILIES), prompt=prompts(), knobs=trie_knobs(), seed=st.integers(0, 10**6))
def test_trie_seeded_sampling_matches_autoregressive(family, prompt, knobs, seed):
    model = tiny_model(family)
    sampling = dict(do_sample=True, seed=seed, temperature=0.7, top_k=10)
    speculative = Engine.from_model(model, None, "trie", **knobs, **sampling).generate(prompt, 25)
    plain = Engine.from_model(model, None, "autoregressive", **sampling).generate(prompt, 25)
    assert speculative.tokens == plain.tokens


def test_warm_trie_accepts_more_on_a_repeated_request():
    model = tiny_model("llama")
    engine = Engine.from_model(model, None, "trie", persist=True)
    cold = engine.generate([5, 9, 11], 60, ignore_eos=True)
    warm = engine.generate([5, 9, 11], 60, ignore_eos=True)  # the trie now holds the first answer
    assert warm.tokens == cold.tokens
    assert warm.forwards < cold.forwards


@pytest.fixture(scope="module")
def datastore(tmp_path_factory):
    tokenizer = tiny_tokenizer()
    folder = tmp_path_factory.mktemp("ds")
    corpus = folder / "corpus.jsonl"
    rows = [{"text": "the cat sat on the red car and the dog ran to the big house"},
            {"turns": ["the sun is hot", "the moon is cold and the sky is blue"]},
            {"other": 5}]
    corpus.write_text("\n".join(json.dumps(r) for r in rows))
    (folder / "notes.txt").write_text("one two three four five\n\nsix seven eight nine ten")
    out = folder / "store.sfds"
    stats = build_datastore([corpus, folder / "notes.txt"], tokenizer, out)
    assert stats.documents == 4 and stats.tokens > 30 and out.stat().st_size == stats.file_bytes
    return out, tokenizer


@SETTINGS
@given(family=st.sampled_from(FAMILIES), prompt=prompts(), max_nodes=st.integers(1, 16),
       max_depth=st.integers(1, 8), max_new=st.integers(1, 30))
def test_retrieval_greedy_is_lossless(datastore, family, prompt, max_nodes, max_depth, max_new):
    model = tiny_model(family)
    engine = Engine.from_model(model, None, "retrieval", datastore=str(datastore[0]), max_nodes=max_nodes,
                               max_depth=max_depth)
    assert engine.generate(prompt, max_new).tokens == reference_greedy(model, prompt, max_new)


def test_retrieval_drafts_from_the_datastore(datastore):
    path, tokenizer = datastore
    model = tiny_model("llama")
    engine = Engine.from_model(model, tokenizer, "retrieval", datastore=str(path))
    proposal = engine.strategy.propose(__import__("numpy").array(tokenizer("the cat sat on").input_ids), 8)
    assert tokenizer.decode(proposal.candidates[0]).startswith("the red car")


def test_retrieval_errors(datastore, tmp_path):
    model = tiny_model("llama")
    with pytest.raises(ConfigError, match="strategy=retrieval needs a datastore file"):
        Engine.from_model(model, None, "retrieval")
    with pytest.raises(ConfigError, match="datastore file not found: .*nope.sfds"):
        Engine.from_model(model, None, "retrieval", datastore=str(tmp_path / "nope.sfds"))
    broken = tmp_path / "broken.sfds"
    broken.write_bytes(datastore[0].read_bytes()[:100])
    with pytest.raises(PoolFileError, match="broken.sfds"):
        Engine.from_model(model, None, "retrieval", datastore=str(broken))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\nnot json\n')
    with pytest.raises(ConfigError, match="bad.jsonl:2: not valid JSON"):
        build_datastore([bad], datastore[1], tmp_path / "x.sfds")
    # Checked before the tokenizer loads: a missing input fails at once.
    with pytest.raises(ConfigError, match=f"^datastore input not found: {tmp_path / 'nope.jsonl'}$"):
        datastore_command(["build", f"input={bad},{tmp_path / 'nope.jsonl'}", f"out={tmp_path / 'y.sfds'}"])


def test_the_models_own_answers_are_kept_and_a_stopped_run_resumes(tmp_path):
    model, tokenizer = tiny_model("llama"), tiny_tokenizer()
    engine = Engine.from_model(model, tokenizer, "prompt_lookup")
    prompts = [PromptItem(id=str(k), category="all", turns=[text, "a second turn is not answered"])
               for k, text in enumerate(["the cat sat", "the sun is hot", "one two three"])]
    answers = answers_path(tmp_path / "self.sfds")
    assert answers.name == "self.answers.jsonl"
    setup = {"model": "tiny llama"}
    assert answer_prompts(engine, prompts[:2], answers, 12, chat=False, setup=setup) == 2
    assert answer_prompts(engine, prompts, answers, 12, chat=False, setup=setup) == 1  # only the new one
    rows = [json.loads(line) for line in answers.read_text().splitlines()]
    assert [row["id"] for row in rows] == ["0", "1", "2"]
    for row, item in zip(rows, prompts):
        plain = Engine.from_model(model, tokenizer, "autoregressive").generate(item.turns[0], 12, chat=False)
        assert row["text"] == plain.text
    # Answers of another length (or model, or template) are not mixed in: the file is named, with the fix.
    with pytest.raises(ConfigError, match="self.answers.jsonl:1 holds answers made with .*delete the file"):
        answer_prompts(engine, prompts, answers, 20, chat=False, setup=setup)


def test_answers_checks_the_answers_file_before_the_model_loads(tmp_path):
    # The folder holds only a tokenizer: loading a model from it would fail, so passing here shows
    # that a foreign answers file is refused, and an answered prompt file indexed, without the model.
    folder = tmp_path / "tokenizer-only"
    tiny_tokenizer().save_pretrained(folder)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "0", "prompt": "the cat sat"}) + "\n")
    out = tmp_path / "self.sfds"
    args = ["answers", f"prompts={prompts}", f"out={out}", f"model={folder}", "max_new_tokens=4", "chat=false"]
    row = {"id": "0", "text": "on the mat", "setup": {"model": str(folder), "max_new_tokens": 8, "chat": False}}
    answers_path(out).write_text(json.dumps(row) + "\n")
    with pytest.raises(ConfigError, match="self.answers.jsonl:1 holds answers made with .*max_new_tokens': 8"):
        datastore_command(args)
    row["setup"]["max_new_tokens"] = 4
    answers_path(out).write_text(json.dumps(row) + "\n")
    assert datastore_command(args) == 0
    assert out.is_file()


@pytest.mark.parametrize("args, message", [
    (["answers", "prompts=p.jsonl"], "datastore answers needs prompts= and out="),
    (["answers", "prompts=p.jsonl", "out=s.sfds", "limit=0"], "limit must be a whole number of at least 1"),
    (["answers", "prompts=p.jsonl", "out=s.sfds", "max_new_tokens=many"], "max_new_tokens must be a whole number"),
    (["answers", "prompts=p.jsonl", "out=s.sfds", "chat=maybe"], "chat must be true or false"),
    (["answers", "input=p.jsonl", "out=s.sfds"], "datastore answers: unexpected argument 'input=p.jsonl'"),
    (["answers", "prompts=/no/such.jsonl", "out=s.sfds"], "datastore answers: prompt file not found: /no/such.jsonl"),
    (["rebuild"], "usage: python -m specfree datastore build"),
])
def test_datastore_command_errors_name_the_fix(args, message):
    with pytest.raises(ConfigError, match=message):
        datastore_command(args)
