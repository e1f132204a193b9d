"""Models with recurrent layers (SSMs, linear attention, their hybrids with attention) verify one
chain a step, roll their state back, and reproduce transformers' greedy decoding token for token."""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
import transformers
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specfree import Engine
from specfree.adapters.hf import HFAdapter
from specfree.draft_tree import DraftTree, merge
from tests.test_lossless import prompts
from tests.tiny_models import RECURRENT_FAMILIES, Oracle, reference_greedy, tiny_model

# transformers 5.23's Mamba-1 mixer (and RecurrentGemma's recurrent block) starts from a zero state on
# multi-token input: no chains there.
ONE_ROW = {"mamba", "jamba", "recurrent_gemma"}
CHAIN = [f for f in RECURRENT_FAMILIES if f not in ONE_ROW]
pytestmark = pytest.mark.usefixtures("one_thread")
STRATEGIES = ["autoregressive", "prompt_lookup", "lookahead", "trie", "recycling", "hybrid", "retrieval"]


@pytest.fixture(autouse=True)
def quiet():
    """The one-row families warn once per engine; transformers logs its kernel fallbacks."""
    transformers.utils.logging.set_verbosity_error()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*does not carry the recurrent state")
        yield


def make_engine(family: str, strategy: str, datastore: str, **knobs) -> Engine:
    if strategy == "retrieval":
        knobs["datastore"] = datastore
    if strategy == "hybrid":
        knobs.setdefault("drafters", ["prompt_lookup", "trie", "recycling"])
    return Engine.from_model(tiny_model(family), None, strategy, **knobs)


@functools.cache
def self_repeating_prompt(family: str) -> list[int]:
    """A prompt followed by the model's own continuation: drafts copied from it are accepted for a
    while, then rejected, so steps keep whole chains, cut them, and roll back."""
    start = [5, 9, 11, 7]
    return start + reference_greedy(tiny_model(family), start, 24, ignore_eos=True)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("family", RECURRENT_FAMILIES)
def test_every_strategy_reproduces_generate(family, strategy, datastore):
    model = tiny_model(family)
    prompt = self_repeating_prompt(family)
    result = make_engine(family, strategy, datastore).generate(prompt, 20, ignore_eos=True)
    assert result.tokens == reference_greedy(model, prompt, 20, ignore_eos=True)
    assert sum(s.emitted for s in result.steps) == len(result.tokens)
    assert all(s.rows == s.drafted + 1 for s in result.steps)  # one chain: no aux rows, no siblings


@pytest.mark.parametrize("family", ["recurrent_gemma", "llama", "falcon_h1"])
def test_an_engine_over_parameters_that_require_grad(family, datastore):
    """As after ``from_pretrained``, every parameter requires grad: every forward the engine runs (probes,
    a recurrent store's own, the cost curve, prompts, steps, replays) runs grad-free all the same, and
    the mode does not leak out to the caller. A recurrent, an attention and a hybrid family."""
    model = tiny_model.__wrapped__(family)  # a fresh model: no engine has swapped its weights yet
    assert all(p.requires_grad for p in model.parameters())
    prompt = self_repeating_prompt(family)
    for strategy in ("prompt_lookup", "hybrid"):
        engine = Engine.from_model(model, None, strategy)
        assert torch.is_grad_enabled() and not torch.is_inference_mode_enabled()
        result = engine.generate(prompt, 12, ignore_eos=True)
        assert torch.is_grad_enabled() and not torch.is_inference_mode_enabled()
        assert result.tokens == reference_greedy(model, prompt, 12, ignore_eos=True)


# Families whose cache is transformers' own linear-attention layers: rollbacks re-run their mixers only.
MIXERS = ["bailing_hybrid", "falcon_h1", "lfm2", "mamba2", "nemotron_h", "qwen3_5_text", "qwen3_next", "zamba2",
          "zaya"]


@pytest.mark.parametrize("wrong_at", [0, 2])
@pytest.mark.parametrize("family", CHAIN)
def test_kept_and_cut_chains_roll_back_to_the_accepted_tokens(family, wrong_at, whole_model=False):
    model = tiny_model(family)
    prompt = [5, 9, 11, 7]
    truth = prompt + reference_greedy(model, prompt, 40, ignore_eos=True)
    engine = Engine.from_model(model, None, Oracle(truth, depth=4, wrong_at=wrong_at), priced=False)
    assert (engine.adapter.store.replay is not None) == (family in MIXERS)
    if whole_model:
        engine.adapter.store.replay = None
    result = engine.generate(prompt, 40, ignore_eos=True)
    assert result.tokens == truth[len(prompt) :]
    cut = [s for s in result.steps if s.accepted < s.drafted]
    whole = [s for s in result.steps if s.accepted == s.drafted]
    assert [s.accepted for s in cut] == [wrong_at] * len(cut) and len(cut) >= 3 and len(whole) >= 3
    assert all(s.extra["rollback_s"] > 0 for s in cut) and all(s.extra["rollback_s"] == 0 for s in whole)


@pytest.mark.parametrize("family", ["falcon_h1", "qwen3_next"])
def test_rollback_by_re_running_the_whole_model(family):
    """The fallback where a mixer's inputs cannot be cut: the kept rows run through the whole model."""
    test_kept_and_cut_chains_roll_back_to_the_accepted_tokens(family, wrong_at=1, whole_model=True)


