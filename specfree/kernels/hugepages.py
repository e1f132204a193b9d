"""Memory for packed weights on transparent huge pages, where Linux offers them.

A verify step streams every weight once. On 4 KB pages each stream crosses a page every 4 KB: a
TLB miss, and a restart of the hardware prefetcher, which stops at page boundaries. Packed into
2 MB pages instead, SmolLM2's 211 linears ran 8-9% faster at 1-8 rows (5% at 16) on the Intel
Xeon VM (family 6 model 167, AVX-512), and the read pass the curves are measured against by as much.

Most distributions set transparent huge pages to ``madvise``: memory gets them only when asked.
``HugePageArena`` asks: it maps anonymous memory (one mapping ``reserve``d for the tensors to come,
else chunks), advises ``MADV_HUGEPAGE`` and hands out 64-byte-aligned tensors from it in order. Where the platform has no such advice, or it is
refused, it hands out ordinary ``torch.empty`` tensors, so callers never need to know.
"""

from __future__ import annotations

import math
import mmap
from pathlib import Path

import torch

HUGE_PAGE = 2 << 20
ALIGN = 64  # one cache line: what the kernels' vector loads expect
CHUNK = 256 << 20  # per mapping (virtual until written); a larger tensor gets a mapping of its own


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def huge_pages_offered(setting: Path = Path("/sys/kernel/mm/transparent_hugepage/enabled")) -> bool:
    """Whether ``MADV_HUGEPAGE`` can take effect here (Linux, the setting not ``[never]``)."""
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        return "[never]" not in setting.read_text()
    except OSError:
        return False


class HugePageArena:
    """Hands out tensors that live on huge pages: each a slice of a chunk of anonymous memory advised
    ``MADV_HUGEPAGE``. Pages are backed only as they are written, so a chunk's unused tail costs
    nothing beyond the huge page it ends in. A chunk is freed when no tensor of it is left."""

    def __init__(self, chunk_bytes: int = CHUNK, enabled: bool | None = None):
        self.chunk_bytes = chunk_bytes
        self.enabled = huge_pages_offered() if enabled is None else enabled
        self._chunk: torch.Tensor | None = None  # uint8, starts on a huge-page boundary
        self._used = 0

    def reserve(self, sizes: list[int]) -> None:
        """Map room for tensors of these byte sizes now, as one mapping: the tensors that follow then
        leave no partly used chunk behind (each costs up to a huge page of memory, and a pickled
        model would carry its unused tail)."""
        total = sum(map(_aligned, sizes))
        if self.enabled and total > 0:
            self._new_chunk(total)

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        nbytes = math.prod(shape) * dtype.itemsize
        if not self.enabled or nbytes == 0:
            return torch.empty(shape, dtype=dtype)
        full = self._chunk is None or self._used + nbytes > self._chunk.numel()
        if full and not self._new_chunk(max(self.chunk_bytes, nbytes)):
            return torch.empty(shape, dtype=dtype)
        out = self._chunk[self._used:self._used + nbytes].view(dtype).view(shape)
        self._used += _aligned(nbytes)
        return out

    def _new_chunk(self, nbytes: int) -> bool:
        """Start handing out from a new mapping of ``nbytes``; where it is refused, stop asking."""
        chunk = self._map(nbytes)
        if chunk is None:
            self.enabled = False
            return False
        self._chunk, self._used = chunk, 0
        return True

    @staticmethod
    def _map(nbytes: int) -> torch.Tensor | None:
        """``nbytes`` of anonymous memory starting on a huge-page boundary, advised; None if refused."""
        try:
            # Private: shared anonymous memory is shmem, which takes huge pages only by another setting.
            region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            region.madvise(mmap.MADV_HUGEPAGE)
        except (OSError, ValueError):
            return None
        memory = torch.frombuffer(region, dtype=torch.uint8)  # the tensor keeps the mapping alive
        start = -memory.data_ptr() % HUGE_PAGE
        return memory[start:start + nbytes]
