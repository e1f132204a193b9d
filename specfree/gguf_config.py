"""A GGUF's config as the file states it, and its tensors checked against the model built from it.

transformers' GGUF config map reads a fixed set of keys per architecture and drops others the file
states: a Qwen3 file's ``attention.key_length`` (transformers then assumes 128 dims a head), a
Qwen3-MoE file's ``expert_feed_forward_length`` (the default 768 instead), a Falcon file's grouped
key/value heads (read as multi-query). ``file_config`` puts the file's values over those defaults;
``check_shapes`` then compares every tensor with the parameter it fills before anything is read, so a
disagreement left is one line naming the tensor, both shapes and the config fields involved.
"""

from __future__ import annotations

import numpy as np

from specfree.errors import ModelLoadError

# GGUF key (after "<arch>.") -> config field it sets, where the config has that field.
STATED = {
    "attention.key_length": "head_dim",
    "expert_feed_forward_length": "moe_intermediate_size",
    "expert_shared_feed_forward_length": "shared_expert_intermediate_size",
    "attention.layer_norm_epsilon": "layer_norm_epsilon",  # Falcon's (transformers maps an RMS key there)
    "context_length": "n_positions",  # GPT-2's position table (transformers sets n_ctx only)
    "feed_forward_length": "n_inner",  # GPT-2's (transformers sets a field GPT-2 does not read)
}
# Architectures in transformers' GGUF support that specfree refuses, and why (docs/families.md).
REFUSED = {
    "deci": "transformers has no model of the deci architecture (DeciLM is remote code), so no model of the "
            "file can be built",
    "gpt-oss": "its experts (MXFP4 blocks, biases, gate and up interleaved) are not mapped onto transformers' "
               "fused expert parameters by specfree's loader yet",
}
# Fields named in a shape disagreement's line (those the config has).
SHAPE_FIELDS = ("hidden_size", "num_attention_heads", "num_key_value_heads", "num_kv_heads", "head_dim",
                "intermediate_size", "moe_intermediate_size", "num_experts", "vocab_size")


def refuse_architecture(architecture: str, path) -> None:
    """One ``ModelLoadError`` line for a file of an architecture in ``REFUSED``."""
    why = REFUSED.get(architecture)
    if why is not None:
        raise ModelLoadError(f"cannot load {path}: GGUF files of the {architecture} architecture are not supported: "
                             f"{why}. Give the model's transformers folder or hub id instead")


def file_config(config, fields: dict, architecture: str, tensor_names: set[str]) -> dict[str, object]:
    """Set on ``config`` what the file states and transformers' map dropped; returns the fields changed.
    ``fields``: the file's metadata (key -> value)."""
    present = config.to_dict()
    changed: dict[str, object] = {}

    def put(name: str, value) -> None:
        if value is not None and present.get(name, value) != value:
            setattr(config, name, value)
            changed[name] = value

    for key, name in STATED.items():
        value = fields.get(f"{architecture}.{key}")
        if name in present and value is not None:
            put(name, value if isinstance(value, float) else int(value))
    if config.model_type == "falcon":  # grouped key/value heads: the newer decoder (two norms a layer)
        kv_heads = fields.get("falcon.attention.head_count_kv")
        if "blk.0.attn_norm_2.weight" in tensor_names:
            put("new_decoder_architecture", True)
        if kv_heads is not None:
            put("num_kv_heads", int(kv_heads))
            put("multi_query", int(kv_heads) == 1)
    return changed


def read_fields(path) -> dict:
    """The file's metadata as plain values (arrays left out: the vocabulary is not needed here)."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    out = {}
    for key, field in reader.fields.items():
        if field.types and field.types[0] != gguf.GGUFValueType.ARRAY:
            out[key] = field.contents()
    return out


def parameter_of(mapping: dict[str, str], name: str) -> str | None:
    """The model parameter a file tensor fills (``gguf_names``' map; a fused MoE key has no ``.weight``)."""
    return mapping.get(name) or mapping.get(name.removesuffix(".weight"))


def check_shapes(model, weights, mapping: dict[str, str], path) -> None:
    """One ``ModelLoadError`` line where a file tensor's size is not the size of the parameter it fills
    (a fused parameter, MoE experts' gate and up, takes equal parts of several)."""
    params = dict(model.named_parameters(remove_duplicate=False))
    parts: dict[str, int] = {}
    for name, *_ in weights.tensors:
        hf_name = parameter_of(mapping, name)
        if hf_name is not None:
            parts[hf_name] = parts.get(hf_name, 0) + 1
    for name, _, shape, _, _ in weights.tensors:
        hf_name = parameter_of(mapping, name)
        param = params.get(hf_name) if hf_name is not None else None
        if param is None:
            continue
        expected = param.numel() // parts[hf_name]
        if int(np.prod(shape)) != expected:
            config = model.config.to_dict()
            stated = ", ".join(f"{f}={config[f]}" for f in SHAPE_FIELDS if config.get(f) is not None)
            raise ModelLoadError(
                f"could not load {path}: its tensor {name} has shape {list(shape)}, but the "
                f"{model.config.model_type} model built from the file's metadata ({stated}) needs "
                f"{tuple(param.shape)} for {hf_name}: the file's metadata and tensors disagree. Convert the model "
                "again with llama.cpp's convert_hf_to_gguf.py, or give its transformers folder")
