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

Measuring the whole curve costs dozens of forwards: 43 s on a tiny Falcon-H1 whose multi-row
forwards run transformers' chunked Mamba-2 scan (each ~100x its one-row step), several seconds of
a 1B model's first request. So a model seen for the first time gets a quick curve (``quick``): the
one-row forward, then the row counts the first steps ask for, as many as fit a budget of
``BUDGET`` one-row forwards, at one short context (and a second one only where the budget still
allows, else at the next engine's build: ``grow``); the engine then learns every other row count
from its own steps (``learner``) and keeps what it learns in the same cache file. A row count not
yet timed is priced between its neighbours, or beyond the last one along the last two's slope,
never below ``MIN_SLOPE`` of a one-row forward per row: never free.
"""

from __future__ import annotations

import json
import sys
import time
from collections import defaultdict, deque
from pathlib import Path

import numpy as np
import torch

from specfree.files import fingerprint, write_atomic
from specfree.kernels import kernel_dir, linear_path
from specfree.timing import clock

SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
CONTEXTS = (256, 1024)  # the two contexts the whole curve is measured at
QUICK_SIZES = (1, 2, 4, 8, 16)  # a first curve's row counts, in this order while the budget lasts
QUICK_CONTEXT = 64  # the context a first curve is measured at (a second one, CONTEXTS[0], if the budget allows)
BUDGET = 16.0  # a first curve (or a cached curve's check) costs about this many one-row forwards at most
LEARN_SAMPLES = 3  # a row count the engine runs joins the curve at the best of its first this many times
MIN_SLOPE = 1 / 64  # beyond its last point the curve grows at least this many one-row forwards per row
NOTICE_S = 1.0  # a first curve expected to take this long or more says so on stderr
CHECK_ROWS = 8  # a cached curve's shape is checked at one row against this many,
CHECK_REPEATS = 2  # best of this many rounds each, after one to warm up
# Measurements minutes apart on a 2-core Zen 3 VM put t(8)/t(1) at 1.63-1.75 (one at 1.35); the
# stale curve this check was written for said 1.21.
SHAPE_TOLERANCE = 0.2


class CostModel:
    """Seconds of a forward by its rows, at ``context`` tokens of context; ``growth`` (seconds per
    context token, by rows; None: the context is not priced) gives the curve at any other context."""

    path: Path | None = None  # the cache file a curve from ``cached`` is kept in

    def __init__(self, rows: list[int], seconds: list[float], context: int = CONTEXTS[0],
                 growth: list[float] | None = None):
        order = np.argsort(rows)
        self.rows = np.asarray(rows, dtype=np.float64)[order]
        self.seconds = never_falls(np.asarray(seconds, dtype=np.float64)[order])
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

    def snapshot(self) -> "CostModel":
        """A copy of the curve as it is now (what learning moves: its points and growth)."""
        return CostModel(self.rows.copy(), self.seconds.copy(), self.context,
                         None if self.growth is None else self.growth.copy())

    def same_as(self, other: "CostModel") -> bool:
        """Whether ``other`` has this curve's points, context and growth."""
        same_growth = (self.growth is None and other.growth is None) or (
            self.growth is not None and other.growth is not None and np.array_equal(self.growth, other.growth))
        return (self.context == other.context and same_growth and np.array_equal(self.rows, other.rows)
                and np.array_equal(self.seconds, other.seconds))

    def many(self, rows: np.ndarray) -> np.ndarray:
        """``self(r)`` for every r of ``rows`` at once (pricing asks for a whole range each step)."""
        rows = np.asarray(rows, dtype=np.float64)
        out = np.interp(rows, self.rows, self.seconds)
        beyond = rows > self.rows[-1]
        if beyond.any():  # extrapolate linearly from the last two points, never for free
            slope = 0.0 if len(self.rows) < 2 else \
                (self.seconds[-1] - self.seconds[-2]) / max(1.0, self.rows[-1] - self.rows[-2])
            slope = max(slope, MIN_SLOPE * self.seconds[0])
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
            self.seconds = never_falls(self.seconds)

    def add(self, rows: int, seconds: float, context: int | None = None) -> None:
        """A new point: ``rows`` rows took ``seconds`` at ``context`` (default this curve's), its
        growth with the context taken between its neighbours' (the context priced as before)."""
        growth = None if self.growth is None else float(np.interp(rows, self.rows, self.growth))
        if context is not None and growth is not None:
            seconds -= growth * (context - self.context)  # as if at this curve's context
        order = np.argsort([*self.rows, rows], kind="stable")
        self.rows = np.asarray([*self.rows, rows], dtype=np.float64)[order]
        self.seconds = never_falls(np.asarray([*self.seconds, max(seconds, 0.0)])[order])
        if self.growth is not None:
            self.growth = np.maximum.accumulate(np.asarray([*self.growth, growth])[order])

    def learner(self, adapt: bool = False) -> "Learner":
        """What the engine feeds its steps' forward times to, so this curve learns the row counts it
        has no point for (kept in its cache file, ``path``, as they are learned); ``adapt``: its
        points also follow the times, as ``observe`` does."""
        return Learner(self, adapt)

    def as_dict(self) -> dict:
        out = {"rows": self.rows.astype(int).tolist(), "seconds": self.seconds.tolist(), "context": self.context}
        return out if self.growth is None else {**out, "growth": self.growth.tolist()}

    @classmethod
    def from_dict(cls, data: dict) -> "CostModel":
        return cls(data["rows"], data["seconds"], data.get("context", CONTEXTS[0]), data.get("growth"))

    @classmethod
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
    def quick(cls, adapter, budget: float = BUDGET, sizes=QUICK_SIZES, context: int = QUICK_CONTEXT,
              longer: int | None = CONTEXTS[0]) -> "CostModel":
        """A first curve at a bounded price: after a ``context``-token prefix, the one-row forward
        (best of two, after one to warm up), then each of ``sizes`` (best of two), in order, while
        the time spent stays within ``budget`` one-row forwards, prefix included; then, if less
        than a third of the budget is spent, the same sizes after ``longer`` tokens for the curve's
        growth. The first two sizes are measured whatever the budget.
        A model whose forward cost climbs steeply (tiny Falcon-H1: 10 ms for one row, 1.1 s for two)
        gets two points and learns the rest as its steps run them."""
        sizes = [1, *(k for k in sizes if k != 1)]
        while len(sizes) > 2 and _room(adapter, sizes, 2) < 1:
            sizes.pop()
        room = _room(adapter, sizes, 2)
        context = max(1, min(context, room))
        start = time.perf_counter()
        seconds = _time_sizes(adapter, context, sizes, repeats=2, budget=budget)
        sizes = sizes[: len(seconds)]
        spent = time.perf_counter() - start
        longer = None if longer is None else min(longer, room)
        if longer is None or longer < context + 64 or spent > budget * seconds[0] / 3:
            return cls(sizes, seconds, context)
        slower = _time_sizes(adapter, longer, sizes, repeats=2)
        growth = [(b - a) / (longer - context) for a, b in zip(seconds, slower)]
        return cls(sizes, seconds, context, growth)

    @classmethod
    def cached(cls, adapter, cache_dir: Path) -> "CostModel":
        """Measure once per (model, device, dtype, threads, kernels): a quick curve (``quick``);
        later engines read the file, after a check that its shape still holds here (``holds``), and
        measure again if not; the next one measures the growth a quick curve lacks (``grow``). What
        the engine's steps teach the curve (``learner``) goes to the file too."""
        setup = [*adapter.cost_identity(), *adapter.cost_setup()]
        path = Path(cache_dir) / "costs" / f"{fingerprint(setup)}.json"
        if path.is_file():
            try:
                cached = cls.from_dict(json.loads(path.read_text()))
            except (ValueError, KeyError):
                cached = None  # a damaged cache file is simply measured again
            if cached is not None and cached.holds(adapter):
                cached.path = path
                if cached.grow(adapter):
                    write_atomic(path, json.dumps(cached.as_dict()))
                return cached
        costs = cls.quick(adapter)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, json.dumps(costs.as_dict()))
        costs.path = path
        return costs

    def grow(self, adapter, budget: float = BUDGET, longer: int = CONTEXTS[0]) -> bool:
        """Measure the growth with the context that a quick curve had no budget left for (most real
        models: the first context's sizes take it all), at a later engine's build, for about one more
        budget: the curve's sizes up to ``QUICK_SIZES[-1]`` at its context (within half the budget,
        two at least), then the same after ``longer`` tokens; a row count not measured takes its
        neighbours' growth. Not where the curve has one, the model's context is too short, or the
        curve says these rounds cost more than the budget (steep multi-row costs). Whether it grew."""
        sizes = [int(r) for r in self.rows if r <= QUICK_SIZES[-1]]
        room = _room(adapter, sizes, 2)
        longer = min(longer, room)
        if self.growth is not None or len(sizes) < 2 or longer < self.context + 64 or \
                2 * (CHECK_REPEATS + 1) * (self(1) + self(sizes[1])) > budget * self(1):
            return False
        short = _time_sizes(adapter, max(1, min(self.context, room)), sizes, 2, budget=budget / 2)
        sizes = sizes[: len(short)]
        slower = _time_sizes(adapter, longer, sizes, 2)
        measured = [(b - a) / (longer - self.context) for a, b in zip(short, slower)]
        self.growth = np.maximum.accumulate(np.maximum(0.0, np.interp(self.rows, sizes, measured)))
        return True

    def holds(self, adapter, tolerance: float = SHAPE_TOLERANCE) -> bool:
        """Whether the curve's shape still holds here: one row against the largest size up to 8,
        timed now, at most ``tolerance`` off the curve's ratio of the two. Pricing reads only the
        shape (a machine's overall drift scales every size alike); a curve measured during a slow
        or fast spell, or on other hardware, can be off by 40% at 8 rows and then over- or
        under-drafts every step (runs AA and AB:
        docs/bench/history.md#runs-aa-and-ab-a-stale-cost-curve-found-checked-on-read-and-one-curve-per-bench-zen-3-2026-11-26)."""
        big = int(max((r for r in self.rows if r <= CHECK_ROWS), default=1))
        room = _room(adapter, [1, big], CHECK_REPEATS)
        # Rounds the curve says cost more than a first curve's budget are not run: such a curve is
        # taken as it is (tiny Falcon-H1's 8 rows cost ~100 one-row forwards).
        price = (CHECK_REPEATS + 1) * (self(1) + self(big))
        if big == 1 or room < 1 or price > BUDGET * self(1):
            return True
        one, many = _time_sizes(adapter, max(1, min(self.context, room)), [1, big], CHECK_REPEATS)
        return abs((many / one) / (self(big) / self(1)) - 1) <= tolerance

    @classmethod
    def from_step_times(cls, medians: dict[int, float], prior_slope: float, min_sizes: int = 2) -> "CostModel":
        """A step's cost from timed steps (``medians``: seconds by the tokens a step verified).

        Until ``min_sizes`` token counts are timed, each token costs ``prior_slope`` of a one-token
        step, anchored on the one count timed so far (1 s with none), linear beyond. Past that, the
        medians, extended below the fewest tokens timed by the slope of the first two (interpolation
        would hold the curve flat there: those tokens free).
        """
        sizes = sorted(medians)
        times = [medians[n] for n in sizes]
        if len(sizes) < max(2, min_sizes):
            at, anchor = (sizes[0], times[0]) if sizes else (1, 1.0)
            one = anchor / (1 + prior_slope * (at - 1))
            sizes, times = [1, 2], [one, one * (1 + prior_slope)]  # linear beyond
        elif sizes[0] > 1:
            slope = (times[1] - times[0]) / (sizes[1] - sizes[0])
            sizes, times = [1, *sizes], [max(times[0] - slope * (sizes[0] - 1), 0.5 * times[0]), *times]
        return cls(sizes, times)


