"""An agent loop of tool calls on SmolLM2, greedy: per task the user asks, the model calls a tool,
a scripted result drawn from the task's data comes back, the model calls again or answers.

The tasks are the ``Glaiveai2K`` rows of the JSON-schema task file (a function's argument schema
each: the tool); every prompt goes through ``serve``'s own pieces (``protocol.parse``, the chat
template or its fallback, the call grammar, ``CallSplitter``), decoded by ``Engine.generate`` with
the prompt cache on (each turn prefills only its new tokens, as a served conversation does).
Turn one asks for a call (``tool_choice: required``), later turns leave it to the model (``auto``).

Per system: calls that parse, name a listed tool and validate against its schema; replies
identical to the constrained plain loop's, turn by turn (the same tokens), and replies that say
the same (the same text and calls); tokens per step; decode tok/s (prefill left out) and its ratio
to the plain loop.

llama-server rows (where ``scripts/build_llama_cpp.sh`` has built llama.cpp's tools), plain and with
``--spec-type ngram-mod``: the same conversation, tools and scripted results through its OpenAI
endpoint (``/v1/chat/completions`` with ``tools``, the server started with ``--jinja``: the GGUF's
own chat template and llama.cpp's call format), greedy, on the same GGUF; its decode time is the
wall time less its prompt evaluation, its steps the tokens less its accepted drafts. Its prompts
are its own template's, so only the "say the same" column compares it with the plain loop.

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
from json_schema_bench import CURVE, SERVER_ROWS, SYSTEMS, TASKS, cpu_name, start_llama_servers  # noqa: E402

SERVER_CTX = 4096  # a conversation of a few turns with their tool results


def tool_of(task: dict) -> dict:
    """The task's function as a strict tool: no keys beyond its schema's, in every object of it, as
    OpenAI's strict mode asks (SmolLM2-135M otherwise invents keys until the token limit)."""
    name = task["id"].split("/", 1)[1].rsplit("_", 1)[0]  # Glaiveai2K/book_flight_a15ee43f -> book_flight
    return {"type": "function", "function": {"name": name, "description": f"{name.replace('_', ' ')}",
                                             "parameters": strict(task["schema"])}}


def strict(schema):
    """``schema`` with ``additionalProperties: false`` in each object that lists its properties and
    says nothing of others."""
    if isinstance(schema, list):
        return [strict(part) for part in schema]
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in ("properties", "$defs", "definitions"):  # maps of names to schemas
        if isinstance(out.get(key), dict):
            out[key] = {name: strict(part) for name, part in out[key].items()}
    for key in ("items", "prefixItems", "anyOf", "oneOf", "allOf"):  # a schema or a list of them
        if key in out:
            out[key] = strict(out[key])
    if isinstance(out.get("properties"), dict):
        out.setdefault("additionalProperties", False)
    return out


def tools_for(task: dict, other: dict) -> list[dict]:
    """The task's tool and the next task's, once where both name the same function (the file has
    several ``calculate_area`` rows; a name listed twice is a 400)."""
    tools = {t["function"]["name"]: t for t in (tool_of(task), tool_of(other))}
    return list(tools.values())


def load_tasks(path: Path, count: int) -> list[dict]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if r["category"] == "Glaiveai2K"][:count]


def parsed(arguments: str):
    try:
        return json.loads(arguments)
    except ValueError:
        return None


def result_for(name: str, arguments: str, turn: int) -> str:
    """The scripted tool result: the call's arguments echoed, each with a record the next turn may quote."""
    request = parsed(arguments)
    records = request.items() if isinstance(request, dict) else []
    return json.dumps({"tool": name, "status": "ok", "request": request,
                       "records": [{"field": key, "value": value, "checked": True, "turn": turn}
                                   for key, value in records]})


def first_ask(tools: list[dict]) -> list[dict]:
    return [{"role": "user", "content": f"Please use the tool `{tools[0]['function']['name']}` for me, "
                                        "with realistic arguments, then tell me what it found."}]


