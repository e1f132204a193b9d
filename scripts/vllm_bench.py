"""vLLM rows beside specfree's engine, on SmolLM2 fp32: plain, vLLM's ngram and suffix, and vLLM with
specfree's proposer, at batch 1 and 4, all checked against vLLM's plain greedy output.

Run with specfree's own python; each vLLM method runs in vLLM's environment (docs/vllm.md):

    python scripts/vllm_bench.py [--vllm-python .vllm-venv/bin/python] [--max-tokens 64] [--out DIR]

One row per (system, batch): tokens/s of the timed run after a warm-up, speed-up over vLLM plain at
the same batch, drafted/accepted tokens, and whether the output equals vLLM plain's.
"""

from __future__ import annotations

import argparse
import json
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
METHODS = [("plain", []), ("ngram", []), ("suffix", []), ("specfree", ["strategy=prompt_lookup"]),
           ("specfree", ["strategy=hybrid"])]


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
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--out", default="bench_results/vllm")
    parser.add_argument("--eager", action="store_true", help="vLLM without torch.compile (starts faster)")
    parser.add_argument("--no-engine", action="store_true", help="skip specfree's own engine rows")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model, tokenizer = smollm2_folder(out / "smollm2-fp32")
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                             tokenize=True, return_dict=False) for p in PROMPTS]
    (out / "prompts.json").write_text(json.dumps(prompts))

    rows = []
    for method, overrides in METHODS:
        name = "vllm-" + method + "".join("-" + o.split("=")[-1] for o in overrides)
        cmd = [args.vllm_python, str(ROOT / "scripts" / "vllm_compare.py"), str(out / "smollm2-fp32"),
               str(out / "prompts.json"), str(out / f"{name}.json"), "--method", method, "--k", str(args.k),
               "--max-tokens", str(args.max_tokens), "--batch", "1", "4"]
        if args.eager:
            cmd.append("--eager")
        if overrides:
            cmd += ["--specfree", *overrides]
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        (out / f"{name}.log").write_text(done.stderr)
        if done.returncode:
            print(f"{name}: failed (see {out / name}.log): {done.stderr.strip().splitlines()[-1:]}")
            continue
        for row in json.loads((out / f"{name}.json").read_text()):
            rows.append({"system": name, **row})
    if not args.no_engine:
        rows += engine_rows(model, tokenizer, prompts, args.max_tokens)
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
        rows.append({"system": f"specfree-engine-{strategy}", "batch": 1, "outputs": outputs, "tokens": tokens,
                     "wall_s": wall, "tokens_per_s": tokens / wall, "drafted": None, "accepted": None})
    return rows


def report(rows: list[dict], out: Path) -> None:
    plain = {r["batch"]: r for r in rows if r["system"] == "vllm-plain"}
    lines = ["| system | batch | tok/s | vs vLLM plain | drafted | accepted | output = vLLM plain |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        base = plain.get(r["batch"])
        speed = f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x" if base else "-"
        same = "yes" if base and r["outputs"] == base["outputs"] else "no" if base else "-"
        lines.append(f"| {r['system']} | {r['batch']} | {r['tokens_per_s']:.1f} | {speed} | {r['drafted']} | "
                     f"{r['accepted']} | {same} |")
    text = "\n".join(lines)
    print(text)
    (out / "report.md").write_text(text + "\n")
    (out / "rows.json").write_text(json.dumps(rows))


if __name__ == "__main__":
    main()
