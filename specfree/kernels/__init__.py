"""Few-row linear kernels for the CPU: ``y = x W^T + b`` at the cost of reading W once.

A speculative step pushes 1 to 16 rows through every linear layer. Those products are bound by
streaming the weights from memory, and the BLAS and oneDNN kernels torch ships pay much more
than one read for 2 to 16 rows. The ops, one library:

- ``specfree::panel_linear`` and ``specfree::coded_linear`` (``panel_linear.cpp``: one driver, one
  row of its format table a weight format) on weights packed once, in place, into panels
  (``panels.py``: float32, float16, bfloat16) or held as small integer codes under block scales
  (``codes.py``, ``gguf_blocks.py``: a GGUF's types): one sequential stream per thread; what an
  engine's model runs (``prepare_linears``, ``PanelLinear``, ``CodedLinear``); coded layers take
  float32 activations (``precision="exact"``) or 8-bit ones (``"int8"``; ``"auto"``, the default,
  picks int8 for a model read from a quantized GGUF file where a probe finds it faster on this CPU:
  ``precision.py``, ``set_precision``);
- ``specfree::linear`` (``unpacked_linear.cpp``) on the model's own ``[N, K]`` tensors, for models
  specfree borrows (``unpacked_linears``) and heads tied to a layer it cannot repack;
- ``specfree::tile_linear`` (``tile_linear.cpp``) on bfloat16 weights packed into AMX tiles
  (``tiles.py``), where the CPU has AMX: a bfloat16 model's products.

Both give each output row the same bits whatever the number of rows in the call. The same library
holds ``specfree::tree_attention`` (``tree_attention.cpp``, the step's attention) and
``specfree::top_ids`` (``top_ids.cpp``, each row's top-k ids for the drafters that recycle logits). They are torch
custom ops (``torch.library``), so eager code, ``torch.compile`` and AOTInductor packages all call
the same code. They are built from their C++ source on first use (each source compiled side by side, then linked) with the C++
compiler Inductor needs anyway, and kept under
``~/.cache/specfree/kernels/<hash of the sources and torch version>``. Where they cannot be built
or the CPU lacks AVX2, ``load_kernels`` warns once and returns None, and the layers run the
library's ``F.linear``. ``specfree::read_pass`` (one read of tensors: the floor the cost curves are
read against) and ``specfree::linear_pass`` (products called from C++) are measurement only, in
``measure_ops.cpp``, for the curves of ``specfree/bench/linear_curves.py``, which
``python -m specfree bench`` runs (user-facing, so they ship).

The package: ``build.py`` (the C++ library's build, its cache folder, loading it, the ISA the
process runs, decided once), ``layers.py`` (which layer class each weight gets, the way back,
precision, ``linear_path``), ``precision.py`` (what ``precision=auto`` chooses, by a probe cached
with the cost curves), ``passes.py`` (the timed passes the probe and bench's linear curves share),
one module per weight format (``panels.py``, ``codes.py``, ``tiles.py``, ``gguf_blocks.py``,
``experts.py``), and the attention op (``tree_attention.py``).
"""

from specfree.kernels.build import (HEADERS, ISA_NAMES, LIBRARY, SOURCES, find_compiler, has_amx, has_op, kernel_dir,
                                    load_kernels, process_isa)
from specfree.kernels.codes import CodedLinear
from specfree.kernels.layers import (BACKENDS, LinearPath, UnpackedLinear, available_memory, int8_layers,
                                     library_linears, linear_kind, linear_path, prepare_linears, resolve_precision, set_precision, stock_linears,
                                     unpacked_linear, unpacked_linears)
from specfree.kernels.panels import PanelLinear
from specfree.kernels.tiles import TileLinear

__all__ = ["BACKENDS", "HEADERS", "ISA_NAMES", "LIBRARY", "SOURCES", "CodedLinear", "LinearPath", "PanelLinear",
           "TileLinear", "UnpackedLinear", "available_memory", "find_compiler", "has_amx",
           "has_op", "int8_layers", "kernel_dir", "library_linears", "linear_kind", "linear_path", "load_kernels", "prepare_linears",
           "process_isa", "resolve_precision", "set_precision", "stock_linears", "unpacked_linear", "unpacked_linears"]
