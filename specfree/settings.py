"""How an engine runs its model: every such setting declared once, with its default, the values it
takes and a line saying what it does.

Everything else reads them from here. The Hydra schema's fields are made from ``EngineSettings``
(``conf/schema.py``: each at its node, ``model.linear_kernel``, ``strategy.priced``,
``serve.max_batch``, the rest at the top); ``Engine.from_pretrained`` and ``Engine.from_model`` take
its fields as keywords (``EngineSettings.take``); ``parts`` builds the adapter from one; the engine,
the adapter, the kernels, the batch and ``serve`` take one whole (``DEFAULTS`` where none is given).
``SERVE_DEFAULTS`` and ``CUSTOM_GENERATE_DEFAULTS`` are the only places an entry point's defaults
differ, each with its reason; ``tests/test_settings.py`` fails if any other place states one of these
defaults. A new setting is one field here, plus the code that acts on it.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from specfree.errors import ConfigError, check_int


def setting(default: Any, doc: str, *, choices: tuple = (), low: int | None = None, high: int | None = None,
            node: str = "", key: str = "") -> Any:
    """A field of ``EngineSettings``: ``choices`` the values it takes, or ``low``/``high`` the range
    of an integer (None stays allowed where it is the default); ``node`` is the config node that
    holds it (top level when empty), ``key`` its name there (the field's own name when empty)."""
    return field(default=default, metadata={"doc": doc, "choices": choices, "low": low, "high": high,
                                            "node": node, "key": key})


@dataclass(frozen=True)
class EngineSettings:
    compile: str = setting(
        "auto", "the compiled forward: true, false, or auto (compiled only where a compiled forward of this "
        "model is ready here within seconds; adapters/compiled.py)", choices=("auto", "true", "false"))
    precision: str = setting(
        "auto", "how layers held as a quantized format's codes multiply: int8 (8-bit activations, llama.cpp's "
        "arithmetic), exact (float32 activations, transformers' output) or auto (int8 for a model read from a "
        "quantized GGUF file where a probe finds it faster on this CPU, exact otherwise: kernels/precision.py); "
        "other layers are float32 at any setting",
        choices=("auto", "exact", "int8"))
    linear_kernel: str = setting(
        "few_row", "CPU linear layers: few_row (specfree's kernel, a quantized file's weights held as its codes), "
        "few_row_fp32 (the kernel on float32 weights) or library (torch's F.linear)",
        choices=("few_row", "few_row_fp32", "library"), node="model")
    adapter_name: str = setting("hf", "the registered model adapter", node="model", key="adapter")
    cache_dir: str | None = setting(
        None, "kernels, compiled packages, cost curves and unpacked models (null: ~/.cache/specfree)")
    generation: str = setting(
        "model", "model: follow the model's generation_config where the verifier leaves a setting unset; "
        "plain: ignore it (greedy unless the verifier samples)", choices=("model", "plain"))
    prompt_cache: bool = setting(
        False, "prefill in row-exact chunks and reuse the KV of the last call's longest common prefix")
    priced: bool = setting(
        True, "keep only the drafted rows that raise expected tokens a second on the cost curve (false: "
        "run the strategy exactly at its knobs)", node="strategy")
    adapt_costs: bool = setting(
        False, "fold live forward times into the cost curve (tracks drift; step counts then vary)", node="strategy")
    price_context: bool = setting(
        True, "price each step's rows at its own context (false: at the curve's 256 tokens)", node="strategy")
    max_batch: int = setting(
        8, "requests decoded together, one forward a step, each as if alone (1: one at a time)", low=1, high=64,
        node="serve")
    threads: int | None = setting(
        None, "torch.set_num_threads; null: torch's default (a joblib sweep: a share of the cores)", low=1)

    def take(self, knobs: dict[str, Any]) -> EngineSettings:
        """These settings with every setting named in ``knobs`` (removed from it) put in, checked."""
        given = {f.name: knobs.pop(f.name) for f in dataclasses.fields(self) if f.name in knobs}
        return dataclasses.replace(self, **given).checked()

    def changed(self, **given: Any) -> EngineSettings:
        """These settings with ``given`` put in, checked (a name that is no setting: TypeError)."""
        return dataclasses.replace(self, **given).checked()

    def value(self, name: str, given: Any = None) -> Any:
        """The setting ``name``: ``given``, checked as every setting is, or these settings' own where None."""
        return getattr(self if given is None else self.changed(**{name: given}), name)

    def checked(self) -> EngineSettings:
        """These settings with each value checked against its choices (``compile`` also takes booleans)
        or its range: the one place a setting's value is checked."""
        return dataclasses.replace(self, **{f.name: check_setting(f.name, getattr(self, f.name))
                                            for f in dataclasses.fields(self) if _checked(f)})

    @classmethod
    def from_config(cls, cfg: Any, skip: tuple[str, ...] = ()) -> EngineSettings:
        """The settings a composed config holds (each at its node; a missing node or key keeps the
        default), checked. ``skip``: keys of the strategy node that are the strategy's own knobs."""
        given = {}
        for f in dataclasses.fields(cls):
            node = _read(cfg, f.metadata["node"]) if f.metadata["node"] else cfg
            value = _read(node, config_key(f))
            if value is not _ABSENT and not (f.metadata["node"] == "strategy" and config_key(f) in skip):
                given[f.name] = value
        return cls(**given).checked()


DEFAULTS = EngineSettings()
# Where an entry point's defaults differ from the library's (the one place they do), and why.
# serve: a server sees every chat's turns again, so reusing their common prefix is what it is for.
SERVE_DEFAULTS = dataclasses.replace(DEFAULTS, prompt_cache=True)
# transformers' custom_generate borrows the caller's model: compiling (auto included) would prepare it
# in place, so by default every call leaves it its own layers.
CUSTOM_GENERATE_DEFAULTS = dataclasses.replace(DEFAULTS, compile="false")


_ABSENT = object()


def _read(node: Any, key: str) -> Any:
    """``node[key]`` of a config (a mapping, or the schema's dataclass object); absent: ``_ABSENT``."""
    if node is None or node is _ABSENT:
        return _ABSENT
    if isinstance(node, Mapping):
        return node[key] if key in node else _ABSENT
    return getattr(node, key, _ABSENT)


def config_key(f: dataclasses.Field) -> str:
    return f.metadata["key"] or f.name


def _checked(f: dataclasses.Field) -> bool:
    return bool(f.metadata["choices"]) or f.metadata["low"] is not None or f.metadata["high"] is not None


def check_setting(name: str, value: Any) -> Any:
    """``value`` for the setting ``name`` (a field of ``EngineSettings``) if it is one of its
    choices or in its range, else a ConfigError naming them. ``generation`` also takes a
    GenerationConfig object."""
    f = _field(name)
    if not f.metadata["choices"]:
        return _in_range(f, value)
    choices = f.metadata["choices"]
    if isinstance(value, bool) and "true" in choices:
        value = "true" if value else "false"
    elif isinstance(value, str) and "true" in choices:
        value = value.lower()
    if name == "generation" and hasattr(value, "to_diff_dict"):  # a GenerationConfig, followed as given
        return value
    if value not in choices:
        raise ConfigError(f"{config_key(f)} must be one of {', '.join(choices)}, not {value!r} "
                          f"({f.metadata['doc']})")
    return value


def _in_range(f: dataclasses.Field, value: Any) -> Any:
    if value is None and f.default is None:
        return value
    return check_int(config_key(f) if not f.metadata["node"] else f"{f.metadata['node']}.{config_key(f)}", value,
                     low=f.metadata["low"], high=f.metadata["high"])


def use_threads(threads: int | None) -> None:
    """Run torch on ``threads`` threads (the ``threads`` setting, checked; None: torch's default)."""
    threads = check_setting("threads", threads)
    if threads is not None:
        import torch

        torch.set_num_threads(threads)


def choices(name: str) -> tuple:
    """The values the setting ``name`` takes."""
    return _field(name).metadata["choices"]


def _field(name: str) -> dataclasses.Field:
    return next(f for f in dataclasses.fields(EngineSettings) if f.name == name)


def config_fields(node: str) -> list[tuple[str, Any, dataclasses.Field]]:
    """The settings a config node holds, as ``dataclasses.make_dataclass`` fields (key, type, default)."""
    types = typing.get_type_hints(EngineSettings)
    return [(config_key(f), types[f.name], field(default=f.default)) for f in dataclasses.fields(EngineSettings)
            if f.metadata["node"] == node]
