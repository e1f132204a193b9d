"""Hook specifications. Built-in parts register through these same hooks as third-party plugins.

A plugin is any module or object with ``@hookimpl`` functions, published under the
``specfree`` entry-point group::

    [project.entry-points.specfree]
    my_strategy = "my_package.specfree_plugin"
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from specfree.registry import Registry

PROJECT = "specfree"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def specfree_register(registry: Registry) -> None:
    """Add components with ``registry.add(kind, name, factory, config=...)``.

    ``kind`` is one of "strategy", "pool", "verifier", "adapter", "mask". ``factory`` is a
    class or function taking plain keyword knobs; ``config`` is an optional dict of default
    knobs. Strategies, pools and verifiers get a Hydra config node ``<kind>/<name>`` made from
    the factory's signature (annotated types are checked) and these defaults, so
    ``strategy=<name> strategy.<knob>=...`` works without shipping YAML.
    """
