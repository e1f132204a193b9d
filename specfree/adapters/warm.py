"""A warm start: a GGUF model's compiled step run again without building the model.

An engine on the compiled path builds transformers' model (its modeling code alone takes seconds to
import), swaps specfree's kernels in, probes what the model can do and loads its AOTInductor package,
which holds the whole step. What a later process needs of all that is small: the tensors the package
reads as its weights, the KV layers' shapes, what the probes found (``Capabilities``), the cost
curve's key and the model's generation settings. ``remember`` keeps those beside the package, named
by everything that decides them (``warm_key``: the file's content, the settings that shape the
adapter, the threads, the CPU's features, torch's, transformers' and specfree's code); ``warm_start``
reads them back into a ``WarmAdapter``, and the model is never built.

A warm adapter runs every forward through the package, prompts included, in pieces of at most
``MAX_ROWS`` rows over the same slots. Its rows have the package's bits, which are the eager step's
(``pinned``), and a row's bits do not depend on the other rows of its forward (the row-exact kernels),
so a prompt split into pieces keeps the bits it has in one forward. ``tests/test_warm_start.py``
checks both paths' outputs and logits equal.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import pickle
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from specfree.adapters.capabilities import Capabilities, Windows
from specfree.adapters.hf import HFAdapter
from specfree.adapters.kv_buffers import StaticSlots
from specfree.adapters.packaged import MAX_ROWS, SlotStep, cpu_features, load_package, model_tensors, \
    package_constants, step_leaves
from specfree.adapters.runners import PackageRunner, StepRunner
from specfree.files import atomic_path, fingerprint

RECORD_VERSION = 1
FACTS, CONSTANTS = "facts.json", "constants.pt"
log = logging.getLogger("specfree")


@functools.cache
def specfree_code() -> str:
    """A hash of specfree's Python source: any change to it may change what a record holds."""
    root = Path(__file__).resolve().parents[1]
    return fingerprint(*(path.read_bytes() for path in sorted(root.rglob("*.py"))))


def warm_key(source_folder: Path, settings, attn_implementation: str | None) -> str:
    """The name of the record of a GGUF model whose cached config folder is ``source_folder`` (named by
    the file's digest and transformers' version), run with ``settings`` on this machine."""
    import transformers

    from specfree.kernels import kernel_dir

    shaping = [settings.precision, settings.linear_kernel, settings.adapter_name, attn_implementation]
    return fingerprint(RECORD_VERSION, source_folder.name, shaping, torch.get_num_threads(), torch.__version__,
                       transformers.__version__, cpu_features(), kernel_dir(settings.cache_dir).name, specfree_code())


def record_folder(cache: Path, key: str) -> Path:
    return cache / "compiled" / "warm" / key


class PackagedModel:
    """What a warm start knows of the model whose step the package holds: its config and
    generation settings as read at the first start, its dtype and the package's weights. It has no
    module tree and no forward: nothing on a warm adapter's path calls them."""

    def __init__(self, facts: dict, constants: dict[str, torch.Tensor]):
        from transformers import GenerationConfig

        self.config = SimpleNamespace(**facts["config"])
        self.generation_config = GenerationConfig.from_dict(facts["generation_config"])
        self.dtype = getattr(torch, facts["dtype"])
        self.constants = constants

    def parameters(self):
        """Its weights: the package's constants (where they live says the model's device)."""
        return iter(self.constants.values())


class WarmRunner(StepRunner):
    """The package alone: every forward of at most ``MAX_ROWS`` rows is one call, a larger one (a
    prompt chunk) several in order over the same slots; no eager fallback, since there is no model."""

    eager_prompts = False

    def __init__(self, loader, buckets: list[int], options: dict, package: str | Path):
        self.loader, self.buckets, self._options = loader, tuple(buckets), options
        self.package = Path(package)  # what it runs: a package (``Engine.batch_off`` asks)
        self.cache_name, self.compiled, self.compile_s, self.failure = None, True, 0.0, None
        self.linears = options.get("linears")

    def rows_for(self, rows: int) -> int:
        return rows

    def ready(self) -> bool:
        return True

    def warm_up_rows(self) -> list[int]:
        return [2]

    def warm_up_description(self, rows: int) -> str:
        return "loading the forward's package"

    def _step_logits(self, ids, positions, mask, slots: StaticSlots) -> torch.Tensor:
        return self._pieces(ids, positions, mask, slots, keep_last=False)

    def eager(self, ids, positions, mask, slots: StaticSlots, logits_to_keep: int = 0) -> torch.Tensor:
        return self._pieces(ids, positions, mask, slots, keep_last=logits_to_keep == 1)

    def _pieces(self, ids, positions, mask, slots: StaticSlots, keep_last: bool) -> torch.Tensor:
        # ids, positions [1, B]; mask [1, 1, B, slots] (or one per layer kind): a row sees only rows
        # before it, so the pieces run in order, each writing its KV before the next reads it
        rows, outputs = ids.shape[1], []
        for start in range(0, rows, MAX_ROWS):
            end = min(start + MAX_ROWS, rows)
            rows_mask = ({kind: m[:, :, start:end].contiguous() for kind, m in mask.items()} if isinstance(mask, dict)
                         else mask[:, :, start:end].contiguous())
            slot_index = torch.arange(slots.past + start, slots.past + end, device=ids.device)
            outputs.append(self.loader.boxed_run(step_leaves(ids[:, start:end].clone(), positions[:, start:end].clone(),
                                                             rows_mask, slot_index, slots.buffers))[0])
            if keep_last and end < rows:
                outputs.clear()  # a prompt keeps its last row's logits only
        return outputs[-1][:, -1:] if keep_last else torch.cat(outputs, dim=1)

    @property
    def options(self) -> dict:
        return self._options

    def describe(self) -> str:
        return f"one AOTInductor package for 1-{MAX_ROWS} rows (a warm start: loaded from {self.package})"


