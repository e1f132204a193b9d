"""Row-wise argmax and top-k over [rows, vocab] logits, cheap on the CPU.

Every step reduces each tree row's logits, about 50k floats, to its argmax (the verifier) and
its top-k (recycling). torch's CPU kernels for both are slow for this shape: on a 2-core Xeon,
8 rows of 49152 took ~0.4 ms for ``argmax`` and ~0.5 ms for ``topk``, about 1.5% of a
SmolLM2-135M step. numpy's argmax is vectorised (~0.03 ms); top-k runs specfree's one-pass op
(``kernels/top_ids.cpp``) where the kernels are built, else first keeps the k blocks with the
largest maxima (~0.1 ms).
"""

from __future__ import annotations

import torch

from specfree.kernels import has_op

BLOCK = 128  # vocabulary entries per block for the two-stage top-k
MAX_KERNEL_K = 64  # the op keeps at most this many per row (kMaxK in top_ids.cpp)


def greedy_ids(logits: torch.Tensor) -> list[int]:
    """The argmax of each row of ``logits`` [T, V]: exactly ``logits.argmax(-1)``, ties and NaN included
    (both take the first maximal entry, and both treat NaN as the maximum)."""
    if logits.device.type != "cpu":
        return logits.argmax(-1).tolist()
    return logits.detach().float().numpy().argmax(-1).tolist()  # .float(): no-op on fp32, exact on fp16/bf16


def top_ids(logits: torch.Tensor, k: int, kernel: bool = True) -> torch.Tensor:
    """[T, k] ids of each row's k largest logits, largest first (ties in any order).

    On the CPU in fp32, specfree's one-pass op (``kernels/top_ids.cpp``, 6-7x faster than torch.topk on
    49152-entry rows) where it is built; ``kernel=False`` forces the library path: each of a row's
    k largest entries lies in a block whose maximum is at least as large, so the k blocks with the
    largest maxima, plus the tail that does not fill a block, hold them all.
    """
    if kernel and logits.device.type == "cpu" and logits.dtype == torch.float32 and k <= MAX_KERNEL_K \
            and has_op("top_ids"):
        return torch.ops.specfree.top_ids(logits.detach(), k)
    rows, vocab = logits.shape
    body = vocab - vocab % BLOCK
    if body < 4 * k * BLOCK:  # too few blocks to save anything
        return torch.topk(logits, k, dim=-1).indices
    blocks = logits[:, :body].view(rows, -1, BLOCK)  # [T, B, BLOCK]
    best = torch.topk(blocks.amax(-1), k, dim=-1).indices  # [T, k] block numbers
    kept = blocks.gather(1, best[..., None].expand(rows, k, BLOCK)).reshape(rows, k * BLOCK)
    columns = (best[..., None] * BLOCK + torch.arange(BLOCK, device=logits.device)).reshape(rows, k * BLOCK)
    if body < vocab:
        kept = torch.cat([kept, logits[:, body:]], dim=1)
        tail = torch.arange(body, vocab, device=logits.device).expand(rows, -1)
        columns = torch.cat([columns, tail], dim=1)
    return columns.gather(1, torch.topk(kept, k, dim=-1).indices)  # [T, k]
