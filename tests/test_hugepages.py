"""Packed weights on transparent huge pages: the arena's tensors, and packing into them."""

from __future__ import annotations

import math
import mmap
import re

import pytest
import torch

from specfree.kernels.hugepages import ALIGN, HugePageArena, huge_pages_offered
from specfree.kernels.panels import pack


def _mapping_of(address: int) -> list[str]:
    """The lines of /proc/self/smaps describing the mapping that holds ``address``."""
    with open("/proc/self/smaps", encoding="utf-8") as smaps:
        lines = smaps.read().splitlines()
    heads = [i for i, line in enumerate(lines) if re.match(r"[0-9a-f]+-[0-9a-f]+ ", line)]
    for i, j in zip(heads, heads[1:] + [len(lines)]):
        low, high = (int(x, 16) for x in lines[i].split()[0].split("-"))
        if low <= address < high:
            return lines[i:j]
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.parametrize("enabled", [True, False])
def test_tensors_are_aligned_disjoint_and_their_own(enabled):
    arena = HugePageArena(chunk_bytes=1 << 20, enabled=enabled)
    shapes = [(3, 5, 16), (7, 11), (1,), (300, 1000), (2, 9, 8)]  # the fourth is larger than a chunk
    tensors = [arena.empty(shape, dtype) for shape, dtype in zip(shapes, [torch.float32, torch.bfloat16] * 3)]
    for i, t in enumerate(tensors):
        assert t.shape == shapes[i] and t.is_contiguous()
        assert t.data_ptr() % ALIGN == 0
        t.fill_(i)
    for i, t in enumerate(tensors):  # no tensor wrote over another
        assert (t == i).all()


@pytest.mark.parametrize("n", [16, 13, 40])
def test_packing_into_the_arena_gives_the_same_panels(n):
    weight = torch.randn(n, 37, dtype=torch.float64).float()
    arena = HugePageArena(chunk_bytes=4096)
    for lanes in (8, 16):
        assert torch.equal(pack(weight, lanes, arena), pack(weight, lanes))


def test_the_setting_decides(tmp_path):
    setting = tmp_path / "enabled"
    setting.write_text("always madvise [never]\n")
    assert not huge_pages_offered(setting)
    setting.write_text("always [madvise] never\n")
    assert huge_pages_offered(setting) == hasattr(mmap, "MADV_HUGEPAGE")
    assert not huge_pages_offered(tmp_path / "missing")


@pytest.mark.skipif(not huge_pages_offered(), reason="this kernel offers no transparent huge pages")
def test_the_memory_is_advised_for_huge_pages():
    tensor = HugePageArena().empty((1 << 20,), torch.float32)  # 4 MB
    tensor.fill_(1.0)
    mapping = _mapping_of(tensor.data_ptr())
    # The advice, not whether the kernel found free huge pages this time: that depends on the machine.
    assert any(line.split() == ["THPeligible:", "1"] for line in mapping), mapping[:3]
    assert any(line.startswith("VmFlags:") and " hg" in line for line in mapping), mapping[-1:]


def test_a_reservation_holds_the_tensors_that_follow_in_one_mapping():
    arena = HugePageArena(chunk_bytes=1 << 20, enabled=True)
    sizes = [(40, 576, 16), (3, 100, 8), (7,)]
    arena.reserve([4 * math.prod(shape) for shape in sizes])
    if not arena.enabled:
        pytest.skip("anonymous memory could not be mapped here")
    tensors = [arena.empty(shape, torch.float32) for shape in sizes]  # 1.5 MB: beyond one 1 MB chunk
    base = tensors[0].untyped_storage().data_ptr()
    assert all(t.untyped_storage().data_ptr() == base for t in tensors)  # the same mapping
    assert arena._used == sum(-(-4 * math.prod(s) // ALIGN) * ALIGN for s in sizes)


def test_packing_a_model_sizes_its_panels_exactly():
    from torch import nn

    from transformers.pytorch_utils import Conv1D

    from specfree.kernels.panels import PanelConv1D, PanelLinear, panel_bytes

    layers = [(nn.Linear(37, 13), PanelLinear), (nn.Linear(64, 48, bias=False).bfloat16(), PanelLinear),
              (Conv1D(21, 10), PanelConv1D)]  # Conv1D(out, in): its weight is [in, out]
    for layer, kind in layers:
        for lanes in (8, 16):
            packed = kind(layer, lanes)
            assert panel_bytes(layer, lanes) == packed.panels.numel() * packed.panels.element_size()
