"""Tiny randomly initialised causal LMs of several families, for property tests.

Weights are drawn with a large init range so logits are spread out: near-ties between the
top two tokens (which fp32 rounding could flip) become vanishingly rare.
"""

from __future__ import annotations

import functools

import torch
import transformers

from specfree.adapters import as_shipped
from specfree.strategies.base import Strategy
from specfree.types import Proposal

VOCAB = 128
BOS, EOS, PAD = 1, 2, 0
COMMON = dict(vocab_size=VOCAB, bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD, initializer_range=0.3)



def _llama(**extra) -> transformers.LlamaConfig:
    return transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=2, max_position_embeddings=512, **extra, **COMMON)


CONFIGS = {
    "llama": _llama,
    "mistral": lambda: transformers.MistralConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                                  num_attention_heads=4, num_key_value_heads=2,
                                                  max_position_embeddings=512, sliding_window=None, **COMMON),
    "qwen2": lambda: transformers.Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                              num_attention_heads=4, num_key_value_heads=2,
                                              max_position_embeddings=512, **COMMON),
    "gpt2": lambda: transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=512, **COMMON),
    "gpt_neox": lambda: transformers.GPTNeoXConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                                   num_attention_heads=4, max_position_embeddings=512, **COMMON),
    "phi3": lambda: transformers.Phi3Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2,
                                            max_position_embeddings=512, **COMMON),
}
# Llama-shaped sizes shared by the families added below.
LAYERS = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=512)
# Mixed sliding/full layers with a window shorter than the tests' prompt + output, so the
# window really cuts attention.
WINDOWED = dict(sliding_window=16, layer_types=["sliding_attention", "full_attention"])
FOUR_WINDOWED = dict(LAYERS, num_hidden_layers=4, head_dim=8, sliding_window=16,
                     layer_types=["sliding_attention", "full_attention"] * 2)
CONFIGS.update({
    "gemma": lambda: transformers.GemmaConfig(head_dim=8, **LAYERS, **COMMON),
    # Gemma2 adds attention-logit soft-capping (eager attention only) to the mixed windows.
    "gemma2": lambda: transformers.Gemma2Config(head_dim=8, **WINDOWED, **LAYERS, **COMMON),
    "gemma3_text": lambda: transformers.Gemma3TextConfig(head_dim=8, **WINDOWED, **LAYERS, **COMMON),
    "opt": lambda: transformers.OPTConfig(hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4,
                                          word_embed_proj_dim=32, max_position_embeddings=512, **COMMON),
    "falcon": lambda: transformers.FalconConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                                max_position_embeddings=512, **COMMON),
    "stablelm": lambda: transformers.StableLmConfig(**LAYERS, **COMMON),
    "phi": lambda: transformers.PhiConfig(**LAYERS, **COMMON),
    "qwen3": lambda: transformers.Qwen3Config(head_dim=8, **LAYERS, **COMMON),
    "smollm3": lambda: transformers.SmolLM3Config(**LAYERS, **COMMON),
    "olmo2": lambda: transformers.Olmo2Config(**LAYERS, **COMMON),
    "starcoder2": lambda: transformers.Starcoder2Config(**LAYERS, **COMMON),
    "mixtral": lambda: transformers.MixtralConfig(num_local_experts=4, num_experts_per_tok=2, **LAYERS, **COMMON),
    # Gemma 3n: layers 2-3 reuse layers 0-1's KV (no cache of their own), per-layer inputs, AltUp, LAuReL,
    # activation-sparse feed-forwards, mixed sliding/full layers past the window
    "gemma3n_text": lambda: transformers.Gemma3nTextConfig(
        num_kv_shared_layers=2, activation_sparsity_pattern=[0.95, 0.95, 0.0, 0.0], vocab_size_per_layer_input=VOCAB,
        hidden_size_per_layer_input=8, laurel_rank=8, **FOUR_WINDOWED, **COMMON),
    # Gemma 4: KV sharing as above; full layers with wider heads and keys as values (KV of other shapes per
    # layer); per-layer inputs, experts, double-wide MLPs on the shared layers
    "gemma4_text": lambda: transformers.Gemma4TextConfig(
        num_kv_shared_layers=2, global_head_dim=16, attention_k_eq_v=True, num_global_key_value_heads=1,
        use_double_wide_mlp=True, hidden_size_per_layer_input=8, vocab_size_per_layer_input=VOCAB,
        enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32, **FOUR_WINDOWED, **COMMON),
    # three-axis RoPE on sliding layers beside a full layer without RoPE (Command A's layout)
    "cohere_compass_text": lambda: transformers.CohereCompassTextConfig(
        layer_types=["sliding_attention", "full_attention"], sliding_window=16,
        rope_parameters={"sliding_attention": dict(rope_type="default", rope_theta=50000.0, mrope_section=[2, 1, 1]),
                         "full_attention": None}, **LAYERS, **COMMON),
    # an encoder family (RoBERTa-like, with per-language adapters) loaded as a decoder: causal, so trees
    "xmod": lambda: transformers.XmodConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                            num_attention_heads=4, max_position_embeddings=512, is_decoder=True,
                                            default_language="en_XX", **COMMON),
})
if hasattr(transformers, "DoryConfig"):  # transformers 5.24 on
    # looped layers: each loop writes its own copy of the looped layers' KV (6 cache layers for 4 layers)
    CONFIGS["dory"] = lambda: transformers.DoryConfig(
        n_input_layers=1, n_recurrent_layers=2, n_output_layers=1, n_recurrent_loops=2, **FOUR_WINDOWED, **COMMON)
