"""Mask time per token on SmolLM2's 49,152-token vocabulary: llguidance against xgrammar, each on
the JSON-schema tasks' schemas with the same fixed layout (", " and ": "), walking each grammar
with seeded random allowed tokens (the mask is computed, a token drawn from it, consumed).

xgrammar is not a dependency (it needs torch and triton): install it apart to compare, e.g.
``pip install --no-deps --target /tmp/xg xgrammar apache-tvm-ffi`` and ``PYTHONPATH=.:/tmp/xg``.

    PYTHONPATH=. python benchmarks/mask_time.py --tasks 8 --tokens 64
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks.json_schema_bench import TASKS, cpu_name, load_tasks


def walk(mask_of, consume, vocab: int, tokens: int, rng: random.Random, eos: int) -> tuple[float, int]:
    """Seconds spent computing masks and consuming, over at most ``tokens`` tokens of a random walk."""
    spent, made = 0.0, 0
    for _ in range(tokens):
        start = time.perf_counter()
        allowed = mask_of()
        spent += time.perf_counter() - start
        choices = [t for t in np.flatnonzero(allowed[:vocab]).tolist() if t != eos]
        if not choices:
            break
        token = rng.choice(choices)
        start = time.perf_counter()
        consume(token)
        spent += time.perf_counter() - start
        made += 1
    return spent, made


def llguidance_walks(tokenizer, vocab: int, schemas: list[dict], tokens: int, eos: int) -> tuple[float, int]:
    from specfree.constraints import Constraint, Grammars

    grammars = Grammars(tokenizer, vocab, {eos})
    total, made = 0.0, 0
    for i, schema in enumerate(schemas):
        matcher = grammars.matcher(Constraint.from_options(json_schema=schema))
        done: list[int] = []

        def consume(token: int) -> None:
            done.append(token)
            matcher.follow(done)

        spent, n = walk(lambda: matcher.allowed().numpy(), consume, vocab, tokens, random.Random(i), eos)
        total, made = total + spent, made + n
    return total, made


def xgrammar_walks(tokenizer, vocab: int, schemas: list[dict], tokens: int, eos: int) -> tuple[float, int]:
    import xgrammar as xgr

    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab))
    total, made = 0.0, 0
    for i, schema in enumerate(schemas):
        matcher = xgr.GrammarMatcher(compiler.compile_json_schema(json.dumps(schema), any_whitespace=False,
                                                                  separators=(", ", ": ")))
        bitmask = xgr.allocate_token_bitmask(1, vocab)

        def mask_of() -> np.ndarray:
            matcher.fill_next_token_bitmask(bitmask)
            return np.unpackbits(bitmask.numpy().view(np.uint8), bitorder="little")

        spent, n = walk(mask_of, matcher.accept_token, vocab, tokens, random.Random(i), eos)
        total, made = total + spent, made + n
    return total, made


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--task-file", type=Path, default=TASKS)
    args = parser.parse_args()
    torch.set_num_threads(1)
    from specfree.loading import load_model

    _, tokenizer = load_model("smollm2")
    vocab, eos = 49152, tokenizer.eos_token_id
    schemas = [t["schema"] for t in load_tasks(args.task_file, args.tasks)]
    rows = {"cpu": cpu_name()}
    for name, run in (("llguidance", llguidance_walks), ("xgrammar", xgrammar_walks)):
        try:
            spent, made = run(tokenizer, vocab, schemas, args.tokens, eos)
        except ImportError as exc:
            rows[name] = f"skipped: {exc}"
            continue
        rows[name] = {"tokens": made, "ms_per_token": round(1e3 * spent / max(1, made), 3)}
    print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
