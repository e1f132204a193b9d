"""Row-wise argmax and top-k (specfree/logits.py) against torch's own kernels."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specfree.kernels import load_kernels
from specfree.logits import BLOCK, greedy_ids, top_ids

# Few distinct values make ties common; NaN and infinities are allowed too.
VALUES = st.sampled_from([-math.inf, -2.0, -0.5, 0.0, 0.5, 1.0, 3.0, math.inf, math.nan])


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 5).flatmap(lambda rows: st.integers(1, 40).flatmap(
    lambda vocab: st.lists(st.lists(VALUES, min_size=vocab, max_size=vocab), min_size=rows, max_size=rows))))
def test_greedy_ids_is_torch_argmax_with_ties_and_nan(rows):
    logits = torch.tensor(rows, dtype=torch.float32)
    assert greedy_ids(logits) == logits.argmax(-1).tolist()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_greedy_ids_takes_half_precision(dtype):
    logits = (torch.randn(6, 3000) * 4).to(dtype)
    logits[0, 7] = logits[0, 9] = logits[0].max() + 1  # a tie: the first one wins
    assert greedy_ids(logits) == logits.argmax(-1).tolist()
    assert greedy_ids(logits)[0] == 7


def test_greedy_ids_takes_logits_that_carry_grad():
    logits = torch.randn(2, 300, requires_grad=True)  # a caller's own forward, outside inference mode
    assert greedy_ids(logits) == logits.argmax(-1).tolist()


KERNEL = load_kernels(progress=False) is not None  # specfree's top_ids op, where it builds


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 9), vocab=st.sampled_from([97, 4 * 8 * BLOCK, 4 * 8 * BLOCK + 1, 49152, 50257]),
       k=st.integers(1, 8), seed=st.integers(0, 2**16), levels=st.sampled_from([0, 5]), kernel=st.booleans())
def test_top_ids_are_the_k_largest_largest_first(rows, vocab, k, seed, levels, kernel):
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=generator)
    if levels:  # coarse values: many ties
        logits = (logits * levels).round()
    ids = top_ids(logits, k, kernel=kernel)
    expected = torch.topk(logits, k, dim=-1).values
    assert ids.shape == (rows, k)
    assert torch.equal(logits.gather(1, ids), expected)  # the same values, in the same order
    assert all(len(set(row)) == k for row in ids.tolist())  # k distinct ids per row


@pytest.mark.skipif(not KERNEL, reason="specfree's kernels are not built here (no compiler or no AVX2)")
@settings(max_examples=150, deadline=None)
@given(st.integers(1, 4).flatmap(lambda rows: st.integers(1, 40).flatmap(
    lambda vocab: st.tuples(st.lists(st.lists(VALUES, min_size=vocab, max_size=vocab), min_size=rows, max_size=rows),
                            st.integers(1, vocab)))))
def test_the_top_ids_op_gives_torch_topk_values_with_ties_nan_and_infinities(case):
    """Rows with NaN or fewer than k entries above -inf go to torch.topk; the others keep the lower
    id first among equal values."""
    rows, k = case
    logits = torch.tensor(rows, dtype=torch.float32)
    ids = torch.ops.specfree.top_ids(logits, k)
    expected = torch.topk(logits, k, dim=-1).values
    got = logits.gather(1, ids)
    assert torch.equal(got.nan_to_num(7.0), expected.nan_to_num(7.0))
    assert all(len(set(row)) == k for row in ids.tolist())
    for row, picked in zip(logits, ids.tolist()):
        if not row.isnan().any() and (row > -math.inf).sum() >= k:
            for a, b in zip(picked, picked[1:]):
                assert row[a] > row[b] or a < b  # equal values: the lower id first


@pytest.mark.skipif(not KERNEL, reason="specfree's kernels are not built here (no compiler or no AVX2)")
def test_the_top_ids_op_refuses_a_k_it_cannot_keep():
    with pytest.raises(RuntimeError, match="k must be in"):
        torch.ops.specfree.top_ids(torch.zeros(2, 100), 65)
