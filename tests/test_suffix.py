"""SuffixDecoding: lossless alone and as a hybrid member, and its state across requests."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specfree import ConfigError, Engine, speculative_generate
from specfree.cost import CostModel
from tests.test_lossless import prompts
from tests.tiny_models import FAMILIES, PAD, reference_greedy, tiny_model, tiny_tokenizer

SETTINGS = settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.too_slow])
CPU_LIKE = CostModel([1, 2, 4, 8, 16, 32], [1.0, 1.2, 1.5, 1.8, 2.0, 2.4])


@st.composite
def suffix_specs(draw) -> tuple[str, dict]:
    knobs = dict(max_tree_depth=draw(st.integers(1, 24)), max_cached_requests=draw(st.integers(0, 3)),
                 max_spec_factor=draw(st.sampled_from([0.5, 1.0, 4.0])),
                 min_token_prob=draw(st.sampled_from([0.0, 0.1, 0.5])), priced=draw(st.booleans()))
    if draw(st.booleans()):
        return "hybrid", dict(drafters=[{"name": "suffix", **{k: v for k, v in knobs.items() if k != "priced"}},
                                        draw(st.sampled_from(["prompt_lookup", "recycling", "trie"]))],
                              priced=knobs["priced"])
    return "suffix", knobs


@SETTINGS
@given(family=st.sampled_from(FAMILIES), first=prompts(), second=prompts(), spec=suffix_specs(),
       max_new=st.integers(1, 24))
def test_greedy_equals_plain_greedy_across_requests(family, first, second, spec, max_new):
    model = tiny_model(family)
    name, knobs = spec
    engine = Engine.from_model(model, None, name, costs=CPU_LIKE, **knobs)
    # The same engine serves several requests: later ones draft from the earlier outputs too.
    for prompt in (first, second):
        result = engine.generate(prompt, max_new_tokens=max_new)
        assert result.tokens == reference_greedy(model, prompt, max_new)


@settings(SETTINGS, max_examples=4)
@given(family=st.sampled_from(FAMILIES), prompt=prompts(), spec=suffix_specs(), seed=st.integers(0, 2**31),
       temperature=st.floats(0.3, 1.5), top_k=st.integers(0, 50))
def test_seeded_sampling_equals_plain_sampling_across_requests(family, prompt, spec, seed, temperature, top_k):
    model = tiny_model(family)
    sampling = dict(do_sample=True, seed=seed, temperature=temperature, top_k=top_k)
    name, knobs = spec
    speculative = Engine.from_model(model, None, name, costs=CPU_LIKE, **knobs, **sampling)
    plain = Engine.from_model(model, None, "autoregressive", **sampling)
    for _ in range(2):
        assert speculative.generate(prompt, 20).tokens == plain.generate(prompt, 20).tokens


def test_a_repeated_request_is_drafted_from_the_global_tree():
    model = tiny_model("llama")
    prompt = [9, 20, 31, 42, 53]
    engine = Engine.from_model(model, None, "suffix", priced=False)
    first = engine.generate(prompt, 30, ignore_eos=True)
    second = engine.generate(prompt, 30, ignore_eos=True)
    assert second.tokens == first.tokens == reference_greedy(model, prompt, 30, ignore_eos=True)
    assert len(second.steps) < len(first.steps)  # the first answer, kept across calls, drafts the second
    assert engine.strategy.stats()["cached_requests"] == 2
    engine.strategy.reset()
    assert len(engine.strategy.pool) == 0


def test_unpriced_suffix_verifies_exactly_its_speculation_tree():
    model = tiny_model("llama")
    engine = Engine.from_model(model, None, "suffix", priced=False, max_spec_factor=2.0)
    prompt = [5, 6, 7, 8, 9] * 3 + [5, 6]
    result = engine.generate(prompt, 20, ignore_eos=True)
    assert all(s.rows == s.offered for s in result.steps)
    # A match of m tokens speculates at most 2m nodes (and no more than max_tree_depth).
    assert max(s.drafted for s in result.steps) <= 24 and any(s.drafted for s in result.steps)


def test_state_file_carries_the_store_to_a_new_engine_and_reset_ignores_it(tmp_path):
    model = tiny_model("llama")
    state = tmp_path / "suffix.state"
    prompt = [9, 20, 31, 42, 53]
    first = Engine.from_model(model, None, "suffix", priced=False, state_file=str(state))
    cold = first.generate(prompt, 30, ignore_eos=True)
    assert state.is_file()
    second = Engine.from_model(model, None, "suffix", priced=False, state_file=str(state))
    assert [len(r) for r in second.strategy.pool.requests] == [30]
    warm = second.generate(prompt, 30, ignore_eos=True)
    assert warm.tokens == cold.tokens and len(warm.steps) < len(cold.steps)
    fresh = Engine.from_model(model, None, "suffix", priced=False, state_file=str(state), reset=True)
    assert len(fresh.strategy.pool) == 0


@pytest.mark.parametrize("damage", ["truncated", "other tokenizer", "corrupt"])
def test_a_bad_state_file_stops_the_engine_with_one_clear_error(tmp_path, damage):
    model = tiny_model("llama")
    state = tmp_path / "suffix.state"
    Engine.from_model(model, None, "suffix", state_file=str(state), costs=CPU_LIKE).generate([5, 6, 7], 8)
    data = bytearray(state.read_bytes())
    tokenizer = None
    if damage == "truncated":
        state.write_bytes(bytes(data[:-4]))
    elif damage == "corrupt":
        data[-2] ^= 1
        state.write_bytes(bytes(data))
    else:
        tokenizer = tiny_tokenizer()  # written without a tokenizer: another fingerprint
    with pytest.raises(ConfigError, match=f"{state}.*{damage.split()[-1]}"):
        Engine.from_model(model, tokenizer, "suffix", state_file=str(state), costs=CPU_LIKE)


def test_the_transformers_seam_keeps_the_store_between_generate_calls():
    model = tiny_model("llama")
    custom = speculative_generate("suffix")
    ids = torch.tensor([[9, 20, 31, 42, 53]])
    for _ in range(2):
        out = model.generate(ids, custom_generate=custom, pad_token_id=PAD, max_new_tokens=12)
        assert out[0, 5:].tolist() == reference_greedy(model, ids[0].tolist(), 12)
    assert len(custom.strategy.pool.requests) == 2


def test_bench_keeps_one_drafter_across_prompts():
    from specfree.bench.systems import SpecfreeSystem

    system = SpecfreeSystem.build(tiny_model("llama"), None, "suffix", {})
    strategy = system.engine.strategy
    for prompt in ([5, 6, 7], [8, 9, 10]):
        system.run(prompt, 6)
    assert system.engine.strategy is strategy and len(strategy.pool.requests) == 2


def test_bad_knobs_are_refused_by_name():
    with pytest.raises(ConfigError, match="max_tree_depth"):
        Engine.from_model(tiny_model("llama"), None, "suffix", max_tree_depth=0)
    with pytest.raises(ConfigError, match="min_token_prob"):
        Engine.from_model(tiny_model("llama"), None, "suffix", min_token_prob=2.0)
    with pytest.raises(ConfigError, match="pool=suffix_tree"):
        Engine.from_model(tiny_model("llama"), None, "suffix", pool="lru")


def test_a_decode_sweep_shares_the_store_through_the_state_file(tiny_llama_dir, tmp_path):
    from specfree import cli
    from specfree.pools.suffix_tree import read_state, tokenizer_fingerprint

    state = tmp_path / "suffix.state"
    code = cli.main(["decode", "-m", "max_new_tokens=6,8", "strategy=suffix", f"strategy.state_file={state}",
                     "model=local", f"model.path={tiny_llama_dir}", "prompt=the cat sat on the mat",
                     f"hydra.sweep.dir={tmp_path / 'sweep'}"])
    assert code == 0
    # Both runs' outputs, in run order: the second run loaded the first one's.
    requests = read_state(state, 128, tokenizer_fingerprint(tiny_tokenizer()))
    assert sorted(len(r) for r in requests) == [6, 8]


def test_the_likeliest_chain_is_the_first_candidate_and_branches_are_labelled_apart():
    from specfree.pools.suffix_tree import Draft
    from specfree.strategies.suffix import likeliest_first, make_suffix

    # 5 -> 6 (0.9) -> 7 (0.8) -> 8 (0.7) -> 9 (0.05); 5 -> 6 -> 3 (0.1): best-first order puts the
    # branch's leaf (0.1) before the main chain's (0.05), yet the chain follows 7 at depth 3.
    draft = Draft([5, 6, 7, 8, 3, 9], [-1, 0, 1, 2, 1, 3], [0.95, 0.9, 0.8, 0.7, 0.1, 0.05], match_len=4)
    assert draft.candidates()[0] == [5, 6, 3]
    assert likeliest_first(draft) == [[5, 6, 7, 8, 9], [5, 6, 3]]
    strategy = make_suffix()
    proposal = strategy._proposal(draft, "r")
    assert proposal.candidates[0] == [5, 6, 7, 8, 9] and proposal.labels == ["r4+", "r4+~"]
