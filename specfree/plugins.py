"""The plugin manager and the registry of named components it fills."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pluggy

from specfree import hookspecs
from specfree.errors import ConfigError

KINDS = ("strategy", "pool", "verifier", "adapter", "mask")


@dataclass
class Component:
    kind: str
    name: str
    factory: Callable[..., Any]
    source: str  # the plugin that registered it
    config: dict[str, Any] = field(default_factory=dict)

    @property
    def knobs(self) -> list[str]:
        params = inspect.signature(self.factory).parameters.values()
        return [p.name for p in params if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)]


class Registry:
    def __init__(self) -> None:
        self.components: dict[str, dict[str, Component]] = {kind: {} for kind in KINDS}
        self._current_source = "?"

    def add(self, kind: str, name: str, factory: Callable[..., Any], config: dict[str, Any] | None = None) -> None:
        if kind not in KINDS:
            raise ConfigError(f"plugin {self._current_source!r} registers unknown kind {kind!r}; kinds: {list(KINDS)}")
        existing = self.components[kind].get(name)
        if existing is not None:
            raise ConfigError(f"{kind} {name!r} is registered twice: by {existing.source!r} and "
                              f"{self._current_source!r}; rename one of them")
        self.components[kind][name] = Component(kind, name, factory, self._current_source, dict(config or {}))

    def names(self, kind: str) -> list[str]:
        return sorted(self.components[kind])

    def get(self, kind: str, name: str) -> Component:
        try:
            return self.components[kind][name]
        except KeyError:
            raise ConfigError(f"unknown {kind} {name!r}; available: {', '.join(self.names(kind))}") from None

    def make(self, kind: str, name: str, **knobs: Any) -> Any:
        """Build a component, turning a wrong knob into a message that lists the right ones."""
        component = self.get(kind, name)
        unknown = sorted(set(knobs) - set(component.knobs))
        if unknown:
            raise ConfigError(f"{kind} {name!r} has no knob {', '.join(map(repr, unknown))}; "
                              f"its knobs: {', '.join(component.knobs) or '(none)'}")
        return component.factory(**knobs)


def build_plugin_manager(extra_plugins: tuple[object, ...] = (), entry_points: bool = True) -> pluggy.PluginManager:
    """Built-ins, then installed entry points, then ``extra_plugins`` (e.g. from a test)."""
    from specfree import builtin

    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    pm.register(builtin, name="specfree.builtin")
    if entry_points:
        try:
            pm.load_setuptools_entrypoints(hookspecs.PROJECT)
        except Exception as exc:
            raise ConfigError(f"a specfree plugin failed to load ({_broken_entry_point()}): "
                              f"{type(exc).__name__}: {exc}") from exc
    for plugin in extra_plugins:
        pm.register(plugin)
    return pm


def registry(pm: pluggy.PluginManager) -> Registry:
    """Call every plugin's ``specfree_register`` in registration order (built-ins first), noting
    which plugin added each component."""
    reg = Registry()
    for impl in pm.hook.specfree_register.get_hookimpls():
        reg._current_source = _describe(pm, impl.plugin)
        impl.function(registry=reg)
    return reg


def _describe(pm: pluggy.PluginManager, plugin: object) -> str:
    # A module by its name; an object by its class (pluggy would name it by its id()).
    name = getattr(plugin, "__name__", None) or f"{type(plugin).__module__}.{type(plugin).__qualname__}"
    for dist_plugin, dist in pm.list_plugin_distinfo():
        if dist_plugin is plugin:
            return f"{pm.get_name(plugin)} ({dist.project_name} {dist.version})"
    return name


def _broken_entry_point() -> str:
    """Which ``specfree`` entry point does not import, to name it in the error."""
    from importlib.metadata import entry_points

    for ep in entry_points(group=hookspecs.PROJECT):
        try:
            ep.load()
        except Exception:
            return f"entry point {ep.name!r} = {ep.value!r} from {ep.dist.name if ep.dist else '?'}"
    return "an entry point of group 'specfree'"
