"""Tiny random Llamas written as GGUF files of any type, the way llama.cpp lays them out (q/k rows
permuted for its rope, a byte-level BPE vocabulary), so the tests need no download.

Types ``gguf`` can quantize (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, F16, BF16, F32) are quantized from
random float32 weights; the K-types, which ``gguf`` only dequantizes, are written as random blocks
whose float16 scales are set to small values (so activations stay finite), every other bit random.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T, GGUFWriter, quants

HIDDEN, INTERMEDIATE, LAYERS, HEADS, KV_HEADS = 256, 512, 2, 4, 2  # K-types need 256-input rows
# byte offsets of the float16 scale fields in each block of the types written as random blocks
HALF_FIELDS = {T.Q2_K: (80, 82), T.Q3_K: (108,), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,)}
QUANTIZABLE = (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.F16, T.BF16, T.F32)
CODED = (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K)


def _byte_tokens() -> list[str]:
    """GPT-2's printable stand-ins for the 256 bytes."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def vocabulary() -> tuple[list[str], list[str]]:
    """256 byte tokens, merges of lowercase letter pairs, and an end token: 512 tokens."""
    tokens, merges = _byte_tokens(), []
    letters = "etaoinsrhldcumfpgwyb"
    for a in letters:
        for b in letters:
            if len(tokens) == 511:
                break
            merges.append(f"{a} {b}")
            tokens.append(a + b)
    tokens.append("<|endoftext|>")
    return tokens, merges


def add_vocabulary(writer: GGUFWriter) -> None:
    """``vocabulary()`` as the file's byte-level BPE tokenizer, its last token the end (and start) token."""
    tokens, merges = vocabulary()
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * (len(tokens) - 1) + [3])
    writer.add_token_merges(merges)
    writer.add_eos_token_id(len(tokens) - 1)
    writer.add_bos_token_id(len(tokens) - 1)


def _permute(weights: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter order for q/k rows (transformers' loader undoes it)."""
    rows = weights.shape[0]
    return weights.reshape(heads, 2, rows // heads // 2, *weights.shape[1:]).swapaxes(1, 2).reshape(weights.shape)


def _blocks(rng: np.random.Generator, qtype: T, rows: int, columns: int) -> np.ndarray:
    """Random ``qtype`` blocks for a [rows, columns] weight, scales small (K-types)."""
    block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows * columns // block, size), dtype=np.uint8)
    for offset in HALF_FIELDS[qtype]:
        scale = rng.uniform(2e-4, 1e-3, size=len(raw)).astype(np.float16)
        raw[:, offset:offset + 2] = scale.view(np.uint8).reshape(-1, 2)
    return raw.reshape(rows, -1)


def _tensor(rng: np.random.Generator, qtype: T, rows: int, columns: int, std: float = 0.05) -> np.ndarray:
    if qtype in HALF_FIELDS:
        return _blocks(rng, qtype, rows, columns)
    weights = (rng.standard_normal((rows, columns)) * std).astype(np.float32)
    return weights if qtype == T.F32 else quants.quantize(weights, qtype)


def write_tiny_llama(path: Path, qtype: T, seed: int = 0, tied: bool = True, head_type: T | None = None) -> Path:
    """A 2-layer random Llama of hidden size 256 in ``qtype`` (norms F32), its head tied to the
    embedding or its own tensor in ``head_type`` (default: ``qtype``)."""
    rng = np.random.default_rng(seed)
    tokens = vocabulary()[0]
    writer = GGUFWriter(str(path), "llama")
    writer.add_context_length(512)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(LAYERS)
    writer.add_feed_forward_length(INTERMEDIATE)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_dimension_count(HIDDEN // HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(len(tokens))
    add_vocabulary(writer)

    def add(name: str, data: np.ndarray, kind: T) -> None:
        writer.add_tensor(name, data, raw_dtype=None if kind == T.F32 else kind)

    kv = HIDDEN // HEADS * KV_HEADS
    add("token_embd.weight", _tensor(rng, qtype, len(tokens), HIDDEN, std=0.5), qtype)
    for i in range(LAYERS):
        add(f"blk.{i}.attn_norm.weight", np.ones(HIDDEN, np.float32), T.F32)
        add(f"blk.{i}.ffn_norm.weight", np.ones(HIDDEN, np.float32), T.F32)
        for name, rows, columns in (("attn_q", HIDDEN, HIDDEN), ("attn_k", kv, HIDDEN), ("attn_v", kv, HIDDEN),
                                    ("attn_output", HIDDEN, HIDDEN), ("ffn_gate", INTERMEDIATE, HIDDEN),
                                    ("ffn_up", INTERMEDIATE, HIDDEN), ("ffn_down", HIDDEN, INTERMEDIATE)):
            data = _tensor(rng, qtype, rows, columns)
            if name in ("attn_q", "attn_k"):
                data = _permute(data, HEADS if name == "attn_q" else KV_HEADS)
            add(f"blk.{i}.{name}.weight", data, qtype)
    add("output_norm.weight", np.ones(HIDDEN, np.float32), T.F32)
    if not tied:
        head = head_type or qtype
        add("output.weight", _tensor(rng, head, len(tokens), HIDDEN), head)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
