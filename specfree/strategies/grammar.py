"""The grammar drafter: where a request's constraint fixes the next characters (keys, quotes,
braces, separators), it proposes them as the tokenizer itself would write them.

It drafts only for a constrained request; the hybrid takes it as a member then (the engine adds
it, ``Decoding``), and the pricer learns its acceptance like any other member's.
"""

from __future__ import annotations

from specfree.constraints.matcher import Matcher
from specfree.types import Proposal


class GrammarDrafter:
    name = "grammar"

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def propose(self, matcher: Matcher, max_depth: int) -> Proposal:
        """One candidate: the forced text's tokens, cut where the grammar stops accepting them."""
        text = forced_text(matcher.forced_bytes())
        if not text or max_depth < 1:
            return Proposal(source=self.name)
        tokens = self.tokenizer.encode(text, add_special_tokens=False)[:max_depth]
        tokens = tokens[: matcher.allows(tokens)]
        return Proposal([tokens] if tokens else [], self.name)


def forced_text(forced: bytes) -> str:
    """The forced bytes as text, less a trailing character they hold only part of."""
    for cut in range(len(forced), max(len(forced) - 4, -1), -1):
        try:
            return forced[:cut].decode("utf-8")
        except UnicodeDecodeError:
            continue
    return ""
