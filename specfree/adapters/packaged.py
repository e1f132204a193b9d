"""Ahead-of-time compiled steps (AOTInductor packages): a compiled forward that a new process
loads in a fraction of a second instead of compiling for minutes.

One package serves every step: it is exported with ``torch.export`` from a small module
(``SlotStep``) whose inputs are the token ids, their positions, the additive mask, the slots the
new rows go to, and the KV buffers themselves, which it writes in place. The row and slot
dimensions are left dynamic, so one package serves every row count up to ``MAX_ROWS`` and every
KV tier. The buffers are passed whole: a view of their first slots would not be contiguous, and
export guards on the layout it traced.

The weights are not in the package: it is built with ``package_constants_in_so=False`` and, once
loaded, pointed at the model's own tensors (``load_constants(..., user_managed=True)``), so the
process holds one copy of the weights however many packages or tiers it runs, and a package
belongs to a model's architecture (its folder name fingerprints the config, the tensors' names,
shapes and dtypes, the layers' classes and the kernels), not to one set of weights.
"""

from __future__ import annotations

import hashlib
import json
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
from transformers.cache_utils import Cache, StaticLayer

from specfree.adapters.kv_buffers import cache_argument
from specfree.files import atomic_path, fingerprint
from specfree.kernels.c_shims import c_shims
from specfree.kernels.panels import stock_tensor_specs


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
        self.cache_argument = cache_argument(model)

    def forward(self, ids, positions, mask, slot_index, kv: list[torch.Tensor]) -> torch.Tensor:
        # ids, positions [1, Q]; mask [1, 1, Q, slots] (or a dict per layer kind); slot_index [Q];
        # kv: keys and values of each layer, [1, H, slots, D] -> logits [1, Q, V]
        cache = Cache(layers=[SlotLayer(kv[i], kv[i + 1], slot_index) for i in range(0, len(kv), 2)])
        return self.model(input_ids=ids, position_ids=positions, attention_mask=mask, use_cache=True,
                          **{self.cache_argument: cache}).logits


MAX_ROWS = 64  # rows a package takes; more run eagerly on the same static cache


# Config entries that describe where a model came from or what callers ask of it, not the
# computation a package holds (save_pretrained, for one, fills in architectures and dtype).
NOT_ARCHITECTURE = {"architectures", "dtype", "torch_dtype", "transformers_version", "name_or_path", "use_cache",
                    "output_attentions", "output_hidden_states", "return_dict"}


def model_tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer by name, tied ones under each name, as the module holds them (not
    ``state_dict()``, which gives packed weights in their stock layout, as copies)."""
    return {**dict(module.named_buffers(remove_duplicate=False)),
            **dict(module.named_parameters(remove_duplicate=False))}


def architecture_fingerprint(model: torch.nn.Module) -> str:
    """A short hash of the model's architecture: its config and the name, shape and dtype of
    every tensor (a package's code depends on these, not on the weights' values)."""
    config = {key: value for key, value in model.config.to_diff_dict().items()
              if key not in NOT_ARCHITECTURE and not key.startswith("_")}
    config["attention"] = model.config._attn_implementation  # which attention code was traced
    digest = hashlib.sha1(json.dumps(config, sort_keys=True, default=str).encode())
    for name, (shape, dtype) in stock_tensor_specs(model).items():  # a packed model's as its stock one's
        digest.update(f"{name}{shape}{dtype}".encode())
    # and every buffer the step reads, held ones too: layers held as codes of another GGUF type
    # (int8 codes, float16 scales, K-type sub-scales...) call the op with other tensors
    for name, buffer in model.named_buffers(remove_duplicate=False):
        digest.update(f"{name}{tuple(buffer.shape)}{buffer.dtype}".encode())
    # and which class each layer is: a swapped layer (a pinned twin, a kernel layer) traces other code
    digest.update(",".join(type(module).__qualname__ for module in model.modules()).encode())
    return digest.hexdigest()[:16]


def dynamic_shapes(example: tuple) -> tuple:
    """``torch.export``'s dynamic_shapes for ``SlotStep``'s inputs: the row dimension (ids,
    positions, mask, slot index) and the slot dimension (mask, every KV buffer) are free."""
    ids, positions, mask, slot_index, kv = example
    rows = torch.export.Dim("rows", min=1, max=MAX_ROWS)
    slots = torch.export.Dim("slots", min=2, max=1 << 20)
    masks = {kind: {2: rows, 3: slots} for kind in mask} if isinstance(mask, dict) else {2: rows, 3: slots}
    return {1: rows}, {1: rows}, masks, {0: rows}, [{2: slots}] * len(kv)


def build_package(model: torch.nn.Module, example: tuple, path: Path, options: dict) -> None:
    """Export ``SlotStep(model)`` at ``example``'s shapes (any row and slot count) and compile it
    with Inductor ``options``, the weights left out, into the package ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    # a package on disk is always whole: an interrupted build leaves nothing at ``path``
    with torch.no_grad(), atomic_path(path) as partial, warnings.catch_warnings():
        # torch's export warns of its own use of a deprecated pytree check: nothing a user can act on
        warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)", category=FutureWarning)
        program = torch.export.export(SlotStep(model), example, dynamic_shapes=dynamic_shapes(example), strict=False)
        with torch._inductor.config.patch({"aot_inductor.custom_ops_to_c_shims": c_shims()}):
            torch._inductor.aoti_compile_and_package(
                program, package_path=str(partial),
                inductor_configs={**options, "aot_inductor.package_constants_in_so": False})


