"""specfree behind transformers' own ``model.generate(...)``, through its ``custom_generate`` hook.

``generate`` prepares everything from the ``GenerationConfig`` (max_length, eos, logits
processors and warpers, stopping criteria) and then hands the decoding loop to a callable:

    model.generate(input_ids, custom_generate=speculative_generate("hybrid"), max_new_tokens=64)

The callable runs specfree's engine with exactly those processors (they become the verifier's)
and stops exactly where those criteria say, so greedy output equals ``generate``'s own. Sampling
draws from specfree's per-position seeded stream (the ``seed`` argument), not torch's global
RNG: sampled output equals specfree's autoregressive sampling with that seed, not
``generate(do_sample=True)`` after ``torch.manual_seed``.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import torch
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList, StoppingCriteriaList
from transformers.generation import (
    EosTokenCriteria,
    GenerateDecoderOnlyOutput,
    MaxLengthCriteria,
    MaxTimeCriteria,
    StopStringCriteria,
)

from specfree.adapters.protocol import Adapter
from specfree.adapters.kv_buffers import CACHE_ARGUMENTS, cache_in
from specfree.adapters.norms import fused_norms
from specfree.kernels import unpacked_linears
from specfree.engine import DEFAULT_STRATEGY, Engine
from specfree.errors import ConfigError, check_int
from specfree.parts import build_adapter
from specfree.pricing import AcceptanceModel
from specfree.settings import CUSTOM_GENERATE_DEFAULTS, EngineSettings
from specfree.strategies.base import Strategy
from specfree.types import Generation

# Generation.stop_reason names; any other criterion is named by its class.
STOP_REASONS = {MaxLengthCriteria: "max_new_tokens", EosTokenCriteria: "eos", StopStringCriteria: "stop_string",
                MaxTimeCriteria: "max_time"}
# Model inputs generate prepares for its own loop; the engine builds its own cache, mask and positions.
PREPARED_INPUTS = {"attention_mask", "position_ids", *CACHE_ARGUMENTS, "use_cache", "logits_to_keep",
                   "cache_position"}
# Outputs specfree's loop does not produce: refusing beats returning None where the user expects data.
UNSUPPORTED_OUTPUTS = ("output_scores", "output_logits", "output_attentions", "output_hidden_states")


@dataclass
class SpeculativeDecoderOnlyOutput(GenerateDecoderOnlyOutput):
    """``generate``'s usual output plus ``specfree``: the run's ``Generation`` (steps, timings)."""

    specfree: Generation | None = None


def speculative_generate(strategy: str | Strategy = DEFAULT_STRATEGY, *, tokenizer=None, seed: int = 0,
                         settings: EngineSettings = CUSTOM_GENERATE_DEFAULTS, **knobs: Any) -> SpeculativeGenerate:
    """A ``custom_generate`` callable that decodes with ``strategy`` (a registered name or a built drafter).

    ``settings`` (``specfree.settings.EngineSettings``) and any of its fields as a keyword over them;
    the other ``knobs`` are the strategy's own (e.g. ``num_candidates=2``); sampling settings come from
    ``generate``'s arguments. ``tokenizer`` is needed for ``stop_strings``: transformers does not
    pass ``generate(tokenizer=...)`` on to a callable, so bind it here. ``seed`` is the default
    sampling seed; ``generate(..., seed=3)`` overrides it per call. ``compile`` (auto/true/false) as in
    ``Engine.from_model``: a compiled forward is built at the first call and kept for the next ones
    (``cache_dir``: where specfree notes which setups compiled, default ``~/.cache/specfree``). Unlike
    the engine's, its default is false (``settings.CUSTOM_GENERATE_DEFAULTS`` says why).
    ``priced``: as in ``Engine`` (False runs the strategy exactly at its knobs).
    """
    return SpeculativeGenerate(strategy, tokenizer=tokenizer, seed=seed, settings=settings, **knobs)


class SpeculativeGenerate:
    """The callable ``generate`` runs. It holds one drafter, so pools that learn keep learning
    across calls, as with one ``Engine``; it is not safe to share between threads."""

    def __init__(self, strategy: str | Strategy = DEFAULT_STRATEGY, *, tokenizer=None, seed: int = 0,
                 settings: EngineSettings = CUSTOM_GENERATE_DEFAULTS, **knobs: Any):
        from specfree.plugins import build_plugin_manager, registry

        self.settings = settings.take(knobs)
        self._compiled: tuple[Any, Adapter] | None = None  # (model, its compiled adapter)

        if not isinstance(strategy, Strategy):
            strategy = registry(build_plugin_manager()).make("strategy", strategy, **knobs)
        elif knobs:
            raise ConfigError(f"unexpected knobs {sorted(knobs)} for an already built strategy")
        self.strategy = strategy
        # Acceptance statistics outlive a call, like the drafter's pools (an engine is built per call).
        self.acceptance = AcceptanceModel() if self.settings.priced else None
        self.tokenizer = tokenizer
        self.seed = check_int("seed", seed, low=0)

    def __repr__(self) -> str:
        return f"speculative_generate({self.strategy.name!r})"

    # transformers passes the model first, then the arguments of its own decoding loops; any
    # other parameter named here (stop_strings, seed, tokenizer) it takes out of generate's
    # kwargs and passes through unchanged.
    def __call__(self, model, input_ids: torch.LongTensor, logits_processor: LogitsProcessorList,
                 stopping_criteria: StoppingCriteriaList, generation_config: GenerationConfig,
                 stop_strings: str | list[str] | None = None, seed: int | None = None, tokenizer=None,
                 **model_kwargs: Any) -> torch.LongTensor | SpeculativeDecoderOnlyOutput:
        prompt = self._check(input_ids, generation_config, model_kwargs)
        criteria = StoppingCriteriaList(stopping_criteria)
        tokenizer = tokenizer or self.tokenizer
        if stop_strings:
            if tokenizer is None:
                raise ConfigError("stop_strings need a tokenizer, and transformers does not pass generate's "
                                  "tokenizer= to a custom_generate callable: bind it with "
                                  "speculative_generate(..., tokenizer=tokenizer)")
            criteria.append(StopStringCriteria(tokenizer, stop_strings))

        sampling = {}
        if generation_config.do_sample:
            sampling = {"do_sample": True, "seed": self.seed if seed is None else seed}
        # generate's processors (penalties, the user's, then temperature/top-k/top-p when
        # sampling) become the verifier's: each drafted position is judged on the same scores.
        processors = [_OnScoresDevice(logits_processor)] if logits_processor else []
        # The caller's model leaves with its own linear and norm layers: ours serve only this call.
        with unpacked_linears(model, self.settings.cache_dir), fused_norms(model):
            engine = _CriteriaEngine.from_model(model, tokenizer, self.strategy, logits_processors=processors,
                                                adapter=self._adapter(model), acceptance=self.acceptance,
                                                settings=self.settings,
                                                generation="plain", **sampling)  # generate applied the model's
            engine.watch(input_ids, criteria, generation_config.max_length)
            max_new = max(1, generation_config.max_length - len(prompt))
            try:
                result = engine.generate(prompt, max_new_tokens=max_new)
            finally:
                engine.adapter.reset()  # do not hold the KV cache between calls
        if result.stop_reason == "context_length":
            warnings.warn(f"specfree stopped after {len(result.tokens)} new tokens: the prompt plus output "
                          f"reached the {engine.adapter.max_length} tokens it can attend to for model "
                          f"family '{engine.adapter.family}'", stacklevel=2)
        new = torch.tensor([result.tokens], dtype=input_ids.dtype, device=input_ids.device)
        sequences = torch.cat([input_ids, new], dim=1)
        if generation_config.return_dict_in_generate:
            return SpeculativeDecoderOnlyOutput(sequences=sequences, specfree=result)
        return sequences

    def _adapter(self, model) -> Adapter | None:
        """The compiled adapter for ``model`` (built at the first call, then kept), or None for
        the eager one, built per call inside the caller's borrowed layers."""
        if self.settings.compile == "false":
            return None
        if self._compiled is not None and self._compiled[0] is model:
            return self._compiled[1]
        adapter = build_adapter(model, settings=self.settings)
        if adapter.compiled:
            self._compiled = (model, adapter)
        return adapter

    @staticmethod
    def _check(input_ids: torch.Tensor, config: GenerationConfig, model_kwargs: dict) -> list[int]:
        """The prompt's ids, after refusing what specfree's loop cannot do, by name."""
        if config.num_beams > 1:
            raise ConfigError(f"specfree does not do beam search (num_beams={config.num_beams}); use num_beams=1")
        if input_ids.shape[0] != 1:
            raise ConfigError(f"specfree decodes one sequence at a time (batch size 1); got a batch of "
                              f"{input_ids.shape[0]} (num_return_sequences multiplies it too). "
                              "Call generate once per prompt")
        asked = [name for name in UNSUPPORTED_OUTPUTS if getattr(config, name, False)]
        if asked and config.return_dict_in_generate:
            raise ConfigError(f"specfree's generate does not return {', '.join(asked)}; leave them off "
                              "(the run's step statistics are in output.specfree)")
        if config.guidance_scale not in (None, 1.0):
            raise ConfigError("classifier-free guidance (guidance_scale) keeps state per decoding step "
                              "and cannot judge drafted positions; leave it unset")
        mask = model_kwargs.get("attention_mask")
        if mask is not None and not bool(mask.all()):
            raise ConfigError("specfree decodes one unpadded prompt: the attention_mask has zeros; "
                              "pass the prompt without padding")
        cache = cache_in(model_kwargs)
        if cache is not None and cache.get_seq_length() > 0:
            raise ConfigError("specfree builds its own KV cache: pass the full prompt without a cache "
                              "(past_key_values)")
        extra = sorted(k for k, v in model_kwargs.items() if k not in PREPARED_INPUTS and v is not None)
        if extra:
            raise ConfigError(f"specfree feeds the model token ids only; it cannot pass {', '.join(extra)}")
        if input_ids.shape[1] == 0:
            raise ConfigError("the prompt is empty: give at least one token (inputs_embeds are not supported)")
        return input_ids[0].tolist()


