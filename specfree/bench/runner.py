"""Run every system over every prompt, interleaved, and hand each finished record to a store.

For each prompt (and repeat) the systems run one after the other, so slow drift of the machine
hits them alike, and who goes first rotates from prompt to prompt: on a shared VM the system
that runs right after a prompt switch was measured about 5% slower, which a fixed order would
always charge to the same system (the baseline). A multi-turn prompt runs turn by turn; each
system continues the conversation with ITS OWN earlier answers. A prompt that fails is
recorded with its error and the run goes on; Ctrl-C (KeyboardInterrupt) propagates after the
finished records are safely stored.

Prompts run in the order given, as one sequence of requests: every system keeps ONE engine for
the whole run, so what its strategy keeps across requests (a persistent trie, any drafter that
learns from past outputs) carries from prompt to prompt, from the warm-up and from earlier
repeats. Systems never share that state.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from specfree.bench.metrics import BASELINE, COMPILED, same_output
from specfree.bench.prompts import PromptItem
from specfree.bench.store import RecordStore
from specfree.bench.systems import HFSystem, SpecfreeSystem, Turn
from specfree.errors import ConfigError
from specfree.plugins import build_plugin_manager, registry
from specfree.settings import DEFAULTS, EngineSettings

WARMUP_PROMPT = "Write one short sentence about the sea."


class System(Protocol):
    label: str
    strategy: str
    kind: str
    knobs: dict[str, Any]
    params: dict[str, Any]
    path: str

    def run(self, ids: list[int], max_new_tokens: int) -> Turn: ...


@dataclass
class SystemSpec:
    """What to build: a specfree strategy or an outside baseline, by name, with knobs."""

    name: str
    knobs: dict[str, Any]


def build_systems(model, tokenizer, strategies: Sequence[SystemSpec], baselines: Sequence[SystemSpec],
                  seed: int | None = None, settings: EngineSettings = DEFAULTS, compiled=None,
                  decoding: dict[str, Any] | None = None) -> list[System]:
    """The (eager) autoregressive baseline first, then, given a ``compiled`` adapter, the compiled
    autoregressive loop, then the requested strategies (on ``compiled`` when given), then outside
    baselines. All of them share ``model``, and the strategies one forward-cost curve, so that no
    system's pricing differs from another's by a measurement's noise. ``decoding``: the verifier
    knobs every specfree system decodes with (None: plain greedy). ``settings``: the run's (its
    precision, linear kernel, cache folder; ``compiled`` was built with them)."""
    reg = registry(build_plugin_manager())
    systems: list[System] = [SpecfreeSystem.build(model, tokenizer, BASELINE, {}, seed, reg, settings,
                                                  decoding=decoding)]
    if compiled is not None:
        systems.append(SpecfreeSystem.build(model, tokenizer, BASELINE, {}, seed, reg, settings, adapter=compiled,
                                            suffix=COMPILED, decoding=decoding))
    costs = None  # the first priced engine's curve (read from the cache, checked, or measured)
    for spec in strategies:
        wants_curve = spec.knobs.get("priced", settings.priced) or spec.knobs.get("adapt_costs", settings.adapt_costs)
        system = SpecfreeSystem.build(model, tokenizer, spec.name, spec.knobs, seed, reg, settings,
                                      adapter=compiled, costs=costs if wants_curve else None, decoding=decoding)
        costs = costs or system.engine.costs
        if system.label != BASELINE:  # the baseline runs once, first
            systems.append(system)
    engine = systems[0].engine
    systems += [HFSystem.build(model, s.name, engine.eos_ids, engine.adapter.max_length, s.knobs) for s in baselines]
    labels = [s.label for s in systems]
    dup = next((x for x in labels if labels.count(x) > 1), None)
    if dup:
        raise ConfigError(f"system {dup!r} is listed twice; each strategy/baseline config must differ")
    return systems


def system_meta(system: System) -> dict[str, Any]:
    """Label, kind, strategy, path (eager, compiled or transformers), the knobs given, and the
    knobs in effect (defaults filled in)."""
    return {"label": system.label, "kind": system.kind, "strategy": system.strategy, "path": system.path,
            "knobs": _jsonable(system.knobs), "params": _jsonable(system.params)}


def _jsonable(knobs: dict[str, Any]) -> dict[str, Any]:
    return {k: v if isinstance(v, (str, int, float, bool, type(None), list, dict)) else repr(v)
            for k, v in knobs.items()}


class Conversation:
    """Turns a prompt's user turns (plus a system's own answers) into token ids."""

    def __init__(self, encode: Callable[..., list[int]], decode: Callable[[list[int]], str], chat: bool):
        self.encode, self.decode, self.chat = encode, decode, chat

    def first_ids(self, user: str) -> list[int]:
        """The ids of a prompt's first turn, as ``run`` sends them."""
        return self.encode([{"role": "user", "content": user}], chat=True) if self.chat else self.encode(user, chat=False)

    def run(self, system: System, turns: Sequence[str], max_new_tokens: int) -> list[Turn]:
        messages: list[dict[str, str]] = []
        text = ""
        results = []
        for user in turns:
            if self.chat:
                messages.append({"role": "user", "content": user})
                ids = self.encode(list(messages), chat=True)
            else:
                text = f"{text}{user}" if not text else f"{text}\n\n{user}"
                ids = self.encode(text, chat=False)
            turn = system.run(ids, max_new_tokens)
            answer = self.decode(turn.tokens)
            messages.append({"role": "assistant", "content": answer})
            text += answer
            results.append(turn)
        return results


