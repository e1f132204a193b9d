"""The records file: one JSON document, rewritten atomically after every finished record.

An interrupted run therefore leaves a complete, readable file with every record finished so far,
and ``resume`` continues it: finished (prompt, system, repeat) records are skipped, records that
ended in an error are run again.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from specfree.errors import ConfigError
from specfree.files import write_atomic

FILENAME = "bench.json"
SCHEMA = "specfree-bench/1"
# Settings that change what a record measures: a resumed run must agree on them.
MUST_MATCH = ("model", "max_new_tokens", "chat", "device", "dtype", "prompts")


def record_key(record: dict[str, Any]) -> tuple[str, str, int]:
    return str(record["prompt_id"]), str(record["system"]), int(record["repeat"])


def read_output(arg: str | Path, command: str) -> tuple[Path, dict[str, Any]]:
    """A command's bench-output argument (a folder or its records file): the records file's path
    and its contents; one clear error naming ``command`` where there is none."""
    path = Path(arg).expanduser()
    path = path / FILENAME if path.is_dir() else path
    if not path.is_file():
        raise ConfigError(f"{command}: {path} not found; pass a bench output folder or its {FILENAME}")
    return path, read(path)


def read(path: str | Path) -> dict[str, Any]:
    """Load a records file (or the one inside a folder) and check it is ours."""
    path = Path(path)
    if path.is_dir():
        path = path / FILENAME
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"no benchmark records at {path}") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
        raise ConfigError(f"{path} is not a specfree bench records file (schema {SCHEMA})")
    return doc


class RecordStore:
    def __init__(self, folder: str | Path, meta: dict[str, Any], resume: bool = False):
        self.folder = Path(folder)
        self.path = self.folder / FILENAME
        self.meta = meta
        self.systems: list[dict[str, Any]] = []
        self.records: list[dict[str, Any]] = []
        if self.path.exists():
            if not resume:
                raise ConfigError(f"{self.path} already exists: pass bench.resume=true to continue that run, "
                                  f"or choose another bench.out")
            self._load()
        self.folder.mkdir(parents=True, exist_ok=True)

    def _load(self) -> None:
        old = read(self.path)
        differ = [k for k in MUST_MATCH if old["meta"].get(k) != self.meta.get(k)]
        if differ:
            detail = ", ".join(f"{k}: {old['meta'].get(k)!r} there, {self.meta.get(k)!r} now" for k in differ)
            raise ConfigError(f"cannot resume {self.path}: it was run with other settings ({detail}); "
                              f"use another bench.out")
        self.meta = {**self.meta, "started": old["meta"].get("started"), "resumed": self.meta.get("started")}
        self.systems = old.get("systems", [])
        self.records = [r for r in old["records"] if not r.get("error")]

    @property
    def done(self) -> set[tuple[str, str, int]]:
        return {record_key(r) for r in self.records}

    def find(self, prompt_id: str, system: str, repeat: int) -> dict[str, Any] | None:
        key = (str(prompt_id), system, repeat)
        return next((r for r in self.records if record_key(r) == key), None)

    def set_systems(self, systems: list[dict[str, Any]]) -> None:
        known = {s["label"] for s in self.systems}
        self.systems += [s for s in systems if s["label"] not in known]
        self.save()

    def add(self, record: dict[str, Any]) -> None:
        key = record_key(record)
        self.records = [r for r in self.records if record_key(r) != key] + [record]
        self.save()

    def save(self) -> None:
        doc = {"schema": SCHEMA, "meta": self.meta, "systems": self.systems, "records": self.records}
        write_atomic(self.path, json.dumps(doc, separators=(",", ":")))  # never half a file, even killed
