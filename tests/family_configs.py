"""Tiny random configs of every family transformers ships as a causal LM, for ``benchmarks.families_report``:
the family's default config shrunk (sizes named in ``SMALL``), then what each family needs on top of that
to stay consistent (``FAMILY_FIXES``) and keep what makes it distinct.
"""

from __future__ import annotations

from typing import Callable

# Sizes for a tiny model; each is set only where the family's config has that field.
SMALL = dict(
    vocab_size=128, hidden_size=32, d_model=32, n_embd=32, embedding_size=32, word_embed_proj_dim=32,
    intermediate_size=64, ffn_dim=64, n_inner=64, decoder_ffn_dim=64, ffn_hidden_size=64, d_ff=64,
    intermediate_size_mlp=64, dense_intermediate_size=64,
    moe_intermediate_size=32, shared_expert_intermediate_size=32, shared_experts_intermediate_size=32,
    shared_intermediate_size=32, moe_shared_expert_intermediate_size=32, expert_ffn_hidden_size=32,
    num_hidden_layers=4, n_layer=4, num_layers=4, decoder_layers=4, encoder_layers=4,
    num_attention_heads=4, n_head=4, num_heads=4, decoder_attention_heads=4, num_key_value_heads=2, num_kv_heads=2,
    head_dim=8, attention_head_dim=8, kv_channels=8, attention_head_size=8,
    qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, kv_lora_rank=16, q_lora_rank=16, o_lora_rank=16,
    max_position_embeddings=512, n_positions=512, n_ctx=512, max_seq_len=512, seq_length=512,
    num_experts=4, num_local_experts=4, n_routed_experts=4, moe_num_experts=4, num_experts_per_tok=2,
    n_group=1, topk_group=1, moe_k=2, num_experts_per_token=2, attn_layer_indices=[1, 3],
    linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
    linear_head_dim=8, state_size=8, mamba_d_state=8, ssm_state_size=8, mamba_n_heads=4, mamba_num_heads=4,
    mamba_d_head=16, mamba_head_dim=16, mamba_d_ssm=64, n_groups=1, mamba_n_groups=1, chunk_size=16,
    mamba_chunk_size=16, time_step_rank=4, mamba_dt_rank=4, lru_width=32,
    index_head_dim=8, index_n_heads=2, index_topk=16, rotary_dim=8, attn_layer_period=2, attn_layer_offset=1,
    expert_layer_period=2, expert_layer_offset=1,
    bos_token_id=1, eos_token_id=2, pad_token_id=0, initializer_range=0.3,
)
# A vision tower a multimodal family builds but the text-only report never runs: as small as it goes.
TINY_VISION = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64,
                   vision_output_dim=32, projector_input_dim=32, projector_output_dim=32, image_size=28,
                   patch_size=14)
# Qwen4-Exp's attention layers always build the QSA token indexer (block top-k sparse attention), whose sizes
# default to None; small hyper-connections; per-layer n-gram embeddings (PLE) on one delta-net layer, over small
# hashed vocabularies (the default base is 20M rows per head)
QWEN4_EXP_TEXT = dict(
    indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=8, indexer_budget=8, indexer_compress_ratio=4,
    hc_count=2, hc_lowrank=16, ple_layer_ids=[2], ple_embed_dim=32, heads_per_ngram=2, ngram_vocab_size_base=1000)
