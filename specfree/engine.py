"""The decoding loop: draft, lay out, one forward, verify, keep the accepted KV, observe."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable, Generator, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from specfree.adapters.protocol import Adapter
from specfree.batching import Batch, decode_together
from specfree.files import DEFAULT_CACHE
from specfree.constraints import Constraint, ConstraintMask, Grammars, Matcher, masked, per_prompt
from specfree.cost import CostModel
from specfree.detokenize import Detokenizer
from specfree.errors import ConfigError
from specfree.generation import ModelSettings, for_call
from specfree.masks.tree import Layout, build_layout
from specfree.planner import StepPlanner
from specfree.pricer import Pricer
from specfree.pricing import AcceptanceModel
from specfree.strategies.base import Strategy
from specfree.strategies.grammar import GrammarDrafter
from specfree.strategies.hybrid import Hybrid
from specfree.draft_tree import DraftTree
from specfree.settings import DEFAULTS, EngineSettings
from specfree.request import Request
from specfree.types import AuxBlock, Generation
from specfree.sequence import Chunk, Decoding
from specfree.verifiers import GreedyVerifier

__all__ = ["Chunk", "Engine"]


def _check_text(text: str) -> str:
    """Text the tokenizer can take: bytes that were not UTF-8 (read with ``surrogateescape``, as
    Python does for command-line arguments under a C locale) would fail deep inside it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ConfigError("the prompt is not valid UTF-8 text (it holds undecodable bytes); give UTF-8 text") from None
    return text


# Lays out one step's rows: (tree, aux rows, root position) -> tokens, positions, mask.
MaskBuilder = Callable[[DraftTree, AuxBlock | None, int], Layout]
DEFAULT_STRATEGY = "hybrid"  # why: docs/strategies.md#the-default-the-priced-hybrid


