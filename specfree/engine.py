"""The decoding loop: draft, lay out, one forward, verify, keep the accepted KV, observe."""

from __future__ import annotations

import copy
import time
import warnings
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import GenerationConfig

from specfree.adapters.protocol import Adapter
from specfree.loading import DEFAULT_CACHE
from specfree.cost import CostModel
from specfree.detokenize import Detokenizer
from specfree.errors import ConfigError, check_int
from specfree.generation import ModelSettings, for_call
from specfree.kernels.tree_attention import LONG_ROWS
from specfree.masks.tree import Layout, build_layout
from specfree.planner import StepPlanner
from specfree.pricing import AcceptanceModel, Pricer
from specfree.strategies.base import Outcome, Strategy
from specfree.timing import clock
from specfree.draft_tree import DraftTree
from specfree.types import AuxBlock, Generation, StepRecord, TokenLogprob
from specfree.verifiers import GreedyVerifier


def _check_text(text: str) -> str:
    """Text the tokenizer can take: bytes that were not UTF-8 (read with ``surrogateescape``, as
    Python does for command-line arguments under a C locale) would fail deep inside it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ConfigError("the prompt is not valid UTF-8 text (it holds undecodable bytes); give UTF-8 text") from None
    return text


@dataclass
class Chunk:
    """One step's worth of streamed output."""

    text: str
    tokens: list[int]
    from_draft: list[bool]  # per token: it was a drafted token the model accepted
    logprobs: list[TokenLogprob] | None = None  # per token, when the call asked for them


# Lays out one step's rows: (tree, aux rows, root position) -> tokens, positions, mask.
MaskBuilder = Callable[[DraftTree, "AuxBlock | None", int], Layout]
DEFAULT_STRATEGY = "hybrid"  # the strategy that measures best on `bench`
# ``prompt_cache``'s prefill chunk: at most this many rows run the row-exact attention (more go to SDPA).
EXACT_CHUNK = LONG_ROWS


def _logprobs(logits: torch.Tensor, rows: list[int], tokens: list[int], k: int) -> list[TokenLogprob]:
    """Each token's log-probability in its row's log-softmax (float32), and the row's ``k`` best."""
    if not rows:
        return []
    table = torch.log_softmax(logits[rows].float(), dim=-1)
    best = torch.topk(table, k, dim=-1) if k else None
    return [TokenLogprob(token, float(table[i, token]),
                         list(zip(best.indices[i].tolist(), best.values[i].tolist())) if best is not None else [])
            for i, token in enumerate(tokens)]