# Families whose default config the generic shrink leaves inconsistent (per-layer lists sized for the full
# model, nested sub-configs, fields that must agree): what to set on top of it, as a function of the shrunk
# keyword arguments and the default config's dict, returning the fields to change.
FAMILY_FIXES: dict[str, Callable[[dict, dict], dict]] = {
    # Zamba ties every hybrid layer's shared transformer block to the first one's: two hybrid layers to tie
    "zamba": lambda kw, d: dict(layers_block_type=["linear_attention", "hybrid", "linear_attention", "hybrid"]),
    # Zamba2: its 54-entry layer list sized for the full model; two hybrid layers share one block (with
    # per-layer LoRA adapters on it, as in Zamba2-1.2B, which add the block's whole width, 2 * hidden, to q,
    # k and v: heads * head_dim must be that, as many key/value heads as query heads). time_step_min: its
    # Mamba-2 multi-token scan clamps the time step to it, its one-token step does not (as NemotronH's)
    "zamba2": lambda kw, d: dict(layers_block_type=["linear_attention", "hybrid", "linear_attention", "hybrid"],
                                 use_shared_attention_adapter=True, adapter_rank=8,
                                 num_key_value_heads=kw["num_attention_heads"],
                                 attention_head_dim=2 * kw["hidden_size"] // kw["num_attention_heads"],
                                 time_step_min=1e-9),
    # xLSTM: the mLSTM layer sizes q/k/v as hidden * factor, its cache as that rounded up to a multiple of 64
    # (configuration_xlstm.py's qk_dim, v_dim): they agree only where hidden * factor is a multiple of 64
    "xlstm": lambda kw, d: dict(hidden_size=64, qk_dim_factor=1.0, v_dim_factor=1.0),
    # LFM2's default makes every layer attention (full_attn_idxs): short-conv layers in turn, as the real models have
    "lfm2": lambda kw, d: dict(layer_types=["conv", "full_attention"] * 2),
    # LFM2-MoE names no default layer_types (its layers need them): short-conv and attention layers in turn,
    # the first layer a dense MLP, the rest mixtures of experts
    "lfm2_moe": lambda kw, d: dict(layer_types=["conv", "full_attention"] * 2, num_dense_layers=1),
    # Granite 4.0-H's default config is all Mamba-2 layers, which generate cannot run (no attention layer for
    # the cache's length): Mamba-2 and attention layers in turn, as the real checkpoints mix them
    "granitemoehybrid": lambda kw, d: dict(layer_types=["linear_attention", "full_attention"] * 2),
    # Bailing-hybrid (Ling 3): its dict names the expert groups num_expert_group, which SMALL misses: 8 groups
    # of 4 experts is none each; every 2nd layer full MLA attention, the others Kimi delta attention
    "bailing_hybrid": lambda kw, d: dict(n_group=1, layer_group_size=2),
    # the text config's per-layer lists (no_rope_layers, moe_layers) are sized for 48 layers: let the 4-layer
    # config derive them (NoPE full attention every 2nd layer, chunked RoPE attention between); a tiny vision tower
    "llama4": lambda kw, d: dict(
        text_config={**kw["text_config"], "no_rope_layers": None, "moe_layers": None, "no_rope_layer_interval": 2},
        vision_config={**d["vision_config"], **TINY_VISION}),
    # nested attention/FFN sub-configs the shrink does not reach; DbrxAttention reads attn_config.rope_theta,
    # which DbrxAttentionConfig no longer defines (real checkpoints' config.json carry it), so set it there
    "dbrx": lambda kw, d: dict(
        n_heads=4, n_layers=4,  # its own names for the head and layer counts
        attn_config={**d["attn_config"], "kv_n_heads": 2, "clip_qkv": 8.0, "rope_theta": 10000.0},
        ffn_config={**d["ffn_config"], "ffn_hidden_size": 32, "moe_num_experts": 4, "moe_top_k": 2}),
    # the default leaves n_shared_experts None, which its MoE block multiplies by; dots.llm1's layout: one dense
    # layer first, then MoE layers with shared experts beside the routed ones
    "dots1": lambda kw, d: dict(n_shared_experts=1, first_k_dense_replace=1, norm_topk_prob=True),
    # dots3_note_text wrapped with vision and audio towers: the text config's per-layer lists and per-layer
    # (sliding-layer) overrides are sized for 46 layers, so they are derived again for 4, the sliding layers'
    # own attention sizes (swa_*) shrunk, MLA key/value heads as many as query heads; the towers' adapters must
    # output the text hidden size
    "dots3_note": lambda kw, d: dict(
        text_config={**{k: v for k, v in kw["text_config"].items()
                        if k not in ("per_layer_config", "mlp_layer_types", "rope_parameters")},
                     "num_key_value_heads": 4, "swa_num_attention_heads": 4, "swa_num_key_value_heads": 4,
                     "swa_q_lora_rank": 16, "swa_kv_lora_rank": 16, "swa_head_dim": 16, "swa_qk_nope_head_dim": 8,
                     "swa_v_head_dim": 8},
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                           moe_intermediate_size=32, adapter_in_dim=32, adapter_out_dim=32, mlp_layer_types=["dense"]),
        audio_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                          adapter_input_size=32, adapter_out_dim=32, downsample_hidden_size=32)),
    # the default config has no RoPE parameters at all (the rotary module then fails on a missing layer kind):
    # Command-A-style layers, sliding windows with (multimodal, 3-axis) RoPE and one NoPE full-attention layer
    "cohere_compass_text": lambda kw, d: dict(
        layer_types=["sliding_attention"] * 3 + ["full_attention"],
        rope_parameters={"sliding_attention": dict(rope_type="default", rope_theta=50000.0, mrope_section=[2, 1, 1]),
                         "full_attention": None}),
    # ZAYA's router picks one expert per token (its config refuses more); its sliding-window layer kind too (the
    # default is full attention everywhere), whose cache layer drops what falls out of the window
    "zaya": lambda kw, d: dict(num_experts_per_tok=1, layer_types=["hybrid", "hybrid_sliding"] * 2, sliding_window=32),
    "qwen4_exp_text": lambda kw, d: QWEN4_EXP_TEXT,
    "qwen4_exp": lambda kw, d: dict(
        # number_of_conv_states is derived from ple_layer_ids: the default's (no PLE) must not come back in
        text_config={**{k: v for k, v in kw["text_config"].items() if k != "number_of_conv_states"}, **QWEN4_EXP_TEXT},
        vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=4, out_hidden_size=32)),
    # X-MOD's forward needs a language for its adapters when no lang_ids are passed: the first it names
    "xmod": lambda kwargs, default: dict(default_language=default["languages"][0]),
    # ReformerModelWithLMHead needs a decoder; one local and one LSH layer, chunks shorter than the report's text
    # so both chunk, axial positions that cover max_position_embeddings and sum to hidden_size, a fixed bucket
    # count and hash seed (else each forward draws its own random rotations: generate is not reproducible)
    "reformer": lambda kwargs, default: dict(
        is_decoder=True, attn_layers=["local", "lsh"], num_hidden_layers=2, feed_forward_size=64,
        axial_pos_shape=[16, 32], axial_pos_embds_dim=[16, 16], local_attn_chunk_length=16,
        lsh_attn_chunk_length=16, num_buckets=4, hash_seed=0),
    # BLT: every sub-config shrunk (local encoder and decoder 32 wide, global transformer 64 = 32 x cross_attn_k,
    # entropy patcher), one vocabulary for all, and a small hash n-gram table (500002 rows x 6 by default);
    # num_hidden_layers, which sizes generate's cache for the local encoder and decoder: the deeper of the two
    "blt": lambda kwargs, default: dict(
        num_hidden_layers=2, encoder_hash_byte_group_vocab=64, encoder_hash_byte_group_size=[3, 4],
        local_attention_window_len=512,
        encoder_config=dict(vocab_size=kwargs["vocab_size"], hidden_size=32, hidden_size_global=64,
                            num_attention_heads=4, num_hidden_layers=1, intermediate_size=64,
                            max_position_embeddings=512, cross_attn_k=2),
        decoder_config=dict(vocab_size=kwargs["vocab_size"], hidden_size=32, hidden_size_global=64,
                            num_attention_heads=4, num_hidden_layers=2, intermediate_size=64,
                            max_position_embeddings=512, cross_attn_k=2),
        global_config=dict(hidden_size=64, num_attention_heads=4, num_hidden_layers=2, intermediate_size=128,
                           max_position_embeddings=512),
        patcher_config=dict(vocab_size=kwargs["vocab_size"], hidden_size=32, num_attention_heads=4,
                            num_hidden_layers=2, intermediate_size=64, max_position_embeddings=512)),
    # Dory: input, looped and output sections must add up to the layers (the default 8 + 8 input and output
    # layers left -12 looped ones, so every layer ran twice into one cache layer); one layer in, two looped
    # twice (each loop its own copy of their cache layers), one out, both layer kinds in the loop.
    "dory": lambda kwargs, default: dict(
        n_input_layers=1, n_recurrent_layers=2, n_output_layers=1, n_recurrent_loops=2,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"]),
    # Inkling 2: the LM head has `unpadded_vocab_size` rows (200058 by default), the embedding `vocab_size`:
    # greedy picks ids past the tiny embedding. Shrunk together; queries scaled from position 16 on, and the
    # relative bias of full layers cut at 24 tokens back, so a 36-token run reaches both.
    "inkling2_text": lambda kwargs, default: _inkling2(kwargs),
    # Inkling 2 Loop, as Inkling 2, and a loop that exists in the tiny model (the default loops layers 6..17, past
    # its 4 layers): 6 layers in residual blocks of 2, layers 2-3 (one sliding, one full) looped in 3 passes, each
    # pass with its own copies of their cache layers.
    "inkling2_loop_text": lambda kwargs, default: dict(
        _inkling2(kwargs), num_hidden_layers=6, layer_types=["hybrid_sliding", "hybrid"] * 3,
        n_layers_per_attn_res_block=2, loop_layer_index_start=2, loop_layer_index_end=4, loop_num_passes=3),
    # Sarvam-MLA: multi-head latent attention with queries projected directly (no query LoRA), as released.
    "sarvam_mla": lambda kwargs, default: dict(q_lora_rank=default["q_lora_rank"]),
    # Apertus 1.5: the LM head pruned to the text prefix of the vocabulary, as released (logits narrower than
    # the embedding).
    "apertus1p5_text": lambda kwargs, default: dict(output_vocab_size=96),
}

