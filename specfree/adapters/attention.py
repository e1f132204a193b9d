"""SDPA for tree rows of grouped-query models on the CPU, without copying the KV cache.

When a mask is given, transformers' SDPA path repeats every key/value head of a grouped-query
model (a copy of the whole cache, per layer, per step), because the GPU kernels that take a
mask do not take grouped heads. Every tree step passes a mask. On the CPU, torch's kernel takes
both, with bit-identical results; at 1024 tokens of context the copy is about a fifth of a
2..8-row forward of SmolLM2-135M.

The function is registered under ``GROUPED_SDPA`` through transformers' own extension points
(``AttentionInterface`` and ``AttentionMaskInterface``), and a model opts in by name.
"""

from __future__ import annotations

import contextlib
import warnings

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from specfree.errors import UnsupportedModelError
from specfree.loading import ignores_custom_masks

GROUPED_SDPA = "specfree_grouped_sdpa"


def grouped_sdpa_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                           **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' SDPA, except that a masked CPU call keeps the key/value heads grouped."""
    groups = getattr(module, "num_key_value_groups", 1)
    plain = (attention_mask is None or groups == 1 or query.device.type != "cpu"
             or kwargs.get("position_bias") is not None or kwargs.get("cache") is not None)
    if plain:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    # query [B, H, Q, D]; key, value [B, H/groups, K, D]; attention_mask [B or 1, 1, Q, K]
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None  # [B, Q, H, D], as transformers expects


def is_grouped_query(model) -> bool:
    """Whether some attention layer shares each key/value head among several query heads."""
    return any(getattr(module, "num_key_value_groups", 1) > 1 for module in model.modules())


def use_grouped_sdpa(model) -> bool:
    """Switch an SDPA grouped-query model on the CPU to ``grouped_sdpa_attention``; True if switched."""
    if model.config._attn_implementation != "sdpa" or model.device.type != "cpu" or not is_grouped_query(model):
        return False
    AttentionInterface.register(GROUPED_SDPA, grouped_sdpa_attention)
    AttentionMaskInterface.register(GROUPED_SDPA, sdpa_mask)
    try:
        model.set_attn_implementation(GROUPED_SDPA)
    except (ValueError, ImportError):  # a family that refuses custom attention keeps its SDPA
        return False
    return model.config._attn_implementation == GROUPED_SDPA


@contextlib.contextmanager
def stock_attention(model):
    """Run transformers' own SDPA inside the block (for baselines that must be stock), then
    switch back to what the model ran before."""
    current = model.config._attn_implementation
    if current == GROUPED_SDPA:
        model.set_attn_implementation("sdpa")
    try:
        yield model
    finally:
        if current == GROUPED_SDPA:
            model.set_attn_implementation(current)


def use_maskable_attention(model) -> None:
    """Switch a flash-attention model to SDPA (or eager, for families without SDPA), which take
    the tree mask: same weights, same math."""
    current = model.config._attn_implementation
    if not ignores_custom_masks(current):
        return
    reasons = []
    for fallback in ("sdpa", "eager"):
        try:
            model.set_attn_implementation(fallback)
        except (ValueError, ImportError) as exc:  # the family lacks this implementation
            reasons.append(f"{fallback}: {exc}")
            continue
        if model.config._attn_implementation == fallback:
            warnings.warn(f"attn_implementation={current!r} cannot take specfree's tree attention mask; "
                          f"switched this model to {fallback!r}", stacklevel=4)
            return
        reasons.append(f"{fallback}: the model does not switch attention after loading")
    raise UnsupportedModelError(
        f"model family '{model.config.model_type}' runs {current!r}, which cannot take specfree's tree "
        f"attention mask, and could not be switched ({'; '.join(reasons)}). Load it with "
        "attn_implementation='sdpa' or 'eager'.")
