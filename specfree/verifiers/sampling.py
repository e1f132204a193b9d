"""Exact sampling verification with a per-position random stream.

At each node the processed distribution p(. | that node's prefix) is sampled with a uniform
drawn from a stream keyed by (seed, absolute position). Plain autoregressive sampling uses the
same stream, so with one seed both emit the same tokens; drafts only choose which positions
were computed in parallel.
"""

from __future__ import annotations

import torch
from transformers import LogitsProcessorList

from specfree.draft_tree import DraftTree
from specfree.types import Verdict
from specfree.verifiers.greedy import walk

_MIX = 0x9E3779B97F4A7C15  # golden-ratio multiplier: spreads (seed, position) over the seed space


def position_uniform(seed: int, position: int) -> float:
    """A uniform in [0, 1) that depends only on (seed, position)."""
    gen = torch.Generator().manual_seed((seed * _MIX + position) % (2**63 - 1))
    return float(torch.rand((), generator=gen, dtype=torch.float64))


def sample_with_uniform(probs: torch.Tensor, u: float) -> int:
    """Inverse-CDF draw; float64 so rounding cannot move a draw across many tokens."""
    cdf = probs.double().cumsum(-1)
    target = torch.tensor([u * float(cdf[-1])], dtype=torch.float64, device=cdf.device)
    index = int(torch.searchsorted(cdf, target, right=True))
    index = min(index, probs.shape[-1] - 1)
    while probs[index] <= 0:  # u*total landed on a zero-mass tail (rounding); step back onto mass
        index -= 1
    return index


class SamplingVerifier:
    name = "sampling"
    do_sample = True

    def __init__(self, processors: LogitsProcessorList | None = None, seed: int = 0):
        self.processors = processors or LogitsProcessorList()
        self.seed = seed

    def verify(self, logits: torch.Tensor, tree: DraftTree, context: torch.Tensor) -> Verdict:
        context = context.to(logits.device)  # processors index the scores with these ids

        def pick(node: int, prefix: torch.Tensor) -> int:
            scores = self.processors(prefix[None], logits[node : node + 1].float())[0]
            probs = torch.softmax(scores, dim=-1)
            return sample_with_uniform(probs, position_uniform(self.seed, prefix.shape[0]))

        return walk(tree, context, pick)