# Families whose weights are those of a quantized file, dequantized (specfree holds them as codes).
GGUF_ROUNDED = {"llama_gguf": "llama"}
# tied like SmolLM2's: the embedding reads its rows from the head's codes (CodedEmbedding)
CONFIGS["llama_gguf"] = lambda: _llama(tie_word_embeddings=True)
FAMILIES = sorted(CONFIGS)

# Families whose layers keep a recurrent state (verified one chain a step, ``adapters/recurrent.py``):
# pure SSMs, attention + SSM hybrids and attention + linear-attention hybrids. Their torch fallback
# kernels are slow, so they are kept out of FAMILIES, which the other property tests sample.
SSM = dict(hidden_size=32, num_hidden_layers=2, max_position_embeddings=512)
HYBRID_LAYERS = dict(LAYERS, num_hidden_layers=4, head_dim=8)
HYBRID_SIZES = dict(LAYERS, num_hidden_layers=4)  # for configs that take no head_dim
LINEAR_ATTENTION = dict(linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
                        linear_num_value_heads=4)
RECURRENT_CONFIGS = {
    # Mamba-1 mixers (mamba, jamba) restart their state on multi-token input in transformers 5.23:
    # the adapter then decodes one row a step.
    "mamba": lambda: transformers.MambaConfig(state_size=8, **SSM, **COMMON),
    "mamba2": lambda: transformers.Mamba2Config(state_size=8, num_heads=4, head_dim=16, n_groups=1, chunk_size=16,
                                                **SSM, **COMMON),
    "jamba": lambda: transformers.JambaConfig(num_experts=4, attn_layer_period=2, attn_layer_offset=1,
                                              expert_layer_period=2, expert_layer_offset=1, mamba_d_state=8,
                                              **HYBRID_LAYERS, **COMMON),
    # attention and a Mamba-2 mixer side by side in every layer
    "falcon_h1": lambda: transformers.FalconH1Config(mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16,
                                                     mamba_d_state=8, mamba_chunk_size=16, **LAYERS, head_dim=8,
                                                     **COMMON),
    # time_step_min: transformers 5.23's NemotronH mixer clamps the time step to time_step_min in its
    # multi-token scan but not in its one-token step, so the two paths give different logits wherever
    # a step falls below it (3.5e-2 apart in float64 at the default 1e-3 on this random model), and
    # generate's own prompt-then-steps split is then reproducible by no other. At 1e-9 it never bites.
    "nemotron_h": lambda: transformers.NemotronHConfig(
        hidden_size=32, intermediate_size=64, layers_block_type=["mamba", "attention", "mamba", "mlp"],
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, ssm_state_size=8, mamba_num_heads=4,
        mamba_head_dim=16, n_groups=1, chunk_size=16, time_step_min=1e-9, max_position_embeddings=512, **COMMON),
    # gated delta-net linear attention, 3 layers to 1 of full attention
    "qwen3_next": lambda: transformers.Qwen3NextConfig(moe_intermediate_size=32, shared_expert_intermediate_size=32,
                                                       num_experts=4, num_experts_per_tok=2, **LINEAR_ATTENTION,
                                                       **HYBRID_LAYERS, **COMMON),
    "qwen3_5_text": lambda: transformers.Qwen3_5TextConfig(**LINEAR_ATTENTION, **HYBRID_LAYERS, **COMMON),
    # a cache class of its own (built inside its forward), attention + lightning linear attention
    "minimax": lambda: transformers.MiniMaxConfig(num_local_experts=4, num_experts_per_tok=2,
                                                  layer_types=["full_attention", "linear_attention"] * 2,
                                                  **HYBRID_LAYERS, **COMMON),
    # cache layers of its own: compressed attention over a sliding window (16, shorter than the tests' text)
    "deepseek_v4": lambda: transformers.DeepseekV4Config(
        hidden_size=32, moe_intermediate_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, q_lora_rank=16, o_lora_rank=16, qk_rope_head_dim=8, num_experts_per_tok=2, n_routed_experts=4,
        index_n_heads=2, index_head_dim=8, index_topk=16, sliding_window=16, max_position_embeddings=512,
        **COMMON),
    # short-conv layers: a conv state and no recurrent state
    "lfm2": lambda: transformers.Lfm2Config(layer_types=["conv", "full_attention"] * 2, **HYBRID_SIZES, **COMMON),
    # Kimi delta attention beside multi-head latent attention, MoE with expert groups
    "bailing_hybrid": lambda: transformers.BailingHybridConfig(
        hidden_size=32, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=4, layer_group_size=2,
        num_attention_heads=4, num_key_value_heads=4, head_dim=8, kv_lora_rank=16, qk_rope_head_dim=8,
        qk_nope_head_dim=8, v_head_dim=8, num_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
        max_position_embeddings=512, **COMMON),
    # one attention block, weight-tied, shared by two hybrid layers through LoRA adapters (time_step_min:
    # the same multi-token clamp as NemotronH's, above)
    "zamba2": lambda: transformers.Zamba2Config(
        hidden_size=32, intermediate_size=64, num_hidden_layers=4, layers_block_type=["linear_attention", "hybrid"] * 2,
        num_attention_heads=4, num_key_value_heads=4, n_mamba_heads=4, mamba_d_state=8, chunk_size=16,
        use_shared_attention_adapter=True, adapter_rank=8, time_step_min=1e-9, max_position_embeddings=512,
        **COMMON),
    # attention whose Q/K/V projection writes a conv state, and a sliding-window KV layer (which drops old
    # positions) inside a state layer that rolls back; one expert per token
    "zaya": lambda: transformers.ZayaConfig(hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
                                            num_key_value_heads=2, head_dim=8, moe_intermediate_size=32, num_experts=4,
                                            num_experts_per_tok=1, router_hidden_size=16,
                                            layer_types=["hybrid", "hybrid_sliding"] * 2, sliding_window=16,
                                            max_position_embeddings=512, **COMMON),
    # RG-LRU recurrent blocks beside local attention (a window of 16, shorter than the tests' text); its
    # recurrent block, like Mamba-1's, restarts its state on multi-token input: one row a step
    "recurrent_gemma": lambda: transformers.RecurrentGemmaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, lru_width=32, attention_window_size=16, **COMMON),
    # a cache class of its own, passed as cache_params; mLSTM matrix memory (hidden 64 with q/k/v factors 1:
    # its layers size heads from hidden * factor, its cache from that rounded up to a multiple of 64)
    "xlstm": lambda: transformers.xLSTMConfig(hidden_size=64, num_hidden_layers=2, num_heads=4, qk_dim_factor=1.0,
                                              v_dim_factor=1.0, chunk_size=16, **COMMON),
}
RECURRENT_FAMILIES = sorted(RECURRENT_CONFIGS)

