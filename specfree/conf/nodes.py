"""One component node checked on its own, exactly as the composed config checks ``strategy=NAME``.

The hybrid's members are such nodes: a name (``prompt_lookup``) or a mapping
(``{name: lookahead, window: 2, pool: trie}``). Each is checked against the schema the
registry makes for its component (typos, wrong types, required knobs), and every mistake is
one line that names the member: ``hybrid.drafters[1] (lookahead): window: expected int, got 'wide'``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from specfree.conf.messages import config_error
from specfree.conf.schema import STEP_KNOBS, knob_fields, node_schema
from specfree.errors import ConfigError
from specfree.registry import Registry, takes_pool_object


def as_node(spec: Any, where: str) -> dict[str, Any]:
    """A member spec as a plain ``{name, knobs...}`` dict (from a name, a dict or a DictConfig)."""
    from omegaconf import DictConfig, OmegaConf

    if isinstance(spec, DictConfig):
        spec = OmegaConf.to_container(spec, resolve=True)
    if isinstance(spec, str) and spec:
        return {"name": spec}
    if isinstance(spec, Mapping) and isinstance(spec.get("name"), str) and spec["name"]:
        return dict(spec)
    raise ConfigError(f"{where}: give a strategy name or {{name: NAME, knob: value, ...}}, got {spec!r}")


def checked_knobs(reg: Registry, kind: str, node: Mapping[str, Any], where: str,
                  defaults: Mapping[str, Any] = ()) -> dict[str, Any]:
    """The knobs to build ``node`` with: ``defaults`` (those the component has) under the node's
    own, checked against the component's config schema. A pool spec is passed on unchecked
    here: ``Registry.make`` builds it through the pool group's nodes."""
    from omegaconf import OmegaConf

    name = str(node["name"])
    try:
        component = reg.get(kind, name)
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    given = {k: v for k, v in node.items() if k != "name"}
    fields = knob_fields(component)
    step = sorted(set(given) & set(STEP_KNOBS) - set(fields)) if kind == "strategy" else []
    if step:
        raise ConfigError(f"{where} ({name}): {step[0]} sets how the whole step runs, not one member: set it on "
                          f"the strategy that holds this one (strategy.{step[0]}=...)")
    pool = given.pop("pool", None) if takes_pool_object(component) else None
    values = {**{k: v for k, v in dict(defaults).items() if k in fields}, **given}
    try:
        checked = OmegaConf.merge(OmegaConf.create({kind: OmegaConf.structured(node_schema(component, False))}),
                                  {kind: {"name": name, **values}})
        knobs = OmegaConf.to_container(checked[kind], throw_on_missing=True)
    except Exception as exc:
        message = str(config_error(exc)).removeprefix(f"{kind}.")
        raise ConfigError(f"{where} ({name}): {message}") from None
    knobs.pop("name")
    if pool is not None:
        knobs["pool"] = pool
    return knobs
