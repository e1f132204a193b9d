"""specfree's proposer inside vLLM gives vLLM's own greedy output, on a tiny Llama and on SmolLM2.

vLLM needs an environment of its own (docs/vllm.md: ``bash scripts/vllm_env.sh`` builds
``.vllm-venv``); these tests run vLLM there in a subprocess and are skipped where it does not exist.
CI does not build it (a large download, and minutes of vLLM start-up per run on 2 cores).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
VLLM_PYTHON = ROOT / ".vllm-venv" / "bin" / "python"
SCRIPT = ROOT / "benchmarks" / "vllm_compare.py"

pytestmark = pytest.mark.skipif(not VLLM_PYTHON.exists(),
                                reason=f"no vLLM environment at {VLLM_PYTHON.parent.parent}: "
                                       "build it with `bash scripts/vllm_env.sh` (docs/vllm.md)")


def run_vllm(model: Path, prompts: list[list[int]], tmp: Path, method: str, *overrides: str,
             max_tokens: int = 24) -> dict:
    (tmp / "prompts.json").write_text(json.dumps(prompts))
    out = tmp / f"{method}-{'-'.join(overrides) or 'x'}.json"
    cmd = [str(VLLM_PYTHON), str(SCRIPT), str(model), str(tmp / "prompts.json"), str(out), "--method", method,
           "--max-tokens", str(max_tokens), "--no-warmup", "--eager"]
    if overrides:
        cmd += ["--specfree", *overrides]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> Path:
    import transformers

    torch.manual_seed(0)
    # head_dim 64: vLLM's CPU attention takes the usual head sizes only.
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=1024,
                                      bos_token_id=1, eos_token_id=2, initializer_range=0.3)
    folder = tmp_path_factory.mktemp("tiny-llama")
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def repetitive_prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    prompts = []
    for n in (12, 20, 7, 30):
        piece = torch.randint(3, vocab, (n,), generator=g).tolist()
        prompts.append(piece * 3 + piece[: n // 2])
    return prompts


def test_tiny_llama_output_equals_plain_for_several_strategies(tiny_llama, tmp_path):
    prompts = repetitive_prompts(256)
    plain = run_vllm(tiny_llama, prompts, tmp_path, "plain")["outputs"]
    assert all(len(o) == 24 for o in plain)
    for strategy in ("prompt_lookup", "trie", "hybrid"):
        run = run_vllm(tiny_llama, prompts, tmp_path, "specfree", f"strategy={strategy}")
        assert run["outputs"] == plain, strategy
        assert run["drafted"] > 0, strategy  # vLLM verified specfree's drafts


def test_unknown_strategy_is_one_line(tiny_llama, tmp_path):
    (tmp_path / "p.json").write_text("[[3, 4, 5]]")
    done = subprocess.run([str(VLLM_PYTHON), str(SCRIPT), str(tiny_llama), str(tmp_path / "p.json"),
                           str(tmp_path / "o.json"), "--method", "specfree", "--specfree", "strategy=nope",
                           "--no-warmup", "--eager"], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode != 0
    assert done.stderr.strip().splitlines()[-1].startswith("error: unknown strategy 'nope'; available:")


@pytest.mark.model
def test_smollm2_output_equals_plain(tmp_path):
    from specfree.loading import load_model

    model, tokenizer = load_model("smollm2", device="cpu", dtype="float32")
    folder = tmp_path / "smollm2"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    texts = ["Repeat exactly: the red fox jumps over the lazy dog. The red fox jumps over the lazy dog.",
             "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):"]
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                             tokenize=True, return_dict=False) for t in texts]
    plain = run_vllm(folder, prompts, tmp_path, "plain", max_tokens=32)["outputs"]
    for strategy in ("prompt_lookup", "hybrid"):
        run = run_vllm(folder, prompts, tmp_path, "specfree", f"strategy={strategy}", max_tokens=32)
        assert run["outputs"] == plain, strategy
        assert run["accepted"] > 0, strategy  # the repeated text is drafted and kept
