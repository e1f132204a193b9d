"""Suffix trees for SuffixDecoding (Oliaro et al., NeurIPS 2025; vLLM's ``suffix`` method).

``SuffixTrie`` holds every suffix of its sequences cut to ``max_tree_depth`` tokens, with a count
per node: a node's count is how often its path occurs in the sequences, so a child's count over
its parent's is the empirical chance that the path continues with the child's token. The paper
uses a path-compressed suffix tree (linear memory); a depth-bounded trie answers the same queries
(longest suffix match, continuation counts) with simpler code, at up to ``max_tree_depth`` nodes per
token (about 290 bytes each in Python), which is why the global store also has a node cap.

``SuffixTreePool`` is the global store: previous requests' outputs, at most ``max_cached_requests``
of them (and at most ``max_nodes`` trie nodes); adding one past a bound evicts the oldest
requests' whole contribution. It saves to and loads from its own file format (``save``/``load``).
"""

from __future__ import annotations

import hashlib
import heapq
import struct
import zlib
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from specfree.errors import ConfigError, check_int
from specfree.files import write_atomic
from specfree.pools._common import as_tokens, leaf_paths

_NAME = "suffix_tree"


@dataclass
class Draft:
    """A speculation tree in best-first order: ``parents[i]`` is an earlier index or -1 (the root)."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)  # each node's chance to be emitted (path product)
    match_len: int = 0

    @property
    def score(self) -> float:
        """Expected accepted tokens: the sum of the nodes' probabilities."""
        return sum(self.probs)

    def candidates(self) -> list[list[int]]:
        return leaf_paths(self.tokens, self.parents)


