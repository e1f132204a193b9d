"""Structured output on JSON-schema tasks: specfree's constrained plain loop, the hybrid with the
grammar drafter (with its default members, and with each drafter alone beside the grammar), and
transformers' ``generate`` with the same mask as a logits processor, greedy, on SmolLM2.

For each system: the share of answers valid under their schema (checked with ``jsonschema``), of
those that stopped; the share of tokens the grammar fixed (the emitted token's text lies inside
the text the grammar forced there); tokens per step; decode tok/s; the grammar's time per token and
its share of the decode time; and how many answers equal the constrained plain loop's.

llama-server rows (where ``scripts/build_llama_cpp.sh`` has built llama.cpp's tools): its
``json_schema`` on the same GGUF, plain and with ``--spec-type ngram-mod``, greedy, one slot, the
same threads, fed the same prompt ids. Their tok/s are the client's (the wall time less the
server's prompt evaluation) and the server's own decode timings; tokens per step from its draft
counts; ``identical`` counts agreement with the constrained plain loop (other kernels: not a
lossless baseline); no mask time (the server does not report it).

    PYTHONPATH=. python benchmarks/json_schema_bench.py --tasks 56 --max-new 256 --out json_bench.json

writes ``json_bench.json`` (every answer) and ``json_bench.md`` (one table, the systems as rows).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

TASKS = Path("../shared/bench/json_schema_tasks.jsonl")  # from the main checkout (56 tasks; SOURCES.md)
# --design-curve: DESIGN.md's fp32 curve on a 2-vCPU EPYC, as measured alone. By default the engines
# price on this machine's own cached curve (specfree's normal path, what a user gets); a shared
# machine measures it under load, which can price every draft out, so a loaded run may fix this one.
CURVE = ([1, 2, 4, 8, 16, 32], [0.0646, 0.106, 0.131, 0.146, 0.154, 0.203])
SERVER_ROWS = {"llama_server[json_schema]": "none", "llama_server(ngram-mod)[json_schema]": "ngram-mod"}
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


def start_llama_servers(threads: int, n_ctx: int, eos_ids, jinja: bool = False) -> list | str:
    """A started llama-server for each of ``SERVER_ROWS`` on SmolLM2's GGUF (``jinja``: its chat
    template renders OpenAI requests), or the line saying why there are none."""
    from specfree.bench import llama_server
    from specfree.bench.llama_cpp import gguf_precision, source_gguf
    from specfree.bench.runner import SystemSpec
    from specfree.files import DEFAULT_CACHE

    if llama_server.binary(DEFAULT_CACHE) is None:
        return f"skipped: llama.cpp's tools are not built here ({llama_server.BUILD})"
    gguf = source_gguf("smollm2")
    specs = [SystemSpec(llama_server.NAME, {"spec_type": spec}) for spec in SERVER_ROWS.values()]
    return llama_server.build(specs, gguf, gguf_precision(gguf), DEFAULT_CACHE, threads, n_ctx, eos_ids, jinja=jinja)


def llama_servers(engine, tasks: list[dict], threads: int, max_new: int) -> tuple[dict, str | None]:
    """The llama-server rows, each its own started server, or none and the line saying why."""
    from specfree.bench import llama_server

    n_ctx = max(len(engine.encode(t["messages"], chat=True)) for t in tasks) + max_new + 8
    built = start_llama_servers(threads, n_ctx, engine.eos_ids)
    if isinstance(built, str):
        return {}, built
    return dict(zip(SERVER_ROWS, built)), llama_server.describe_rows(built)


def run_llama_server(system, ids: list[int], task: dict, max_new: int) -> dict:
    """One ``/completion`` with the task's ``json_schema``; a schema the server refuses (its
    converter's 400) is an answer with no tokens, stop ``refused``."""
    import urllib.error

    start = time.perf_counter()
    try:
        reply = system.server.complete(ids, max_new, json_schema=task["schema"])
    except urllib.error.HTTPError as error:
        return {"tokens": [], "text": "", "stop": "refused", "steps": 0, "decode_s": 0.0, "grammar_s": None,
                "grammar_drafted": None, "server_decode_s": 0.0, "refusal": error.read().decode()[:300]}
    wall = time.perf_counter() - start
    timings = reply.get("timings") or {}
    tokens, stop = system.answer(reply)
    steps = max(1, len(tokens) - int(timings.get("draft_n_accepted") or 0))  # its plain loop: 1 token a step
    return {"tokens": tokens, "text": reply.get("content", ""), "stop": stop, "steps": steps,
            "decode_s": wall - timings.get("prompt_ms", 0.0) / 1e3, "grammar_s": None, "grammar_drafted": None,
            "server_decode_s": timings.get("predicted_ms", 0.0) / 1e3, "server_tokens": timings.get("predicted_n", 0)}


