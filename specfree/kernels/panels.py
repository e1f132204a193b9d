"""Weights packed once, in place, into the layout the few-row kernel streams best.

``specfree::panel_linear`` (``panel_linear.cpp``) reads W as panels ``[N/P, K, P]``: P output
columns (one vector of the CPU's widest code path: 8 floats AVX2, 16 AVX-512), K contiguous,
zero columns past N. A thread then reads one sequential stream; the model's own ``[N, K]`` makes
it read several short rows side by side (25-50% slower on Zen 3).

The panels replace the model's storage rather than adding to it: ``PanelLinear`` holds only the
panels, and a tied input embedding (SmolLM2's, most small models') becomes a ``PanelEmbedding``
that looks its rows up in the head's panels, so every weight exists once. GPT-2's ``Conv1D``
(the same product with the weight stored ``[K, N]``) becomes a ``PanelConv1D``. Where a weight in
``[N, K]`` is still wanted it is made on demand, as a copy: ``.weight``, ``state_dict()`` (the
original keys and layout, so a saved checkpoint loads into the stock model), ``to_linear()`` for
the stock baselines.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from specfree.kernels.hugepages import HugePageArena

LANES = {"avx2": 8, "avx512": 16}


def pack(weight: torch.Tensor, lanes: int, arena: HugePageArena | None = None) -> torch.Tensor:
    """[N, K] -> panels [ceil(N / lanes), K, lanes], zero columns past N; in ``arena``'s memory if given."""
    n, k = weight.shape
    padded = F.pad(weight.detach(), (0, 0, 0, (-n) % lanes)) if n % lanes else weight.detach()
    panels = padded.reshape(-1, lanes, k).transpose(1, 2)
    return panels.contiguous() if arena is None else arena.empty(panels.shape, weight.dtype).copy_(panels)


def unpack(panels: torch.Tensor, n: int) -> torch.Tensor:
    """Panels -> a new [N, K] tensor (the inverse of ``pack``)."""
    return panels.transpose(1, 2).reshape(-1, panels.shape[1])[:n].contiguous()


class PanelLinear(nn.Module):
    """An ``nn.Linear`` whose weight lives only as panels; its product runs ``specfree::panel_linear``."""

    def __init__(self, linear: nn.Module, lanes: int, arena: HugePageArena | None = None):
        super().__init__()
        rows = self._rows_of(linear.weight)  # [N, K]
        self.out_features, self.in_features = rows.shape
        self.panels = nn.Parameter(pack(rows, lanes, arena), requires_grad=False)
        self.register_parameter("bias", linear.bias)

    @property
    def stock_shape(self) -> tuple[int, int]:
        return self.out_features, self.in_features

    @property
    def weight(self) -> torch.Tensor:
        """The weight as ``nn.Linear`` holds it: a new tensor each call (the panels are the storage)."""
        return self.rows()

    def rows(self) -> torch.Tensor:
        """The weight as [N, K] (what ``pack`` took), a new tensor, whatever the stock layout."""
        return unpack(self.panels, self.out_features)

    @property
    def storage(self) -> torch.Tensor:
        """The tensor that holds the weight (a tied embedding shares it)."""
        return self.panels

    @property
    def weight_dtype(self) -> torch.dtype:
        return self.panels.dtype

    def _rows_of(self, weight: torch.Tensor) -> torch.Tensor:
        """A weight in the stock layout as [N, K] (what ``pack`` takes)."""
        return weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        params = self._parameters  # 211 calls a SmolLM2 forward: skip nn.Module.__getattr__
        return torch.ops.specfree.panel_linear(x, params["panels"], params["bias"], self.out_features)

    def tied_embedding(self, embedding: nn.Embedding) -> nn.Module:
        """The input embedding tied to this head, reading its rows from this layer's storage."""
        return PanelEmbedding(embedding, self)

    def to_linear(self, weight: nn.Parameter | None = None) -> nn.Linear:
        """A plain ``nn.Linear`` over an unpacked copy (or ``weight``) and the same bias."""
        linear = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, device="meta",
                           dtype=self.panels.dtype)
        linear.weight = weight if weight is not None else nn.Parameter(self.weight, requires_grad=False)
        linear.bias = self.bias
        return linear

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        destination[prefix + "weight"] = self.weight  # the stock layout and key
        if self.bias is not None:
            destination[prefix + "bias"] = self.bias if keep_vars else self.bias.detach()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        if prefix + "weight" in state_dict:
            if not self._load_weight(state_dict[prefix + "weight"], prefix, error_msgs):
                return
        elif strict:
            missing_keys.append(prefix + "weight")
        if self.bias is not None and prefix + "bias" in state_dict:
            with torch.no_grad():
                self.bias.copy_(state_dict[prefix + "bias"])

    def _load_weight(self, weight: torch.Tensor, prefix: str, error_msgs: list[str]) -> bool:
        """Take a stock-layout ``weight`` into this layer's storage; False (with a message in
        ``error_msgs``) where it cannot."""
        with torch.no_grad():
            self.panels.copy_(pack(self._rows_of(weight.to(self.panels.dtype)), self.panels.shape[2]))
        return True

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"panels={tuple(self.panels.shape)}")


