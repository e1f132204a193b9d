"""Build a retrieval datastore: tokenize text/JSONL corpora, index them with a suffix array, save.

Used by ``python -m specfree datastore build input=... out=...`` and by library users, and by
``datastore answers``, which indexes the model's own greedy answers to a prompt set: a small
model words different answers alike ("I hope this message finds you well"), so its past answers
draft its next ones better than text written by others.
"""

from __future__ import annotations

import json
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


def answers_path(out: str | Path) -> Path:
    """Where ``datastore answers`` keeps the answers behind the datastore ``out``."""
    out = Path(out).expanduser()
    return out.with_name(out.stem + ".answers.jsonl")


def answer_prompts(engine, prompts: Sequence, answers: Path, max_new_tokens: int = 128, chat: bool = True,
                   setup: dict | None = None, progress: Callable[[int, int], None] | None = None) -> int:
    """Append the engine's greedy answer to each prompt's first turn to ``answers`` (JSONL rows
    ``{"id", "text", "setup"}``), one row as each finishes; prompts answered there already are
    skipped, so a stopped run resumes where it stopped. ``setup`` names what made the answers
    (model, length, chat): a file holding another setup's answers is an error, not silently
    extended. Returns the number of new answers."""
    setup = answers_setup(setup, max_new_tokens, chat)
    todo = unanswered(prompts, answers, setup)
    _append_answers(engine, todo, answers, setup, progress)
    return len(todo)


def answers_setup(setup: dict | None, max_new_tokens: int, chat: bool) -> dict:
    """What each answer row records about how it was made."""
    return {**(setup or {}), "max_new_tokens": max_new_tokens, "chat": chat}


def unanswered(prompts: Sequence, answers: Path, setup: dict) -> list:
    """The prompts ``answers`` does not answer yet; an error naming the file if a row was made
    with another ``setup``."""
    done = set()
    for number, row in read_jsonl(answers) if answers.is_file() else ():
        if row.get("setup") != setup:
            raise ConfigError(f"{answers}:{number} holds answers made with {row.get('setup')}, not {setup}; "
                              f"delete the file or choose another out=")
        done.add(str(row.get("id")))
    return [item for item in prompts if item.id not in done]


def _append_answers(engine, todo: Sequence, answers: Path, setup: dict,
                    progress: Callable[[int, int], None] | None) -> None:
    answers.parent.mkdir(parents=True, exist_ok=True)
    with answers.open("a", encoding="utf-8") as out:
        for k, item in enumerate(todo):
            generation = engine.generate(item.turns[0], setup["max_new_tokens"], chat=setup["chat"])
            out.write(json.dumps({"id": item.id, "text": generation.text, "setup": setup}) + "\n")
            out.flush()
            if progress:
                progress(k + 1, len(todo))


USAGES = {
    "build": ("python -m specfree datastore build input=FILE[,FILE...] out=PATH [model=smollm2|PATH|HUB_ID] "
              "[fields=text,turns]"),
    "answers": ("python -m specfree datastore answers prompts=FILE out=PATH [model=smollm2|PATH|HUB_ID] "
                "[max_new_tokens=128] [limit=N] [chat=true]"),
}
OPTIONS = {"build": ("input", "out", "model", "fields", "cache_dir"),
           "answers": ("prompts", "out", "model", "max_new_tokens", "limit", "chat", "cache_dir")}


def _options(args: Sequence[str]) -> tuple[str, dict[str, str]]:
    if not args or args[0] not in OPTIONS:
        raise ConfigError("usage: " + "\n   or: ".join(USAGES.values()))
    command, options = args[0], {}
    usage = f"usage: {USAGES[command]}"
    for arg in args[1:]:
        key, eq, value = arg.partition("=")
        if not eq or key not in OPTIONS[command]:
            raise ConfigError(f"datastore {command}: unexpected argument {arg!r}; {usage}")
        options[key] = value
    needed = ("input" if command == "build" else "prompts", "out")
    if not all(options.get(key) for key in needed):
        raise ConfigError(f"datastore {command} needs {needed[0]}= and out=; {usage}")
    return command, options


