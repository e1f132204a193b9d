"""Compile and decode a random-weight ~1B Llama built from a config (nothing downloaded), and
report the peak resident memory against the weights' bytes.

    PYTHONPATH=. python benchmarks/large_model.py --threads 2 --out large.json

The config is TinyLlama-1.1B's shape (22 layers, hidden 2048, MLP 5632, 32 heads, 4 KV heads,
vocabulary 32000): 1.1B parameters, 4.4 GB in fp32. The compiled forward's package holds no
weights (they stay the model's own tensors), so the process should peak near the weights' size.
"""

from __future__ import annotations

import argparse
import json
import resource
import tempfile
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from specfree.parts import build_adapter
from specfree.settings import EngineSettings
from specfree.bench.cli import cpu_name
from specfree.engine import Engine
from specfree.plugins import build_plugin_manager, registry


def peak_rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9  # Linux reports KiB


def current_rss_gb() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize() / 1e9


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--out")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    config = LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                         num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=2048)
    start = time.perf_counter()
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    result = {"cpu": cpu_name(), "threads": args.threads, "weights_GB": round(weights / 1e9, 2),
              "build_s": round(time.perf_counter() - start, 1), "rss_after_build_GB": round(current_rss_gb(), 2)}
    print(json.dumps(result), flush=True)
    with tempfile.TemporaryDirectory() as cache:
        start = time.perf_counter()
        adapter = build_adapter(model, settings=EngineSettings(compile="true", cache_dir=cache))
        result.update(compiled_by=adapter.describe(),
                      cold_start_s=round(time.perf_counter() - start, 1), rss_after_compile_GB=round(current_rss_gb(), 2))
        print(json.dumps(result), flush=True)
        reg = registry(build_plugin_manager())
        prompt = list(range(100, 164))
        for strategy in ("autoregressive", "prompt_lookup"):
            engine = Engine(adapter, reg.make("strategy", strategy))
            out = engine.generate(prompt, args.tokens)
            result[f"{strategy}_tok_s"] = round(out.tokens_per_s, 2)
        result["peak_rss_GB"] = round(peak_rss_gb(), 2)
        result["peak_over_weights"] = round(result["peak_rss_GB"] / result["weights_GB"], 2)
    print(json.dumps(result), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