def request_body(messages: list[dict], tools: list[dict], turn: int) -> dict:
    """Turn one asks for a call, later turns leave it to the model."""
    return {"messages": messages, "tools": tools, "tool_choice": "required" if turn == 0 else "auto",
            "parallel_tool_calls": False}


def run_loop(engine, task: dict, tools: list[dict], turns: int, max_new: int) -> list[dict]:
    from specfree.serve.prompt import render
    from specfree.serve.protocol import parse
    from specfree.serve.tools import CallSplitter

    messages = first_ask(tools)
    replies = []
    engine.forget()
    for turn in range(turns):
        ask = parse("chat", request_body(messages, tools, turn), max_new)
        ids = engine.tokenizer(render(engine.tokenizer, ask.prompt, ask.tools), add_special_tokens=False).input_ids
        start = time.perf_counter()
        result = engine.generate(ids, max_new, **ask.tools.constraint().options())
        wall = time.perf_counter() - start
        splitter = CallSplitter()
        content, calls = splitter.push(result.text)
        content += splitter.flush()
        replies.append({"tokens": result.tokens, "n_tokens": len(result.tokens), "text": result.text,
                        "content": content, "steps": len(result.steps), "decode_s": wall - result.prefill_s,
                        "calls": [(c.name, c.arguments) for c in calls], "stop": result.stop_reason})
        if not calls:
            break
        messages.append({"role": "assistant", "content": content, "tool_calls": [c.tool_call() for c in calls]})
        messages += [{"role": "tool", "tool_call_id": c.id, "content": result_for(c.name, c.arguments, turn)}
                     for c in calls]
    return replies


