"""The plugin manager: built-ins and installed plugins fill a ``Registry`` through one hook.

Import order, one way only: ``registry`` (no plugins) <- ``hookspecs`` <- ``builtin`` <- here.
"""

from __future__ import annotations

import pluggy

from specfree import builtin, hookspecs
from specfree.errors import ConfigError
from specfree.registry import KINDS, Component, Registry

__all__ = ["KINDS", "Component", "Registry", "build_plugin_manager", "registry"]


def build_plugin_manager(extra_plugins: tuple[object, ...] = (), entry_points: bool = True) -> pluggy.PluginManager:
    """Built-ins, then installed entry points, then ``extra_plugins`` (e.g. from a test)."""
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
