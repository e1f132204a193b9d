"""The things a benchmark times: specfree engines and transformers' own ``generate()``.

Every system shares ONE loaded model and answers ``run(ids, max_new_tokens) -> Turn``: the new
tokens and what was measured while making them. Wall time is taken the same way for every
system (perf_counter around the call, after a device sync), so the columns compare like with like.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from specfree.adapters import as_shipped
from specfree.adapters.kv_buffers import cache_argument
from specfree.bench import predicted
from specfree.bench.metrics import PHASES
from specfree.conf.schema import STEP_KNOBS
from specfree.cost import CostModel
from specfree.engine import Engine
from specfree.errors import ConfigError
from specfree.plugins import Registry, build_plugin_manager, registry
from specfree.settings import DEFAULTS, EngineSettings
from specfree.timing import clock

HF_BASELINES = ("hf_generate", "hf_prompt_lookup", "hf_static_compiled")
LLAMA_CPP_BASELINES = ("llama_cpp", "llama_cpp_lookup")  # built by bench/llama_cpp.py
LLAMA_SERVER_BASELINES = ("llama_server",)  # built by bench/llama_server.py
OUTSIDE_BASELINES = (*HF_BASELINES, *LLAMA_CPP_BASELINES, *LLAMA_SERVER_BASELINES)
STATIC_SLOTS = 512  # hf_static_compiled's StaticCache grows in multiples of this


@dataclass
class Turn:
    """One generation: the raw events every metric is computed from."""

    tokens: list[int]
    wall_s: float
    prompt_tokens: int
    stop_reason: str | None = None
    # seconds before the decode loop (the prompt's forward; specfree's drafter index of it too); None if unknown
    prefill_s: float | None = None
    prefill_emitted: int = 0  # new tokens the prefill itself made (transformers: the first one)
    steps: int | None = None  # forwards that emitted tokens (specfree: after its prefill; transformers: all)
    emitted: list[int] | None = None  # tokens emitted by each step
    rows: int | None = None  # rows pushed through all forwards
    offered: int | None = None  # rows the drafters offered, before pricing kept ``rows`` of them
    split: dict[str, float] | None = None  # draft/mask/forward/verify/other seconds
    accepted_by: dict[str, int] | None = None  # accepted drafted tokens per drafter (a hybrid's members)
    priced: dict | None = None  # pricing's predictions beside the measurements (``predicted.from_steps``)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def check_listed_once(labels: list[str]) -> None:
    """An outside baseline's rows must differ: two entries that make one label would be one row twice."""
    dup = next((x for x in labels if labels.count(x) > 1), None)
    if dup:
        raise ConfigError(f"{dup!r} is listed twice in bench.baselines; each entry must differ")


def _as_list(value: Any) -> Any:
    """Tuples as lists: a default of ("a", "b") and a config's [a, b] are the same knob value."""
    return list(value) if isinstance(value, (tuple, list)) else value


def describe(name: str, knobs: dict[str, Any]) -> str:
    """A system's label: its name and the knobs it was given, e.g. ``prompt_lookup(draft_len=8)``."""
    if not knobs:
        return name
    return f"{name}({','.join(f'{k}={v}' for k, v in sorted(knobs.items()))})"


