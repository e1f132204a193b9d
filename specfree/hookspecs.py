"""Hook specifications. Built-in parts register through these same hooks as third-party plugins.

A plugin is any module or object with ``@hookimpl`` functions, published under the
``specfree`` entry-point group::

    [project.entry-points.specfree]
    my_strategy = "my_package.specfree_plugin"
"""

from __future__ import annotations

import pluggy

PROJECT = "specfree"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def specfree_register(registry: "Registry") -> None:  # noqa: F821 (see specfree.plugins)
    """Add components with ``registry.add(kind, name, factory, config=...)``.

    ``kind`` is one of "strategy", "pool", "verifier", "adapter", "mask". ``factory`` is a
    class or function taking plain keyword knobs; ``config`` is an optional dict of its
    default knobs, which becomes its Hydra config node.
    """
