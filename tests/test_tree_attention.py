"""specfree's tree-attention operator (specfree/kernels/tree_attention.cpp): against float64 over
odd shapes, masks and both code paths; each row's bits independent of the other rows and of where
its keys sit; empty slots never read; and, through the adapter, every verify row of a chain or a
tree bit-equal to the one-row forward (eager here; compiled in test_compiled.py)."""

from __future__ import annotations

import functools

import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specfree.adapters.attention import (TREE_ATTENTION, attention_path, grouped_sdpa_attention, stock_attention,
                                        tree_attention_forward)
from specfree.adapters.hf import HFAdapter
from specfree.kernels import load_kernels
from specfree.kernels.tree_attention import LONG_ROWS, tree_attention, visible
from specfree.masks.tree import ancestors
from tests.tiny_models import tiny_model

ISA = load_kernels(progress=False)
pytestmark = pytest.mark.skipif(ISA is None, reason="the kernel cannot be built or run on this machine")
ISAS = ["avx2", "avx512"] if ISA == "avx512" else ["avx2"]
LOWEST = torch.finfo(torch.float32).min

# Families whose every verify row equals the one-row forward bit for bit with the operator (their
# other layers are row-wise or run the batch-invariant linear kernel; gpt2's Conv1D layers are
# packed like nn.Linear). Not here, though they run the operator: mixtral (expert routing),
# gemma4_text, dory.
BIT_IDENTICAL = ("cohere_compass_text", "gemma", "gemma2", "gemma3_text", "gemma3n_text", "gpt2", "gpt_neox", "llama",
                 "mistral", "olmo2", "opt", "phi", "phi3", "qwen2", "qwen3", "smollm3", "stablelm", "starcoder2",
                 "xmod")


def reference(query, key, value, mask, scale, softcap=0.0):
    """Softmax attention in float64 from the same inputs, hidden keys dropped."""
    groups = query.shape[1] // key.shape[1]
    key, value = key.double().repeat_interleave(groups, 1), value.double().repeat_interleave(groups, 1)
    seen = visible(mask, query.shape[2], key.shape[2])
    scores = (query.double() @ key.transpose(-1, -2)) * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~seen, float("-inf"))
    weights = torch.softmax(scores, dim=-1)
    return (weights.nan_to_num(0.0) @ value.nan_to_num(0.0)).transpose(1, 2)


def step_mask(past: int, allowed: torch.Tensor, slots: int, window: int | None, positions: torch.Tensor,
              as_bool: bool) -> torch.Tensor:
    """[1, 1, Q, slots]: the cache's past entries, the step's rows after them (``allowed``), empty
    slots after those; a sliding window hides keys ``window`` or more positions back."""
    rows = allowed.shape[0]
    seen = torch.zeros(rows, slots, dtype=torch.bool)
    seen[:, :past] = True
    seen[:, past:past + rows] = allowed
    if window is not None:
        key_positions = torch.cat([torch.arange(past), positions, torch.full((slots - past - rows,), 10**6)])
        seen &= (positions[:, None] - key_positions[None, :]) < window
    if as_bool:
        return seen[None, None]
    return torch.zeros(rows, slots).masked_fill(~seen, LOWEST)[None, None]


@st.composite
def steps(draw):
    """A step's shapes and visibility: a random tree (a chain when every parent is the previous row)."""
    rows = draw(st.integers(1, 64))
    chain = draw(st.booleans())
    parents = [-1] + [i - 1 if chain else draw(st.integers(0, i - 1)) for i in range(1, rows)]
    depth = [0] * rows
    for i in range(1, rows):
        depth[i] = depth[parents[i]] + 1
    past = draw(st.integers(0, 150))
    return dict(rows=rows, allowed=torch.from_numpy(ancestors([max(p, 0) for p in parents])),
                depth=torch.tensor(depth), past=past, empty=draw(st.integers(0, 40)),
                window=draw(st.none() | st.integers(1, 60)), head_dim=draw(st.sampled_from([64, 128, 40])),
                kv_heads=draw(st.integers(1, 3)), groups=draw(st.integers(1, 8)), as_bool=draw(st.booleans()),
                softcap=draw(st.sampled_from([0.0, 0.0, 0.5, 1.0, 50.0])),  # Gemma 2 caps at 50
                seed=draw(st.integers(0, 99)))


