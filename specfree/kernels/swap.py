"""Swapping a model's layers for specfree's (and back), in place, without copying parameters."""

from __future__ import annotations

import contextlib

from torch import nn


def swap_modules(model: nn.Module, convert) -> int:
    """Replace every submodule for which ``convert`` returns a module; returns how many."""
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            new = convert(child)
            if new is not None:
                setattr(parent, name, new)
                swapped += 1
    return swapped


@contextlib.contextmanager
def swapped_modules(model: nn.Module, convert):
    """The modules ``convert`` replaces inside the block, the originals back after it."""
    originals: dict[int, nn.Module] = {}

    def swap(module):
        new = convert(module)
        if new is not None:
            originals[id(new)] = module
        return new

    swap_modules(model, swap)
    try:
        yield model
    finally:
        swap_modules(model, lambda m: originals.get(id(m)))
