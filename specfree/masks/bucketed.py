"""Static-shape step layouts for a compiled forward: rows padded to a few bucket sizes, the mask
spanning every preallocated KV slot.

A compiled graph serves one shape, so a step's Q rows are padded up to the next bucket (1, 2, 4,
8, 16, 32) and its mask covers the whole static cache, not just the filled part. Padding must
never change a real row: a padding row sees the committed cache and itself (a row that sees
nothing would give NaN, and NaN times a zero attention weight is still NaN), no real row sees a
padding row, and the adapter never keeps a padding row's KV.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specfree.masks.tree import additive_mask

ROW_BUCKETS = (1, 2, 4, 8, 16, 32)


def bucket_for(rows: int, buckets: Sequence[int] = ROW_BUCKETS) -> int | None:
    """The smallest bucket that holds ``rows``, or None when none does."""
    return next((b for b in buckets if b >= rows), None)


def pad_rows(tokens: torch.Tensor, allowed: torch.Tensor, positions: torch.Tensor, bucket: int,
             pad_token: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``tokens`` [Q], ``allowed`` [Q, Q], ``positions`` [Q] padded to ``bucket`` rows.

    Padding rows take the root's position and see only themselves among the new rows.
    """
    q = tokens.numel()
    if bucket == q:
        return tokens, allowed, positions
    pad = bucket - q
    tokens = torch.cat([tokens, tokens.new_full((pad,), pad_token)])
    positions = torch.cat([positions, positions[:1].expand(pad)])
    padded = torch.eye(bucket, dtype=torch.bool)  # [bucket, bucket]
    padded[:q, :q] = allowed
    return tokens, padded, positions


def static_mask(allowed: torch.Tensor, past_len: int, positions: torch.Tensor, capacity: int,
                dtype: torch.dtype, sliding_window: int | None = None) -> torch.Tensor:
    """[1, 1, Q, capacity] additive mask: ``additive_mask`` over the filled slots, the empty rest hidden."""
    q = allowed.shape[0]
    mask = torch.full((1, 1, q, capacity), torch.finfo(dtype).min, dtype=dtype)
    mask[..., : past_len + q] = additive_mask(allowed, past_len, positions, dtype, sliding_window)
    return mask