class WarmAdapter(HFAdapter):
    """An ``HFAdapter`` over a warm start's package, its facts read from the record."""

    record: Path | None = None  # the folder it was read from

    def __init__(self, model: PackagedModel, runner: WarmRunner, facts: dict, cache_dir):
        self.model, self._facts, self._cache_dir = model, facts, cache_dir
        self.kernel_linears = facts["kernel_linears"]
        self._device = torch.device(facts["device"])
        self._rows_exact = facts["rows_exact"]
        shapes = [(torch.Size(k), torch.Size(v)) for k, v in facts["layer_shapes"]]
        slots = facts["slots"]
        self._compiled_runner = runner
        self._slots = StaticSlots(shapes, model.dtype, self._device, slots["min_slots"], slots["tier_step"])
        with torch.inference_mode():
            self._attach(capabilities_from(facts["capabilities"]), runner)

    @property
    def linears(self) -> str:
        return self._facts["linears"]

    def cost_identity(self) -> list:
        return self._facts["cost_identity"]

    def describe(self) -> str:
        return self._facts["describe"].replace(self._facts["runner_described"], self.runner.describe())

    def path(self) -> dict:
        return {**self._facts["path"], "forward": "aoti package (warm start)", "described": self.describe()}


def capabilities_from(facts: dict) -> Capabilities:
    return Capabilities(**{**facts, "windows": Windows(**facts["windows"])})


def _json_config(config) -> dict:
    """The model config's entries that survive JSON (a warm model's ``config``)."""
    return {key: value for key, value in json.loads(json.dumps(config.to_dict(), default=lambda _: None)).items()
            if not key.startswith("_")} | {"_attn_implementation": config._attn_implementation}


def remember(adapter, folder: Path, tokenizer_folder: Path) -> None:
    """Keep what a warm start needs of ``adapter`` (an ``HFAdapter`` whose steps run a package already
    loaded) in ``folder``; anything else is not kept. A failure to write costs the next start its
    warmth, nothing else."""
    runner = getattr(adapter, "runner", None)
    if not isinstance(runner, PackageRunner) or not adapter.compiled or runner.package.loaded_runner is None:
        return
    if (folder / FACTS).is_file():
        return
    model = adapter.model
    slots = adapter.store.slots
    facts = {"version": RECORD_VERSION, "package": str(runner.package.path), "tokenizer": str(tokenizer_folder),
             "layer_shapes": [[list(k), list(v)] for k, v in slots.layer_shapes],
             "slots": {"min_slots": slots.min_slots, "tier_step": slots.tier_step},
             "capabilities": dataclasses.asdict(adapter.capabilities),
             "dtype": str(adapter.dtype).removeprefix("torch."), "device": str(adapter.device),
             "kernel_linears": adapter.kernel_linears, "linears": adapter.linears, "rows_exact": adapter.rows_exact,
             "buckets": list(runner.buckets), "options": runner.options,
             "cost_identity": adapter.cost_identity(), "describe": adapter.describe(),
             "runner_described": runner.describe(), "path": adapter.path(),
             "config": _json_config(model.config), "generation_config": model.generation_config.to_dict()}
    constants = package_constants(runner.package.loaded_runner, model_tensors(SlotStep(runner.model)))
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(folder) as partial:
            partial.mkdir()
            torch.save(constants, partial / CONSTANTS)
            (partial / FACTS).write_text(json.dumps(facts, default=str))
    except OSError as exc:
        log.warning("could not keep a warm start at %s (%s): the next start builds the model again", folder, exc)


def warm_start(folder: Path, cache_dir) -> tuple[WarmAdapter, Any] | None:
    """The adapter and tokenizer of the record in ``folder``, or None where there is none whole (a
    damaged one is removed, for the next normal start to write again)."""
    if not (folder / FACTS).is_file():
        return None
    try:
        facts = json.loads((folder / FACTS).read_text())
        if facts.get("version") != RECORD_VERSION or not Path(facts["package"]).is_file():
            raise ValueError("it names a package that is gone")
        constants = torch.load(folder / CONSTANTS, mmap=True, weights_only=True)
    except (OSError, ValueError, KeyError, RuntimeError, pickle.UnpicklingError) as exc:
        log.info("the warm start at %s is not usable (%s): building the model", folder, exc)
        import shutil

        shutil.rmtree(folder, ignore_errors=True)
        return None
    from specfree.kernels import load_kernels

    load_kernels(cache_dir, progress=False)  # the ops the package calls
    loader = load_package(Path(facts["package"]), constants)
    model = PackagedModel(facts, constants)
    adapter = WarmAdapter(model, WarmRunner(loader, facts["buckets"], facts["options"], facts["package"]), facts,
                          cache_dir)
    adapter.record = folder
    return adapter, warm_tokenizer(Path(facts["tokenizer"]))


def warm_tokenizer(folder: Path):
    """The tokenizer saved in ``folder``: its class directly where it is the plain tokenizers backend
    (transformers' auto classes take a quarter second to import), else through them."""
    from specfree.loading import _local_tokenizer, boundary

    named = json.loads((folder / "tokenizer_config.json").read_text()).get("tokenizer_class")
    if named in ("TokenizersBackend", "PreTrainedTokenizerFast"):
        from transformers import TokenizersBackend

        with boundary(f"load the tokenizer in {folder}", "remove the folder: the next start writes it again"):
            return TokenizersBackend.from_pretrained(folder)
    return _local_tokenizer(folder)
