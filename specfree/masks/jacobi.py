"""The Jacobi lookahead window as auxiliary rows: which cell sees which, and where it sits.

The window (Fu et al. 2024, "Break the Sequential Dependency of LLM Inference Using Lookahead
Decoding", the attention-mask figure) is a grid of ``levels`` x ``columns`` cells::

    level 2     c20  c21  c22  c23        newest Jacobi iterate (its logits make the next level)
    level 1     c10  c11  c12  c13
    level 0    root  c01  c02  c03        oldest iterate; cell (0, 0) is the tree's root row
    offset      0    1    2    3   (+ level)

Cell (l, j) guesses the token at offset ``l + j`` after the root. It sees the committed
cache, the root, the first level up to its own column (cells (0, 1..j)) and its own column's
levels up to itself (cells (1..l, j)): positions root+0, +1, ..., +l+j, one token each, so
every cell reads one consistent left-to-right sequence. Column j read top-down after its
first-level cell is an n-gram: key (0, j), then (1, j), ..., (levels-1, j), then the token
the newest cell predicts.

Rows are level-major, as in the reference implementation: level 0 columns 1..C-1, then
level 1 columns 0..C-1, and so on; the newest level's rows come last.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class WindowBlock:
    attends: torch.Tensor  # [A, A] bool: aux row i sees aux row k (all rows also see root + cache)
    offsets: list[int]  # [A] position offset from the root
    levels: np.ndarray  # [A] level of each row
    columns: np.ndarray  # [A] column of each row
    top: int  # the last ``top`` rows are the newest level, in column order

    def __len__(self) -> int:
        return len(self.offsets)


@functools.lru_cache(maxsize=128)
def window_block(columns: int, levels: int) -> WindowBlock:
    """The aux block of a ``levels`` x ``columns`` window (cell (0, 0), the root, is not a row).

    Cached: the same shape recurs every step, and callers must not modify the result.
    """
    if columns < 1 or levels < 1:
        raise ValueError(f"a Jacobi window needs columns >= 1 and levels >= 1, got {columns} x {levels}")
    lev, col = np.divmod(np.arange(1, levels * columns), columns)  # [A], skipping (0, 0)
    sees_first_level = (lev[None, :] == 0) & (col[None, :] <= col[:, None])
    sees_own_column = (lev[None, :] >= 1) & (col[None, :] == col[:, None]) & (lev[None, :] <= lev[:, None])
    attends = torch.from_numpy(sees_first_level | sees_own_column)  # [A, A]
    lev.setflags(write=False)
    col.setflags(write=False)
    top = columns - 1 if levels == 1 else columns
    return WindowBlock(attends, (lev + col).tolist(), lev, col, top)


def max_offset(columns: int, levels: int) -> int:
    """The furthest offset a window cell sits from the root."""
    return columns - 1 + levels - 1