class Engine:
    """``settings`` (``specfree.settings.EngineSettings``, any field of it also as a keyword over it),
    kept whole as ``engine.settings``. ``priced`` (the default): every step keeps only the drafted
    rows that raise expected tokens per second on the measured cost curve (``specfree.pricing``); False runs the strategy exactly
    at its knobs. ``adapt_costs`` folds live forward times into the curve (tracks machine drift,
    at the price of step counts that vary from run to run). ``price_context`` (the default) prices
    each step's rows at its own context (a row attends to all of it); False prices every step at
    the curve's reference context (256 tokens). ``costs``: a cost curve to use instead
    of the measured one; ``acceptance``: statistics to start from (and keep learning into).
    ``correct_costs``: price on the curve corrected by the steps' own forward times
    (``cost.Correction``); None: where the engine measured its own curve, or with ``adapt_costs``
    (a curve given as ``costs`` is the caller's: fixed, it keeps step counts the same run to run).
    ``model_settings``: which of the model's generation settings the verifier follows (a record,
    for reports; ``specfree.generation``).

    ``prompt_cache``: hold the KV of the last call's tokens and, on the next call, prefill only
    what follows the longest common prefix of token ids (``Generation.cached_tokens`` says how
    many were reused; ``generate(..., cache_prompt=False)`` prefills the whole prompt). The
    adapter's KV manager holds and adopts that prefix, as it does for a batch's requests. Lossless
    either way: where an adapter's rows are exact and its KV can be cut (``reuse_off`` is None),
    every prompt is prefilled in chunks of at most ``batching.EXACT_CHUNK`` rows through the
    row-exact attention, cached or not, so every kept row has the bits of the one-row forward
    whichever call computed it, and the answer is the same with the cache on or off. Elsewhere
    (``reuse_off`` says why) a prompt is prefilled in one call and nothing is reused: recurrent and
    hybrid families, whose state cannot be cut, and rows that are not exact. A compiled adapter
    reuses only the rows its eager prefill computed (its compiled steps match the eager rows to
    rounding, not bit for bit)."""

    def __init__(self, adapter: Adapter, strategy: Strategy, verifier=None, tokenizer=None, *,
                 settings: EngineSettings = DEFAULTS, mask_builder: MaskBuilder | None = None,
                 costs: CostModel | None = None, acceptance: AcceptanceModel | None = None,
                 model_settings: ModelSettings | None = None, correct_costs: bool | None = None, **knobs: Any):
        settings = settings.take(knobs)
        if knobs:
            raise ConfigError(f"unexpected keywords {sorted(knobs)}: Engine takes the fields of EngineSettings")
        self.settings = settings
        priced, adapt_costs = settings.priced, settings.adapt_costs
        self.adapter = adapter
        self.strategy = strategy
        self.verifier = verifier or GreedyVerifier()
        self.tokenizer = tokenizer
        self.mask_builder = mask_builder or build_layout
        strategy.bind_tokenizer(tokenizer)
        strategy.setup(adapter.vocab_size, adapter.max_length)
        drafts = type(strategy).propose is not Strategy.propose  # the autoregressive loop offers nothing to price
        own = (priced and drafts or adapt_costs) and costs is None
        if own:
            # Pricing needs the forward cost curve: a quick one measured once, then read from the cache;
            # the row counts it lacks are learned from the steps that run them (``cost.Learner``).
            costs = CostModel.cached(adapter, Path(settings.cache_dir) if settings.cache_dir else DEFAULT_CACHE)
        self.costs = costs
        correct = bool(own or adapt_costs) if correct_costs is None else correct_costs
        self.pricer = Pricer.calibrated(costs, acceptance, correct=correct) if priced else None
        self._costs = costs.learner(adapt_costs) if own else costs if adapt_costs else None
        self.price_context = settings.price_context
        self.eos_ids = self._eos_ids()
        self.model_settings = model_settings or ModelSettings()
        self._grammars: Grammars | None = None  # constraints compiled over this tokenizer, made on first use

    @property
    def priced(self) -> bool:
        return self.pricer is not None

    @property
    def prompt_cache(self) -> bool:
        return self.settings.prompt_cache

    @prompt_cache.setter
    def prompt_cache(self, on: bool) -> None:  # serve turns it on for its engine: the settings say so
        self.settings = self.settings.changed(prompt_cache=bool(on))

    # ---- construction -------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, model: str = "smollm2", strategy: str = DEFAULT_STRATEGY, *,
                        device: str = "cpu", dtype: str = "float32", settings: EngineSettings = DEFAULTS,
                        **knobs: Any) -> "Engine":
        """Load ``model`` (embedded name, .gguf, folder or hub id) and build an engine; ``settings`` and
        ``knobs``: see ``from_model``."""
        from specfree.loading import load_model

        settings = settings.take(knobs)
        hf_model, tokenizer = load_model(model, device=device, dtype=dtype, cache_dir=settings.cache_dir)
        return cls.from_model(hf_model, tokenizer, strategy, settings=settings, **knobs)

    @classmethod
    def from_model(cls, model, tokenizer=None, strategy: str | Strategy = DEFAULT_STRATEGY, *,
                   adapter: Adapter | None = None, costs: CostModel | None = None,
                   acceptance: AcceptanceModel | None = None, settings: EngineSettings = DEFAULTS,
                   correct_costs: bool | None = None, **knobs: Any) -> "Engine":
        """Wrap an already loaded transformers model.

        ``settings`` (``specfree.settings.EngineSettings``: each field's default and meaning), and
        any of its fields as a keyword over it: ``compile`` (``true`` compiles, minutes the first
        time on a machine; ``auto``, the default, only where a compiled forward of this model is
        ready here within seconds), ``precision`` (``"auto"``, the default, runs a quantized
        GGUF file's coded layers on 8-bit activations and everything else exact; ``"exact"``,
        ``"int8"``), ``linear_kernel``, ``cache_dir``, ``generation``, ``prompt_cache``,
        ``priced``, ``adapt_costs``, ``price_context`` (see ``Engine``). ``generation`` may also be
        a ``GenerationConfig``, followed instead of the model's; ``engine.model_settings`` says
        what was followed.

        The other ``knobs``: sampling (do_sample, temperature, top_k, top_p, repetition_penalty,
        seed, logits_processors) and the strategy's own knobs. ``adapter``: one built before for
        this model (a compiled one is reused, not recompiled). ``costs``, ``acceptance``: see ``Engine``.
        """
        from specfree.parts import build_parts
        from specfree.plugins import build_plugin_manager, registry

        settings = settings.take(knobs)
        sampling_keys = ("do_sample", "temperature", "top_k", "top_p", "repetition_penalty", "seed",
                         "logits_processors")
        sampling = {k: knobs.pop(k) for k in sampling_keys if k in knobs}
        reg = registry(build_plugin_manager())
        if not isinstance(strategy, Strategy):
            strategy = reg.make("strategy", strategy, **knobs)
        elif knobs:
            raise ConfigError(f"unexpected knobs {sorted(knobs)} for an already built strategy")
        parts = build_parts(model, reg, strategy, settings, verifier_knobs=sampling, adapter=adapter)
        if parts["model_settings"].ignored:
            warnings.warn(parts["model_settings"].line(), stacklevel=2)
        return cls(**parts, tokenizer=tokenizer, costs=costs, acceptance=acceptance, correct_costs=correct_costs,
                   settings=settings)

    @classmethod
    def from_config(cls, cfg=None, overrides: Sequence[str] = (), plugins: Sequence[object] = ()) -> "Engine":
        """Build from a config: a DictConfig, a dict or a YAML path, over the packaged defaults.

        ``overrides`` are command-line style (``["strategy=prompt_lookup", "strategy.draft_len=8"]``);
        ``plugins`` are extra plugin objects, beside the installed ones. See ``specfree.config``.
        """
        from specfree.config import engine_parts, load_config
        from specfree.plugins import build_plugin_manager, registry

        reg = registry(build_plugin_manager(extra_plugins=tuple(plugins)))
        return cls(**engine_parts(load_config(cfg, overrides, reg), reg))

    def _eos_ids(self) -> set[int]:
        ids: set[int] = set()
        for source in (getattr(self.adapter.model, "generation_config", None), self.adapter.model.config,
                       self.tokenizer):
            value = getattr(source, "eos_token_id", None) if source is not None else None
            ids.update([value] if isinstance(value, int) else (value or []))
        return ids

    # ---- prompts ------------------------------------------------------------------------
    def encode(self, prompt: str | Sequence[int] | Sequence[dict] | torch.Tensor,
               chat: bool | None = None) -> list[int]:
        """Token ids for a string, a chat (list of {role, content}), or ids."""
        if isinstance(prompt, torch.Tensor):
            prompt = prompt.flatten().tolist()
        if isinstance(prompt, str) and chat:
            prompt = [{"role": "user", "content": prompt}]
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], dict)):
            if self.tokenizer is None:
                raise ConfigError("a text prompt needs a tokenizer; pass token ids or build the engine with one")
            if isinstance(prompt, str):
                ids = self.tokenizer(_check_text(prompt)).input_ids
            else:
                if not getattr(self.tokenizer, "chat_template", None):
                    raise ConfigError("this model's tokenizer has no chat template; pass plain text (chat=false)")
                text = self.tokenizer.apply_chat_template(list(prompt), add_generation_prompt=True, tokenize=False)
                ids = self.tokenizer(_check_text(text), add_special_tokens=False).input_ids
        else:
            ids = list(prompt)
        return self.check_ids(ids)

    def check_ids(self, ids: Sequence) -> list[int]:
        """``ids`` as a prompt's token ids: not empty, each in the vocabulary, shorter than the context."""
        if not ids:
            raise ConfigError("the prompt is empty: give at least one token of text")
        bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, (int, np.integer))
               or not 0 <= t < self.adapter.vocab_size]
        if bad:
            raise ConfigError(f"prompt token ids must be integers in [0, {self.adapter.vocab_size}); "
                              f"got {bad[:5]}{'...' if len(bad) > 5 else ''}")
        if len(ids) >= self.adapter.max_length:
            raise ConfigError(f"the prompt has {len(ids)} tokens but the model's context holds "
                              f"{self.adapter.max_length}; shorten the prompt")
        return [int(t) for t in ids]

    # ---- decoding -----------------------------------------------------------------------
    def request(self, prompt, max_new_tokens: int = 128, *, chat: bool | None = None, **fields: Any) -> Request:
        """A ``Request`` for ``prompt`` (text, a chat or ids, as ``encode`` takes them); ``fields``:
        its other fields (``specfree.request.Request``), checked now."""
        return Request(self.encode(prompt, chat), max_new_tokens, **fields)

    def generate(self, prompt, max_new_tokens: int = 128, *, stop: Sequence[str] = (), chat: bool | None = None,
                 seed: int | None = None, ignore_eos: bool = False, cache_prompt: bool = True,
                 logprobs: int | None = None, json_schema=None, regex: str | None = None,
                 grammar: str | None = None, json_object: bool = False) -> Generation:
        """``json_schema`` (a dict or JSON text), ``json_object`` (any JSON object), ``regex``,
        ``grammar`` (Lark or llama.cpp's GBNF): what the answer must match, at most one
        (docs/structured-output.md); the tokens are those of plain decoding under the same mask.
        ``cache_prompt=False``: prefill the whole prompt even where ``prompt_cache`` could reuse a prefix.
        ``logprobs=k``: each new token's log-probability under the model (log-softmax of the raw
        logits of the verify row that predicted it, before any processor) and its ``k`` most likely
        alternatives, in ``Generation.logprobs``; a verify row has the one-row forward's bits, so
        they are the same with or without speculation."""
        request = self.request(prompt, max_new_tokens, chat=chat, stop=stop, seed=seed, ignore_eos=ignore_eos,
                               cache_prompt=cache_prompt, logprobs=logprobs,
                               constraint=Constraint.from_options(json_schema, regex, grammar, json_object))
        run = self.run(request)
        while True:
            try:
                next(run)
            except StopIteration as done:
                return done.value

    def stream(self, prompt, max_new_tokens: int = 128, *, stop: Sequence[str] = (), chat: bool | None = None,
               seed: int | None = None, ignore_eos: bool = False, cache_prompt: bool = True,
               logprobs: int | None = None, json_schema=None, regex: str | None = None,
               grammar: str | None = None, json_object: bool = False) -> Iterator[Chunk]:
        """Yield text as steps are accepted; the final ``Generation`` is the generator's return value
        (``cache_prompt``, ``logprobs``, the constraints: see ``generate``)."""
        request = self.request(prompt, max_new_tokens, chat=chat, stop=stop, seed=seed, ignore_eos=ignore_eos,
                               cache_prompt=cache_prompt, logprobs=logprobs,
                               constraint=Constraint.from_options(json_schema, regex, grammar, json_object))
        return (yield from self.run(request))

    def run(self, request: Request) -> Generator[Chunk, None, Generation]:
        """Decode one request, a batch of one (``batching.Batch``, the one loop): yields each step's
        ``Chunk``; the ``Generation`` is the generator's return value. Closing it ends the request
        (the KV it kept stays held for ``prompt_cache``)."""
        batch = Batch(self, 1, hold_prompts=self.prompt_cache)
        try:
            batch.add(request)
            while True:
                for event in batch.step():
                    if event.error is not None:
                        raise event.error
                    if event.chunk is not None:
                        yield event.chunk
                    if event.result is not None:
                        return event.result
        finally:
            batch.close()

    # ---- several requests together ---------------------------------------------------------
    def generate_batch(self, prompts: Sequence, max_new_tokens: int = 128, *, max_batch: int | None = None,
                       constraints: Sequence[dict | None] | None = None, **settings: Any) -> list[Generation]:
        """One ``Generation`` per prompt, as ``generate`` gives it (``settings``: its keywords but
        ``cache_prompt``), decoded ``max_batch`` at a time: each step runs every request's rows in
        one forward (``specfree.batching``), and each output is bit-identical to decoding its prompt
        alone. Where this engine cannot share a forward (``batch_off`` says why, in a warning), the
        same loop decodes the prompts one at a time. ``constraints``: one per prompt, each None or a
        dict of ``generate``'s constraint keywords (``{"json_schema": ...}``), its own whatever the
        others' (a constraint keyword among ``settings`` holds for every prompt). ``max_batch``: None
        is the engine's setting."""
        if isinstance(prompts, (str, torch.Tensor)):
            raise ConfigError("generate_batch takes a list of prompts; for one prompt call generate")
        max_batch = self.settings.value("max_batch", max_batch)
        constraints = per_prompt(len(prompts), constraints, settings)
        if self.batch_off is not None and max_batch > 1:
            warnings.warn(f"decoding one request at a time: {self.batch_off}", stacklevel=2)
            max_batch = 1
        return decode_together(self, list(prompts), max_new_tokens, max_batch=max_batch, constraints=constraints,
                               **settings)

    @property
    def batch_off(self) -> str | None:
        """Why this engine cannot decode several requests in one forward bit-identically (None: it can)."""
        adapter = self.adapter
        caps = getattr(adapter, "capabilities", None)
        if caps is None or not hasattr(adapter, "runner"):
            return f"the adapter {type(adapter).__name__} has no capabilities record or runner to batch over"
        if caps.chain_only:
            return f"the {adapter.family} model verifies one chain a step (recurrent or hybrid layers)"
        if caps.store != "growing":
            return f"the {adapter.family} model keeps no growing KV cache to share"
        if adapter.compiled and not hasattr(adapter.runner, "package"):
            return ("its steps run torch.compile graphs, which pad rows to buckets; a batch runs eagerly or "
                    "on an AOTInductor package (the CPU's compiled path): build it with compile=false")
        if not getattr(adapter, "rows_exact", False):
            return ("its rows are not bit-equal to the one-row forward (attention or linear layers outside "
                    "specfree's row-exact kernels), so a row's bits would depend on the batch")
        return None

    # ---- the prompt cache ---------------------------------------------------------------
    @property
    def reuse_off(self) -> str | None:
        """Why this engine's adapter cannot reuse a prefix's KV bit for bit (None: it can). Where it
        can, every prompt is prefilled in row-exact chunks, cached or not, so a prompt's KV has the
        same bits however it was computed."""
        adapter = self.adapter
        if not callable(getattr(adapter, "resume", None)) or not callable(getattr(adapter, "hold", None)):
            return f"the adapter {type(adapter).__name__} cannot keep a prefix's KV for the next call (no resume, hold)"
        if not adapter.can_truncate:
            return f"the {adapter.family} model's state cannot be cut back to a prefix (recurrent or rerun)"
        if not getattr(adapter, "rows_exact", False):
            return ("its rows are not bit-equal to the one-row forward (attention or linear layers outside "
                    "specfree's row-exact kernels, or a probe of 24 rows against one at a time differed), so a "
                    "reused row could differ from a fresh prefill's")
        return None

    @property
    def prompt_cache_off(self) -> str | None:
        """Why this engine's ``prompt_cache`` cannot reuse a prefix (None: it can, or it is off)."""
        return self.reuse_off if self.prompt_cache else None

    def forget(self) -> None:
        """Drop what ``prompt_cache`` holds: the next call prefills its whole prompt."""
        self.adapter.reset()

    def decoding(self, request: Request, *, strategy: Strategy | None = None, timing: bool = True) -> Decoding:
        """``request``'s state, the parts that depend on this engine checked: its verifier built for
        this call (the model's processors that depend on the prompt's length, the seed, its
        constraint's mask first), a planner over the shared pricer (``timing``: its forwards teach
        the engine's cost curve).
        ``strategy``: a batch's drafter for this request (default: the engine's)."""
        if request.stop and self.tokenizer is None:
            raise ConfigError("stop strings need a tokenizer")
        ids, adapter = list(request.ids), self.adapter
        verifier = for_call(request.verifier or self.verifier, len(ids), len(ids) + request.max_new_tokens,
                            self.eos_ids, adapter.device)
        if request.seed is not None and hasattr(verifier, "seed"):
            verifier = copy.copy(verifier)
            verifier.seed = request.seed
        matcher = self.matcher(request.constraint)
        if matcher is not None:
            verifier = masked(verifier, ConstraintMask(matcher, len(ids)))
        strategy = strategy or self.strategy
        planner = StepPlanner.for_adapter(self.pricer, adapter, price_context=self.price_context,
                                          timing=self._costs if timing else None)
        return Decoding(ids, min(len(ids) + request.max_new_tokens, adapter.max_length), request.max_new_tokens,
                        verifier=verifier, strategy=strategy, planner=planner,
                        mask_builder=self.mask_builder, tokenizer=self.tokenizer, should_stop=self.should_stop,
                        stop=request.stop, ignore_eos=request.ignore_eos, logprobs=request.logprobs,
                        rollback_s=(lambda: adapter.rollback_s) if adapter.capabilities.chain_only else None,
                        constraint=matcher,
                        grammar=GrammarDrafter(self.tokenizer) if matcher is not None and isinstance(strategy, Hybrid)
                        else None)

    def check_constraint(self, constraint: Constraint) -> None:
        """Compile ``constraint`` now (ConfigError, in one line, if it does not); kept for its requests."""
        self.matcher(constraint)

    def matcher(self, constraint: Constraint | None) -> Matcher | None:
        """A fresh matcher for ``constraint`` (the tokenizer's conversion made on the first, then kept)."""
        if constraint is None:
            return None
        if self._grammars is None:
            self._grammars = Grammars(self.tokenizer, self.adapter.vocab_size, self.eos_ids)
        return self._grammars.matcher(constraint)

    def should_stop(self, token: int, detok: Detokenizer | None, stop: Sequence[str],
                    ignore_eos: bool) -> str | None:
        """Why to stop after emitting ``token`` (asked once per token, in order), or None.

        Subclasses add stop conditions here (the transformers integration applies
        ``generate``'s stopping criteria this way).
        """
        if token in self.eos_ids and not ignore_eos:
            return "eos"
        if stop and detok is not None:
            tail = detok.text[-(max(map(len, stop)) + 32) :]
            if any(s in tail for s in stop):
                return "stop_string"
        return None
