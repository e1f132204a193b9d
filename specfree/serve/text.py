"""Stop strings as the OpenAI API treats them: the answer ends before the first one, and a
streamed answer never shows the start of one that may still complete."""

from __future__ import annotations

from collections.abc import Sequence

# The engine's stop reasons as OpenAI's finish_reason.
FINISH = {"eos": "stop", "stop_string": "stop", "grammar": "stop", "max_new_tokens": "length", "context_length": "length"}


class StopTrim:
    def __init__(self, stops: Sequence[str]):
        self.stops = [s for s in stops if s]
        self.held = ""
        self.done = False

    def push(self, text: str) -> str:
        """The part of ``text`` that can be shown now."""
        if self.done:
            return ""
        buf = self.held + text
        cuts = [i for i in (buf.find(s) for s in self.stops) if i >= 0]
        if cuts:
            self.done, self.held = True, ""
            return buf[: min(cuts)]
        keep = max((k for s in self.stops for k in range(1, min(len(s), len(buf) + 1))
                    if buf.endswith(s[:k])), default=0)
        self.held = buf[len(buf) - keep :]
        return buf[: len(buf) - keep]

    def flush(self) -> str:
        """What was held back, once no more text comes."""
        out, self.held = ("" if self.done else self.held), ""
        return out
