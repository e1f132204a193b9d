"""The registry of named components (strategies, pools, verifiers, adapters, mask builders).

It knows nothing of pluggy or configs: plugins fill it (``specfree.plugins``), configs are
made from it (``specfree.conf.schema``).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from specfree.errors import ConfigError

KINDS = ("strategy", "pool", "verifier", "adapter", "mask")
# A factory declaring this parameter is handed the registry by ``Registry.make``: it builds
# other components by name (the hybrid builds its members). It is not a knob.
REGISTRY_PARAMETER = "registry"


@dataclass
class Component:
    kind: str
    name: str
    factory: Callable[..., Any]
    source: str  # the plugin that registered it
    config: dict[str, Any] = field(default_factory=dict)
    member: bool | None = None  # may it be a hybrid's member; None: unless it is composite

    @property
    def knobs(self) -> list[str]:
        params = inspect.signature(self.factory).parameters.values()
        return [p.name for p in params
                if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD) and p.name != REGISTRY_PARAMETER]

    @property
    def composite(self) -> bool:
        """True for a component built from other components (it takes the registry)."""
        return REGISTRY_PARAMETER in inspect.signature(self.factory).parameters

    @property
    def hybrid_member(self) -> bool:
        """Whether a hybrid may hold it: any strategy but a composite, unless registered with
        ``member=True`` (one that builds a helper by name, like sam's fallback, not a hybrid)."""
        return self.member if self.member is not None else not self.composite


class Registry:
    def __init__(self) -> None:
        self.components: dict[str, dict[str, Component]] = {kind: {} for kind in KINDS}
        self._current_source = "?"

    def add(self, kind: str, name: str, factory: Callable[..., Any], config: dict[str, Any] | None = None,
            member: bool | None = None) -> None:
        if kind not in KINDS:
            raise ConfigError(f"plugin {self._current_source!r} registers unknown kind {kind!r}; kinds: {list(KINDS)}")
        existing = self.components[kind].get(name)
        if existing is not None:
            raise ConfigError(f"{kind} {name!r} is registered twice: by {existing.source!r} and "
                              f"{self._current_source!r}; rename one of them")
        self.components[kind][name] = Component(kind, name, factory, self._current_source, dict(config or {}),
                                                   member)

    def names(self, kind: str) -> list[str]:
        return sorted(self.components[kind])

    def get(self, kind: str, name: str) -> Component:
        try:
            return self.components[kind][name]
        except KeyError:
            raise ConfigError(f"unknown {kind} {name!r}; available: {', '.join(self.names(kind))}") from None

    def make(self, kind: str, name: str, **knobs: Any) -> Any:
        """Build a component, turning a wrong knob into a message that lists the right ones.

        A strategy whose factory takes a pool object may be given the pool as a spec (a pool
        name or ``{name: ..., knobs...}``): it is built here, through the registry's pools.
        """
        component = self.get(kind, name)
        unknown = sorted(set(knobs) - set(component.knobs))
        if unknown:
            raise ConfigError(f"{kind} {name!r} has no knob {', '.join(map(repr, unknown))}; "
                              f"its knobs: {', '.join(component.knobs) or '(none)'}")
        if kind == "strategy" and isinstance(knobs.get("pool"), (str, Mapping)) and takes_pool_object(component):
            knobs["pool"] = self.make_pool(knobs["pool"], owner=name)
        if component.composite:
            knobs[REGISTRY_PARAMETER] = self
        return component.factory(**knobs)

    def make_pool(self, spec: str | Mapping, owner: str) -> Any:
        """A pool from a name or a ``{name, knobs...}`` node; its own refusals name ``owner``."""
        node = {"name": spec} if isinstance(spec, str) else dict(spec)
        name = node.pop("name", None)
        if not isinstance(name, str) or not name:
            raise ConfigError(f"{owner}.pool must be a pool name or {{name: ..., knobs...}}; "
                              f"available: {', '.join(self.names('pool'))}; got {spec!r}")
        try:
            return self.make("pool", name, **node)
        except ValueError as exc:
            raise ConfigError(f"{owner}.pool={name}: {exc}") from exc


def takes_pool_object(component: Component) -> bool:
    """Whether the factory's ``pool`` parameter takes a pool object (not a plain config setting)."""
    param = inspect.signature(component.factory).parameters.get("pool")
    if param is None:
        return False
    annotation = param.annotation
    return annotation in (inspect.Parameter.empty, Any, "Any") or (
        isinstance(annotation, str) and annotation.replace(" ", "") in ("Any", "Pool", "Pool|None", "Any|None"))