def main(args: Sequence[str]) -> int:
    """``python -m specfree datastore build|answers ...``: build with a progress bar."""
    from rich.console import Console

    from specfree.loading import load_tokenizer
    from specfree.progress import progress_bar

    command, options = _options(args)
    console = Console(stderr=True)
    if command == "build":
        inputs = [p for p in options["input"].strip("[]").split(",") if p]
        missing = [p for p in inputs if not Path(p).expanduser().is_file()]
        if missing:  # before the tokenizer loads (seconds) and the progress bar starts
            raise ConfigError(f"datastore input not found: {missing[0]}")
        fields = [f for f in options.get("fields", "").strip("[]").split(",") if f] or None
        tokenizer = load_tokenizer(options.get("model", "smollm2"), cache_dir=options.get("cache_dir"))
    else:  # the answering engine's tokenizer indexes the answers
        answers, tokenizer = _answer(options, console)
        inputs, fields = [answers], ["text"]
    with progress_bar(console, counted=False) as bar:
        task = bar.add_task("reading", total=1.0)
        stats = build_datastore(inputs, tokenizer, options["out"], fields,
                                progress=lambda stage, f: bar.update(task, description=stage, completed=f))
    console.print(f"datastore {options['out']}: {stats.documents} documents, {stats.tokens:,} tokens, "
                  f"{stats.file_bytes / 2**20:.1f} MiB; tokenize {stats.tokenize_s:.1f} s, "
                  f"index {stats.index_s:.1f} s, peak RSS {stats.peak_rss_mb:.0f} MB")
    return 0


def _answer(options: dict[str, str], console):
    """``datastore answers``: the model answers the prompts it has not answered yet; the answers
    file and the model's tokenizer."""
    from specfree.loading import load_tokenizer
    from specfree.bench.prompts import load_prompts
    from specfree.engine import Engine

    def whole(key: str, default: int | None) -> int | None:
        value = options.get(key)
        if value is None:
            return default
        if not value.isdigit() or int(value) < 1:
            raise ConfigError(f"datastore answers: {key} must be a whole number of at least 1, got {value!r}")
        return int(value)

    limit, max_new = whole("limit", None), whole("max_new_tokens", 128)
    chat = options.get("chat", "true").lower()
    if chat not in ("true", "false"):
        raise ConfigError(f"datastore answers: chat must be true or false, got {options['chat']!r}")
    path = Path(options["prompts"]).expanduser()
    if not path.is_file():
        raise ConfigError(f"datastore answers: prompt file not found: {path}")
    # Rows may hold a chat's "turns" or one "prompt"; the first turn is answered.
    prompts = load_prompts(path, format="jsonl", fields={"turns": "turns", "prompt": "prompt"}, limit=limit)
    answers = answers_path(options["out"])
    model, cache_dir = options.get("model", "smollm2"), options.get("cache_dir")
    # Checked before the model loads: answers of another setup are refused at once, and with
    # nothing left to answer only the tokenizer is needed.
    setup = answers_setup({"model": model}, max_new, chat == "true")
    todo = unanswered(prompts, answers, setup)
    kept = f"{len(prompts) - len(todo)} kept from an earlier run"
    if not todo:
        console.print(f"{answers}: no new answers, {kept}")
        return answers, load_tokenizer(model, cache_dir=cache_dir)
    # Prompt lookup: its greedy output is plain greedy decoding's, token for token, only sooner.
    engine = Engine.from_pretrained(model, "prompt_lookup", cache_dir=cache_dir)
    from specfree.progress import progress_bar

    with progress_bar(console) as bar:
        task = bar.add_task("answering", total=len(todo))
        _append_answers(engine, todo, answers, setup, progress=lambda k, n: bar.update(task, completed=k))
    console.print(f"{answers}: {len(todo)} new answers, {kept}")
    return answers, engine.tokenizer
