"""Small helpers shared by the pools: knob checks, candidate trees, pool files."""

from __future__ import annotations

import itertools
import os
import struct
import zlib
from collections.abc import Iterable, Sequence

from specfree.files import write_atomic
from specfree.pools.base import PoolFileError


def as_tokens(tokens: Sequence[int]) -> list[int]:
    """Plain Python ints: numpy/torch scalars are slow dict keys and compare oddly."""
    tolist = getattr(tokens, "tolist", None)
    return tolist() if tolist is not None else [int(t) for t in tokens]


def fit_candidates(candidates: Iterable[Sequence[int]], max_nodes: int,
                   max_depth: int) -> list[list[int]]:
    """Keep candidates in order until their merged prefix tree holds ``max_nodes`` nodes.

    Each is cut to ``max_depth``; one that adds no new node is skipped; the one that would
    overflow the budget is cut to fit (its first tokens are still worth verifying).
    """
    out: list[list[int]] = []
    in_tree: set[tuple[int, ...]] = set()  # every prefix already in the merged tree
    budget = max_nodes
    for cand in candidates:
        if budget <= 0:
            break
        c = tuple(cand[:max_depth])
        shared = 0
        while shared < len(c) and c[: shared + 1] in in_tree:
            shared += 1
        if shared == len(c):
            continue
        keep = min(len(c), shared + budget)
        for j in range(shared + 1, keep + 1):
            in_tree.add(c[:j])
        budget -= keep - shared
        out.append(list(c[:keep]))
    return out


def leaf_paths(tokens: list[int], parents: list[int]) -> list[list[int]]:
    """Root-to-leaf token paths of a tree given in best-first order, best leaf first.

    ``parents[i]`` indexes an earlier node, or is -1 for a child of the (implicit) root.
    """
    has_child = [False] * len(tokens)
    for p in parents:
        if p >= 0:
            has_child[p] = True
    paths = []
    for i, leaf in enumerate(has_child):
        if not leaf:
            path, j = [], i
            while j >= 0:
                path.append(tokens[j])
                j = parents[j]
            paths.append(path[::-1])
    return paths


# --- pool files: MAGIC (16 bytes) | header struct | payload, every part checked on load ---

def write_file(path: str | os.PathLike, magic: bytes, header: bytes, chunks: Iterable[bytes]) -> None:
    """Written atomically, so a crash never leaves a half-written pool."""
    write_atomic(path, itertools.chain([magic, header], chunks))


def read_header(path: str | os.PathLike, magic: bytes, fmt: str, what: str) -> tuple:
    """Unpack the header after ``magic``; PoolFileError names the file and the problem."""
    size = len(magic) + struct.calcsize(fmt)
    try:
        with open(path, "rb") as f:
            head = f.read(size)
    except OSError as e:
        raise PoolFileError(f"{path}: cannot read {what} file: {e}") from e
    if len(head) < len(magic) or head[: len(magic)] != magic:
        raise PoolFileError(f"{path}: not a specfree {what} file (bad magic bytes)")
    if len(head) < size:
        raise PoolFileError(f"{path}: truncated {what} file (header is incomplete)")
    fields = struct.unpack(fmt, head[len(magic):])
    # The last header field is the CRC of the header's other bytes.
    if zlib.crc32(head[len(magic): -4]) != fields[-1]:
        raise PoolFileError(f"{path}: corrupted {what} file (header checksum mismatch)")
    return fields


def pack_header(fmt: str, *fields: float) -> bytes:
    """Header bytes for ``fmt`` whose last field (a u32) is the CRC of the others."""
    body = struct.pack(fmt[:-1], *fields)
    return body + struct.pack("<I", zlib.crc32(body))
