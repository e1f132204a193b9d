"""The prompt cache on a long chat: a ``--turns``-turn conversation through ``specfree serve``
(streaming ``openai`` client), each turn adding a user message of about ``--user-tokens`` tokens
and an answer of ``--max-tokens`` (EOS ignored), so each turn brings about their sum in new tokens.

    .venv/bin/python scripts/serve_cache.py [--turns 10] [--user-tokens 120] [--max-tokens 80]
        [--threads 2] [--rounds 2] [--out serve_cache.json] [OVERRIDE ...]

Passes, each ``--rounds`` times in turn, each from the same drafter state and an empty cache:
  cached     serve.prompt_cache=true: each turn prefills what follows the last turn's kept tokens
  uncached   the same server, every request ``cache_prompt: false`` (the whole prompt, in chunks)
  plain      serve.prompt_cache=false: the whole prompt in one prefill call (SDPA past 160 rows), as ``decode``
Reported per pass: the prefill time summed over the turns (the server's ``timings.prompt_ms``), the
time to first token of the last turn (client side), tokens prefilled, and whether every answer
equals the cached pass's.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

import openai
import torch

from specfree import Engine
from specfree.conf.schema import ServeConfig
from specfree.runinfo import cpu_info, cpu_name
from specfree.serve import create_app
from specfree.serve.state import suffix_drafter

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_load import Running  # noqa: E402


def user_messages(path: Path, turns: int, tokens: int, tokenizer) -> list[str]:
    """Spec-Bench questions, joined until each message holds about ``tokens`` tokens."""
    rows = [json.loads(line)["turns"][0] for line in path.read_text(encoding="utf-8").splitlines()]
    out, at = [], 0
    for _ in range(turns):
        text = ""
        while len(tokenizer(text).input_ids) < tokens:
            text += ("\n\n" if text else "") + rows[at % len(rows)]
            at += 1
        ids = tokenizer(text).input_ids[:tokens]
        out.append(tokenizer.decode(ids))
    return out


def conversation(url: str, messages_in: list[str], max_tokens: int, cache: bool) -> list[dict]:
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
    messages, turns = [], []
    for text in messages_in:
        messages.append({"role": "user", "content": text})
        sent, first, answer, timings, usage = time.perf_counter(), None, "", None, None
        stream = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=max_tokens,
                                                stream=True, stream_options={"include_usage": True},
                                                extra_body={"cache_prompt": cache, "specfree": {"ignore_eos": True}})
        for part in stream:
            if part.choices and part.choices[0].delta.content:
                first = first or time.perf_counter()
                answer += part.choices[0].delta.content
            if part.choices and part.choices[0].finish_reason:
                timings = part.model_extra["timings"]
            if part.usage:
                usage = part.usage
        turns.append({"ttft_s": first - sent, "prompt_ms": timings["prompt_ms"], "prompt_n": timings["prompt_n"],
                      "cache_n": timings["cache_n"], "prompt_tokens": usage.prompt_tokens,
                      "predicted_ms": timings["predicted_ms"], "answer": answer})
        messages.append({"role": "assistant", "content": answer})
    return turns


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", default="/work/shared/bench/spec_bench_questions.jsonl")
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--user-tokens", type=int, default=120)
    ap.add_argument("--max-tokens", type=int, default=80)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default="serve_cache.json")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    engine = Engine.from_config(overrides=["compile=false", *args.overrides])
    engine.generate("Say hello to the reader in one short sentence.", 16)  # warm-up: kernels, caches
    drafter = suffix_drafter(engine.strategy)
    pricing = copy.deepcopy(engine.pricer)
    messages = user_messages(Path(args.prompts), args.turns, args.user_tokens, engine.tokenizer)
    report = {"cpu": cpu_name(), "cpu_info": cpu_info(), "threads": args.threads, "turns": args.turns,
              "user_tokens": args.user_tokens, "max_tokens": args.max_tokens, "overrides": args.overrides,
              "passes": []}
    reference = None
    for round_ in range(args.rounds):
        for name, server_cache, request_cache in (("cached", True, True), ("uncached", True, False),
                                                  ("plain", False, False)):
            drafter.reset()
            engine.pricer = copy.deepcopy(pricing)
            engine.forget()
            app = create_app(engine, ServeConfig(max_tokens=1024, prompt_cache=server_cache), model_name="smollm2")
            with Running(app) as running:
                turns = conversation(running.url, messages, args.max_tokens, request_cache)
            answers = [t.pop("answer") for t in turns]
            reference = reference or answers
            result = {"pass": name, "round": round_, "prefill_s": sum(t["prompt_ms"] for t in turns) / 1000,
                      "prefilled_tokens": sum(t["prompt_n"] for t in turns),
                      "last_ttft_s": turns[-1]["ttft_s"], "last_prompt_ms": turns[-1]["prompt_ms"],
                      "last_prompt_tokens": turns[-1]["prompt_tokens"], "last_cache_n": turns[-1]["cache_n"],
                      "same_answers": answers == reference, "turns": turns}
            report["passes"].append(result)
            print(f"{name:8} round {round_}: prefill {result['prefill_s']:.2f} s over {result['prefilled_tokens']} "
                  f"tokens; turn {args.turns}: prompt {result['last_prompt_tokens']} tokens, "
                  f"{result['last_cache_n']} reused, prefill {result['last_prompt_ms'] / 1000:.3f} s, "
                  f"TTFT {result['last_ttft_s']:.3f} s; answers as the first pass: {result['same_answers']}",
                  flush=True)
    for name in ("cached", "uncached", "plain"):
        mine = [p for p in report["passes"] if p["pass"] == name]
        print(f"{name:8} median over rounds: prefill {statistics.median(p['prefill_s'] for p in mine):.2f} s, "
              f"turn-{args.turns} TTFT {statistics.median(p['last_ttft_s'] for p in mine):.3f} s")
    Path(args.out).write_text(json.dumps(report, indent=1))
    return 0 if all(p["same_answers"] for p in report["passes"]) else 1


if __name__ == "__main__":
    sys.exit(main())
