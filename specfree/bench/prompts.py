"""Prompt sets: Spec-Bench question files and any JSONL with a field mapping.

Every loader returns ``PromptItem``s. ``category`` is the row the report groups by (for
Spec-Bench files the eight MT-bench categories become one ``mt_bench`` task, as Spec-Bench's
``speed.py`` does); ``subcategory`` keeps the file's own category.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from specfree.errors import ConfigError, check_int
from specfree.jsonl import read_jsonl

FORMATS = ("spec_bench", "jsonl")
MT_BENCH_CATEGORIES = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")
SPEC_BENCH_FIELDS = {"id": "question_id", "category": "category", "turns": "turns"}
# A generic JSONL row needs a prompt ("turns" list or one "prompt" string); id and category are optional.
JSONL_FIELDS = {"id": "id", "category": "category", "prompt": "prompt"}
FIELD_ROLES = ("id", "category", "turns", "prompt")
# Prompt sets shipped with specfree, by name (``bench.prompts=code_edits``); made by specfree.bench.code_edits.
DATA = Path(__file__).parent / "data"
SHIPPED = {"code_edits": DATA / "code_edits.jsonl", "code_edits_multi_turn": DATA / "code_edits_multi_turn.jsonl"}


@dataclass(frozen=True)
class PromptItem:
    id: str
    category: str
    turns: list[str]
    subcategory: str = ""


def load_prompts(path: str | Path, format: str = "spec_bench", fields: Mapping[str, str] | None = None,
                 limit: int | None = None, per_category: int | None = None,
                 default_category: str = "all") -> list[PromptItem]:
    """Read a prompt file and select from it.

    ``fields`` maps roles (``id``, ``category``, ``turns`` or ``prompt``) to the file's keys; given
    keys override the format's defaults. ``per_category`` keeps the first k prompts of each
    category, taking them round-robin over its subcategories (so ``mt_bench`` with k=8 gets one of
    each MT-bench category); ``limit`` then keeps the first n prompts overall.
    """
    if format not in FORMATS:
        raise ConfigError(f"bench.format must be one of {list(FORMATS)}, got {format!r}")
    mapping = _field_mapping(format, fields)
    items = [_item(row, mapping, format, path, line, default_category) for line, row in _read_jsonl(Path(path))]
    ids = [item.id for item in items]
    if len(set(ids)) != len(ids):
        dup = next(i for i in ids if ids.count(i) > 1)
        raise ConfigError(f"{path}: prompt id {dup!r} appears more than once; ids must be unique "
                          f"(map another field with fields.id)")
    if per_category is not None:
        items = select_per_category(items, check_int("bench.per_category", per_category, low=1))
    if limit is not None:
        items = items[: check_int("bench.limit", limit, low=1)]
    if not items:
        raise ConfigError(f"{path}: no prompts selected")
    return items


def shipped_prompts(name: str | Path) -> Path | None:
    """The file of a prompt set shipped with specfree, or None when ``name`` names none."""
    return SHIPPED.get(str(name))


def select_per_category(items: list[PromptItem], k: int) -> list[PromptItem]:
    """First k of each category, round-robin over subcategories; categories keep file order."""
    chosen: set[int] = set()
    categories = list(dict.fromkeys(item.category for item in items))
    for category in categories:
        queues: dict[str, list[int]] = {}
        for index, item in enumerate(items):
            if item.category == category:
                queues.setdefault(item.subcategory, []).append(index)
        picked = 0
        while picked < k and any(queues.values()):
            for queue in queues.values():
                if queue and picked < k:
                    chosen.add(queue.pop(0))
                    picked += 1
    return [item for index, item in enumerate(items) if index in chosen]


def _field_mapping(format: str, fields: Mapping[str, str] | None) -> dict[str, str]:
    mapping = dict(SPEC_BENCH_FIELDS if format == "spec_bench" else JSONL_FIELDS)
    given = {str(k): str(v) for k, v in dict(fields or {}).items() if v is not None}
    unknown = sorted(set(given) - set(FIELD_ROLES))
    if unknown:
        raise ConfigError(f"bench.fields has unknown role(s) {unknown}; roles: {list(FIELD_ROLES)}")
    if "turns" in given and "prompt" not in given:
        mapping.pop("prompt", None)
    if "prompt" in given and "turns" not in given:
        mapping.pop("turns", None)
    mapping.update(given)  # both mapped: each row uses whichever of the two it has, turns first
    return mapping


def _read_jsonl(path: Path):
    if not path.is_file():
        raise ConfigError(f"prompt file not found: {path} (set bench.prompts to a JSONL file)")
    yield from read_jsonl(path)


def _item(row: dict, mapping: dict[str, str], format: str, path, line: int, default_category: str) -> PromptItem:
    where = f"{path}:{line}"

    def get(role: str, required: bool):
        key = mapping[role]
        if key not in row:
            if required:
                raise ConfigError(f"{where}: missing field {key!r} (the {role!r} field); keys present: "
                                  f"{sorted(row)}. Map another key with bench.fields.{role}=NAME")
            return None
        return row[key]

    required = format == "spec_bench"
    role = "turns" if "turns" in mapping and (mapping["turns"] in row or "prompt" not in mapping) else "prompt"
    turns = get(role, True)
    turns = [turns] if isinstance(turns, str) else turns
    if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t for t in turns):
        raise ConfigError(f"{where}: field {mapping[role]!r} must be a non-empty string or a list of "
                          f"non-empty strings")
    raw_id = get("id", required)
    raw_category = get("category", required)
    category = str(raw_category) if raw_category is not None else default_category
    subcategory = category
    if format == "spec_bench" and category in MT_BENCH_CATEGORIES:
        category = "mt_bench"
    return PromptItem(id=str(raw_id) if raw_id is not None else str(line), category=category, turns=list(turns),
                      subcategory=subcategory)
