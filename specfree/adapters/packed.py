"""Linear layers whose weights are packed once for MKL, for the CPU's few-row forwards.

A tree step pushes a few rows through every linear layer. For 2..15 rows MKL's ``sgemm``
takes a path that is slow on this project's 2-core CPU: 8 rows of SmolLM2-135M took ~80 ms
against ~40–47 ms for one. With each weight packed once (``cblas_sgemm_pack``, reached through
torch's ``mkl::_mkl_linear``, which inductor's CPU freezing uses too) 8 rows take ~60 ms.
One-row forwards, memory bound and already cheap, keep transformers' own path, so plain decoding
is unchanged bit for bit; from 16 rows on MKL's own path is as fast and gives the same bits.

Numerics: like any change in row count, packed products round differently from one-row ones
in the last bits; the verifier compares tokens, and the lossless tests check the tokens.

The packed copy costs memory (about 1.7x the linear weights), so ``pack_linears`` only packs
when that fits well within the free memory, unless told to.
"""

from __future__ import annotations

import contextlib
import os

import torch
import torch.nn.functional as F
from torch import nn

from specfree.adapters.swap import swap_modules, swapped_modules

MIN_ROWS = 2  # one row keeps the stock kernel: memory bound, and bit-identical to plain decoding
MAX_ROWS = 15  # from 16 rows on MKL's own path packs too, gives the same bits and was as fast or faster
PACKED_OVER_WEIGHTS = 2.0  # packed bytes per weight byte, rounded up (1.7 measured)
# The op's overload, bound once: resolving ``torch.ops.mkl._mkl_linear`` per call costs more than a
# small product. None where torch was built without MKL (nothing is packed there).
_MKL_LINEAR = getattr(getattr(torch.ops.mkl, "_mkl_linear", None), "default", None)


def mkl_packing_available() -> bool:
    return torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_reorder_linear_weight")


def _version(tensor: torch.Tensor) -> int | None:
    """The count of in-place writes to ``tensor``; None for an inference tensor, which keeps no
    count (made under ``torch.inference_mode``): then only its identity tells a new weight."""
    try:
        return tensor._version
    except RuntimeError:
        return None


class PackedLinear(nn.Linear):
    """An ``nn.Linear`` sharing the original's parameters, plus its weight packed for MKL.

    The state dict is the original's. A weight changed in place (or replaced) is repacked at its
    next multi-row call, so the packed copy is never stale.
    """

    def __init__(self, linear: nn.Linear):
        # meta: no second allocation; the original's parameters are shared, not copied
        super().__init__(linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta",
                         dtype=linear.weight.dtype)
        self.weight, self.bias = linear.weight, linear.bias
        self._pack()

    def _pack(self) -> None:
        weight = self.weight.detach()
        self._packed_from = (self.weight, _version(self.weight))
        self._packed = torch.ops.mkl._mkl_reorder_linear_weight(weight, 8)  # packing ignores the row count

    def __getstate__(self):
        # MKL's packed buffer neither pickles nor deep-copies: copies repack at their first use.
        return {**super().__getstate__(), "_packed": None, "_packed_from": (None, -1)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Called 211 times per forward of SmolLM2, so the checks stay lean: the parameters are read
        # from the dict (``self.weight`` goes through ``nn.Module.__getattr__``), ``is`` on dtypes.
        params = self._parameters
        weight, bias = params["weight"], params["bias"]
        rows = x.numel() // max(1, x.shape[-1])
        if (not MIN_ROWS <= rows <= MAX_ROWS or not x.is_cpu or x.dtype is not torch.float32
                or weight.dtype is not torch.float32
                or (weight.requires_grad and torch.is_grad_enabled())):  # the MKL op has no backward
            return F.linear(x, weight, bias)
        source, version = self._packed_from
        if source is not weight or version != _version(weight):
            self._pack()
        return _MKL_LINEAR(x, self._packed, weight, bias, rows)

    def to_linear(self) -> nn.Linear:
        """A plain ``nn.Linear`` over the same parameters."""
        linear = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, device="meta",
                           dtype=self.weight.dtype)
        linear.weight, linear.bias = self.weight, self.bias
        return linear