def warm_up(systems: Sequence[System], conversation: Conversation, max_new_tokens: int, times: int) -> None:
    """Run each system on a short prompt so first-call costs (allocations, kernels) are not timed."""
    for _ in range(times):
        for system in systems:
            conversation.run(system, [WARMUP_PROMPT], min(max_new_tokens, 16))


def run_records(items: Sequence[PromptItem], systems: Sequence[System], conversation: Conversation,
                store: RecordStore, max_new_tokens: int, repeats: int = 1,
                on_unit: Callable[[PromptItem, System, dict | None], None] | None = None) -> None:
    """Run every (prompt, repeat, system) not yet in ``store``; ``on_unit`` hears of each unit
    with its new record (None when it was skipped as already done)."""
    done = store.done
    for index, item in enumerate(items):
        for repeat in range(repeats):
            shift = (index * repeats + repeat) % len(systems)
            for system in [*systems[shift:], *systems[:shift]]:
                if (item.id, system.label, repeat) in done:
                    if on_unit:
                        on_unit(item, system, None)
                    continue
                record = {"prompt_id": item.id, "category": item.category, "subcategory": item.subcategory,
                          "system": system.label, "repeat": repeat, "turns": [], "error": None}
                try:
                    record["turns"] = [t.to_dict() for t in conversation.run(system, item.turns, max_new_tokens)]
                except Exception as exc:  # one bad prompt must not end the run  # noqa: BLE001
                    record["error"] = f"{type(exc).__name__}: {exc}"
                base = record if system.label == BASELINE else store.find(item.id, BASELINE, repeat)
                record["identical"] = _identical(record, base)
                store.add(record)
                if system.label == BASELINE:  # settle the systems that ran before it on this prompt
                    for other in systems:
                        earlier = store.find(item.id, other.label, repeat)
                        if earlier is not None and earlier is not record and earlier.get("identical") is None:
                            earlier["identical"] = _identical(earlier, record)
                            store.add(earlier)
                if on_unit:
                    on_unit(item, system, record)


def _identical(record: dict, base: dict | None) -> bool | None:
    """Same tokens as the baseline's record; None while it has not run (or either failed)."""
    if base is None or record["error"] or base.get("error"):
        return None
    return same_output(record, base)
