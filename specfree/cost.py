"""What a forward costs as a function of its rows, measured once per model/device and cached.

On a CPU the price of a step is its row count: one row is a memory-bound matrix-vector pass,
two rows already switch to slower matrix-matrix kernels, and from there rows are cheap until
compute dominates. Strategies that size their drafts from this curve spend rows only where
the expected accepted tokens pay for them.

The price of a row also grows with the context: each row attends to every committed token, so on
a 2-core Zen 3 CPU, compiled, 8 rows cost 1.35x one row at 256 tokens of context and 1.65x at 1536
(docs/bench/history.md#runs-s-and-t-pricing-at-each-steps-context-and-a-calibrated-prior-on-zen-3-2026-11-26).
The curve is measured at two contexts and priced at each step's own (``at``), linear in the
context between and beyond them, as attention is.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from specfree.files import fingerprint, write_atomic
from specfree.kernels import kernel_dir, linear_path
from specfree.timing import clock

SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
CONTEXTS = (256, 1024)  # the two contexts the curve is measured at
CHECK_ROWS = 8  # a cached curve's shape is checked at one row against this many,
CHECK_REPEATS = 5  # best of this many rounds each
# Measurements minutes apart on a 2-core Zen 3 VM put t(8)/t(1) at 1.63-1.75 (one at 1.35); the
# stale curve this check was written for said 1.21.
SHAPE_TOLERANCE = 0.2


class CostModel:
    """Seconds of a forward by its rows, at ``context`` tokens of context; ``growth`` (seconds per
    context token, by rows; None: the context is not priced) gives the curve at any other context."""

    def __init__(self, rows: list[int], seconds: list[float], context: int = CONTEXTS[0],
                 growth: list[float] | None = None):
        order = np.argsort(rows)
        self.rows = np.asarray(rows, dtype=np.float64)[order]
        # A forward never gets cheaper with more rows; smooth measurement noise accordingly.
        self.seconds = np.maximum.accumulate(np.asarray(seconds, dtype=np.float64)[order])
        self.context = int(context)
        # Nor does a row's share of a longer context: each row attends to all of it.
        self.growth = None if growth is None else np.maximum.accumulate(
            np.maximum(0.0, np.asarray(growth, dtype=np.float64)[order]))

    def at(self, context: int) -> "CostModel":
        """The curve at ``context`` tokens of context (this curve, where the context is not priced)."""
        if self.growth is None or context == self.context:
            return self
        seconds = np.maximum(self.seconds + self.growth * (context - self.context), 0.1 * self.seconds)
        return CostModel(self.rows, seconds, context, self.growth)

    def __call__(self, rows: int) -> float:
        return float(self.many(np.array([rows]))[0])

    def many(self, rows: np.ndarray) -> np.ndarray:
        """``self(r)`` for every r of ``rows`` at once (pricing asks for a whole range each step)."""
        rows = np.asarray(rows, dtype=np.float64)
        out = np.interp(rows, self.rows, self.seconds)
        beyond = rows > self.rows[-1]
        if beyond.any():  # extrapolate linearly from the last two points
            slope = (self.seconds[-1] - self.seconds[-2]) / max(1.0, self.rows[-1] - self.rows[-2])
            out[beyond] = self.seconds[-1] + slope * (rows[beyond] - self.rows[-1])
        return out

    def observe(self, rows: int, seconds: float, weight: float = 0.1, context: int | None = None) -> None:
        """Fold a real step's forward time (at ``context``, default this curve's) into the nearest
        measured size (machines drift)."""
        i = int(np.abs(self.rows - rows).argmin())
        if self.rows[i] == rows:
            if context is not None and self.growth is not None:
                seconds -= self.growth[i] * (context - self.context)  # as if at this curve's context
            self.seconds[i] += weight * (seconds - self.seconds[i])
            self.seconds = np.maximum.accumulate(self.seconds)

    def as_dict(self) -> dict:
        out = {"rows": self.rows.astype(int).tolist(), "seconds": self.seconds.tolist(), "context": self.context}
        return out if self.growth is None else {**out, "growth": self.growth.tolist()}

    @classmethod
    def from_dict(cls, data: dict) -> "CostModel":
        return cls(data["rows"], data["seconds"], data.get("context", CONTEXTS[0]), data.get("growth"))

    @classmethod
    @torch.inference_mode()
    def measure(cls, adapter, context: int = CONTEXTS[0], sizes=SIZES, repeats: int = 5,
                longer: int | None = CONTEXTS[1]) -> "CostModel":
        """Time forwards of ``sizes`` rows after a ``context``-token prefix (best of ``repeats``), and
        again after ``longer`` tokens (None: the context is not priced) for the curve's growth.

        The sizes take turns, round after round, so a slow spell of a shared machine slows every
        size alike instead of bending the curve.
        """
        sizes = list(sizes)
        # Each timed forward leaves one row in the cache: a short-context model measures fewer sizes.
        while len(sizes) > 2 and _room(adapter, sizes, repeats) < 1:
            sizes.pop(sizes.index(max(sizes)))
        room = _room(adapter, sizes, repeats)
        context = max(1, min(context, room))
        seconds = _time_sizes(adapter, context, sizes, repeats)
        longer = None if longer is None else min(longer, room)
        if longer is None or longer < context + 64:  # too short a model to tell the growth apart
            return cls(sizes, seconds, context)
        slower = _time_sizes(adapter, longer, sizes, repeats)
        growth = [(b - a) / (longer - context) for a, b in zip(seconds, slower)]
        return cls(sizes, seconds, context, growth)

    @classmethod
    def cached(cls, adapter, cache_dir: Path) -> "CostModel":
        """Measure once per (model, device, dtype, threads, kernels); later engines read the file,
        after a check that its shape still holds here (``holds``), and measure again if not."""
        model = adapter.model
        params = sum(p.numel() for p in model.parameters())
        # The layer classes name the kernels (few-row linears, fused norms, ...), whichever were swapped in.
        classes = {type(m) for m in model.modules()}
        layers = sorted(f"{c.__module__}.{c.__qualname__}" for c in classes)
        # The KV layers, and the compiled path's own curve: padded buckets, Inductor's kernels; and
        # the build of specfree's ops (a faster kernel is a new curve, or pricing keeps the old one).
        setup = [model.config.model_type, params, str(adapter.device), str(adapter.dtype), torch.get_num_threads(),
                 torch.__version__, model.config._attn_implementation, layers, linear_path(model),
                 kernel_dir().name, CONTEXTS, *adapter.cost_setup()]
        path = Path(cache_dir) / "costs" / f"{fingerprint(setup)}.json"
        if path.is_file():
            try:
                cached = cls.from_dict(json.loads(path.read_text()))
            except (ValueError, KeyError):
                cached = None  # a damaged cache file is simply measured again
            if cached is not None and cached.holds(adapter):
                return cached
        costs = cls.measure(adapter)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, json.dumps(costs.as_dict()))
        return costs

    def holds(self, adapter, tolerance: float = SHAPE_TOLERANCE) -> bool:
        """Whether the curve's shape still holds here: one row against the largest size up to 8,
        timed now, at most ``tolerance`` off the curve's ratio of the two. Pricing reads only the
        shape (a machine's overall drift scales every size alike); a curve measured during a slow
        or fast spell, or on other hardware, can be off by 40% at 8 rows and then over- or
        under-drafts every step (runs AA and AB:
        docs/bench/history.md#runs-aa-and-ab-a-stale-cost-curve-found-checked-on-read-and-one-curve-per-bench-zen-3-2026-11-26)."""
        big = int(max((r for r in self.rows if r <= CHECK_ROWS), default=1))
        room = _room(adapter, [1, big], CHECK_REPEATS)
        if big == 1 or room < 1:
            return True
        one, many = _time_sizes(adapter, max(1, min(self.context, room)), [1, big], CHECK_REPEATS)
        return abs((many / one) / (self(big) / self(1)) - 1) <= tolerance


def _room(adapter, sizes: list[int], repeats: int) -> int:
    """Context tokens that can precede a timing of ``sizes`` over ``repeats`` rounds and a warm-up
    (each timed forward leaves one row in the cache)."""
    return adapter.max_length - max(sizes) - (repeats + 1) * len(sizes) - 2


def _time_sizes(adapter, context: int, sizes: list[int], repeats: int) -> list[float]:
    """Best-of-``repeats`` seconds of a forward of each of ``sizes`` rows after ``context`` tokens."""
    generator = torch.Generator().manual_seed(0)
    vocab = adapter.vocab_size
    adapter.reset()
    adapter.prefill(torch.randint(0, vocab, (context,), generator=generator))
    inputs = [(torch.randint(0, vocab, (k,), generator=generator), torch.ones(k, k, dtype=torch.bool).tril())
              for k in sizes]
    best = [float("inf")] * len(sizes)
    for round_ in range(repeats + 1):  # round 0 warms the kernels up
        for i, (tokens, allowed) in enumerate(inputs):
            start = clock(adapter.device)
            adapter.forward(tokens, None if len(tokens) == 1 else allowed)
            if round_:
                best[i] = min(best[i], clock(adapter.device) - start)
            adapter.commit([0], rows=len(tokens))  # keep one row: the context barely grows
    adapter.reset()
    return best
