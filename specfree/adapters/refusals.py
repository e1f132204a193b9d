"""Models refused by what they are, before any probe: their logits cannot be reproduced by verifying
several tokens at once, whatever the drafts, or they do not decode one token sequence.

The wrap-time probes (``probes``) refuse what a few forwards can show (a row that sees later rows, logits
that change with how the tokens are split between forwards). These are the cases a short probe cannot
show; each message names the family and the reason.
"""

from __future__ import annotations

import inspect

import torch

from specfree.errors import UnsupportedModelError
from specfree.kernels.panels import PanelLinear


def refuse_unverifiable(model, max_length: int) -> None:
    """Raise ``UnsupportedModelError`` for a model specfree cannot verify exactly (``max_length``: the
    context it will decode up to)."""
    config = model.config
    family = config.model_type
    if "shared_kv_states" in inspect.signature(model.forward).parameters:
        raise UnsupportedModelError(
            f"model family '{family}' is a drafting head for another model: its forward ignores input_ids and "
            "takes that model's last hidden state and keys and values (inputs_embeds, shared_kv_states), so it "
            "is not a language model on its own. Give specfree the model it drafts for.")
    check_one_lm_head(model)
    if "indexed_attention" in layer_kinds(model):
        # Refused by kind: a probe over a few tokens never reaches the top-k budget, so it cannot show that a
        # model's pick is split-invariant. (Qwen4-Exp's QSA, a top-k over per-query block lists, measures
        # split-invariant in transformers 5.23, but that is its implementation's property, not the kind's.)
        raise UnsupportedModelError(
            f"model family '{family}' runs sparse top-k attention (indexed_attention layers): a row sees "
            "only the keys a top-k over indexer scores picks, and in transformers the pick can change with how "
            "the tokens are split between forwards (DeepSeek-V3.2-style indexers break score ties by the "
            "forward's length), so specfree cannot guarantee generate's output. Use another model family.")
    lsh_chunk = getattr(config, "lsh_attn_chunk_length", None)
    if "lsh" in (getattr(config, "attn_layers", None) or ()) and (lsh_chunk or 0) < max_length:
        raise UnsupportedModelError(
            f"model family '{family}' runs LSH attention (attn_layers 'lsh', lsh_attn_chunk_length={lsh_chunk}): "
            f"past {lsh_chunk} tokens a forward sorts the tokens into hash-bucket chunks, so a row's logits change "
            "with later tokens, and generate's one-token cached steps attend over other keys than a forward over "
            "several tokens. Use a model with local attention layers only, or another model family.")


def layer_kinds(model) -> set[str]:
    """The layer kinds a model's config names (``layer_types``), empty where it names none."""
    return set(getattr(model.config.get_text_config(decoder=True), "layer_types", None) or [])


def check_one_lm_head(model) -> None:
    """Refuse a model without one LM head over its vocabulary: specfree drafts and verifies one token
    sequence, one token per position. MusicGen's decoders have a list of heads, one per audio codebook,
    and take one row of input_ids per codebook."""
    heads = model.get_output_embeddings()
    if isinstance(heads, PanelLinear):  # packed already (its ``weight`` would be a copy)
        return
    if isinstance(getattr(heads, "weight", None), torch.Tensor) and heads.weight.dim() == 2:
        return
    config = model.config
    family = config.model_type
    codebooks = getattr(config.get_text_config(decoder=True), "num_codebooks", None)
    if isinstance(heads, torch.nn.ModuleList):
        raise UnsupportedModelError(
            f"model family '{family}' keeps its LM heads in a list ({len(heads)}"
            + (f", one per audio codebook, num_codebooks={codebooks}: its input_ids hold one row per codebook, "
               "and its generate offsets the codebooks by a delay pattern and drops pad tokens from its output"
               if codebooks is not None else "")
            + "), while specfree drafts and verifies one token sequence with one LM head. "
            "Use another model family.")
    raise UnsupportedModelError(
        f"model family '{family}' has no single LM head over its vocabulary (its output embeddings are "
        f"{type(heads).__name__}), so specfree cannot verify drafts on it. Use another model family.")
