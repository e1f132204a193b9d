"""vLLM rows beside specfree's engine, on SmolLM2 fp32: plain, vLLM's ngram and suffix, and vLLM with
specfree's proposer, at batch 1 and 4, all checked against vLLM's plain greedy output.

Run with specfree's own python; each vLLM method runs in vLLM's environment (docs/vllm.md):

    python benchmarks/vllm_bench.py [--vllm-python .vllm-venv/bin/python] [--max-tokens 64] [--out DIR]

One row per (system, k, batch): tokens/s of the timed run after a warm-up on other text, speed-up
over vLLM plain at the same batch, drafted/accepted tokens, and whether the output equals vLLM
plain's. Each (system, k, batch) runs in a fresh vLLM process, so nothing a drafter learned in one
row's run reaches another's, with Intel OpenMP preloaded as vLLM's CPU guide asks.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ARTICLE = ("The town council of Millbrook voted on Tuesday to convert the old railway station into a public "
           "library. The railway station, built in 1894, has been empty since the line closed in 1972. Council "
           "members said the library will open in the spring of next year and will include a reading room, a "
           "children's corner and a small museum about the history of the railway.")
CODE = ("def area(width, height):\n    return width * height\n\n\ndef perimeter(width, height):\n"
        "    return 2 * (width + height)\n\n\ndef describe(width, height):\n"
        "    return f'{width}x{height}: area {area(width, height)}, perimeter {perimeter(width, height)}'\n")
PROMPTS = [f"Summarize the following article in two sentences.\n\n{ARTICLE}",
           f"Add type hints and a docstring to every function below; repeat the code in full.\n\n{CODE}",
           f"Copy the following text exactly, then say how many sentences it has.\n\n{ARTICLE}",
           f"Rename `width` to `w` and `height` to `h` in this code and show the whole result.\n\n{CODE}"]
METHODS = [("vllm-plain", "plain", []), ("vllm-ngram", "ngram", []), ("vllm-suffix", "suffix", []),
           ("vllm-specfree-prompt_lookup", "specfree", ["strategy=prompt_lookup"]),
           ("vllm-specfree-suffix", "specfree", ["strategy=suffix"]),
           ("vllm-specfree-hybrid", "specfree", ["strategy=hybrid"]),
           ("vllm-specfree-hybrid+suffix", "specfree",
            ["strategy=hybrid", "strategy.drafters=[prompt_lookup,trie,suffix]"]),
           ("vllm-specfree-suffix+pl", "specfree", ["strategy=hybrid", "strategy.drafters=[suffix,prompt_lookup]"])]


def root_cause(stderr: str) -> str:
    """The first exception line of a failed run's log (vLLM re-raises its worker's error, then warns)."""
    errors = [line.strip() for line in stderr.splitlines() if re.match(r"\w+(\.\w+)*(Error|Exception): ", line.strip())]
    return errors[0] if errors else (stderr.strip().splitlines() or ["no output"])[-1]


def smollm2_folder(folder: Path):
    """SmolLM2 as a plain fp32 folder vLLM loads (specfree's embedded model, saved once)."""
    from specfree.loading import load_model

    model, tokenizer = load_model("smollm2", device="cpu", dtype="float32")
    if not (folder / "config.json").exists():
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
    return model, tokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vllm-python", default=str(ROOT / ".vllm-venv" / "bin" / "python"))
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--k", type=int, nargs="+", default=[4], help="num_speculative_tokens (several: a row each)")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--methods", nargs="+", help="only these systems (vllm-plain, vllm-ngram, ...)")
    parser.add_argument("--out", default="bench_results/vllm")
    parser.add_argument("--eager", action="store_true", help="vLLM without torch.compile (starts faster)")
    parser.add_argument("--memory", type=float, default=0.3,
                        help="fraction of the CPU memory each vLLM run reserves, its own use included (compiled "
                             "runs hold ~3.5 GB before their KV cache on the Intel VM: 0.15 of 24 GB left 0.02)")
    parser.add_argument("--no-engine", action="store_true", help="skip specfree's own engine rows")
    parser.add_argument("--keep", action="store_true",
                        help="keep the rows of OUT/rows.json that this run does not measure again (one report)")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model, tokenizer = smollm2_folder(out / "smollm2-fp32")
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                             tokenize=True, return_dict=False) for p in PROMPTS]
    (out / "prompts.json").write_text(json.dumps(prompts))

    env = dict(os.environ)
    iomp = Path(args.vllm_python).parents[1] / "lib" / "libiomp5.so"
    if iomp.exists():  # vLLM warns that speculative decoding on CPU is much slower without it
        env["LD_PRELOAD"] = ":".join(filter(None, [str(iomp), env.get("LD_PRELOAD")]))
    rows = []
    for system, method, overrides in METHODS:
        if args.methods and system not in args.methods:
            continue
        for k in [0] if method == "plain" else args.k:
            for batch in args.batch:
                name = f"{system}-k{k}-b{batch}"
                cmd = [args.vllm_python, str(ROOT / "benchmarks" / "vllm_compare.py"), str(out / "smollm2-fp32"),
                       str(out / "prompts.json"), str(out / f"{name}.json"), "--method", method, "--k", str(k or 1),
                       "--max-tokens", str(args.max_tokens), "--batch", str(batch), "--memory", str(args.memory)]
                if args.eager:
                    cmd.append("--eager")
                if overrides:
                    cmd += ["--specfree", *overrides]
                done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)
                (out / f"{name}.log").write_text(done.stderr)
                if done.returncode:
                    print(f"{name}: failed (see {out / name}.log): {root_cause(done.stderr)}")
                    continue
                row = json.loads((out / f"{name}.json").read_text())
                rows.append({"system": system, **row, "k": k or "-"})
                print(f"{name}: {row['tokens_per_s']:.1f} tok/s, drafted {row['drafted']}, accepted {row['accepted']}",
                      flush=True)
    if not args.no_engine:
        rows += engine_rows(model, tokenizer, prompts, args.max_tokens)
    if args.keep and (out / "rows.json").exists():
        measured = {(r["system"], r["k"], r["batch"]) for r in rows}
        rows = [r for r in json.loads((out / "rows.json").read_text())
                if (r["system"], r["k"], r["batch"]) not in measured] + rows
    report(rows, out)