@dataclass
class SpecfreeSystem:
    """A specfree ``Engine`` with one strategy over the shared model."""

    strategy: str
    engine: Engine
    knobs: dict[str, Any] = field(default_factory=dict)  # as given (a pool as its config node)
    params: dict[str, Any] = field(default_factory=dict)  # every knob in effect, defaults filled in
    label: str = ""
    seed: int | None = None
    kind: str = "specfree"
    path: str = "eager"  # the forward it runs on: eager, or compiled (a shared compiled adapter)

    @classmethod
    def build(cls, model, tokenizer, strategy: str, knobs: dict[str, Any] | None = None,
              seed: int | None = None, reg: Registry | None = None,
              settings: EngineSettings = DEFAULTS, adapter=None, suffix: str = "",
              costs: CostModel | None = None, decoding: dict[str, Any] | None = None) -> SpecfreeSystem:
        """``knobs`` may hold ``pool`` as a pool config node ``{name, knobs...}`` (or a pool name).
        ``adapter``: a compiled adapter shared by the compiled systems (None: an eager one of its
        own); ``suffix`` is added to the label (`` (compiled)``); ``costs``: the forward-cost curve
        to price on (None: the engine reads or measures its own); ``decoding``: verifier knobs
        (``do_sample``, ``temperature``...; None: plain greedy); ``settings``: the run's (an eager
        system never compiles)."""
        reg = reg or registry(build_plugin_manager())
        knobs = dict(knobs or {})
        component = reg.get("strategy", strategy)
        # A pool spec in knobs is built by Registry.make, like a hybrid member's.
        # generation="plain": bench times plain greedy decoding, as its transformers baselines run it,
        # or the decoding the run names (then with specfree's systems alone).
        settings = dataclasses.replace(settings, compile="false", generation="plain")
        # Every priced system's curve corrected by its own steps' times, the one built first and those
        # given its curve alike.
        engine = Engine.from_model(model, tokenizer, strategy, settings=settings, adapter=adapter,
                                   costs=None if costs is None else CostModel.from_dict(costs.as_dict()),
                                   correct_costs=True,
                                   **(decoding or {}), **knobs)
        # The step knobs (priced...) are documented defaults too: `{name: trie, priced: false}` is
        # labelled trie(priced=False), beside the priced trie, in one report.
        documented = {k: default for k, (_, default) in STEP_KNOBS.items()}
        actual = dict(documented)
        for p in inspect.signature(component.factory).parameters.values():
            if p.default is not p.empty:
                documented[p.name] = component.config.get(p.name, p.default)
                actual[p.name] = p.default
        # The label names only the knobs that differ from the documented defaults.
        shown = {k: (v.get("name", v) if isinstance(v, Mapping) else v) for k, v in knobs.items()
                 if k not in documented or _as_list(documented[k]) != _as_list(v)}
        return cls(strategy, engine, knobs, {**actual, **knobs}, describe(strategy, shown) + suffix, seed,
                   path="eager" if adapter is None else "compiled")

    def run(self, ids: list[int], max_new_tokens: int) -> Turn:
        device = self.engine.adapter.device
        start = clock(device)
        gen = self.engine.generate(ids, max_new_tokens, seed=self.seed)
        wall = clock(device) - start
        self.engine.adapter.reset()  # free this system's KV cache before the next one runs
        return Turn(tokens=list(gen.tokens), wall_s=wall, prompt_tokens=gen.prompt_tokens,
                    stop_reason=gen.stop_reason, prefill_s=gen.prefill_s, steps=len(gen.steps),
                    emitted=[s.emitted for s in gen.steps], rows=sum(s.rows for s in gen.steps),
                    offered=sum(s.offered for s in gen.steps),
                    split={k: sum(getattr(s, k) for s in gen.steps) for k in PHASES},
                    accepted_by=gen.accepted_by, priced=predicted.from_steps(gen.steps))


