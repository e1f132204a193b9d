"""The model's own generation settings (its ``generation_config``), followed by specfree's verifiers.

A model ships the way it should be decoded: a chat model may sample (``do_sample``,
``temperature``, ``top_p``, ``top_k``), penalise repetition (``repetition_penalty``,
``no_repeat_ngram_size``), force or suppress tokens, or ask for a minimum length. transformers'
``generate()`` follows all of it, and so does specfree by default (``generation="model"``):

- the sampling settings become the verifier's knobs (explicit ones win);
- the rest become transformers' own logits processors, in ``generate``'s order, computed at each
  drafted node for THAT node's prefix, so they stay lossless through every strategy. Several
  depend on the call (the prompt's length, the call's max length): ``ModelProcessors`` holds the
  settings, and ``for_call`` builds the processors at the start of each call.

``generation="plain"`` ignores the model's settings: plain greedy unless told otherwise.
"""

from __future__ import annotations

import copy
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList
from transformers.generation.logits_process import (
    ForcedBOSTokenLogitsProcessor,
    ForcedEOSTokenLogitsProcessor,
    InfNanRemoveLogitsProcessor,
    MinLengthLogitsProcessor,
    MinNewTokensLengthLogitsProcessor,
    NoBadWordsLogitsProcessor,
    NoRepeatNGramLogitsProcessor,
    SuppressTokensAtBeginLogitsProcessor,
    SuppressTokensLogitsProcessor,
)

from specfree.errors import ConfigError
from specfree.settings import check_setting

# Settings that become the verifier's own knobs (the sampling verifier takes all, greedy the penalty).
VERIFIER_KNOBS = ("temperature", "top_k", "top_p", "repetition_penalty")
# Settings that become logits processors, in the order generate() applies them.
PROCESSOR_SETTINGS = ("no_repeat_ngram_size", "bad_words_ids", "min_length", "min_new_tokens", "forced_bos_token_id",
                      "forced_eos_token_id", "remove_invalid_values", "suppress_tokens", "begin_suppress_tokens")
# Settings that change generate()'s output which specfree does not follow (said, never silently dropped).
NOT_FOLLOWED = ("min_p", "top_h", "typical_p", "epsilon_cutoff", "eta_cutoff", "sequence_bias",
                "exponential_decay_length_penalty", "num_beams", "guidance_scale")
# The value at which each setting changes nothing (a config may spell out the neutral value).
NEUTRAL: dict[str, Any] = {"do_sample": False, "temperature": 1.0, "top_p": 1.0, "repetition_penalty": 1.0,
                           "no_repeat_ngram_size": 0, "min_length": 0, "min_new_tokens": 0,
                           "remove_invalid_values": False, "typical_p": 1.0, "epsilon_cutoff": 0.0,
                           "eta_cutoff": 0.0, "num_beams": 1, "guidance_scale": 1.0}
DEFAULT_TOP_K = 50  # what generate() samples with when the model's config sets no top_k


def model_asks(source: Any) -> dict[str, Any]:
    """What a ``generation_config`` (or a model carrying one) sets that changes the output."""
    config = getattr(source, "generation_config", source)
    if not isinstance(config, GenerationConfig):
        return {}
    asked = {}
    for name in ("do_sample", "top_k", *VERIFIER_KNOBS, *PROCESSOR_SETTINGS, *NOT_FOLLOWED):
        value = getattr(config, name, None)
        if value is None or value == NEUTRAL.get(name) or (isinstance(value, (list, dict)) and not value):
            continue
        asked[name] = value
    if asked.get("do_sample") and "top_k" not in asked:
        asked["top_k"] = DEFAULT_TOP_K
    if not asked.get("do_sample"):  # settings only sampling reads are no change for greedy decoding
        asked = {k: v for k, v in asked.items() if k not in ("temperature", "top_k", "top_p")}
    return asked


@dataclass(frozen=True)
class ModelSettings:
    """The model's generation settings an engine follows, and those it cannot (by their
    ``generation_config`` names)."""

    followed: dict[str, Any] = field(default_factory=dict)
    ignored: dict[str, Any] = field(default_factory=dict)

    def line(self) -> str | None:
        """``from the model's generation_config: do_sample=True temperature=0.6 (generation=plain ...)``."""
        if not self.followed and not self.ignored:
            return None
        text = "from the model's generation_config: " + (_pairs(self.followed) or "nothing followed")
        if self.ignored:
            text += f"; not followed by specfree: {_pairs(self.ignored)}"
        greedy = "to decode greedily" if self.followed.get("do_sample") else "to ignore them"
        return f"{text} (generation=plain {greedy})"


def _pairs(values: Mapping[str, Any]) -> str:
    return " ".join(f"{k}={v}" for k, v in values.items())


