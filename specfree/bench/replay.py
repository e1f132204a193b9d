"""``specfree replay BENCH [STRATEGY ...]``: drafters replayed on a bench run's own outputs.

Greedy output does not depend on the drafter, so the baseline's recorded tokens are what every
strategy emitted. Replaying a strategy over them (propose, keep the longest drafted path that
agrees with the recorded continuation plus the model's own next token, observe) gives its tokens
per step and rows per step in seconds, without the model's forwards. Each system is priced, and
its decode speedup modelled, on the curve its engine priced on in the run (recorded since run Y;
for older runs, and strategies the run did not have, the run's measured forward curve, at its
reference context); ``--flat F`` prices the same steps on a curve where 8 rows cost F times one
row, to ask what a flatter forward would buy; ``--curve OTHER`` on the forward curve another bench
run measured (``OTHER``: its bench.json or folder), to ask what the same drafts would buy on another
model or machine (a 1-7B file's curve: the drafts of a small model priced as a large one's
forward). Each system's drafting time per step is timed too: its strategy's and its pricing's own
calls, which a live step adds to its forward (the replay's logits, built from the recorded top
tokens, are not counted). What a replay cannot tell:

- a live engine's steps also take their own time, which the curve only models;
- drafters that learn from the model's logits (recycling, logit_spec) see those of the rows the
  model emitted (one forward over each recorded sequence), not those of the rows it rejected;
  lookahead, whose window rows are decoded by the forward itself, cannot be replayed.

Token-only drafters (prompt lookup, suffix, SAM, the trie) unpriced replay a live run exactly.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from rich.console import Console
from rich.table import Table

from specfree.bench import store as store_mod
from specfree.bench.ceiling import _conversation_and_cost, run_curve, run_engine
from specfree.bench.metrics import BASELINE, COMPILED
from specfree.bench.report import markdown_table, wide_console
from specfree.cost import CostModel
from specfree.errors import ConfigError
from specfree.planner import StepPlanner
from specfree.pricer import Pricer
from specfree.strategies.base import Outcome, Strategy
from specfree.draft_tree import DraftTree
from specfree.types import Verdict
from specfree.settings import DEFAULTS

TOP = 16  # the model's top next tokens kept per recorded position (what logit-learning drafters see)
ENGINE_PARAMS = ("priced", "adapt_costs", "price_context")
REFUSED = {"lookahead": "its Jacobi window rows are decoded by the forward itself"}


@dataclass
class Recorded:
    """One recorded turn: its prompt ids, the model's greedy output, and the model's top tokens
    after every position of prompt + output ([L, TOP] ids and logits)."""

    category: str
    context: list[int]
    output: list[int]
    top_ids: torch.Tensor
    top_logits: torch.Tensor

    def logits(self, positions: Sequence[int], vocab: int) -> torch.Tensor:
        """[len(positions), vocab]: the model's logits after those positions, its top tokens only."""
        out = torch.full((len(positions), vocab), float("-inf"))
        for row, at in enumerate(positions):
            out[row, self.top_ids[at]] = self.top_logits[at]
        return out


@dataclass
class Replayed:
    tokens: int
    steps: int
    rows: int
    offered: int
    seconds: float  # the steps' forwards on the curve
    one_row: float  # the same tokens one row a step, on the same curve
    per_step: list[list[int]]  # tokens each step emitted, per recorded turn
    drafting_s: float = 0.0  # wall time of the strategy's and the pricing's own calls (no forwards)


def record_sequences(records: Sequence[dict], contexts: Callable[[dict], list[list[int]]],
                     model=None) -> list[Recorded]:
    """The baseline's turns in run order; with ``model``, its top tokens at every position (one forward each)."""
    out = []
    for record in records:
        if record["system"] != BASELINE or record.get("error") or record.get("repeat", 0) != 0:
            continue
        for context, turn in zip(contexts(record), record["turns"]):
            ids, top_ids, top_logits = [*context, *turn["tokens"]], torch.empty(0), torch.empty(0)
            if model is not None:
                with torch.inference_mode():
                    logits = model(torch.tensor([ids], device=model.device)).logits[0].float().cpu()
                top_logits, top_ids = logits.topk(TOP, dim=-1)
            out.append(Recorded(record["category"], list(context), list(turn["tokens"]), top_ids, top_logits))
    return out


