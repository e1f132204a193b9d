"""Ahead-of-time compiled steps (AOTInductor packages): a compiled forward that a new process
loads in about a second instead of compiling for minutes.

One package serves one row count (a bucket) over any number of KV slots: it is exported with
``torch.export`` from a small module (``SlotStep``) whose inputs are the token ids, their
positions, the additive mask, the slots the new rows go to, and the KV buffers themselves, which
it writes in place. The slot dimension is left dynamic (the matrix shapes, where the time goes,
stay static), so one package serves every KV tier. The buffers are passed whole: a view of their
first slots would not be contiguous, and export guards on the layout it traced.

The weights are frozen into the package, so a package belongs to one set of weights: its folder
name carries a fingerprint of them (``weights_fingerprint``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path

import torch
from transformers.cache_utils import Cache, StaticLayer


class SlotLayer(StaticLayer):
    """A static KV layer over given buffers [1, H, slots, D] that writes a step's rows at
    ``slot_index`` [Q] and leaves its length to the caller (the adapter keeps it)."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, slot_index: torch.Tensor):
        super().__init__(max_cache_len=keys.shape[2])
        self.keys, self.values, self.slot_index = keys, values, slot_index
        self.dtype, self.device = keys.dtype, keys.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        self.keys.index_copy_(2, self.slot_index, key_states)
        self.values.index_copy_(2, self.slot_index, value_states)
        return self.keys, self.values


class SlotStep(torch.nn.Module):
    """One decoding step as a function of plain tensors (what ``torch.export`` needs)."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, ids, positions, mask, slot_index, kv: list[torch.Tensor]) -> torch.Tensor:
        # ids, positions [1, Q]; mask [1, 1, Q, slots] (or a dict per layer kind); slot_index [Q];
        # kv: keys and values of each layer, [1, H, slots, D] -> logits [1, Q, V]
        cache = Cache(layers=[SlotLayer(kv[i], kv[i + 1], slot_index) for i in range(0, len(kv), 2)])
        return self.model(input_ids=ids, position_ids=positions, attention_mask=mask, past_key_values=cache,
                          use_cache=True).logits


def weights_fingerprint(model: torch.nn.Module, samples: int = 4096) -> str:
    """A short hash of the model's weights: names, shapes and a strided sample of each tensor's
    values (hashing every byte of a large model would take seconds)."""
    digest = hashlib.sha1()
    for name, tensor in model.state_dict().items():
        flat = tensor.detach().reshape(-1)
        step = max(1, flat.numel() // samples)
        digest.update(f"{name}{tuple(tensor.shape)}{tensor.dtype}".encode())
        digest.update(flat[::step].float().cpu().numpy().tobytes())
    return digest.hexdigest()[:16]


def package_name(rows: int) -> str:
    return f"rows{rows}.pt2"


def slot_dynamic_shapes(example: tuple) -> tuple:
    """``torch.export``'s dynamic_shapes for ``SlotStep``'s inputs: the slot dimension of the
    mask(s) and of every KV buffer is free, everything else static."""
    ids, positions, mask, slot_index, kv = example
    slots = torch.export.Dim("slots", min=2, max=1 << 20)
    masks = {kind: {3: slots} for kind in mask} if isinstance(mask, dict) else {3: slots}
    return None, None, masks, None, [{2: slots}] * len(kv)


def build_package(model: torch.nn.Module, example: tuple, path: Path, options: dict) -> None:
    """Export ``SlotStep(model)`` at ``example``'s shapes (any slot count) and compile it with
    Inductor ``options`` into the package ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f"partial-{path.name}")
    with torch.no_grad():
        program = torch.export.export(SlotStep(model), example, dynamic_shapes=slot_dynamic_shapes(example),
                                      strict=False)
        torch._inductor.aoti_compile_and_package(program, package_path=str(partial), inductor_configs=options)
    partial.replace(path)  # a package on disk is always whole: an interrupted build leaves only partial-*


def load_package(path: Path):
    """The callable in package ``path``: (ids, positions, mask, slot_index, kv) -> logits."""
    return torch._inductor.aoti_load_package(str(path))


class PackageShelf:
    """The packages of one model's steps, compiled with Inductor ``options``: loaded from
    ``package_dir`` when there, else built and kept there. ``package_dir=None`` builds into a
    temporary folder that goes with the shelf."""

    def __init__(self, model: torch.nn.Module, package_dir: str | Path | None, options: dict):
        self.model, self.options = model, options
        if package_dir is None:
            import tempfile

            self._temporary = tempfile.TemporaryDirectory(prefix="specfree-packages-")
            package_dir = self._temporary.name
        # Packages hold kernels tuned for one thread count, torch build and set of Inductor options,
        # and the weights themselves.
        setup = f"{weights_fingerprint(model)}-{model.dtype}-{torch.get_num_threads()}t-torch{torch.__version__}"
        self.folder = Path(package_dir) / hashlib.sha1(f"{setup}-{sorted(options.items())}".encode()).hexdigest()[:16]
        self.built = self.loaded = 0
        self._runners: dict[int, object] = {}

    def path(self, rows: int) -> Path:
        return self.folder / package_name(rows)

    def ready(self, rows: Sequence[int]) -> bool:
        """Whether every one of these row counts is on disk (loading them takes seconds)."""
        return all(self.path(r).is_file() for r in rows)

    def get(self, rows: int, example: tuple):
        """The runner for ``rows``; ``example`` inputs shape a build when none is on disk."""
        runner = self._runners.get(rows)
        if runner is None:
            path = self.path(rows)
            if not path.is_file():
                build_package(self.model, example, path, self.options)
                self.built += 1
            else:
                self.loaded += 1
            runner = self._runners[rows] = load_package(path)
        return runner
