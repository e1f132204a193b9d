"""Tiny random models of every architecture transformers reads from GGUF, written as GGUF files the way
llama.cpp's converter lays them out, so the tests need neither a download nor llama.cpp.

The writer works from transformers' own tables, inverted: the config goes out under the keys transformers'
GGUF config map reads (plus the ones llama.cpp writes that transformers drops: ``attention.key_length``,
``expert_feed_forward_length``), and each parameter under the tensor name ``gguf``'s map gives it, put back
into the file's layout by undoing transformers' tensor processor (a row permutation, a transpose, or an
offset, found by probing it). Falcon's fused heads are the exception: transformers has no processor for them,
so ``converter_qkv`` writes them in the converter's order from the layout itself, not from specfree's reader
(a misreading shared by writer and reader would pass). ``file_model`` is the reference: the source model with
every parameter set to what specfree's processor (transformers', or Falcon's in ``specfree.gguf_layouts``)
makes of the file's tensor, so it holds exactly the file's values.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T, GGUFWriter, quants

from tests.gguf_files import HALF_FIELDS, add_vocabulary, vocabulary

HIDDEN, INTERMEDIATE, LAYERS, HEADS, KV_HEADS, HEAD_DIM = 256, 512, 2, 4, 2, 64
TYPES = ("F16", "Q8_0", "Q4_K_M")
# gguf architecture name where it is not the model type without underscores
GGUF_ARCH = {"mistral": "llama", "gpt_oss": "gpt-oss", "gemma3_text": "gemma3"}
# transformers' config-map section where it is not the model type
MAP_SECTION = {"gemma3_text": "gemma3"}
# What each family needs on top of the common sizes to be a consistent tiny model.
CONFIGS: dict[str, dict] = {
    "llama": {}, "mistral": {}, "qwen2": {}, "qwen3": dict(head_dim=32), "phi3": {},
    # transformers' default scale (no GGUF key states it): 1/sqrt(256), as the released Gemmas have it
    "gemma2": dict(head_dim=32, sliding_window=16, query_pre_attn_scalar=256),
    "gemma3_text": dict(head_dim=32, sliding_window=16, query_pre_attn_scalar=256),
    "starcoder2": {}, "stablelm": dict(partial_rotary_factor=0.25),
    "nemotron": dict(partial_rotary_factor=0.5),
    "falcon": dict(new_decoder_architecture=True, num_kv_heads=KV_HEADS, parallel_attn=True, bias=False),
    "qwen3_moe": dict(head_dim=32, norm_topk_prob=True, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=256,
                      decoder_sparse_step=1, mlp_only_layers=[]),
    "qwen2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=256,
                      shared_expert_intermediate_size=256),
}
CONFIGS.update({"gpt2": dict(n_inner=512, n_positions=512), "bloom": {}, "mamba": dict(state_size=16),
                "lfm2": dict(layer_types=["conv", "full_attention"], block_auto_adjust_ff_dim=False)})
# In transformers' GGUF support but not written here, and why (docs/families.md, GGUF files)
NOT_WRITTEN = {
    "deci": "transformers has no model of the deci architecture (DeciLM is remote code): its files cannot be built",
    "gpt_oss": "its experts are MXFP4 and its attention sinks a tensor transformers' name map does not place",
}
ARCHITECTURES = tuple(CONFIGS)


def tiny_config(model_type: str, extra: dict | None = None):
    """The tiny config of ``model_type``; ``extra``: fields over ``CONFIGS``' (another decoder kind)."""
    from transformers import AutoConfig

    sizes = dict(vocab_size=len(vocabulary()[0]), hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
                 num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                 max_position_embeddings=512, bos_token_id=511, eos_token_id=511, pad_token_id=0,
                 tie_word_embeddings=True)
    # epsilons a float32 field holds exactly: the file's model then has the source's
    sizes.update(dict.fromkeys(("rms_norm_eps", "layer_norm_eps", "norm_epsilon", "norm_eps", "layer_norm_epsilon"),
                               2.0 ** -17))
    config = AutoConfig.for_model(model_type, **{**sizes, **CONFIGS[model_type], **(extra or {})})
    config.architectures = None
    return config


