"""Incremental detokenization: turn a growing token list into text deltas.

Decoding only a short window (from the previous read offset) keeps streaming O(n); holding back
a trailing U+FFFD avoids printing half of a multi-byte character.
"""

from __future__ import annotations


class Detokenizer:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.tokens: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self.text = ""

    def _decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    def push(self, token: int) -> str:
        """Add one token; return the text it completes (may be empty)."""
        self.tokens.append(token)
        before = self._decode(self.tokens[self.prefix_offset : self.read_offset])
        after = self._decode(self.tokens[self.prefix_offset :])
        if after.endswith("\ufffd") or len(after) <= len(before):
            return ""
        delta = after[len(before) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
        self.text += delta
        return delta

    def flush(self) -> str:
        """Whatever is still held back (e.g. an incomplete character at the very end)."""
        full = self._decode(self.tokens)
        delta = full[len(self.text) :] if full.startswith(self.text) else ""
        self.text += delta
        return delta