class SuffixTrie:
    """Counted suffix trie of depth ``max_tree_depth`` over one or more token sequences.

    Two node columns in Python lists, a children dict (token -> node) and a count; ids of removed
    nodes are reused (``_free``), so the lists never outgrow the largest trie held.
    """

    def __init__(self, max_tree_depth: int = 24):
        self.max_tree_depth = check_int(f"{_NAME}.max_tree_depth", max_tree_depth, low=1)
        self._kids: list[dict[int, int]] = [{}]  # node 0 is the root
        self._count: list[int] = [0]
        self._free: list[int] = []
        self._size = 0
        self._open: list[tuple[int, int]] = []  # (node, length) of the suffixes of what ``append`` grew

    def __len__(self) -> int:
        """Nodes held, the root excluded."""
        return self._size

    def insert(self, tokens: Sequence[int]) -> None:
        """Count every suffix of ``tokens`` (cut to the depth) as a sequence of its own."""
        self.grow([], tokens)

    def remove(self, tokens: Sequence[int]) -> None:
        """Undo ``insert(tokens)``: nodes whose count falls to zero go."""
        toks, depth = as_tokens(tokens), self.max_tree_depth
        kids, count = self._kids, self._count
        for i in range(len(toks)):
            node = 0
            for t in toks[i : i + depth]:
                child = kids[node][t]
                count[child] -= 1
                if count[child] == 0:  # its whole subtree on this path is at zero too: drop it
                    del kids[node][t]
                    self._drop(child)
                    break
                node = child

    def _drop(self, node: int) -> None:
        stack = [node]
        while stack:
            n = stack.pop()
            stack.extend(self._kids[n].values())
            self._kids[n] = {}
            self._free.append(n)
            self._size -= 1

    def append(self, tokens: Sequence[int]) -> None:
        """Extend the one sequence this trie grows token by token (a request's prompt and output)."""
        self._open = self.grow(self._open, tokens)

    def own_matches(self) -> list[int]:
        """``matches`` of the sequence ``append`` grew, without a search: its own suffixes."""
        return suffix_nodes(self._open)

    def grow(self, open_: list[tuple[int, int]], tokens: Sequence[int]) -> list[tuple[int, int]]:
        """Extend a sequence whose suffixes are ``open_`` ((node, length), longest first; ``[]`` for a
        new one); returns them after ``tokens``. Each new token extends every suffix shorter than
        the depth and starts one: O(depth) per token, the same counts as ``insert`` of the whole
        sequence, so several sequences can grow in one trie side by side, each with its own list."""
        kids_of, count, free = self._kids, self._count, self._free
        depth, created = self.max_tree_depth, 0
        for t in as_tokens(tokens):
            grown = []
            for node, d in [*open_, (0, 0)]:
                if d == depth:
                    continue
                kids = kids_of[node]
                child = kids.get(t)
                if child is None:  # a new node, inline: this loop is the drafter's hottest
                    created += 1
                    if free:
                        child = free.pop()
                        kids_of[child], count[child] = {}, 1
                    else:
                        child = len(count)
                        kids_of.append({})
                        count.append(1)
                    kids[t] = child
                else:
                    count[child] += 1
                grown.append((child, d + 1))
            open_ = grown
        self._size += created
        return open_

    # --- queries ------------------------------------------------------------------------------

    def find(self, pattern: Sequence[int]) -> int | None:
        """The node whose path is ``pattern``, or None."""
        node: int | None = 0
        for t in pattern:
            node = self._kids[node].get(t)
            if node is None:
                return None
        return node

    def count(self, pattern: Sequence[int]) -> int:
        """How often ``pattern`` (at most ``max_tree_depth`` long) occurs in the sequences held."""
        node = self.find(as_tokens(pattern))
        return 0 if node is None else self._count[node]

    def continuations(self, pattern: Sequence[int]) -> dict[int, int]:
        """Token -> how often it follows ``pattern``."""
        node = self.find(as_tokens(pattern))
        return {} if node is None else {t: self._count[c] for t, c in self._kids[node].items()}

    def longest_match(self, context: Sequence[int]) -> int:
        """Length of the longest suffix of ``context`` (at most the depth) that occurs."""
        return len(self.matches(context))

    def matches(self, context: Sequence[int], known: Sequence[int] = ()) -> list[int]:
        """The nodes of the suffixes of ``context`` (at most the depth long) that occur, shortest
        first: ``[m - 1]`` is the m-token suffix's. ``known``: the first of them, already found
        (``own_matches``, a streamed response's suffixes); the rest are searched from the root."""
        ctx = as_tokens(context[max(0, len(context) - self.max_tree_depth) :])
        nodes = list(known[: len(ctx)])
        for m in range(len(nodes) + 1, len(ctx) + 1):
            node = self.find(ctx[len(ctx) - m :])
            if node is None:
                break  # a longer suffix contains this one, so it does not occur either
            nodes.append(node)
        return nodes

    def speculate(self, context: Sequence[int], max_spec_tokens: int, max_spec_factor: float,
                  max_spec_offset: float, min_token_prob: float, max_depth: int,
                  matches: Sequence[int] | None = None) -> Draft:
        """The paper's speculation: for every suffix of ``context`` that occurs (length m), a tree
        grown greedily by path probability, at most ``min(max_spec_tokens, max_spec_factor * m +
        max_spec_offset)`` nodes, none below ``min_token_prob``; the tree with the highest score
        wins (a longer match on a tie). ``matches``: ``self.matches(context)`` when the caller
        has it cheaper."""
        nodes = self.matches(context) if matches is None else matches
        best = Draft()
        # Longest match first: a tree of `size` nodes scores at most `size` (every probability is at
        # most 1) and sizes shrink with m, so once one scores `size` no shorter match can win.
        for m in range(len(nodes), 0, -1):
            size = min(max_spec_tokens, int(m * max_spec_factor + max_spec_offset + 1e-6))
            if size <= 0 or (best.tokens and size <= best.score):
                break
            node = nodes[m - 1]
            if not self._kids[node]:
                continue
            draft = self._grow(node, size, min_token_prob, max_depth)
            draft.match_len = m
            if draft.tokens and draft.score > best.score:
                best = draft
        return best

    def _grow(self, match: int, size: int, min_prob: float, max_depth: int) -> Draft:
        kids, count = self._kids, self._count
        draft = Draft()
        order = 0  # ties: the earlier pushed first, so the result does not depend on heap internals
        heap: list[tuple[float, int, int, int, int, int]] = []  # (-prob, order, node, token, parent index, depth)

        # The product of child / parent counts down a path telescopes to count(node) / count(match):
        # computed that way, a probability exactly at min_token_prob is not lost to rounding.
        total = count[match]

        def push(node: int, at: int, depth: int) -> None:
            nonlocal order
            for token, child in kids[node].items():
                p = count[child] / total
                if p >= min_prob:
                    heapq.heappush(heap, (-p, order, child, token, at, depth))
                    order += 1

        push(match, -1, 1)
        while heap and len(draft.tokens) < size:
            neg, _, node, token, parent, depth = heapq.heappop(heap)
            draft.tokens.append(token)
            draft.parents.append(parent)
            draft.probs.append(-neg)
            if depth < max_depth:
                push(node, len(draft.tokens) - 1, depth + 1)
        return draft


