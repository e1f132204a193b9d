"""A tiny random Llama with a byte-level tokenizer and a chat template, saved to a temp folder."""

from __future__ import annotations

import json

import pytest

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CONTEXT = 96


def make_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    for special in ("<|endoftext|>", "<|im_start|>", "<|im_end|>"):
        vocab[special] = len(vocab)
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|im_end|>", bos_token="<|endoftext|>",
                                  pad_token="<|endoftext|>",
                                  additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    tok.chat_template = CHAT_TEMPLATE
    return tok


def save_tiny_llama(folder, context: int = CONTEXT):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = make_tokenizer()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=context,
                         eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id,
                         pad_token_id=tok.pad_token_id)
    LlamaForCausalLM(config).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def long_tiny_model_dir(tmp_path_factory):
    """The same tiny Llama with 2048 positions: room for a code-edit conversation in bytes."""
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama-2k"), context=2048)


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


@pytest.fixture
def write_jsonl():
    """``write_jsonl(path, rows) -> path``: one JSON object per line."""
    return _write_jsonl


@pytest.fixture
def prompts(tmp_path):
    """Three prompts: a repetitive one, a two-turn chat, and one longer than the tiny model's context."""
    return _write_jsonl(tmp_path / "prompts.jsonl", [
        {"id": "rep", "category": "code", "prompt": "abc abc abc abc abc"},
        {"id": "chat", "category": "chat", "turns": ["hello there", "and again"]},
        {"id": "long", "category": "chat", "prompt": "far too long " * 20},  # > the model's 96 positions
    ])
