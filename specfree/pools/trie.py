"""Trie pool after "Lookahead: An Inference Acceleration Framework for LLM with Lossless
Generation Accuracy" (Zhao et al., KDD 2024).

The trie holds every token window of up to ``branch_length`` tokens seen in prompts and
outputs, so a node's count is how often its path occurred as an n-gram. Prompt ("input")
counts belong to the current request and go at ``end_request``; output counts persist and
decay when output makes the trie outgrow ``max_nodes``; then the weakest nodes are evicted.

Layout, chosen by measurement: node columns (token, parent, depth, counts) are Python lists
indexed by node id, plus one children dict (token -> id) per node. Against one flat dict
keyed by (parent << 32 | token) over ``array.array`` columns, this is ~1.8x faster to insert
and to look up, for ~2x the memory (~300 bytes a node: 60 MB at 200k nodes); int-only dicts
are not tracked by the garbage collector, so their number costs no GC time. numpy takes over
for the rare whole-trie passes (decay, pruning, saving). Ids are renumbered when nodes go,
so a parent's id is always smaller than its children's.

A request's end drops the nodes its prompt alone held by unlinking them from their parents
(unreachable, as if gone; their ids become holes), not by renumbering the whole trie: that
rebuild cost ~20 ms per request on a trie of a few hundred requests' outputs, most of a
hybrid's drafting time. The holes are compacted away once they outnumber the live nodes, before
an eviction pass and before saving.
"""

from __future__ import annotations

import heapq
import struct
import zlib
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from specfree.errors import check_float, check_int
from specfree.pools._common import (
    as_tokens,
    leaf_paths,
    pack_header,
    read_header,
    write_file,
)
from specfree.pools.base import PoolFileError

_NAME = "trie_pool"
_PRUNE_BELOW = 1.0  # after ageing, a subtree whose counts all fall below this is pruned
_LOW_WATER = 0.9  # when ageing is not enough, evict down to this share of max_nodes
_TOKEN_LIMIT = 1 << 32  # more than any vocabulary; keeps ids well inside the int64 file format
_MAGIC = b"SPECFREE-TRIE\x00\x00\x00"
_VERSION = 1
# version, nodes (incl. root), max_nodes, branch_length, max_query_length, decay, payload crc, header crc
_HEADER = "<IQQIIdII"


def _np(column: list, dtype: type = np.int64) -> np.ndarray:
    return np.fromiter(column, dtype=dtype, count=len(column))


