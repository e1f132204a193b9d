"""The layers that run the ops: which layer class each weight gets (``prepare_linears``), the
way back to ``nn.Linear``, the precision of layers held as codes, and ``linear_path``, the name of
what a model's linear layers run."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from specfree.files import cache_folder, fingerprint
from specfree.kernels.build import has_amx, load_kernels, process_isa, registered
from specfree.kernels.codes import CodedLinear
from specfree.settings import DEFAULTS, EngineSettings, choices
from specfree.kernels.hugepages import HugePageArena
from specfree.kernels.precision import choose_precision
from specfree.kernels.panels import (LANES, PanelLinear, is_conv1d, pack_linears, release_checkpoint_mapping,
                                     unpacked)
from specfree.kernels.saved_codes import SavedCodes
from specfree.kernels.shared_input import share_inputs
from specfree.kernels.swap import swap_modules, swapped_modules
from specfree.kernels.tiles import TileLinear, tile_bytes, tiles_fit

# The values of ``linear_kernel=`` (configs, CLI, docs: user-facing, so their names stay):
# "few_row": specfree's kernels (``prepare_linears``): weights packed into panels, held as codes where
#   they are exactly a 4- or 8-bit code's values (a dequantized GGUF), AMX tiles for bfloat16 where
#   the CPU has AMX, ``UnpackedLinear`` where a layer cannot be packed;
# "few_row_fp32": the same, every weight kept as float32 panels (no codes, no tiles);
# "library": torch's own ``F.linear``.
BACKENDS = choices("linear_kernel")


def unpacked_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                    isa: str = "auto") -> torch.Tensor:
    """``F.linear`` through ``specfree::linear``, on ``weight`` as it is, ``[N, K]`` (``load_kernels``
    first). ``isa``: ``"auto"``, ``"avx2"`` or ``"avx512"`` (the CPU must have it)."""
    return torch.ops.specfree.linear(x, weight, bias, isa)


class UnpackedLinear(nn.Module):
    """An ``nn.Linear`` (same parameters, shared, not copied) whose product runs ``specfree::linear``
    on the weight in its own ``[N, K]`` layout: the unpacked fallback where a weight is not packed into
    panels (a borrowed model, a head tied to a layer that cannot be repacked). The state dict is the original's."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_parameter("weight", linear.weight)
        self.register_parameter("bias", linear.bias)  # None registers as absent, as in nn.Linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        params = self._parameters  # 211 calls a SmolLM2 forward: skip nn.Module.__getattr__
        weight = params["weight"]
        if weight.requires_grad and torch.is_grad_enabled():  # the op has no backward
            return F.linear(x, weight, params["bias"])
        return torch.ops.specfree.linear(x, weight, params["bias"])

    def to_linear(self) -> nn.Linear:
        """A plain ``nn.Linear`` over the same parameters."""
        linear = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, device="meta",
                           dtype=self.weight.dtype)
        linear.weight, linear.bias = self.weight, self.bias
        return linear

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def _fits(module: nn.Module) -> bool:
    # Exactly nn.Linear (subclasses may compute something else), fp32/bf16 on the CPU, no hooks
    # (accelerate's offloading works through hooks).
    return type(module) is nn.Linear and _plain_cpu_weight(module)


def _packs(module: nn.Module) -> bool:
    """What packing takes: ``_fits``, and GPT-2's ``Conv1D`` (the same product, its weight transposed)."""
    return (type(module) is nn.Linear or is_conv1d(module)) and _plain_cpu_weight(module)


def _plain_cpu_weight(module: nn.Module) -> bool:
    return (module.weight.device.type == "cpu" and module.weight.dtype in (torch.float32, torch.bfloat16)
            and not module._forward_hooks and not module._forward_pre_hooks)


def resolve_precision(model: nn.Module, settings: EngineSettings = DEFAULTS) -> str:
    """The arithmetic ``settings.precision`` names for ``model``'s coded layers (``kernels.precision``:
    ``auto`` is int8 for a model read from a quantized GGUF file where a probe finds it faster on
    this CPU, else exact)."""
    return choose_precision(model, settings).precision


def int8_layers(model: nn.Module) -> list[str]:
    """The names of the model's coded layers that multiply 8-bit activations."""
    return [name for name, m in model.named_modules() if isinstance(m, CodedLinear) and m.precision == "int8"]