def prices(curve, rows: np.ndarray) -> np.ndarray:
    """``curve`` (any function of a row count) at each of ``rows``, at once where it can (``many``)."""
    many = getattr(curve, "many", None)
    return many(rows) if many is not None else np.array([curve(int(r)) for r in rows], dtype=np.float64)


def never_falls(seconds: np.ndarray) -> np.ndarray:
    """A forward never gets cheaper with more rows: each point (by rows) at most the cheapest one
    above it. Points are best-of timings, so noise makes one too dear (a stall), rarely too cheap;
    lifting every point above a dear one instead (a running maximum) let one stall at two rows price
    every count above it at 27x one row on a loaded VM, in the cache file for good."""
    return np.minimum.accumulate(seconds[::-1])[::-1].copy()


def _room(adapter, sizes: list[int], repeats: int) -> int:
    """Context tokens that can precede a timing of ``sizes`` over ``repeats`` rounds and a warm-up
    (each timed forward leaves one row in the cache)."""
    return adapter.max_length - max(sizes) - (repeats + 1) * len(sizes) - 2


def _time_sizes(adapter, context: int, sizes: list[int], repeats: int, budget: float | None = None) -> list[float]:
    """Best-of-``repeats`` seconds of a forward of each of ``sizes`` rows after ``context`` tokens.

    ``budget``: the sizes are measured one after another instead (``repeats`` rounds each, after one
    to warm up the first), and none is started once the time since the prefix began passes ``budget``
    one-row forwards (the first size's time): the sizes measured are returned. Where that may take
    noticeable time, one line on stderr says so, with an estimate."""
    generator = torch.Generator().manual_seed(0)
    vocab = adapter.vocab_size
    adapter.reset()
    start = time.perf_counter()
    adapter.prefill(torch.randint(0, vocab, (context,), generator=generator))
    prefix_s = time.perf_counter() - start
    inputs = [(torch.randint(0, vocab, (k,), generator=generator), torch.ones(k, k, dtype=torch.bool).tril())
              for k in sizes]

    def timed(tokens, allowed) -> float:
        begin = clock(adapter.device)
        adapter.forward(tokens, None if len(tokens) == 1 else allowed)
        seconds = clock(adapter.device) - begin
        adapter.commit([0], rows=len(tokens))  # keep one row: the context barely grows
        return seconds

    if budget is not None:
        best: list[float] = []
        for i, (tokens, allowed) in enumerate(inputs):
            rounds: list[float] = []
            for _ in range(repeats + (i == 0)):
                if i > 1 and time.perf_counter() - start > budget * best[0]:
                    break  # past the budget (the first two sizes are always measured)
                rounds.append(timed(tokens, allowed))
            if not rounds:
                break
            best.append(min(rounds[-repeats:]))  # the first size leaves its warm-up round out
            if i == 0 and len(sizes) > 1:  # the rest: the budget's remainder, and one forward past it
                left = max(0.0, budget * best[0] - (time.perf_counter() - start)) + prefix_s
                if left >= NOTICE_S:
                    print(f"specfree: timing this model's forwards to price drafts (once per model and machine, "
                          f"about {left:.0f} s)", file=sys.stderr, flush=True)
        adapter.reset()
        return best
    best = [float("inf")] * len(sizes)
    for round_ in range(repeats + 1):  # round 0 warms the kernels up
        for i, (tokens, allowed) in enumerate(inputs):
            seconds = timed(tokens, allowed)
            if round_:
                best[i] = min(best[i], seconds)
    adapter.reset()
    return best