@settings(max_examples=60, deadline=None)
@given(step=steps(), backend=st.sampled_from([*ISAS, "library"]))
def test_the_op_equals_attention_in_float64(step, backend):
    g = torch.Generator().manual_seed(step["seed"])
    rows, past, d = step["rows"], step["past"], step["head_dim"]
    slots = past + rows + step["empty"]
    heads = step["kv_heads"] * step["groups"]
    query = torch.randn(1, rows, heads, d, generator=g).transpose(1, 2)  # transformers' strides
    key = torch.randn(1, step["kv_heads"], slots, d, generator=g)
    value = torch.randn(1, step["kv_heads"], slots, d, generator=g)
    key[:, :, past + rows:] = float("nan")  # empty slots: never read
    value[:, :, past + rows:] = float("nan")
    positions = past + step["depth"]
    mask = step_mask(past, step["allowed"], slots, step["window"], positions, step["as_bool"])
    scale = d ** -0.5
    cap = step["softcap"]
    if backend == "library":
        out = tree_attention(query, key.nan_to_num(0.0), value.nan_to_num(0.0), mask, scale, backend="library",
                             softcap=cap)
    else:
        out = tree_attention(query, key, value, mask, scale, isa=backend, softcap=cap)
    assert out.shape == (1, rows, heads, d) and out.is_contiguous()  # as the fake (compiled code) promises
    expected = reference(query, key, value, mask, scale, cap)
    assert (out.double() - expected).abs().max().item() <= 2e-6


@settings(max_examples=30, deadline=None)
@given(step=steps(), isa=st.sampled_from(ISAS))
def test_bf16_inputs_give_the_float32_result_on_their_exact_widening_rounded_once(step, isa):
    g = torch.Generator().manual_seed(step["seed"])
    rows, past, d = step["rows"], step["past"], step["head_dim"]
    slots = past + rows + step["empty"]
    heads = step["kv_heads"] * step["groups"]
    query = torch.randn(1, rows, heads, d, generator=g).transpose(1, 2).bfloat16()
    key, value = (torch.randn(1, step["kv_heads"], slots, d, generator=g).bfloat16() for _ in range(2))
    mask = step_mask(past, step["allowed"], slots, step["window"], past + step["depth"], step["as_bool"])
    scale = d ** -0.5
    out = tree_attention(query, key, value, mask, scale, isa=isa, softcap=step["softcap"])
    wide = tree_attention(query.float(), key.float(), value.float(), mask, scale, isa=isa, softcap=step["softcap"])
    assert out.dtype == torch.bfloat16 and torch.equal(out, wide.bfloat16())


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(2, 32), past=st.integers(0, 100), groups=st.integers(1, 8), isa=st.sampled_from(ISAS),
       softcap=st.sampled_from([0.0, 1.0, 50.0]), seed=st.integers(0, 99))
def test_a_row_has_the_same_bits_alone_in_a_tree_and_wherever_its_keys_sit(rows, past, groups, isa, softcap, seed):
    """A chain of ``rows`` rows in one call, the same chain with a sibling after every node (its keys
    at every other slot), and each row alone over a cache that holds exactly the keys it sees."""
    g = torch.Generator().manual_seed(seed)
    d, kv_heads = 64, 2
    query = torch.randn(1, kv_heads * groups, rows, d, generator=g)
    key, value = torch.randn(2, 1, kv_heads, past + rows, d, generator=g)
    chain_mask = step_mask(past, torch.ones(rows, rows, dtype=torch.bool).tril(), past + rows, None,
                           torch.arange(past, past + rows), False)
    attend = functools.partial(tree_attention, isa=isa, softcap=softcap)
    chain = attend(query, key, value, chain_mask, 0.125)
    # the tree: chain node i at slot past + 2i, a sibling (other query, other key) at past + 2i + 1
    spread = lambda x, other: torch.stack([x[:, :, past:], other], dim=3).flatten(2, 3)  # noqa: E731
    tree_key = torch.cat([key[:, :, :past], spread(key, torch.randn(1, kv_heads, rows, d, generator=g))], 2)
    tree_value = torch.cat([value[:, :, :past], spread(value, torch.randn(1, kv_heads, rows, d, generator=g))], 2)
    tree_query = torch.stack([query, torch.randn(query.shape, generator=g)], dim=3).flatten(2, 3)
    allowed = torch.zeros(2 * rows, 2 * rows, dtype=torch.bool)
    for i in range(rows):
        allowed[2 * i, 0:2 * i + 1:2] = True
        allowed[2 * i + 1, 0:2 * i:2] = True
        allowed[2 * i + 1, 2 * i + 1] = True
    tree_mask = step_mask(past, allowed, past + 2 * rows, None, torch.arange(2 * rows), True)
    tree = attend(tree_query, tree_key, tree_value, tree_mask, 0.125)
    assert torch.equal(tree[:, 0::2], chain)
    # the chain's keys at every other slot, the slots between seen by no row (blocks of keys that
    # are not runs of slots take the op's per-key path; runs, above, its vector path)
    gappy = lambda x: torch.stack([x, torch.full_like(x, float("nan"))], dim=3).flatten(2, 3)  # noqa: E731
    gappy_mask = torch.zeros(1, 1, rows, 2 * (past + rows), dtype=torch.bool)
    gappy_mask[..., 0::2] = chain_mask.bool() if chain_mask.dtype == torch.bool else chain_mask == 0
    gappy_out = attend(query, gappy(key), gappy(value), gappy_mask, 0.125)
    assert torch.equal(gappy_out, chain)
    for i in range(rows):  # one row, no mask: every key of its cache
        alone = attend(query[:, :, i:i + 1], key[:, :, :past + i + 1], value[:, :, :past + i + 1], None, 0.125)
        assert torch.equal(alone[:, 0], chain[:, i]), i


