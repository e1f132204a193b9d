"""Config schemas: the dataclasses the packaged YAML is checked against, and the nodes made
from the plugin registry for strategies, verifiers, pools and mask builders.

Each registered component becomes a dataclass ``{name, knobs...}`` whose fields are its
factory's keyword parameters, typed from their annotations, with defaults from
``Registry.add(config=...)`` or the signature. A third-party strategy thus gets a config node
with typo and type checks without shipping YAML, exactly like the built-ins.
"""

from __future__ import annotations

import collections.abc
import copy
import dataclasses
import enum
import inspect
import pathlib
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Optional

from omegaconf import MISSING

from specfree.errors import ConfigError
from specfree.registry import REGISTRY_PARAMETER, Component
from specfree.settings import SERVE_DEFAULTS, config_fields


def with_settings(schema: type, node: str = "") -> type:
    """``schema`` with the engine settings its node holds appended, made from ``EngineSettings``
    (``specfree.settings``: each declared there once, with its default)."""
    return dataclasses.make_dataclass(schema.__name__, config_fields(node), bases=(schema,))


@dataclass
class ModelConfig:
    name: str = MISSING  # embedded name (smollm2), hub id, folder or .gguf file
    # A folder or .gguf on disk, loaded instead of `name`. Every model option sets it (most to
    # null); a YAML `???` could not make it required, because merging never overwrites with ???.
    path: str | None = MISSING
    revision: str | None = None
    attn_implementation: str = "sdpa"
    # adapter and linear_kernel: from specfree.settings


ModelConfig = with_settings(ModelConfig, "model")


# The outside systems a bench runs unless told otherwise. The llama.cpp rows among them are skipped,
# with one line saying how to add them, where llama-cpp-python is missing or the model is no GGUF.
DEFAULT_BASELINES = ("hf_generate", "hf_prompt_lookup", "hf_static_compiled", "llama_cpp", "llama_cpp_lookup")


@dataclass
class BenchConfig:
    prompts: str = MISSING
    format: str = "spec_bench"
    fields: dict[str, str | None] = field(default_factory=dict)
    limit: int | None = None
    per_category: int | None = None
    max_new_tokens: int = 128
    baselines: list[Any] = field(default_factory=lambda: list(DEFAULT_BASELINES))
    strategies: list[Any] = field(default_factory=list)
    repeats: int = 1
    warmup: int = 1
    resume: bool = False
    out: str | None = None
    chat: bool = True
    markdown: bool = False
    cost_curves: bool = True
    concurrency: int = 1  # > 1: each strategy's prompts also run this many at a time (bench/concurrent.py)


@dataclass
class ServeConfig:
    """``python -m specfree serve``: the OpenAI-compatible server (docs/serve.md)."""

    host: str = "127.0.0.1"  # 0.0.0.0 listens on every interface: set api_key then
    port: int = 8000
    api_key: str | None = None  # set: every /v1 and /metrics request needs "Authorization: Bearer <key>"
    model_name: str | None = None  # the id /v1/models lists; null: model.name (or the file or folder name)
    queue_size: int = 16  # requests waiting beside those decoding; one more gets 429 with Retry-After
    request_timeout: float = 600.0  # seconds from arrival to the last token (queue wait included)
    max_body_bytes: int = 1_000_000  # a larger request body gets 413
    max_tokens: int = 1024  # the most tokens a request may ask for; also the default when it asks none
    state_file: str | None = None  # the suffix drafter's global tree: loaded at start if present, saved at shutdown
    log_level: str = "info"  # uvicorn's: critical | error | warning | info | debug | trace
    # reuse the KV of the longest common prefix with the last request (docs/serve.md); on unlike the
    # library's prompt_cache: specfree.settings.SERVE_DEFAULTS says why
    prompt_cache: bool = SERVE_DEFAULTS.prompt_cache
    cors_origins: list[str] = field(default_factory=list)  # origins a browser may call from ("*": any); none: no CORS
    # max_batch: from specfree.settings


ServeConfig = with_settings(ServeConfig, "serve")


@dataclass
class SpecfreeConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    strategy: Any = None  # these four are checked by their own registry-made schemas
    verifier: Any = None
    pool: Any = None
    mask: Any = None
    bench: BenchConfig | None = None
    serve: ServeConfig | None = None
    prompt: str | None = None
    prompt_file: str | None = None
    chat: bool = True
    max_new_tokens: int = 128
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    seed: int | None = None
    json_schema: str | None = None  # structured output (docs/structured-output.md): one of these four
    json_object: bool = False
    regex: str | None = None
    grammar: str | None = None
    device: str = "cpu"
    dtype: str = "float32"
    output: str | None = None
    verify_against_baseline: bool = False
    # compile, precision, cache_dir, generation, prompt_cache, threads: from specfree.settings