class WidePanelLinear(PanelLinear):
    """A float32 linear layer whose weights are 16-bit values (a bfloat16 or float16 checkpoint, a
    GGUF's F16/BF16 tensors), held as 16-bit panels: half the bytes of float32, and the same
    products, since widening 16 bits to float32 is exact and the kernel computes in float32. Its
    ``weight``, state dict and ``to_linear`` are float32: the model stays a float32 model."""

    def __init__(self, weight16: torch.Tensor, bias: nn.Parameter | None, lanes: int):
        nn.Module.__init__(self)
        self.out_features, self.in_features = weight16.shape
        self.panels = nn.Parameter(pack(weight16, lanes), requires_grad=False)
        self.register_parameter("bias", None if bias is None else nn.Parameter(bias.float(), requires_grad=False))

    @property
    def weight(self) -> torch.Tensor:
        return self.rows().float()

    @property
    def weight_dtype(self) -> torch.dtype:
        return torch.float32

    def to_linear(self, weight: nn.Parameter | None = None) -> nn.Linear:
        linear = super().to_linear(weight)
        return linear.float()

    def _load_weight(self, weight: torch.Tensor, prefix: str, error_msgs: list[str]) -> bool:
        narrow = weight.to(self.panels.dtype)
        if not torch.equal(narrow.float(), weight.float()):
            error_msgs.append(f"{prefix}weight is not exactly {self.panels.dtype} values, which this layer holds "
                              "its weight as; load the model with dtype=float32 from a float32 checkpoint")
            return False
        return super()._load_weight(narrow, prefix, error_msgs)


def holders(model: nn.Module) -> dict[int, int]:
    """How many module slots hold each parameter (by id): more than one is a tie."""
    counts: dict[int, int] = {}
    for module in model.modules():
        for param in module._parameters.values():
            if param is not None:
                counts[id(param)] = counts.get(id(param), 0) + 1
    return counts


def hold_16bit_linears(model: nn.Module, lanes: int) -> int:
    """A model loaded in bfloat16 or float16 made a float32 model whose linear layers keep their
    16-bit weights (``WidePanelLinear``): every other parameter and buffer widened to float32 (exact).
    A layer that shares its weight (a head tied to the embedding) is widened with the rest. Returns
    how many layers keep 16 bits."""
    from specfree.kernels.swap import swap_modules

    counts = holders(model)

    def convert(module):
        if type(module) is nn.Linear and module.weight.dtype in (torch.bfloat16, torch.float16) \
                and counts[id(module.weight)] == 1 and module.weight.device.type == "cpu":
            return WidePanelLinear(module.weight.detach(), module.bias, lanes)
        return None

    with torch.no_grad():
        held = swap_modules(model, convert)
        for module in model.modules():
            if isinstance(module, WidePanelLinear):
                continue
            for key, param in module._parameters.items():
                if param is not None and param.is_floating_point() and param.dtype != torch.float32:
                    param.data = param.data.float()
            for key, buffer in module._buffers.items():
                if buffer is not None and buffer.is_floating_point() and buffer.dtype != torch.float32:
                    module._buffers[key] = buffer.float()
    model.config.dtype = torch.float32
    return held


class PanelConv1D(PanelLinear):
    """transformers' ``Conv1D`` (GPT-2's linear layers, the weight stored ``[K, N]``) packed the same
    way; ``.weight``, the state dict and ``to_linear`` keep its own layout and class."""

    @property
    def stock_shape(self) -> tuple[int, int]:
        return self.in_features, self.out_features

    @property
    def weight(self) -> torch.Tensor:
        return self.rows().t().contiguous()

    def _rows_of(self, weight: torch.Tensor) -> torch.Tensor:
        return weight.t()

    def to_linear(self, weight: nn.Parameter | None = None) -> nn.Module:
        """A plain ``Conv1D`` over an unpacked copy (or ``weight``, [K, N]) and the same bias."""
        from transformers.pytorch_utils import Conv1D

        with torch.device("meta"):  # no weight allocated (or initialised) only to be replaced
            conv = Conv1D(self.out_features, self.in_features)
        conv.weight = weight if weight is not None else nn.Parameter(self.weight, requires_grad=False)
        conv.bias = self.bias
        return conv


