"""The step layout: tokens, position ids and the 4D mask for [root + tree + aux] rows."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from specfree.draft_tree import DraftTree
from specfree.types import AuxBlock


@dataclass
class Layout:
    tokens: torch.Tensor  # [Q] long
    positions: torch.Tensor  # [Q] long
    allowed: torch.Tensor  # [Q, Q] bool: row i may attend to new row j (the cache is always visible)
    num_tree: int  # rows 0..num_tree-1 are the tree (row 0 = root); the rest are aux rows

    @property
    def rows(self) -> int:
        return int(self.tokens.shape[0])


def ancestors(parents: list[int]) -> np.ndarray:
    """[T, T] bool: node i sees node j iff j is i itself or one of its ancestors.

    Parents precede children, so one pass copies the parent's row and adds the diagonal.
    """
    n = len(parents)
    anc = np.eye(n, dtype=bool)
    for i in range(1, n):
        anc[i] |= anc[parents[i]]
    return anc


def build_layout(tree: DraftTree, aux: AuxBlock | None, root_position: int) -> Layout:
    t = len(tree)
    a = 0 if aux is None else len(aux)
    allowed = np.zeros((t + a, t + a), dtype=bool)
    allowed[:t, :t] = ancestors(tree.parents)
    positions = np.empty(t + a, dtype=np.int64)
    positions[:t] = root_position + np.asarray(tree.depths)
    tokens = list(tree.tokens)
    if aux is not None:
        allowed[t:, t:] = aux.attends.numpy()
        allowed[t:, 0] = aux.sees_root
        positions[t:] = root_position + np.asarray(aux.offsets)
        tokens += aux.tokens
    return Layout(
        tokens=torch.tensor(tokens, dtype=torch.long),
        positions=torch.from_numpy(positions),
        allowed=torch.from_numpy(allowed),
        num_tree=t,
    )


def tree_mask() -> Callable[[DraftTree, AuxBlock | None, int], Layout]:
    """The ``mask=tree`` builder: exact-size rows, the tree's ancestor mask plus the aux block."""
    return build_layout


def additive_mask(allowed: torch.Tensor, past_len: int, positions: torch.Tensor, dtype: torch.dtype,
                  sliding_window: int | None = None) -> torch.Tensor:
    """[1, 1, Q, past+Q] additive mask: 0 where a row may attend, dtype-min elsewhere.

    All committed cache entries are visible, except those a sliding-window model would
    have dropped (key position <= query position - window).
    """
    q = allowed.shape[0]
    full = torch.ones(q, past_len + q, dtype=torch.bool)
    full[:, past_len:] = allowed
    if sliding_window is not None and past_len + q > sliding_window:
        key_pos = torch.cat([torch.arange(past_len), positions])
        full &= (positions[:, None] - key_pos[None, :]) < sliding_window
    mask = torch.zeros(full.shape, dtype=dtype)
    mask.masked_fill_(~full, torch.finfo(dtype).min)
    return mask[None, None]