class Learner:
    """Feeds a curve (``CostModel.learner``) the engine's steps: each row count the curve has no point
    for becomes one, at the best of its first ``LEARN_SAMPLES`` forward times (at the curve's context,
    where its growth is known), written to the curve's cache file. Points already there stay as they
    are (``adapt_costs`` moves them): once every row count a model's steps use is learned, its
    pricing is as steady as a measured curve's."""

    def __init__(self, curve: CostModel, adapt: bool = False):
        self.curve, self.adapt = curve, adapt
        self.samples: dict[int, list[tuple[float, int | None]]] = defaultdict(list)

    def observe(self, rows: int, seconds: float, weight: float = 0.1, context: int | None = None) -> None:
        if rows in self.curve.rows:
            if self.adapt:
                self.curve.observe(rows, seconds, weight, context)
            return
        samples = self.samples[rows]
        samples.append((seconds, context))
        if len(samples) < LEARN_SAMPLES:
            return
        best, at = min(samples, key=lambda sample: sample[0])
        self.curve.add(rows, best, at)
        del self.samples[rows]
        if self.curve.path is not None:
            try:
                write_atomic(self.curve.path, json.dumps(self.curve.as_dict()))
            except OSError:
                pass  # a read-only cache: the next engine learns it again


class StepTimes:
    """A step's cost where specfree runs no forward of its own (inside vLLM): learned from the wall
    time between calls, as ``CostModel.from_step_times`` reads it.

    Only clean steps are timed (inside vLLM: decode steps whose rows all continued from the step
    before; a new request's prefill, or the idle time between ``generate`` calls, would read as a
    slow step). Each token count keeps its last ``window`` times; the curve is their medians, once
    ``min_sizes`` counts have ``min_samples`` each. Until then each token costs ``prior_slope`` of a
    one-token step (vLLM's CPU runner: 2-4 ms on a 55-65 ms step). Pricing every draft as free
    instead made the four rows of a batch send full chains every step, so no second count was ever
    timed.
    """

    def __init__(self, window: int = 16, min_samples: int = 3, min_sizes: int = 2, prior_slope: float = 0.03):
        self.window, self.min_samples, self.min_sizes = window, min_samples, min_sizes
        self.prior_slope = prior_slope
        self.samples: defaultdict[int, deque[float]] = defaultdict(lambda: deque(maxlen=window))
        self.medians: dict[int, float] = {}  # token counts with min_samples times: their median
        self._curve: CostModel | None = None  # built from the medians when one of them changes
        self.tokens: int | None = None  # what the step now running verifies
        self.since = 0.0

    def started(self, tokens: int, now: float) -> None:
        """A step of ``tokens`` tokens starts."""
        self.tokens, self.since = tokens, now

    def finished(self, now: float, timed: bool) -> None:
        """That step is over; ``timed``: it was a clean step."""
        if self.tokens is not None and timed:
            times = self.samples[self.tokens]
            times.append(now - self.since)
            if len(times) >= self.min_samples:  # one median changes a step, not every one of them
                self.medians[self.tokens] = float(np.median(times))
                self._curve = None
        self.tokens = None

    def curve(self) -> CostModel:
        if self._curve is None:
            self._curve = CostModel.from_step_times(self.medians, self.prior_slope, self.min_sizes)
        return self._curve


