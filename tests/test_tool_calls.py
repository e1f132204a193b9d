"""Tool calls are lossless: under the call grammar of ``serve.tools`` (auto, required or a named
tool, one call or several), every strategy, priced and unpriced, alone and batched, gives the
tokens of constrained plain decoding, greedy and seeded sampling."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specfree.batching import Batch
from specfree.constraints import Constraint, Grammars
from specfree.serve.tools import Tool, Tools
from tests.test_batching import drive
from tests.test_constraints import KEYS, engine, leaf_schemas, reference
from tests.test_lossless import drafter_specs
from tests.tiny_models import EOS, VOCAB, tiny_json_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")
SETTINGS = settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
NAMES = ["add", "get", "a_b"]
PIECES = ["<tool_call>\n", '{"name": "', "add", "get", '", "arguments": {', '"a": ', "true", "12", '"abc"', "}}",
          "\n</tool_call>", "\n", "ab ", "null"]


@st.composite
def tool_sets(draw) -> Tools:
    """Up to three tools with small object schemas, called auto, required or by name."""
    names = draw(st.lists(st.sampled_from(NAMES), min_size=1, max_size=3, unique=True))
    tools = []
    for name in names:
        props = draw(st.dictionaries(st.sampled_from(KEYS), leaf_schemas(), max_size=2))
        optional = draw(st.sets(st.sampled_from(sorted(props) or ["a"]), max_size=1))
        tools.append(Tool(name, None, {"type": "object", "properties": props, "additionalProperties": False,
                                       "required": [k for k in props if k not in optional]}))
    choice = draw(st.sampled_from(["auto", "required", *names]))
    return Tools(tools, choice, parallel=draw(st.booleans()))


@st.composite
def prompts(draw) -> list[int]:
    """Prompts that hold call-like text, so that lookup drafts meet what the grammar allows."""
    pieces = draw(st.lists(st.sampled_from(PIECES), min_size=1, max_size=10))
    return tiny_json_tokenizer()("".join(pieces)).input_ids


def options(tools: Tools) -> dict:
    return tools.constraint().options()


@SETTINGS
@given(family=st.sampled_from(["llama", "qwen3"]), spec=drafter_specs(), priced=st.booleans(), prompt=prompts(),
       tools=tool_sets(), max_new=st.integers(1, 40))
def test_every_strategy_under_the_call_grammar_is_constrained_plain_greedy(family, spec, priced, prompt, tools,
                                                                           max_new):
    from tests.tiny_models import tiny_model

    name, knobs = spec
    result = engine(family, name, knobs, priced=priced).generate(prompt, max_new, **options(tools))
    assert result.tokens == reference(tiny_model(family), prompt, max_new, options(tools))


@SETTINGS
@given(spec=drafter_specs(), prompt=prompts(), tools=tool_sets(), seed=st.integers(0, 2**31),
       temperature=st.floats(0.3, 1.5))
def test_every_strategy_under_the_call_grammar_is_constrained_plain_sampling(spec, prompt, tools, seed, temperature):
    name, knobs = spec
    sampling = dict(do_sample=True, seed=seed, temperature=temperature)
    speculative = engine("llama", name, knobs, **sampling).generate(prompt, 40, **options(tools))
    plain = engine("llama", "autoregressive", {}, **sampling).generate(prompt, 40, **options(tools))
    assert speculative.tokens == plain.tokens


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=drafter_specs(), priced=st.booleans(),
       requests=st.lists(st.tuples(prompts(), st.one_of(st.none(), tool_sets())), min_size=2, max_size=4),
       do_sample=st.booleans(), seed=st.integers(0, 2**31))
def test_requests_with_different_tools_batch_each_as_its_own(spec, priced, requests, do_sample, seed):
    name, knobs = spec
    sampling = dict(do_sample=True, temperature=0.8, top_k=20) if do_sample else {}
    batched = engine("llama", name, knobs, priced=priced, **sampling)
    constraint = (lambda tools: tools.constraint() if tools is not None else None)  # noqa: E731
    results = drive(Batch(batched, 3), [dict(prompt=p, max_new_tokens=30, seed=seed + i, constraint=constraint(t))
                                        for i, (p, t) in enumerate(requests)], [0, 1, 2, 3][: len(requests)])
    plain = engine("llama", "autoregressive", {}, **sampling)
    for i, (prompt, tools) in enumerate(requests):
        alone = plain.generate(prompt, 30, seed=seed + i, **(options(tools) if tools else {}))
        assert results[i].tokens == alone.tokens and results[i].stop_reason == alone.stop_reason


def test_a_token_past_the_grammars_end_is_undone_without_undoing_the_answer():
    """llguidance takes EOS once the grammar stopped without a step it can roll back: a tree that
    walks past the end and back must leave the matcher where the answer is."""
    tokenizer = tiny_json_tokenizer()
    matcher = Grammars(tokenizer, VOCAB, {EOS}).matcher(Constraint("regex", "abc"))
    answer = tokenizer("abc", add_special_tokens=False).input_ids
    matcher.follow([*answer, EOS])
    matcher.follow(answer[:-1])
    assert matcher.allows(answer[-1:]) == 1 and not matcher.stopped
    matcher.follow(answer)
    assert matcher.stopped