# MusicGen's start and pad token is the one past the codebook vocabulary, as in its checkpoints
FAMILY_FIXES["musicgen"] = FAMILY_FIXES["musicgen_melody"] = lambda kwargs, default: dict(
    pad_token_id=kwargs["vocab_size"], bos_token_id=kwargs["vocab_size"])


def _inkling2(kwargs: dict) -> dict:
    return dict(unpadded_vocab_size=kwargs["vocab_size"], log_scaling_n_floor=16, rel_extent=24)


def _gemma3n_text(kwargs: dict, default: dict) -> dict:
    # Gemma 3n: per-layer lists sized for 35 layers, 15 KV-sharing layers and a 262k per-layer-input vocab;
    # half the shrunk layers alternate sliding/full and store KV, the other half reuse it, with the first
    # half's feed-forwards activation-sparse, and small per-layer inputs, LAuReL and AltUp kept
    n = kwargs["num_hidden_layers"]
    return dict(layer_types=["sliding_attention", "full_attention"] * (n // 2), num_kv_shared_layers=n // 2,
                activation_sparsity_pattern=[0.95] * (n // 2) + [0.0] * (n - n // 2),
                vocab_size_per_layer_input=kwargs["vocab_size"], hidden_size_per_layer_input=8, laurel_rank=8)


FAMILY_FIXES["gemma3n_text"] = _gemma3n_text


def _gemma4_text(text: dict, n: int, **fields) -> dict:
    # Gemma 4's text config, shrunk: its per_layer_config (wider heads on the full-attention layers) is keyed
    # by the full model's layer indices and is rebuilt from layer_types; sliding/full layers alternate (the
    # last one full, as Gemma 4 requires), the second half reuses the first half's KV, full layers get 16-wide
    # heads with keys as values (attention_k_eq_v, one key/value head) and kv-shared layers a double-wide MLP
    return {**{k: v for k, v in text.items() if k != "per_layer_config"},
            "layer_types": ["sliding_attention", "full_attention"] * (n // 2), "num_kv_shared_layers": n // 2,
            "global_head_dim": 16, "attention_k_eq_v": True, "num_global_key_value_heads": 1,
            "use_double_wide_mlp": True, **fields}


def _gemma4_e2b(text: dict) -> dict:
    # Gemma 4 (E2B-like text decoder): as above, with small per-layer inputs (the default's 262k x 256-per-layer
    # table alone is 268M parameters at 4 layers) and mixture-of-experts blocks
    return _gemma4_text(text, text["num_hidden_layers"], hidden_size_per_layer_input=8,
                        vocab_size_per_layer_input=text["vocab_size"], enable_moe_block=True, num_experts=4,
                        top_k_experts=2, moe_intermediate_size=32)


FAMILY_FIXES["gemma4_text"] = lambda kwargs, default: _gemma4_e2b(kwargs)
FAMILY_FIXES["gemma4"] = lambda kwargs, default: dict(text_config=_gemma4_e2b(kwargs["text_config"]))
# Gemma 4 unified: its text config has no per-layer inputs or experts
FAMILY_FIXES["gemma4_unified_text"] = lambda kwargs, default: _gemma4_text(kwargs, kwargs["num_hidden_layers"])
FAMILY_FIXES["gemma4_unified"] = lambda kwargs, default: dict(text_config=_gemma4_text(
    kwargs["text_config"], kwargs["text_config"]["num_hidden_layers"]))
# Gemma 3n: its text config as gemma3n_text's, and a small audio encoder (its vision tower is a timm model)
FAMILY_FIXES["gemma3n"] = lambda kwargs, default: dict(
    text_config={**kwargs["text_config"], **_gemma3n_text(kwargs["text_config"], default["text_config"])},
    audio_config=dict(hidden_size=32, conf_num_attention_heads=4, conf_num_hidden_layers=2,
                      sscp_conv_channel_size=[8, 8], input_feat_size=32))


def _gemma4_assistant(kwargs: dict, default: dict) -> dict:
    # Gemma 4 assistants (drafting heads): every layer reuses the target's KV, no per-layer inputs, experts or
    # double-wide MLPs, as the assistant configs require; the target's hidden size is the tiny one
    text, n = kwargs["text_config"], kwargs["text_config"]["num_hidden_layers"]
    fields = dict(num_kv_shared_layers=n, use_double_wide_mlp=False)
    fields.update({k: off for k, off in (("hidden_size_per_layer_input", 0), ("vocab_size_per_layer_input", 0),
                                         ("enable_moe_block", False)) if k in text})
    return dict(text_config=_gemma4_text(text, n, **fields), backbone_hidden_size=text["hidden_size"])


FAMILY_FIXES["gemma4_assistant"] = FAMILY_FIXES["gemma4_unified_assistant"] = _gemma4_assistant
# Families whose own default config its validators reject: the keyword arguments its default is built with.
DEFAULT_KWARGS = {
    # its default text config is Gemma 4's, with per-layer inputs, which the assistant config rejects
    "gemma4_assistant": dict(text_config=dict(hidden_size_per_layer_input=0, vocab_size_per_layer_input=0)),
}
# Why a family is not tested, beyond the exception its build or generate raises.
NOT_TESTED = dict.fromkeys(("gemma4_assistant", "gemma4_unified_assistant"), (
    "(transformers 5.23: the assistant config makes every layer reuse the target's KV, which the text config's "
    "kv_sharing_modes rejects: no layer produces it). Not a standalone LM either: a drafting head whose forward "
    "ignores input_ids and takes a Gemma 4 target's last hidden state and KV (inputs_embeds, shared_kv_states); "
    "generate runs it only as a Gemma 4 / Gemma 3n target's assistant_model"))
NOT_TESTED["gemma3n"] = ("(Gemma3nModel always builds its vision tower, a timm MobileNetV5; timm needs torchvision, "
                         "and PyPI's torchvision does not load beside the CPU torch 2.13 wheel: 'operator "
                         "torchvision::nms does not exist'. The decoder it wraps is gemma3n_text's, verified above)")
WINDOWS = ("sliding_window", "attention_window_size", "attention_chunk_size", "sliding_window_size", "window_size")


def causal_lm_class(model_type: str):
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])


def config_class(model_type: str):
    """The config class the family's causal LM is built from: the family's own, or, where that is a
    composite whose causal LM takes one of its sub-configs other than text_config (MusicGen's
    decoder: ``AutoModelForCausalLM.from_config`` hands it the composite, which it cannot read), that
    sub-config's class."""
    from transformers import CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type]
    takes = getattr(causal_lm_class(model_type), "config_class", None)
    if takes is None or issubclass(cls, takes):
        return cls
    default = cls().to_dict()
    if any(isinstance(sub, dict) and sub.get("model_type") == takes.model_type
           for key, sub in default.items() if key != "text_config"):
        return takes
    return cls