class Correction:
    """What a curve's price of each row count turned out to be on this machine, now: per row count,
    measured over predicted forward seconds. A count's first ``samples`` steps set it (their median:
    one stall of a shared machine is one of them); later steps move it by a moving average (each
    step's ratio clipped to ``clip``x either way). A count not yet set takes its set neighbours'
    correction (the nearest's beyond them); with none set, the curve as it is.

    The curve is measured once, at start-up, as the best of a few forwards of each size, a few sizes
    (the rest extrapolated or learned later); the steps then run on a machine that may be busier or
    quieter, with the compiled path's padded buckets. A start-up curve taken in a slow spell can
    price two rows at thirty times one (seen on a loaded 2-core VM): no step would ever run two rows
    again to show otherwise. So, once one row's price is set, a count not yet set is priced at most
    ``optimism`` of a one-row forward per extra row, up to twice the most rows set so far (so trees
    grow into untried sizes step by step: a jump to 27 rows, tried three times, cost a loaded VM
    several hundred milliseconds), and the planner tries it where it pays at that price, until its
    own times set it; nor dearer than the counts set cost along their slope (``Corrected._run``:
    a stalled point, or one learned at a longer context, would otherwise price every count past it
    out of reach). Half a one-row forward a row is far below a stalled point's price and above
    what a CPU's rows cost (a fifth to a quarter); at a sixteenth, a hybrid ran three steps at each
    count up to twice its largest, each at twice its price
    (docs/bench/history.md#the-price-of-a-row-count-not-yet-run-issue-82-intel-xeon-2026-12-03). An
    average of ratios, not of logs: tokens a second divide by the mean time."""

    def __init__(self, weight: float = 0.2, clip: float = 3.0, samples: int = 3, optimism: float = 1 / 2):
        self.weight, self.clip, self.samples, self.optimism = weight, clip, samples, optimism
        self.ratio: dict[int, float] = {}  # the counts set
        self.trying: dict[int, list[float]] = defaultdict(list)  # the first ratios of the counts not yet set
        self._table: tuple[np.ndarray, np.ndarray] | None = None  # ratio as sorted arrays

    def observe(self, rows: int, seconds: float, predicted: float) -> None:
        if seconds <= 0 or predicted <= 0:
            return
        ratio = seconds / predicted
        old = self.ratio.get(rows)
        if old is not None:
            ratio = min(self.clip * old, max(old / self.clip, ratio))
            self.ratio[rows] = old + self.weight * (ratio - old)
        else:
            first = self.trying[rows]
            first.append(ratio)
            if len(first) < self.samples:
                return
            self.ratio[rows] = float(np.median(first))
            del self.trying[rows]
        self._table = None

    def counts(self) -> np.ndarray:
        """The row counts with a ratio, set or being set."""
        return np.asarray(sorted({*self.ratio, *self.trying}), dtype=np.float64)

    def rebase(self, counts: np.ndarray, factors: np.ndarray) -> None:
        """Each count's ratio (and first ratios) times its factor: the curve under it moved by
        1 / factor there."""
        for count, factor in zip(counts.astype(int).tolist(), factors.tolist()):
            if factor == 1.0 or not np.isfinite(factor) or factor <= 0:
                continue
            if count in self.ratio:
                self.ratio[count] *= factor
            if count in self.trying:
                self.trying[count] = [r * factor for r in self.trying[count]]
        self._table = None

    def factors(self, rows: np.ndarray) -> np.ndarray:
        if not self.ratio:
            return np.ones(len(rows))
        if self._table is None:
            keys = sorted(self.ratio)
            self._table = np.asarray(keys, dtype=np.float64), np.asarray([self.ratio[k] for k in keys])
        return np.interp(np.asarray(rows, dtype=np.float64), *self._table)

    def settled(self, rows: np.ndarray) -> np.ndarray:
        return np.fromiter((int(r) in self.ratio for r in rows), dtype=bool, count=len(rows))


