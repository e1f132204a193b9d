"""One request, one answer, whichever way it is asked: a multi-turn chat decoded with the prompt
cache on, off, per call, by ``generate_batch`` and by a batch that holds prompts (what ``serve``
runs) gives the same tokens and the same log-probabilities bit for bit (equal floats: the verify
rows themselves were equal), at precision=exact and int8, eager and compiled. Every path is the
one loop (``batching.Batch``), and a prompt's KV has the same bits whether it was prefilled fresh,
reused, or computed while decoding an earlier turn (``batching.EXACT_CHUNK`` chunks throughout).
"""

from __future__ import annotations

import pytest
from gguf import GGMLQuantizationType as T

from specfree import Engine
from specfree.adapters.compiled import compiled_adapter
from specfree.batching import EXACT_CHUNK, Batch
from specfree.loading import load_model
from specfree.plugins import build_plugin_manager, registry
from tests.test_gguf import tiny_file
from tests.test_prompt_cache import CPU_LIKE, conversation
from tests.tiny_models import tiny_model

REG = registry(build_plugin_manager())
TURNS, NEW = 3, 10


def chat_paths(make_engine, batches: bool) -> dict[str, list[tuple]]:
    """Each path's (tokens, logprobs) per turn of one chat whose first prompt spans several prefill chunks."""
    turns = conversation(31, TURNS, first=EXACT_CHUNK + 60)
    ask = dict(ignore_eos=True, logprobs=2)
    cached, fresh = make_engine(prompt_cache=True), make_engine(prompt_cache=False)
    holding = Batch(cached, 2, hold_prompts=True) if batches else None
    answers: dict[str, list[tuple]] = {name: [] for name in ("cached", "uncached", "cache_prompt=False", "batch",
                                                             "held batch")}
    prompt: list[int] = []
    for new in turns:
        prompt = prompt + new
        runs = {"cached": cached.generate(prompt, NEW, **ask),
                "uncached": fresh.generate(prompt, NEW, **ask),
                "cache_prompt=False": cached.generate(prompt, NEW, cache_prompt=False, **ask)}
        # generate_batch beside another prompt (one at a time where the engine cannot batch)
        runs["batch"] = fresh.generate_batch([prompt, turns[0][:20]], NEW, max_batch=2, **ask)[0] if batches \
            else fresh.generate_batch([prompt], NEW, max_batch=1, **ask)[0]
        if holding is not None:
            member = holding.add(cached.request(prompt, NEW, **ask))
            while member.result is None:
                assert member.error is None, member.error
                holding.step()
            runs["held batch"] = member.result
        for name, generation in runs.items():
            answers[name].append((generation.tokens, generation.logprobs))
        prompt = prompt + runs["cached"].tokens
    if holding is not None:
        holding.close()
    return {name: turns for name, turns in answers.items() if turns}


def assert_one_answer(answers: dict[str, list[tuple]]) -> None:
    want = answers.pop("uncached")
    for name, got in answers.items():
        assert got == want, name


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_a_chat_has_one_answer_on_every_path_at_exact(family):
    model = tiny_model(family)

    def make(**knobs):
        return Engine.from_model(model, None, "hybrid", costs=CPU_LIKE, **knobs)

    assert_one_answer(chat_paths(make, batches=True))


def test_a_chat_has_one_answer_on_every_path_at_int8(tmp_path):
    model, _ = load_model(str(tiny_file(tmp_path, T.Q4_K)), cache_dir=tmp_path)

    def make(**knobs):
        return Engine.from_model(model, None, "hybrid", costs=CPU_LIKE, precision="int8", **knobs)

    assert "int8" in make().adapter.linears
    assert_one_answer(chat_paths(make, batches=True))


def test_a_chat_has_one_answer_on_every_path_compiled():
    """torch.compile graphs (the eager backend: the same graph machinery, seconds to build) cannot
    share a forward: every path decodes one request at a time, through the same loop."""
    model = tiny_model("qwen2")
    adapter = compiled_adapter(model, backend="eager", min_slots=16, buckets=(1, 8))

    def make(**knobs):
        return Engine(adapter, REG.make("strategy", "prompt_lookup"), costs=CPU_LIKE, **knobs)

    assert adapter.compiled and make().batch_off is not None
    assert_one_answer(chat_paths(make, batches=False))
