"""specfree through transformers' own ``model.generate(custom_generate=...)``."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import LogitsProcessor, LogitsProcessorList
from transformers.generation import GenerateDecoderOnlyOutput

from specfree import ConfigError, Engine, Generation, speculative_generate
from specfree.adapters.kv_buffers import cache_in
from tests.tiny_models import FAMILIES, PAD, VOCAB, tiny_model, tiny_tokenizer

FEW = settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.too_slow])
PROMPT = torch.tensor([[5, 6, 7, 8] * 4 + [9, 10]])


def plain(model, ids=PROMPT, **kwargs) -> torch.Tensor:
    """transformers' own decoding: the reference."""
    return model.generate(ids, pad_token_id=PAD, **kwargs)


def speculative(model, ids=PROMPT, strategy="prompt_lookup", tokenizer=None, **kwargs):
    return model.generate(ids, custom_generate=speculative_generate(strategy, tokenizer=tokenizer, num_candidates=2),
                          pad_token_id=PAD, **kwargs)


class BanToken(LogitsProcessor):
    """A user processor: the token must never be emitted."""

    def __init__(self, token: int):
        self.token = token

    def __call__(self, input_ids, scores):
        return scores.index_fill(-1, torch.tensor([self.token]), float("-inf"))


@FEW
@given(family=st.sampled_from(FAMILIES), pattern=st.lists(st.integers(3, VOCAB - 1), min_size=1, max_size=5),
       max_new=st.integers(1, 20), repetition_penalty=st.sampled_from([1.0, 1.3]), ban=st.booleans())
def test_greedy_equals_plain_generate(family, pattern, max_new, repetition_penalty, ban):
    model = tiny_model(family)
    ids = torch.tensor([pattern * 3])
    processors = LogitsProcessorList([BanToken(int(plain(model, ids, max_new_tokens=1)[0, -1]))] if ban else [])
    kwargs = dict(max_new_tokens=max_new, do_sample=False, repetition_penalty=repetition_penalty,
                  logits_processor=processors)
    assert speculative(model, ids, **kwargs).tolist() == plain(model, ids, **kwargs).tolist()


@settings(FEW, max_examples=3)
@given(family=st.sampled_from(FAMILIES), seed=st.integers(0, 2**31), temperature=st.floats(0.5, 1.5),
       top_k=st.sampled_from([0, 20]), top_p=st.sampled_from([0.8, 1.0]),
       repetition_penalty=st.sampled_from([1.0, 1.2]))
def test_seeded_sampling_equals_specfree_autoregressive_sampling(family, seed, temperature, top_k, top_p,
                                                                 repetition_penalty):
    model = tiny_model(family)
    knobs = dict(temperature=temperature, top_k=top_k, top_p=top_p, repetition_penalty=repetition_penalty)
    out = speculative(model, do_sample=True, seed=seed, max_new_tokens=16, **knobs)
    reference = Engine.from_model(model, None, "autoregressive", do_sample=True, seed=seed, **knobs)
    assert out[0, PROMPT.shape[1]:].tolist() == reference.generate(PROMPT[0], 16).tokens


def test_return_dict_carries_sequences_and_specfree_steps():
    model = tiny_model("llama")
    out = speculative(model, max_new_tokens=12, return_dict_in_generate=True)
    assert isinstance(out, GenerateDecoderOnlyOutput)
    assert out.sequences.dtype == torch.long and out.sequences.shape[0] == 1
    assert out.sequences.tolist() == plain(model, max_new_tokens=12).tolist()
    assert isinstance(out.specfree, Generation)
    assert out.specfree.tokens == out.sequences[0, PROMPT.shape[1]:].tolist()
    assert sum(step.emitted for step in out.specfree.steps) == len(out.specfree.tokens)
    assert out.scores is None and cache_in(out) is None


def test_eos_and_max_length_are_honoured():
    model = tiny_model("llama")
    greedy = plain(model, max_new_tokens=10, eos_token_id=None)[0, PROMPT.shape[1]:].tolist()
    eos = greedy[4]
    out = speculative(model, max_new_tokens=10, eos_token_id=eos, return_dict_in_generate=True)
    assert out.sequences.tolist() == plain(model, max_new_tokens=10, eos_token_id=eos).tolist()
    assert out.sequences[0, -1] == eos and out.specfree.stop_reason == "eos"
    length = PROMPT.shape[1] + 3
    assert speculative(model, max_length=length).tolist() == plain(model, max_length=length).tolist()


