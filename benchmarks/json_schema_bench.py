"""Structured output on JSON-schema tasks: specfree's constrained plain loop, the hybrid with the
grammar drafter (with its default members, and with each drafter alone beside the grammar), and
transformers' ``generate`` with the same mask as a logits processor, greedy, on SmolLM2.

For each system: the share of answers valid under their schema (checked with ``jsonschema``), of
those that stopped; the share of tokens the grammar fixed (the emitted token's text lies inside
the text the grammar forced there); tokens per step; decode tok/s; the grammar's time per token and
its share of the decode time; and how many answers equal the constrained plain loop's.
llama-server's ``json_schema`` rows need llama.cpp's tools (``scripts/build_llama_cpp.sh``).

    PYTHONPATH=. python benchmarks/json_schema_bench.py --tasks 6 --max-new 128 --out json_bench.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

TASKS = Path("../shared/bench/json_schema_tasks.jsonl")  # from the main checkout (56 tasks; SOURCES.md)
# The cost curve every priced system is given (DESIGN.md's fp32 curve on a 2-vCPU EPYC, as
# measured alone): the one a shared machine measures under load can price every draft out.
CURVE = ([1, 2, 4, 8, 16, 32], [0.0646, 0.106, 0.131, 0.146, 0.154, 0.203])
SYSTEMS = {"plain": ("autoregressive", {}), "hybrid": ("hybrid", {}),
           "hybrid[prompt_lookup]": ("hybrid", {"drafters": ["prompt_lookup"]}),
           "hybrid[suffix]": ("hybrid", {"drafters": ["suffix"]})}


def load_tasks(path: Path, count: int) -> list[dict]:
    tasks = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    step = max(1, len(tasks) // count)  # spread over the categories, which the file lists in runs
    return tasks[::step][:count]


def valid(text: str, schema: dict) -> bool:
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), schema)
    except (json.JSONDecodeError, jsonschema.ValidationError):
        return False
    return True


def fixed_tokens(engine, tokens: list[int], schema: dict) -> int:
    """How many of ``tokens`` the grammar fixed: the token's bytes lie inside the forced bytes there."""
    from specfree.constraints import Constraint

    matcher = engine.matcher(Constraint.from_options(json_schema=schema))
    fixed = 0
    for i, token in enumerate(tokens):
        forced = matcher.forced_bytes()
        piece = engine.tokenizer.decode([token]).encode()
        fixed += bool(forced) and forced.startswith(piece)
        if i + 1 < len(tokens):
            matcher.follow(tokens[: i + 1])
    return fixed


def run_engine(engine, task: dict, max_new: int) -> dict:
    start = time.perf_counter()
    result = engine.generate(task["messages"], max_new, json_schema=task["schema"])
    wall = time.perf_counter() - start
    grammar_s = result.steps[-1].extra.get("constraint_s", 0.0) if result.steps else 0.0
    return {"tokens": result.tokens, "text": result.text, "stop": result.stop_reason, "steps": len(result.steps),
            "decode_s": wall - result.prefill_s, "grammar_s": grammar_s,
            "grammar_drafted": sum(s.sources.get("grammar", 0) for s in result.steps)}


def run_transformers(engine, task: dict, max_new: int) -> dict:
    """``generate`` with the mask as a logits processor: what a user would otherwise write."""
    from transformers import LogitsProcessorList

    from specfree.adapters import as_shipped
    from specfree.constraints import Constraint, ConstraintMask

    ids = engine.encode(task["messages"], chat=True)
    matcher = engine.matcher(Constraint.from_options(json_schema=task["schema"]))
    model = engine.adapter.model
    start = time.perf_counter()
    with torch.no_grad(), as_shipped(model):
        out = model.generate(torch.tensor([ids]), max_new_tokens=max_new, do_sample=False,
                             logits_processor=LogitsProcessorList([ConstraintMask(matcher, len(ids))]),
                             eos_token_id=sorted(engine.eos_ids), pad_token_id=engine.tokenizer.eos_token_id)
    wall = time.perf_counter() - start
    tokens = out[0, len(ids) :].tolist()
    if tokens and tokens[-1] in engine.eos_ids:
        tokens = tokens[:-1]
    return {"tokens": tokens, "text": engine.tokenizer.decode(tokens), "steps": len(tokens) + 1,
            "stop": "eos" if len(tokens) < max_new else "max_new_tokens", "decode_s": wall,
            "grammar_s": matcher.spent_s, "grammar_drafted": 0}


def summarize(name: str, runs: list[dict], tasks: list[dict], plain: list[dict]) -> dict:
    stopped = [(r, t) for r, t in zip(runs, tasks) if r["stop"] != "max_new_tokens"]
    tokens = sum(len(r["tokens"]) for r in runs)
    decode_s = sum(r["decode_s"] for r in runs)
    return {"system": name, "answers": len(runs), "stopped": len(stopped),
            "valid_of_stopped": sum(valid(r["text"], t["schema"]) for r, t in stopped),
            "identical_to_plain": sum(r["tokens"] == p["tokens"] for r, p in zip(runs, plain)),
            "tokens": tokens, "tokens_per_step": tokens / max(1, sum(r["steps"] for r in runs)),
            "tok_s": tokens / decode_s, "grammar_ms_per_token": 1e3 * sum(r["grammar_s"] for r in runs) / tokens,
            "grammar_share_of_decode": sum(r["grammar_s"] for r in runs) / decode_s,
            "grammar_drafted_share": sum(r["grammar_drafted"] for r in runs) / tokens}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=int, default=6)
    parser.add_argument("--max-new", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--task-file", type=Path, default=TASKS)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from specfree import Engine
    from specfree.cost import CostModel
    from specfree.runinfo import forward_path

    tasks = load_tasks(args.task_file, args.tasks)
    engines = {}
    for name, (strategy, knobs) in SYSTEMS.items():
        engines[name] = Engine.from_pretrained("smollm2", strategy, costs=CostModel(*CURVE), **knobs)
        engines[name].generate(tasks[0]["messages"], 4, json_schema=tasks[0]["schema"])  # warm: tokenizer conversion
    first = engines["plain"]
    runs: dict[str, list[dict]] = {name: [] for name in [*engines, "transformers+mask"]}
    for task in tasks:  # the systems interleaved per task: a shared machine's load drifts
        for name, engine in engines.items():
            runs[name].append(run_engine(engine, task, args.max_new))
        runs["transformers+mask"].append(run_transformers(first, task, args.max_new))
        print(task["id"], "done", flush=True)
    fixed = sum(fixed_tokens(first, r["tokens"], t["schema"]) for r, t in zip(runs["plain"], tasks))
    report = {"cpu": cpu_name(), "threads": args.threads, "path": forward_path(first),
              "tasks": [t["id"] for t in tasks], "max_new_tokens": args.max_new,
              "grammar_fixed_share_of_plain_tokens": fixed / max(1, sum(len(r["tokens"]) for r in runs["plain"])),
              "llama_server": "skipped: llama.cpp's tools are not built here (scripts/build_llama_cpp.sh)",
              "systems": [summarize(name, rs, tasks, runs["plain"]) for name, rs in runs.items()],
              "answers": {name: [r["text"] for r in rs] for name, rs in runs.items()}}
    text = json.dumps(report, indent=1)
    print(json.dumps({k: v for k, v in report.items() if k != "answers"}, indent=1))
    if args.out:
        args.out.write_text(text)


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


if __name__ == "__main__":
    main()