class Corrected:
    """A curve with a ``Correction`` applied: what pricing reads (``__call__``, ``many``, ``at``)."""

    def __init__(self, curve, correction: Correction):
        self.curve, self.correction = curve, correction

    def __call__(self, rows: int) -> float:
        return float(self.many(np.array([rows]))[0])

    def _raw(self, rows: np.ndarray) -> np.ndarray:
        return prices(self.curve, rows)

    def many(self, rows: np.ndarray) -> np.ndarray:
        rows = np.asarray(rows)
        correction = self.correction
        seconds = self._raw(rows) * correction.factors(rows)
        if 1 in correction.ratio:  # counts not yet set: never dearer than the optimistic price
            one = float(self._raw(np.array([1]))[0]) * correction.ratio[1]
            untried = ~correction.settled(rows) & (rows <= 2 * max(correction.ratio))
            if untried.any():
                cap = np.minimum(one * (1 + correction.optimism * (rows[untried] - 1)), self._run(rows[untried]))
                seconds[untried] = np.minimum(seconds[untried], cap)
        return seconds

    def _run(self, rows: np.ndarray) -> np.ndarray:
        """What the counts set so far cost as run: their corrected prices, between them, and beyond
        the largest along their average slope (at least ``MIN_SLOPE`` of one row a row). A curve
        point taken in a slow spell, or at a shorter context than the steps run at, prices the
        counts past it far above what the counts run cost; no step then runs them to say so."""
        counts = np.asarray(sorted(self.correction.ratio), dtype=np.float64)
        if len(counts) < 2:
            return np.full(len(rows), np.inf)
        run = self._raw(counts) * self.correction.factors(counts)
        slope = max((run[-1] - run[0]) / (counts[-1] - counts[0]), MIN_SLOPE * run[0])
        out = np.interp(np.asarray(rows, dtype=np.float64), counts, run)
        beyond = rows > counts[-1]
        out[beyond] = run[-1] + slope * (rows[beyond] - counts[-1])
        return out

    def at(self, context: int) -> "Corrected":
        at = getattr(self.curve, "at", None)
        return Corrected(at(context), self.correction) if at is not None else self


def model_cost_identity(adapter) -> list:
    """What of the adapter's model and this process sets a forward's cost (with ``adapter.cost_setup()``,
    the cost curve's cache key; a warm start reads its model's from its record)."""
    model = adapter.model
    params = sum(p.numel() for p in model.parameters())
    # The layer classes name the kernels (few-row linears, fused norms, ...), whichever were swapped in.
    layers = sorted(f"{c.__module__}.{c.__qualname__}" for c in {type(m) for m in model.modules()})
    # The KV layers, and the compiled path's own curve: padded buckets, Inductor's kernels; and
    # the build of specfree's ops (a faster kernel is a new curve, or pricing keeps the old one).
    return [model.config.model_type, params, str(adapter.device), str(adapter.dtype), torch.get_num_threads(),
            torch.__version__, model.config._attn_implementation, layers, linear_path(model), kernel_dir().name,
            CONTEXTS]
