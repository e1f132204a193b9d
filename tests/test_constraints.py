"""Structured output is lossless: under a JSON schema, a regex or a grammar, every strategy (priced
and unpriced, alone and batched) gives the tokens of constrained plain decoding, the model's logits
masked to the allowed tokens at each position, then argmax or the seeded sampler."""

from __future__ import annotations

import json

import llguidance
import llguidance.hf
import llguidance.torch
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specfree import Engine
from specfree.adapters import as_shipped
from specfree.batching import Batch
from specfree.constraints import Constraint, Grammars
from specfree.cost import CostModel
from specfree.errors import ConfigError
from tests.test_batching import drive
from tests.test_lossless import drafter_specs
from tests.tiny_models import EOS, VOCAB, tiny_json_tokenizer, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")
SETTINGS = settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
CPU_LIKE = CostModel([1, 2, 4, 8, 16, 32], [1.0, 1.2, 1.5, 1.8, 2.0, 2.4])
FAMILIES = ["llama", "gpt2", "qwen3"]
KEYS = ["a", "b", "abc", "null", "name"]


def leaf_schemas():
    return st.one_of(
        st.just({"type": "boolean"}), st.just({"type": "null"}),
        st.builds(lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
                  st.integers(-50, 50), st.integers(0, 500)),
        st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(0, 6)),
        st.builds(lambda values: {"enum": values}, st.lists(st.sampled_from(["ab", "abc", "true", 1, None]),
                                                            min_size=1, max_size=3, unique=True)))


def schemas():
    """Small schemas: objects of a few keys (some optional), arrays, leaves, nested at most twice."""
    def containers(inner):
        objects = st.builds(
            lambda props, optional: {"type": "object", "properties": props, "additionalProperties": False,
                                     "required": [k for k in props if k not in optional]},
            st.dictionaries(st.sampled_from(KEYS), inner, min_size=1, max_size=3),
            st.sets(st.sampled_from(KEYS), max_size=2))
        arrays = st.builds(lambda items, n: {"type": "array", "items": items, "maxItems": n}, inner,
                           st.integers(0, 3))
        return st.one_of(objects, arrays)
    return st.recursive(leaf_schemas(), containers, max_leaves=4)


REGEX_PIECES = ["[a-c]{1,4}", "(ab|ca)+", "x?", "[0-9]{2}", "(true|false)", " ", "\\{\"[ab]\": [0-9]\\}", "n+u"]


@st.composite
def constraints(draw) -> dict:
    kind = draw(st.sampled_from(["json_schema", "regex", "json_object", "grammar"]))
    if kind == "json_schema":
        return {"json_schema": draw(schemas())}
    if kind == "regex":
        return {"regex": "".join(draw(st.lists(st.sampled_from(REGEX_PIECES), min_size=1, max_size=4)))}
    if kind == "grammar":  # llama.cpp's GBNF
        word = draw(st.sampled_from(['"ab"', '"true"', '[a-c]+', '"x" [0-9]*']))
        return {"grammar": f'root ::= "{{" item ("," item)* "}}"\nitem ::= {word}'}
    return {"json_object": True}


@st.composite
def texts(draw) -> list[int]:
    """Prompts that hold JSON-like text (so lookup drafts meet what the grammar allows), tokenized."""
    pieces = draw(st.lists(st.sampled_from(['{"a": ', 'true', ', "abc": ', '12', 'null', '}', 'ab', ' ', '"name"']),
                           min_size=1, max_size=8))
    return tiny_json_tokenizer()("".join(pieces)).input_ids