def replay(strategy: Strategy, turns: Sequence[Recorded], vocab: int, max_length: int,
           cost: Callable[[int], float], pricer: Pricer | None, max_new_tokens: int,
           price_context: bool) -> Replayed:
    """Every turn, in order, through ``strategy`` as the engine's loop runs it (``pricer`` None:
    every candidate, as proposed), each step verified against the recorded output; with
    ``price_context``, each step priced and timed at its own context (where ``cost`` has ``at``)."""
    strategy.setup(vocab, max_length)
    result = Replayed(0, 0, 0, 0, 0.0, 0.0, [])
    clock = time.perf_counter
    planner = StepPlanner(pricer, budget=max_length, price_context=price_context)
    at = (lambda context: cost.at(context)) if price_context and hasattr(cost, "at") else (lambda context: cost)
    for turn in turns:
        ids, output = turn.context, turn.output
        limit = min(len(ids) + max_new_tokens, max_length)
        text = np.array([*ids, *output], dtype=np.int64)
        n, emitted = len(ids), []
        start = clock()
        strategy.begin(text[:n].copy())
        result.drafting_s += clock() - start
        try:
            while n < len(ids) + len(output):
                context = text[:n]
                start = clock()
                proposal = strategy.propose(context, max_depth=limit - n - 1)
                root = int(context[-1])
                plan = planner.plan(root, proposal, max_depth=limit - n - 1, context=n)
                result.drafting_s += clock() - start
                result.seconds += at(n)(plan.rows)
                tree = plan.tree
                node, path = 0, []  # the longest drafted path the recorded output follows, and its next token
                while n + len(path) + 1 < len(text) and (node, int(text[n + len(path)])) in tree.children:
                    node = tree.children[node, int(text[n + len(path)])]
                    path.append(node)
                tokens = text[n : n + len(path) + 1].tolist()
                kept = DraftTree.root_only(root)  # the emitted path: the rows whose logits the run recorded
                for token in tokens[:-1]:
                    kept.add(len(kept) - 1, token)
                logits = turn.logits(range(n - 1, n - 1 + len(kept)), vocab) if turn.top_ids.numel() else None
                result.one_row += sum(at(n + j)(1) for j in range(len(tokens)))
                n += len(tokens)
                outcome = Outcome(kept, Verdict(tokens, list(range(1, len(kept)))), text[:n].copy(), None, logits, None)
                start = clock()
                strategy.observe(outcome)
                planner.learn(proposal, plan, tokens, len(path))
                result.drafting_s += clock() - start
                emitted.append(len(tokens))
                result.rows += plan.rows
                result.offered += plan.offered
        finally:
            start = clock()
            strategy.end()
            result.drafting_s += clock() - start
        result.per_step.append(emitted)
        result.tokens += sum(emitted)
        result.steps += len(emitted)
    return result


def flattened(cost: Callable[[int], float], ratio: float) -> CostModel:
    """A curve through cost(1) where 8 rows cost ``ratio`` times one row, linear in the rows."""
    rows = np.array([1, 2, 4, 8, 16, 32, 64])
    return CostModel(rows.tolist(), (cost(1) * (1 + (ratio - 1) * (rows - 1) / 7)).tolist())


def _strategies(names: Sequence[str], systems_meta: Sequence[dict], registry) -> list[tuple[str, Strategy, bool]]:
    """(label, strategy, priced) per name: a system of the run by its label (its knobs), else a strategy by name."""
    systems = {m["label"]: m for m in systems_meta if m.get("kind") == "specfree"}
    if not names:
        names = [label for label in systems if label not in (BASELINE, BASELINE + COMPILED)]
    out = []
    for name in names:
        meta = systems.get(name, {"strategy": name, "knobs": {}})
        strategy_name = meta["strategy"]
        if strategy_name in REFUSED:
            raise ConfigError(f"replay: {strategy_name} cannot be replayed ({REFUSED[strategy_name]}); "
                              "run it with python -m specfree bench")
        knobs = {k: v for k, v in (meta.get("knobs") or {}).items() if k not in ENGINE_PARAMS}
        priced = DEFAULTS.take(dict(meta.get("knobs") or {})).priced
        out.append((name, registry.make("strategy", strategy_name, **knobs), priced))
    return out


def measured_tokens_per_step(records: Sequence[dict], label: str) -> float | None:
    """The run's own tokens per step for a system (its turns' recorded steps), None where it has none."""
    turns = [t for r in records if r["system"] == label and not r.get("error") for t in r["turns"] if t.get("steps")]
    steps = sum(t["steps"] for t in turns)
    return sum(len(t["tokens"]) for t in turns) / steps if steps else None


