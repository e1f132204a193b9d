"""The KV manager: one owner of a model's KV on the eager and compiled paths, per sequence.

A store is one sequence of a manager, a batch several; the runners are given the buffers with each
call and keep none. These checks hold the bookkeeping to the buffers themselves: the entries the
manager counts are the rows the cache holds, and each sequence keeps exactly the rows committed.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers.cache_utils import Cache

from specfree import Engine
from specfree.adapters.capabilities import causal
from specfree.adapters.compiled import compiled_adapter
from specfree.adapters.hf import HFAdapter
from specfree.adapters.kv_buffers import GrowingBuffers, StaticSlots
from specfree.adapters.kv_manager import KVManager, Rows
from specfree.adapters.runners import EagerRunner
from specfree.plugins import build_plugin_manager, registry
from tests.tiny_models import reference_greedy, tiny_model

REG = registry(build_plugin_manager())
KV_KINDS = (GrowingBuffers, StaticSlots, Cache)


def held_length(buffers) -> int:
    """The rows the buffers themselves hold (not the manager's count)."""
    return buffers.past if isinstance(buffers, StaticSlots) else buffers.cache.get_seq_length()


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_both_paths_keep_their_kv_in_a_manager_and_no_runner_holds_any(compiled):
    model = tiny_model("qwen2")
    adapter = (compiled_adapter(model, backend="eager", min_slots=16, buckets=(1, 8)) if compiled
               else HFAdapter(model))
    prompt = [5, 6, 7, 8, 9] * 3
    result = Engine(adapter, REG.make("strategy", "prompt_lookup")).generate(prompt, 40)
    assert result.tokens == reference_greedy(model, prompt, 40)
    kv = adapter.store.kv
    assert isinstance(kv, KVManager)
    assert isinstance(kv.buffers, StaticSlots if compiled else GrowingBuffers)
    assert kv.entries == held_length(kv.buffers) == adapter.past_len  # the count is the buffers' own
    assert set(kv.owner.tolist()) == {adapter.store.seq}
    assert not [name for name, value in vars(adapter.runner).items() if isinstance(value, KV_KINDS)]


def test_sequences_keep_what_they_commit_and_a_held_prefix_is_adopted():
    adapter = HFAdapter(tiny_model("llama"))
    caps = adapter.capabilities
    kv = KVManager(GrowingBuffers(adapter.dtype, adapter.device),
                   EagerRunner(adapter.model, caps.cache_argument, caps.takes_positions), caps.windows, max_held=1)

    def rows(seq, tokens):
        start = kv.length(seq)
        return Rows(seq, torch.tensor(tokens), causal(len(tokens)), torch.arange(start, start + len(tokens)))

    with torch.inference_mode():
        a, _ = kv.join()
        b, _ = kv.join()
        logits = kv.run([rows(a, [3, 4, 5]), rows(b, [6, 7])])
        assert logits.shape[0] == 5
        kv.commit(5, [(0, [0, 1, 2]), (3, [0])])  # a keeps all three, b its first row
        assert (kv.length(a), kv.length(b)) == (3, 1) and kv.entries == held_length(kv.buffers) == 4
        kv.run([rows(b, [8]), rows(a, [9, 10])])
        kv.commit(3, [(0, [0]), (1, [0])])  # b keeps its row, a the first of two
        assert kv.owner.tolist() == [a, a, a, b, b, a] and held_length(kv.buffers) == 6
        kv.leave(a, np.array([3, 4, 5]))  # its first three held for a later prompt, its last dropped
        assert kv.owner.tolist() == [a, a, a, b, b] and held_length(kv.buffers) == 5
        c, reused = kv.join(np.array([3, 4, 5, 11]))
        assert reused == 3 and kv.owner.tolist() == [c, c, c, b, b] and not kv.held
        kv.leave(b)
        assert kv.owner.tolist() == [c] * 3 and held_length(kv.buffers) == 3
        kv.truncate(2)
        assert kv.entries == held_length(kv.buffers) == 2
        kv.reset()
        assert kv.entries == held_length(kv.buffers) == 0


def test_a_failed_forward_leaves_the_kv_as_it_was():
    adapter = HFAdapter(tiny_model("llama"))
    kv = adapter.store.kv
    with torch.inference_mode():
        adapter.prefill(torch.tensor([3, 4, 5, 6]))
        before = kv.entries
        bad_mask = torch.zeros(1, 1, 2, 3)  # too narrow: the first layer writes its rows, then attention fails
        with pytest.raises(RuntimeError):
            kv.forward([(adapter.store.seq, 2)], torch.tensor([3, 7]), torch.arange(before, before + 2), bad_mask)
        assert kv.entries == held_length(kv.buffers) == before