def engine_rows(model, tokenizer, prompts, max_tokens) -> list[dict]:
    """specfree's own engine (one request at a time) on the same ids."""
    from specfree import Engine

    rows = []
    for strategy in ("autoregressive", "hybrid"):
        engine = Engine.from_model(model, tokenizer, strategy)
        engine.generate(prompts[0], max_new_tokens=8, ignore_eos=True)  # warm-up
        start = time.perf_counter()
        outputs = [engine.generate(ids, max_new_tokens=max_tokens, ignore_eos=True).tokens for ids in prompts]
        wall = time.perf_counter() - start
        tokens = sum(map(len, outputs))
        rows.append({"system": f"specfree-engine-{strategy}", "k": "-", "batch": 1, "outputs": outputs,
                     "tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall, "drafted": None, "accepted": None})
    return rows


def report(rows: list[dict], out: Path) -> None:
    plain = {r["batch"]: r for r in rows if r["system"] == "vllm-plain"}
    lines = ["| system | k | batch | tok/s | vs vLLM plain | drafted | accepted | output = vLLM plain |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        base = plain.get(r["batch"])
        speed = f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x" if base else "-"
        same = "yes" if base and r["outputs"] == base["outputs"] else "no" if base else "-"
        lines.append(f"| {r['system']} | {r['k']} | {r['batch']} | {r['tokens_per_s']:.1f} | {speed} | "
                     f"{r['drafted']} | {r['accepted']} | {same} |")
    text = "\n".join(lines)
    print(text)
    (out / "report.md").write_text(text + "\n")
    (out / "rows.json").write_text(json.dumps(rows))


if __name__ == "__main__":
    main()
