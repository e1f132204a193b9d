"""An agent loop of tool calls on SmolLM2, greedy: per task the user asks, the model calls a tool,
a scripted result drawn from the task's data comes back, the model calls again or answers.

The tasks are the ``Glaiveai2K`` rows of the JSON-schema task file (a function's argument schema
each: the tool); every prompt goes through ``serve``'s own pieces (``protocol.parse``, the chat
template or its fallback, the call grammar, ``CallSplitter``), decoded by ``Engine.generate`` with
the prompt cache on (each turn prefills only its new tokens, as a served conversation does).
Turn one asks for a call (``tool_choice: required``), later turns leave it to the model (``auto``).

Per system: calls that parse, name a listed tool and validate against its schema; replies
identical to the constrained plain loop's, turn by turn; tokens per step; decode tok/s (prefill
left out) and its ratio to the plain loop. llama-server's rows need llama.cpp's tools.

    PYTHONPATH=. python benchmarks/agent_loop_bench.py --tasks 4 --turns 3 --out agent_loop.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from json_schema_bench import CURVE, SYSTEMS, TASKS, cpu_name  # noqa: E402


def tool_of(task: dict) -> dict:
    """The task's function as a strict tool (no keys beyond its schema's, as OpenAI's strict mode asks:
    SmolLM2-135M otherwise invents keys until the token limit)."""
    name = task["id"].split("/", 1)[1].rsplit("_", 1)[0]  # Glaiveai2K/book_flight_a15ee43f -> book_flight
    return {"type": "function", "function": {"name": name, "description": f"{name.replace('_', ' ')}",
                                             "parameters": {**task["schema"], "additionalProperties": False}}}


def load_tasks(path: Path, count: int) -> list[dict]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if r["category"] == "Glaiveai2K"][:count]


def result_for(call, turn: int) -> str:
    """The scripted tool result: the call's arguments echoed, each with a record the next turn may quote."""
    arguments = json.loads(call.arguments)
    return json.dumps({"tool": call.name, "status": "ok", "request": arguments,
                       "records": [{"field": key, "value": value, "checked": True, "turn": turn}
                                   for key, value in arguments.items()]})


def run_loop(engine, task: dict, tools: list[dict], turns: int, max_new: int) -> list[dict]:
    from specfree.serve.prompt import render
    from specfree.serve.protocol import parse
    from specfree.serve.tools import CallSplitter

    messages = [{"role": "user", "content": f"Please use the tool `{tools[0]['function']['name']}` for me, "
                                            "with realistic arguments, then tell me what it found."}]
    replies = []
    engine.forget()
    for turn in range(turns):
        body = {"messages": messages, "tools": tools, "tool_choice": "required" if turn == 0 else "auto",
                "parallel_tool_calls": False}
        ask = parse("chat", body, max_new)
        ids = engine.tokenizer(render(engine.tokenizer, ask.prompt, ask.tools), add_special_tokens=False).input_ids
        start = time.perf_counter()
        result = engine.generate(ids, max_new, **ask.tools.constraint().options())
        wall = time.perf_counter() - start
        splitter = CallSplitter()
        content, calls = splitter.push(result.text)
        replies.append({"tokens": result.tokens, "text": result.text, "steps": len(result.steps),
                        "decode_s": wall - result.prefill_s, "calls": [(c.name, c.arguments) for c in calls],
                        "stop": result.stop_reason})
        if not calls:
            break
        messages.append({"role": "assistant", "content": content + splitter.flush(),
                         "tool_calls": [c.tool_call() for c in calls]})
        messages += [{"role": "tool", "tool_call_id": c.id, "content": result_for(c, turn)} for c in calls]
    return replies


def checked_calls(replies: list[dict], tools: list[dict]) -> tuple[int, int]:
    import jsonschema

    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    made = good = 0
    for reply in replies:
        for name, arguments in reply["calls"]:
            made += 1
            try:
                jsonschema.validate(json.loads(arguments), schemas[name])
                good += 1
            except (KeyError, ValueError, jsonschema.ValidationError):
                pass
    return made, good


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=int, default=4)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--max-new", type=int, default=96)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--task-file", type=Path, default=TASKS)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from specfree import Engine
    from specfree.cost import CostModel
    from specfree.runinfo import forward_path

    tasks = load_tasks(args.task_file, args.tasks)
    names = ["plain", *[n for n in args.systems.split(",") if n != "plain"]]
    engines = {n: Engine.from_pretrained("smollm2", SYSTEMS[n][0], costs=CostModel(*CURVE), prompt_cache=True,
                                         **SYSTEMS[n][1]) for n in names}
    runs: dict[str, list] = {n: [] for n in names}
    for i, task in enumerate(tasks):  # the systems interleaved per task: a shared machine's load drifts
        tools = [tool_of(task), tool_of(tasks[(i + 1) % len(tasks)])]  # the one asked for and one more
        for name, engine in engines.items():
            runs[name].append((tools, run_loop(engine, task, tools, args.turns, args.max_new)))
        print(task["id"], "done", flush=True)
    rows = []
    for name in names:
        replies = [r for _, loop in runs[name] for r in loop]
        plain = [r for _, loop in runs["plain"] for r in loop]
        made, good = map(sum, zip(*(checked_calls(loop, tools) for tools, loop in runs[name])))
        tokens, decode_s = sum(len(r["tokens"]) for r in replies), sum(r["decode_s"] for r in replies)
        rows.append({"system": name, "turns": len(replies), "calls": made, "calls_valid": good,
                     "replies_identical_to_plain": sum(r["tokens"] == p["tokens"] for r, p in zip(replies, plain)),
                     "tokens": tokens, "tokens_per_step": tokens / max(1, sum(r["steps"] for r in replies)),
                     "decode_tok_s": tokens / decode_s})
    for row in rows:
        row["over_plain"] = row["decode_tok_s"] / rows[0]["decode_tok_s"]
    report = {"cpu": cpu_name(), "threads": args.threads, "path": forward_path(engines["plain"]),
              "tasks": [t["id"] for t in tasks], "turns": args.turns, "max_new_tokens": args.max_new,
              "llama_server": "skipped: llama.cpp's tools are not built here (scripts/build_llama_cpp.sh)",
              "systems": rows,
              "replies": {n: [[r["text"] for r in loop] for _, loop in runs[n]] for n in names}}
    print(json.dumps({k: v for k, v in report.items() if k != "replies"}, indent=1))
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