@dataclass
class HFSystem:
    """transformers' ``model.generate`` (greedy), optionally with its prompt-lookup decoding."""

    strategy: str
    model: Any
    eos_ids: list[int]
    max_length: int
    knobs: dict[str, Any] = field(default_factory=dict)
    kind: str = "transformers"
    path: str = "transformers"  # its own loop: no specfree autoregressive loop runs the same path
    static_slots: int = STATIC_SLOTS  # hf_static_compiled: the StaticCache's size, unless a prompt needs more

    @property
    def params(self) -> dict[str, Any]:
        return dict(self.knobs)

    @classmethod
    def build(cls, model, name: str, eos_ids, max_length: int, knobs: dict[str, Any] | None = None) -> HFSystem:
        knobs = dict(knobs or {})
        if name not in HF_BASELINES:
            raise ConfigError(f"unknown outside baseline {name!r}; available: {', '.join(OUTSIDE_BASELINES)}")
        if name == "hf_prompt_lookup":
            knobs.setdefault("prompt_lookup_num_tokens", 10)
        elif "prompt_lookup_num_tokens" in knobs:
            raise ConfigError(f"{name} takes no prompt_lookup_num_tokens; use hf_prompt_lookup")
        if not eos_ids:
            raise ConfigError("the model defines no eos token id; transformers' generate() needs one to stop")
        if name == "hf_static_compiled":
            # What a transformers user tries first: a StaticCache and torch.compile of the forward
            # (generate compiles the one-token steps). On its own stock copy of the modules, so the
            # graph never sees the layers specfree's engines swap into the shared model.
            from specfree.adapters.compiled import shared_parameter_copy

            with as_shipped(model):
                model = shared_parameter_copy(model)
        return cls(name, model, sorted(eos_ids), max_length, knobs)

    @property
    def label(self) -> str:
        return describe(self.strategy, self.knobs)

    def _static_inputs(self, needed: int) -> dict[str, Any]:
        """generate()'s arguments for a static cache holding ``needed`` tokens, compiled."""
        from transformers import StaticCache
        from transformers.generation import CompileConfig

        cache = getattr(self, "_cache", None)
        if cache is None or self._cache_slots < needed:
            slots = -(-max(needed, self.static_slots) // STATIC_SLOTS) * STATIC_SLOTS
            cache = self._cache = StaticCache(config=self.model.config, max_cache_len=slots)
            self._cache_slots = slots
        cache.reset()
        config = CompileConfig()
        config._compile_all_devices = True  # transformers compiles by itself on GPUs only; a CPU user asks so
        return {cache_argument(self.model): cache, "compile_config": config}

    @torch.inference_mode()
    def run(self, ids: list[int], max_new_tokens: int) -> Turn:
        device = self.model.device
        input_ids = torch.tensor([ids], device=device)
        # The engine stops at the context end; ask generate() for no more than fits either.
        budget = max(0, min(max_new_tokens, self.max_length - len(ids)))
        if budget == 0:
            raise ConfigError(f"the prompt has {len(ids)} tokens but the model's context holds {self.max_length}")
        forwards = 0

        def count(*_):
            nonlocal forwards
            forwards += 1

        handle = self.model.register_forward_pre_hook(count)
        static = self._static_inputs(len(ids) + budget) if self.strategy == "hf_static_compiled" else {}
        first = FirstTokens(device)
        try:
            # transformers as shipped, not the kernels a specfree engine gave the shared model
            with as_shipped(self.model):
                start = clock(device)
                out = self.model.generate(
                    input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=budget, do_sample=False,
                    num_beams=1, repetition_penalty=1.0, no_repeat_ngram_size=0,  # plain greedy, whatever the
                    eos_token_id=self.eos_ids, pad_token_id=self.eos_ids[0],      # model's generation_config says
                    streamer=first, **static, **self.knobs)
                wall = clock(device) - start
        finally:
            handle.remove()
        tokens = out[0, len(ids):].tolist()
        if tokens and tokens[-1] in self.eos_ids:
            stop = "eos"
        else:
            stop = "max_new_tokens" if budget == max_new_tokens else "context_length"
        # The prefill: up to the first new tokens (the prompt's forward, with prompt lookup its first draft too).
        prefill = wall if first.at is None else first.at - start
        return Turn(tokens=tokens, wall_s=wall, prompt_tokens=len(ids), stop_reason=stop, steps=forwards,
                    prefill_s=prefill, prefill_emitted=first.count if first.at is not None else len(tokens))


class FirstTokens:
    """A generate() streamer that notes when its first new tokens arrive, and how many: the end of
    the prefill. (generate() puts the prompt first, then the tokens of each step.)"""

    def __init__(self, device: torch.device):
        self.device, self.puts, self.at, self.count = device, 0, None, 0

    def put(self, value: torch.Tensor) -> None:
        self.puts += 1
        if self.puts == 2:
            self.at = clock(self.device)
            self.count = int(value.numel())

    def end(self) -> None:
        pass
