"""A GGUF's layers as repacked codes, kept on disk beside the file's cached config so that a warm
start memory-maps them instead of unpacking the file's blocks into panels again.

The entry is named by what decides the codes: the folder is the file's own (its digest and the
transformers version, ``loading.gguf_to_folder``), and the file name adds the panel width, the torch
version and the source of the code that repacks (``REPACKING_CODE``). Tensors read back are
memory-mapped copy-on-write: nothing specfree does writes to codes, and the file stays as written.
A file's digest vouches for these codes; codes found by search in float32 weights have no file to
vouch for them and are checked against the weights on every load instead (``kernels.saved_codes``).
"""

from __future__ import annotations

import functools
import pickle
import warnings
from pathlib import Path

import torch

from specfree.files import atomic_path, fingerprint
from specfree.kernels.codes import Codes

# specfree's modules whose code turns a file's blocks into ``Codes``, relative to the package
REPACKING_CODE = ("gguf_model.py", "gguf_layouts.py", "kernels/codes.py", "kernels/gguf_blocks.py",
                  "kernels/panels.py", "stored_codes.py")


@functools.cache
def _repacking_code() -> str:
    root = Path(__file__).resolve().parent
    return fingerprint(*((root / name).read_text() for name in REPACKING_CODE))


class StoredCodes:
    """The codes of one file at one panel width: ``get`` reads a layer's stored codes, or makes
    them and keeps them for ``save``; ``folder=None`` stores nothing."""

    def __init__(self, folder: Path | None, lanes: int):
        self.path = None if folder is None else folder / f"codes-{fingerprint(lanes, torch.__version__, _repacking_code())}.pt"
        self.found = self._read()
        self.made: dict[str, tuple] = {}

    def _read(self) -> dict:
        if self.path is None or not self.path.is_file():
            return {}
        try:
            return torch.load(self.path, mmap=True, weights_only=True)
        except (OSError, RuntimeError, pickle.UnpicklingError) as exc:
            warnings.warn(f"{self.path} could not be read ({exc}); the file's codes are repacked and the "
                          "entry written again", stacklevel=3)
            return {}

    def get(self, name: str, make) -> Codes | None:
        """Tensor ``name``'s codes: stored, else ``make()`` (None: the tensor has no codes)."""
        if name in self.found:
            return Codes(*self.found[name])
        codes = make()
        if codes is not None:
            self.made[name] = codes.tensors()
        return codes

    def save(self) -> None:
        """Write the codes made, once: an entry read is never rewritten (its missing tensors have none)."""
        if self.path is None or self.found or not self.made:
            return
        try:
            with atomic_path(self.path) as tmp:
                torch.save(self.made, tmp)
            for older in self.path.parent.glob("codes-*.pt"):  # an older specfree's or torch's: never read again
                if older != self.path:
                    older.unlink(missing_ok=True)
        except OSError as exc:  # a full or read-only cache costs the next start its repacking, nothing else
            warnings.warn(f"could not keep the repacked codes at {self.path} ({exc}): the next start repacks "
                          "them again", stacklevel=3)