def test_bad_inputs_are_refused_by_the_op_with_a_message():
    query, kv = torch.randn(1, 3, 2, 8), torch.randn(1, 2, 5, 8)
    with pytest.raises(RuntimeError, match="do not share 2 key/value heads evenly"):
        tree_attention(query, kv, kv, None, 1.0)
    with pytest.raises(RuntimeError, match="the mask must be"):
        tree_attention(torch.randn(1, 2, 2, 8), kv, kv, torch.ones(1, 1, 2, 4, dtype=torch.bool), 1.0)
    with pytest.raises(RuntimeError, match="isa must be auto, avx2 or avx512"):
        tree_attention(torch.randn(1, 2, 2, 8), kv, kv, None, 1.0, isa="sse")
    with pytest.raises(RuntimeError, match="softcap must be 0 .none. or positive"):
        tree_attention(torch.randn(1, 2, 2, 8), kv, kv, None, 1.0, softcap=-1.0)
    with pytest.raises(RuntimeError, match="must all be float32 or all bfloat16"):
        tree_attention(torch.randn(1, 2, 2, 8).bfloat16(), kv, kv, None, 1.0)
    with pytest.raises(RuntimeError, match="must all be float32 or all bfloat16"):
        tree_attention(torch.randn(1, 2, 2, 8).half(), kv.half(), kv.half(), None, 1.0)


def chain_and_tree_against_one_row(adapter, context: torch.Tensor, continuation: torch.Tensor):
    """(chain rows, the tree's chain rows, one-row forwards): logits [n, V] each, for a step over
    ``continuation`` as a plain causal chain, the same chain with a sibling row after each node, and
    one forward per token."""
    adapter.reset()
    adapter.prefill(context)
    chain = adapter.forward(continuation)
    n = continuation.numel()
    tokens = torch.stack([continuation, (continuation + 1) % adapter.vocab_size], dim=1).flatten()
    allowed = torch.zeros(2 * n, 2 * n, dtype=torch.bool)
    for i in range(n):
        allowed[2 * i, 0:2 * i + 1:2] = True
        allowed[2 * i + 1, 0:2 * i:2] = True
        allowed[2 * i + 1, 2 * i + 1] = True
    adapter.reset()
    adapter.prefill(context)
    tree = adapter.forward(tokens, allowed)[0::2]
    adapter.reset()
    adapter.prefill(context)
    alone = []
    for token in continuation.tolist():
        alone.append(adapter.forward(torch.tensor([token]))[0])
        adapter.commit([0], rows=1)
    return chain, tree, torch.stack(alone)


CONTEXT = torch.tensor([5, 9, 11, 13, 40, 41, 7, 3, 99, 100, 12, 14, 60, 61, 62, 8, 9, 30, 31, 32])
CONTINUATION = torch.tensor([20, 21, 22, 23, 50, 51, 52])


@pytest.mark.parametrize("family", BIT_IDENTICAL)
def test_every_verify_row_equals_the_one_row_forward_bit_for_bit(family):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        adapter = HFAdapter(tiny_model(family, seed=31), check_tree_mask=False)
    assert adapter.model.config._attn_implementation == TREE_ATTENTION
    chain, tree, alone = chain_and_tree_against_one_row(adapter, CONTEXT, CONTINUATION)
    assert torch.equal(chain, alone) and torch.equal(tree, alone)


