"""Cost curves of a model's linear layers alone, kernel against library, in one process (``python -m
specfree bench``'s ``cost_curves``; the ops ``read_pass`` and ``linear_pass`` are ``kernels/measure_ops.cpp``).

A pass runs every linear layer of the model once (SmolLM2-135M: 211 products over 538 MB of
weights), with ``rows`` rows of activations each: what a forward of that many rows spends in
its products. Variants:

- ``blas``: ``F.linear`` as torch ships it (MKL or OpenBLAS);
- ``onednn_packed``: oneDNN with each weight packed once (``torch.ops.mkldnn._linear_pointwise``),
  where torch has it; the packed copies exist only during the measurement;
- ``few_row-avx2`` / ``few_row-avx512``: specfree's kernel on the model's own ``[N, K]`` layout,
  each code path this CPU runs;
- ``few_row-panels-avx2`` / ``-avx512``: the same on weights packed into panels (``kernels/panels.py``),
  what an engine's model runs, on the same memory (huge pages where the OS offers them,
  ``kernels/hugepages.py``); the variants above read the model's own tensors, on ordinary pages;
- ``few_row-panels-avx512 from C++``: the same products called one after another from C++
  through the dispatcher (``specfree::linear_pass``), as the compiled forward calls them; every
  other variant is called from a Python loop, which adds microseconds a call (SmolLM2 at one row,
  Intel Xeon VM: 2 ms of 18);
- ``few_row-coded-avx512``: where the model's weights are a quantized file's, dequantized (SmolLM2's
  GGUF), the same products on those weights held as codes (``kernels/codes.py``), as an engine holds them:
  3.7-6x fewer bytes than the panels, the same bits; ``few_row-coded-int8-avx512``: the same codes
  against 8-bit activations (``precision=int8``);
- ``few_row-tiles-amx``: a bfloat16 model's weights on AMX tiles (``kernels/tiles.py``), where the CPU has
  AMX (every variant's activations are in the weights' dtype, as the model's forward passes them);
- ``read_pass``: the floor, one read of every weight (as panels) with the kernel's split among
  threads and no arithmetic to speak of, each thread's share read as 1, 2, 4 or 8 streams side
  by side (the fastest of these in each round: one stream a thread is not the fastest read);
- ``inductor_cpp``: Inductor's C++ GEMM template with frozen weights (optional: it compiles a
  graph per row count, minutes for a real model).

Rows take turns within each round, rounds repeat, and the best pass per (variant, rows) is kept.
Every variant but the coded ones multiplies float32 (or 16-bit) copies of the weights, several at
once; where those copies would not fit in the memory available (a 7B file held as codes on a
24 GB machine: ``no_room_for_copies`` says why), ``dense=False`` measures only the coded variants,
on the codes the engine's layers hold.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from specfree.kernels import UnpackedLinear, available_memory, has_amx, load_kernels
from specfree.kernels.codes import CodedLinear, find_codes
from specfree.kernels.hugepages import HugePageArena
from specfree.kernels.panels import LANES, PanelLinear, pack
from specfree.kernels.passes import best_ms, coded_passes, held_layers
from specfree.kernels.tiles import pack_tiles

ROWS = (1, 2, 4, 8, 16)
STREAMS = (1, 2, 4, 8)  # how many side-by-side streams a thread reads in the floor's pass
# Copies of the weights alive at once while the dense variants run: unpacked, packed for each of two
# ISA paths, and oneDNN's packed copy.
DENSE_COPIES = 4


def linear_modules(model: nn.Module) -> list[nn.Module]:
    """Every linear layer, the shared LM head once."""
    seen, out = set(), []
    for module in model.modules():
        key = id(module.storage) if isinstance(module, PanelLinear) else id(getattr(module, "weight", None))
        if isinstance(module, (nn.Linear, UnpackedLinear, PanelLinear)) and key not in seen:
            seen.add(key)
            out.append(module)
    return out


def dense_bytes(modules: Sequence[nn.Module]) -> int:
    """The bytes of one unpacked copy of every layer's weight, in its dtype."""
    total = 0
    for m in modules:
        if isinstance(m, PanelLinear):
            total += m.out_features * m.in_features * m.panels.element_size()
        else:
            total += m.weight.numel() * m.weight.element_size()
    return total