def source_model(model_type: str, seed: int = 0, extra: dict | None = None):
    """A random float32 model of ``model_type`` whose weights keep activations in range."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(model_type, extra), dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.5 if "embed" in name or "wte" in name else 0.05)
            elif "norm" in name or "ln" in name:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0, 0.02)
    return model


def _processor(model_type: str, config):
    from specfree.gguf_layouts import tensor_processor

    arch = GGUF_ARCH.get(model_type, model_type.replace("_", ""))
    return arch, tensor_processor(arch, config)


def converter_qkv(rows: np.ndarray, config) -> np.ndarray:
    """Falcon's fused query_key_value rows (transformers' order: key/value groups of [the group's queries,
    key, value]) in the order llama.cpp's converter writes them: all queries, then all keys, then all values.
    The groups are transformers' own: the key/value heads in the newer decoder and in the old one without
    multi-query, one group with it."""
    heads = config.num_attention_heads
    groups = config.num_kv_heads if config.new_decoder_architecture or not config.multi_query else 1
    head_dim = config.hidden_size // heads
    per_group = rows.reshape(groups, heads // groups + 2, head_dim, *rows.shape[1:])
    queries, keys, values = per_group[:, :-2], per_group[:, -2], per_group[:, -1]
    return np.concatenate([part.reshape(-1, *rows.shape[1:]) for part in (queries, keys, values)])


def _process(processor, name: str, values: np.ndarray) -> np.ndarray | None:
    result = processor.process(weights=values, name=name, tensor_key_mapping={},
                               parsed_parameters={"tensors": {}, "config": {}})
    return None if result.name is None else np.asarray(result.weights)


def _inverse(processor, name: str, value: np.ndarray) -> np.ndarray:
    """The file's layout of ``value`` (transformers' layout) for tensor ``name``: the processor undone. It
    is found by probing: an offset (Gemma's norms: the file holds 1 + w), then any rearrangement of the
    elements (a row permutation, a transpose, Bloom's fused heads), on the shape itself or with a
    singleton axis the processor adds (Mamba's and LFM2's convolutions)."""
    if "ssm_a" in name:  # Mamba: the file holds A, transformers log(-A)
        return -np.exp(value)
    shape = value.shape
    candidates = [shape, shape[::-1]] + [shape[:i] + shape[i + 1:] for i in range(len(shape)) if shape[i] == 1]
    for layout in candidates:
        try:
            offset = _process(processor, name, np.zeros(layout))
            moved = _process(processor, name, np.arange(value.size, dtype=np.float64).reshape(layout))
        except ValueError:
            continue
        if offset is None or moved is None:
            raise NotImplementedError(name)
        moved = moved - offset
        if moved.size != value.size or moved.shape != shape and moved.shape != (1, *shape):
            continue
        if not np.array_equal(np.sort(moved.reshape(-1)), np.arange(value.size)):
            continue
        out = np.empty(value.size, dtype=value.dtype)
        out[moved.reshape(-1).astype(np.int64)] = (value - offset.reshape(value.shape)).reshape(-1)
        return out.reshape(layout)
    raise NotImplementedError(f"{name}: {shape}")


def _coded_type(name: str, shape: tuple, kind: str) -> T | None:
    if len(shape) < 2 or kind == "F32":
        return None
    if kind == "F16":
        return T.F16
    if kind == "Q8_0":
        return T.Q8_0 if shape[-1] % 32 == 0 else T.F16
    if shape[-1] % 256:  # Q4_K_M: Q6_K for the embedding, head and ffn_down as llama.cpp mixes them
        return T.Q8_0 if shape[-1] % 32 == 0 else T.F16
    return T.Q6_K if ("token_embd" in name or name.startswith("output") or "ffn_down" in name) else T.Q4_K


def _encode(rng: np.random.Generator, values: np.ndarray, qtype: T) -> np.ndarray:
    if qtype == T.F16:
        return values.astype(np.float16)
    if qtype in HALF_FIELDS:  # gguf quantizes no K-type: random blocks with small scales
        block, size = GGML_QUANT_SIZES[qtype]
        raw = rng.integers(0, 256, size=(values.size // block, size), dtype=np.uint8)
        for offset in HALF_FIELDS[qtype]:
            raw[:, offset:offset + 2] = rng.uniform(2e-4, 1e-3, size=len(raw)).astype(np.float16).view(
                np.uint8).reshape(-1, 2)
        return raw.reshape(*values.shape[:-1], values.shape[-1] // block * size)
    return quants.quantize(values.astype(np.float32), qtype)


def _add_value(writer: GGUFWriter, key: str, value) -> None:
    if isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, int):
        writer.add_uint32(key, value)
    elif isinstance(value, float):
        writer.add_float32(key, value)
    elif isinstance(value, (list, tuple)):
        writer.add_array(key, list(value))
    elif isinstance(value, str):
        writer.add_string(key, value)


def write_architecture(path: Path, model_type: str, kind: str, seed: int = 0, extra: dict | None = None):
    """``path`` written as a GGUF of ``model_type`` in ``kind`` (F16, Q8_0, Q4_K_M); returns the source model.
    ``extra``: config fields over ``CONFIGS``' (Falcon's other decoder kinds)."""
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    from specfree.gguf_model import gguf_names

    model = source_model(model_type, seed, extra)
    config = model.config
    arch, processor = _processor(model_type, config)
    rng = np.random.default_rng(seed)
    tokens = vocabulary()[0]
    writer = GGUFWriter(str(path), arch)
    writer.add_name(f"tiny-{model_type}")
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    values = {key: getattr(config, field, None) if isinstance(field, str) else None
              for key, field in GGUF_CONFIG_MAPPING[MAP_SECTION.get(model_type, model_type)].items()}
    # what llama.cpp's converter writes besides, read by specfree where transformers' map drops it
    values.update({"attention.key_length": head_dim, "attention.value_length": head_dim,
                   "rope.dimension_count": int(head_dim * getattr(config, "partial_rotary_factor", 1.0)),
                   "expert_feed_forward_length": getattr(config, "moe_intermediate_size", None),
                   "expert_shared_feed_forward_length": getattr(config, "shared_expert_intermediate_size", None),
                   "vocab_size": len(tokens)})
    if getattr(config, "n_positions", None):  # GPT-2's position table: llama.cpp writes it as the context
        values["context_length"] = config.n_positions
        values["feed_forward_length"] = config.n_inner
    if model_type == "falcon":
        values["attention.layer_norm_epsilon"] = config.layer_norm_epsilon
        values["tensor_data_layout"] = "jploski"  # as llama.cpp's converter says it rearranged the fused heads
    if model_type == "lfm2":  # key/value heads per layer, 0 for a convolution layer
        values["attention.head_count_kv"] = [KV_HEADS if kind == "full_attention" else 0 for kind in config.layer_types]
        values["rope.freq_base"] = float(config.rope_parameters["rope_theta"])
    for key, value in values.items():
        if value is not None:
            _add_value(writer, f"{arch}.{key}", value)
    add_vocabulary(writer)
    writer.add_pad_token_id(0)
    state = dict(model.named_parameters())  # a tied head is not a tensor of its own
    for gguf_name, hf_name in gguf_names(model, processor, arch).items():
        if hf_name not in state:
            continue
        value = state[hf_name].detach().numpy()
        if "_exps" in gguf_name and not gguf_name.endswith(".weight"):  # a fused parameter's key: the file's is a weight
            gguf_name += ".weight"
        merged = re.fullmatch(r".*ffn_(gate|up)_exps\.weight", gguf_name)
        if merged:  # gate_up_proj [E, 2I, H]: gate the first half, up the second
            half = value.shape[1] // 2
            value = value[:, :half] if merged[1] == "gate" else value[:, half:]
        elif model_type == "falcon" and ".attn_qkv." in gguf_name:
            value = converter_qkv(value, config)
        else:
            value = _inverse(processor, gguf_name, value)
        qtype = _coded_type(gguf_name, value.shape, kind)
        if qtype is None:
            writer.add_tensor(gguf_name, np.ascontiguousarray(value, dtype=np.float32))
        else:
            writer.add_tensor(gguf_name, _encode(rng, np.ascontiguousarray(value), qtype),
                              raw_dtype=None if qtype == T.F16 else qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return model


def file_model(path: Path, model):
    """``model`` with every parameter set to transformers' processing of the file's tensor (float32): the
    model of the file, built on the source config (so metadata transformers drops cannot hide a fault)."""
    import gguf

    from specfree.gguf_model import gguf_names

    arch, processor = _processor(model.config.model_type, model.config)
    mapping = gguf_names(model, processor, arch)
    found: dict = {"tensors": {}, "config": {}}
    reader = gguf.GGUFReader(str(path))
    params = dict(model.named_parameters(remove_duplicate=False))
    with torch.no_grad():
        for tensor in reader.tensors:
            values = np.asarray(gguf.quants.dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
            result = processor.process(weights=values, name=tensor.name, tensor_key_mapping=mapping,
                                       parsed_parameters=found)
            if result.name is not None:
                found["tensors"][mapping.get(result.name) or mapping[result.name.removesuffix(".weight")]] = torch.from_numpy(np.ascontiguousarray(result.weights))
        for hf_name, value in found["tensors"].items():
            params[hf_name].copy_(value.reshape(params[hf_name].shape))
    return model