def set_precision(model: nn.Module, settings: EngineSettings = DEFAULTS) -> int:
    """Run the model's coded layers (``CodedLinear``: a quantized format's codes) at
    ``settings.precision`` (``kernels.precision.choose_precision``; the choice and its reason kept as
    ``model.precision_choice`` where the model has such layers); returns how many there are. Other
    layers have no other precision."""
    settings = settings.checked()
    coded = [m for m in model.modules() if isinstance(m, CodedLinear)]
    if coded:
        choice = choose_precision(model, settings)
        model.precision_choice = choice
        for module in coded:  # a type's row names the arithmetics its layers run
            row = module.block_type
            module.precision = choice.precision if row is None or choice.precision in row.precisions else "exact"
    return len(coded)


def prepare_linears(model: nn.Module, settings: EngineSettings = DEFAULTS, pack: bool = True) -> int:
    """Swap the model's CPU ``nn.Linear`` layers for specfree's kernels, their weights packed
    (``settings.linear_kernel="few_row"``, where the kernel loads), or back to ``nn.Linear``
    (``"library"``); returns how many layers now run the kernel. ``pack``: each weight repacked in
    place into panels (``PanelLinear``, the fastest layout, still one copy; GPT-2's ``Conv1D`` layers
    too); else ``UnpackedLinear`` over the model's own tensors (``nn.Linear`` only).
    ``settings.precision``: how layers held as codes multiply (``set_precision``); ``cache_dir``:
    where the kernel is built."""
    settings = settings.checked()
    backend, cache_dir = settings.linear_kernel, settings.cache_dir
    if backend == "library":
        library_linears(model)
        return 0
    if backend == "few_row_fp32" and any(isinstance(m, CodedLinear) for m in model.modules()):
        library_linears(model)  # a GGUF's codes as float32 weights (the same values), packed below
    if not any((_packs if pack else _fits)(m) for m in model.modules()):
        # Nothing left to swap (a model on a GPU, or one an earlier adapter swapped): the kernel is
        # neither built nor asked for its ISA.
        set_precision(model, settings)  # a GGUF's layers hold codes from the load
        share_inputs(model)
        return sum(isinstance(m, KERNEL_LAYERS) for m in model.modules())
    if load_kernels(cache_dir) is None:
        library_linears(model)
        return 0
    isa = process_isa()
    if pack and isa in LANES:
        # codes found by an earlier load of the same weights are checked, not searched again
        coder = SavedCodes.for_model(model, _packs, LANES[isa], cache_folder(cache_dir)) if backend == "few_row" else None
        tiles = HugePageArena() if backend == "few_row" and has_amx() else None  # on huge pages, as panels
        if tiles is not None:
            tiles.reserve([tile_bytes(m) for m in model.modules() if _packs(m) and tiles_fit(m)])

        def hold(module: nn.Module, lanes: int) -> nn.Module | None:
            # codes where a weight is exactly a code's values, AMX tiles for bfloat16, else panels (None)
            held = coder(module, lanes) if coder is not None else None
            return TileLinear(module, tiles) if held is None and tiles is not None and tiles_fit(module) else held

        if pack_linears(model, _packs, LANES[isa], hold):
            release_checkpoint_mapping(model)
        if coder is not None:
            coder.save()
    set_precision(model, settings)
    share_inputs(model)  # q, k, v and gate, up: one coded call each
    swap_modules(model, lambda m: UnpackedLinear(m) if _fits(m) else None)
    return sum(isinstance(m, KERNEL_LAYERS) for m in model.modules())


# The layer classes a weight may be held as besides codes (``CodedLinear``, named with its
# precision), most specific first, by the name ``linear_path`` gives them: bfloat16 weights on AMX
# tiles, weights repacked into panels, and the fallback over the model's own [N, K] tensors.
LAYER_FORMATS = (("tiles", TileLinear), ("panels", PanelLinear), ("unpacked", UnpackedLinear))
KERNEL_LAYERS = (PanelLinear, UnpackedLinear)  # every layer that runs specfree's ops (tiles and codes are panels)


