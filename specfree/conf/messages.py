"""One-line messages for Hydra and OmegaConf failures: the field, what it accepts, a close name.

Shared by the composed config (``specfree.config``) and by component nodes checked on their
own (hybrid members, ``specfree.conf.nodes``).
"""

from __future__ import annotations

import dataclasses
import inspect
import types
import typing
from collections.abc import Sequence
from typing import Any

from specfree.errors import ConfigError, one_line


def config_error(exc: BaseException) -> ConfigError:
    """One line, naming the field and what it accepts, for a Hydra or OmegaConf failure."""
    from hydra.errors import MissingConfigException, OverrideParseException
    from omegaconf.errors import ConfigKeyError, MissingMandatoryValue, OmegaConfBaseException, ValidationError

    if isinstance(exc, ConfigError):
        return exc
    if isinstance(exc, MissingConfigException) and exc.missing_cfg_file and "/" in exc.missing_cfg_file:
        group, _, option = exc.missing_cfg_file.rpartition("/")
        hint = (" (launchers are Hydra plugins: joblib comes with pip install 'specfree[sweeps]', "
                "submitit_slurm with 'specfree[cluster]')" if group == "hydra/launcher" else "")
        return ConfigError(f"unknown {group} {option!r}; available: {', '.join(exc.options or [])}{hint}")
    if isinstance(exc, OverrideParseException):
        return ConfigError(f"{_first_line(exc)}; quote values with spaces or commas: 'key=\"a, b\"'")
    cause = exc
    while not isinstance(cause, OmegaConfBaseException) and cause.__cause__ is not None:
        cause = cause.__cause__
    if isinstance(cause, OmegaConfBaseException):
        key = cause.full_key or cause.key
        schema = cause.object_type if dataclasses.is_dataclass(cause.object_type) else None
        names = [f.name for f in dataclasses.fields(schema)] if schema else []
        if isinstance(cause, MissingMandatoryValue):
            return ConfigError(f"{key} is required: set it with {key}=...")
        if isinstance(cause, ConfigKeyError) or "not in struct" in str(cause) or "not in '" in str(cause):
            owner, _, leaf = str(key).rpartition(".")
            label = getattr(schema, "component", None)
            if label:
                names = [n for n in names if n != "name"]
                return ConfigError(f"{key}: {owner} {label!r} has no knob {leaf!r}; its knobs: "
                                   f"{', '.join(names) or '(none)'}{_did_you_mean(leaf, names)}")
            if not names and owner in ("strategy", "verifier", "pool", "mask"):  # a group left at null
                return ConfigError(f"{key}: no {owner} is chosen; pick one first ({owner}=NAME {key}=...)")
            return ConfigError(f"{key}: no such setting; {owner or 'the top level'} has: {', '.join(names)}"
                               + _did_you_mean(leaf, names))
        if isinstance(cause, ValidationError) and schema is not None:
            leaf = str(key).rpartition(".")[2]
            hints = typing.get_type_hints(schema)  # resolved: the schemas' annotations are strings
            if leaf in hints:
                return ConfigError(f"{key}: expected {_type_name(hints[leaf])}, got {cause.value!r}")
        return ConfigError(f"{key}: {_first_line(cause)}" if key else _first_line(cause))
    return ConfigError(one_line(exc))


def _did_you_mean(word: str, names: Sequence[str]) -> str:
    import difflib

    close = difflib.get_close_matches(word, names, n=1)
    return f" (did you mean {close[0]}?)" if close else ""


def _type_name(kind: Any) -> str:
    args = typing.get_args(kind)
    if typing.get_origin(kind) in (typing.Union, types.UnionType) and type(None) in args:
        return " or ".join(_type_name(a) for a in args if a is not type(None)) + " or null"
    return kind.__name__ if inspect.isclass(kind) else str(kind).replace("typing.", "")


def _first_line(exc: BaseException) -> str:
    return next((line.strip() for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