def weight_and_bias(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A linear layer's (weight [N, K], bias); a packed layer's weight unpacked into a copy."""
    weight = module.rows() if isinstance(module, PanelLinear) else module.weight  # a packed Conv1D's .weight is [K, N]
    return weight.detach(), None if module.bias is None else module.bias.detach()


def _onednn(layers) -> Callable | None:
    reorder = getattr(torch.ops.mkldnn, "_reorder_linear_weight", None)
    if reorder is None or not torch.backends.mkldnn.is_available():
        return None
    try:
        packed = {id(w): reorder(w) for w, _ in layers}  # in the weights' dtype, as the activations
        probe_w, probe_b = layers[0]
        torch.ops.mkldnn._linear_pointwise(torch.zeros(2, probe_w.shape[1], dtype=probe_w.dtype),
                                           packed[id(probe_w)], probe_b,
                                           "none", [], "")
    except RuntimeError:
        return None
    return lambda x, w, b: torch.ops.mkldnn._linear_pointwise(x, packed[id(w)], b, "none", [], "")


class _Stack(nn.Module):
    """Every layer once, each on the activations of its own width (what Inductor compiles)."""

    def __init__(self, layers):
        super().__init__()
        self.linears = nn.ModuleList()
        for weight, bias in layers:
            linear = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
            linear.weight = nn.Parameter(weight, requires_grad=False)
            if bias is not None:
                linear.bias = nn.Parameter(bias, requires_grad=False)
            self.linears.append(linear)

    def forward(self, inputs: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        return [linear(inputs[str(linear.in_features)]) for linear in self.linears]


def _inductor_passes(layers, rows: Sequence[int]) -> dict[int, Callable]:
    stack = _Stack(layers)
    options = {"freezing": True, "max_autotune": True, "max_autotune_gemm_backends": "CPP",
               "autotune_num_choices_displayed": 0}
    passes = {}
    for m in rows:
        compiled = torch.compile(stack, options=options, dynamic=False)
        inputs = {str(w.shape[1]): torch.randn(m, w.shape[1]) for w, _ in layers}
        with torch.no_grad(), torch._inductor.config.patch(freezing=True):
            compiled(inputs)  # compiles
        passes[m] = lambda compiled=compiled, inputs=inputs: compiled(inputs)
    return passes


def no_room_for_copies(model: nn.Module, copies: int = DENSE_COPIES, memory: int | None = None) -> str | None:
    """Why ``copies`` unpacked copies of the model's linear weights cannot be made here (they would
    not fit in ``memory``, default what the OS says is available), None where they can."""
    memory = available_memory() if memory is None else memory
    need = copies * dense_bytes(linear_modules(model))
    if memory is None or need <= memory:
        return None
    return f"{copies} unpacked cop{'y' if copies == 1 else 'ies'} of the weights need {need / 2**30:.1f} GB, " \
           f"{memory / 2**30:.1f} GB available"


def linear_curves(model: nn.Module, rows: Sequence[int] = ROWS, rounds: int = 5, inductor: bool = False,
                  progress: Callable[[str], None] | None = None, dense: bool = True) -> dict[str, dict[int, float]]:
    """Milliseconds per pass over the model's linear layers, per variant and row count
    (``dense=False``: the coded variants only, no copy of any weight)."""
    modules = linear_modules(model)
    if not dense:
        return best_ms(_coded_variants(held_layers(modules), rows), rows, rounds)
    layers = [weight_and_bias(m) for m in modules]
    variants: dict[str, Callable] = {"blas": lambda x, w, b: F.linear(x, w, b)}
    onednn = _onednn(layers)
    if onednn is not None:
        variants["onednn_packed"] = onednn
    isa = load_kernels(progress=False)
    paths = ["avx2", "avx512"] if isa == "avx512" else ["avx2"] if isa else []
    for path in paths:
        variants[f"few_row-{path}"] = lambda x, w, b, path=path: torch.ops.specfree.linear(x, w, b, path)
    dtype = layers[0][0].dtype  # activations as the model's forward passes them (a bf16 model's are bf16)
    activations = {m: {w.shape[1]: torch.randn(m, w.shape[1], dtype=dtype) for w, _ in layers} for m in rows}
    passes: dict[str, dict[int, Callable]] = {}
    for name, fn in variants.items():
        passes[name] = {m: (lambda fn=fn, xs=activations[m]: [fn(xs[w.shape[1]], w, b) for w, b in layers])
                        for m in rows}
    for path in paths:
        arena = HugePageArena()  # the memory an engine's packed model reads (huge pages where offered)
        packed = [(pack(w, LANES[path], arena), b, w.shape[0]) for w, b in layers]
        engine_path = path == paths[-1]  # the path an engine runs
        if engine_path:  # the floor: the bytes the engine's kernel reads, read once
            weights, biases, outputs = (list(column) for column in zip(*packed))
            streams = itertools.cycle(STREAMS)  # each call the next count: every row count meets each
            passes["read_pass"] = {m: (lambda: torch.ops.specfree.read_pass(weights, next(streams))) for m in rows}
        passes[f"few_row-panels-{path}"] = {
            m: (lambda xs=activations[m], packed=packed, path=path:
                [torch.ops.specfree.panel_linear(xs[p.shape[1]], p, b, n, path) for p, b, n in packed])
            for m in rows}
        if engine_path:  # ... and the same products called as the compiled forward calls them
            passes[f"few_row-panels-{path} from C++"] = {
                m: (lambda xs=[activations[m][w.shape[1]] for w in weights], path=path:
                    torch.ops.specfree.linear_pass(xs, weights, biases, outputs, path)) for m in rows}
    if paths:
        # the codes an engine's model holds already, else searched (a model kept as float32 panels)
        coded = [m.coded if isinstance(m, CodedLinear) else find_codes(w, LANES[paths[-1]])
                 for m, (w, _) in zip(modules, layers)]
        if any(c is not None for c in coded):  # each layer as an engine holds it: codes, else panels
            passes.update(_coded_variants([(c, None if c is not None else pack(w, LANES[paths[-1]]), b, *w.shape)
                                         for c, (w, b) in zip(coded, layers)], rows, paths[-1]))
    if has_amx() and all(w.dtype == torch.bfloat16 for w, _ in layers):  # as a bf16 engine's model runs them
        arena = HugePageArena()  # as an engine's model holds them
        tiles = [(pack_tiles(w, arena), b, w.shape[0]) for w, b in layers]
        passes["few_row-tiles-amx"] = {
            m: (lambda xs=activations[m]:
                [torch.ops.specfree.tile_linear(xs[w.shape[1]], t, b, n) for (t, b, n), (w, _) in zip(tiles, layers)])
            for m in rows}
    if inductor:
        if progress:
            progress("compiling Inductor's C++ GEMM for each row count")
        passes["inductor_cpp"] = _inductor_passes(layers, rows)
    return best_ms(passes, rows, rounds)


def _coded_variants(held, rows, isa: str | None = None) -> dict[str, dict[int, Callable]]:
    """The coded passes (``kernels.passes.coded_passes``) under their curves' names."""
    isa = isa or load_kernels(progress=False)
    return {f"few_row-coded-{isa}" if precision == "exact" else f"few_row-coded-{precision}-{isa}": per_rows
            for precision, per_rows in coded_passes(held, rows, isa).items()}
