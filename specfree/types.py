"""Core value types shared by drafters, mask builders, verifiers and the engine."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from specfree.errors import ConfigError


@dataclass
class AuxBlock:
    """Rows a drafter wants decoded in the step's forward but NOT verified (e.g. a Jacobi window).

    ``offsets`` are position offsets from the root (root is offset 0, the next token 1...).
    ``attends[i, j]`` says aux row i may see aux row j; ``sees_root`` says every aux row also
    sees the root. All aux rows see the whole committed cache.
    """

    tokens: list[int]
    offsets: list[int]
    attends: torch.Tensor  # [A, A] bool
    sees_root: bool = True

    def __len__(self) -> int:
        return len(self.tokens)

    @staticmethod
    def stack(blocks: list[AuxBlock], owners: list[str]) -> AuxBlock:
        """Several owners' aux rows as one block: rows one after the other, each block seeing only itself."""
        if len(blocks) == 1:
            return blocks[0]
        if len({b.sees_root for b in blocks}) > 1:
            raise ConfigError(f"drafters {owners} ask for aux rows that disagree on seeing the root; "
                              "use at most one of them")
        return AuxBlock([t for b in blocks for t in b.tokens], [o for b in blocks for o in b.offsets],
                        torch.block_diag(*[b.attends for b in blocks]), blocks[0].sees_root)


@dataclass
class Proposal:
    """What one drafter offers for this step: candidate continuations and optional aux rows."""

    candidates: list[list[int]] = field(default_factory=list)  # best first; each follows the root
    source: str = ""
    aux: AuxBlock | None = None
    sources: list[str] | None = None  # per candidate, when several drafters contributed
    labels: list[str] | None = None  # per candidate: the drafter's confidence class (e.g. match length)
    # Several owners' aux blocks (a hybrid's members), each priced and kept or dropped on its own;
    # a drafter with one block sets ``aux`` instead.
    windows: list[tuple[str, AuxBlock]] | None = None
    max_rows: int | None = None  # the most rows (root, tree and aux) this step may take; None: any

    def candidate_sources(self) -> list[str]:
        return self.sources if self.sources is not None else [self.source] * len(self.candidates)

    def aux_parts(self) -> list[tuple[str, AuxBlock]]:
        """Every aux block with its owner."""
        if self.windows is not None:
            return list(self.windows)
        return [(self.source, self.aux)] if self.aux is not None and len(self.aux) else []


@dataclass
class Verdict:
    """What the verifier decided for one step."""

    tokens: list[int]  # emitted tokens: accepted drafts then one token from the model (bonus)
    path: list[int]  # tree nodes accepted, root excluded; len(path) == len(tokens) - 1


@dataclass
class StepRecord:
    """Events of one decoding step, the raw material of every metric."""

    rows: int  # rows in the forward (root + drafted + aux)
    drafted: int  # drafted tree nodes
    accepted: int  # drafted tokens accepted (the bonus token is not counted)
    emitted: int  # tokens this step added to the output (accepted + bonus, after stops)
    draft_s: float
    mask_s: float
    forward_s: float
    verify_s: float
    other_s: float
    sources: dict[str, int] = field(default_factory=dict)  # accepted tokens per drafter
    extra: dict[str, float] = field(default_factory=dict)  # drafter-specific (window, pool size)
    offered: int = 0  # rows the drafters offered (root + distinct drafted nodes + aux); ``rows`` were kept
    # What pricing predicted for this step, beside ``forward_s`` and ``accepted`` / ``sources`` (None:
    # the step was not priced): the forward's seconds, the drafted tokens expected accepted, per drafter.
    predicted_s: float | None = None
    expected: float | None = None
    expected_by: dict[str, float] = field(default_factory=dict)


class TokenLogprob(NamedTuple):
    """One generated token's log-probability under the model, and the ``k`` most likely ids of its row."""

    token: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass
class Generation:
    """The result of one ``Engine.generate`` call."""

    tokens: list[int]  # new tokens only
    text: str
    prompt_tokens: int
    steps: list[StepRecord]
    prefill_s: float  # before the first step: the prompt's forward and the drafter's index of the prompt
    wall_s: float  # prefill + all steps
    stop_reason: str  # "eos" | "stop_string" | "max_new_tokens" | "context_length"
    drafted_mask: list[bool] = field(default_factory=list)  # per token: came from an accepted draft
    cached_tokens: int = 0  # prompt tokens whose KV ``Engine(prompt_cache=True)`` reused from the last call
    logprobs: list[TokenLogprob] | None = None  # per token, when asked (``generate(..., logprobs=k)``)

    @property
    def prefilled_tokens(self) -> int:
        """Prompt tokens this call's prefill ran (all but the last, which the first step runs, less the reused)."""
        return max(0, self.prompt_tokens - 1 - self.cached_tokens)

    @property
    def forwards(self) -> int:
        return len(self.steps)

    @property
    def mean_accepted(self) -> float:
        """Mean tokens emitted per step (accepted drafts + the model's own token)."""
        return sum(s.emitted for s in self.steps) / max(1, len(self.steps))

    @property
    def decode_s(self) -> float:
        return sum(s.draft_s + s.mask_s + s.forward_s + s.verify_s + s.other_s for s in self.steps)

    @property
    def tokens_per_s(self) -> float:
        return len(self.tokens) / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def accepted_by(self) -> dict[str, int]:
        """Accepted drafted tokens per drafter (a hybrid's members by their labels)."""
        total: dict[str, int] = {}
        for step in self.steps:
            for source, count in step.sources.items():
                total[source] = total.get(source, 0) + count
        return total

    def time_split(self) -> dict[str, float]:
        keys = ("draft_s", "mask_s", "forward_s", "verify_s", "other_s")
        return {k: sum(getattr(s, k) for s in self.steps) for k in keys}

    def summary(self) -> dict:
        split = self.time_split()
        return {
            "new_tokens": len(self.tokens),
            "prompt_tokens": self.prompt_tokens,
            "forwards": self.forwards,
            "mean_accepted": self.mean_accepted,
            "tokens_per_s": self.tokens_per_s,
            "wall_s": self.wall_s,
            "prefill_s": self.prefill_s,
            "stop_reason": self.stop_reason,
            "accepted_by": self.accepted_by,
            "rows_offered": sum(s.offered for s in self.steps),
            "rows_kept": sum(s.rows for s in self.steps),
            **split,
            "overhead_frac": 1 - split["forward_s"] / max(1e-12, sum(split.values())),
        }