def model_verifier(reg, model, given: Mapping[str, Any], generation: str | GenerationConfig,
                   name: str | None = None) -> tuple[Any, ModelSettings]:
    """The verifier: ``name`` (None: sampling when ``do_sample``, given or the model's, else greedy)
    built from the ``given`` knobs over the model's settings. ``generation``: ``"model"`` follows
    ``model.generation_config``, ``"plain"`` nothing, a ``GenerationConfig`` that one instead."""
    if isinstance(generation, GenerationConfig):
        asked = model_asks(generation)
    else:
        asked = model_asks(model) if check_setting("generation", generation) == "model" else {}
    knobs = {k: v for k, v in given.items() if v is not None}
    followed = {}
    if name is None:
        sample = knobs.pop("do_sample", None)
        if sample is None and asked.get("do_sample"):
            followed["do_sample"] = sample = True
        name = "sampling" if sample else "greedy"
    takes = reg.get("verifier", name).knobs
    for key in VERIFIER_KNOBS:
        if key in asked and key not in knobs and key in takes and (key == "repetition_penalty" or name == "sampling"):
            knobs[key] = followed[key] = asked[key]
    processors = {k: asked[k] for k in PROCESSOR_SETTINGS if k in asked}
    ignored = {k: asked[k] for k in NOT_FOLLOWED if k in asked}
    if processors and "logits_processors" in takes:
        knobs["logits_processors"] = [ModelProcessors(processors), *knobs.get("logits_processors", ())]
        followed.update(processors)
    else:
        ignored.update(processors)  # a verifier from a plugin that takes no processors
    try:
        verifier = reg.make("verifier", name, **knobs)
    except ValueError as exc:  # ConfigError included: a value the verifier refuses
        if not followed:
            raise
        raise ConfigError(f"verifier={name}: {exc} (with the model's generation_config: {_pairs(followed)}; "
                          "give your own value, or generation=plain)") from None
    return verifier, ModelSettings(followed, ignored)


class ModelProcessors(LogitsProcessor):
    """The model's processors beyond the verifier's knobs. Several need the call's prompt length
    or max length: the engine calls ``for_call`` at the start of each call (``for_call`` below)."""

    def __init__(self, settings: Mapping[str, Any], processors: LogitsProcessorList | None = None):
        self.settings = dict(settings)
        self.processors = processors

    def __repr__(self) -> str:
        return f"ModelProcessors({_pairs(self.settings)})"

    def for_call(self, prompt_len: int, max_length: int, eos_ids: Collection[int],
                 device: torch.device | str = "cpu") -> ModelProcessors:
        """The processors for a call whose prompt has ``prompt_len`` tokens and whose output may
        reach ``max_length`` tokens in all, exactly as ``generate()`` builds them."""
        s, eos = self.settings, sorted(eos_ids)
        procs = LogitsProcessorList()
        if s.get("no_repeat_ngram_size"):
            procs.append(NoRepeatNGramLogitsProcessor(s["no_repeat_ngram_size"]))
        if s.get("bad_words_ids"):
            procs.append(NoBadWordsLogitsProcessor(s["bad_words_ids"], eos or None))
        min_new = s.get("min_new_tokens")
        min_length = prompt_len + min_new if min_new else s.get("min_length")  # min_new_tokens wins, as in generate
        if min_length and eos:
            procs.append(MinLengthLogitsProcessor(min_length, eos, device=device))
        if min_new and eos:
            procs.append(MinNewTokensLengthLogitsProcessor(prompt_len, min_new, eos, device=device))
        if s.get("forced_bos_token_id") is not None:
            procs.append(ForcedBOSTokenLogitsProcessor(s["forced_bos_token_id"]))
        if s.get("forced_eos_token_id") is not None:
            procs.append(ForcedEOSTokenLogitsProcessor(max_length, s["forced_eos_token_id"], device=device))
        if s.get("remove_invalid_values"):
            procs.append(InfNanRemoveLogitsProcessor())
        if s.get("suppress_tokens"):
            procs.append(SuppressTokensLogitsProcessor(s["suppress_tokens"], device=device))
        if s.get("begin_suppress_tokens"):
            begin = prompt_len if prompt_len > 1 or s.get("forced_bos_token_id") is None else prompt_len + 1
            procs.append(SuppressTokensAtBeginLogitsProcessor(s["begin_suppress_tokens"], begin, device=device))
        return ModelProcessors(s, procs)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self.processors is None:
            raise RuntimeError("ModelProcessors runs inside an engine call (Engine.generate builds it per call)")
        return self.processors(input_ids, scores)


def for_call(verifier, prompt_len: int, max_length: int, eos_ids: Collection[int],
             device: torch.device | str = "cpu"):
    """``verifier``, or a copy whose ``ModelProcessors`` are built for this call."""
    processors: Sequence[LogitsProcessor] | None = getattr(verifier, "processors", None)
    if not processors or not any(isinstance(p, ModelProcessors) for p in processors):
        return verifier
    verifier = copy.copy(verifier)
    verifier.processors = LogitsProcessorList(
        p.for_call(prompt_len, max_length, eos_ids, device) if isinstance(p, ModelProcessors) else p
        for p in processors)
    return verifier