def is_conv1d(module: nn.Module) -> bool:
    """Exactly transformers' ``Conv1D`` (a linear layer with its weight transposed)."""
    from transformers.pytorch_utils import Conv1D

    return type(module) is Conv1D


class PanelEmbedding(nn.Module):
    """A plain ``nn.Embedding`` tied to a ``PanelLinear`` head: rows read from the head's panels."""

    def __init__(self, embedding: nn.Embedding, head: PanelLinear):
        super().__init__()
        self.num_embeddings, self.embedding_dim = embedding.num_embeddings, embedding.embedding_dim
        self.padding_idx = embedding.padding_idx
        self.panels = head.panels  # shared: the tie stays a tie

    @property
    def storage(self) -> torch.Tensor:
        return self.panels

    @property
    def weight_dtype(self) -> torch.dtype:
        return self.panels.dtype

    @property
    def weight(self) -> torch.Tensor:
        return unpack(self.panels, self.num_embeddings)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [...] -> [..., K]
        lanes = self.panels.shape[2]
        return self.panels[torch.div(ids, lanes, rounding_mode="floor"), :, ids % lanes]

    def to_embedding(self, weight: nn.Parameter | None = None) -> nn.Embedding:
        embedding = nn.Embedding(self.num_embeddings, self.embedding_dim, self.padding_idx, device="meta",
                                 dtype=self.weight_dtype)
        embedding.weight = weight if weight is not None else nn.Parameter(self.weight, requires_grad=False)
        return embedding

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        destination[prefix + "weight"] = self.weight

    def _load_from_state_dict(self, state_dict, prefix, *args):
        pass  # the head's panels hold this weight and load through the head

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, tied to a PanelLinear head's panels"


def stock_tensor_specs(model: nn.Module) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """The name, shape and dtype of every tensor ``model.state_dict()`` holds, packed or not, without
    unpacking anything (a package's key; its code depends on these, not on the layout's copies)."""
    specs = {}
    for name, module in model.named_modules(remove_duplicate=False):
        prefix = f"{name}." if name else ""
        if isinstance(module, PanelLinear):
            specs[prefix + "weight"] = (module.stock_shape, module.weight_dtype)
        elif isinstance(module, PanelEmbedding):
            specs[prefix + "weight"] = ((module.num_embeddings, module.embedding_dim), module.weight_dtype)
        for key, tensor in module._parameters.items():
            if tensor is not None and key != "panels":
                specs[prefix + key] = (tuple(tensor.shape), tensor.dtype)
        for key, tensor in module._buffers.items():
            if tensor is not None and key not in module._non_persistent_buffers_set:
                specs[prefix + key] = (tuple(tensor.shape), tensor.dtype)
    return specs


