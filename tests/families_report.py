"""Try every family the installed transformers ships as a causal LM, on a tiny random model, and
write the verdicts into docs/families.md: identical to ``generate`` / refused (why) / not tested (why).

    python -m tests.families_report            # all families, 2 worker processes, ~10-20 minutes
    python -m tests.families_report llama mamba  # some families, printed only
    python -m tests.families_report --update bloom mpt  # rerun some families, their rows rewritten in place

Not run by CI (slow). Each family runs in its own process with a time limit. A tiny config is made
by shrinking the family's default config (sizes named in ``SMALL``); a family whose tiny model cannot
be built, or whose ``generate`` fails, is "not tested". "different" would be a lossless bug.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import warnings
from datetime import date
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

STRATEGIES = {
    "prompt_lookup": dict(num_candidates=3, draft_len=6),  # sibling candidates: trees
    "lookahead": {},
    "trie": {},
    "recycling": {},
}
# Repetitive, so prompt lookup drafts several sibling candidates; 20 + 16 tokens outrun a 32-token window.
PROMPT = [5, 6, 7, 8, 9] * 3 + [10, 11, 5, 6, 7]
NEW_TOKENS = 16
TIME_LIMIT_S = 240
DOC = Path(__file__).resolve().parents[1] / "docs" / "families.md"
START, END = "<!-- families-report:start -->", "<!-- families-report:end -->"

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
# Families whose default config the generic shrink leaves inconsistent (per-layer lists sized for the full
# model, nested sub-configs, fields that must agree): what to set on top of it, as a function of the shrunk
# keyword arguments and the default config's dict, returning the fields to change.
FAMILY_FIXES: dict[str, Callable[[dict, dict], dict]] = {
    # Dory: input, looped and output sections must add up to the layers (the default 8 + 8 input and output
    # layers left -12 looped ones, so every layer ran twice into one cache layer); one layer in, two looped
    # twice (each loop its own copy of their cache layers), one out, both layer kinds in the loop.
    "dory": lambda kwargs, default: dict(
        n_input_layers=1, n_recurrent_layers=2, n_output_layers=1, n_recurrent_loops=2,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"]),
    # Inkling 2: the LM head has `unpadded_vocab_size` rows (200058 by default), the embedding `vocab_size`:
    # greedy picks ids past the tiny embedding. Shrunk together; queries scaled from position 16 on, and the
    # relative bias of full layers cut at 24 tokens back, so a 36-token run reaches both.
    "inkling2_text": lambda kwargs, default: dict(
        unpadded_vocab_size=kwargs["vocab_size"], log_scaling_n_floor=16, rel_extent=24),
    # Inkling 2 Loop, as Inkling 2, and a loop that exists in the tiny model (the default loops layers 6..17, past
    # its 4 layers): 6 layers in residual blocks of 2, layers 2-3 (one sliding, one full) looped in 3 passes, each
    # pass with its own copies of their cache layers.
    "inkling2_loop_text": lambda kwargs, default: dict(
        unpadded_vocab_size=kwargs["vocab_size"], log_scaling_n_floor=16, rel_extent=24,
        num_hidden_layers=6, layer_types=["hybrid_sliding", "hybrid"] * 3, n_layers_per_attn_res_block=2,
        loop_layer_index_start=2, loop_layer_index_end=4, loop_num_passes=3),
    # Sarvam-MLA: multi-head latent attention with queries projected directly (no query LoRA), as released.
    "sarvam_mla": lambda kwargs, default: dict(q_lora_rank=default["q_lora_rank"]),
    # Apertus 1.5: the LM head pruned to the text prefix of the vocabulary, as released (logits narrower than
    # the embedding).
    "apertus1p5_text": lambda kwargs, default: dict(output_vocab_size=96),
}
WINDOWS = ("sliding_window", "attention_window_size", "attention_chunk_size", "sliding_window_size", "window_size")


def tiny_config(model_type: str):
    from transformers import CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type]
    default = cls().to_dict()

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


def try_family(model_type: str) -> dict:
    """The verdict for one family (run in a child process)."""
    import torch
    import transformers

    from specfree import Engine, UnsupportedModelError
    from tests.tiny_models import Oracle, reference_greedy

    transformers.utils.logging.set_verbosity_error()
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        try:
            model = transformers.AutoModelForCausalLM.from_config(tiny_config(model_type), attn_implementation="sdpa")
        except (ValueError, ImportError):  # no SDPA path in this family
            torch.manual_seed(0)
            model = transformers.AutoModelForCausalLM.from_config(tiny_config(model_type))
        model.eval()
        model.generation_config.pad_token_id = 0
        # generate would force EOS as the last token (encoder-decoder configs); specfree's Engine has no
        # such processor, and this report checks verification, not generation-config processors
        model.generation_config.forced_eos_token_id = None
    except Exception as exc:
        return dict(verdict="not tested", why=f"no tiny model: {type(exc).__name__}: {_short(exc)}")
    try:
        reference = reference_greedy(model, PROMPT, NEW_TOKENS, ignore_eos=True)
        truth = PROMPT + reference_greedy(model, PROMPT, NEW_TOKENS + 8, ignore_eos=True)
    except Exception as exc:
        return dict(verdict="not tested", why=f"generate fails: {type(exc).__name__}: {_short(exc)}")
    strategies = dict(STRATEGIES, oracle=None)
    covered, mode = [], None
    for name, knobs in strategies.items():
        try:
            strategy = Oracle(truth, depth=4, wrong_at=2) if knobs is None else name
            # The oracle checks chains and rollbacks at its own depth: unpriced.
            engine = Engine.from_model(model, None, strategy, **(knobs if knobs is not None else {"priced": False}))
        except UnsupportedModelError as exc:
            return dict(verdict="refused", why=_short(exc, 400))
        except Exception as exc:
            return dict(verdict="error", why=f"wrapping: {type(exc).__name__}: {_short(exc)}")
        adapter = engine.adapter
        mode = "one row" if adapter.max_chain == 0 else adapter.verification
        mode += "" if adapter.keeps_cache else ", no KV cache"
        try:
            result = engine.generate(PROMPT, NEW_TOKENS, ignore_eos=True)
        except Exception as exc:
            return dict(verdict="error", why=f"{name}: {type(exc).__name__}: {_short(exc)}", mode=mode)
        tokens = result.tokens
        if result.stop_reason == "context_length" and tokens == reference[: len(tokens)]:
            # windowed layers specfree cannot mask per kind: the context stops at the window
            mode += f" (context capped at {adapter.max_length})"
        elif tokens != reference:
            first = next((i for i, (a, b) in enumerate(zip(tokens, reference)) if a != b), len(tokens))
            return dict(verdict="different", why=f"{name}: from new token {first}", mode=mode)
        covered.append(name)
    return dict(verdict="identical", mode=mode, strategies=covered)


def _short(exc: BaseException, limit: int = 160) -> str:
    text = " ".join(str(exc).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def run_one(model_type: str) -> dict:
    try:
        done = subprocess.run([sys.executable, "-m", "tests.families_report", "--one", model_type],
                              capture_output=True, text=True, timeout=TIME_LIMIT_S)
    except subprocess.TimeoutExpired:
        return dict(verdict="not tested", why=f"over the {TIME_LIMIT_S} s limit")
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if not lines:
        return dict(verdict="error", why=f"the process died: {_short(done.stderr[-400:])}")
    return json.loads(lines[-1])


def how(r: dict) -> str:
    text = r.get("how") or (f"{r['mode']}: {', '.join(r['strategies'])}" if r["verdict"] == "identical" else r["why"])
    return text.replace("|", "/")


def table(results: dict[str, dict]) -> str:
    order = {"different": 0, "error": 1, "identical": 2, "refused": 3, "not tested": 4}
    counts = {v: sum(r["verdict"] == v for r in results.values()) for v in order}
    modes = [how(r).split(":")[0].split(" (")[0] for r in results.values() if r["verdict"] == "identical"]
    kinds = {kind: sum(m.startswith(kind) for m in modes) for kind in ("tree", "chain", "one row")}
    lines = [", ".join(f"{n} {v}" for v, n in counts.items() if n) + f" (of {len(results)}). Identical: "
             + ", ".join(f"{n} {kind}" for kind, n in kinds.items() if n) + " verified"
             + f" ({sum('custom mask' in m for m in modes)} of the chains under specfree's causal mask, "
             f"{sum('no KV cache' in m for m in modes)} without a KV cache).", "",
             "| family | verdict | how / why |", "|---|---|---|"]
    for family, r in sorted(results.items(), key=lambda kv: (order[kv[1]["verdict"]], kv[0])):
        lines.append(f"| `{family}` | {r['verdict']} | {how(r)} |")
    return "\n".join(lines)


def rows_in_doc() -> dict[str, dict]:
    """The table now in docs/families.md, as {family: {verdict, how}}."""
    body = DOC.read_text().split(START)[1].split(END)[0]
    return {family: dict(verdict=verdict, how=text) for family, verdict, text
            in re.findall(r"^\| `([^`]+)` \| ([a-z ]+) \| (.*) \|$", body, flags=re.M)}


def main(argv: list[str]) -> None:
    if argv[:1] == ["--one"]:
        print(json.dumps(try_family(argv[1])))
        return
    from transformers import __version__
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    update = argv[:1] == ["--update"]
    argv = argv[1:] if update else argv
    families = argv or list(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    with ThreadPoolExecutor(2) as pool:
        results = dict(zip(families, pool.map(run_one, families)))
    for family, r in results.items():
        print(family, r, flush=True)
    if argv and not update:
        return
    if update:
        results = {**rows_in_doc(), **results}
    body = (f"Generated by `python -m tests.families_report` with transformers {__version__}: every model type "
            f"in `MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`, one tiny random model each, prompt {len(PROMPT)} tokens + "
            f"{NEW_TOKENS} new, greedy, checked token for token against `generate(do_sample=False)`. "
            "Modes, as the wrap-time probes chose them: `tree` verifies draft trees; `chain, custom mask` "
            "one chain a step under specfree's causal 4D mask (the model takes a mask but not a tree); "
            "`chain, own mask` one chain a step under the model's own causal mask (recurrent layers, with "
            "rollback; chunked attention; a forward that rejects or ignores a custom mask); `no KV cache`: "
            "the whole sequence runs again each step; `one row` plain decoding (the model's forward cannot "
            "continue its recurrent state over several tokens). `oracle` drafts the true continuation with every "
            "other step's third token wrong, so whole and cut drafts are both verified."
            + (f" Some rows were rerun with `--update` after the last full run, the latest on {date.today()}."
               if update else "")
            + "\n\n" + table(results))
    text = DOC.read_text()
    text = re.sub(f"{re.escape(START)}.*{re.escape(END)}", lambda _: f"{START}\n{body}\n{END}", text, flags=re.S)
    DOC.write_text(text)


if __name__ == "__main__":
    main(sys.argv[1:])