@pytest.mark.parametrize("family", sorted(ONE_ROW))
def test_a_model_whose_forward_drops_its_state_decodes_one_row_a_step(family):
    with pytest.warns(UserWarning, match=f"model family '{family}': .*does not carry the recurrent state .*"
                                         "decoding one token per step"):
        warnings.filterwarnings("default", message=".*does not carry the recurrent state")
        engine = Engine.from_model(tiny_model(family), None, "prompt_lookup")
    prompt = self_repeating_prompt(family)
    result = engine.generate(prompt, 12, ignore_eos=True)
    assert result.tokens == reference_greedy(tiny_model(family), prompt, 12, ignore_eos=True)
    assert all(s.rows == 1 for s in result.steps)


@pytest.mark.parametrize("family", CHAIN)
def test_rollback_leaves_the_state_of_the_accepted_tokens(family):
    """After a chain with its tail rejected, every cached state equals a forward over the kept
    tokens only (within fp32 rounding: the kept rows ran as one chunk)."""
    adapter = HFAdapter(tiny_model(family))
    assert (adapter.store.replay is not None) == (family in MIXERS)
    ids = torch.tensor([5, 9, 11, 7, 20, 30, 40, 50])
    adapter.prefill(ids[:4])
    adapter.forward(ids[4:8])
    adapter.commit([0, 1], rows=4)  # keep 20 30; drop 40 50
    ours = adapter.store.cache
    adapter.store.cache = None
    adapter.reset()
    adapter.prefill(ids[:4])
    adapter.forward(ids[4:6])
    assert adapter.past_len == 6
    if not hasattr(plain_cache := adapter.store.cache, "layers"):  # a cache class of its own (xLSTM's): all its tensors
        for (name, mine), (_, plain) in zip(tensors(ours), tensors(plain_cache), strict=True):
            torch.testing.assert_close(mine, plain, rtol=1e-4, atol=1e-5, msg=name)
        return
    for mine, plain in zip(ours.layers, plain_cache.layers):
        for name in ("conv_states", "recurrent_states"):
            for i, state in getattr(plain, name, {}).items():
                if state is not None:
                    torch.testing.assert_close(getattr(mine, name)[i], state, rtol=1e-4, atol=1e-5)
        if getattr(plain, "keys", None) is not None:
            torch.testing.assert_close(mine.keys, plain.keys, rtol=1e-4, atol=1e-5)


def tensors(value, name: str = "cache"):
    """Every tensor inside ``value`` (its attributes, dicts, lists and tuples), with where it was found."""
    if isinstance(value, torch.Tensor):
        yield name, value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from tensors(item, f"{name}[{key!r}]")
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            yield from tensors(item, f"{name}[{i}]")
    elif hasattr(value, "__dict__") and not isinstance(value, transformers.PretrainedConfig):
        for key, item in vars(value).items():
            yield from tensors(item, f"{name}.{key}")


@st.composite
def strategy_knobs(draw) -> tuple[str, dict]:
    name = draw(st.sampled_from(STRATEGIES))
    knobs = {
        "prompt_lookup": lambda: dict(draft_len=draw(st.integers(1, 10)), num_candidates=draw(st.integers(1, 4))),
        "lookahead": lambda: dict(window=draw(st.integers(1, 4)), ngram=draw(st.integers(2, 4))),
        "trie": lambda: dict(decoding_length=draw(st.integers(1, 16)), branch_length=draw(st.integers(1, 8))),
        "recycling": lambda: dict(successors=4, widths=draw(st.lists(st.integers(1, 4), min_size=1, max_size=5))),
        "hybrid": lambda: dict(max_rows=draw(st.integers(1, 24))),
        "retrieval": lambda: dict(max_depth=draw(st.integers(1, 8))),
    }.get(name, dict)()
    return name, {**knobs, "priced": draw(st.booleans())}  # one priced chain, or the first candidate


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(family=st.sampled_from(CHAIN), prompt=prompts(), spec=strategy_knobs(), max_new=st.integers(1, 30),
       copied=st.integers(0, 16))
def test_greedy_equals_transformers_generate(datastore, family, prompt, spec, max_new, copied):
    prompt = prompt + self_repeating_prompt(family)[:copied]  # some prompts the model continues itself
    name, knobs = spec
    result = make_engine(family, name, datastore, **knobs).generate(prompt, max_new)
    assert result.tokens == reference_greedy(tiny_model(family), prompt, max_new)


def test_chain_is_the_first_candidate():
    tree = merge(1, [([5, 6, 7], "a"), ([5, 8], "b"), ([9], "c")], budget=10)
    chain = tree.chain()
    assert chain.tokens == [1, 5, 6, 7] and chain.parents == [-1, 0, 1, 2] and chain.sources[1:] == ["a"] * 3
    assert tree.chain(max_depth=1).tokens == [1, 5]
    assert DraftTree.root_only(3).chain().tokens == [3]



@pytest.mark.parametrize("family", CHAIN)
def test_seeded_sampling_through_kept_and_cut_chains_equals_plain_sampling(family):
    model = tiny_model(family)
    prompt, sampling = [5, 9, 11, 7], dict(do_sample=True, seed=7, temperature=0.8, top_k=20)
    plain = Engine.from_model(model, None, "autoregressive", **sampling).generate(prompt, 30, ignore_eos=True)
    oracle = Oracle(prompt + plain.tokens, depth=3, wrong_at=1)
    speculative = Engine.from_model(model, None, oracle, priced=False, **sampling).generate(prompt, 30,
                                                                                           ignore_eos=True)
    assert speculative.tokens == plain.tokens
    assert any(s.accepted < s.drafted for s in speculative.steps) and speculative.forwards < 30
