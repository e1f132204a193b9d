"""Tiny random causal LMs of several families for the lookahead tests.

A wide init range spreads the logits, so near-ties that fp32 rounding could flip between a
one-row and a many-row forward are vanishingly rare.
"""

from __future__ import annotations

import functools

import torch
import transformers

VOCAB = 96
EOS = 2
COMMON = dict(vocab_size=VOCAB, bos_token_id=1, eos_token_id=EOS, pad_token_id=0, initializer_range=0.25)

CONFIGS = {
    "llama": lambda ctx: transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                                  num_attention_heads=4, num_key_value_heads=2,
                                                  max_position_embeddings=ctx, **COMMON),
    "qwen2": lambda ctx: transformers.Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                                  num_attention_heads=4, num_key_value_heads=2,
                                                  max_position_embeddings=ctx, **COMMON),
    "gpt2": lambda ctx: transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=ctx, **COMMON),
    "gpt_neox": lambda ctx: transformers.GPTNeoXConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                                       num_attention_heads=4, max_position_embeddings=ctx,
                                                       **COMMON),
}
FAMILIES = sorted(CONFIGS)


@functools.cache
def tiny(family: str, context: int = 256, seed: int = 0) -> transformers.PreTrainedModel:
    torch.manual_seed(seed)
    config = CONFIGS[family](context)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    model.generation_config.pad_token_id = 0
    return model


def plain_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' own greedy decoding, EOS ignored: the ground truth."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             min_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()
