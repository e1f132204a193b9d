"""Load test of ``specfree serve`` on Spec-Bench prompts: decode in sequence against the server
under concurrent clients, through the same engine, with malformed requests mixed in.

    .venv/bin/python scripts/serve_load.py [--prompts question.jsonl] [--per-task 4] [--max-tokens 64]
        [--clients 8] [--bad 200] [--threads 1] [--out serve_load.json] [OVERRIDE ...]

OVERRIDEs are the usual config overrides (``strategy=suffix``...). One engine is built; passes:
  1. ``decode`` in sequence: ``Engine.generate`` over the prompts (greedy, chat template).
  2. the server (in this process, on 127.0.0.1, an API key set) with ``--clients`` streaming clients
     at once, ``--bad`` malformed requests mixed in.
  3. the same again (the suffix tree now knows pass 2's answers): accepted tokens per step rise.
  4. the server with 1 streaming client.
  5. ``--rounds`` - 1 more pairs of passes 1 and 2 (without the malformed ones): on a shared machine
     the speed drifts between passes, and pairs show by how much.
Every pass but 3 starts from the same drafter state (the suffix tree emptied, the pricing statistics
as after the warm-up), so their speeds compare; pass 3 keeps what pass 2 learned. Every answer is
checked against pass 1's text, every malformed request against its expected status.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import torch
import uvicorn

from specfree import Engine
from specfree.conf.schema import ServeConfig
from specfree.runinfo import cpu_info
from specfree.serve import create_app
from specfree.serve.cli import listen
from specfree.serve.state import suffix_drafter

KEY = "load-test-key"
# Spec-Bench's six tasks; MT-bench's categories are one task, multi-turn chat.
MT_BENCH = {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"}


def spec_bench_prompts(path: Path, per_task: int) -> list[str]:
    taken: dict[str, list[str]] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        row = json.loads(line)
        task = "multi_turn" if row["category"] in MT_BENCH else row["category"]
        if len(taken.setdefault(task, [])) < per_task:
            taken[task].append(row["turns"][0])
    return [p for prompts in taken.values() for p in prompts]


def chat(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def malformed(n: int) -> list[tuple[str, dict, int]]:
    """``n`` bad requests, (what, httpx request kwargs, expected status), many kinds in turn."""
    ok = {"Authorization": f"Bearer {KEY}"}
    msg = chat("hi")
    kinds = [
        ("no key", {"json": {"messages": msg}}, 401),
        ("wrong key", {"json": {"messages": msg}, "headers": {"Authorization": "Bearer nope"}}, 401),
        ("n=2", {"json": {"messages": msg, "n": 2}, "headers": ok}, 400),
        ("top_logprobs without logprobs", {"json": {"messages": msg, "top_logprobs": 2}, "headers": ok}, 400),
        ("tools", {"json": {"messages": msg, "tools": [{"type": "function"}]}, "headers": ok}, 400),
        ("unknown nested field", {"json": {"messages": msg, "specfree": {"colour": 1}}, "headers": ok}, 400),
        ("wrong type", {"json": {"messages": msg, "temperature": "hot"}, "headers": ok}, 400),
        ("max_tokens too big", {"json": {"messages": msg, "max_tokens": 10**6}, "headers": ok}, 400),
        ("not JSON", {"content": b"{oops", "headers": ok}, 400),
        ("no messages", {"json": {"model": "smollm2"}, "headers": ok}, 400),
        ("logit_bias out of range", {"json": {"messages": msg, "logit_bias": {"1": 500}}, "headers": ok}, 400),
        ("body too large", {"content": b" " * 1_100_000, "headers": ok}, 413),
        ("prompt too long", {"json": {"messages": chat("word " * 9000)}, "headers": ok}, 400),
        ("bad role", {"json": {"messages": [{"role": "tool", "content": "x"}]}, "headers": ok}, 400),
    ]
    return [kinds[i % len(kinds)] for i in range(n)]


class Running:
    """The app on a free port of 127.0.0.1, uvicorn in a thread."""

    def __init__(self, app):
        self.sock = listen("127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self):
        self.thread.start()
        while not self.server.started:
            time.sleep(0.05)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(60)


async def one(client: openai.AsyncOpenAI, index: int, prompt: str, max_tokens: int, start: float) -> dict:
    sent = time.perf_counter()
    first, text, usage, stats = None, "", None, None
    stream = await client.chat.completions.create(model="smollm2", messages=chat(prompt), max_tokens=max_tokens,
                                                  temperature=0, stream=True, stream_options={"include_usage": True})
    async for part in stream:
        if part.choices and part.choices[0].delta.content:
            first = first or time.perf_counter()
            text += part.choices[0].delta.content
        if part.choices and part.choices[0].finish_reason:
            stats = part.model_extra.get("specfree")
        if part.usage:
            usage = part.usage
    done = time.perf_counter()
    return {"index": index, "text": text, "tokens": usage.completion_tokens, "ttft_s": (first or done) - sent,
            "sent_s": sent - start, "done_s": done - start, "steps": stats["steps"]}


async def server_pass(url: str, prompts: list[str], clients: int, max_tokens: int, bad: int) -> dict:
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=3600)
    todo: asyncio.Queue = asyncio.Queue()
    for item in enumerate(prompts):
        todo.put_nowait(item)
    answers: list[dict] = []
    bad_results: list[tuple[str, int, int]] = []
    start = time.perf_counter()
    running = True

    async def worker():
        while not todo.empty():
            index, prompt = todo.get_nowait()
            answers.append(await one(client, index, prompt, max_tokens, start))

    async def troublemaker(requests):
        async with httpx.AsyncClient(base_url=url, timeout=600) as http:
            for what, kwargs, want in requests:
                got = await http.post("/v1/chat/completions", **kwargs)
                body = got.json()
                assert set(body["error"]) == {"message", "type", "param", "code"}, body
                bad_results.append((what, want, got.status_code))
                if running:
                    await asyncio.sleep(0.05)

    bad_requests = malformed(bad)
    tasks = [asyncio.create_task(troublemaker(bad_requests[i::2])) for i in range(2) if bad]
    await asyncio.gather(*(worker() for _ in range(clients)))
    wall = time.perf_counter() - start
    running = False
    await asyncio.gather(*tasks)
    async with httpx.AsyncClient(base_url=url) as http:
        health = (await http.get("/health")).json()
    await client.close()
    answers.sort(key=lambda a: a["index"])
    tokens, steps = sum(a["tokens"] for a in answers), sum(a["steps"] for a in answers)
    ttft = [a["ttft_s"] for a in answers]
    return {"clients": clients, "wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall,
            "tokens_per_step": tokens / steps, "ttft_median_s": statistics.median(ttft), "ttft_max_s": max(ttft),
            "ttft_p90_s": sorted(ttft)[int(0.9 * (len(ttft) - 1))], "texts": [a["text"] for a in answers],
            "bad": {"sent": len(bad_results), "as_expected": sum(w == g for _, w, g in bad_results),
                    "wrong": [r for r in bad_results if r[1] != r[2]][:10]},
            "health_after": health.get("status")}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", default="/work/shared/bench/spec_bench_questions.jsonl")
    ap.add_argument("--per-task", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--bad", type=int, default=200)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3, help="(decode, serve) pairs timed, each from the same state")
    ap.add_argument("--out", default="serve_load.json")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    prompts = spec_bench_prompts(Path(args.prompts), args.per_task)
    engine = Engine.from_config(overrides=args.overrides)
    engine.generate("Say hello to the reader in one short sentence.", 16)  # warm-up: kernels, caches
    drafter = suffix_drafter(engine.strategy)
    pricing = copy.deepcopy(engine.pricer)

    def fresh():  # the drafters' state as after the warm-up
        drafter.reset()
        engine.pricer = copy.deepcopy(pricing)

    report = {"cpu": cpu_info(), "threads": args.threads, "prompts": len(prompts), "max_tokens": args.max_tokens,
              "overrides": args.overrides}
    def decode(name: str) -> list[str]:
        fresh()
        start, texts, tokens, steps = time.perf_counter(), [], 0, 0
        for prompt in prompts:
            g = engine.generate(chat(prompt), args.max_tokens)
            texts.append(g.text)
            tokens, steps = tokens + len(g.tokens), steps + g.forwards
        wall = time.perf_counter() - start
        report[name] = {"wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall,
                        "tokens_per_step": tokens / steps}
        print(f"{name} in sequence: {tokens} tokens in {wall:.1f} s, {tokens / wall:.2f} tok/s, "
              f"{tokens / steps:.3f} tokens/step", flush=True)
        return texts

    texts = decode("decode")
    app = create_app(engine, ServeConfig(api_key=KEY, queue_size=64, max_tokens=1024), model_name="smollm2")
    rounds = {"decode": [report["decode"]], "serve": []}
    with Running(app) as running:
        def serve(name: str, clients: int, bad: int, reset: bool) -> dict:
            if reset:
                fresh()
            result = asyncio.run(server_pass(running.url, prompts, clients, args.max_tokens, bad))
            result["identical_to_decode"] = sum(a == b for a, b in zip(result.pop("texts"), texts))
            report[name] = result
            print(f"serve, {name}: {result['tokens']} tokens in {result['wall_s']:.1f} s, "
                  f"{result['tokens_per_s']:.2f} tok/s, {result['tokens_per_step']:.3f} tokens/step, TTFT median "
                  f"{result['ttft_median_s']:.2f} s (p90 {result['ttft_p90_s']:.2f}, max {result['ttft_max_s']:.2f}), "
                  f"identical {result['identical_to_decode']}/{len(prompts)}, malformed {result['bad']['as_expected']}/"
                  f"{result['bad']['sent']} as expected, health {result['health_after']}", flush=True)
            return result

        rounds["serve"].append(serve(f"{args.clients} clients", args.clients, args.bad, True))
        serve(f"{args.clients} clients, 2nd pass", args.clients, 0, False)  # the suffix tree knows pass 1
        serve("1 client", 1, 0, True)
        for r in range(2, args.rounds + 1):  # more pairs, each from the same state: the machine's drift shows
            again = decode(f"decode {r}")
            report[f"decode {r}"]["identical_to_decode"] = sum(a == b for a, b in zip(again, texts))
            rounds["decode"].append(report[f"decode {r}"])
            rounds["serve"].append(serve(f"{args.clients} clients {r}", args.clients, 0, True))
    ratios = [s["tokens_per_s"] / d["tokens_per_s"] for s, d in zip(rounds["serve"], rounds["decode"])]
    total = (sum(s["tokens"] for s in rounds["serve"]) / sum(s["wall_s"] for s in rounds["serve"])) / \
            (sum(d["tokens"] for d in rounds["decode"]) / sum(d["wall_s"] for d in rounds["decode"]))
    report["ratios"] = {"per_round": ratios, "all_rounds": total}
    print(f"{args.clients} clients / decode, per round: {', '.join(f'{r:.2f}x' for r in ratios)}; "
          f"all rounds: {total:.2f}x", flush=True)
    Path(args.out).write_text(json.dumps(report, indent=1), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
