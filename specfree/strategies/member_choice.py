"""Which of a hybrid's members draft a step: all of them, or all but one whose drafting does not pay.

A member's draft costs its time every step, and a member whose nodes the others mostly draft too
buys few tokens with it: the merged tree can lose to a member alone once drafting is counted
(pricing counts forward time only). So some steps are checks: every member drafts, and pricing also
prices that step as it would have run without each member (``Proposal.leave_out``). When the check
step is over, its measured time (from one ``propose`` to the next: drafting, pricing, forward,
verifying) prices each option: the step's own time, less what the member's draft took and the
forward time its rows added on the curve. The option with the most expected tokens per second,
over the request's checks (older ones fading), decides who drafts until the next check.

Who drafts changes only which rows the model checks: the output is the model's own either way.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from specfree.pricing import Plan

ALL = ""  # the option where every member drafts


@dataclass
class MemberChoice:
    """``every``: a check every this many steps (0: every member drafts every step, no checks);
    ``warm``: the first steps of a request are checks too; ``memory``: checks a sum keeps (older
    checks fade by 1 - 1/memory each); ``clock``: seconds, for the steps' own time."""

    every: int = 8
    warm: int = 2
    memory: float = 4.0
    clock: Callable[[], float] = time.perf_counter
    left_out: str | None = field(default=None, init=False)  # the member not drafting between checks
    _step: int = field(default=0, init=False)
    _began: float | None = field(default=None, init=False)  # when the last step's propose began
    _check: tuple[Plan, dict[str, float]] | None = field(default=None, init=False)
    _tokens: Counter = field(default_factory=Counter, init=False)
    _seconds: Counter = field(default_factory=Counter, init=False)

    def begin(self) -> None:
        """A request starts: nothing learned yet, every member drafts."""
        self.left_out, self._step, self._began, self._check = None, 0, None, None
        self._tokens, self._seconds = Counter(), Counter()

    def step(self) -> bool:
        """A step begins (its propose): the last check learns its time; whether this step is a check."""
        now = self.clock()
        if self._check is not None and self._began is not None:
            self._learn(*self._check, now - self._began)
        self._check, self._began = None, now
        self._step += 1
        return self.every > 0 and (self._step <= self.warm or self._step % self.every == 0)

    def checked(self, plan: Plan | None, drafts: dict[str, float]) -> None:
        """The check step's plan and each member's drafting seconds; learned at the next step."""
        if plan is not None and plan.option is not None and plan.without:
            self._check = (plan, drafts)

    def _learn(self, plan: Plan, drafts: dict[str, float], seconds: float) -> None:
        options = {ALL: (plan.option.tokens, seconds)}
        for member, option in plan.without.items():
            if option is not None:
                saved = drafts.get(member, 0.0) + plan.option.seconds - option.seconds
                options[member] = (option.tokens, max(seconds - saved, 1e-9))
        keep = 1.0 - 1.0 / self.memory
        for key, (tokens, spent) in options.items():
            self._tokens[key] = keep * self._tokens[key] + tokens
            self._seconds[key] = keep * self._seconds[key] + spent
        best = max(options, key=lambda key: self._tokens[key] / self._seconds[key])
        self.left_out = None if best == ALL else best
