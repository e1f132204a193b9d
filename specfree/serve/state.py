"""``serve.state_file``: the suffix drafter's global tree, loaded at start and saved at shutdown.

The tree is the one every request of the server shares (one engine, one drafter); it stays
bounded by the strategy's ``max_cached_requests`` and ``max_nodes``. The file format is the
``suffix`` strategy's own ``state_file`` (docs/cli.md, "State across requests").
"""

from __future__ import annotations

from pathlib import Path

from specfree.errors import ConfigError
from specfree.pools.suffix_tree import tokenizer_fingerprint
from specfree.strategies.suffix import SuffixDecoding


def suffix_drafter(strategy) -> SuffixDecoding:
    """The engine's one ``suffix`` drafter: the strategy itself or a hybrid's member."""
    found = [d for d in [strategy, *getattr(strategy, "drafters", ())] if isinstance(d, SuffixDecoding)]
    if len(found) != 1:
        raise ConfigError(f"serve.state_file keeps the suffix drafter's global tree, but strategy "
                          f"{getattr(strategy, 'name', type(strategy).__name__)!r} has {len(found) or 'no'} suffix "
                          "drafters; use strategy=suffix or the default hybrid, or drop serve.state_file")
    return found[0]


class SharedState:
    def __init__(self, engine, path: str | Path):
        self.path = Path(path).expanduser()
        self.drafter = suffix_drafter(engine.strategy)
        self.vocab_size = engine.adapter.vocab_size
        self.fingerprint = tokenizer_fingerprint(engine.tokenizer)

    def load(self) -> bool:
        if not self.path.exists():
            return False
        self.drafter.pool.load(self.path, self.vocab_size, self.fingerprint)
        return True

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.drafter.pool.save(self.path, self.vocab_size, self.fingerprint)

    def requests(self) -> int:
        return len(self.drafter.pool.requests)