# Attention families whose forward cannot verify a draft tree (verified one chain a step, chosen by
# ``adapters/probes.py``): ALiBi families that reject a 4D mask (Bloom, Falcon-RW), one that builds
# its ALiBi bias from key indices rather than position ids (MPT), decoders of encoder-decoder models
# that derive positions from the cache length (TrOCR, BlenderbotSmall, Marian), and GPT-1 and RWKV,
# which keep no KV cache. ``generate`` would force EOS as the last token where the config names
# ``forced_eos_token_id`` (specfree's Engine has no such processor), so the configs name none.
# (Their caches are sized by the encoder layers: as many as the decoder.)
ENCODER_DECODER_LAYERS = dict(d_model=32, decoder_layers=2, decoder_attention_heads=4, decoder_ffn_dim=64,
                              encoder_layers=2, encoder_attention_heads=4, encoder_ffn_dim=64,
                              max_position_embeddings=512, forced_eos_token_id=None)
CHAIN_CONFIGS = {
    "bloom": lambda: transformers.BloomConfig(hidden_size=32, n_layer=2, n_head=4, **COMMON),
    "falcon_alibi": lambda: transformers.FalconConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                                      alibi=True, max_position_embeddings=512, **COMMON),
    "mpt": lambda: transformers.MptConfig(d_model=32, n_layers=2, n_heads=4, max_seq_len=512, **COMMON),
    "openai-gpt": lambda: transformers.OpenAIGPTConfig(n_embd=32, n_layer=2, n_head=4, n_positions=512, **COMMON),
    "trocr": lambda: transformers.TrOCRConfig(d_model=32, decoder_layers=2, decoder_attention_heads=4,
                                              decoder_ffn_dim=64, max_position_embeddings=512, **COMMON),
    "blenderbot-small": lambda: transformers.BlenderbotSmallConfig(**ENCODER_DECODER_LAYERS, **COMMON),
    # RWKV keeps its state in a `state` argument, not in a cache specfree can pass: like GPT-1, the
    # whole sequence runs again each step
    "rwkv": lambda: transformers.RwkvConfig(hidden_size=32, num_hidden_layers=2, attention_hidden_size=32,
                                            intermediate_size=64, context_length=512, **COMMON),
    # chunked attention (8 tokens) one mask per layer kind cannot express, beside NoPE full layers that scale
    # their queries by position
    "llama4_text": lambda: transformers.Llama4TextConfig(
        hidden_size=32, intermediate_size=32, intermediate_size_mlp=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=1, no_rope_layer_interval=2,
        attention_chunk_size=8, floor_scale=8, max_position_embeddings=512, **COMMON),
    # local (chunked) attention only, and a cache (past_buckets_states) that takes one token a forward: the
    # whole sequence runs again each step, past the 8-token chunk
    "reformer": lambda: transformers.ReformerConfig(
        hidden_size=32, attention_head_size=8, num_attention_heads=4, feed_forward_size=64, attn_layers=["local"] * 2,
        axial_pos_shape=[16, 32], axial_pos_embds_dim=[16, 16], local_attn_chunk_length=8,
        max_position_embeddings=512, is_decoder=True, **COMMON),
    "marian": lambda: transformers.MarianConfig(decoder_vocab_size=VOCAB, decoder_start_token_id=PAD,
                                                **ENCODER_DECODER_LAYERS, **COMMON),
}
CHAIN_FAMILIES = sorted(CHAIN_CONFIGS)