def panel_bytes(module: nn.Module, lanes: int) -> int:
    """The bytes ``PanelLinear`` (or ``PanelConv1D``) packs this layer's weight into."""
    k, n = module.weight.shape if is_conv1d(module) else module.weight.shape[::-1]
    return -(-n // lanes) * lanes * k * module.weight.element_size()


def pack_linears(model: nn.Module, fits, lanes: int, coder=None) -> int:
    """Replace every linear layer ``fits`` accepts by a ``PanelLinear``, in place (the old weight is
    freed as each layer is packed); a head tied to a plain ``nn.Embedding`` takes the embedding with
    it. ``coder(layer, lanes)``, where given, may return the layer held another way instead (a
    ``codes.CodedLinear``: a weight that is exactly a 4- or 8-bit code's values), or None for
    panels. Returns how many layers were packed. A layer whose weight something else shares (a tie
    to a scaled embedding, say) is left as it is."""
    from specfree.kernels.swap import swap_modules

    shared = holders(model)
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    tied_heads: dict[int, PanelLinear] = {}

    file_pages = FilePages.of_this_process()
    arena = HugePageArena()  # the panels on huge pages where the OS offers them: every stream runs faster
    # One mapping for every layer that may be packed (one left unpacked, shared or tied elsewhere,
    # leaves its share unused: address space, never backed).
    arena.reserve([panel_bytes(module, lanes) for module in model.modules() if fits(module)])

    def convert(module):
        if not fits(module):
            return None
        tied = type(embedding) is nn.Embedding and embedding.weight is module.weight
        weight = module.weight
        holders = shared[id(weight)]
        if holders == 1 or (tied and holders == 2):
            packed = coder(module, lanes) if coder is not None else None
            if packed is None:
                packed = (PanelConv1D if is_conv1d(module) else PanelLinear)(module, lanes, arena)
            # The source is read once, here: its checkpoint pages need not stay resident until the
            # mapping goes (they would add the model's size again to the peak).
            file_pages.drop(weight)
            if tied:
                tied_heads[id(embedding)] = packed
            return packed
        return None

    with torch.no_grad():
        packed = swap_modules(model, convert)
        swap_modules(model, lambda m: tied_heads[id(m)].tied_embedding(m) if id(m) in tied_heads else None)
    return packed


SMALL_BYTES = 64 << 20


def release_checkpoint_mapping(model: nn.Module) -> None:
    """Copy the tensors packing left in place (norms, biases: each under 64 MB) into memory of their
    own. A checkpoint loaded from safetensors is a memory-mapped file, and any tensor still on the
    mapping keeps all of it (``FilePages`` has handed back the packed weights' pages as they were
    packed; this lets the mapping itself go)."""
    with torch.no_grad():
        for module in model.modules():
            for name, param in module._parameters.items():
                if param is not None and name != "panels" and param.numel() * param.element_size() <= SMALL_BYTES:
                    param.data = param.data.clone()
            for name, buffer in module._buffers.items():
                if buffer is not None and buffer.numel() * buffer.element_size() <= SMALL_BYTES:
                    module._buffers[name] = buffer.clone()
    _return_freed_memory()


class FilePages:
    """The file mappings of this process (a safetensors checkpoint is one, mapped private), so that
    the pages a tensor on one has been read from can be handed back once read. Only clean pages
    are: they stay in the page cache, and a later read, by anyone still holding the tensor, faults
    them in again with the same bytes. A page written since it was mapped (a private copy) is never
    dropped. Linux only; elsewhere, and for tensors in ordinary memory, ``drop`` does nothing (they
    are freed with the tensor)."""

    MADV_DONTNEED = 4
    PAGE = 4096

    def __init__(self, ranges: list[tuple[int, int]], madvise=None):
        self.ranges = ranges
        self.madvise = madvise

    @classmethod
    def of_this_process(cls) -> FilePages:
        import ctypes

        libc = _libc()
        try:
            with open("/proc/self/maps", encoding="utf-8") as maps:
                lines = maps.read().splitlines()
            madvise = libc.madvise
        except (OSError, AttributeError):  # no /proc, no libc, or a libc without madvise
            return cls([])
        madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        ranges = []
        for line in lines:  # start-end perms offset dev inode path
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].startswith("/"):
                start, end = (int(x, 16) for x in fields[0].split("-"))
                ranges.append((start, end))
        return cls(ranges, madvise)

    def drop(self, tensor: torch.Tensor) -> bool:
        """Hand back the clean whole pages under ``tensor``; whether any were."""
        if not self.ranges or tensor.device.type != "cpu":
            return False
        start = tensor.data_ptr()
        end = start + tensor.numel() * tensor.element_size()  # weights are contiguous
        if not any(low <= start and end <= high for low, high in self.ranges):
            return False  # ordinary memory
        first, last = -(-start // self.PAGE) * self.PAGE, end // self.PAGE * self.PAGE
        if last <= first or self._written(first, last):
            return False
        return self.madvise(first, last - first, self.MADV_DONTNEED) == 0

    def _written(self, first: int, last: int) -> bool:
        """Whether a page in [first, last) is a private copy: present but not file-backed, or in
        swap (``/proc/self/pagemap``: bit 63 present, 62 swapped, 61 file page). Unreadable: assume so."""
        try:
            with open("/proc/self/pagemap", "rb") as pagemap:
                pagemap.seek(first // self.PAGE * 8)
                entries = np.frombuffer(pagemap.read((last - first) // self.PAGE * 8), dtype=np.uint64)
        except OSError:
            return True
        present, swapped, file = (entries >> 63) & 1, (entries >> 62) & 1, (entries >> 61) & 1
        return len(entries) != (last - first) // self.PAGE or bool(((present & (file ^ 1)) | swapped).any())


def _libc():
    """The C library, or None where there is none to load."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name) if name else None
    except OSError:
        return None


def _return_freed_memory() -> None:
    """Packing frees a model's worth of small blocks, which glibc keeps for reuse: hand them back."""
    trim = getattr(_libc(), "malloc_trim", None)
    if trim is not None:  # glibc only; elsewhere the allocator keeps them, as it would anyway
        trim(0)


def unpacked(module: nn.Module, copies: dict[int, nn.Parameter]) -> nn.Module | None:
    """The stock module for a packed one (``nn.Linear``, ``nn.Embedding``), over an unpacked copy of
    its weight; ``copies`` keeps a tied head and embedding on one copy."""
    if isinstance(module, (PanelLinear, PanelEmbedding)):
        weight = copies.get(id(module.storage))
        if weight is None:
            weight = copies[id(module.storage)] = nn.Parameter(module.weight, requires_grad=False)
        return module.to_linear(weight) if isinstance(module, PanelLinear) else module.to_embedding(weight)
    return None