def reference(model, prompt: list[int], max_new: int, options: dict) -> list[int]:
    """Constrained plain greedy decoding, written apart from specfree's loop: a whole forward per
    token, llguidance's mask applied to the logits, argmax; the answer ends at EOS or where the
    grammar is complete."""
    tokenizer = tiny_json_tokenizer()
    matcher = llguidance.LLMatcher(llguidance.hf.from_tokenizer(tokenizer, n_vocab=VOCAB, eos_token=EOS),
                                   Grammars(tokenizer, VOCAB, {EOS}).compiled(Constraint.from_options(**options)),
                                   log_level=0)
    bits = llguidance.torch.allocate_token_bitmask(1, VOCAB)
    ids, out = list(prompt), []
    with torch.no_grad(), as_shipped(model):
        while len(out) < max_new:
            logits = model(torch.tensor([ids])).logits[0, -1].float()
            llguidance.torch.fill_next_token_bitmask(matcher, bits)
            allowed = ((bits[0, torch.arange(VOCAB) // 32] >> (torch.arange(VOCAB) % 32)) & 1).bool()
            token = int(logits.masked_fill(~allowed, float("-inf")).argmax())
            out.append(token)
            ids.append(token)
            assert matcher.consume_token(token)
            if token == EOS or matcher.is_stopped():
                break
    return out


def engine(family: str, name: str, knobs: dict, **extra) -> Engine:
    return Engine.from_model(tiny_model(family), tiny_json_tokenizer(), name, costs=CPU_LIKE, **knobs, **extra)


@SETTINGS
@given(family=st.sampled_from(FAMILIES), spec=drafter_specs(), priced=st.booleans(), prompt=texts(),
       options=constraints(), max_new=st.integers(1, 30))
def test_every_strategy_under_a_constraint_is_constrained_plain_greedy(family, spec, priced, prompt, options,
                                                                       max_new):
    name, knobs = spec
    result = engine(family, name, knobs, priced=priced).generate(prompt, max_new, **options)
    assert result.tokens == reference(tiny_model(family), prompt, max_new, options)
    assert sum(s.emitted for s in result.steps) == len(result.tokens)


@SETTINGS
@given(family=st.sampled_from(FAMILIES), spec=drafter_specs(), prompt=texts(), options=constraints(),
       seed=st.integers(0, 2**31), temperature=st.floats(0.3, 1.5), top_k=st.integers(0, 40),
       top_p=st.floats(0.5, 1.0))
def test_every_strategy_under_a_constraint_is_constrained_plain_sampling(family, spec, prompt, options, seed,
                                                                         temperature, top_k, top_p):
    name, knobs = spec
    sampling = dict(do_sample=True, seed=seed, temperature=temperature, top_k=top_k, top_p=top_p)
    speculative = engine(family, name, knobs, **sampling).generate(prompt, 30, **options)
    plain = engine(family, "autoregressive", {}, **sampling).generate(prompt, 30, **options)
    assert speculative.tokens == plain.tokens


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(family=st.sampled_from(["llama", "gpt2"]), spec=drafter_specs(), priced=st.booleans(),
       requests=st.lists(st.tuples(texts(), st.one_of(st.none(), constraints())), min_size=2, max_size=4),
       do_sample=st.booleans(), seed=st.integers(0, 2**31))
def test_requests_with_different_constraints_batch_each_as_its_own(family, spec, priced, requests, do_sample, seed):
    name, knobs = spec
    sampling = dict(do_sample=True, temperature=0.8, top_k=20) if do_sample else {}
    batched = engine(family, name, knobs, priced=priced, **sampling)
    results = drive(Batch(batched, 3), [dict(prompt=p, max_new_tokens=24, seed=seed + i,
                                             constraint=Constraint.from_options(**(o or {})))
                                        for i, (p, o) in enumerate(requests)], [0, 1, 2, 3][: len(requests)])
    plain = engine(family, "autoregressive", {}, **sampling)
    for i, (prompt, options) in enumerate(requests):
        alone = plain.generate(prompt, 24, seed=seed + i, **(options or {}))
        assert results[i].tokens == alone.tokens
        assert results[i].stop_reason == alone.stop_reason


def test_an_answer_matches_its_schema_and_ends_where_the_grammar_is_complete():
    schema = {"type": "object", "properties": {"a": {"type": "boolean"}, "abc": {"enum": ["ab", 12]}},
              "required": ["a", "abc"], "additionalProperties": False}
    result = engine("llama", "hybrid", {}).generate(tiny_json_tokenizer()('{"a": true').input_ids, 60,
                                                    json_schema=json.dumps(schema))
    answer = json.loads(result.text)
    assert set(answer) == {"a", "abc"} and isinstance(answer["a"], bool) and answer["abc"] in ("ab", 12)
    assert result.stop_reason == "grammar"
    assert ", " in result.text  # the fixed layout: one space after ',' and ':'


@pytest.mark.parametrize("fill", ["ties", "nan", "random"])
def test_the_masks_argmax_is_the_masked_rows_argmax(fill):
    """``ConstraintMask.argmax`` (greedy's pick, off the allowed ids) against the masked row's
    ``argmax``, state after state of a JSON answer, ties and NaN included."""
    from specfree.constraints import ConstraintMask

    tokenizer = tiny_json_tokenizer()
    matcher = Grammars(tokenizer, VOCAB, {EOS}).matcher(Constraint.from_options(json_object=True))
    mask = ConstraintMask(matcher, prompt_len=0)
    answer = tokenizer('{"a": true, "abc": [12, null]}').input_ids
    generator = torch.Generator().manual_seed(1)
    for end in range(len(answer)):
        ids = torch.tensor([answer[:end]])
        scores = torch.randn(1, VOCAB, generator=generator)
        if fill == "ties":
            scores = scores.round()
        elif fill == "nan":
            scores[0, torch.randint(0, VOCAB, (3,), generator=generator)] = float("nan")
        assert mask.argmax(ids, scores[0].numpy()) == int(mask(ids, scores)[0].argmax())


def test_the_grammar_drafter_proposes_the_forced_text_and_it_is_accepted():
    schema = {"type": "object", "properties": {"name": {"type": "boolean"}, "abc": {"type": "null"}},
              "required": ["name", "abc"], "additionalProperties": False}
    result = engine("llama", "hybrid", {}, priced=False).generate(tiny_json_tokenizer()("ab").input_ids, 40,
                                                                  json_schema=schema)
    assert json.loads(result.text)["abc"] is None
    accepted = sum(step.sources.get("grammar", 0) for step in result.steps)
    assert accepted >= 4  # '{"', 'name', '":' ... come from the grammar, not the model one by one
    assert len(result.steps) < len(result.tokens)


def test_generate_batch_takes_one_constraint_per_prompt():
    tok = tiny_json_tokenizer()
    chosen = engine("llama", "hybrid", {})
    prompts = [tok("ab").input_ids, tok("12").input_ids, tok("x").input_ids]
    options = [{"regex": "[ab]+c"}, {"json_schema": {"type": "integer"}}, None]
    batched = chosen.generate_batch(prompts, 20, constraints=options)
    for prompt, option, result in zip(prompts, options, batched):
        assert result.tokens == chosen.generate(prompt, 20, **(option or {})).tokens
    shared = chosen.generate_batch(prompts, 20, regex="[0-9]+")
    assert all(r.text.isdigit() for r in shared)


@pytest.mark.parametrize("options, message", [
    ({"json_schema": "{not json"}, "json_schema is not valid JSON"),
    ({"json_schema": [1, 2]}, "json_schema must be a JSON object"),
    ({"json_schema": {"type": "string", "format": "no-such-format"}}, "json_schema does not compile: Unknown format"),
    ({"json_schema": {"type": "array", "uniqueItems": True}}, "Unimplemented keys: .*uniqueItems.*remove"),
    ({"json_schema": {"$ref": "#/nowhere"}}, "json_schema"),
    ({"regex": "a(b"}, "regex does not compile"),
    ({"grammar": "root ::= ( 'a'"}, "grammar does not compile"),
    ({"grammar": ""}, "grammar must be a non-empty string"),
    ({"regex": "a", "json_object": True}, "set one constraint per request"),
    ({"json_object": "yes"}, "json_object must be true or false"),
    ({"regex": "a" * (1 << 20 + 1)}, "more than the"),
])
def test_a_bad_constraint_is_one_clear_error(options, message):
    with pytest.raises(ConfigError, match=message) as caught:
        engine("llama", "autoregressive", {}).generate([5, 6], 4, **options)
    assert "\n" not in str(caught.value)


def test_a_constraint_needs_a_tokenizer():
    with pytest.raises(ConfigError, match="needs the model's tokenizer"):
        Engine.from_model(tiny_model("llama"), None, "autoregressive").generate([5, 6], 4, regex="a+")


def test_an_answer_cut_by_max_new_tokens_says_so():
    result = engine("llama", "hybrid", {}).generate([5, 6], 5, regex="[a-c]{20}")
    assert result.stop_reason == "max_new_tokens" and len(result.tokens) == 5


@pytest.fixture(scope="module")
def json_model_dir(tmp_path_factory):
    """The tiny Llama with the JSON tokenizer, saved as a folder for ``model=local``."""
    folder = tmp_path_factory.mktemp("tiny-json")
    tiny_model("llama").save_pretrained(folder)
    tiny_json_tokenizer().save_pretrained(folder)
    return folder


@pytest.mark.parametrize("how", ["file", "text"])
def test_decode_takes_a_json_schema_file_or_text(json_model_dir, tmp_path, monkeypatch, capsys, how):
    from specfree import cli

    monkeypatch.chdir(tmp_path)
    schema = {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"],
              "additionalProperties": False}
    (tmp_path / "schema.json").write_text(json.dumps(schema))
    value = "schema.json" if how == "file" else json.dumps(schema)
    code = cli.main(["decode", "model=local", f"model.path={json_model_dir}", "prompt=ab", "chat=false",
                     f"json_schema={value}", "max_new_tokens=20", f"hydra.run.dir={tmp_path / 'run'}"])
    assert code == 0
    result = json.loads((tmp_path / "run" / "result.json").read_text())
    assert isinstance(json.loads(result["text"])["a"], bool)
    assert result["text"] in capsys.readouterr().out


def test_decode_says_in_one_line_why_a_grammar_does_not_compile(json_model_dir, tmp_path, monkeypatch, capsys):
    from specfree import cli

    monkeypatch.chdir(tmp_path)
    code = cli.main(["decode", "model=local", f"model.path={json_model_dir}", "prompt=ab", "chat=false",
                     "grammar=root ::= ( 'a'", "max_new_tokens=4"])
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "grammar does not compile" in err[0]


@pytest.mark.model
def test_smollm2_answers_a_json_schema_task_validly_and_as_its_plain_loop(one_thread):
    """SmolLM2 at the default precision: the hybrid with the grammar drafter gives the constrained
    plain loop's tokens, the answer is valid under the schema, and grammar drafts were accepted."""
    from specfree.strategies.autoregressive import Autoregressive

    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                               "population": {"type": "integer"}},
              "required": ["city", "population"], "additionalProperties": False}
    messages = [{"role": "user", "content": "Give a French city and its population as JSON."}]
    hybrid = Engine.from_pretrained("smollm2", "hybrid", priced=False)
    plain = Engine(hybrid.adapter, Autoregressive(), hybrid.verifier, hybrid.tokenizer, priced=False)
    fast, slow = hybrid.generate(messages, 48, json_schema=schema), plain.generate(messages, 48, json_schema=schema)
    assert fast.tokens == slow.tokens
    answer = json.loads(fast.text)
    assert set(answer) == {"city", "population"} and isinstance(answer["population"], int)
    assert sum(step.sources.get("grammar", 0) for step in fast.steps) > 0


def test_an_engine_that_cannot_batch_follows_each_prompts_constraint_one_at_a_time():
    tok = tiny_json_tokenizer()
    chosen = Engine.from_model(tiny_model("mixtral"), tok, "prompt_lookup")  # its experts mix a forward's rows
    assert chosen.batch_off is not None
    prompts, options = [tok("ab").input_ids, tok("12").input_ids], [{"regex": "[ab]+c"}, {"json_object": True}]
    with pytest.warns(UserWarning, match="one request at a time"):
        results = chosen.generate_batch(prompts, 16, constraints=options)
    assert [r.tokens for r in results] == [chosen.generate(p, 16, **o).tokens for p, o in zip(prompts, options)]