# Where tiny models live: ``pytest --device cuda`` (tests/conftest.py) runs the property tests on a GPU.
DEVICE = "cpu"


def gguf_rounded(weight: torch.Tensor, kind: str) -> torch.Tensor:
    """``weight`` [N, K] as a GGUF file stores it and transformers loads it back: per block of 32
    inputs, Q4_1 (``d * q + m``, q in 0..15) or Q8_0 (``d * q``), d and m float16, decoded in
    float32 as the gguf package decodes it."""
    blocks = weight.detach().reshape(weight.shape[0], -1, 32)
    if kind == "q4_1":
        low = blocks.amin(-1, keepdim=True)
        d = ((blocks.amax(-1, keepdim=True) - low) / 15).half().float()
        m = low.half().float()
        q = ((blocks - low) / d.clamp_min(1e-30)).round().clamp(0, 15)
        return (d * q + m).reshape(weight.shape)
    d = (blocks.abs().amax(-1, keepdim=True) / 127).half().float()
    return (d * (blocks / d.clamp_min(1e-30)).round().clamp(-127, 127)).reshape(weight.shape)


def round_like_gguf(model: transformers.PreTrainedModel) -> None:
    """Every linear layer's weight as a Q4_1 GGUF holds it, the head's as Q8_0 (SmolLM2's file)."""
    head = model.get_output_embeddings()
    with torch.no_grad():
        for module in model.modules():
            if type(module) is torch.nn.Linear:
                module.weight.copy_(gguf_rounded(module.weight, "q8_0" if module is head else "q4_1"))


@functools.cache
def tiny_model(family: str, seed: int = 0) -> transformers.PreTrainedModel:
    config = (CONFIGS.get(family) or RECURRENT_CONFIGS.get(family) or CHAIN_CONFIGS[family])()
    try:
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    except ValueError:  # no SDPA path in this family (e.g. Gemma2's soft-capping): eager attention
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    if family in GGUF_ROUNDED:
        round_like_gguf(model)
    model.to(DEVICE).eval()  # weights drawn on the CPU first: the same model on every device
    model.generation_config.pad_token_id = PAD
    return model


