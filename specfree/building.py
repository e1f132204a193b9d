"""How specfree asks transformers to build a model: with the attention the family supports."""

from __future__ import annotations


def with_supported_attention(build, attn_implementation: str | None):
    """``build(attn_implementation)``; where the family refuses SDPA (Gemma 2: its soft-capping), the
    family's own choice, as transformers' ``from_pretrained`` makes it when asked for none."""
    try:
        return build(attn_implementation)
    except ValueError as exc:
        if not (attn_implementation == "sdpa" and "scaled_dot_product_attention" in str(exc)):
            raise
    return build(None)
