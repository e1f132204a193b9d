"""One vLLM run of token-id prompts, plain or speculative; run with vLLM's own python (docs/vllm.md).

    .vllm-venv/bin/python scripts/vllm_compare.py MODEL_DIR PROMPTS.json OUT.json --method plain
    ... --method specfree --specfree strategy=hybrid        (specfree's proposer, any overrides)
    ... --method ngram | suffix                              (vLLM's own drafters)

PROMPTS.json holds a list of token-id lists; OUT.json gets each prompt's greedy output ids and the
run's timing (generate's wall time after a warm-up, all prompts batched at once).
"""

from __future__ import annotations

import argparse
import json
import time

PROPOSER = "specfree.integrations.vllm.SpecfreeProposer"


def speculative_config(method: str, k: int) -> dict | None:
    if method == "plain":
        return None
    if method == "specfree":
        return {"method": "custom_class", "model": PROPOSER, "num_speculative_tokens": k}
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4, "prompt_lookup_min": 1}
    if method == "suffix":
        return {"method": "suffix", "num_speculative_tokens": k}
    raise SystemExit(f"error: unknown --method {method!r}; use plain, specfree, ngram or suffix")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("prompts")
    parser.add_argument("out")
    parser.add_argument("--method", default="plain")
    parser.add_argument("--specfree", nargs="*", default=[], help="specfree config overrides, e.g. strategy=trie")
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--batch", type=int, default=0, help="prompts per generate call (0: all at once)")
    parser.add_argument("--no-warmup", action="store_true", help="time the first run (a test needs no timing)")
    parser.add_argument("--eager", action="store_true", help="no torch.compile (faster start, slower steps)")
    args = parser.parse_args()

    from specfree.integrations.vllm import check_environment

    check_environment()
    from vllm import LLM, SamplingParams

    prompts = json.load(open(args.prompts))
    extra = {"additional_config": {"specfree": list(args.specfree)}} if args.method == "specfree" else {}
    llm = LLM(model=args.model, dtype="float32", skip_tokenizer_init=True, max_model_len=1024,
              max_num_seqs=max(4, args.batch or len(prompts)), enforce_eager=args.eager, seed=0,
              speculative_config=speculative_config(args.method, args.k), **extra)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True, detokenize=False)
    batch = args.batch or len(prompts)
    groups = [prompts[i: i + batch] for i in range(0, len(prompts), batch)]

    def run() -> list[list[int]]:
        outputs = []
        for group in groups:
            results = llm.generate([{"prompt_token_ids": ids} for ids in group], params, use_tqdm=False)
            outputs += [list(r.outputs[0].token_ids) for r in results]
        return outputs

    if not args.no_warmup:
        run()  # compiled kernels, caches
    start = time.perf_counter()
    outputs = run()
    wall = time.perf_counter() - start
    tokens = sum(len(o) for o in outputs)
    json.dump({"method": args.method, "specfree": args.specfree, "k": args.k, "batch": batch, "outputs": outputs,
               "tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall}, open(args.out, "w"))
    print(f"{args.method} {' '.join(args.specfree)}: batch {batch}, {tokens} tokens, {tokens / wall:.1f} tok/s")


if __name__ == "__main__":  # vLLM starts its engine in a spawned process, which re-imports this file
    main()
