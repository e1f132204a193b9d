"""Concurrent streaming chat clients against any OpenAI-compatible server (``specfree serve``,
llama.cpp's ``llama-server``), the same prompts and settings for each: total throughput and time to
first token, so servers compare on one machine.

    .venv/bin/python scripts/serve_peers.py --url http://127.0.0.1:8000/v1 --label specfree \\
        [--prompts question.jsonl] [--per-task 2] [--clients 8] [--max-tokens 128] [--out peers.jsonl]

Greedy (temperature 0), every request streamed with usage; one JSON line a run is appended to --out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path

import openai

from specfree.bench.prompts import load_prompts
from specfree.runinfo import cpu_info


def prompts(path: Path, per_task: int) -> list[str]:
    """The first turn of the first ``per_task`` prompts of each of the file's own categories (MT-bench's
    eight each count), read by bench's loader."""
    taken: dict[str, list[str]] = {}
    for item in load_prompts(path):
        if len(texts := taken.setdefault(item.subcategory or item.category, [])) < per_task:
            texts.append(item.turns[0])
    return [text for texts in taken.values() for text in texts]


async def one(client: openai.AsyncOpenAI, text: str, max_tokens: int) -> dict:
    start, first, tokens = time.perf_counter(), None, 0
    stream = await client.chat.completions.create(
        model="any", messages=[{"role": "user", "content": text}], max_tokens=max_tokens, temperature=0,
        stream=True, stream_options={"include_usage": True})
    async for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].delta.content:
            first = time.perf_counter() - start
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    return {"ttft_s": first if first is not None else time.perf_counter() - start,
            "tokens": tokens, "s": time.perf_counter() - start}


async def run(url: str, texts: list[str], clients: int, max_tokens: int) -> dict:
    client = openai.AsyncOpenAI(base_url=url, api_key="none", timeout=3600)
    queue = list(texts)
    results: list[dict] = []

    async def worker() -> None:
        while queue:
            results.append(await one(client, queue.pop(0), max_tokens))

    await one(client, "Hi", 4)  # a warm-up request, not counted
    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(clients)))
    wall = time.perf_counter() - start
    ttft = sorted(r["ttft_s"] for r in results)
    tokens = sum(r["tokens"] for r in results)
    return {"requests": len(results), "clients": clients, "completion_tokens": tokens, "wall_s": round(wall, 2),
            "tokens_per_s": round(tokens / wall, 2), "ttft_p50_s": round(statistics.median(ttft), 3),
            "ttft_p90_s": round(ttft[min(len(ttft) - 1, int(0.9 * len(ttft)))], 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", required=True)
    ap.add_argument("--label", required=True)
    ap.add_argument("--prompts", default="../shared/bench/spec_bench_questions.jsonl")
    ap.add_argument("--per-task", type=int, default=2)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--out", default="serve_peers.jsonl")
    args = ap.parse_args()
    texts = prompts(Path(args.prompts), args.per_task)
    result = {"label": args.label, "cpu": cpu_info(), "max_tokens": args.max_tokens,
              **asyncio.run(run(args.url, texts, args.clients, args.max_tokens))}
    print(json.dumps(result))
    with open(args.out, "a", encoding="utf-8") as f:
        f.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