def summarize(name: str, runs: list[dict], tasks: list[dict], plain: list[dict]) -> dict:
    stopped = [(r, t) for r, t in zip(runs, tasks) if r["stop"] not in ("max_new_tokens", "refused")]
    tokens = sum(len(r["tokens"]) for r in runs)
    decode_s = sum(r["decode_s"] for r in runs)
    row = {"system": name, "answers": len(runs), "refused": sum(r["stop"] == "refused" for r in runs),
           "stopped": len(stopped), "valid_of_stopped": sum(valid(r["text"], t["schema"]) for r, t in stopped),
           "identical_to_plain": sum(r["tokens"] == p["tokens"] for r, p in zip(runs, plain)),
           "tokens": tokens, "tokens_per_step": tokens / max(1, sum(r["steps"] for r in runs)),
           "tok_s": tokens / decode_s if decode_s else None, "server_tok_s": None,
           "grammar_ms_per_token": None, "grammar_share_of_decode": None, "grammar_drafted_share": None}
    if "server_decode_s" in runs[0]:
        server_s = sum(r["server_decode_s"] for r in runs)  # its own count: the EOS it sampled too
        server_tokens = sum(r.get("server_tokens", 0) for r in runs)
        row["server_tok_s"] = server_tokens / server_s if server_s else None
    else:
        grammar_s = sum(r["grammar_s"] for r in runs)
        row.update(grammar_ms_per_token=1e3 * grammar_s / max(1, tokens), grammar_share_of_decode=grammar_s / decode_s,
                   grammar_drafted_share=sum(r["grammar_drafted"] for r in runs) / max(1, tokens))
    return row


COLUMNS = {"system": "system", "answers": "answers", "refused": "refused", "stopped": "stopped",
           "valid_of_stopped": "of them valid", "identical_to_plain": "identical to the plain loop",
           "tokens_per_step": "tokens per step", "tok_s": "decode tok/s (client)",
           "server_tok_s": "decode tok/s (server's timings)", "grammar_ms_per_token": "grammar ms per token",
           "grammar_share_of_decode": "grammar share of decode", "grammar_drafted_share": "from the grammar drafter"}


def markdown(report: dict) -> str:
    """The run as one table, the systems as rows, under a line naming the setup."""
    def cell(value) -> str:
        if value is None:
            return "—"
        return f"{value:.3g}" if isinstance(value, float) else str(value)

    path = report["path"]
    head = (f"{len(report['tasks'])} tasks, at most {report['max_new_tokens']} new tokens, greedy, "
            f"{report['cpu']}, {report['threads']} threads, {path.get('forward')} forward at {path.get('precision')} "
            f"({path.get('linear_kernel')}), costs: {report['costs']}; "
            f"grammar-fixed share of the plain loop's tokens: {report['grammar_fixed_share_of_plain_tokens']:.3f}. "
            f"llama-server: {report['llama_server']}.")
    lines = [head, "", "| " + " | ".join(COLUMNS.values()) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(cell(row[key]) for key in COLUMNS) + " |" for row in report["systems"]]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=int, default=6)
    parser.add_argument("--max-new", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--task-file", type=Path, default=TASKS)
    parser.add_argument("--design-curve", action="store_true", help="price on DESIGN.md's curve (see CURVE)")
    parser.add_argument("--no-llama-server", action="store_true", help="leave out the llama-server rows")
    parser.add_argument("--out", type=Path, help="the run's JSON; its table goes beside it as .md")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from specfree import Engine
    from specfree.cost import CostModel
    from specfree.runinfo import forward_path

    tasks = load_tasks(args.task_file, args.tasks)
    costs = CostModel(*CURVE) if args.design_curve else None
    engines = {}
    for name, (strategy, knobs) in SYSTEMS.items():
        engines[name] = Engine.from_pretrained("smollm2", strategy, costs=costs, **knobs)
        engines[name].generate(tasks[0]["messages"], 4, json_schema=tasks[0]["schema"])  # warm: tokenizer conversion
    first = engines["plain"]
    servers, server_note = ({}, "left out (--no-llama-server)") if args.no_llama_server else \
        llama_servers(first, tasks, args.threads, args.max_new)
    runs: dict[str, list[dict]] = {name: [] for name in [*engines, "transformers+mask", *servers]}
    for task in tasks:  # the systems interleaved per task: a shared machine's load drifts
        for name, engine in engines.items():
            runs[name].append(run_engine(engine, task, args.max_new))
        runs["transformers+mask"].append(run_transformers(first, task, args.max_new))
        ids = first.encode(task["messages"], chat=True)
        for name, system in servers.items():
            runs[name].append(run_llama_server(system, ids, task, args.max_new))
        print(task["id"], "done", flush=True)
    for system in servers.values():
        system.server.stop()
    fixed = sum(fixed_tokens(first, r["tokens"], t["schema"]) for r, t in zip(runs["plain"], tasks))
    report = {"cpu": cpu_name(), "threads": args.threads, "path": forward_path(first),
              "costs": "DESIGN.md's curve" if args.design_curve else "this machine's measured curve (cached)",
              "tasks": [t["id"] for t in tasks], "max_new_tokens": args.max_new,
              "grammar_fixed_share_of_plain_tokens": fixed / max(1, sum(len(r["tokens"]) for r in runs["plain"])),
              "llama_server": server_note,
              "systems": [summarize(name, rs, tasks, runs["plain"]) for name, rs in runs.items()],
              "answers": {name: [r["text"] for r in rs] for name, rs in runs.items()},
              "refusals": {name: [r["refusal"] for r in runs[name] if "refusal" in r] for name in servers}}
    print(json.dumps({k: v for k, v in report.items() if k != "answers"}, indent=1))
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
        args.out.with_suffix(".md").write_text(markdown(report))


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


if __name__ == "__main__":
    main()
