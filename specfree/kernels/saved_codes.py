"""Codes found once and loaded after, never trusted without the exact check.

``find_codes`` searches SmolLM2's 211 weights in about 3 s, half of a load. ``SavedCodes`` keeps
what it found in one file per model (``<cache>/codes/``) and, on the next load, takes each layer's
saved codes only if decoding them gives that layer's float32 weight back bit for bit (0.3 s for
SmolLM2), else searches again. A file that is missing, unreadable, truncated or from other weights
costs the search, never a wrong weight. The file is found by a digest of a sample of each weight;
the sample only names the file, the exact check decides.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch
from torch import nn

from specfree.files import atomic_path, fingerprint
from specfree.kernels.codes import CodedConv1D, CodedLinear, Codes, decodes_to, find_codes
from specfree.kernels.panels import is_conv1d

LAYOUT = 2  # the codes' layout (2: eight 4-bit codes a word, float16 scales); other files are ignored
KEEP = 4  # files kept, the newest: one a model, about a fifth of its float32 bytes each
SAMPLE = 4096  # values of each weight that name its file


def weight_digest(weight: torch.Tensor) -> str:
    """A short name for ``weight`` from its shape, dtype and an even sample of its values."""
    flat = weight.detach().reshape(-1)
    sample = flat[:: max(1, flat.numel() // SAMPLE)].contiguous().view(torch.uint8)
    return fingerprint(list(weight.shape), str(weight.dtype), hashlib.sha1(sample.numpy().tobytes()).hexdigest())


class SavedCodes:
    """``pack_linears``' coder for one model: a layer's codes from the file where they decode to its
    weight exactly, else from ``find_codes``; ``save()`` writes what was searched."""

    def __init__(self, path: Path):
        self.path = path
        self.saved = self._read()
        self.codes: dict[str, Codes] = {}  # this model's, by weight digest
        self.loaded = self.searched = 0
        self.found = 0  # searches that found codes: what the file does not hold yet

    @classmethod
    def for_model(cls, model: nn.Module, fits, lanes: int, root: Path) -> SavedCodes:
        """The file of ``model``'s weights that ``fits`` accepts, in panels of ``lanes``, under ``root``."""
        digests = [weight_digest(m.weight) for m in model.modules() if fits(m)]
        return cls(root / "codes" / f"{fingerprint(LAYOUT, lanes, digests)}.pt")

    def _read(self) -> dict[str, Codes]:
        try:
            entries = torch.load(self.path, weights_only=True)
            return {key: Codes(*parts) for key, parts in entries.items()}
        except Exception:  # missing, truncated, corrupt or another layout: the search runs instead
            return {}

    def __call__(self, module: nn.Module, lanes: int) -> CodedLinear | None:
        weight = module.weight.t() if is_conv1d(module) else module.weight
        key = weight_digest(module.weight)
        coded = self.saved.get(key)
        if coded is not None and _fits(coded, weight, lanes) and _decodes_exactly(coded, weight):
            self.loaded += 1
        else:
            coded = find_codes(weight, lanes)
            self.searched += 1
            self.found += coded is not None
        if coded is None:
            return None
        self.codes[key] = coded
        return (CodedConv1D if is_conv1d(module) else CodedLinear)(module, coded)

    def save(self) -> None:
        """Write this model's codes if a search found some the file lacked (a model without codes,
        or whose layers without codes were only searched again, writes nothing), keeping the newest
        ``KEEP`` files."""
        if not self.found:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(self.path) as tmp:
            torch.save({key: c.tensors() for key, c in self.codes.items()}, tmp)
        for old in sorted(self.path.parent.glob("*.pt"), key=lambda p: p.stat().st_mtime)[:-KEEP]:
            old.unlink(missing_ok=True)


def _decodes_exactly(coded: Codes, weight: torch.Tensor) -> bool:
    try:
        return decodes_to(coded, weight)
    except RuntimeError:  # codes the op refuses (a damaged file): not these
        return False


def _fits(coded: Codes, weight: torch.Tensor, lanes: int) -> bool:
    """Whether ``coded`` has the shape codes of ``weight`` in panels of ``lanes`` would have."""
    n, k = weight.shape
    return (weight.dtype == torch.float32 and coded.codes.dim() == 3 and coded.codes.shape[2] == lanes
            and coded.codes.shape[0] == -(-n // lanes) and coded.scales.shape[1] * 32 == k)