def suffix_nodes(open_: list[tuple[int, int]]) -> list[int]:
    """A grown sequence's suffixes (``grow``'s list, longest first) as ``matches`` lists them: nodes,
    shortest first."""
    return [node for node, _ in reversed(open_)]


# --- the global store -------------------------------------------------------------------------

_MAGIC = b"SPECFREE-SUFFIX\x00"
_VERSION = 1
# version, vocab size, tokenizer fingerprint (16 bytes), max_tree_depth, requests, tokens,
# payload crc, header crc
_HEADER = "<IQ16sIQQII"


class SuffixTreePool:
    """Previous requests' outputs in one ``SuffixTrie``, oldest evicted first.

    As a pool (``pool=suffix_tree``) any drafter can use it: ``update`` caches a sequence (one
    request's output), ``lookup`` drafts the speculation tree of ``SuffixTrie.speculate`` with
    ``max_spec_factor`` unbounded (``max_nodes`` decides) and ``min_token_prob`` 0.1.

    A request either adds its output when it ends (``add_request``) or streams it in while it runs
    (``open_response``, ``extend_response``, ``close_response``), as vLLM's ``suffix`` does: then
    concurrent requests (vLLM's batch rows) draft from each other's text as it is written. A
    response still open is never evicted; once closed it counts as a cached request.
    """

    shared_across_requests = True

    def __init__(self, max_tree_depth: int = 24, max_cached_requests: int = 10000, max_nodes: int = 400_000):
        self.trie = SuffixTrie(max_tree_depth)
        self.max_cached_requests = check_int(f"{_NAME}.max_cached_requests", max_cached_requests, low=0)
        self.max_nodes = check_int(f"{_NAME}.max_nodes", max_nodes, low=1)
        self.requests: deque[list[int]] = deque()
        self.live: dict[int, tuple[list[int], list[tuple[int, int]]]] = {}  # handle -> (tokens, open suffixes)
        self._handles = 0

    @property
    def max_tree_depth(self) -> int:
        return self.trie.max_tree_depth

    def __len__(self) -> int:
        return len(self.trie)

    def add_request(self, tokens: Sequence[int]) -> None:
        """Cache one request's output; then evict the oldest until both bounds hold."""
        toks = as_tokens(tokens)
        if not toks or self.max_cached_requests == 0:
            return
        self.requests.append(toks)
        self.trie.insert(toks)
        self._evict()

    def open_response(self) -> int:
        """Start streaming a request's output into the store; returns its handle."""
        self._handles += 1
        self.live[self._handles] = ([], [])
        return self._handles

    def extend_response(self, handle: int, tokens: Sequence[int]) -> None:
        """Add the next output tokens of an open response (a handle ``clear`` dropped is ignored)."""
        if handle in self.live and self.max_cached_requests:
            toks, open_ = self.live[handle]
            new = as_tokens(tokens)
            toks += new
            self.live[handle] = (toks, self.trie.grow(open_, new))

    def response_matches(self, handle: int | None) -> list[int]:
        """The nodes of an open response's own suffixes, shortest first (``SuffixTrie.matches``'s
        ``known``): they occur, since the response is in the trie."""
        return suffix_nodes(self.live[handle][1]) if handle in self.live else []

    def close_response(self, handle: int) -> None:
        """The response is complete: it becomes a cached request (and may evict older ones)."""
        toks, _ = self.live.pop(handle, ([], []))
        if toks:
            self.requests.append(toks)
            self._evict()

    def _evict(self) -> None:
        while self.requests and (len(self.requests) > self.max_cached_requests or len(self.trie) > self.max_nodes):
            self.trie.remove(self.requests.popleft())

    def clear(self) -> None:
        """Forget every cached request and every open response."""
        self.trie = SuffixTrie(self.max_tree_depth)
        self.requests.clear()
        self.live.clear()

    # --- the Pool contract ------------------------------------------------------------------

    def update(self, tokens: Sequence[int], *, source: str = "output") -> None:
        if source == "output":
            self.add_request(tokens)

    def lookup(self, context: Sequence[int], max_nodes: int, max_depth: int) -> list[list[int]]:
        if max_nodes < 1 or max_depth < 1:
            return []
        return self.trie.speculate(context, max_nodes, float(max_nodes), 0.0, 0.1, max_depth).candidates()

    def begin_request(self, prompt: Sequence[int]) -> None:
        """The global store holds outputs only."""

    def end_request(self) -> None:
        pass

    # --- files --------------------------------------------------------------------------------

    def save(self, path: str | Path, vocab_size: int, fingerprint: bytes) -> None:
        """Write the cached requests (oldest first) atomically: a temp file in the same folder,
        then a rename, so a crash or a second process never leaves half a file."""
        lengths = np.array([len(r) for r in self.requests], dtype="<i8")
        tokens = np.array([t for r in self.requests for t in r], dtype="<i8")
        payload = lengths.tobytes() + tokens.tobytes()
        body = struct.pack(_HEADER[:-1], _VERSION, vocab_size, fingerprint[:16].ljust(16, b"\0"),
                           self.max_tree_depth, len(lengths), len(tokens), zlib.crc32(payload))
        path = Path(path).expanduser()
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, _MAGIC + body + struct.pack("<I", zlib.crc32(body)) + payload)

    def load(self, path: str | Path, vocab_size: int, fingerprint: bytes) -> None:
        """Replace the cached requests with those of a file ``save`` wrote for the same tokenizer.

        A file that is not one, is truncated or corrupt, or comes from another tokenizer raises
        one ConfigError naming the file, the problem and the fix, and changes nothing."""
        requests = read_state(path, vocab_size, fingerprint)
        self.clear()
        for r in requests:
            self.add_request(r)


