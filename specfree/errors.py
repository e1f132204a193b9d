"""Errors a user can act on. The CLI prints these as one line, never a traceback."""

import numbers


class SpecfreeError(Exception):
    """A problem with the user's input, config or environment, stated with its fix."""


class ConfigError(SpecfreeError, ValueError):
    """A knob, option or config value is wrong."""


class UnsupportedModelError(SpecfreeError):
    """The model cannot run speculative steps (e.g. it ignores a custom 4D attention mask)."""


class ModelLoadError(SpecfreeError):
    """The model or tokenizer could not be found or loaded."""


def one_line(exc: BaseException) -> str:
    """An exception's message on one line: transformers' and YAML's span several, the CLI prints one."""
    return " ".join(str(exc).split())


def check_int(name: str, value, low: int | None = None, high: int | None = None, allow_none: bool = False):
    """Validate an integer knob and return it; the message names the knob and its range.

    ``allow_none``: None is a valid value too (a knob where None means "no limit").
    """
    if value is None and allow_none:
        return None
    none = ", or None for no limit" if allow_none else ""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ConfigError(f"{name} must be an integer{none}, got {value!r} ({type(value).__name__})")
    if (low is not None and value < low) or (high is not None and value > high):
        bounds = f">= {low}" if high is None else f"between {low} and {high}"
        raise ConfigError(f"{name} must be {bounds}{none}, got {value}")
    return int(value)


def check_float(name: str, value, low: float | None = None, high: float | None = None,
                low_open: bool = False, high_open: bool = False) -> float:
    """Validate a float knob and return it as float."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{name} must be a number, got {value!r} ({type(value).__name__})")
    value = float(value)
    too_low = low is not None and (value <= low if low_open else value < low)
    too_high = high is not None and (value >= high if high_open else value > high)
    if too_low or too_high:
        lo = f"> {low}" if low_open else f">= {low}"
        bounds = lo if high is None else f"{lo} and {'<' if high_open else '<='} {high}"
        raise ConfigError(f"{name} must be {bounds}, got {value}")
    return value


CAUSE_CHARS = 300  # a library's message is cut here: the line must stay readable


def cause(exc: BaseException) -> str:
    """The library's exception, on one line and cut short (its type says where it came from)."""
    text = one_line(exc) or "(no message)"
    text = text if len(text) <= CAUSE_CHARS else text[: CAUSE_CHARS - 3] + "..."
    return f"{type(exc).__name__}: {text.rstrip('.!? ')}"
