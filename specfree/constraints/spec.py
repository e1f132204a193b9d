"""What a request asks its output to match: a JSON schema, any JSON, a regex or a grammar.

A ``Constraint`` is the request's own words, checked for shape only; ``compiler.Grammars`` turns
it into a matcher over one tokenizer (and says, in one line, what does not compile).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from specfree.errors import ConfigError

KINDS = ("json_schema", "json_object", "regex", "grammar")
MAX_TEXT = 1 << 20  # a schema or grammar longer than 1 MiB is refused before compiling


@dataclass(frozen=True)
class Constraint:
    """``kind``: one of ``KINDS``; ``text``: the schema as JSON text, the regex, or the grammar
    (Lark, or llama.cpp's GBNF: told apart by ``compiler.grammar_text``)."""

    kind: str
    text: str

    @classmethod
    def from_options(cls, json_schema=None, regex: str | None = None, grammar: str | None = None,
                     json_object: bool = False) -> Constraint | None:
        """The one constraint these keywords set, or None; more than one is an error."""
        given = [name for name, value in (("json_schema", json_schema), ("regex", regex), ("grammar", grammar),
                                          ("json_object", json_object)) if value not in (None, False)]
        if len(given) > 1:
            raise ConfigError(f"set one constraint per request, got {' and '.join(given)}")
        if not given:
            return None
        if json_object is not False:
            if json_object is not True:
                raise ConfigError(f"json_object must be true or false, got {json_object!r}")
            return cls("json_object", '{"type": "object"}')
        if json_schema is not None:
            return cls("json_schema", schema_text(json_schema))
        name, value = ("regex", regex) if regex is not None else ("grammar", grammar)
        if not isinstance(value, str) or not value.strip():
            raise ConfigError(f"{name} must be a non-empty string, got {value!r}")
        return cls(name, checked_size(name, value))


def schema_text(schema) -> str:
    """A JSON schema given as a dict or as JSON text, as canonical JSON text."""
    if isinstance(schema, str):
        try:
            schema = json.loads(checked_size("json_schema", schema))
        except json.JSONDecodeError as exc:
            raise ConfigError(f"json_schema is not valid JSON ({exc}); give a JSON object") from None
    if isinstance(schema, bool):  # true and false are schemas too (anything, nothing)
        schema = {} if schema else {"not": {}}
    if not isinstance(schema, Mapping):
        raise ConfigError(f"json_schema must be a JSON object (a dict), got {type(schema).__name__}")
    return checked_size("json_schema", json.dumps(schema, sort_keys=True))


def checked_size(name: str, text: str) -> str:
    if len(text) > MAX_TEXT:
        raise ConfigError(f"{name} is {len(text)} characters long, more than the {MAX_TEXT} accepted; "
                          "give a smaller one")
    return text


def read_option(name: str, value: str) -> str:
    """A command-line value that may name a file (``json_schema=schema.json``, ``grammar=g.gbnf``):
    the file's text if it exists, else the value itself."""
    path = Path(value)
    try:
        is_file = len(value) < 4096 and path.is_file()
    except OSError:
        is_file = False
    if not is_file:
        return value
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{name}: cannot read {value} ({exc})") from None
