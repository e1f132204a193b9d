"""What a request asks its output to match: a JSON schema, any JSON, a regex or a grammar.

A ``Constraint`` is the request's own words, checked for shape only; ``compiler.Grammars`` turns
it into a matcher over one tokenizer (and says, in one line, what does not compile).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from specfree.errors import ConfigError

KINDS = ("json_schema", "json_object", "regex", "grammar")
OPTIONS = ("json_schema", "regex", "grammar", "json_object")  # Engine.generate's keywords, at most one a request
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
        if not isinstance(value, str) or not value:
            raise ConfigError(f"{name} must be a non-empty string, got {value!r}")
        return cls(name, checked_size(name, value))

    def options(self) -> dict:
        """The keywords of ``Engine.generate`` that set this constraint."""
        return {"json_object": True} if self.kind == "json_object" else {self.kind: self.text}


def per_prompt(count: int, constraints: Sequence[dict | None] | None,
             settings: dict) -> list[Constraint | None]:
    """Each prompt's constraint: its own entry of ``constraints``, else the keywords in ``settings``
    (taken out of it), which hold for every prompt."""
    shared = Constraint.from_options(**{k: settings.pop(k) for k in OPTIONS if k in settings})
    if constraints is None:
        return [shared] * count
    if isinstance(constraints, (str, dict)) or len(constraints) != count:
        raise ConfigError(f"constraints must be a list with one entry (a dict or None) per prompt, {count} in all")
    if shared is not None:
        raise ConfigError("give the constraints per prompt (constraints=[...]) or one for all, not both")
    for i, options in enumerate(constraints):
        if options is not None and (not isinstance(options, dict) or set(options) - set(OPTIONS)):
            raise ConfigError(f"constraints[{i}] must be None or a dict of {', '.join(OPTIONS)}; "
                              f"got {options!r}")
    return [Constraint.from_options(**options) if options else None for options in constraints]


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
