"""What chain verification and rollback cost on a hybrid model (attention + gated delta-net linear
attention, Qwen3.5 layout), randomly initialised: the mechanism, not a real model's speedup.

    python -m benchmarks.recurrent_bench [threads]

Random weights make drafters useless, so drafts come from an oracle that knows the model's own
greedy continuation and spoils one token of every other draft (``tests.tiny_models.Oracle``):
half the steps keep a whole chain, half cut it and roll back. Systems run interleaved, prompt by
prompt, and the medians are printed. Not run by CI.
"""

from __future__ import annotations

import statistics
import sys
import time
import warnings

import torch
import transformers

from specfree import Engine
from specfree.adapters.hf import HFAdapter
from tests.tiny_models import Oracle, reference_greedy

CONFIG = dict(vocab_size=8192, hidden_size=256, intermediate_size=768, num_hidden_layers=8, num_attention_heads=8,
              num_key_value_heads=2, head_dim=32, linear_key_head_dim=32, linear_value_head_dim=32,
              linear_num_key_heads=4, linear_num_value_heads=8, max_position_embeddings=4096,
              bos_token_id=1, eos_token_id=2, pad_token_id=0)
PROMPT_TOKENS, NEW_TOKENS, PROMPTS = 128, 48, 3


def median_ms(values) -> float:
    return 1000 * statistics.median(values)


def forward_and_rollback_costs(model, repeats: int = 5) -> None:
    """Forward of k chain rows after the prompt, and the rollback that keeps j of them."""
    adapter = HFAdapter(model)
    generator = torch.Generator().manual_seed(1)
    prompt = torch.randint(3, CONFIG["vocab_size"], (PROMPT_TOKENS,), generator=generator)
    mixers = adapter.store.replay
    forward = {k: [] for k in (1, 2, 4, 6)}
    rollback = {(how, j): [] for how in ("mixers", "whole model") for j in (1, 2, 3, 4, 5)}
    for _ in range(repeats):
        for k in forward:
            adapter.reset()
            adapter.prefill(prompt)
            start = time.perf_counter()
            adapter.forward(torch.randint(3, 100, (k,), generator=generator))
            forward[k].append(time.perf_counter() - start)
        for how, j in rollback:
            adapter.store.replay = mixers if how == "mixers" else None
            adapter.reset()
            adapter.prefill(prompt)
            adapter.forward(torch.randint(3, 100, (6,), generator=generator))
            adapter.commit(list(range(j)), rows=6)
            rollback[how, j].append(adapter.rollback_s)
    adapter.store.replay = mixers
    print("forward of k chain rows after", PROMPT_TOKENS, "tokens:",
          ", ".join(f"k={k} {median_ms(v):.1f} ms" for k, v in forward.items()))
    for how in ("mixers", "whole model"):
        print(f"rollback of a 6-row chain keeping j rows, re-running the {how}:",
              ", ".join(f"j={j} {median_ms(rollback[how, j]):.1f} ms" for j in (1, 2, 3, 4, 5)))


def end_to_end(model) -> None:
    generator = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, CONFIG["vocab_size"], (PROMPT_TOKENS,), generator=generator).tolist()
               for _ in range(PROMPTS)]
    truths = [p + reference_greedy(model, p, NEW_TOKENS + 8, ignore_eos=True) for p in prompts]
    systems = {  # name: (strategy, rollback re-runs the mixers only)
        "autoregressive": (lambda truth: "autoregressive", True),
        "oracle depth 4, every other draft cut after 2": (lambda truth: Oracle(truth, depth=4, wrong_at=2), True),
        "same, rollback re-runs the whole model": (lambda truth: Oracle(truth, depth=4, wrong_at=2), False),
        "oracle depth 4, every other draft cut after 0": (lambda truth: Oracle(truth, depth=4, wrong_at=0), True),
        "prompt_lookup (random text: nothing to copy)": (lambda truth: "prompt_lookup", True),
    }
    stats = {name: {"tok/s": [], "tokens/step": [], "rollback share": [], "rollback ms/step": []} for name in systems}
    for i, (prompt, truth) in enumerate(zip(prompts, truths)):
        names = list(systems)
        for name in names[i % len(names):] + names[: i % len(names)]:  # who goes first rotates
            strategy, mixers = systems[name]
            drafter = strategy(truth)
            # The oracles measure rollbacks at their own depth: unpriced; the named strategies as users run them.
            engine = Engine.from_model(model, None, drafter, priced=isinstance(drafter, str))
            if not mixers:
                engine.adapter.store.replay = None
            result = engine.generate(prompt, NEW_TOKENS, ignore_eos=True)
            assert result.tokens == truth[len(prompt) : len(prompt) + NEW_TOKENS], name
            rollback = sum(s.extra.get("rollback_s", 0.0) for s in result.steps)
            step_time = sum(s.draft_s + s.mask_s + s.forward_s + s.verify_s + s.other_s for s in result.steps)
            stats[name]["tok/s"].append(len(result.tokens) / result.wall_s)
            stats[name]["tokens/step"].append(len(result.tokens) / len(result.steps))
            stats[name]["rollback share"].append(rollback / step_time)
            stats[name]["rollback ms/step"].append(1000 * rollback / len(result.steps))
    base = statistics.median(stats["autoregressive"]["tok/s"])
    print(f"\n{PROMPTS} prompts of {PROMPT_TOKENS} random tokens, {NEW_TOKENS} new tokens, medians; every output "
          "identical to generate()")
    print("| system | tok/s | speedup | tokens/step | rollback ms/step | rollback share of step time |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, s in stats.items():
        tps = statistics.median(s["tok/s"])
        print(f"| {name} | {tps:.1f} | {tps / base:.2f}x | {statistics.median(s['tokens/step']):.2f} | "
              f"{statistics.median(s['rollback ms/step']):.1f} | {100 * statistics.median(s['rollback share']):.0f}% |")


def main() -> None:
    torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
    transformers.utils.logging.set_verbosity_error()
    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.Qwen3_5TextConfig(**CONFIG)).eval()
    model.generation_config.pad_token_id = 0
    params = sum(p.numel() for p in model.parameters()) / 1e6
    print(f"qwen3_5_text, {params:.0f}M parameters, layers {model.config.layer_types}, "
          f"{torch.get_num_threads()} threads, fp32")
    forward_and_rollback_costs(model)
    end_to_end(model)


if __name__ == "__main__":
    main()
