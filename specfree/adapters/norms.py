"""RMSNorm layers computed by one call to ``torch.rms_norm``: the same arithmetic, fewer dispatches.

transformers spells a Llama-style RMSNorm out as about eight tensor operations, each a trip through
Python and the dispatcher. ``torch.rms_norm`` runs the same operations in one call; on the CPU
(where torch composes it from the same ops) its results are bit-identical, and each layer is
checked before it is swapped. SmolLM2-135M has 61 norms: ~1.5 ms of a ~42 ms one-row forward on
this project's 2-core CPU. Families whose norm computes something else (Gemma's ``1 + weight``)
fail the check and keep their own.

Where specfree's library is loaded the call goes through its op ``specfree::rms_norm`` (ATen's
same kernel): Inductor would otherwise generate its own reduction, whose sum of squares rounds
differently, and a compiled step would not have the eager step's bits (``pinned.py``). A model
whose coded layers run int8 (``own_norms``) takes specfree's own row kernel instead,
``specfree::rms_norm_rows``: one pass a row in a fixed order, a tenth of SmolLM2's compiled one-row
step faster than ATen's ten dispatched ops, and other last bits than transformers', which int8's
output is not anyway.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from specfree.kernels.build import has_op
from specfree.kernels.swap import swap_modules, swapped_modules


class FusedRMSNorm(nn.Module):
    """A Llama-style RMSNorm sharing the original's weight (the state dict is unchanged)."""

    def __init__(self, norm: nn.Module, eps: float):
        super().__init__()
        self.weight = norm.weight
        self.eps = eps
        self.pinned = has_op("rms_norm")  # through specfree's op: a compiled step calls it as it is
        self.own = False  # specfree's row kernel (``own_norms``) instead of ATen's arithmetic
        self.__dict__["original"] = norm  # not a submodule: its weight is already registered here

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self._parameters["weight"]
        if self.own:
            return torch.ops.specfree.rms_norm_rows(x, weight, self.eps)
        if self.pinned:
            return torch.ops.specfree.rms_norm(x, weight, self.eps)
        return torch.rms_norm(x, weight.shape, weight, self.eps)

    def to_original(self) -> nn.Module:
        """The layer this one replaced, holding this one's weight (which may have been replaced)."""
        self.original.weight = self.weight
        return self.original


def _epsilon(norm: nn.Module) -> float | None:
    for name in ("variance_epsilon", "eps"):
        value = getattr(norm, name, None)
        if isinstance(value, float):
            return value
    return None


@torch.inference_mode()
def _fused(module: nn.Module) -> FusedRMSNorm | None:
    """The fused twin of ``module`` if it is an fp32 CPU RMSNorm, not fused yet, whose outputs the
    twin matches bit for bit on random probes, else None."""
    # Straight from the parameters: a packed layer's ``weight`` is an unpacked copy made per read.
    weight = module._parameters.get("weight")
    eps = _epsilon(module)
    if (isinstance(module, FusedRMSNorm) or not type(module).__name__.endswith("RMSNorm")
            or not isinstance(weight, nn.Parameter) or eps is None or weight.dim() != 1
            or weight.device.type != "cpu" or weight.dtype != torch.float32
            or len(module._parameters) != 1 or any(True for _ in module.children())
            or module._forward_hooks or module._forward_pre_hooks):
        return None
    fused = FusedRMSNorm(module, eps)
    generator = torch.Generator().manual_seed(0)
    for scale in (1e-3, 1.0, 30.0):
        x = torch.randn(1, 3, weight.numel(), generator=generator) * scale
        try:
            if not torch.equal(module(x), fused(x)):
                return None
        except (RuntimeError, TypeError):  # a norm with other arguments or shapes
            return None
    return fused


def own_norms(model: nn.Module, own: bool) -> int:
    """The model's fused norms on specfree's row kernel (``own``, where the library has it) or on
    ATen's arithmetic (transformers' bits); returns how many norms run the row kernel."""
    own = own and has_op("rms_norm_rows")
    norms = [m for m in model.modules() if isinstance(m, FusedRMSNorm)]
    for norm in norms:
        norm.own = own
    return len(norms) if own else 0


def fuse_norms(model: nn.Module) -> int:
    """Swap the model's RMSNorm layers for ``FusedRMSNorm`` where bit-identical; returns how many."""
    return swap_modules(model, _fused)


@contextlib.contextmanager
def fused_norms(model: nn.Module):
    """Fused norms inside the block and the model's own after it, for callers that borrow a model."""
    with swapped_modules(model, _fused):
        yield model


@contextlib.contextmanager
def stock_norms(model: nn.Module):
    """The model's own norm layers inside the block (for baselines that must be stock)."""
    with swapped_modules(model, lambda m: m.to_original() if isinstance(m, FusedRMSNorm) else None):
        yield model