def reference_greedy(model, prompt: list[int], max_new_tokens: int, ignore_eos: bool = False) -> list[int]:
    """transformers' own greedy decoding: the ground truth every strategy must reproduce
    (``ignore_eos``: running on through EOS, as ``generate(..., ignore_eos=True)`` does)."""
    ids = torch.tensor([prompt], device=model.device)
    with torch.no_grad(), as_shipped(model):
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, eos_token_id=None if ignore_eos else EOS, pad_token_id=PAD)
    return out[0, len(prompt):].tolist()


class Oracle(Strategy):
    """Drafts the true continuation, ``depth`` tokens a step, with the token at ``wrong_at`` replaced
    every other step: whole chains kept and chains cut short, in turn."""

    name = "oracle"

    def __init__(self, truth: list[int], depth: int, wrong_at: int):
        self.truth, self.depth, self.wrong_at, self.steps = truth, depth, wrong_at, 0

    def propose(self, context, max_depth: int) -> Proposal:
        draft = list(self.truth[len(context) : len(context) + min(self.depth, max_depth)])
        self.steps += 1
        if self.steps % 2 == 0 and len(draft) > self.wrong_at:
            draft[self.wrong_at] = (draft[self.wrong_at] + 1) % VOCAB
        return Proposal([draft] if draft else [], self.name)


WORDS = ("the a an and or but if then so of to in on at by for with from up down out over under "
         "cat dog bird fish tree house car road sun moon star sky sea river hill town city park "
         "is was are were be been has had have do did will can may must should would could "
         "big small red blue green old new good bad happy sad fast slow hot cold long short "
         "run walk jump swim fly sing play read write eat see look "
         "one two three four five six seven eight nine ten . , ! ? ; : day night time year "
         "he she it we they you i this that").split()


def tiny_tokenizer():
    """A word-level tokenizer whose ids fit the tiny models' vocabulary (with a chat template)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": PAD, "<s>": BOS, "</s>": EOS, "<unk>": 3}
    for word in WORDS:
        vocab.setdefault(word, len(vocab))
    # transformers' stop-string matcher learns each token's text by decoding it after this
    # probe word ("abcdef"); the word must therefore be in the vocabulary.
    vocab.setdefault("abcdef", len(vocab))
    assert len(vocab) <= VOCAB
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.WordPiece(prefix="##")
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>",
        chat_template="{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} . {% endfor %}"
                      "{% if add_generation_prompt %}assistant : {% endif %}")


def _byte_chars() -> dict[int, str]:
    """GPT-2's byte-to-character table (byte-level BPE writes each byte as one of these)."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = dict(zip(kept, kept)), 0
    for byte in range(256):
        if byte not in chars:
            chars[byte], extra = 256 + extra, extra + 1
    return {byte: chr(code) for byte, code in chars.items()}


# Merges of the JSON tokenizer: a few multi-character tokens like the ones a real BPE has for JSON.
JSON_MERGES = [('{', '"'), ('"', ':'), ('"', ','), ('"', '}'), ('t', 'r'), ('u', 'e'), ('tr', 'ue'), ('n', 'u'),
               ('l', 'l'), ('nu', 'll'), ('Ġ', '"'), (':', 'Ġ'), (',', 'Ġ'), ('0', '0'), ('a', 'b'), ('ab', 'c'),
               ('":', 'Ġ'), ('",', 'Ġ'), ('Ġ', '['), ('f', 'a'), ('fa', 'l'), ('s', 'e'), ('fal', 'se')]


@functools.cache
def tiny_json_tokenizer():
    """A byte-level BPE over printable ASCII (and newline) with a few JSON merges, whose ids fit the
    tiny models' vocabulary: text for the constraint tests (llguidance needs each token's bytes)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = _byte_chars()
    vocab = {"<pad>": PAD, "<s>": BOS, "</s>": EOS}
    for byte in [*range(32, 127), 10]:
        vocab[chars[byte]] = len(vocab)
    for left, right in JSON_MERGES:
        vocab[left + right] = len(vocab)
    assert len(vocab) <= VOCAB
    backend = Tokenizer(models.BPE(vocab, JSON_MERGES))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
