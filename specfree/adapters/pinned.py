"""Rotary embeddings and activations computed by specfree's ops, so a compiled step has the eager step's bits.

Inductor generates its own code for what it compiles, and its cos, sin, erf and tanh round
differently from ATen's kernels (torch 2.13: 1 ulp on some rotary entries, GELU on 40% of values).
At int8 such a last bit can move an activation across a rounding boundary of its 8-bit code, so
the compiled and eager loops chose different tokens. Each layer here is a twin of a transformers
layer that calls an op of specfree's library (``pinned_ops.cpp``): the op calls the ATen kernel
the eager layer calls, and Inductor cannot look inside it, so both paths compute the same bits.
RMSNorms get the same treatment in ``norms.FusedRMSNorm``.

A twin is swapped in only where it gives the original's outputs bit for bit on probes; a layer of
another formula (dynamic or per-layer rotary types, other activations) keeps its own. Without the
library (no compiler, or no AVX2) nothing is swapped: eager results are the same either way.
"""

from __future__ import annotations

import contextlib
import inspect

import torch
from torch import nn

from specfree.kernels.build import has_op
from specfree.kernels.swap import swap_modules, swapped_modules

ACTIVATIONS = ("silu", "gelu", "gelu_tanh")  # what specfree::activation computes
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")  # inv_freq fixed at construction


class PinnedRotary(nn.Module):
    """transformers' default rotary embedding, its cos/sin from ``specfree::rotary``."""

    def __init__(self, rotary: nn.Module):
        super().__init__()
        self.inv_freq = rotary.inv_freq  # the same buffer (shared, not copied)
        self.attention_scaling = float(rotary.attention_scaling)
        self.__dict__["original"] = rotary  # not a submodule: its buffer is registered here

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # position_ids [B, T] -> cos, sin [B, T, head_dim] in x's dtype
        return torch.ops.specfree.rotary(position_ids, self.inv_freq, self.attention_scaling, x.dtype)

    def to_original(self) -> nn.Module:
        return self.original


class PinnedActivation(nn.Module):
    """An activation layer computed by ``specfree::activation`` under ``name``."""

    def __init__(self, activation: nn.Module, name: str):
        super().__init__()
        self.name = name
        self.__dict__["original"] = activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.specfree.activation(x, self.name)

    def to_original(self) -> nn.Module:
        return self.original

    def extra_repr(self) -> str:
        return self.name


def _probe_equal(original, twin, *args) -> bool:
    try:
        ours, theirs = twin(*args), original(*args)
    except (RuntimeError, TypeError, ValueError):  # a layer of other arguments or shapes
        return False
    ours, theirs = (ours, theirs) if isinstance(ours, tuple) else ((ours,), (theirs,))
    return len(ours) == len(theirs) and all(isinstance(t, torch.Tensor) and a.dtype == t.dtype and torch.equal(a, t)
                                            for a, t in zip(ours, theirs))


def _rotary_twin(module: nn.Module) -> PinnedRotary | None:
    inv_freq = module._buffers.get("inv_freq")
    if (not type(module).__name__.endswith("RotaryEmbedding") or inv_freq is None or inv_freq.device.type != "cpu"
            or getattr(module, "rope_type", None) not in STATIC_ROPE_TYPES
            or not isinstance(getattr(module, "attention_scaling", None), (int, float))
            or list(inspect.signature(module.forward).parameters)[:2] != ["x", "position_ids"]):
        return None
    twin = PinnedRotary(module)
    generator = torch.Generator().manual_seed(0)
    positions = torch.cat([torch.arange(8), torch.randint(0, 1 << 17, (24,), generator=generator)])[None]
    x = torch.zeros(1, 1, 1, dtype=torch.float32)
    # positions of another rank too: a multimodal rotary (Qwen3.5's) reads a [3, B, T] grid its own way
    same = all(_probe_equal(module, twin, x, p) for p in (positions, positions.expand(3, 1, -1)))
    return twin if same else None


def _activation_twin(module: nn.Module) -> PinnedActivation | None:
    if (not (type(module).__module__.startswith("transformers.activations")
             or isinstance(module, (nn.SiLU, nn.GELU)))
            or any(True for _ in module.parameters())):
        return None
    generator = torch.Generator().manual_seed(0)
    x = torch.cat([torch.randn(4096, generator=generator) * scale for scale in (1e-3, 1.0, 8.0)])
    return next((twin for name in ACTIVATIONS if _probe_equal(module, twin := PinnedActivation(module, name), x)),
                None)


@torch.inference_mode()
def _pinned(module: nn.Module) -> nn.Module | None:
    if isinstance(module, (PinnedRotary, PinnedActivation)):
        return None
    return _rotary_twin(module) or _activation_twin(module)


def pin_math(model: nn.Module) -> int:
    """Swap the model's rotary embedding and activations for their pinned twins where those give the
    same bits and specfree's library is loaded; returns how many were swapped."""
    if not (has_op("rotary") and has_op("activation")):
        return 0
    return swap_modules(model, _pinned)


@contextlib.contextmanager
def stock_math(model: nn.Module):
    """The model's own rotary and activation layers inside the block (for baselines that must be stock)."""
    with swapped_modules(model, lambda m: m.to_original() if isinstance(m, (PinnedRotary, PinnedActivation))
                         else None):
        yield model
