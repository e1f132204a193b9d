"""``bench.concurrency=K``: the run's prompts decoded K at a time (``Engine.generate_batch``) against
the same prompts one after another, per specfree system, in the same run.

Each side gets an engine of its own, fresh, over the system's adapter and cost curve: a drafter
that learns from past outputs (a suffix tree, a trie) would otherwise meet on the second pass the
answers of the first, and look faster for it. The sequential side runs first on every system, then
the batched side; both decode each prompt's first turn to ``max_new_tokens`` with EOS ignored, so
both emit the same number of tokens, and the outputs are compared token for token. Alone, prompts
are prefilled in the batch's 160-row chunks (``Engine.prompt_cache``, reusing nothing): a prompt
of more than 161 tokens prefilled in one SDPA call can differ in a last bit of its KV, so at a
near tie in a token (``docs/serve.md``, the prompt cache).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from specfree.bench.report import markdown_table
from specfree.types import Generation


def _side(generations: Sequence[Generation], seconds: float) -> dict[str, Any]:
    tokens = sum(len(g.tokens) for g in generations)
    steps = sum(len(g.steps) for g in generations)
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds if seconds else 0.0,
            "mean_accepted": tokens / steps if steps else 0.0}


def measure(make_engine: Callable[[], Any], label: str, prompts: Sequence[list[int]], max_new_tokens: int,
            concurrency: int) -> dict[str, Any]:
    """One system's row: the prompts (token ids) one after another, then ``concurrency`` at a time
    (fresh engines)."""
    alone_engine = make_engine()
    # A batch prefills in 160-row chunks through the row-exact operator; alone, that is the prompt
    # cache's prefill (here reusing nothing), so both sides compute every row the same way.
    alone_engine.prompt_cache = True
    start = time.perf_counter()
    alone = [alone_engine.generate(p, max_new_tokens, ignore_eos=True, cache_prompt=False)
             for p in prompts]
    alone_s = time.perf_counter() - start
    batch_engine = make_engine()
    start = time.perf_counter()
    together = batch_engine.generate_batch(list(prompts), max_new_tokens, max_batch=concurrency, ignore_eos=True)
    together_s = time.perf_counter() - start
    sequential, batched = _side(alone, alone_s), _side(together, together_s)
    return {"system": label, "concurrency": concurrency, "requests": len(prompts),
            "batched_together": batch_engine.batch_off is None, "why_not": batch_engine.batch_off,
            "sequential": sequential, "batched": batched,
            "speedup": batched["tokens_per_s"] / sequential["tokens_per_s"] if sequential["tokens_per_s"] else 0.0,
            "identical": sum(a.tokens == b.tokens for a, b in zip(alone, together))}


def section(rows: Sequence[dict[str, Any]]) -> str:
    """The report's table of the concurrency rows (Markdown; empty without rows)."""
    if not rows:
        return ""
    body = []
    for r in rows:
        s, b = r["sequential"], r["batched"]
        note = "" if r["batched_together"] else f" (one at a time: {r['why_not']})"
        body.append([f"{r['system']}{note}", f"{s['tokens_per_s']:.1f}", f"{b['tokens_per_s']:.1f}",
                     f"{r['speedup']:.2f}x", f"{s['mean_accepted']:.2f} / {b['mean_accepted']:.2f}",
                     f"{r['identical']}/{r['requests']}"])
    headers = ["system", "one after another tok/s", "together tok/s", "speedup", "tokens a step (alone / together)",
               "outputs identical"]
    title = f"## {rows[0]['requests']} requests, {rows[0]['concurrency']} at a time (bench.concurrency)"
    return f"{title}\n\n{markdown_table(headers, body, left=1)}\n"