def tiny_config(model_type: str):
    cls = config_class(model_type)
    default = cls(**DEFAULT_KWARGS.get(model_type, {})).to_dict()

    def shrink(fields: dict) -> dict:
        small = {k: v for k, v in SMALL.items() if k in fields}
        small.update({k: 32 for k in WINDOWS if isinstance(fields.get(k), int) and fields[k] > 32})
        return small

    kwargs = shrink(default)
    if isinstance(default.get("text_config"), dict):
        kwargs["text_config"] = {**default["text_config"], **shrink(default["text_config"])}
        kwargs["text_config"].pop("layer_types", None)
    if "kv_lora_rank" in default:  # multi-head latent attention: as many key/value heads as query heads
        kwargs["num_key_value_heads"] = kwargs.get("num_attention_heads", 4)
    if default.get("model_type") in ("mamba2",):  # its head_dim is the SSM head's: expand * hidden = heads * dim
        kwargs["head_dim"] = 16
    if isinstance(default.get("attention_types"), list):  # GPT-Neo: [[kinds, repeats]] must cover the 4 layers
        kwargs["attention_types"] = [[["global", "local"], 2]]
    if model_type in FAMILY_FIXES:
        kwargs.update(FAMILY_FIXES[model_type](kwargs, default))
    try:
        config = cls(**kwargs)
    except Exception:
        config = None
    # A hybrid whose first 4 layers hold only one kind: one layer of each kind the full model has.
    full_kinds = list(dict.fromkeys(default.get("layer_types") or []))
    if len(full_kinds) > 1 and (config is None or len(set(getattr(config, "layer_types", None) or [])) < 2):
        kinds = (full_kinds * 4)[:4]
        config = cls(**{**kwargs, "layer_types": kinds, "num_hidden_layers": len(kinds)})
    if config is None:
        config = cls(**kwargs)
    return config
