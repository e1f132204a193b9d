"""One request being decoded, step by step: the part of the loop the engine and a batch share.

A step of one request is: ``plan`` (the drafter proposes, the planner keeps the rows worth their
cost, the mask builder lays them out), one forward that the caller runs (alone, or beside other
requests' rows in a batch), ``verify`` (the verifier keeps what the model would have produced),
the caller keeping the KV of the accepted rows, and ``emit`` (the accepted tokens join the
request's ids, stops are checked, the drafter and the pricer learn). The forward and the KV are
the caller's: that is all that differs between decoding alone and in a batch.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from specfree.constraints.matcher import Matcher, prune
from specfree.detokenize import Detokenizer
from specfree.masks.tree import Layout
from specfree.planner import StepPlanner
from specfree.pricing import Plan
from specfree.strategies.base import Outcome, Strategy
from specfree.strategies.grammar import GrammarDrafter
from specfree.strategies.hybrid import with_member
from specfree.types import Generation, Proposal, StepRecord, TokenLogprob, Verdict


@dataclass
class Chunk:
    """One step's worth of streamed output."""

    text: str
    tokens: list[int]
    from_draft: list[bool]  # per token: it was a drafted token the model accepted
    logprobs: list[TokenLogprob] | None = None  # per token, when the call asked for them


@dataclass
class Step:
    """One planned step of one request: what was proposed, the rows kept, their layout, and when."""

    proposal: Proposal
    plan: Plan
    layout: Layout
    started: float  # perf_counter at the start of drafting
    planned: float  # ... once the rows were priced
    laid_out: float  # ... once the mask was built
    verifying: float = 0.0  # ... when the verifier was handed the forward's logits
    verified: float = 0.0  # ... once it was done


def token_logprobs(logits: torch.Tensor, rows: list[int], tokens: list[int], k: int) -> list[TokenLogprob]:
    """Each token's log-probability in its row's log-softmax (float32), and the row's ``k`` best."""
    if not rows:
        return []
    table = torch.log_softmax(logits[rows].float(), dim=-1)
    best = torch.topk(table, k, dim=-1) if k else None
    return [TokenLogprob(token, float(table[i, token]),
                         list(zip(best.indices[i].tolist(), best.values[i].tolist())) if best is not None else [])
            for i, token in enumerate(tokens)]


