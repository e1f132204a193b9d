"""Suffix-array pool over a static token datastore: REST (He et al. 2024) without training.

Documents are concatenated, each followed by a separator (-1) that no query token equals, so
a match never spans two documents and a continuation stops at its document's end. A lookup
finds the longest context suffix that occurs (binary search over the suffix array), then
counts what followed its occurrences and drafts the most frequent continuations as a tree.

For prompt lookup over a very long prompt, index the prompt alone:
``SuffixArrayPool.build([prompt_ids]).lookup(context, ...)`` drafts what most often followed
the context's tail in the prompt, and ``occurrences(pattern)`` gives match positions (their
maximum is the most recent one).
"""

from __future__ import annotations

import heapq
import os
import struct
import zlib
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import numpy as np
from pydivsufsort import divsufsort

from specfree.errors import check_int
from specfree.pools._common import (
    leaf_paths,
    pack_header,
    read_header,
    write_file,
)
from specfree.pools.base import PoolFileError

try:
    from numba import njit
except ImportError:  # pragma: no cover - same results, ~100x slower lookups
    def njit(*args, **kwargs):
        return lambda f: f

_NAME = "suffix_array_pool"
_SEP = -1
_MAGIC = b"SPECFREE-SA\x00\x00\x00\x00\x00"
_VERSION = 1
# version, sa itemsize, text length, max_query_length, min_query_length, max_occurrences,
# text crc, sa crc, header crc
_HEADER = "<IIQIIQIII"
_DATA = 128  # the text starts here; the suffix array at the next multiple of 64 (mmap-aligned)

Progress = Callable[[str, float], None]  # (stage, fraction of the build done)


@njit(cache=True, nogil=True)
def _compare(text, pos, pattern):  # pragma: no cover - compiled
    """-1 / 0 / 1: the suffix at ``pos`` sorts before / starts with / sorts after ``pattern``."""
    n = text.shape[0]
    for k in range(pattern.shape[0]):
        if pos + k >= n:
            return -1
        t = text[pos + k]
        if t != pattern[k]:
            return -1 if t < pattern[k] else 1
    return 0


@njit(cache=True, nogil=True)
def _bounds(text, sa, pattern):  # pragma: no cover - compiled
    """[lo, hi): the suffix-array rows whose suffix starts with ``pattern``."""
    lo, hi = 0, sa.shape[0]
    while lo < hi:
        mid = (lo + hi) // 2
        if _compare(text, sa[mid], pattern) < 0:
            lo = mid + 1
        else:
            hi = mid
    first, hi = lo, sa.shape[0]
    while lo < hi:
        mid = (lo + hi) // 2
        if _compare(text, sa[mid], pattern) <= 0:
            lo = mid + 1
        else:
            hi = mid
    return first, lo


@njit(cache=True, nogil=True)
def _longest_match(text, sa, ctx, min_len, max_len):  # pragma: no cover - compiled
    """(L, lo, hi) for the longest ctx[-L:] with min_len <= L <= max_len that occurs, or L=0.

    A suffix that occurs implies its own suffixes occur, so L can be binary searched.
    """
    m = ctx.shape[0]
    lo, hi = _bounds(text, sa, ctx[m - min_len:])
    if lo == hi:
        return 0, 0, 0
    best, best_lo, best_hi = min_len, lo, hi
    a, b = min_len + 1, max_len
    while a <= b:
        mid = (a + b) // 2
        lo, hi = _bounds(text, sa, ctx[m - mid:])
        if lo < hi:
            best, best_lo, best_hi = mid, lo, hi
            a = mid + 1
        else:
            b = mid - 1
    return best, best_lo, best_hi


