"""Files: paths as the user typed them, and what specfree keeps between runs (written whole or
not at all, named by what they depend on)."""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


DEFAULT_CACHE = Path.home() / ".cache" / "specfree"  # what specfree keeps between runs, unless told otherwise


def cache_folder(cache_dir: str | os.PathLike | None = None) -> Path:
    """specfree's cache folder: ``cache_dir`` (``~`` expanded), else ``DEFAULT_CACHE``. The one
    place that says where the kernels' build, GGUF configs, cost curves, compiled packages and the
    llama.cpp tools are kept."""
    return Path(cache_dir).expanduser() if cache_dir else DEFAULT_CACHE


def user_path(value: str | os.PathLike) -> Path:
    """A path the user typed: ``~`` expanded, and relative to the folder the command started in,
    even where Hydra has changed the working folder since."""
    from hydra.utils import to_absolute_path

    return Path(to_absolute_path(os.path.expanduser(value)))


@contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """A temporary path beside ``path`` for the block to fill (a file or a folder, itself or through
    a tool); when the block ends it replaces ``path`` in one rename, and when it raises it is removed:
    readers see the old entry or the new one, never half of one."""
    path = Path(path)
    # Unique (writers may race), and ending like ``path``: some tools check the suffix (AOTInductor: .pt2).
    tmp = path.with_name(f".tmp-{secrets.token_hex(4)}-{path.name}")
    try:
        yield tmp
        if tmp.is_file():
            with open(tmp, "rb") as written:
                os.fsync(written.fileno())  # on disk before the rename, so a crash cannot leave it empty
        elif path.is_dir():
            shutil.rmtree(path)  # a folder is replaced whole, never merged
        os.replace(tmp, path)
    finally:
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            tmp.unlink(missing_ok=True)


def write_atomic(path: str | os.PathLike, data: str | bytes | Iterable[bytes]) -> None:
    """Write ``data`` (text as UTF-8, bytes, or chunks of bytes) to ``path`` atomically."""
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        if isinstance(data, str):
            data = data.encode("utf-8")
        if isinstance(data, bytes):
            f.write(data)
        else:
            f.writelines(data)


def fingerprint(*parts: Any) -> str:
    """16 hex digits that change when any of ``parts`` does: the name of a cache entry built from
    them (parts as JSON; anything JSON cannot hold by its ``str``)."""
    return hashlib.sha1(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def file_digest(path: Path, memo: Path) -> str:
    """The SHA-256 of ``path``'s bytes: what a cache entry made from a file is named by, so the same
    file at another path (a new virtual environment's copy of a wheel's model) finds the same entry.
    Each digest is remembered in ``memo`` under the file's path, size and modification time, so a
    file is read once (``remember_digest`` writes it; a failed run writes nothing)."""
    try:
        digest = _memo_entry(path, memo).read_text().strip()
        if len(digest) == 64 and all(c in "0123456789abcdef" for c in digest):
            return digest
    except OSError:
        pass  # never read, or unreadable: read the file again
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            sha.update(chunk)
    return sha.hexdigest()


def remember_digest(path: Path, memo: Path, digest: str) -> None:
    """Remember ``digest`` for ``path`` as it is now (``file_digest``'s memo). Best effort: a memo
    that cannot be written only means the file is read again next time."""
    try:
        remembered = _memo_entry(path, memo)
        if not remembered.is_file():
            memo.mkdir(parents=True, exist_ok=True)
            write_atomic(remembered, digest)
    except OSError:
        pass


def _memo_entry(path: Path, memo: Path) -> Path:
    """Where ``file_digest`` remembers ``path``'s digest: by path, size and modification time."""
    stat = path.stat()
    return memo / fingerprint(str(path.resolve()), stat.st_size, stat.st_mtime_ns)