def package_loader_class():
    """torch's C++ loader of AOTInductor packages, or None where this torch has none."""
    return getattr(getattr(torch._C, "_aoti", None), "AOTIModelPackageLoader", None)


def cpu_features() -> str:
    """The vector features this CPU has, as torch's own CPU checks report them (microseconds). A
    package's kernels are compiled for the vector ISA its building CPU had, so its folder names them."""
    checks = sorted(name for name in dir(torch.cpu) if name.startswith("_is_") and name.endswith("_supported"))
    return ",".join(name[4:-10] for name in checks if getattr(torch.cpu, name)())


def load_package(path: Path, tensors: Mapping[str, torch.Tensor]):
    """The loader of package ``path`` (steps run through ``boxed_run`` on ``step_leaves``), reading
    ``tensors`` (its constants by name: ``model_tensors(SlotStep(model))``, or a warm start's) as its
    weights (no copy).

    It is torch's C++ loader, made directly: ``torch._inductor.aoti_load_package`` first probes
    the CPU's vector ISAs by compiling and running a program per ISA in subprocesses (over a second
    in every new process), only to warn where they differ from the building CPU's; a package's
    folder already names this CPU's features (``cpu_features``)."""
    loader = package_loader_class()(str(path), "model", False, 1, -1)
    from torch.utils import _pytree as pytree

    if not pytree.treespec_loads(loader.get_call_spec()[1]).is_leaf():  # more than the logits
        raise RuntimeError(f"{path} is not a package of SlotStep: its step returns more than the logits")
    missing = [name for name in loader.get_constant_fqns() if name not in tensors]
    if missing:
        raise RuntimeError(f"{path} reads {len(missing)} tensor(s) not given, {', '.join(missing[:3])}")
    loader.load_constants(package_constants(loader, tensors), use_inactive=False, check_full_update=True,
                          user_managed=True)
    return loader


def package_constants(loader, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Of ``tensors``, those the package of ``loader`` reads, by name."""
    return {name: tensors[name].detach() for name in loader.get_constant_fqns()}


def step_leaves(ids, positions, mask, slot_index, kv: list[torch.Tensor]) -> list[torch.Tensor]:
    """``SlotStep``'s inputs as the flat list a package runs on: pytree's order (a dict of masks
    by insertion order), built without walking the tree each step (the flattening of 60-odd
    tensors that torch's loaded-model ``__call__`` does would cost 27 us a step)."""
    masks = list(mask.values()) if isinstance(mask, dict) else [mask]
    return [ids, positions, *masks, slot_index, *kv]


def export_example(inputs: tuple) -> tuple:
    """``SlotStep``'s ``inputs`` with at least two rows: export leaves a dimension of size 1 static,
    and the package must take any row count. Only shapes matter to the export."""
    ids, positions, mask, slot_index, kv = inputs
    if ids.shape[1] > 1:
        return inputs
    masks = {kind: m.repeat(1, 1, 2, 1) for kind, m in mask.items()} if isinstance(mask, dict) \
        else mask.repeat(1, 1, 2, 1)
    return ids.repeat(1, 2), positions.repeat(1, 2), masks, slot_index.repeat(2), kv


class StepPackage:
    """The package of one model's step, compiled with Inductor ``options``: loaded from
    ``package_dir`` when there, else built and kept there. ``package_dir=None`` builds into a
    temporary folder that goes with it."""

    def __init__(self, model: torch.nn.Module, package_dir: str | Path | None, options: dict, linears: str):
        """``linears`` names the linear layers' kernels the step calls (``kernels.linear_path``)."""
        self.model, self.options = model, options
        if package_dir is None:
            import tempfile

            self._temporary = tempfile.TemporaryDirectory(prefix="specfree-packages-")
            package_dir = self._temporary.name
        # Packages hold kernels built for one thread count, torch build and set of Inductor options,
        # and calls to specfree's ops as their schemas stood (the ops' build names those).
        from specfree.kernels import kernel_dir

        ops = kernel_dir().name
        setup = (f"{architecture_fingerprint(model)}-{linears}-{torch.get_num_threads()}t-torch{torch.__version__}"
                 f"-ops{ops}-cpu{cpu_features()}-entries{fingerprint(*sorted(map(str, c_shims().values())))}")
        self.folder = Path(package_dir) / fingerprint(setup, sorted(options.items()))
        self.path = self.folder / "step.pt2"
        self.built = self.loaded = 0
        self._runner = None

    def ready(self) -> bool:
        """Whether the package is on disk (loading it takes a fraction of a second)."""
        return self.path.is_file()

    def get(self, example: Callable[[], tuple]):
        """The runner; ``example()`` gives the inputs that shape a build when none is on disk (asked
        for only then: making them costs every step a few copies)."""
        if self._runner is None:
            if not self.path.is_file():
                build_package(self.model, example(), self.path, self.options)
                self.built += 1
            else:
                self.loaded += 1
            self._runner = load_package(self.path, model_tensors(SlotStep(self.model)))
        return self._runner

    @property
    def loaded_runner(self):
        """The package's runner where it has been built or loaded already, else None."""
        return self._runner

    def run(self, ids, positions, mask, slot_index, kv: list[torch.Tensor]) -> torch.Tensor:
        """The step's logits [1, Q, V] (``SlotStep``'s arguments), building or loading the package first."""
        inputs = (ids, positions, mask, slot_index, kv)
        runner = self.get(lambda: export_example(inputs))
        return runner.boxed_run(step_leaves(*inputs))[0]