def run_server_loop(server, tools: list[dict], turns: int, max_new: int) -> list[dict]:
    """The same loop through llama-server's OpenAI endpoint; a request it refuses ends the loop
    with a reply of no tokens, stop ``refused``."""
    import urllib.error

    messages = first_ask(tools)
    replies = []
    for turn in range(turns):
        start = time.perf_counter()
        try:
            answer = server.chat({**request_body(messages, tools, turn), "max_tokens": max_new})
        except urllib.error.HTTPError as error:
            replies.append({"tokens": None, "n_tokens": 0, "text": error.read().decode()[:300], "content": "",
                            "steps": 0, "decode_s": 0.0, "calls": [], "stop": "refused"})
            break
        wall = time.perf_counter() - start
        choice, timings = answer["choices"][0], answer.get("timings") or {}
        message, n_tokens = choice["message"], answer["usage"]["completion_tokens"]
        calls = [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls") or []]
        replies.append({"tokens": None, "n_tokens": n_tokens, "text": json.dumps(message),
                        "content": message.get("content") or "", "calls": calls, "stop": choice["finish_reason"],
                        "steps": n_tokens - int(timings.get("draft_n_accepted") or 0),
                        "decode_s": wall - timings.get("prompt_ms", 0.0) / 1e3})
        if not calls:
            break
        messages.append({"role": "assistant", "content": message.get("content") or "",
                         "tool_calls": message["tool_calls"]})
        messages += [{"role": "tool", "tool_call_id": c["id"], "content": result_for(*call, turn)}
                     for c, call in zip(message["tool_calls"], calls)]
    return replies


def says(reply: dict) -> tuple:
    """What a reply says, whatever its call format: its text and its calls' names and arguments."""
    return reply["content"].strip(), [(name, parsed(arguments)) for name, arguments in reply["calls"]]


def llama_servers(threads: int) -> tuple[dict, str]:
    """The llama-server rows, each its own server started with ``--jinja``, or none and why."""
    from specfree.bench.llama_server import BUILD

    built = start_llama_servers(threads, SERVER_CTX, [], jinja=True)
    if isinstance(built, str):
        return {}, built
    names = [name.replace("[json_schema]", "[tools]") for name in SERVER_ROWS]
    note = (f"llama.cpp {built[0].details['server']} ({BUILD}), {threads} threads, one slot, "
            f"{Path(built[0].details['gguf']).name}, --jinja (the GGUF's chat template), /v1/chat/completions "
            "with tools, greedy")
    return {name: system.server for name, system in zip(names, built)}, note


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


def summarize(name: str, loops: list, plain_loops: list) -> dict:
    """One row. Turns are compared where both loops reached them (a loop ends at its first reply
    without a call)."""
    pairs = [(r, p) for (_, loop), (_, plain) in zip(loops, plain_loops) for r, p in zip(loop, plain)]
    replies = [r for _, loop in loops for r in loop]
    made, good = map(sum, zip(*(checked_calls(loop, tools) for tools, loop in loops)))
    tokens, decode_s = sum(r["n_tokens"] for r in replies), sum(r["decode_s"] for r in replies)
    identical = None if replies[0]["tokens"] is None else sum(r["tokens"] == p["tokens"] for r, p in pairs)
    return {"system": name, "turns": len(replies), "refused": sum(r["stop"] == "refused" for r in replies),
            "calls": made, "calls_valid": good, "replies_identical_to_plain": identical,
            "replies_saying_as_plain": sum(says(r) == says(p) for r, p in pairs), "tokens": tokens,
            "tokens_per_step": tokens / max(1, sum(r["steps"] for r in replies)),
            "decode_tok_s": tokens / decode_s if decode_s else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=int, default=4)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--max-new", type=int, default=96)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--task-file", type=Path, default=TASKS)
    parser.add_argument("--design-curve", action="store_true", help="price on DESIGN.md's curve (json_schema_bench)")
    parser.add_argument("--no-llama-server", action="store_true", help="leave out the llama-server rows")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from specfree import Engine
    from specfree.cost import CostModel
    from specfree.runinfo import forward_path

    tasks = load_tasks(args.task_file, args.tasks)
    names = ["plain", *[n for n in args.systems.split(",") if n != "plain"]]
    costs = CostModel(*CURVE) if args.design_curve else None  # why: json_schema_bench's CURVE
    engines = {n: Engine.from_pretrained("smollm2", SYSTEMS[n][0], costs=costs, prompt_cache=True,
                                         **SYSTEMS[n][1]) for n in names}
    for engine in engines.values():  # warm: the tokenizer's conversion for the grammar, the first forwards
        run_loop(engine, tasks[0], tools_for(tasks[0], tasks[0]), 1, 4)
    servers, server_note = ({}, "left out (--no-llama-server)") if args.no_llama_server else \
        llama_servers(args.threads)
    runs: dict[str, list] = {n: [] for n in [*names, *servers]}
    for i, task in enumerate(tasks):  # the systems interleaved per task: a shared machine's load drifts
        tools = tools_for(task, tasks[(i + 1) % len(tasks)])
        for name, engine in engines.items():
            runs[name].append((tools, run_loop(engine, task, tools, args.turns, args.max_new)))
        for name, server in servers.items():
            runs[name].append((tools, run_server_loop(server, tools, args.turns, args.max_new)))
        print(task["id"], "done", flush=True)
    for server in servers.values():
        server.stop()
    rows = [summarize(name, runs[name], runs["plain"]) for name in runs]
    for row in rows:
        row["over_plain"] = row["decode_tok_s"] / rows[0]["decode_tok_s"] if row["decode_tok_s"] else None
    report = {"cpu": cpu_name(), "threads": args.threads, "path": forward_path(engines["plain"]),
              "costs": "DESIGN.md's curve" if args.design_curve else "this machine's measured curve (cached)",
              "tasks": [t["id"] for t in tasks], "turns": args.turns, "max_new_tokens": args.max_new,
              "llama_server": server_note, "systems": rows,
              "replies": {n: [[r["text"] for r in loop] for _, loop in runs[n]] for n in runs}}
    print(json.dumps({k: v for k, v in report.items() if k != "replies"}, indent=1))
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