def test_stock_attention_is_sdpa_inside_the_block():
    adapter = HFAdapter(tiny_model("llama", seed=31), check_tree_mask=False)
    assert attention_path(adapter.model) == "tree_attention"
    with stock_attention(adapter.model):
        assert adapter.model.config._attn_implementation == "sdpa" and attention_path(adapter.model) == "sdpa"
    assert adapter.model.config._attn_implementation == TREE_ATTENTION


def test_a_long_prefill_runs_sdpa_and_a_step_the_operator():
    """Beyond ``LONG_ROWS`` rows (a prefill, never a verify step) attention is SDPA's, bit for bit."""
    module = torch.nn.Module()
    module.is_causal, module.num_key_value_groups = True, 2
    outputs = {}
    for rows in (LONG_ROWS, LONG_ROWS + 1):
        generator = torch.Generator().manual_seed(rows)
        query = torch.randn(1, 4, rows, 16, generator=generator)
        key, value = torch.randn(2, 1, 2, rows, 16, generator=generator)
        outputs[rows] = (tree_attention_forward(module, query, key, value, None, scaling=0.25)[0],
                         tree_attention(query, key, value, None, 0.25),
                         grouped_sdpa_attention(module, query, key, value, None, scaling=0.25)[0])
    step, op, sdpa = outputs[LONG_ROWS]
    assert torch.equal(step, op) and not torch.equal(op, sdpa)  # the two differ in bits
    prefill, op, sdpa = outputs[LONG_ROWS + 1]
    assert torch.equal(prefill, sdpa) and not torch.equal(prefill, op)


def test_a_soft_capped_family_leaves_eager_for_the_operator_and_keeps_its_cap_on_every_call():
    """Gemma 2 caps its attention logits, which SDPA cannot: the model runs the operator (eager
    inside ``stock_attention``), and a long prefill, which the operator leaves, keeps the cap."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = tiny_model("gemma2", seed=33)
    assert model.config.attn_logit_softcapping and model.config._attn_implementation == "eager"
    ids = torch.randint(0, model.config.vocab_size, (1, LONG_ROWS + 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        eager = model(ids).logits
    HFAdapter(model, check_tree_mask=False)
    assert attention_path(model) == "tree_attention"
    with stock_attention(model):
        assert model.config._attn_implementation == "eager"
    with torch.no_grad():
        ours = model(ids).logits  # more than LONG_ROWS rows: torch ops, capped
        short = model(ids[:, :20]).logits  # the operator, capped
    torch.testing.assert_close(ours, eager, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(short, eager[:, :20], rtol=1e-4, atol=1e-4)
    for layer in model.model.layers:  # the same model without its cap gives other logits
        layer.self_attn.attn_logit_softcapping = None
    with torch.no_grad():
        assert not torch.allclose(model(ids[:, :20]).logits, short, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", ["llama", "gpt2", "qwen3", "gemma2"])
def test_a_bf16_model_runs_the_operator_and_every_verify_row_equals_the_one_row_forward(family):
    """bf16 widened exactly to float32 for the operator, its output rounded once: a verify row keeps
    the one-row forward's bits, as in fp32 (and its linears, AMX tiles or panels, are batch invariant)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        adapter = HFAdapter(tiny_model.__wrapped__(family, seed=31).to(torch.bfloat16), check_tree_mask=False)
    assert attention_path(adapter.model) == "tree_attention"
    chain, tree, alone = chain_and_tree_against_one_row(adapter, CONTEXT, CONTINUATION)
    assert chain.dtype == torch.bfloat16
    assert torch.equal(chain, alone) and torch.equal(tree, alone)


def test_a_float16_model_keeps_sdpa():
    model = tiny_model.__wrapped__("llama", seed=32).to(torch.float16)
    HFAdapter(model, check_tree_mask=False)
    assert attention_path(model) == "grouped_sdpa"


@pytest.mark.model
def test_smollm2_verify_rows_equal_the_one_row_forward_bit_for_bit():
    from specfree import Engine

    adapter = Engine.from_pretrained("smollm2", "autoregressive").adapter
    assert adapter.model.config._attn_implementation == TREE_ATTENTION
    context = torch.arange(100, 400, 7)  # 43 tokens
    chain, tree, alone = chain_and_tree_against_one_row(adapter, context, torch.tensor([1000, 2000, 3000, 400, 5,
                                                                                          600, 7000, 80]))
    assert torch.equal(chain, alone) and torch.equal(tree, alone)
