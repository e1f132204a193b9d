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
from specfree.settings import DEFAULTS, EngineSettings


def build_adapter(model, reg: Registry | None = None, settings: EngineSettings = DEFAULTS, **knobs: Any) -> Adapter:
    """The adapter ``settings.adapter_name`` over ``model``. A factory that takes ``settings`` (the
    built-in ``hf``) gets them whole; to another, ``compile`` and ``cache_dir`` reach it where it takes
    them, ``linear_kernel`` and ``precision`` only when not the default, so an adapter from a plugin
    need not know them. ``knobs`` (e.g. ``slots``) reach the factories that take them."""
    if reg is None:
        from specfree.plugins import build_plugin_manager, registry

        reg = registry(build_plugin_manager())
    settings = settings.checked()
    takes = reg.get("adapter", settings.adapter_name).knobs
    if "settings" in takes:
        return reg.make("adapter", settings.adapter_name, model=model, settings=settings,
                        **{k: v for k, v in knobs.items() if k in takes})
    given = {"compile": settings.compile, "cache_dir": settings.cache_dir, **knobs}
    extra = {k: v for k, v in given.items() if k in takes}
    for name in ("linear_kernel", "precision"):
        if getattr(settings, name) != getattr(DEFAULTS, name):
            extra[name] = getattr(settings, name)
    return reg.make("adapter", settings.adapter_name, model=model, **extra)


def build_parts(model, reg: Registry, strategy: Any, settings: EngineSettings = DEFAULTS, *,
                verifier_knobs: dict[str, Any] | None = None, verifier: str | None = None,
                adapter: Adapter | None = None) -> dict[str, Any]:
    """``adapter``, ``strategy``, ``verifier`` and ``model_settings`` for ``Engine(...)``: the
    verifier ``verifier`` (None: sampling where asked, else greedy) from ``verifier_knobs`` over the
    model's generation settings (``settings.generation``: see ``specfree.generation``), then the
    adapter (``adapter`` when one was built before), so a bad knob shows before the slow model
    preparation."""
    from specfree.generation import model_verifier

    chosen, followed = model_verifier(reg, model, verifier_knobs or {}, settings.generation, verifier)
    if adapter is None:
        adapter = build_adapter(model, reg, settings)
    return {"adapter": adapter, "strategy": strategy, "verifier": chosen, "model_settings": followed}