def _packable(module: nn.Module) -> bool:
    # Exactly nn.Linear (subclasses may compute something else), fp32 on the CPU, no hooks
    # (accelerate's offloading works through hooks).
    return (type(module) is nn.Linear and module.weight.device.type == "cpu"
            and module.weight.dtype == torch.float32 and not module._forward_hooks
            and not module._forward_pre_hooks)


def _free_bytes() -> int | None:
    """Memory available to a new allocation: Linux's MemAvailable (page cache counts as free),
    else the free pages, else unknown."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # not a platform that reports it
        return None


@torch.inference_mode()
def packing_agrees(linear: nn.Linear, rows=(2, 5, 13, 32)) -> bool:
    """One packed copy serves every row count (what ``PackedLinear`` relies on): true of the MKL
    builds checked so far, and checked here on this machine's MKL before anything is packed."""
    weight = linear.weight.detach()
    x = torch.randn(max(rows), linear.in_features, generator=torch.Generator().manual_seed(0))
    try:
        shared = torch.ops.mkl._mkl_reorder_linear_weight(weight, 8)
        for m in rows:
            own = torch.ops.mkl._mkl_reorder_linear_weight(weight, m)
            out = torch.ops.mkl._mkl_linear(x[:m], shared, weight, linear.bias, m)
            if not torch.equal(out, torch.ops.mkl._mkl_linear(x[:m], own, weight, linear.bias, m)):
                return False
            if not torch.allclose(out, F.linear(x[:m], weight, linear.bias), rtol=1e-4, atol=1e-4):
                return False
    except RuntimeError:  # an MKL build without the packed API
        return False
    return True


def worth_packing(model: nn.Module, force: bool = False) -> bool:
    """Whether ``model`` has layers to pack, on an MKL that packs as expected, and (unless
    ``force``) the packed copies would take at most a quarter of the free memory."""
    if not mkl_packing_available():
        return False
    linears = [m for m in model.modules() if _packable(m)]
    if not linears:
        return False
    weights = sum(m.weight.numel() * m.weight.element_size() for m in linears)
    free = None if force else _free_bytes()
    if free is not None and weights * PACKED_OVER_WEIGHTS > free / 4:
        return False
    return packing_agrees(linears[0])


def pack_linears(model: nn.Module, force: bool = False) -> int:
    """Swap the model's fp32 CPU ``nn.Linear`` layers for ``PackedLinear`` (see ``worth_packing``);
    returns how many."""
    if not worth_packing(model, force):
        return 0
    return swap_modules(model, lambda m: PackedLinear(m) if _packable(m) else None)


def _unpacked(module: nn.Module) -> nn.Linear | None:
    return module.to_linear() if isinstance(module, PackedLinear) else None


def unpack_linears(model: nn.Module) -> int:
    """Undo ``pack_linears``; returns how many layers went back to ``nn.Linear``."""
    return swap_modules(model, _unpacked)


@contextlib.contextmanager
def packed_linears(model: nn.Module, kept: dict[int, PackedLinear]):
    """Packed linear layers inside the block and the model's own layers after it, for callers
    that borrow a model they do not own. ``kept``, a dict the caller holds on to, carries the
    packed layers from one block to the next: only the first block pays for packing."""
    if not kept and not worth_packing(model):
        yield model
        return

    def packed(module):
        if not _packable(module):
            return None
        layer = kept.get(id(module))
        if layer is None or layer.weight is not module.weight:  # a new layer, or new parameters
            layer = kept[id(module)] = PackedLinear(module)
        return layer

    with swapped_modules(model, packed):
        yield model


@contextlib.contextmanager
def stock_linears(model: nn.Module):
    """Plain ``nn.Linear`` layers inside the block (for baselines that must be stock), then the
    packed ones again."""
    with swapped_modules(model, _unpacked):
        yield model