def read_state(path: str | Path, vocab_size: int, fingerprint: bytes) -> list[list[int]]:
    """The requests a state file holds, every part checked (see ``SuffixTreePool.load``)."""
    fix = f"delete {path} or point state_file elsewhere (reset=true starts empty and overwrites it)"

    def bad(problem: str) -> ConfigError:
        return ConfigError(f"suffix state file {path}: {problem}; {fix}")

    try:
        data = Path(path).expanduser().read_bytes()
    except OSError as e:
        raise bad(f"cannot be read ({e.strerror})") from None
    size = len(_MAGIC) + struct.calcsize(_HEADER)
    if data[: len(_MAGIC)] != _MAGIC:
        raise bad("not a specfree suffix state file (bad magic bytes)")
    if len(data) < size:
        raise bad("truncated (the header is incomplete)")
    body = data[len(_MAGIC) : size - 4]
    version, vocab, fp, _, n_req, n_tok, crc, head_crc = struct.unpack(_HEADER, data[len(_MAGIC) : size])
    if zlib.crc32(body) != head_crc:
        raise bad("corrupt (header checksum mismatch)")
    if version != _VERSION:
        raise bad(f"format version {version}, this specfree reads version {_VERSION}")
    if vocab != vocab_size or fp != fingerprint[:16].ljust(16, b"\0"):
        what = f"a vocabulary of {vocab} ids, this model has {vocab_size}" if vocab != vocab_size \
            else "a tokenizer with another vocabulary (fingerprint mismatch)"
        raise bad(f"written for another tokenizer ({what})")
    payload = data[size:]
    need = 8 * (n_req + n_tok)
    if len(payload) != need:
        raise bad(f"truncated ({need} payload bytes expected, {len(payload)} found)" if len(payload) < need
                  else "corrupt (trailing bytes)")
    if zlib.crc32(payload) != crc:
        raise bad("corrupt (payload checksum mismatch)")
    lengths = np.frombuffer(payload, "<i8", n_req)
    tokens = np.frombuffer(payload, "<i8", n_tok, 8 * n_req)
    if (lengths < 0).any() or int(lengths.sum()) != n_tok or ((tokens < 0) | (tokens >= vocab_size)).any():
        raise bad("corrupt (lengths or token ids out of range)")
    bounds = np.concatenate([[0], np.cumsum(lengths)])
    return [tokens[a:b].tolist() for a, b in zip(bounds[:-1], bounds[1:])]


def tokenizer_fingerprint(tokenizer) -> bytes:
    """16 bytes identifying a tokenizer's vocabulary (every token string and its id); empty
    without a tokenizer (token ids given directly), where only the vocabulary size is checked."""
    if tokenizer is None:
        return b""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    digest = hashlib.blake2b(digest_size=16)
    for token, index in vocab:
        digest.update(f"{index}\t{token}\n".encode("utf-8", "surrogatepass"))
    return digest.digest()