@dataclass(frozen=True)
class LinearPath:
    """Which kernel a model's linear layers run, as a value (``linear_kind``); ``str`` of it is
    ``linear_path``'s name, part of package names and cost-curve keys."""

    held: str  # "library" (torch's F.linear), or how the kernel holds weights: coded, tiles, panels, unpacked
    isa: str = ""
    which: str = ""  # a digest of which layers hold codes, where some are panels ("": every kernel layer)
    int8: str = ""  # coded layers at precision=int8: "" none, "all", or a digest of which

    @property
    def coded(self) -> bool:
        return self.held == "coded"

    def __str__(self) -> str:
        if self.held == "library":
            return "library"
        precision = "" if not self.int8 else "-int8" if self.int8 == "all" else f"-int8{self.int8}"
        return f"few_row-{self.held}{self.which}{precision}-{self.isa}"


def linear_kind(model: nn.Module) -> LinearPath:
    """Which kernel the model's linear layers run (``LinearPath``): held as codes (some layers
    possibly as panels: then which are codes is part of it, and which run at ``precision=int8``: a
    compiled step calls the op with it), as tiles, packed in place as panels, in the model's own
    layout (a borrowed model), or torch's ``library``."""
    if not registered():
        return LinearPath("library")
    isa = process_isa()
    coded = [name for name, m in model.named_modules() if isinstance(m, CodedLinear)]
    if coded:  # which layers hold codes, and at which precision, is part of what a compiled step calls
        every = all(not isinstance(m, PanelLinear) or isinstance(m, CodedLinear) for m in model.modules())
        int8 = int8_layers(model)
        return LinearPath("coded", isa, "" if every else fingerprint(*coded)[:8],
                          "" if not int8 else "all" if len(int8) == len(coded) else fingerprint(*int8)[:8])
    held = {type(m) for m in model.modules()}
    return next((LinearPath(name, isa) for name, layer in LAYER_FORMATS if any(issubclass(c, layer) for c in held)),
                LinearPath("library"))


def linear_path(model: nn.Module) -> str:
    """``linear_kind``'s name: ``"few_row-coded-avx512"``, ``"few_row-coded<digest>-int8-avx512"``,
    ``"few_row-panels-avx512"``, ``"few_row-unpacked-avx2"`` and so on, or ``"library"``."""
    return str(linear_kind(model))


def _stock(copies: dict):
    return lambda m: m.to_linear() if isinstance(m, UnpackedLinear) else unpacked(m, copies)


def library_linears(model: nn.Module) -> int:
    """Undo ``prepare_linears`` (packed weights unpacked, in place); returns how many
    ``nn.Linear`` layers the model has then."""
    with torch.no_grad():
        swap_modules(model, _stock({}))
    return sum(type(m) is nn.Linear for m in model.modules())


def available_memory() -> int | None:
    """Bytes the kernel says can be allocated without swapping (Linux), or None."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


@contextlib.contextmanager
def stock_linears(model: nn.Module):
    """Plain ``nn.Linear`` layers (and embedding) inside the block, for baselines that must be stock,
    then specfree's again. Packed weights are unpacked into a copy that lives as long as the block;
    where that float32 copy (a GGUF held as codes: 4 bytes a weight) would not fit in memory, a
    ``SpecfreeError`` says so before anything is unpacked."""
    from specfree.errors import SpecfreeError

    need = sum(4 * m.in_features * m.out_features for m in model.modules()
               if isinstance(m, PanelLinear) and m.storage.dtype != torch.float32)
    free = available_memory()
    if free is not None and need > free:
        raise SpecfreeError(f"the stock float32 copy of this model's linear layers needs {need / 2**30:.1f} GiB "
                            f"and {free / 2**30:.1f} GiB is available: leave the transformers baselines out "
                            "(bench.baselines without hf_*)")
    with torch.no_grad(), swapped_modules(model, _stock({})):
        yield model


@contextlib.contextmanager
def unpacked_linears(model: nn.Module, cache_dir: str | Path | None = None):
    """specfree's linear layers inside the block and the model's own after it, for callers that
    borrow a model they do not own (nothing is copied either way)."""
    if load_kernels(cache_dir) is None:
        yield model
        return
    with swapped_modules(model, lambda m: UnpackedLinear(m) if _fits(m) else None):
        yield model
