"""SDPA for tree rows of grouped-query models on the CPU, without copying the KV cache.

When a mask is given, transformers' SDPA path repeats every key/value head of a grouped-query
model (a copy of the whole cache, per layer, per step), because the GPU kernels that take a
mask do not take grouped heads. Every tree step passes a mask. On the CPU, torch's kernel takes
both, with bit-identical results; at 1024 tokens of context the copy is about a fifth of a
2..8-row forward of SmolLM2-135M.

The function is registered under ``GROUPED_SDPA`` through transformers' own extension points
(``AttentionInterface`` and ``AttentionMaskInterface``), and a model opts in by name.

``TREE_ATTENTION`` goes further for fp32 and bf16 models on the CPU: specfree's own operator
(``specfree.kernels.tree_attention``), which reads only the keys some row sees and gives each row the
same bits whatever else is in the step, so a verify row equals the one-row forward bit for bit.
It also computes Gemma 2's logit soft-capping, which SDPA cannot (those families run transformers'
eager attention otherwise). A bf16 model's call runs the same float32 arithmetic, the operator
widening its query, keys and values exactly as it reads them and rounding the output once: still
one fixed sequence of operations per row. Calls it does not cover (attention sinks, position
biases, dropout, other dtypes) run the grouped SDPA above.
"""

from __future__ import annotations

import contextlib
import warnings

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from specfree.errors import UnsupportedModelError
from specfree.loading import ignores_custom_masks

GROUPED_SDPA = "specfree_grouped_sdpa"
TREE_DTYPES = (torch.float32, torch.bfloat16)  # the operator's float32 math; bf16 widened as it is read
TREE_ATTENTION = "specfree_tree_attention"
# Attention features the operator does not compute: a call that carries one runs SDPA instead.
UNCOVERED_KWARGS = ("s_aux", "sinks", "position_bias", "cache", "head_mask")
# Config fields of families whose attention the operator does not compute.
UNCOVERED_CONFIG = ("alibi", "use_alibi", "attention_sink_size")
# A family that soft-caps its attention logits runs eager attention (SDPA cannot cap); the operator
# computes the same softmax(cap * tanh(scores / cap) + mask) V, so such a family may switch from eager.
SOFTCAP_CONFIG = "attn_logit_softcapping"


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


