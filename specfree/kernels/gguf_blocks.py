"""GGUF's quantized blocks as the codes ``specfree::coded_linear`` runs: one decode per type.

Each GGUF type stores a weight row as blocks of bytes. Every common type's value is, per run of 16
or 32 inputs, an integer code times a float32 scale, plus a float32 offset for some: exactly what
``gguf.quants.dequantize`` computes, with one rounding (the products below are exact in float32:
an fp16 scale has 11 significant bits, a K-type's sub-scale at most 8, a code at most 8). So each
type maps onto one of the kernel's formats without changing a bit:

| type | value (gguf's) | held as | bits a weight (file) |
|---|---|---|---|
| Q4_0 | d·(q−8) | affine4: fma(q, d, −8d) | 5 (4.5) |
| Q4_1 | d·q + m | affine4 | 5 (5) |
| Q5_0 | d·(q−16) | scaled8 | 8.5 (5.5) |
| Q5_1 | d·q + m | affine8 | 9 (6) |
| Q8_0 | d·q | scaled8 | 8.5 (8.5) |
| Q2_K | (d·sc)·q − dmin·m, per 16 | affine8, sub-scales | 9.1 (2.6) |
| Q3_K | (d·sc)·q, per 16 | scaled8, sub-scales | 8.6 (3.4) |
| Q4_K | (d·sc)·q − dmin·m, per 32 | affine4, sub-scales | 4.6 (4.5) |
| Q5_K | (d·sc)·q − dmin·m, per 32 | affine8, sub-scales | 8.6 (5.5) |
| Q6_K | (d·sc)·q, per 16 | scaled8, sub-scales | 8.6 (6.6) |

A K-type keeps its own scale structure ("sub-scales"): each block's 8-bit sc (and m) under its
256-input super-block's float16 d (and −dmin); the kernel multiplies them as gguf does.

``GGUF_TYPES`` is that table (``type_table`` writes it; a test keeps the copy above equal), one
``BlockType`` row per type: its decode, its code format and inputs per scale, the bits it holds,
the layer it becomes, the precisions it runs. A new type is one decode function and one row. Types outside it
(F32, F16, BF16: float already; IQ*, TQ*: no code format) are dequantized by ``gguf`` itself.
The unpacking follows ``gguf.quants``' own numpy, so the codes land where its values do; the
tests check every type against ``gguf.quants.dequantize`` on random blocks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T
from torch import nn

from specfree.kernels.codes import PRECISIONS, CodedConv1D, CodedLinear

QK_K = 256


@dataclass(frozen=True)
class BlockCodes:
    """A weight [N, K] as codes: ``q`` [N, K] (uint8, or int8 for scaled8), ``d`` and ``m``
    [N, K/block] float32 (``m`` None: scaled8); ``nibbles``: q fits 4 bits (affine4). A K-type
    also has its scales as held (``sub``): 8-bit sub-scales ``sc`` [N, K/block] (int8 or uint8),
    sub-minimums ``mins`` (uint8, or None) and float16 ``super_d`` and ``super_m`` (−dmin) [N, K/256]."""

    q: np.ndarray
    d: np.ndarray
    m: np.ndarray | None
    block: int
    nibbles: bool
    sub: tuple | None = None  # (sc, super_d, mins, super_m)

    def rows(self, order: np.ndarray) -> "BlockCodes":
        """These codes with their rows in ``order``."""
        pick = lambda t: None if t is None else t[order]  # noqa: E731
        sub = None if self.sub is None else tuple(pick(t) for t in self.sub)
        return BlockCodes(self.q[order], self.d[order], pick(self.m), self.block, self.nibbles, sub)

    def values(self) -> np.ndarray:
        """The float32 values these codes stand for, as the kernel decodes them (float64 fma, then
        one rounding to float32: an fma's result), for tests and for a tensor the kernel cannot run."""
        n, k = self.q.shape
        q = self.q.astype(np.float64).reshape(n, k // self.block, self.block)
        d = self.d.astype(np.float64)[..., None]
        exact = q * d if self.m is None else q * d + self.m.astype(np.float64)[..., None]
        return exact.astype(np.float32).reshape(n, k)


def _half(raw: np.ndarray) -> np.ndarray:
    return raw.view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray, n_blocks: int, width: int) -> np.ndarray:
    """A 32-input block's low nibbles then high nibbles (gguf's order)."""
    q = qs.reshape((n_blocks, -1, 1, width)) >> np.array([0, 4], dtype=np.uint8).reshape((1, 1, 2, 1))
    return (q & np.uint8(0x0F)).reshape((n_blocks, -1))


def _high_bits(qh: np.ndarray, n_blocks: int) -> np.ndarray:
    """Q5_0 / Q5_1: bit i of the block's 32-bit word is input i's fifth bit."""
    bits = qh.copy().view(np.uint32).reshape((n_blocks, 1)) >> np.arange(32, dtype=np.uint32).reshape((1, 32))
    return (bits & np.uint32(1)).astype(np.uint8)


def q4_0(blocks: np.ndarray) -> tuple:
    n = len(blocks)
    d = _half(blocks[:, :2].copy())
    return _nibbles(blocks[:, 2:], n, 16), d, -8 * d


def q4_1(blocks: np.ndarray) -> tuple:
    n = len(blocks)
    return _nibbles(blocks[:, 4:], n, 16), _half(blocks[:, :2].copy()), _half(blocks[:, 2:4].copy())


def q5_0(blocks: np.ndarray) -> tuple:
    n = len(blocks)
    q = _nibbles(blocks[:, 6:], n, 16) | (_high_bits(blocks[:, 2:6], n) << np.uint8(4))
    return q.astype(np.int8) - np.int8(16), _half(blocks[:, :2].copy()), None


def q5_1(blocks: np.ndarray) -> tuple:
    n = len(blocks)
    q = _nibbles(blocks[:, 8:], n, 16) | (_high_bits(blocks[:, 4:8], n) << np.uint8(4))
    return q, _half(blocks[:, :2].copy()), _half(blocks[:, 2:4].copy())


def q8_0(blocks: np.ndarray) -> tuple:
    return blocks[:, 2:].copy().view(np.int8), _half(blocks[:, :2].copy()), None


def _raw_half(raw: np.ndarray) -> np.ndarray:
    return raw.copy().view(np.float16)


def q2_k(blocks: np.ndarray) -> tuple:
    n = len(blocks)
    scales, qs, d, dmin = blocks[:, :16], blocks[:, 16:80], _half(blocks[:, 80:82].copy()), _half(blocks[:, 82:84].copy())
    shift = np.array([0, 2, 4, 6], dtype=np.uint8).reshape((1, 1, 4, 1))
    q = ((qs.reshape((n, -1, 1, 32)) >> shift) & np.uint8(3)).reshape((n, QK_K))
    sc, mins = scales & np.uint8(0xF), scales >> np.uint8(4)
    dl = d * sc.astype(np.float32)
    ml = dmin * mins.astype(np.float32)
    return q, dl, -ml, (sc, _raw_half(blocks[:, 80:82]), mins, -_raw_half(blocks[:, 82:84]))


def q3_k(blocks: np.ndarray) -> tuple:
    n = len(blocks)
    hmask, qs, scales, d = blocks[:, :32], blocks[:, 32:96], blocks[:, 96:108], _half(blocks[:, 108:110].copy())
    low = (scales[:, :8].reshape((n, 1, 8)) >> np.array([0, 4], dtype=np.uint8).reshape((1, 2, 1))).reshape((n, 16))
    high = (scales[:, 8:].reshape((n, 1, 4)) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape((1, 4, 1))).reshape((n, 16))
    sc = ((low & np.uint8(0x0F)) | ((high & np.uint8(0x03)) << np.uint8(4))).astype(np.int8) - np.int8(32)
    ql = qs.reshape((n, -1, 1, 32)) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape((1, 1, 4, 1))
    qh = hmask.reshape((n, -1, 1, 32)) >> np.arange(8, dtype=np.uint8).reshape((1, 1, 8, 1))
    ql = ql.reshape((n, 16, QK_K // 16)) & np.uint8(3)
    qh = (qh.reshape((n, 16, QK_K // 16)) & np.uint8(1)) ^ np.uint8(1)
    q = (ql.astype(np.int8) - (qh << np.uint8(2)).astype(np.int8)).reshape((n, QK_K))
    return q, d * sc.astype(np.float32), None, (sc, _raw_half(blocks[:, 108:110]), None, None)


def _k_scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K: eight 6-bit sub-scales and sub-minimums packed in 12 bytes (gguf's unpacking)."""
    n = len(scales)
    d, m, m_d = np.split(scales.reshape((n, 3, 4)), 3, axis=-2)
    sc = np.concatenate([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], axis=-1).reshape((n, 8))
    mins = np.concatenate([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], axis=-1).reshape((n, 8))
    return sc, mins


def q4_k(blocks: np.ndarray) -> tuple:
    n = len(blocks)
    d, dmin = _half(blocks[:, :2].copy()), _half(blocks[:, 2:4].copy())
    sc, mins = _k_scale_min(blocks[:, 4:16])
    q = _nibbles(blocks[:, 16:], n, 32)
    sub = (sc, _raw_half(blocks[:, :2]), mins, -_raw_half(blocks[:, 2:4]))
    return q, d * sc.astype(np.float32), -(dmin * mins.astype(np.float32)), sub


def q5_k(blocks: np.ndarray) -> tuple:
    n = len(blocks)
    d, dmin = _half(blocks[:, :2].copy()), _half(blocks[:, 2:4].copy())
    sc, mins = _k_scale_min(blocks[:, 4:16])
    qh = blocks[:, 16:48].reshape((n, -1, 1, 32)) >> np.arange(8, dtype=np.uint8).reshape((1, 1, 8, 1))
    q = _nibbles(blocks[:, 48:], n, 32) | ((qh & np.uint8(1)).reshape((n, QK_K)) << np.uint8(4))
    sub = (sc, _raw_half(blocks[:, :2]), mins, -_raw_half(blocks[:, 2:4]))
    return q, d * sc.astype(np.float32), -(dmin * mins.astype(np.float32)), sub


def q6_k(blocks: np.ndarray) -> tuple:
    n = len(blocks)
    ql, qh, scales, d = blocks[:, :128], blocks[:, 128:192], blocks[:, 192:208], _half(blocks[:, 208:210].copy())
    low = (ql.reshape((n, -1, 1, 64)) >> np.array([0, 4], dtype=np.uint8).reshape((1, 1, 2, 1))) & np.uint8(0x0F)
    high = (qh.reshape((n, -1, 1, 32)) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape((1, 1, 4, 1))) & np.uint8(3)
    q = (low.reshape((n, -1, 32)) | (high.reshape((n, -1, 32)) << np.uint8(4))).astype(np.int8) - np.int8(32)
    sc = scales.copy().view(np.int8)
    return q.reshape((n, QK_K)), d * sc.astype(np.float32), None, (sc, _raw_half(blocks[:, 208:210]), None, None)


@dataclass(frozen=True)
class BlockType:
    """One GGUF type's traits, the one row every reader takes: loading (``decode``, ``scale_block``,
    ``held_as``, ``held_bits``, ``layers``: ``hold``), layer preparation (``precisions``, read by
    ``kernels.layers.set_precision``) and the module's table (``type_table``). Every type's layers
    call the one op, ``specfree::coded_linear``, which reads the code format the layer holds."""

    decode: Callable[[np.ndarray], tuple]  # blocks [n, type_size] uint8 -> q, d, m[, a K-type's scales as held]
    value: str  # a weight's value as gguf computes it
    held_as: str  # the kernel's code format: affine4 (codes fit 4 bits), affine8 or scaled8
    scale_block: int  # inputs per scale (d, m)
    held_bits: float  # bits a weight as held (codes, scales, offsets; panel padding aside): what a load is sized by
    layers: tuple[type, type] = (CodedLinear, CodedConv1D)  # what a Linear weight, a Conv1D weight becomes
    precisions: tuple[str, ...] = PRECISIONS  # the arithmetics its layers run: exact, and int8 (llama.cpp's)

    @property
    def nibbles(self) -> bool:
        return self.held_as.startswith("affine4")

    def layer(self, conv1d: bool) -> type:
        return self.layers[1] if conv1d else self.layers[0]

    def hold(self, module: nn.Module, codes, conv1d: bool = False) -> nn.Module:
        """``module``'s weight held as ``codes`` in this type's layer, which keeps this row
        (``block_type``) for layer preparation to read (``kernels.layers.set_precision``)."""
        layer = self.layer(conv1d)(module, codes)
        layer.block_type = self
        return layer


SUB = ", sub-scales"
# The type-traits table: a new type is one decode function and one row.
GGUF_TYPES: dict[T, BlockType] = {
    T.Q4_0: BlockType(q4_0, "d·(q−8)", "affine4: fma(q, d, −8d)", 32, 5),
    T.Q4_1: BlockType(q4_1, "d·q + m", "affine4", 32, 5),
    T.Q5_0: BlockType(q5_0, "d·(q−16)", "scaled8", 32, 8.5),
    T.Q5_1: BlockType(q5_1, "d·q + m", "affine8", 32, 9),
    T.Q8_0: BlockType(q8_0, "d·q", "scaled8", 32, 8.5),
    T.Q2_K: BlockType(q2_k, "(d·sc)·q − dmin·m, per 16", "affine8" + SUB, 16, 9.125),
    T.Q3_K: BlockType(q3_k, "(d·sc)·q, per 16", "scaled8" + SUB, 16, 8.5625),
    T.Q4_K: BlockType(q4_k, "(d·sc)·q − dmin·m, per 32", "affine4" + SUB, 32, 4.625),
    T.Q5_K: BlockType(q5_k, "(d·sc)·q − dmin·m, per 32", "affine8" + SUB, 32, 8.625),
    T.Q6_K: BlockType(q6_k, "(d·sc)·q, per 16", "scaled8" + SUB, 16, 8.5625),
}


def file_bits(qtype: T) -> float:
    """Bits a weight of ``qtype`` takes in the file."""
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    return type_size * 8 / block_size


def type_table() -> str:
    """``GGUF_TYPES`` as the markdown table this module's docstring shows."""
    short = lambda bits: f"{round(bits, 1):g}"  # noqa: E731
    rows = [f"| {t.name} | {row.value} | {row.held_as} | {short(row.held_bits)} ({short(file_bits(t))}) |"
            for t, row in GGUF_TYPES.items()]
    return "\n".join(["| type | value (gguf's) | held as | bits a weight (file) |", "|---|---|---|---|", *rows])


def block_codes(raw: np.ndarray, qtype: T, rows: int, columns: int) -> BlockCodes | None:
    """The codes of a [rows, columns] tensor stored as ``qtype`` blocks (``raw``: its bytes), or
    None where the type has no code format or a scale is not finite (then ``gguf`` dequantizes it:
    an fma would turn inf·0 into nan where gguf's product gives inf)."""
    row = GGUF_TYPES.get(qtype)
    if row is None:
        return None
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(-1, type_size)
    if len(blocks) * block_size != rows * columns:
        raise ValueError(f"{len(blocks)} blocks of {block_size} cannot be a {rows}x{columns} tensor")
    q, d, m, *held = row.decode(blocks)
    block, nibbles = row.scale_block, row.nibbles
    d, m = (None if t is None else t.reshape(rows, columns // block).astype(np.float32) for t in (d, m))
    if not np.isfinite(d).all() or (m is not None and not np.isfinite(m).all()):
        return None
    sub = None
    if held:
        sc, super_d, mins, super_m = held[0]
        per_row = (rows, -1)
        sub = (sc.reshape(per_row), super_d.reshape(per_row), None if mins is None else mins.reshape(per_row),
               None if super_m is None else super_m.reshape(per_row))
    return BlockCodes(np.ascontiguousarray(q).reshape(rows, columns), d, m, block, nibbles, sub)