class TriePool:
    """Token trie with per-node prompt and output counts; best-first multi-branch lookup.

    ``max_nodes`` caps the trie (root excluded) after every public call. A lookup matches at
    most ``max_query_length`` context tokens, and the trie is ``branch_length`` deep, so at
    most ``branch_length - 1`` tokens follow the shortest match: pick branch_length >= the
    query length + the draft depth you want.
    """

    def __init__(self, max_nodes: int = 200_000, branch_length: int = 12,
                 max_query_length: int = 8, decay: float = 0.5):
        self.max_nodes = check_int(f"{_NAME}.max_nodes", max_nodes, low=1)
        self.branch_length = check_int(f"{_NAME}.branch_length", branch_length, low=1)
        self.max_query_length = check_int(f"{_NAME}.max_query_length", max_query_length, low=1)
        self.decay = check_float(f"{_NAME}.decay", decay, low=0.0, high=1.0, low_open=True, high_open=True)
        root = np.array([-1])
        self._set(root, root, np.zeros(1), np.zeros(1), np.zeros(1))  # node 0 is the root

    def _set(self, tok: np.ndarray, par: np.ndarray, depth: np.ndarray, tin: np.ndarray,
             out: np.ndarray) -> None:
        """Install node columns (parents before children) and rebuild the children dicts."""
        self._tok: list[int] = tok.tolist()
        self._par: list[int] = par.tolist()
        self._depth: list[int] = depth.tolist()
        self._in: list[int] = tin.astype(np.int64).tolist()  # prompt occurrences, this request only
        self._out: list[float] = out.astype(np.float64).tolist()  # output occurrences, decayed
        self._inputs: list[int] = np.flatnonzero(tin > 0).tolist()  # nodes with prompt counts
        self._holes: list[int] = []  # unlinked node ids (dropped, not yet compacted away)
        kids: list[dict[int, int]] = [{} for _ in self._tok]
        for i, (p, t) in enumerate(zip(self._par, self._tok)):
            if i:
                kids[p][t] = i
        self._kids = kids
        self._forget_tails()

    def _forget_tails(self) -> None:
        # The nodes of the last insert's shortest suffixes (lengths 1 .. branch_length - 1), with
        # those suffixes' tokens: the next insert that continues the same text extends them instead
        # of walking every window from the root again. Valid until node ids change or nodes go.
        self._tails: list[int] = []
        self._tail_tokens: tuple[int, ...] | None = None

    # --- learning ---------------------------------------------------------------------------

    def update(self, tokens: Sequence[int], *, source: str = "output", start: int = 0) -> None:
        """Count the n-grams (up to ``branch_length`` long) of ``tokens`` that END at index >= start.

        ``start=0`` learns every window of ``tokens``. A drafter that passes the last few
        committed tokens each step sets ``start`` to where the new ones begin: then each
        n-gram is counted once, exactly as if the whole output had been inserted in one call.
        Pass at least ``branch_length - 1`` old tokens before ``start`` so no n-gram is missed.
        An old prefix the trie no longer holds (it was pruned) is counted again when re-created.
        """
        if source not in ("input", "output"):
            raise ValueError(f"{_NAME}: source must be 'input' or 'output', got {source!r}")
        toks = as_tokens(tokens)
        if not 0 <= start <= len(toks):
            raise ValueError(f"{_NAME}: start must be in [0, len(tokens)={len(toks)}], got {start}")
        if toks and not (0 <= min(toks) and max(toks) < _TOKEN_LIMIT):
            raise ValueError(f"{_NAME}: token ids must be in [0, 2**32), got {min(toks)}..{max(toks)}")
        self._insert(toks, start, source == "input")

    def _insert(self, toks: list[int], start: int, is_input: bool) -> None:
        history = tuple(toks[max(0, start - self.branch_length + 1):start])
        if start == 0 or history == self._tail_tokens:
            # The text continues the last insert's (or starts fresh): extend its suffixes' nodes by
            # each new token, O(branch_length) a token rather than O(branch_length**2) a call.
            self._extend(toks, start, is_input, self._tails if start else [])
        else:
            self._walk(toks, start, is_input)

    def _extend(self, toks: list[int], start: int, is_input: bool, tails: list[int]) -> None:
        """Count, for each token from ``start`` on, the n-grams ending there: each suffix node in
        ``tails`` (lengths 1 .. branch_length - 1, shortest first) and the root gets that token as a child."""
        kids, tok, depth, inputs = self._kids, self._tok, self._depth, self._inputs
        counts = self._in if is_input else self._out
        last = self.branch_length - 1  # a suffix this long cannot grow into the trie
        for j in range(start, len(toks)):
            t = toks[j]
            grown = []
            for node in (0, *tails):
                child = kids[node].get(t)
                if child is None:
                    child = self._new_child(node, t)
                if is_input and not counts[child]:
                    inputs.append(child)
                counts[child] += 1
                if depth[child] <= last:
                    grown.append(child)
            tails = grown
            if len(tok) - 1 - len(self._holes) > self.max_nodes:
                self._shrink(age=not is_input)  # renumbers: walk the rest from the root
                self._walk(toks, j + 1, is_input)
                return
        self._tails = tails
        self._tail_tokens = tuple(toks[max(0, len(toks) - last):])

    def _new_child(self, node: int, t: int) -> int:
        """Add token ``t`` below ``node``, counts zero; its id."""
        child = len(self._tok)
        self._kids[node][t] = child
        self._kids.append({})
        self._tok.append(t)
        self._par.append(node)
        self._depth.append(self._depth[node] + 1)
        self._in.append(0)
        self._out.append(0.0)
        return child

    def _walk(self, toks: list[int], start: int, is_input: bool) -> None:
        """``_insert`` by walking every window that ends at ``start`` or later from the root."""
        n, cap = len(toks), self.branch_length
        for i in range(max(0, start - cap + 1), n):
            # Re-read the columns each window: _shrink below replaces them.
            kids, tok, inputs = self._kids, self._tok, self._inputs
            counts = self._in if is_input else self._out
            node = 0
            for j in range(i, min(i + cap, n)):
                t = toks[j]
                child = kids[node].get(t)
                if child is None:
                    child = self._new_child(node, t)
                    counts[child] += 1
                    if is_input:
                        inputs.append(child)
                elif j >= start:
                    if is_input and not counts[child]:
                        inputs.append(child)
                    counts[child] += 1
                node = child
            if len(tok) - 1 - len(self._holes) > self.max_nodes:
                self._shrink(age=not is_input)
        self._remember_tails(toks)

    def _remember_tails(self, toks: list[int]) -> None:
        """Find the nodes of ``toks``' suffixes shorter than ``branch_length`` (all exist after an insert)."""
        last = self.branch_length - 1
        suffix = toks[max(0, len(toks) - last):]
        tails = []
        for length in range(1, len(suffix) + 1):
            node: int | None = 0
            for t in suffix[len(suffix) - length:]:
                node = self._kids[node].get(t)
                if node is None:  # pruned by a shrink at the very end: nothing to extend
                    self._forget_tails()
                    return
            tails.append(node)
        self._tails, self._tail_tokens = tails, tuple(suffix)

    def begin_request(self, prompt: Sequence[int]) -> None:
        """Learn the prompt's windows as "input" (first dropping any unfinished request's)."""
        if self._inputs:
            self.end_request()
        self.update(prompt, source="input")

    def end_request(self) -> None:
        """Drop all prompt counts; nodes whose whole subtree is left without counts go."""
        if not self._inputs:
            return
        tin, tout, tok, par, kids = self._in, self._out, self._tok, self._par, self._kids
        gone: set[int] = set()
        for i in sorted(self._inputs, reverse=True):  # children (larger ids) before their parents
            tin[i] = 0
            if tout[i] == 0.0 and all(c in gone for c in kids[i].values()):
                gone.add(i)
        for i in gone:
            kids[par[i]].pop(tok[i], None)
        if gone:
            self._forget_tails()
        self._holes += gone
        self._inputs = []
        if len(self._holes) > len(tok) // 2:
            self.compact()

    def compact(self) -> None:
        """Renumber the live nodes, dropping the holes that requests' ends left."""
        if self._holes:
            par, depth = _np(self._par), _np(self._depth)
            self._compact(self._live(), _np(self._in, np.float64), _np(self._out, np.float64), par, depth)

    def _live(self) -> np.ndarray:
        live = np.ones(len(self._tok), dtype=bool)
        live[self._holes] = False
        return live

    # --- bounding memory --------------------------------------------------------------------

    def _alive(self, strong: np.ndarray, par: np.ndarray, depth: np.ndarray) -> np.ndarray:
        """Nodes that are strong or have a strong descendant (so a kept node keeps its parent)."""
        alive = strong.copy()
        alive[0] = True
        for d in range(self.branch_length, 0, -1):
            idx = np.flatnonzero(alive & (depth == d))
            alive[par[idx]] = True
        return alive

    def _shrink(self, age: bool) -> None:
        """Get back under ``max_nodes``: age the output counts, then evict the weakest nodes.

        Ageing (one ``decay`` round, then pruning what falls below _PRUNE_BELOW) happens only
        when output overflowed the trie: a long prompt is request-local and should not wipe
        the output history. Deviation from decaying "until under budget": repeated rounds
        would also erase the history of every surviving node; evicting the weakest instead
        reaches the budget while ageing the rest only once per overflow.
        """
        tin, out = _np(self._in, np.float64), _np(self._out, np.float64)
        par, depth = _np(self._par), _np(self._depth)
        keep = self._live()
        if age:
            out *= self.decay
            keep = self._alive(tin + out >= _PRUNE_BELOW, par, depth)
        if keep.sum() - 1 > self.max_nodes:
            self._evict_weakest(keep, tin + out, par, depth)
        self._compact(keep, tin, out, par, depth)

    def _evict_weakest(self, keep: np.ndarray, total: np.ndarray, par: np.ndarray,
                       depth: np.ndarray) -> None:
        """Drop nodes with the weakest subtrees (deepest, then oldest first) to the low water.

        Ordering by (strongest count in the subtree, -depth) puts every node after its
        descendants, so dropping a prefix of that order never orphans a node. Going down to
        _LOW_WATER rather than to max_nodes spares a long prompt one eviction per window.
        """
        best = np.where(keep, total, -1.0)
        for d in range(self.branch_length, 0, -1):
            idx = np.flatnonzero(keep & (depth == d))
            np.maximum.at(best, par[idx], best[idx])
        cand = np.flatnonzero(keep)[1:]  # never the root
        order = np.lexsort((cand, -depth[cand], best[cand]))
        target = int(self.max_nodes * _LOW_WATER)
        keep[cand[order[: max(0, len(cand) - target)]]] = False

    def _compact(self, keep: np.ndarray, tin: np.ndarray, out: np.ndarray, par: np.ndarray,
                 depth: np.ndarray) -> None:
        """Keep the ``keep`` nodes (ancestor-closed), renumbered in their old order."""
        idx = np.flatnonzero(keep)
        new_id = np.cumsum(keep) - 1
        par = par[idx]
        par[1:] = new_id[par[1:]]
        tails, tail_tokens = self._tails, self._tail_tokens
        self._set(_np(self._tok)[idx], par, depth[idx], tin[idx], out[idx])
        if tail_tokens is not None and all(keep[t] for t in tails):  # still there, renumbered
            self._tails, self._tail_tokens = new_id[tails].tolist(), tail_tokens

    # --- drafting ---------------------------------------------------------------------------

    def lookup(self, context: Sequence[int], max_nodes: int, max_depth: int) -> list[list[int]]:
        """Best-first subtree below the longest matched context suffix that has children.

        Nodes are taken by (count desc, depth asc, path tokens asc), count = input + output;
        candidates are the leaves of the taken subtree in that same order.
        """
        if max_nodes < 1 or max_depth < 1:
            return []
        ctx = as_tokens(context[max(0, len(context) - self.max_query_length):])
        kids = self._kids
        for q in range(len(ctx), 0, -1):
            node: int | None = 0
            for t in ctx[len(ctx) - q:]:
                node = kids[node].get(t)
                if node is None:
                    break
            if node is not None and kids[node]:
                return self._expand(node, max_nodes, max_depth)
        return []

    def _expand(self, match: int, max_nodes: int, max_depth: int) -> list[list[int]]:
        kids, tin, tout = self._kids, self._in, self._out
        heap: list[tuple[float, int, tuple[int, ...], int, int]] = []

        def push_children(node: int, path: tuple[int, ...], sel: int, room: int) -> None:
            scored = [(-(tin[c] + tout[c]), t, c) for t, c in kids[node].items()]
            if len(scored) > room:  # only the best `room` children can still be taken
                scored = heapq.nsmallest(room, scored)
            for score, t, c in scored:
                heapq.heappush(heap, (score, len(path) + 1, path + (t,), c, sel))

        push_children(match, (), -1, max_nodes)
        toks: list[int] = []
        parents: list[int] = []
        while heap and len(toks) < max_nodes:
            _, d, path, c, sel = heapq.heappop(heap)
            toks.append(path[-1])
            parents.append(sel)
            if d < max_depth and kids[c]:
                push_children(c, path, len(toks) - 1, max_nodes - len(toks))
        return leaf_paths(toks, parents)

    # --- inspection and files ---------------------------------------------------------------

    def to_dict(self) -> dict[tuple[int, ...], tuple[int, float]]:
        """Every node's path -> (input count, output count); for tests and debugging."""
        paths: list[tuple[int, ...]] = [()]
        for i in range(1, len(self._tok)):
            paths.append(paths[self._par[i]] + (self._tok[i],))
        holes = set(self._holes)
        return {paths[i]: (self._in[i], self._out[i]) for i in range(1, len(paths)) if i not in holes}

    def __len__(self) -> int:
        return len(self._tok) - 1 - len(self._holes)

    def save(self, path: str | Path) -> None:
        self.compact()
        payload = [np.asarray(column, dtype=dtype).tobytes() for column, dtype in
                   ((self._tok, "<i8"), (self._par, "<i8"), (self._in, "<i8"), (self._out, "<f8"))]
        crc = 0
        for chunk in payload:
            crc = zlib.crc32(chunk, crc)
        header = pack_header(_HEADER, _VERSION, len(self._tok), self.max_nodes, self.branch_length,
                             self.max_query_length, self.decay, crc)
        write_file(path, _MAGIC, header, payload)

    @classmethod
    def load(cls, path: str | Path) -> TriePool:
        """Read a file written by ``save``; anything else raises PoolFileError naming the file."""
        version, n, max_nodes, branch, query, decay, crc, _ = read_header(path, _MAGIC, _HEADER, "trie pool")
        if version != _VERSION:
            raise PoolFileError(f"{path}: trie pool file version {version}, this specfree reads {_VERSION}")
        with open(path, "rb") as f:
            f.seek(len(_MAGIC) + struct.calcsize(_HEADER))
            data = f.read()
        if len(data) != 32 * n:
            problem = "truncated" if len(data) < 32 * n else "corrupted (trailing bytes in)"
            raise PoolFileError(f"{path}: {problem} trie pool file: {n} nodes need {32 * n} "
                                f"payload bytes, found {len(data)}")
        if zlib.crc32(data) != crc:
            raise PoolFileError(f"{path}: corrupted trie pool file (payload checksum mismatch)")
        try:
            pool = cls(max_nodes, branch, query, decay)
        except ValueError as e:
            raise PoolFileError(f"{path}: corrupted trie pool file: {e}") from e
        tok, par, tin = (np.frombuffer(data, "<i8", n, k * 8 * n).astype(np.int64) for k in range(3))
        out = np.frombuffer(data, "<f8", n, 24 * n).astype(np.float64)
        problem = _check_arrays(tok, par, tin, out, max_nodes)
        if problem is None:
            depth = _depths(par, branch)
            if depth is None:
                problem = f"a path is deeper than branch_length={branch}"
            else:
                pool._set(tok, par, depth, tin, out)
                if sum(len(k) for k in pool._kids) != n - 1:
                    problem = "two nodes share a parent and token"
        if problem is not None:
            raise PoolFileError(f"{path}: corrupted trie pool file: {problem}")
        return pool


def _depths(par: np.ndarray, branch_length: int) -> np.ndarray | None:
    """Node depths from parent links (parents precede children), or None if deeper than allowed."""
    depth = np.zeros(len(par), dtype=np.int64)
    for _ in range(branch_length + 1):  # each round fixes one more level
        new = depth.copy()
        new[1:] = depth[par[1:]] + 1
        if np.array_equal(new, depth):
            return depth
        depth = new
    return None


def _check_arrays(tok: np.ndarray, par: np.ndarray, tin: np.ndarray, out: np.ndarray,
                  max_nodes: int) -> str | None:
    n = len(tok)
    if n < 1 or tok[0] != -1 or par[0] != -1:
        return "missing root node"
    if n - 1 > max_nodes:
        return f"{n - 1} nodes exceed max_nodes={max_nodes}"
    if ((tok[1:] < 0) | (tok[1:] >= _TOKEN_LIMIT)).any():
        return "token id out of range"
    if ((par[1:] < 0) | (par[1:] >= np.arange(1, n))).any():
        return "a node's parent does not precede it"
    if (tin < 0).any() or not np.isfinite(out).all() or (out < 0).any():
        return "negative or non-finite counts"
    return None
