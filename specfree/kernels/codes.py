"""Weights held as the small integer codes that reproduce their float32 values exactly.

A model loaded from a quantized GGUF file (SmolLM2's: Q4_1 layers, a Q8_0 head) is dequantized
into float32 weights, but each block of 32 inputs of an output column still takes only the
values of its code: ``fma(q, d, m)`` with q in 0..15 (affine4: Q4_1 and the like) or
``q * d`` with q in -128..127 (scaled8: Q8_0). ``find_codes`` recovers d, m and the codes from
the float32 weight alone (no file format involved) and keeps them only if decoding them, with the
kernel's own operations (``specfree::decode_panels``), gives the float32 weight back bit for bit.
``specfree::coded_linear`` (``panel_linear.cpp``, the coded rows of its format table) then reads
5 (affine4) or 8.5 (scaled8) bits a weight instead of 32 (6 or 9 where the scales are not float16
values), and computes what ``panel_linear`` computes on the float32 panels, bit for bit.

``CodedLinear`` replaces a ``PanelLinear`` where its weight codes; a tied embedding becomes a
``CodedEmbedding`` that decodes its rows from the head's codes. As with the panels, ``.weight``,
``state_dict()`` and ``to_linear()`` give the stock layout, as copies.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from specfree.kernels.panels import PanelConv1D, PanelEmbedding, PanelLinear, unpack
from specfree.settings import choices

BLOCK = 32  # inputs per scale
# How a coded layer multiplies (``precision=``; configs, CLI, docs: user-facing):
# "exact": float32 activations, the float32 panels of the decoded weights bit for bit (transformers'
#   model of the file, to rounding order);
# "int8": each activation row quantized alone to 8 bits per block of the weight's (llama.cpp's Q8
#   rule) and integer dot products (``panel_linear.cpp``, ``SPECFREE_INT8``): cheaper rows, other
#   bits than exact, each row's its own whatever else is in the call.
PRECISIONS = tuple(p for p in choices("precision") if p != "auto")  # "auto" names one of these per model
ROWS_AT_ONCE = 2048  # rows searched together (bounds the float64 temporaries)


@dataclass
class Codes:
    """A weight's codes in panels of ``lanes`` columns: ``codes`` [N/P, K/8, P] int32 (affine4),
    [N/P, K, P] uint8 (affine8) or int8 (scaled8), ``scales`` and ``offsets`` (affine only)
    [N/P, K/B, P] for blocks of B = 32 inputs (16 for some GGUF K-types), float16 where every one
    is a float16 value, else float32. A GGUF K-type's scales are its 8-bit sub-scales (uint8, int8
    for Q6_K/Q3_K) and offsets its uint8 sub-minimums, under ``supers`` and ``super_offsets``
    [N/P, K/256, P] float16: the super-block's scale and its minimum negated (the kernel multiplies
    them, the same one rounding as gguf)."""

    codes: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor | None
    supers: torch.Tensor | None = None
    super_offsets: torch.Tensor | None = None

    FIELDS = ("codes", "scales", "offsets", "supers", "super_offsets")

    def tensors(self) -> tuple:
        return tuple(getattr(self, key) for key in self.FIELDS)

    @property
    def kind(self) -> str:
        return {torch.int32: "affine4", torch.uint8: "affine8"}.get(self.codes.dtype, "scaled8")

    def decode(self) -> torch.Tensor:
        """The float32 panels [N/P, K, P] these codes stand for."""
        return torch.ops.specfree.decode_panels(self.codes, self.scales, self.offsets, self.supers, self.super_offsets)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None, n: int, isa: str = "auto",
               precision: str | None = None) -> torch.Tensor:
        """``x W^T + bias`` for the ``n`` outputs these codes hold (``specfree::coded_linear``), with
        float32 activations (``precision="exact"``, the op's own default when None) or 8-bit ones
        (``"int8"``: ``PRECISIONS``)."""
        given = {} if precision is None else {"precision": precision}
        return torch.ops.specfree.coded_linear(x, self.codes, self.scales, self.offsets, bias, n, isa, self.supers,
                                               self.super_offsets, **given)

    def panel_slice(self, index) -> "Codes":
        """The codes of the panels ``index`` selects (a slice or index tensor)."""
        return Codes(*(None if t is None else t[index] for t in self.tensors()))

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors() if t is not None)


def _half_neighbours(value: torch.Tensor, steps: int) -> torch.Tensor:
    """[steps * 2 + 1, ...]: ``value`` rounded to float16 and its neighbours, as float64 (the
    scales a GGUF file stores; any other scale is tried as itself first)."""
    bits = value.to(torch.float16).view(torch.int16)
    offsets = torch.tensor([0] + [s for i in range(1, steps + 1) for s in (i, -i)], dtype=torch.int16)
    shifted = (bits.unsqueeze(0) + offsets.view(-1, *[1] * bits.dim())).view(torch.float16).double()
    return torch.cat([value.unsqueeze(0), shifted])


def _search(blocks: torch.Tensor, affine: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """Codes for ``blocks`` [R, K/32, 32] (float32): (q, d, m) with q as int16, d and m float32
    per block, or None if some block has none. Each candidate scale is tried on the blocks the
    ones before it left (the first fits nearly all)."""
    flat = blocks.reshape(-1, BLOCK)
    wide = flat.double()
    if affine:
        low = wide.amin(-1, keepdim=True)
        candidates = _half_neighbours((wide.amax(-1, keepdim=True) - low) / 15, 2)
    else:
        low = torch.zeros_like(wide[:, :1])
        candidates = _half_neighbours(wide.abs().amax(-1, keepdim=True) / 127, 1)
    codes = torch.zeros(flat.shape, dtype=torch.int16)
    scales = torch.zeros(len(flat), dtype=torch.float64)
    left = torch.arange(len(flat))
    lo, hi = (0, 15) if affine else (-128, 127)
    for d in candidates:  # d [blocks, 1]
        d, base, values = d[left], low[left], wide[left]
        q = torch.where(d > 0, ((values - base) / torch.where(d > 0, d, 1)).round(), 0).clamp(lo, hi)
        same = ((q * d + base).float() == flat[left]).all(-1) & torch.isfinite(d[:, 0])
        codes[left[same]], scales[left[same]] = q[same].short(), d[same][:, 0]
        left = left[~same]
        if not len(left):
            shape = blocks.shape[:-1]
            return codes.view(blocks.shape), scales.float().view(shape), low[:, 0].float().view(shape)
    return None


def find_codes(weight: torch.Tensor, lanes: int) -> Codes | None:
    """The codes of ``weight`` [N, K] in panels of ``lanes`` columns, or None where it has none
    (not float32, K not a multiple of 32, or some block not exactly a code's values)."""
    if weight.dtype != torch.float32 or weight.dim() != 2 or weight.shape[1] % BLOCK or not weight.numel():
        return None
    n, k = weight.shape
    rows = weight.detach().reshape(n, k // BLOCK, BLOCK)
    for affine in (True, False):
        if _search(rows[:1], affine) is None:  # a quick no from the first row
            continue
        parts = [_search(rows[i:i + ROWS_AT_ONCE], affine) for i in range(0, n, ROWS_AT_ONCE)]
        if any(part is None for part in parts):
            continue
        q, d, m = (torch.cat(column) for column in zip(*parts))
        coded = _panels(q, d, m if affine else None, lanes)
        if decodes_to(coded, weight):
            return coded
    return None


def decodes_to(coded: Codes, weight: torch.Tensor) -> bool:
    """Whether ``coded`` decodes to ``weight`` bit for bit (a few panels at a time: no second copy
    of a large head)."""
    step = max(1, ROWS_AT_ONCE // coded.codes.shape[2])
    for first in range(0, coded.codes.shape[0], step):
        part = coded.panel_slice(slice(first, first + step))
        rows = weight[first * coded.codes.shape[2]:(first + step) * coded.codes.shape[2]]
        if not torch.equal(unpack(part.decode(), rows.shape[0]), rows):
            return False
    return True


def from_blocks(blocks, lanes: int) -> Codes:
    """A GGUF tensor's ``gguf_blocks.BlockCodes`` as ``Codes`` in panels of ``lanes`` columns (a
    K-type with its sub-scales under super-block scales, as the file holds them)."""
    if blocks.sub is None:
        return _panels(blocks.q, blocks.d, blocks.m, lanes, blocks.nibbles)
    sc, super_d, mins, super_m = blocks.sub
    coded = _panels(blocks.q, sc, mins, lanes, blocks.nibbles)
    return Codes(coded.codes, coded.scales, coded.offsets, _panel_array(super_d, lanes),
                 None if super_m is None else _panel_array(super_m, lanes))


def _panel_array(t: np.ndarray, lanes: int) -> torch.Tensor:
    """[N, X] -> [N/P, X, P] (zero columns past N)."""
    pad = (-t.shape[0]) % lanes
    t = np.pad(t, ((0, pad), (0, 0))) if pad else t
    return torch.from_numpy(np.ascontiguousarray(t.reshape(-1, lanes, t.shape[1]).transpose(0, 2, 1)))


def _panels(q, d, m, lanes: int, nibbles: bool = True) -> Codes:
    """q [N, K/B, B] (or [N, K]), d and m [N, K/B] (tensors or arrays) -> ``Codes`` in panels (zero
    columns past N); affine codes eight a word where ``nibbles`` (they fit 4 bits), else a byte each.
    numpy does the repacking: torch's strided copies of small integers took 30x longer."""
    q = np.asarray(q)
    n = q.shape[0]
    panels = lambda t: _panel_array(t, lanes)  # noqa: E731
    q = q.reshape(n, -1)
    if np.asarray(d).dtype.kind == "f":  # float scales (8-bit ones are a K-type's sub-scales, as they are)
        d, m = np.asarray(d, dtype=np.float32), None if m is None else np.asarray(m, dtype=np.float32)
        # float16 scales and offsets where all are float16 values (a GGUF file's are): fewer bytes read
        if all(np.array_equal(t.astype(np.float16).astype(np.float32), t) for t in (d, m) if t is not None):
            d, m = d.astype(np.float16), None if m is None else m.astype(np.float16)
    if m is not None and not nibbles:
        return Codes(panels(q.astype(np.uint8)), panels(d), panels(m))
    if m is not None:  # eight codes a word: input 8g+i in bits 4i..4i+3 of word g
        # input 2j in the low nibble of byte j, 2j+1 in the high one; four bytes a little-endian word
        q = q.astype(np.uint8)
        words = np.ascontiguousarray(q[:, 0::2] | (q[:, 1::2] << np.uint8(4))).view(np.int32)
        return Codes(panels(words), panels(d), panels(m))
    return Codes(panels(q.astype(np.int8)), panels(d), None)


class CodedLinear(PanelLinear):
    """A ``PanelLinear`` whose panels are held as codes; its product runs ``specfree::coded_linear``."""

    precision = "exact"  # one of PRECISIONS: the op's own default, until ``kernels.set_precision`` says
    block_type = None  # the GGUF type's traits row a file's layer was loaded by (codes found in a float weight: none)

    def __init__(self, linear: nn.Module, coded: Codes):
        nn.Module.__init__(self)
        rows = self._rows_of(linear.weight)
        self.out_features, self.in_features = rows.shape
        self._hold(coded)
        self.register_parameter("bias", linear.bias)

    def _hold(self, coded: Codes) -> None:
        # buffers, not parameters (integer codes cannot be parameters); kept out of the state dict,
        # which holds the stock float32 weight instead
        for key in Codes.FIELDS:
            self.register_buffer(key, getattr(coded, key), persistent=False)

    @property
    def coded(self) -> Codes:
        return Codes(*(self._buffers[key] for key in Codes.FIELDS))

    @property
    def panels(self) -> torch.Tensor:
        """The float32 panels, decoded: a new tensor each call (the codes are the storage)."""
        return self.coded.decode()

    @property
    def weight_dtype(self) -> torch.dtype:
        return torch.float32

    @property
    def storage(self) -> torch.Tensor:
        return self.codes

    def tied_embedding(self, embedding: nn.Embedding) -> nn.Module:
        return CodedEmbedding(embedding, self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        buffers = self._buffers
        return torch.ops.specfree.coded_linear(x, buffers["codes"], buffers["scales"], buffers["offsets"],
                                               self._parameters["bias"], self.out_features, "auto",
                                               buffers["supers"], buffers["super_offsets"], self.precision)

    def _load_weight(self, weight: torch.Tensor, prefix: str, error_msgs: list[str]) -> bool:
        coded = find_codes(self._rows_of(weight.to(torch.float32)), self.codes.shape[2])
        if coded is None:
            error_msgs.append(f"{prefix}weight is not exactly the values of a 4- or 8-bit code, which this layer "
                              "holds its weight as; load it into a model prepared with linear_kernel=few_row_fp32")
            return False
        self._hold(coded)
        return True

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"codes={self.coded.kind} {tuple(self.codes.shape)}"
                + f", precision={self.precision}")


class CodedConv1D(CodedLinear, PanelConv1D):
    """GPT-2's ``Conv1D`` held as codes: its stock layout ([K, N]) from ``PanelConv1D``."""


# Linear classes whose forward only restates x W^T + b (Falcon's, as a matmul): held as codes like nn.Linear.
RESTATED_LINEARS = ("FalconLinear",)


def carries_linear(module: nn.Module) -> bool:
    """Whether ``CodedLinear`` computes what ``module``'s own class computes: x W^T + b."""
    return type(module) is nn.Linear or (isinstance(module, nn.Linear) and type(module).__name__ in RESTATED_LINEARS)


def carries_embedding(embedding: nn.Module) -> bool:
    """Whether ``CodedEmbedding`` computes what ``embedding``'s own class computes: a plain
    ``nn.Embedding``, or a scaled one (Gemma's ``*ScaledWordEmbedding``: the looked-up rows times its
    ``embed_scale``, sqrt(hidden)). Any other class's arithmetic is not carried: it keeps its module."""
    if type(embedding) is nn.Embedding:
        return True
    cls = type(embedding)
    return (cls.__name__.endswith("ScaledWordEmbedding") and cls.__bases__ == (nn.Embedding,)
            and hasattr(embedding, "embed_scale"))


class CodedEmbedding(PanelEmbedding):
    """An embedding tied to a ``CodedLinear`` head: each looked-up row decoded from the head's codes
    (the panels holding it, decoded by the same op, so the same bits as the head's). ``own=True``: the
    codes are the embedding's own (a GGUF whose head is another tensor), held as its submodule
    ``table``. What the model's own embedding class adds is carried (``carries_embedding``): a scaled
    one's rows are multiplied by its ``embed_scale`` as its forward does; ``to_embedding`` gives that
    class back."""

    def __init__(self, embedding: nn.Embedding, head: CodedLinear, own: bool = False):
        nn.Module.__init__(self)
        if not carries_embedding(embedding):
            raise TypeError(f"{type(embedding).__name__} adds arithmetic a CodedEmbedding does not carry")
        self.num_embeddings, self.embedding_dim = embedding.num_embeddings, embedding.embedding_dim
        self.padding_idx = embedding.padding_idx
        self.head = [head]  # not a submodule when tied: the head is the model's own, its codes its storage
        self.stock = [embedding]  # the model's own module (its weight on the meta device): its class and scale
        scale = getattr(embedding, "embed_scale", None)
        if isinstance(scale, torch.Tensor):
            self.register_buffer("embed_scale", scale.detach().clone(), persistent=False)
        else:
            self.embed_scale = scale
        if own:
            self.table = head

    @property
    def storage(self) -> torch.Tensor:
        return self.head[0].codes

    @property
    def weight_dtype(self) -> torch.dtype:
        return torch.float32

    @property
    def weight(self) -> torch.Tensor:
        return self.head[0].weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [...] -> [..., K]
        head = self.head[0]
        lanes = head.codes.shape[2]
        flat = ids.reshape(-1)
        panel = torch.div(flat, lanes, rounding_mode="floor")
        decoded = head.coded.panel_slice(panel).decode()  # [T, K, P]
        rows = decoded[torch.arange(flat.numel(), device=flat.device), :, flat % lanes]
        rows = rows.reshape(*ids.shape, self.embedding_dim)
        if self.embed_scale is None:
            return rows
        scale = self.embed_scale  # as the scaled class multiplies: a tensor in the weight's dtype, or a float
        return rows * (scale.to(rows.dtype) if isinstance(scale, torch.Tensor) else scale)

    def to_embedding(self, weight: nn.Parameter | None = None) -> nn.Module:
        stock = self.stock[0]
        if type(stock) is nn.Embedding:
            return super().to_embedding(weight)
        stock.weight = weight if weight is not None else nn.Parameter(self.weight, requires_grad=False)
        return stock

    def extra_repr(self) -> str:
        scaled = "" if self.embed_scale is None else f", rows times {float(self.embed_scale):g}"
        return f"{self.num_embeddings}, {self.embedding_dim}, tied to a CodedLinear head's codes{scaled}"