SpecfreeConfig = with_settings(SpecfreeConfig)


# ---- config nodes made from the registry ---------------------------------------------------
# Knobs of every strategy node that set how the engine runs the steps, not the drafter itself
# (``Engine(priced=..., adapt_costs=..., price_context=...)``): every strategy is priced unless told
# otherwise, at each step's own context, and live forward times stay out of the cost curve (runs
# repeat step for step).
STEP_KNOBS: dict[str, tuple[type, Any]] = {key: (kind, default.default)
                                           for key, kind, default in config_fields("strategy")}


def knob_fields(component: Component) -> dict[str, tuple[Any, Any]]:
    """The knobs a config can set: name -> (type OmegaConf checks, default or MISSING).

    Parameters whose type a config cannot hold (a pool object, logits processors) are left out;
    a ``pool`` object comes from the ``pool`` group instead.
    """
    try:
        params = inspect.signature(component.factory, eval_str=True).parameters
    except Exception:  # an annotation that only exists under TYPE_CHECKING: keep the strings
        params = inspect.signature(component.factory).parameters
    fields: dict[str, tuple[Any, Any]] = {}
    for p in params.values():
        if p.kind not in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD) or p.name == REGISTRY_PARAMETER:
            continue
        kind = _config_type(p.annotation)
        if kind is None or (p.name == "pool" and kind is Any):  # an untyped `pool` is a pool object
            continue
        default = component.config.get(p.name, p.default)
        fields[p.name] = (kind, MISSING if default is p.empty else _plain_default(default))
    stray = sorted(set(component.config) - set(fields))
    if stray:
        raise ConfigError(f"{component.kind} {component.name!r} (from {component.source}) has config defaults for "
                          f"{stray}, which are not knobs of its factory; knobs: {', '.join(fields)}")
    return fields


def _config_type(annotation: Any) -> Any:
    """The OmegaConf type for a parameter annotation, or None when a config cannot express it."""
    if annotation is inspect.Parameter.empty or annotation is Any or isinstance(annotation, str):
        return Any
    if annotation in (int, float, bool, str):
        return annotation
    if annotation in (list, tuple, set, frozenset):
        return list[Any]
    if annotation is dict:
        return dict[str, Any]
    if inspect.isclass(annotation):
        if issubclass(annotation, pathlib.PurePath):
            return str
        return annotation if issubclass(annotation, enum.Enum) else None  # other classes are objects
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        rest = [a for a in args if a is not type(None)]
        inner = _config_type(rest[0]) if len(rest) == 1 else Any
        return None if inner is None else (Optional[inner] if len(rest) < len(args) else inner)
    if origin is typing.Literal:
        kinds = {type(a) for a in args}
        return kinds.pop() if len(kinds) == 1 and kinds <= {int, str, bool, float} else Any
    if origin in (list, tuple, set, frozenset, collections.abc.Sequence, collections.abc.Set):
        inner = _config_type(args[0]) if args else Any
        return None if inner is None else list[inner]
    if origin in (dict, collections.abc.Mapping):
        return dict[str, Any]
    return None


def _plain_default(value: Any) -> Any:
    if isinstance(value, (tuple, set, frozenset)):
        return list(value)
    if isinstance(value, pathlib.PurePath):
        return str(value)
    return value


def node_schema(component: Component, step_knobs: bool = True) -> type:
    """A dataclass ``{name, knobs...}`` for one registered component: its Hydra config node (a
    strategy's with the ``STEP_KNOBS``, unless ``step_knobs`` is False: a hybrid's member)."""
    specs = [("name", str, component.name)]
    fields = knob_fields(component)
    if component.kind == "strategy" and step_knobs:
        fields.update({k: v for k, v in STEP_KNOBS.items() if k not in fields})
    for knob, (kind, default) in fields.items():
        if isinstance(default, (list, dict)):
            default = field(default_factory=lambda d=default: copy.deepcopy(d))
        specs.append((knob, kind, default))
    title = "".join(part.title() for part in f"{component.name}_{component.kind}".split("_"))
    return dataclasses.make_dataclass(f"{title}Config", specs, namespace={"component": component.name})
