"""One vLLM run of token-id prompts, plain or speculative; run with vLLM's own python (docs/vllm.md).

    .vllm-venv/bin/python benchmarks/vllm_compare.py MODEL_DIR PROMPTS.json OUT.json --method plain
    ... --method specfree --specfree strategy=hybrid        (specfree's proposer, any overrides)
    ... --method ngram | suffix                              (vLLM's own drafters)

PROMPTS.json holds a list of token-id lists; OUT.json gets each prompt's greedy output ids, the
run's timing (generate's wall time after a warm-up run) and vLLM's drafted/accepted counts; with
several --batch sizes, a list of such rows.

The warm-up runs each prompt's ids reversed: the same lengths (so the same compiled shapes), but
neither vLLM's prefix cache nor a drafter that learns across requests sees the timed text first.
"""

from __future__ import annotations

import argparse
import json
import time


def speculative_config(method: str, k: int) -> dict | None:
    if method == "plain":
        return None
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4, "prompt_lookup_min": 1}
    if method == "suffix":
        return {"method": "suffix", "num_speculative_tokens": k}
    raise SystemExit(f"error: unknown --method {method!r}; use plain, specfree (--specfree OVERRIDES), "
                     "ngram or suffix")


def spec_counts(llm) -> dict[str, int]:
    """Drafted and accepted tokens so far, from vLLM's own counters."""
    names = {"vllm:spec_decode_num_draft_tokens": "drafted", "vllm:spec_decode_num_accepted_tokens": "accepted"}
    counts = {"drafted": 0, "accepted": 0}
    for metric in llm.get_metrics():
        if metric.name in names:
            counts[names[metric.name]] += int(metric.value)
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("prompts")
    parser.add_argument("out")
    parser.add_argument("--method", default="plain")
    parser.add_argument("--specfree", nargs="*", default=[], help="specfree config overrides, e.g. strategy=trie")
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--batch", type=int, nargs="*", default=[0],
                        help="prompts per generate call (0: all at once); several: one timed run each")
    parser.add_argument("--no-warmup", action="store_true", help="time the first run (a test needs no timing)")
    parser.add_argument("--memory", type=float, default=0.15,
                        help="fraction of the CPU memory vLLM reserves (its gpu_memory_utilization)")
    parser.add_argument("--eager", action="store_true", help="no torch.compile (faster start, slower steps)")
    args = parser.parse_args()

    from specfree.errors import ConfigError
    from specfree.integrations.vllm import check_environment, vllm_args

    try:
        check_environment()
        spec = vllm_args(args.k, args.specfree) if args.method == "specfree" else {
            "speculative_config": speculative_config(args.method, args.k)}
    except ConfigError as error:
        raise SystemExit(f"error: {error}") from None
    from vllm import LLM, SamplingParams

    prompts = json.load(open(args.prompts))
    llm = LLM(model=args.model, dtype="float32", skip_tokenizer_init=True, max_model_len=1024,
              max_num_seqs=max(4, len(prompts)), enforce_eager=args.eager, seed=0,
              gpu_memory_utilization=args.memory, disable_log_stats=False,
              **spec)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True, detokenize=False)

    def run(batch: int, warmup: bool = False) -> list[list[int]]:
        outputs = []
        for i in range(0, len(prompts), batch):
            group = [ids[::-1] if warmup else ids for ids in prompts[i: i + batch]]
            results = llm.generate([{"prompt_token_ids": ids} for ids in group], params, use_tqdm=False)
            outputs += [list(r.outputs[0].token_ids) for r in results]
        return outputs

    rows = []
    for batch in [b or len(prompts) for b in args.batch]:
        if not args.no_warmup:
            run(batch, warmup=True)  # compiled kernels, on other text
        before = spec_counts(llm)
        start = time.perf_counter()
        outputs = run(batch)
        wall = time.perf_counter() - start
        counts = {k: v - before[k] for k, v in spec_counts(llm).items()}
        tokens = sum(len(o) for o in outputs)
        rows.append({"method": args.method, "specfree": args.specfree, "k": args.k, "batch": batch,
                     "outputs": outputs, "tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall, **counts})
        print(f"{args.method} {' '.join(args.specfree)}: batch {batch}, {tokens} tokens, {tokens / wall:.1f} tok/s, "
              f"{counts}", flush=True)
    json.dump(rows[0] if len(rows) == 1 else rows, open(args.out, "w"))


if __name__ == "__main__":  # vLLM starts its engine in a spawned process, which re-imports this file
    main()