class Decoding:
    """One request's state: its committed ids (the last is the next step's root), its verifier,
    drafter and planner, and what it has emitted so far.

    ``limit``: the most ids prompt and answer may reach; ``should_stop(token, detok, stop,
    ignore_eos)``: the engine's stop rule, asked once per emitted token; ``logprobs``: None, or how
    many alternatives each token's log-probability carries; ``rollback_s``: the adapter's last
    rollback time, for chain-verifying models (recorded with each step).

    ``constraint``: None, or the request's ``constraints.Matcher`` (its ``ConstraintMask`` leads the
    verifier's processors): drafts are cut to what the grammar allows before the forward, the
    answer ends where the grammar is complete (stop reason ``"grammar"``), and ``grammar``
    (a ``GrammarDrafter``, or None) adds the text the grammar forces to each proposal."""

    def __init__(self, ids: Sequence[int], limit: int, max_new_tokens: int, *, verifier, strategy: Strategy,
                 planner: StepPlanner, mask_builder: Callable, tokenizer, should_stop: Callable,
                 stop: Sequence[str] = (), ignore_eos: bool = False, logprobs: int | None = None,
                 rollback_s: Callable[[], float] | None = None, constraint: Matcher | None = None,
                 grammar: GrammarDrafter | None = None):
        self.prompt_len = len(ids)
        self.max_new_tokens = max_new_tokens
        self.buffer = np.zeros(limit, dtype=np.int64)
        self.buffer[: len(ids)] = ids
        self.n = len(ids)
        self.verifier, self.strategy, self.planner, self.mask_builder = verifier, strategy, planner, mask_builder
        self.tokenizer = tokenizer
        self.detok = Detokenizer(tokenizer) if tokenizer is not None else None
        self.should_stop, self.stop, self.ignore_eos = should_stop, stop, ignore_eos
        self.logprobs_k = logprobs
        self.logprobs: list[TokenLogprob] | None = [] if logprobs is not None else None
        self.rollback_s = rollback_s
        self.constraint, self.grammar = constraint, grammar
        self.new_tokens: list[int] = []
        self.from_draft: list[bool] = []
        self.steps: list[StepRecord] = []
        self.stop_reason: str | None = None

    @property
    def limit(self) -> int:
        return len(self.buffer)

    @property
    def context(self) -> np.ndarray:
        """The committed ids (prompt, then answer); the last one is the next step's root."""
        return self.buffer[: self.n]

    @property
    def done(self) -> bool:
        return self.stop_reason is not None

    def plan(self, cost=None, shared_tokens: float = 0.0) -> Step:
        """Draft and price this step's rows, and lay them out after the root (``cost``,
        ``shared_tokens``: a batch's price, see ``StepPlanner.plan``)."""
        t0 = time.perf_counter()
        n, context = self.n, self.context
        proposal = self.strategy.propose(context, max_depth=self.limit - n - 1)
        if self.constraint is not None:
            proposal = self._constrained(proposal, self.limit - n - 1)
        plan = self.planner.plan(int(context[-1]), proposal, max_depth=self.limit - n - 1, context=n, cost=cost,
                                 shared_tokens=shared_tokens)
        t1 = time.perf_counter()
        layout = self.mask_builder(plan.tree, plan.aux, n - 1)  # tokens, positions, mask of the rows
        return Step(proposal, plan, layout, t0, t1, time.perf_counter())

    def _constrained(self, proposal: Proposal, max_depth: int) -> Proposal:
        self.constraint.follow(self.context[self.prompt_len :].tolist())
        if self.grammar is not None:
            proposal = with_member(proposal, self.grammar.propose(self.constraint, max_depth))
        return prune(proposal, self.constraint)

    def verify(self, step: Step, logits: torch.Tensor) -> Verdict:
        """What the model would have produced, from this step's logits [rows, V]."""
        step.verifying = time.perf_counter()
        verdict = self.verifier.verify(logits[: step.layout.num_tree], step.plan.tree, torch.from_numpy(self.context))
        step.verified = time.perf_counter()
        return verdict

    def emit(self, step: Step, verdict: Verdict, logits: torch.Tensor, forward_s: float,
             shared: dict[str, float] | None = None) -> Chunk:
        """Commit the verdict's tokens up to a stop, let the drafter and the pricer learn, record the
        step (``shared``: what a batch's forward held besides this request, recorded with it)."""
        tree, aux, layout = step.plan.tree, step.plan.aux, step.layout
        emitted, text = 0, ""
        for token in verdict.tokens:
            self.buffer[self.n] = token
            self.n += 1
            emitted += 1
            self.new_tokens.append(token)
            self.from_draft.append(emitted <= len(verdict.path))
            if self.detok is not None:
                text += self.detok.push(token)
            self.stop_reason = self.should_stop(token, self.detok, self.stop, self.ignore_eos)
            if self.constraint is not None and self.stop_reason is None:
                self.constraint.follow(self.new_tokens)
                self.stop_reason = "grammar" if self.constraint.stopped else None
            if self.stop_reason or self.n >= self.limit:
                break
        if self.logprobs is not None:  # token i was predicted by row i of [root, *path]
            self.logprobs += token_logprobs(logits, [0, *verdict.path][:emitted], verdict.tokens[:emitted],
                                            self.logprobs_k)
        self.strategy.observe(Outcome(tree, verdict, self.context, logits[layout.num_tree :] if aux is not None else None,
                                      logits[: layout.num_tree], step.plan.aux_logits(logits)))
        self.planner.learn(step.proposal, step.plan, verdict.tokens, len(verdict.path))
        accepted = min(len(verdict.path), emitted)
        extra = self.strategy.stats()
        if self.rollback_s is not None:
            extra = {**extra, "rollback_s": self.rollback_s()}
        if self.constraint is not None:  # the grammar's time so far (masks, drafts checked): a bench's mask cost
            extra = {**extra, "constraint_s": self.constraint.spent_s}
        if shared:
            extra = {**extra, **shared}
        self.steps.append(StepRecord(
            rows=layout.rows, drafted=tree.num_drafted, accepted=accepted, emitted=emitted,
            draft_s=step.planned - step.started, mask_s=step.laid_out - step.planned, forward_s=forward_s,
            verify_s=step.verified - step.verifying, other_s=time.perf_counter() - step.verified,
            sources=dict(Counter(tree.sources[node] for node in verdict.path[:accepted])), extra=extra,
            offered=step.plan.offered, predicted_s=step.plan.predicted_s, expected=step.plan.expected,
            expected_by=step.plan.expected_by or {}))
        if self.stop_reason is None and self.n >= self.limit:
            self.stop_reason = "max_new_tokens" if len(self.new_tokens) >= self.max_new_tokens else "context_length"
        if self.stop_reason and self.detok is not None:
            text += self.detok.flush()
        return Chunk(text, self.new_tokens[-emitted:], self.from_draft[-emitted:],
                     self.logprobs[-emitted:] if self.logprobs is not None else None)

    def result(self, prefill_s: float, wall_s: float, cached_tokens: int = 0) -> Generation:
        text = self.tokenizer.decode(self.new_tokens, skip_special_tokens=True) if self.tokenizer else ""
        return Generation(tokens=self.new_tokens, text=text, prompt_tokens=self.prompt_len, steps=self.steps,
                          prefill_s=prefill_s, wall_s=wall_s, stop_reason=self.stop_reason,
                          drafted_mask=self.from_draft, cached_tokens=cached_tokens, logprobs=self.logprobs)
