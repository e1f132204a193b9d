"""Composing the packaged Hydra configs, checking them, and building an Engine's parts from a config.

The config tree (``specfree/conf``) has one group per swappable part; its schemas, including the
nodes made from the plugin registry for strategies, verifiers and pools, are in
``specfree/conf/schema.py``. Every mistake becomes a one-line ``ConfigError`` naming the field.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig, OmegaConf

from specfree.conf.messages import config_error
from specfree.conf.schema import STEP_KNOBS, BenchConfig, ModelConfig, SpecfreeConfig, knob_fields, node_schema
from specfree.errors import ConfigError, ModelLoadError, one_line
from specfree.registry import Registry, takes_pool_object
from specfree.settings import EngineSettings

if TYPE_CHECKING:
    from specfree.startup import StartupSplit

__all__ = ["BenchConfig", "ModelConfig", "SpecfreeConfig", "compose", "config_error", "engine_parts",
           "group_options", "knob_fields", "load_config", "node_schema"]

CONFIG_MODULE = "specfree.conf"
CONFIG_NAME = "config"
SCHEMA_NAME = "specfree_schema"
COMPONENT_GROUPS = ("strategy", "verifier", "pool", "mask")  # group name == registry kind
GROUPS = ("model", *COMPONENT_GROUPS, "bench", "serve")


def register_config_nodes(reg: Registry) -> None:
    """Put the schemas and every registered component's node into Hydra's ConfigStore.

    The ConfigStore is Hydra's process-wide table; these groups are rewritten from ``reg`` on
    every call, so the last registry used decides what ``strategy=NAME`` means.
    """
    from hydra.core.config_store import ConfigStore

    store = ConfigStore.instance()
    store.store(name=SCHEMA_NAME, node=SpecfreeConfig)
    for kind in COMPONENT_GROUPS:
        store.repo.pop(kind, None)  # a previous registry's components must not linger as options
        for name in reg.names(kind):
            store.store(group=kind, name=name, node=node_schema(reg.get(kind, name)))


# ---- composing ----------------------------------------------------------------------------
@contextmanager
def packaged_configs(job_name: str = "app") -> Iterator[None]:
    """Hydra initialized on the packaged configs, even from inside another Hydra app."""
    from hydra import initialize_config_module
    from hydra.core.global_hydra import GlobalHydra
    from hydra.initialize import get_gh_backup, restore_gh_from_backup

    backup = get_gh_backup() if GlobalHydra.instance().is_initialized() else None
    if backup is not None:
        GlobalHydra.instance().clear()
    try:
        with initialize_config_module(CONFIG_MODULE, job_name=job_name, version_base="1.3"):
            yield
    finally:
        if backup is not None:
            restore_gh_from_backup(backup)


def compose(overrides: Sequence[str] = (), reg: Registry | None = None) -> DictConfig:
    """The packaged config with command-line style ``overrides``; mistakes raise ConfigError."""
    reg = reg if reg is not None else _default_registry()
    register_config_nodes(reg)
    with packaged_configs():
        return compose_here(overrides, reg)


def compose_here(overrides: Sequence[str], reg: Registry, job: str | None = None) -> DictConfig:
    """``compose`` inside ``packaged_configs`` with the config nodes registered. With ``job`` (a
    command's name), the config keeps its ``hydra`` node, composed as ``hydra.main`` composes one run
    of that job, so the run can start from it."""
    from hydra import compose as hydra_compose

    hydra_overrides = [f"hydra.job.name={job}", "hydra.mode=RUN"] if job else []
    try:
        cfg = hydra_compose(CONFIG_NAME, overrides=[*hydra_overrides, *overrides], return_hydra_config=bool(job))
    except Exception as exc:
        raise config_error(exc) from None
    check(cfg, reg)
    return cfg


def check(cfg: DictConfig, reg: Registry) -> None:
    """Refuse keys no schema has room for (Hydra lets ``+key=value`` add them) and unknown names."""
    try:
        # Plain copies: a node keeps its schema class, which a fresh schema would not accept.
        plain = OmegaConf.to_container(cfg)
        top = {k: v for k, v in plain.items() if k not in (*COMPONENT_GROUPS, "hydra")}
        OmegaConf.merge(OmegaConf.structured(SpecfreeConfig), top)
        for group in COMPONENT_GROUPS:
            node = plain.get(group)
            if node is not None:
                if not isinstance(node, Mapping) or not node.get("name"):
                    raise ConfigError(f"{group} must be an option name, e.g. {group}={reg.names(group)[0]}; "
                                      f"available: {', '.join(reg.names(group))}")
                schema = node_schema(reg.get(group, str(node["name"])))
                OmegaConf.merge(OmegaConf.create({group: OmegaConf.structured(schema)}), {group: node})
    except Exception as exc:
        raise config_error(exc) from None


def group_options(reg: Registry | None = None) -> dict[str, list[str]]:
    """Every config group and its options, as ``--help`` lists them."""
    from hydra.core.global_hydra import GlobalHydra

    register_config_nodes(reg if reg is not None else _default_registry())
    with packaged_configs():
        loader = GlobalHydra.instance().config_loader()
        return {group: loader.get_group_options(group) for group in GROUPS}


def load_config(cfg: DictConfig | Mapping | str | Path | None = None, overrides: Sequence[str] = (),
                reg: Registry | None = None) -> DictConfig:
    """A checked config: ``cfg`` (a config, a dict or a YAML file) over the packaged defaults, then
    ``overrides`` (``["strategy=prompt_lookup", "strategy.draft_len=8"]``) on top.

    A partial ``cfg`` is fine: its ``strategy.name`` (likewise verifier, pool) picks the option
    whose defaults fill in the knobs it leaves out.
    """
    reg = reg if reg is not None else _default_registry()
    user = _as_config(cfg)
    if user is None:
        return compose(overrides, reg)
    chosen, values = _split_overrides(overrides)
    picks = dict(chosen)
    for group in COMPONENT_GROUPS:
        node = user.get(group)
        if isinstance(node, str):  # {"strategy": "lookahead"}: just the option
            picks.setdefault(group, node)
            user.pop(group)
        elif group in chosen:
            if isinstance(node, Mapping) and node.get("name") != chosen[group]:
                user.pop(group)  # the override picks another option: this node no longer applies
        elif isinstance(node, Mapping) and node.get("name"):
            picks[group] = str(node["name"])
    base = compose([f"{group}={option}" for group, option in picks.items() if option is not None], reg)
    try:
        merged = OmegaConf.merge(base, user)
        for group, option in picks.items():
            if option is None:  # pool=null: no option to compose, just an empty group
                merged[group] = None
        for key, value in values:
            OmegaConf.update(merged, key, value, merge=False)
    except Exception as exc:
        raise config_error(exc) from None
    check(merged, reg)
    return merged


def _as_config(cfg) -> DictConfig | None:
    if cfg is None:
        return None
    if isinstance(cfg, (str, Path)):
        path = Path(cfg).expanduser()
        if not path.is_file():
            raise ConfigError(f"config file not found: {path}")
        try:
            cfg = OmegaConf.load(path)
        except Exception as exc:
            raise ConfigError(f"{path} is not a YAML config: {one_line(exc)}") from None
    if not isinstance(cfg, (DictConfig, Mapping)):
        raise ConfigError(f"a config must be a DictConfig, a dict or a YAML path, got {type(cfg).__name__}")
    plain = OmegaConf.to_container(OmegaConf.create(cfg) if not isinstance(cfg, DictConfig) else cfg)
    plain.pop("hydra", None)  # a config saved by a Hydra run carries Hydra's own node
    return OmegaConf.create(plain)


def _split_overrides(overrides: Sequence[str]) -> tuple[dict[str, str | None], list[tuple[str, Any]]]:
    """Group picks (``strategy=x``) and value settings (``strategy.k=2``), parsed like the CLI."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        parsed = OverridesParser.create().parse_overrides(list(overrides))
    except Exception as exc:
        raise config_error(exc) from None
    chosen, values = {}, []
    for o in parsed:
        if o.is_sweep_override() or o.is_delete() or o.is_add() or o.is_force_add():
            raise ConfigError(f"override {o.input_line!r}: only key=value and group=option work here; "
                              "sweeps (-m) need the command line")
        key = o.key_or_group
        if key in GROUPS:
            chosen[key] = None if o.value() is None else str(o.value())
        else:
            values.append((key, o.value()))
    return chosen, values


def _default_registry() -> Registry:
    from specfree.plugins import build_plugin_manager, registry

    return registry(build_plugin_manager())


# ---- building -----------------------------------------------------------------------------
def knobs(node: DictConfig | Mapping) -> dict[str, Any]:
    """A component node as plain keyword knobs (``name`` removed)."""
    plain = OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else dict(node)
    plain.pop("name", None)
    return plain


def build(reg: Registry, kind: str, node: DictConfig | Mapping, **extra: Any) -> Any:
    if not isinstance(node, Mapping) or not node.get("name"):
        raise ConfigError(f"{kind} must be a node with a name, e.g. {kind}={reg.names(kind)[0]}; got {node!r}")
    given = knobs(node)
    if kind == "strategy":  # the step knobs (priced...) are the engine's, unless the factory has its own
        takes = reg.get(kind, str(node["name"])).knobs
        given = {k: v for k, v in given.items() if k not in STEP_KNOBS or k in takes}
    try:
        return reg.make(kind, str(node["name"]), **given, **extra)
    except ValueError as exc:  # a factory refused a knob value: a config mistake
        # Pool messages name the pool class, not the config group the user typed: say which.
        if isinstance(exc, ConfigError) and kind != "pool":
            raise
        raise ConfigError(f"{kind}={node['name']}: {exc}") from exc


def build_strategy(cfg: DictConfig, reg: Registry):
    """The strategy, given the ``pool`` node's pool when its factory takes a pool object."""
    component = reg.get("strategy", cfg.strategy.name)
    wants_pool = takes_pool_object(component)
    extra = {}
    if cfg.pool is not None:
        if not wants_pool:
            raise ConfigError(f"strategy {component.name!r} does not take a pool from the pool group; "
                              f"remove pool={cfg.pool.name}")
        extra["pool"] = build(reg, "pool", cfg.pool)
    elif wants_pool and inspect.signature(component.factory).parameters["pool"].default is inspect.Parameter.empty:
        raise ConfigError(f"strategy {component.name!r} needs a pool: add pool=NAME "
                          f"(available: {', '.join(reg.names('pool'))})")
    return build(reg, "strategy", cfg.strategy, **extra)


def engine_parts(cfg: DictConfig, reg: Registry, split: StartupSplit | None = None,
                 warm: bool = False) -> dict[str, Any]:
    """``Engine(**engine_parts(cfg, reg))``: the parts a checked config names. Strategy, verifier
    and mask builder are built first, so their mistakes show before the model spends seconds loading.
    ``split``: times loading the model (``model``) and building its adapter (``adapter``). ``warm``:
    a GGUF model's compiled step comes from a warm start where one was kept (``adapters.warm``;
    its adapter's ``model`` is then no transformers model), and one is kept after a start without."""
    from specfree.loading import check_hub_reachable, load_model
    from specfree.parts import build_parts
    from specfree.startup import phase_of

    own = reg.get("strategy", cfg.strategy.name).knobs  # a factory with its own `priced` keeps it
    settings = EngineSettings.from_config(cfg, skip=tuple(own))
    strategy = build_strategy(cfg, reg)
    if cfg.get("verifier") is not None:
        build(reg, "verifier", cfg.verifier)  # its mistakes show now; it is built with the model's settings below
    mask_builder = build(reg, "mask", cfg.mask) if cfg.get("mask") is not None else None
    model_cfg = cfg.model
    if model_cfg.path is not None and not Path(model_cfg.path).expanduser().exists():
        raise ModelLoadError(f"model.path not found: {model_cfg.path} (give a model folder or a .gguf file)")
    chosen = cfg.get("verifier")
    verifier = {"verifier_knobs": knobs(chosen) if chosen is not None else {},
                "verifier": chosen.name if chosen is not None else None}
    source = warm_source(cfg, reg, settings) if warm else None
    if source is not None:
        from specfree.adapters.warm import remember, warm_start
    with phase_of(split, "model"):
        started = None if source is None else warm_start(source[0], settings.cache_dir)
    if started is not None:
        adapter, tokenizer = started
        with phase_of(split, "adapter"):
            parts = build_parts(adapter.model, reg, strategy, settings, adapter=adapter, **verifier)
        return {**parts, "tokenizer": tokenizer, "mask_builder": mask_builder, "settings": settings}
    check_hub_reachable(model_cfg.path or model_cfg.name, model_cfg.revision)
    with phase_of(split, "model"):
        model, tokenizer = load_model(model_cfg.path or model_cfg.name, device=cfg.device, dtype=cfg.dtype,
                                      cache_dir=settings.cache_dir, attn_implementation=model_cfg.attn_implementation,
                                      revision=model_cfg.revision)
    # The verifier's knobs the config leaves unset (null) follow the model's generation_config.
    with phase_of(split, "adapter"):
        parts = build_parts(model, reg, strategy, settings, **verifier)
    if source is not None:
        remember(parts["adapter"], *source)
    # cache_dir: the cost curve is kept beside the kernels and packages, where the config says
    return {**parts, "tokenizer": tokenizer, "mask_builder": mask_builder, "settings": settings}


def warm_source(cfg: DictConfig, reg: Registry, settings: EngineSettings) -> tuple[Path, Path] | None:
    """Where a warm start of this config's model is kept, and its tokenizer's folder: a GGUF file on
    the built-in adapter's compiled path on a CPU in float32; None for any other model or setup."""
    from specfree.adapters.compiled import make_adapter
    from specfree.adapters.warm import record_folder, warm_key
    from specfree.files import cache_folder
    from specfree.loading import gguf_path, gguf_to_folder

    if (settings.compile == "false" or str(cfg.device) != "cpu" or str(cfg.dtype) not in ("float32", "fp32")
            or reg.get("adapter", settings.adapter_name).factory is not make_adapter):
        return None
    path = gguf_path(cfg.model.path or cfg.model.name)
    if path is None:
        return None
    cache = cache_folder(settings.cache_dir)
    folder = gguf_to_folder(path, cache)  # the file's digest, remembered: a stat and a small read
    return record_folder(cache, warm_key(folder, settings, cfg.model.attn_implementation)), folder