def tree_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                           **kwargs) -> tuple[torch.Tensor, None]:
    """specfree's tree-attention operator where it computes what the model asks, else
    ``grouped_sdpa_attention``. query [B, H, Q, D]; key, value [B, Hkv, S, D]; mask [B or 1, 1, Q, S].
    What the layer fixes (``layer_covered``) and what a call carries (its row count, dropout, extra
    arguments, mask) are both tested per call: a few attribute reads, traced once when compiled."""
    from specfree.kernels.tree_attention import LONG_ROWS, library_tree_attention, tree_attention

    if attention_mask is not None:
        attention_mask = attention_mask[:, :, :, : key.shape[-2]]  # as transformers' SDPA does
    covered = (query.shape[-2] <= LONG_ROWS  # a long prefill: SDPA is faster there
               and layer_covered(module, query, key, value, kwargs.get("softcap"))
               and not dropout and not any(kwargs.get(name) is not None for name in UNCOVERED_KWARGS)
               and (attention_mask is not None or getattr(module, "is_causal", True))
               and (attention_mask is None or (attention_mask.shape[1] == 1 and attention_mask.dim() == 4
                                                and attention_mask.shape[-1] == key.shape[-2])))
    softcap = kwargs.pop("softcap", None) or 0.0
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if softcap and not covered:
        # SDPA cannot cap: a soft-capped call the operator leaves (a long prefill, another dtype)
        # runs the same math in torch ops, so no call ever loses its cap.
        return library_tree_attention(query, key, value, attention_mask, scale, softcap), None
    if not covered:
        return grouped_sdpa_attention(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    return tree_attention(query, key, value, attention_mask, scale, softcap=softcap), None


def layer_covered(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  softcap: float | None) -> bool:
    """Whether the operator computes this layer's attention, as far as the layer itself decides:
    the CPU, one fp32 or bf16 dtype for query, key and value, a cap that is none or positive, no
    attention sinks, one head dim for query, key and value (MLA's values are narrower), whole query
    groups. Not cached: a module-level table of verdicts was global state that torch.compile guarded
    on, and its guards broke when a collected layer left the table (IndexError while creating a
    guard, the compiled path given up)."""
    return (query.device.type == "cpu" and query.dtype == key.dtype == value.dtype and query.dtype in TREE_DTYPES
            and (softcap or 0) >= 0
            and getattr(module, "sinks", None) is None
            and query.shape[-1] == key.shape[-1] == value.shape[-1] and key.shape[:3] == value.shape[:3]
            and query.shape[1] % key.shape[1] == 0)


def tree_attention_covers(model, cache_dir=None) -> bool:
    """Whether ``model`` can run ``TREE_ATTENTION``: transformers' SDPA, fp32 or bf16 on the CPU, none of the
    attention features the operator leaves out, and the operator built for this CPU (under
    ``cache_dir``; a failed build says so once, from the linear layers' swap)."""
    import warnings

    from specfree.kernels import load_kernels

    config = model.config
    softcapped_eager = config._attn_implementation == "eager" and getattr(config, SOFTCAP_CONFIG, None)
    if ((config._attn_implementation not in ("sdpa", GROUPED_SDPA) and not softcapped_eager)
            or model.device.type != "cpu"
            or model.dtype not in TREE_DTYPES
            or any(getattr(config, name, None) not in (None, False) for name in UNCOVERED_CONFIG)):
        return False
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return load_kernels(cache_dir, progress=False) is not None


def use_tree_attention(model, cache_dir=None) -> bool:
    """Switch a model ``tree_attention_covers`` to ``tree_attention_forward``; True if switched."""
    return tree_attention_covers(model, cache_dir) and _switch(model, TREE_ATTENTION, tree_attention_forward)


def attention_path(model) -> str:
    """Which attention the model runs, for ``describe()``: ``"tree_attention"`` (specfree's op:
    verify rows bit-equal to the one-row forward), ``"grouped_sdpa"``, or transformers' own name."""
    names = {TREE_ATTENTION: "tree_attention", GROUPED_SDPA: "grouped_sdpa"}
    current = model.config._attn_implementation
    return names.get(current, current)


def is_grouped_query(model) -> bool:
    """Whether some attention layer shares each key/value head among several query heads."""
    return any(getattr(module, "num_key_value_groups", 1) > 1 for module in model.modules())


def use_grouped_sdpa(model) -> bool:
    """Switch an SDPA grouped-query model on the CPU to ``grouped_sdpa_attention``; True if switched."""
    if model.config._attn_implementation != "sdpa" or model.device.type != "cpu" or not is_grouped_query(model):
        return False
    return _switch(model, GROUPED_SDPA, grouped_sdpa_attention)


def _switch(model, name: str, function) -> bool:
    """Register ``function`` under ``name`` through transformers' own extension points (with SDPA's
    mask) and switch ``model`` to it; False where the family refuses custom attention."""
    # here, not at the top: they load transformers' modeling code, which a warm start never needs
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(name, function)
    AttentionMaskInterface.register(name, sdpa_mask)
    try:
        model.set_attn_implementation(name)
    except (ValueError, ImportError):  # a family that refuses custom attention keeps its SDPA
        return False
    return model.config._attn_implementation == name


@contextlib.contextmanager
def stock_attention(model):
    """Run transformers' own SDPA (eager for a family that soft-caps its logits, which SDPA cannot)
    inside the block, for baselines that must be stock, then switch back to what the model ran before."""
    current = model.config._attn_implementation
    ours = current in (GROUPED_SDPA, TREE_ATTENTION)
    if ours:
        model.set_attn_implementation("eager" if getattr(model.config, SOFTCAP_CONFIG, None) else "sdpa")
    try:
        yield model
    finally:
        if ours:
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