class Engine:
    """``priced`` (the default): every step keeps only the drafted rows that raise expected tokens
    per second on the measured cost curve (``specfree.pricing``); False runs the strategy exactly
    at its knobs. ``adapt_costs`` folds live forward times into the curve (tracks machine drift,
    at the price of step counts that vary from run to run). ``price_context`` (the default) prices
    each step's rows at its own context (a row attends to all of it); False prices every step at
    the curve's reference context (256 tokens). ``costs``: a cost curve to use instead
    of the measured one; ``acceptance``: statistics to start from (and keep learning into).
    ``model_settings``: which of the model's generation settings the verifier follows (a record,
    for reports; ``specfree.generation``).

    ``prompt_cache``: keep the KV of the last call's tokens and, on the next call, prefill only
    what follows the longest common prefix of token ids (``Generation.cached_tokens`` says how
    many were reused; ``generate(..., cache_prompt=False)`` prefills the whole prompt once).
    To keep that lossless, a prompt is then prefilled in chunks of at most ``EXACT_CHUNK`` rows,
    which run the row-exact attention, so every kept row has the bits of the one-row forward
    whichever call computed it: the answer equals a fresh ``Engine(prompt_cache=True)``'s bit for
    bit. Without it a prompt of more than 161 tokens is prefilled in one call through SDPA, whose
    rows' bits depend on the prompt's length (so a prefix could not be reused exactly); the two
    settings can differ in a last bit of the prompt's KV, hence, at a near tie, in a token.
    Reuse needs an adapter whose rows are exact and whose KV can be cropped
    (``prompt_cache_off``: why not, else None; there the prompt is prefilled in one call, as
    without the cache); a compiled adapter reuses only rows its eager prefill computed (its
    compiled steps match the eager rows to rounding, not bit for bit); recurrent and hybrid
    families, whose state cannot be cropped, never reuse."""

    def __init__(self, adapter: Adapter, strategy: Strategy, verifier=None, tokenizer=None,
                 cache_dir: str | Path | None = None, mask_builder: MaskBuilder | None = None, *,
                 priced: bool = True, adapt_costs: bool = False, price_context: bool = True,
                 costs: CostModel | None = None, acceptance: AcceptanceModel | None = None,
                 model_settings: ModelSettings | None = None, prompt_cache: bool = False):
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
            costs = CostModel.cached(adapter, Path(cache_dir) if cache_dir else DEFAULT_CACHE)
        self.costs = costs
        self.pricer = Pricer(costs, acceptance) if priced else None
        self._costs = costs.learner(adapt_costs) if own else costs if adapt_costs else None
        self.price_context = price_context
        self.eos_ids = self._eos_ids()
        self.model_settings = model_settings or ModelSettings()
        self.prompt_cache = prompt_cache
        # (ids whose KV the adapter holds, the adapter's state_version then): reusable by the next call
        self._held: tuple[np.ndarray, int] | None = None

    @property
    def priced(self) -> bool:
        return self.pricer is not None

    # ---- construction -------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, model: str = "smollm2", strategy: str = DEFAULT_STRATEGY, *,
                        device: str = "cpu", dtype: str = "float32", cache_dir: str | None = None,
                        compile: str | bool = "auto", **knobs: Any) -> "Engine":
        """Load ``model`` (embedded name, .gguf, folder or hub id) and build an engine.

        ``knobs`` holds sampling settings (do_sample, temperature, top_k, top_p,
        repetition_penalty, seed), ``generation``, ``priced``/``adapt_costs``/``prompt_cache`` (see ``from_model``)
        and the strategy's own knobs, ``linear_kernel`` and ``precision`` (see ``from_model``).
        ``compile``: see ``from_model``.
        """
        from specfree.loading import load_model

        hf_model, tokenizer = load_model(model, device=device, dtype=dtype, cache_dir=cache_dir)
        return cls.from_model(hf_model, tokenizer, strategy, cache_dir=cache_dir, compile=compile, **knobs)

    @classmethod
    def from_model(cls, model, tokenizer=None, strategy: str | Strategy = DEFAULT_STRATEGY, *,
                   cache_dir: str | None = None, linear_kernel: str = "few_row", compile: str | bool = False,
                   adapter: Adapter | None = None, priced: bool = True, adapt_costs: bool = False,
                   price_context: bool = True, costs: CostModel | None = None,
                   acceptance: AcceptanceModel | None = None, generation: str | GenerationConfig = "model",
                   prompt_cache: bool = False, precision: str = "exact", **knobs: Any) -> "Engine":
        """Wrap an already loaded transformers model (``linear_kernel`` and ``precision``: see ``HFAdapter``;
        ``precision="int8"`` runs a quantized file's coded layers on 8-bit activations).

        ``generation``: ``"model"`` (the default) follows what the model's ``generation_config``
        asks (sampling and its parameters, penalties, forced and suppressed tokens, minimum
        length) wherever ``knobs`` leave a setting unset; ``"plain"`` ignores it (greedy unless
        ``do_sample=True``); a ``GenerationConfig`` is followed instead of the model's.
        ``engine.model_settings`` says what was followed.

        ``compile``: ``true`` runs a compiled forward (``adapters.compiled``; the first compile on
        a machine takes minutes), ``auto`` only where one compiled here before is ready within
        seconds, ``false`` (the default here; ``from_pretrained`` and configs default to ``auto``) never.
        ``adapter``: one built before for this model (a compiled one is reused, not recompiled).
        ``priced``, ``adapt_costs``, ``price_context``, ``costs``, ``acceptance``, ``prompt_cache``: see ``Engine``.
        """
        from specfree.adapters.compiled import check_compile
        from specfree.kernels import check_precision
        from specfree.parts import build_parts
        from specfree.plugins import build_plugin_manager, registry

        sampling_keys = ("do_sample", "temperature", "top_k", "top_p", "repetition_penalty", "seed",
                         "logits_processors")
        sampling = {k: knobs.pop(k) for k in sampling_keys if k in knobs}
        reg = registry(build_plugin_manager())
        if not isinstance(strategy, Strategy):
            strategy = reg.make("strategy", strategy, **knobs)
        elif knobs:
            raise ConfigError(f"unexpected knobs {sorted(knobs)} for an already built strategy")
        check_compile(compile)
        check_precision(precision)
        parts = build_parts(model, reg, strategy, verifier_knobs=sampling, generation=generation, adapter=adapter,
                            compile=compile, linear_kernel=linear_kernel, cache_dir=cache_dir, precision=precision)
        if parts["model_settings"].ignored:
            warnings.warn(parts["model_settings"].line(), stacklevel=2)
        return cls(**parts, tokenizer=tokenizer, cache_dir=cache_dir, priced=priced, adapt_costs=adapt_costs,
                   price_context=price_context, costs=costs, acceptance=acceptance, prompt_cache=prompt_cache)

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
        return self._check_ids(ids)

    def _check_ids(self, ids: list) -> list[int]:
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
    def generate(self, prompt, max_new_tokens: int = 128, *, stop: Sequence[str] = (), chat: bool | None = None,
                 seed: int | None = None, ignore_eos: bool = False, cache_prompt: bool = True,
                 logprobs: int | None = None) -> Generation:
        """``cache_prompt=False``: prefill the whole prompt even where ``prompt_cache`` could reuse a prefix.
        ``logprobs=k``: each new token's log-probability under the model (log-softmax of the raw
        logits of the verify row that predicted it, before any processor) and its ``k`` most likely
        alternatives, in ``Generation.logprobs``; a verify row has the one-row forward's bits, so
        they are the same with or without speculation."""
        run = self._run(self.encode(prompt, chat), max_new_tokens, stop, seed, ignore_eos, cache_prompt, logprobs)
        while True:
            try:
                next(run)
            except StopIteration as done:
                return done.value

    def stream(self, prompt, max_new_tokens: int = 128, *, stop: Sequence[str] = (), chat: bool | None = None,
               seed: int | None = None, ignore_eos: bool = False, cache_prompt: bool = True,
               logprobs: int | None = None) -> Iterator[Chunk]:
        """Yield text as steps are accepted; the final ``Generation`` is the generator's return value
        (``cache_prompt``, ``logprobs``: see ``generate``)."""
        return (yield from self._run(self.encode(prompt, chat), max_new_tokens, stop, seed, ignore_eos, cache_prompt,
                                     logprobs))

    # ---- the prompt cache ---------------------------------------------------------------
    @property
    def prompt_cache_off(self) -> str | None:
        """Why this engine's ``prompt_cache`` cannot reuse a prefix (None: it can, or it is off)."""
        if not self.prompt_cache:
            return None
        adapter = self.adapter
        if not callable(getattr(adapter, "truncate", None)) or not hasattr(adapter, "state_version"):
            return f"the adapter {type(adapter).__name__} cannot cut its KV back to a prefix (no truncate, state_version)"
        if not adapter.can_truncate:
            return f"the {adapter.family} model's state cannot be cut back to a prefix (recurrent or rerun)"
        if not getattr(adapter, "rows_exact", False):
            return ("its rows are not bit-equal to the one-row forward (attention or linear layers outside "
                    "specfree's row-exact kernels, or a probe of 24 rows against one at a time differed), so a "
                    "reused row could differ from a fresh prefill's")
        return None

    def forget(self) -> None:
        """Drop what ``prompt_cache`` holds: the next call prefills its whole prompt."""
        self._held = None

    def _reusable(self, ids: list[int], cache_prompt: bool) -> int:
        """How many leading ids of this prompt the adapter's KV already holds (at most all but the last)."""
        held, self._held = self._held, None  # nothing is held while this call changes the KV
        if not (self.prompt_cache and cache_prompt) or held is None or self.prompt_cache_off is not None:
            return 0
        held, version = held
        if version != self.adapter.state_version:  # another engine (or anything else) used the adapter since
            return 0
        m = min(len(held), len(ids) - 1)
        if m <= 0:
            return 0
        differ = np.flatnonzero(held[:m] != np.asarray(ids[:m], dtype=np.int64))
        return int(differ[0]) if differ.size else m

    def _prefill(self, ids: np.ndarray) -> None:
        # Chunks only where a prefix can be reused: elsewhere one call, as without the cache (a Mamba-1
        # mixer, for one, cannot continue its state over a second multi-token call).
        if not self.prompt_cache or self.prompt_cache_off is not None:
            self.adapter.prefill(torch.from_numpy(ids))
            return
        for at in range(0, len(ids), EXACT_CHUNK):  # each chunk through the row-exact attention
            self.adapter.prefill(torch.from_numpy(ids[at : at + EXACT_CHUNK]))

    def _run(self, ids: list[int], max_new_tokens: int, stop: Sequence[str], seed: int | None,
             ignore_eos: bool, cache_prompt: bool = True, logprobs: int | None = None):
        check_int("max_new_tokens", max_new_tokens, low=1)
        if logprobs is not None:
            check_int("logprobs", logprobs, low=0)
        token_logprobs: list[TokenLogprob] | None = [] if logprobs is not None else None
        if isinstance(stop, str):
            stop = [stop]
        if stop and self.tokenizer is None:
            raise ConfigError("stop strings need a tokenizer")
        # The model's processors that depend on the call (prompt length, max length) are built here.
        verifier = for_call(self.verifier, len(ids), len(ids) + max_new_tokens, self.eos_ids, self.adapter.device)
        if seed is not None:
            seed = check_int("seed", seed, low=0)  # the same range the sampling verifier's own seed takes
        if seed is not None and hasattr(verifier, "seed"):
            verifier = copy.copy(verifier)
            verifier.seed = seed
        adapter, strategy = self.adapter, self.strategy
        chain_only = adapter.capabilities.chain_only
        limit = min(len(ids) + max_new_tokens, adapter.max_length)
        buffer = np.zeros(limit, dtype=np.int64)  # committed ids; the last one is the root
        buffer[: len(ids)] = ids
        n = len(ids)
        detok = Detokenizer(self.tokenizer) if self.tokenizer is not None else None
        new_tokens: list[int] = []
        from_draft: list[bool] = []
        steps: list[StepRecord] = []
        stop_reason: str | None = None

        planner = StepPlanner.for_adapter(self.pricer, adapter, price_context=self.price_context, timing=self._costs)
        start = time.perf_counter()
        reused = self._reusable(ids, cache_prompt)
        if not (reused and adapter.truncate(reused)):
            reused = 0
            adapter.reset()
        self._prefill(buffer[reused : n - 1])
        strategy.begin(buffer[:n].copy())
        prefill_s = self._elapsed(start)
        # The ids whose KV may be reused: every kept row on the eager path; on a compiled one the
        # eager prefill's only (its compiled steps equal the eager rows to rounding, not in bits).
        exact_steps = not getattr(adapter, "compiled", False)
        steady = True  # False while a step's forward has run but its commit has not
        try:
            while stop_reason is None:
                t0 = time.perf_counter()
                context = buffer[:n]
                proposal = strategy.propose(context, max_depth=limit - n - 1)
                plan = planner.plan(int(context[-1]), proposal, max_depth=limit - n - 1, context=n)  # rows to run
                tree, aux = plan.tree, plan.aux
                t1 = time.perf_counter()
                layout = self.mask_builder(tree, aux, n - 1)
                t2 = time.perf_counter()
                # [Q, V]; a lone root row needs no mask: the plain causal path is fastest.
                steady = False
                logits = adapter.forward(layout.tokens, None if layout.rows == 1 else layout.allowed,
                                         layout.positions)
                t3 = clock(adapter.device)
                planner.timed(layout.rows, t3 - t2, context=n)
                verdict = verifier.verify(logits[: layout.num_tree], tree, torch.from_numpy(context))
                t4 = time.perf_counter()
                adapter.commit([0, *verdict.path], rows=layout.rows)
                steady = True

                emitted, text, stop_reason = 0, "", None
                for token in verdict.tokens:
                    buffer[n] = token
                    n += 1
                    emitted += 1
                    new_tokens.append(token)
                    from_draft.append(emitted <= len(verdict.path))
                    if detok is not None:
                        text += detok.push(token)
                    stop_reason = self.should_stop(token, detok, stop, ignore_eos)
                    if stop_reason or n >= limit:
                        break
                if token_logprobs is not None:  # token i was predicted by row i of [root, *path]
                    token_logprobs += _logprobs(logits, [0, *verdict.path][:emitted], verdict.tokens[:emitted],
                                                logprobs)
                strategy.observe(Outcome(tree, verdict, buffer[:n],
                                         logits[layout.num_tree :] if aux is not None else None,
                                         logits[: layout.num_tree], plan.aux_logits(logits)))
                planner.learn(proposal, plan, verdict.tokens, len(verdict.path))
                t5 = time.perf_counter()
                accepted = min(len(verdict.path), emitted)
                steps.append(StepRecord(
                    rows=layout.rows, drafted=tree.num_drafted, accepted=accepted, emitted=emitted,
                    draft_s=t1 - t0, mask_s=t2 - t1, forward_s=t3 - t2, verify_s=t4 - t3, other_s=t5 - t4,
                    sources=dict(Counter(tree.sources[node] for node in verdict.path[:accepted])),
                    extra=strategy.stats() if not chain_only
                    else {**strategy.stats(), "rollback_s": adapter.rollback_s}, offered=plan.offered))
                if stop_reason is None and n >= limit:
                    stop_reason = "max_new_tokens" if len(new_tokens) >= max_new_tokens else "context_length"
                if stop_reason and detok is not None:
                    text += detok.flush()
                yield Chunk(text, new_tokens[-emitted:], from_draft[-emitted:],
                            token_logprobs[-emitted:] if token_logprobs is not None else None)
        finally:
            strategy.end()
            if self.prompt_cache and steady:
                # The adapter holds the KV of the first past_len ids of prompt + answer (a step cut
                # short by a stop may have kept rows past n: those ids are not in the buffer).
                kept = min(n, adapter.past_len) if exact_steps else len(ids) - 1
                self._held = (buffer[:kept].copy(), adapter.state_version)
        wall = self._elapsed(start)
        text = self.tokenizer.decode(new_tokens, skip_special_tokens=True) if self.tokenizer else ""
        return Generation(tokens=new_tokens, text=text, prompt_tokens=len(ids), steps=steps,
                          prefill_s=prefill_s, wall_s=wall, stop_reason=stop_reason, drafted_mask=from_draft,
                          cached_tokens=reused, logprobs=token_logprobs)

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

    def _elapsed(self, start: float) -> float:
        return clock(self.adapter.device) - start
