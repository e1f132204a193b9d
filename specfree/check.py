"""Check mode: rerun plain decoding and report where a speculative output first differs.

In fp32 the two agree token for token. In bf16/fp16, rows batched into one forward round
differently from single rows, so near-tied tokens can flip; this tells the user where.
"""

from __future__ import annotations

from dataclasses import dataclass

from specfree.strategies.autoregressive import Autoregressive
from specfree.types import Generation


@dataclass
class BaselineCheck:
    identical: bool
    first_divergence: int | None  # index into the new tokens
    speculative_token: int | None
    baseline_token: int | None
    baseline: Generation

    def describe(self, tokenizer=None) -> str:
        if self.identical:
            return f"identical to plain decoding ({len(self.baseline.tokens)} tokens)"
        show = (lambda t: repr(tokenizer.decode([t]))) if tokenizer is not None else str
        ours = "end of output" if self.speculative_token is None else show(self.speculative_token)
        theirs = "end of output" if self.baseline_token is None else show(self.baseline_token)
        return (f"differs from plain decoding at new token {self.first_divergence}: speculative gave {ours}, "
                f"plain gave {theirs} (batched rows round differently in low precision; use dtype=float32 "
                "for identical output)")


def check_against_baseline(engine, result: Generation, prompt, **generate_kwargs) -> BaselineCheck:
    """Decode ``prompt`` again with the same model and verifier but no drafts; compare tokens."""
    from specfree.engine import Engine

    plain = Engine(engine.adapter, Autoregressive(), engine.verifier, engine.tokenizer)
    baseline = plain.generate(prompt, **generate_kwargs)
    ours, theirs = result.tokens, baseline.tokens
    for i in range(max(len(ours), len(theirs))):
        a = ours[i] if i < len(ours) else None
        b = theirs[i] if i < len(theirs) else None
        if a != b:
            return BaselineCheck(False, i, a, b, baseline)
    return BaselineCheck(True, None, None, None, baseline)