def test_stop_strings_with_a_bound_tokenizer():
    model, tokenizer = tiny_model("llama"), tiny_tokenizer()
    greedy = plain(model, max_new_tokens=20)[0, PROMPT.shape[1]:].tolist()
    word = tokenizer.convert_ids_to_tokens(greedy[3])
    expected = plain(model, max_new_tokens=20, stop_strings=[word], tokenizer=tokenizer)
    out = speculative(model, tokenizer=tokenizer, max_new_tokens=20, stop_strings=[word], return_dict_in_generate=True)
    assert out.sequences.tolist() == expected.tolist()
    assert out.specfree.stop_reason == "stop_string"
    with pytest.raises(ConfigError, match=r"stop_strings need a tokenizer.*speculative_generate\(\.\.\., tokenizer"):
        model.generate(PROMPT, custom_generate=speculative_generate(), max_new_tokens=5, stop_strings=[word],
                       tokenizer=tokenizer)  # transformers does not pass this tokenizer on


@pytest.mark.parametrize("kwargs, message", [
    (dict(input_ids=PROMPT.repeat(2, 1)), "specfree decodes one sequence at a time .batch size 1.; got a batch of 2"),
    (dict(num_return_sequences=2, do_sample=True), "got a batch of 2"),
    (dict(num_beams=2), r"specfree does not do beam search \(num_beams=2\)"),
    (dict(return_dict_in_generate=True, output_scores=True), "does not return output_scores"),
])
def test_what_specfree_cannot_do_is_refused_by_name(kwargs, message):
    ids = kwargs.pop("input_ids", PROMPT)
    with pytest.raises(ConfigError, match=message):
        speculative(tiny_model("llama"), ids, max_new_tokens=4, **kwargs)


def test_stopping_at_the_model_context_warns():
    with pytest.warns(UserWarning, match="specfree stopped after 7 new tokens: the prompt plus output reached "
                                         "the 512 tokens it can attend to for model family 'llama'"):
        out = speculative(tiny_model("llama"), torch.full((1, 505), 7), max_new_tokens=20, eos_token_id=None)
    assert out.shape == (1, 512)


def test_unknown_strategy_or_knob_fails_when_the_callable_is_built():
    with pytest.raises(ConfigError, match="unknown strategy 'nope'"):
        speculative_generate("nope")
    with pytest.raises(ConfigError, match="strategy 'prompt_lookup' has no knob 'draft_length'"):
        speculative_generate("prompt_lookup", draft_length=3)


def test_the_callers_model_keeps_its_own_linear_and_norm_layers_between_calls():
    from specfree.adapters.norms import FusedRMSNorm
    from specfree.kernels import UnpackedLinear, load_kernels

    model = tiny_model.__wrapped__("llama")  # a model of its own: nothing else swaps its layers
    layers = {name: m for name, m in model.named_modules() if type(m) is torch.nn.Linear}
    norm = model.model.norm
    seen = []
    handle = model.model.layers[0].mlp.register_forward_pre_hook(
        lambda *_: seen.append((type(model.lm_head), type(model.model.norm))))
    generate = speculative_generate("prompt_lookup", num_candidates=2)
    try:
        for _ in range(2):
            out = model.generate(PROMPT, custom_generate=generate, pad_token_id=PAD, max_new_tokens=8)
            assert {name: m for name, m in model.named_modules() if type(m) is torch.nn.Linear} == layers
            assert model.model.norm is norm
    finally:
        handle.remove()
    assert out.tolist() == plain(model, max_new_tokens=8).tolist()
    assert {norm_type for _, norm_type in seen} == {FusedRMSNorm}  # fused during the calls
    if load_kernels() is not None:
        assert {linear_type for linear_type, _ in seen} == {UnpackedLinear}  # the kernel during the calls


def test_compiled_speculative_generate_equals_generate_and_compiles_once(tmp_path):
    model = tiny_model("llama")
    custom = speculative_generate("prompt_lookup", compile=True, cache_dir=tmp_path, num_candidates=2)
    other = torch.tensor([[9, 8, 7, 6] * 3 + [5]])
    first = model.generate(PROMPT, custom_generate=custom, max_new_tokens=24, pad_token_id=PAD)
    adapter = custom._compiled[1]
    compiled_s = adapter.compile_s
    second = model.generate(other, custom_generate=custom, max_new_tokens=24, pad_token_id=PAD)
    assert custom._compiled[1] is adapter and adapter.compiled and adapter.compile_s == compiled_s  # no recompile
    assert torch.equal(first, plain(model, max_new_tokens=24)) and torch.equal(second, plain(model, other,
                                                                                            max_new_tokens=24))