class _OnScoresDevice(LogitsProcessor):
    """generate's processors, given the ids on the scores' device: the verifier keeps the ids on
    the CPU while the logits may be on a GPU, and processors such as the repetition penalty
    gather scores at those ids."""

    def __init__(self, processors: LogitsProcessorList):
        self.processors = processors

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        return self.processors(input_ids.to(scores.device), scores)


class _CriteriaEngine(Engine):
    """An engine that stops where ``generate``'s stopping criteria say.

    The engine asks ``should_stop`` after each token it emits, in order; here the answer comes
    from transformers' own criteria (max_length, eos, stop strings, max_time, the user's), run
    on the whole sequence as ``generate`` runs them after each new token. Criteria see
    ``scores=None``: the verifier's scores are per tree node, not per emitted token.
    """

    def watch(self, input_ids: torch.Tensor, criteria: StoppingCriteriaList, max_length: int) -> None:
        self.criteria = criteria
        self.n = input_ids.shape[1]
        self.ids = input_ids.new_zeros(1, max(max_length, self.n + 1))  # [1, max_length] prompt + output
        self.ids[:, : self.n] = input_ids

    def should_stop(self, token: int, detok, stop, ignore_eos: bool) -> str | None:
        self.ids[0, self.n] = token
        self.n += 1
        sequence = self.ids[:, : self.n]
        for criterion in self.criteria:
            if bool(criterion(sequence, None).all()):
                return STOP_REASONS.get(type(criterion), type(criterion).__name__)
        return None
