"""Slow, obviously-correct reference pools the real ones are checked against."""

from __future__ import annotations

from collections import Counter


def tree_nodes(candidates: list[list[int]]) -> int:
    """Nodes of the prefix tree the candidates merge into (shared prefixes counted once)."""
    return len({tuple(c[:j]) for c in candidates for j in range(1, len(c) + 1)})


def check_contract(candidates: list[list[int]], max_nodes: int, max_depth: int) -> None:
    """The Pool.lookup contract, plus: no empty and no redundant candidate, plain ints."""
    assert isinstance(candidates, list)
    assert tree_nodes(candidates) <= max_nodes
    for i, c in enumerate(candidates):
        assert isinstance(c, list) and 1 <= len(c) <= max_depth
        assert all(type(t) is int and t >= 0 for t in c)
        assert tree_nodes(candidates[: i + 1]) > tree_nodes(candidates[:i]), "redundant candidate"


def naive_fit(candidates, max_nodes: int, max_depth: int) -> list[list[int]]:
    out: list[list[int]] = []
    for c in candidates:
        c = list(c[:max_depth])
        while c and tree_nodes(out + [c]) > max_nodes:
            c = c[:-1]
        if c and tree_nodes(out + [c]) > tree_nodes(out):
            out.append(c)
        if tree_nodes(out) == max_nodes:
            break
    return out


def best_first(score: dict[tuple[int, ...], float], max_nodes: int, max_depth: int) -> list[list[int]]:
    """Take nodes (relative paths) by (score desc, depth asc, tokens asc), children only after
    their parent; return the taken leaves in the order taken."""
    frontier = [p for p in score if len(p) == 1]
    taken: list[tuple[int, ...]] = []
    while frontier and len(taken) < max_nodes:
        best = min(frontier, key=lambda p: (-score[p], len(p), p))
        frontier.remove(best)
        taken.append(best)
        if len(best) < max_depth:
            frontier += [p for p in score if len(p) == len(best) + 1 and p[:-1] == best]
    parents = {p[:-1] for p in taken}
    return [list(p) for p in taken if p not in parents]


class NaiveLRU:
    def __init__(self, key_len=1, max_per_key=8, max_keys=100_000, ngram=4):
        self.key_len, self.max_per_key, self.max_keys, self.ngram = key_len, max_per_key, max_keys, ngram
        self.keys: list[tuple] = []  # most recent first
        self.conts: dict[tuple, list[tuple]] = {}  # most recent first

    def _touch(self, k):
        self.keys.remove(k)
        self.keys.insert(0, k)

    def add(self, key, cont):
        k, c = tuple(key), tuple(cont)
        if k in self.conts:
            self._touch(k)
        else:
            self.conts[k] = []
            self.keys.insert(0, k)
            if self.max_keys is not None and len(self.keys) > self.max_keys:
                del self.conts[self.keys.pop()]
        lst = self.conts[k]
        if c in lst:
            lst.remove(c)
        lst.insert(0, c)
        if self.max_per_key is not None and len(lst) > self.max_per_key:
            lst.pop()

    def update(self, tokens):
        n = self.key_len + self.ngram - 1
        for i in range(len(tokens) - n + 1):
            self.add(tokens[i : i + self.key_len], tokens[i + self.key_len : i + n])

    def lookup(self, context, max_nodes, max_depth):
        if max_nodes < 1 or max_depth < 1 or len(context) < self.key_len:
            return []
        k = tuple(context[len(context) - self.key_len :])
        if k not in self.conts:
            return []
        self._touch(k)
        return naive_fit(self.conts[k], max_nodes, max_depth)

    def __len__(self):
        return sum(len(v) for v in self.conts.values())


class NaiveTrie:
    """path -> [input count, output count]; structural (zero-count) nodes are kept as in TriePool."""

    def __init__(self, branch_length: int):
        self.branch_length = branch_length
        self.counts: dict[tuple[int, ...], list[float]] = {}

    def update(self, tokens, source="output", start=0):
        b, n, s = self.branch_length, len(tokens), 0 if source == "input" else 1
        for i in range(max(0, start - b + 1), n):
            for j in range(i, min(i + b, n)):
                p = tuple(tokens[i : j + 1])
                if p not in self.counts:
                    self.counts[p] = [0, 0.0]
                    self.counts[p][s] += 1
                elif j >= start:
                    self.counts[p][s] += 1

    def end_request(self):
        for v in self.counts.values():
            v[0] = 0
        alive = set()
        for p, (i, o) in self.counts.items():
            if i + o > 0:
                alive.update(p[:j] for j in range(1, len(p) + 1))
        self.counts = {p: v for p, v in self.counts.items() if p in alive}


def naive_trie_lookup(counts: dict[tuple[int, ...], tuple[int, float]], context, max_query_length,
                      max_nodes, max_depth) -> list[list[int]]:
    if max_nodes < 1 or max_depth < 1:
        return []
    ctx = list(context)[-max_query_length:]
    for q in range(len(ctx), 0, -1):
        m = tuple(ctx[-q:])
        below = {p[q:]: sum(v) for p, v in counts.items() if len(p) > q and p[:q] == m}
        if m in counts and below:
            return best_first(below, max_nodes, max_depth)
    return []


def naive_sa_lookup(docs: list[list[int]], context, max_query_length, min_query_length,
                    max_nodes, max_depth) -> list[list[int]]:
    if max_nodes < 1 or max_depth < 1:
        return []
    ctx = list(context)[-max_query_length:]
    for q in range(len(ctx), min_query_length - 1, -1):
        pat = ctx[-q:]
        conts = [tuple(d[i + q : i + q + max_depth]) for d in docs for i in range(len(d) - q + 1)
                 if d[i : i + q] == pat]
        conts = [c for c in conts if c]
        if conts:
            counts = Counter(c[:j] for c in conts for j in range(1, len(c) + 1))
            return best_first(dict(counts), max_nodes, max_depth)
    return []
