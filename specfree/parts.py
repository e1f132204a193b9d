"""The one way an engine's parts over a loaded model are built, whichever path builds the engine.

``Engine.from_model`` (and so ``from_pretrained``, the bench's systems and the transformers
integration) and ``config.engine_parts`` (the CLI, ``Engine.from_config``) both end in
``build_parts``; it and the bench's shared compiled adapter build the adapter with
``build_adapter``: from the plugin registry (kind ``adapter``; the built-in ``hf`` is
``compiled.make_adapter``), given only the knobs its factory takes, so an adapter from a plugin
need not know them.
"""

from __future__ import annotations

from typing import Any

from specfree.adapters.protocol import Adapter
from specfree.registry import Registry


def build_adapter(model, reg: Registry | None = None, name: str = "hf", *, compile: str | bool = "false",
                  linear_kernel: str = "few_row", cache_dir: str | None = None, precision: str = "exact",
                  **knobs: Any) -> Adapter:
    """The adapter ``name`` over ``model``. ``compile``, ``cache_dir`` and ``knobs`` (e.g. ``slots``)
    reach the factories that take them; ``linear_kernel`` and ``precision`` are passed only when not
    the default."""
    from specfree.adapters.compiled import check_compile

    if reg is None:
        from specfree.plugins import build_plugin_manager, registry

        reg = registry(build_plugin_manager())
    check_compile(compile)
    takes = reg.get("adapter", name).knobs
    given = {"compile": compile, "cache_dir": cache_dir, **knobs}
    extra = {k: v for k, v in given.items() if k in takes}
    if linear_kernel != "few_row":
        extra["linear_kernel"] = linear_kernel
    if precision != "exact":
        extra["precision"] = precision
    return reg.make("adapter", name, model=model, **extra)


def build_parts(model, reg: Registry, strategy: Any, *, verifier_knobs: dict[str, Any] | None = None,
                verifier: str | None = None, generation: Any = "model", adapter: Adapter | None = None,
                adapter_name: str = "hf", compile: str | bool = "false", linear_kernel: str = "few_row",
                cache_dir: str | None = None, precision: str = "exact") -> dict[str, Any]:
    """``adapter``, ``strategy``, ``verifier`` and ``model_settings`` for ``Engine(...)``: the
    verifier ``verifier`` (None: sampling where asked, else greedy) from ``verifier_knobs`` over the
    model's generation settings (``generation``: see ``specfree.generation``), then the adapter
    (``adapter`` when one was built before), so a bad knob shows before the slow model preparation."""
    from specfree.generation import model_verifier

    chosen, settings = model_verifier(reg, model, verifier_knobs or {}, generation, verifier)
    if adapter is None:
        adapter = build_adapter(model, reg, adapter_name, compile=compile, linear_kernel=linear_kernel,
                                cache_dir=cache_dir, precision=precision)
    return {"adapter": adapter, "strategy": strategy, "verifier": chosen, "model_settings": settings}
