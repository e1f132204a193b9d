"""Tree attention for the rows of one step over the KV store, each row's bits independent of the
others (``tree_attention.cpp``: keys in position order, hidden keys skipped, an exact max).

``tree_attention`` runs the C++ op (``load_kernels`` first) or, with ``backend="library"``, the
same masked softmax in torch ops: the fallback where the op cannot be built, equal to rounding
but without the bit-identity guarantee.
"""

from __future__ import annotations

import torch

ATTENTION_BACKENDS = ("kernel", "library")
# A forward of more rows is a long prefill, not a verify step: attention goes to SDPA (0.43 s
# against 0.19 s for 512 rows of SmolLM2 on a Zen 3), which does not keep rows batch-invariant;
# only verify rows need that.
LONG_ROWS = 160


def visible(mask: torch.Tensor | None, rows: int, keys: int) -> torch.Tensor:
    """[B or 1, 1, Q, S] bool: which keys each row sees (``mask``: bool, or additive float where
    -inf or the dtype's lowest value hides a key; None: causal, the last row on the last key)."""
    if mask is None:
        return torch.ones(rows, keys, dtype=torch.bool).tril(keys - rows)[None, None]
    if mask.dtype == torch.bool:
        return mask
    return mask >= -0.5 * torch.finfo(torch.float32).max


def library_tree_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           mask: torch.Tensor | None, scale: float, softcap: float = 0.0) -> torch.Tensor:
    """The op's result in torch ops (same masking, library rounding): [B, H, Q, D] -> [B, Q, H, D]."""
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    seen = visible(mask, query.shape[2], key.shape[2]).to(query.device)
    scores = (query @ key.transpose(-1, -2)) * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    if mask is not None and mask.dtype != torch.bool:
        scores = scores + mask.float().masked_fill(~seen, 0)
    scores = scores.masked_fill(~seen, float("-inf"))
    weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a row that sees nothing: zeros
    return (weights @ value).transpose(1, 2).contiguous()


def tree_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
                   scale: float, backend: str = "kernel", isa: str = "auto", softcap: float = 0.0) -> torch.Tensor:
    """Attention of ``query`` [B, H, Q, D] over ``key``/``value`` [B, Hkv, S, D] (H a multiple of
    Hkv) under ``mask`` [B or 1, 1, Q, S]; returns [B, Q, H, D]. ``backend``: ``"kernel"`` (the C++
    op; ``isa`` ``"auto"``, ``"avx2"`` or ``"avx512"``) or ``"library"`` (torch ops). ``softcap``
    > 0: each score becomes ``softcap * tanh(score / softcap)`` before the mask's values are added
    (Gemma 2's logit soft-capping); 0: none."""
    if backend == "library":
        return library_tree_attention(query, key, value, mask, scale, softcap)
    return torch.ops.specfree.tree_attention(query, key, value, mask, scale, isa, softcap)
