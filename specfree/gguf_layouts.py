"""Tensors that llama.cpp's converter (``convert_hf_to_gguf.py``) rewrites, read back in transformers' layout.

transformers' GGUF tensor processors undo most of the converter's rewrites: Llama's q/k rows permuted for
its rope, Bloom's fused heads, GPT-2's transposed ``Conv1D`` weights, Gemma's and Nemotron's norms stored as
1 + w, Mamba's A stored as -exp(A_log). Falcon's they do not: the converter rearranges its fused
``query_key_value`` from key/value groups of [the group's queries, key, value] into all queries, then all
keys, then all values, and says so in the file (``falcon.tensor_data_layout`` = "jploski"). The full list,
and how specfree reads each, is in docs/families.md ("Tensors the converter rewrites").

``tensor_processor`` gives the processor for a file's architecture (transformers' own, or Falcon's here);
``check_layout`` refuses, by tensor and architecture, a file whose layout the file does not let specfree know.
"""

from __future__ import annotations

import numpy as np

from specfree.errors import ModelLoadError

FALCON_LAYOUT = "jploski"  # what llama.cpp's converter writes as falcon.tensor_data_layout
# Layouts a file may state, per architecture, that specfree reads (Meta's original q/k order is the
# rope permutation llama.cpp's converter applies, which transformers' Llama processor undoes).
KNOWN_LAYOUTS = {"falcon": (FALCON_LAYOUT,), "llama": ("Meta AI original pth",)}


def falcon_groups(config: dict) -> int:
    """How many key/value groups transformers' ``FalconAttention`` splits the fused projection into:
    the key/value heads in the newer decoder and in the old one without multi-query, one with it."""
    if config.get("new_decoder_architecture") or not config.get("multi_query", True):
        return int(config["num_kv_heads"])
    return 1


def grouped_qkv(rows: np.ndarray, heads: int, groups: int) -> np.ndarray:
    """Falcon's fused rows as llama.cpp's converter writes them (all queries, all keys, all values) put
    in transformers' order: ``groups`` groups of [that group's queries, its key, its value]."""
    head_dim = rows.shape[0] // (heads + 2 * groups)
    rest = rows.shape[1:]
    queries, keys, values = np.split(rows, [heads * head_dim, (heads + groups) * head_dim])
    parts = (queries.reshape(groups, heads // groups, head_dim, *rest), keys.reshape(groups, 1, head_dim, *rest),
             values.reshape(groups, 1, head_dim, *rest))
    return np.concatenate(parts, axis=1).reshape(rows.shape)


def _falcon_processor_class():
    from transformers.modeling_gguf_pytorch_utils import GGUFTensor, TensorProcessor

    class FalconTensorProcessor(TensorProcessor):
        """transformers has no Falcon processor (it reads the converter's rows as they are)."""

        def process(self, weights, name, **kwargs):
            if ".attn_qkv." in name:
                weights = grouped_qkv(weights, int(self.config["num_attention_heads"]), falcon_groups(self.config))
            return GGUFTensor(weights, name, {})

    return FalconTensorProcessor


def tensor_processor(architecture: str, config):
    """The tensor processor that reads a file of ``architecture`` (``config``: the model's config)."""
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    cls = _falcon_processor_class() if architecture == "falcon" else TENSOR_PROCESSORS.get(architecture, TensorProcessor)
    return cls(config=config.to_dict())


def check_layout(architecture: str, fields: dict, config, tensor_names: set[str], path) -> None:
    """One ``ModelLoadError`` line, naming the tensor and the architecture, where the file does not let
    specfree know the layout its tensors are in: a stated layout specfree has not mapped, a Falcon file
    whose fused heads are not stated to be in the converter's order (where that order differs from
    transformers'), or a rewrite transformers' names cannot place (StableLM's per-head q/k norms)."""
    layout = fields.get(f"{architecture}.tensor_data_layout")
    if layout is not None and layout not in KNOWN_LAYOUTS.get(architecture, ()):
        raise ModelLoadError(f"cannot load {path}: it states its tensors are in the {layout!r} layout, which "
                             f"specfree does not map for the {architecture} architecture (it reads "
                             f"{', '.join(map(repr, KNOWN_LAYOUTS.get(architecture, ()))) or 'none stated'}), "
                             "so it would decode a guess. Convert the model with llama.cpp's convert_hf_to_gguf.py, "
                             "or give its transformers folder")
    if architecture == "falcon" and layout != FALCON_LAYOUT and falcon_groups(config.to_dict()) > 1:
        raise ModelLoadError(f"cannot load {path}: its tensor blk.0.attn_qkv.weight (falcon) holds "
                             f"{config.num_kv_heads} key/value groups, and the file does not say in which order (no "
                             f"falcon.tensor_data_layout = {FALCON_LAYOUT!r}, which llama.cpp's converter writes), "
                             "so it would decode a guess. Convert the model with llama.cpp's convert_hf_to_gguf.py, "
                             "or give its transformers folder")
    stacked = sorted(n for n in tensor_names if n.endswith(("attn_q_norm.weight", "attn_k_norm.weight")))
    if architecture == "stablelm" and stacked:
        raise ModelLoadError(f"cannot load {path}: its tensor {stacked[0]} (stablelm) stacks one norm a head, "
                             "which transformers' GGUF names do not place on StableLM's per-head norms. Give the "
                             "model's transformers folder instead")


def transformers_misreads(architecture: str, config) -> str | None:
    """Why transformers' own ``from_pretrained(gguf_file=)`` would misread the file, or None: specfree
    then reads it only into its own model (a CPU, float32)."""
    if architecture == "falcon" and falcon_groups(config.to_dict()) > 1:
        return ("transformers reads Falcon's fused attn_qkv as if the file kept its key/value groups, which "
                "llama.cpp's converter rearranges")
    return None
