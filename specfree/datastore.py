"""Build a retrieval datastore: tokenize text/JSONL corpora, index them with a suffix array, save.

Used by ``python -m specfree datastore build input=... out=...`` and by library users.
"""

from __future__ import annotations

import resource
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from specfree.errors import ConfigError
from specfree.jsonl import read_jsonl
from specfree.pools.suffix_array import SuffixArrayPool

TEXT_FIELDS = ("text", "content", "turns", "prompt", "question", "reference")


@dataclass
class DatastoreStats:
    documents: int
    tokens: int
    tokenize_s: float
    index_s: float
    file_bytes: int
    peak_rss_mb: float

    def as_dict(self) -> dict:
        return asdict(self)


def _as_text(value) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return "\n".join(value)
    return None


def read_documents(path: Path, fields: Sequence[str] | None = None) -> Iterator[str]:
    """Documents of a .txt (blank-line separated paragraphs) or .jsonl file (one object per line).

    For JSONL, every listed field present in a row (default: the usual text-like fields) adds
    its text: a string, or a list of strings (e.g. chat ``turns``) joined by newlines.
    """
    if not path.is_file():
        raise ConfigError(f"datastore input not found: {path}")
    if path.suffix == ".jsonl":
        wanted = tuple(fields) if fields else TEXT_FIELDS
        for number, row in read_jsonl(path):
            texts = [t for f in wanted if (t := _as_text(row.get(f)))]
            if not texts and fields:
                raise ConfigError(f"{path}:{number}: none of the fields {list(wanted)} holds text; "
                                  f"the row has {sorted(row)}")
            yield from texts
    else:
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise ConfigError(f"datastore input {path} is not UTF-8 text; give .txt or .jsonl files") from None
        yield from (p for p in text.split("\n\n") if p.strip())


def build_datastore(inputs: Sequence[str | Path], tokenizer, out: str | Path, fields: Sequence[str] | None = None,
                    progress: Callable[[str, float], None] | None = None) -> DatastoreStats:
    """Tokenize ``inputs`` with the model's tokenizer, build the suffix array, save it to ``out``."""
    if not inputs:
        raise ConfigError("datastore build needs at least one input file: input=CORPUS.jsonl")
    say = progress or (lambda stage, fraction: None)
    start = time.perf_counter()
    docs: list[np.ndarray] = []
    paths = [Path(p).expanduser() for p in inputs]
    for k, path in enumerate(paths):
        batch: list[str] = []
        for text in read_documents(path, fields):
            batch.append(text)
            if len(batch) == 512:
                docs += _tokenize(tokenizer, batch)
                batch = []
        docs += _tokenize(tokenizer, batch)
        say(f"tokenized {path.name}", 0.5 * (k + 1) / len(paths))
    tokens = sum(len(d) for d in docs)
    if tokens == 0:
        raise ConfigError(f"the datastore inputs {[str(p) for p in paths]} hold no text")
    tokenized = time.perf_counter()
    pool = SuffixArrayPool.build(docs, progress=lambda stage, f: say(stage, 0.5 + 0.5 * f))
    out = Path(out).expanduser()
    out.parent.mkdir(parents=True, exist_ok=True)
    pool.save(out)
    done = time.perf_counter()
    return DatastoreStats(documents=len(docs), tokens=tokens, tokenize_s=tokenized - start,
                          index_s=done - tokenized, file_bytes=out.stat().st_size,
                          peak_rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)


def _tokenize(tokenizer, texts: list[str]) -> list[np.ndarray]:
    if not texts:
        return []
    ids = tokenizer(texts, add_special_tokens=False).input_ids
    return [np.asarray(x, dtype=np.int32) for x in ids]


USAGE = ("usage: python -m specfree datastore build input=FILE[,FILE...] out=PATH "
         "[model=smollm2|PATH|HUB_ID] [fields=text,turns]")


def main(args: Sequence[str]) -> int:
    """``python -m specfree datastore build input=... out=...``: build with a progress bar."""
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from specfree.adapters.loading import load_tokenizer

    if not args or args[0] != "build":
        raise ConfigError(USAGE)
    options: dict[str, str] = {}
    for arg in args[1:]:
        key, eq, value = arg.partition("=")
        if not eq or key not in ("input", "out", "model", "fields", "cache_dir"):
            raise ConfigError(f"datastore build: unexpected argument {arg!r}; {USAGE}")
        options[key] = value
    if not options.get("input") or not options.get("out"):
        raise ConfigError(f"datastore build needs input= and out=; {USAGE}")
    inputs = [p for p in options["input"].strip("[]").split(",") if p]
    missing = [p for p in inputs if not Path(p).expanduser().is_file()]
    if missing:  # before the tokenizer loads (seconds) and the progress bar starts
        raise ConfigError(f"datastore input not found: {missing[0]}")
    fields = [f for f in options.get("fields", "").strip("[]").split(",") if f] or None
    tokenizer = load_tokenizer(options.get("model", "smollm2"), cache_dir=options.get("cache_dir"))
    console = Console(stderr=True)
    # Only on a terminal: piped or logged, the bar's last frame would sit above any error line.
    with Progress(TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(), console=console,
                  disable=not console.is_terminal) as bar:
        task = bar.add_task("reading", total=1.0)
        stats = build_datastore(inputs, tokenizer, options["out"], fields,
                                progress=lambda stage, f: bar.update(task, description=stage, completed=f))
    console.print(f"datastore {options['out']}: {stats.documents} documents, {stats.tokens:,} tokens, "
                  f"{stats.file_bytes / 2**20:.1f} MiB; tokenize {stats.tokenize_s:.1f} s, "
                  f"index {stats.index_s:.1f} s, peak RSS {stats.peak_rss_mb:.0f} MB")
    return 0