@njit(cache=True, nogil=True)
def _continuation_tree(text, sa, lo, hi, cap, skip, depth, max_nodes):  # pragma: no cover - compiled
    """Best-first tree of what follows ``skip`` tokens into the suffixes sa[lo:hi].

    At most ``cap`` occurrences are read, evenly spaced over the range. The range is sorted,
    so a node (a shared continuation prefix) is a run of consecutive rows and its count is
    the run's length. Nodes are made depth by depth, row by row: their index order is
    (depth, tokens) order, and a node's children get consecutive indices. Returns the taken
    nodes' tokens and parents (-1: child of the match; else an index into the taken nodes)
    in the order taken: (count desc, depth asc, tokens asc).
    """
    total = hi - lo
    m = min(total, cap)
    rows = np.empty((m, depth), dtype=np.int32)
    for r in range(m):
        p = sa[lo + (r * total) // m] + skip
        for d in range(depth):
            t = text[p + d]  # the text ends with a separator, so p + d stays inside
            rows[r, d] = t
            if t == -1:
                rows[r, d:] = -1  # nothing after a document's end
                break
    # Node columns; np.empty because every field is written when its node is made.
    size = m * depth
    count = np.empty(size, dtype=np.int64)
    parent = np.empty(size, dtype=np.int64)
    first_child = np.empty(size, dtype=np.int64)
    n_children = np.empty(size, dtype=np.int64)
    node_depth = np.empty(size, dtype=np.int64)
    token = np.empty(size, dtype=np.int64)
    prev = np.full(m, -1, dtype=np.int64)  # each row's node at the previous depth
    cur = np.empty(m, dtype=np.int64)
    k = 0
    for d in range(depth):
        made = False
        for r in range(m):
            t = rows[r, d]
            if t == -1:
                cur[r] = -1
            elif r > 0 and cur[r - 1] != -1 and prev[r] == prev[r - 1] and t == rows[r - 1, d]:
                cur[r] = cur[r - 1]
                count[cur[r]] += 1
            else:
                count[k], parent[k], node_depth[k], token[k] = 1, prev[r], d, t
                first_child[k], n_children[k] = -1, 0
                if prev[r] >= 0:
                    if first_child[prev[r]] == -1:
                        first_child[prev[r]] = k
                    n_children[prev[r]] += 1
                cur[r] = k
                k += 1
                made = True
        if not made:
            break
        prev, cur = cur, prev
    heap = [(0, 0)]  # (-count, node): ties go to the smaller index = shallower, smaller tokens
    heap.pop()
    for i in range(k):
        if node_depth[i] > 0:
            break
        heap.append((-count[i], i))
    heapq.heapify(heap)
    taken = np.empty(k, dtype=np.int64)  # node -> its position among the taken (parents first)
    out_token = np.empty(min(max_nodes, k), dtype=np.int64)
    out_parent = np.empty(min(max_nodes, k), dtype=np.int64)
    n = 0
    while heap and n < max_nodes:
        _, i = heapq.heappop(heap)
        out_token[n] = token[i]
        out_parent[n] = -1 if parent[i] < 0 else taken[parent[i]]
        taken[i] = n
        n += 1
        for c in range(first_child[i], first_child[i] + n_children[i]):
            heapq.heappush(heap, (-count[c], c))
    return out_token[:n], out_parent[:n]


def suffix_array(text: np.ndarray) -> np.ndarray:
    """Suffix array of an int32 token array (separators = -1 sort first), via divsufsort.

    divsufsort sorts bytes, so each token is written as a fixed-width big-endian number
    (token + 1, 1 to 4 bytes): comparing bytes from token-aligned offsets then compares
    tokens, and we keep only the aligned suffixes.
    """
    n = len(text)
    keys = text.view(np.uint32) + np.uint32(1)  # the separator wraps to 0, the smallest key
    width = max(1, (int(keys.max()).bit_length() + 7) // 8)
    buf = np.ascontiguousarray(keys.astype(">u4").view(np.uint8).reshape(n, 4)[:, 4 - width:]).reshape(-1)
    del keys
    raw = divsufsort(buf)
    del buf
    dtype = np.int32 if n < 2**31 else np.int64
    if width == 1:
        return np.asarray(raw, dtype=dtype)
    sa = np.empty(n, dtype=dtype)
    done = 0
    for s in range(0, len(raw), 1 << 22):  # filter in chunks to keep the peak memory low
        chunk = raw[s : s + (1 << 22)]
        chunk = chunk[chunk % width == 0] // width
        sa[done : done + len(chunk)] = chunk
        done += len(chunk)
    assert done == n
    return sa


class SuffixArrayPool:
    """Drafts the most frequent continuations of the longest matching context suffix.

    ``text`` is the int32 datastore (documents each followed by -1) and ``sa`` its suffix
    array; use ``build`` or ``load`` rather than making them by hand. A match with more than
    ``max_occurrences`` occurrences is counted on that many, evenly spaced over its
    suffix-array range: the range is sorted by continuation, so the sample keeps proportions.
    """

    def __init__(self, text: np.ndarray, sa: np.ndarray, *, max_query_length: int = 16,
                 min_query_length: int = 2, max_occurrences: int = 4096):
        self.max_query_length = check_int(f"{_NAME}.max_query_length", max_query_length, low=1)
        self.min_query_length = check_int(f"{_NAME}.min_query_length", min_query_length,
                                          low=1, high=self.max_query_length)
        self.max_occurrences = check_int(f"{_NAME}.max_occurrences", max_occurrences, low=1)
        text, sa = np.asarray(text), np.asarray(sa)
        if text.dtype != np.int32 or text.ndim != 1 or len(text) == 0 or text[-1] != _SEP:
            raise ValueError(f"{_NAME}: text must be a 1-D int32 array ending with {_SEP}")
        if sa.dtype not in (np.int32, np.int64) or sa.shape != text.shape:
            raise ValueError(f"{_NAME}: sa must be an int32/int64 array as long as text")
        if sa.min() < 0 or sa.max() >= len(text):  # the compiled search trusts these indices
            raise ValueError(f"{_NAME}: sa holds positions outside the text")
        self.text, self.sa = text, sa
        self._n_tokens = int(np.count_nonzero(text != _SEP))

    @classmethod
    def build(cls, token_arrays: Iterable[Sequence[int]] | np.ndarray, progress: Progress | None = None,
              **knobs: int) -> SuffixArrayPool:
        """Index documents (a 1-D array is one document); ``knobs`` go to the constructor."""
        docs = [token_arrays] if isinstance(token_arrays, np.ndarray) and token_arrays.ndim == 1 else token_arrays
        docs = [np.asarray(d) for d in docs]
        say = progress or (lambda stage, fraction: None)
        say("concatenate", 0.0)
        text = np.empty(sum(len(d) for d in docs) + max(1, len(docs)), dtype=np.int32)
        text[-1] = _SEP
        pos = 0
        for k, d in enumerate(docs):
            if d.ndim != 1 or (d.size and d.dtype.kind not in "iu"):
                raise ValueError(f"{_NAME}: document {k} must be a 1-D array of token ids")
            if d.size and (int(d.min()) < 0 or int(d.max()) >= 2**31):
                raise ValueError(f"{_NAME}: document {k} has token ids outside [0, 2**31)")
            text[pos : pos + len(d)] = d
            text[pos + len(d)] = _SEP
            pos += len(d) + 1
        say("suffix sort", 0.1)
        sa = suffix_array(text)
        say("done", 1.0)
        return cls(text, sa, **knobs)

    # --- drafting ---------------------------------------------------------------------------

    def lookup(self, context: Sequence[int], max_nodes: int, max_depth: int) -> list[list[int]]:
        """Best-first tree of continuations of the longest context suffix that has any.

        Nodes are taken by (count desc, depth asc, tokens asc); candidates are the leaves of
        the taken tree in that same order.
        """
        if max_nodes < 1 or max_depth < 1:
            return []
        ctx = np.asarray(context[max(0, len(context) - self.max_query_length):], dtype=np.int64)
        bad = np.flatnonzero(ctx < 0)  # a negative id would match a separator: never match it
        if bad.size:
            ctx = ctx[bad[-1] + 1:]
        longest = len(ctx)
        while longest >= self.min_query_length:
            n, lo, hi = _longest_match(self.text, self.sa, ctx, self.min_query_length, longest)
            if n == 0:
                return []
            tokens, parents = _continuation_tree(self.text, self.sa, lo, hi, self.max_occurrences,
                                                 n, max_depth, max_nodes)
            paths = leaf_paths(tokens.tolist(), parents.tolist())
            if paths:
                return paths
            longest = n - 1  # every occurrence ends its document: try a shorter suffix
        return []

    def longest_match(self, context: Sequence[int], max_length: int) -> tuple[int, int]:
        """(L, where the first occurrence of the context's last L tokens starts) for the longest such
        suffix of at most ``max_length`` tokens that occurs; (0, -1) when not even one token does."""
        ctx = np.asarray(context[max(0, len(context) - max_length):], dtype=np.int64)
        bad = np.flatnonzero(ctx < 0)
        if bad.size:
            ctx = ctx[bad[-1] + 1:]
        if not len(ctx):
            return 0, -1
        length, lo, hi = _longest_match(self.text, self.sa, ctx, 1, len(ctx))
        return (int(length), int(self.sa[lo:hi].min())) if length else (0, -1)

    def occurrences(self, pattern: Sequence[int]) -> np.ndarray:
        """Sorted start positions of ``pattern`` in the concatenated text (documents in order,
        each followed by one separator; with a single document these are its own indices)."""
        pat = np.asarray(pattern, dtype=np.int64)
        if len(pat) == 0:
            raise ValueError(f"{_NAME}: occurrences() needs a non-empty pattern")
        if (pat < 0).any():
            return np.empty(0, dtype=np.int64)
        lo, hi = _bounds(self.text, self.sa, pat)
        return np.sort(self.sa[lo:hi].astype(np.int64))

    # --- the Pool protocol: the datastore is static -----------------------------------------

    def update(self, tokens: Sequence[int], *, source: str = "output") -> None:
        """No-op: the datastore is static (build a new pool to add documents)."""

    def begin_request(self, prompt: Sequence[int]) -> None:
        """No-op: nothing is request-local."""

    def end_request(self) -> None:
        """No-op: nothing is request-local."""

    def __len__(self) -> int:
        """Datastore tokens (separators excluded)."""
        return self._n_tokens

    # --- files ------------------------------------------------------------------------------

    def save(self, path: str | Path) -> None:
        text, sa = self.text.astype("<i4"), self.sa.astype("<i" + str(self.sa.itemsize))
        header = pack_header(_HEADER, _VERSION, sa.itemsize, len(text), self.max_query_length,
                             self.min_query_length, self.max_occurrences,
                             zlib.crc32(text), zlib.crc32(sa))
        pad1 = b"\0" * (_DATA - len(_MAGIC) - len(header))
        pad2 = b"\0" * (_sa_offset(len(text)) - _DATA - text.nbytes)
        write_file(path, _MAGIC, header, [pad1, memoryview(text), pad2, memoryview(sa)])

    @classmethod
    def load(cls, path: str | Path, *, mmap: bool = True, verify: bool = True) -> SuffixArrayPool:
        """Read a file written by ``save``, memory-mapped unless ``mmap=False``.

        ``verify`` checks the payload checksums (reads the whole file once); a file that is
        truncated, damaged or not ours raises PoolFileError naming it.
        """
        version, itemsize, n, max_q, min_q, max_occ, crc_text, crc_sa, _ = read_header(
            path, _MAGIC, _HEADER, "suffix array")
        if version != _VERSION:
            raise PoolFileError(f"{path}: suffix array file version {version}, this specfree reads {_VERSION}")
        if itemsize not in (4, 8) or n < 1:
            raise PoolFileError(f"{path}: corrupted suffix array file (bad header)")
        want, size = _sa_offset(n) + n * itemsize, os.path.getsize(path)
        if size != want:
            problem = "truncated" if size < want else "corrupted (trailing bytes in)"
            raise PoolFileError(f"{path}: {problem} suffix array file: expected {want} bytes, found {size}")
        with open(path, "rb") as f:  # padding is outside the checksums: it must read as zeros
            f.seek(len(_MAGIC) + struct.calcsize(_HEADER))
            pad1 = f.read(_DATA - f.tell())
            f.seek(_DATA + 4 * n)
            pad2 = f.read(_sa_offset(n) - f.tell())
        if pad1.strip(b"\0") or pad2.strip(b"\0"):
            raise PoolFileError(f"{path}: corrupted suffix array file (non-zero padding)")
        read = (lambda dt, off: np.memmap(path, dt, "c", off, (n,))) if mmap else (
            lambda dt, off: np.fromfile(path, dt, n, offset=off))
        text, sa = read("<i4", _DATA), read(f"<i{itemsize}", _sa_offset(n))
        if verify and (zlib.crc32(text) != crc_text or zlib.crc32(sa) != crc_sa):
            raise PoolFileError(f"{path}: corrupted suffix array file (payload checksum mismatch)")
        try:
            return cls(np.asarray(text, dtype=np.int32), np.asarray(sa, dtype=f"i{itemsize}"),
                       max_query_length=max_q, min_query_length=min_q, max_occurrences=max_occ)
        except ValueError as e:
            raise PoolFileError(f"{path}: corrupted suffix array file: {e}") from e


def _sa_offset(n: int) -> int:
    return _DATA + (4 * n + 63) // 64 * 64