USAGE = "usage: python -m specfree replay BENCH_JSON_OR_FOLDER [STRATEGY ...] [--flat F] [--curve OTHER_BENCH]"
FLAT_TAKES = "a number, the cost of 8 rows over one row (e.g. --flat 1.15)"


def _option(args: list[str], flag: str, what: str) -> str | None:
    """The value after ``flag`` (both taken out of ``args``), None where it is absent."""
    if flag not in args:
        return None
    i = args.index(flag)
    if i + 1 >= len(args):
        raise ConfigError(f"replay: {flag} takes {what}")
    value = args[i + 1]
    del args[i : i + 2]
    return value


def other_curve(source: str) -> tuple[CostModel, str]:
    """The forward curve another bench run measured for its own path, and its name."""
    _, other = store_mod.read_output(source, "replay --curve")
    meta = other.get("meta", {})
    found = run_curve(meta)
    if found is None:
        raise ConfigError(f"replay: --curve {source} recorded no forward curve: run its bench with "
                          "bench.cost_curves=true")
    name, cost = found
    return cost, f"{meta.get('model', source)}'s {name} curve (--curve)"


def main(args: Sequence[str], console: Console | None = None) -> int:
    """Entry point of ``python -m specfree replay BENCH [STRATEGY ...] [--flat F] [--curve OTHER]``;
    the table is printed and written to ``replay.md`` (``replay_flat_F.md``, ``replay_curve.md``)
    beside the bench.json."""
    from specfree.plugins import build_plugin_manager, registry

    args = list(args)
    flat = _option(args, "--flat", FLAT_TAKES)
    if flat is not None:
        try:
            flat = float(flat)
        except ValueError:
            raise ConfigError(f"replay: --flat takes {FLAT_TAKES}") from None
        if flat < 1.0:
            raise ConfigError(f"replay: --flat {flat} would make 8 rows cheaper than one; pass 1.0 or more")
    source = _option(args, "--curve", "another bench run's bench.json or folder")
    if not args:
        raise ConfigError(USAGE)
    path, data = store_mod.read_output(args[0], "replay")
    meta, records = data.get("meta", {}), data["records"]
    chosen = _strategies(args[1:], data.get("systems", []), registry(build_plugin_manager()))
    elsewhere = other_curve(source) if source is not None else None  # checked before the model loads
    engine = run_engine(meta)  # its model also gives the logits of the recorded sequences
    contexts, cost, curve_name = _conversation_and_cost(meta, engine)
    if elsewhere is not None:
        cost, curve_name = elsewhere
    if flat is not None:
        flat_name = f"flattened: 8 rows {flat}x one row"
        cost, curve_name = flattened(cost, flat), f"{curve_name}, {flat_name}" if elsewhere else flat_name
    model = engine.adapter.model
    turns = record_sequences(records, contexts, model)
    vocab, max_length = model.config.vocab_size, int(getattr(model.config, "max_position_embeddings", 1 << 20))
    headers = ["system", "tok/step", "measured tok/step", "rows/step kept/offered", "decode speedup (curve)",
               "drafting ms/step", "priced on"]
    body = []
    engines = meta.get("pricing_curves") or {}
    for label, strategy, priced in chosen:
        # the curve this system's engine priced on, unless another was asked for
        own = label in engines and flat is None and source is None
        curve = CostModel.from_dict(engines[label]) if own else cost
        done = replay(strategy, turns, vocab, max_length, curve, Pricer(curve) if priced else None,
                      int(meta.get("max_new_tokens", 128)), price_context=own)
        measured = measured_tokens_per_step(records, label)
        body.append([label, f"{done.tokens / done.steps:.2f}",
                     f"{measured:.2f}" if measured else "–", f"{done.rows / done.steps:.1f}/{done.offered / done.steps:.1f}",
                     f"{done.one_row / done.seconds:.2f}x", f"{1e3 * done.drafting_s / done.steps:.2f}",
                     "its engine's curve, each step's context" if own else curve_name or "this machine's cached curve"])
    table = Table(title="Strategies replayed on the baseline's outputs")
    for header in headers:
        table.add_column(header, justify="left" if header == "system" else "right")
    for line in body:
        table.add_row(*line)
    (console or wide_console()).print(table)
    out = path.parent / ("replay" + ("_curve" if source is not None else "") +
                         ("" if flat is None else f"_flat_{flat:g}") + ".md")
    out.write_text(f"# Strategies replayed on the baseline's outputs\n\n{markdown_table(headers, body, left=1)}\n",
                   encoding="utf-8")
    return 0
