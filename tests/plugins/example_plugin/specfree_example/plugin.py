"""A third-party strategy, registered through the same hook as specfree's built-ins.

``repeat_last`` drafts the last token repeated ``k`` times: useless on prose, right on runs
of one token, and small enough to read in one go. Its config node (``strategy=repeat_last
strategy.k=3``) is made from the signature of ``RepeatLast`` and the defaults below, and the
same node makes it a hybrid member beside the built-ins, with no code of its own for that::

    python -m specfree decode strategy=hybrid 'strategy.drafters=[prompt_lookup, {name: repeat_last, k: 3}]'
"""

from __future__ import annotations

import numpy as np

from specfree.errors import check_int
from specfree.hookspecs import hookimpl
from specfree.strategies.base import Strategy
from specfree.types import Proposal


class RepeatLast(Strategy):
    name = "repeat_last"

    def __init__(self, k: int = 4):
        self.k = check_int("repeat_last.k", k, low=1)

    def propose(self, context: np.ndarray, max_depth: int) -> Proposal:
        depth = min(self.k, max_depth)
        if depth <= 0:
            return Proposal(source=self.name)
        return Proposal([[int(context[-1])] * depth], source=self.name)


@hookimpl
def specfree_register(registry) -> None:
    registry.add("strategy", "repeat_last", RepeatLast, config={"k": 2})
