"""Determinism, the baseline check mode, and bounded memory over long runs."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
import transformers

from specfree import Engine
from specfree.check import check_against_baseline
from tests.tiny_models import COMMON, tiny_model

RUN = """
import json, sys
sys.path.insert(0, {root!r})
from specfree import Engine
from specfree.cost import CostModel
from tests.tiny_models import tiny_model
# A fixed curve: a measured one is timed, and a busy machine can time it differently in each process,
# so the rows priced in (and the step counts) would differ while the tokens do not.
costs = CostModel([1, 2, 4, 8, 16, 32, 64], [1.0, 1.05, 1.1, 1.2, 1.5, 2.0, 3.0])
engine = Engine.from_model(tiny_model("qwen2"), None, "hybrid", do_sample=True, seed=11, temperature=0.8,
                           costs=costs)
runs = [engine.generate([5, 6, 7, 5, 6, 7, 9], 40, ignore_eos=True) for _ in range(2)]
print(json.dumps([[r.tokens, [[s.rows, s.accepted, s.emitted] for s in r.steps]] for r in runs]))
"""


def test_same_seed_gives_same_output_and_step_counts_across_processes(tmp_path):
    root = str(__import__("pathlib").Path(__file__).parents[1])
    outputs = [json.loads(subprocess.run([sys.executable, "-c", RUN.format(root=root)], capture_output=True,
                                         text=True, check=True).stdout) for _ in range(2)]
    assert outputs[0] == outputs[1]
    # Within a process, a second request reuses learned pools: same tokens, but steps may differ.
    assert outputs[0][0][0] == outputs[0][1][0]


def test_check_mode_reports_identity_in_fp32():
    engine = Engine.from_model(tiny_model("llama"), None, "prompt_lookup")
    result = engine.generate([5, 6, 7, 5, 6], 30)
    check = check_against_baseline(engine, result, [5, 6, 7, 5, 6], max_new_tokens=30)
    assert check.identical and check.first_divergence is None
    assert "identical to plain decoding" in check.describe()


def test_check_mode_names_the_first_divergence():
    engine = Engine.from_model(tiny_model("llama"), None, "prompt_lookup")
    result = engine.generate([5, 6, 7, 5, 6], 30, ignore_eos=True)
    result.tokens[7] = (result.tokens[7] + 1) % 128  # a deliberately different output
    check = check_against_baseline(engine, result, [5, 6, 7, 5, 6], max_new_tokens=30, ignore_eos=True)
    assert not check.identical and check.first_divergence == 7
    assert "differs from plain decoding at new token 7" in check.describe()


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


@pytest.mark.slow
@pytest.mark.parametrize("strategy, knobs", [("hybrid", {}), ("lookahead", {}), ("trie", {"max_nodes": 5000})])
def test_an_8000_token_generation_keeps_memory_bounded(strategy, knobs):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=8200, **COMMON)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    engine = Engine.from_model(model, None, strategy, **knobs)
    engine.generate([5, 6, 7], 200, ignore_eos=True)  # warm up allocations
    before = rss_mb()
    result = engine.generate([5, 6, 7], 8000, ignore_eos=True)
    grown = rss_mb() - before
    assert len(result.tokens) == 8000
    print(f"{strategy}: RSS grew {grown:.1f} MB over 8000 tokens")
    assert grown < 200  # the KV cache of this model for 8k tokens is ~2 MB; pools are capped


@pytest.mark.slow
def test_500_requests_with_a_persistent_trie_stay_within_the_node_budget():
    engine = Engine.from_model(tiny_model("llama"), None, "trie", max_nodes=2000, persist=True)
    sizes, before = [], None
    for request in range(500):
        prompt = [3 + (request * 7 + k) % 120 for k in range(20)]
        engine.generate(prompt, 40, ignore_eos=True)
        sizes.append(len(engine.strategy.pool))
        if request == 50:
            before = rss_mb()
    grown = rss_mb() - before
    print(f"trie: max {max(sizes)} nodes, RSS grew {grown:.1f} MB over 450 requests")
    assert max(sizes) <= 2000
    assert grown < 50
