"""Measure the compiled forward against the eager one on SmolLM2-135M (or another model).

    PYTHONPATH=. python benchmarks/compile_forward.py --threads 2 --variants packages inductor --warm-start \
        --inductor-gemm --out cf.json

First the model's linear layers alone (``specfree.bench.linear_curves``): ms per pass over all of them
for 1..16 rows, with torch's BLAS, oneDNN with packed weights, specfree's few-row kernel on the
model's layout and on weights packed into panels (each code path this CPU runs), the read-pass
floor (``read_pass``: every packed weight read once, same threads) and, with ``--inductor-gemm``, Inductor's C++ GEMM with frozen weights.
With ``--attention``, the model's attention alone (``tree_attention.py``): specfree's tree-attention
op against SDPA at 1..16 rows and 64..2048 tokens of context, growing cache and static slots.
Then per variant (``packages``: the AOTInductor package, the CPU default, kept in
``--package-dir``; ``inductor``: torch.compile): seconds to compile (or load) the steps, the
forward cost curve (1..32 rows at 256 tokens of context, best of 5, sizes taking turns) beside
the eager adapter's (with torch's linear layers and with the kernel), greedy output of the compiled path against the eager
path, and, with ``--warm-start``, the seconds a second process needs until its compiled path is
ready. Also the memory bandwidth (a large read, and a large copy) and the model's weight bytes:
one row cannot beat bytes / read bandwidth.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import torch

from specfree.adapters.compiled import compiled_adapter
from specfree.adapters.hf import HFAdapter
from specfree.loading import DEFAULT_CACHE, load_model
from specfree.bench.cli import cpu_name
from specfree.cost import CostModel
from specfree.engine import Engine
from specfree.kernels import stock_linears
from specfree.bench.linear_curves import linear_curves
from specfree.plugins import build_plugin_manager, registry

SIZES = (1, 2, 4, 8, 16, 32)
VARIANTS = {"packages": dict(backend="aoti"), "inductor": dict(backend="inductor", max_autotune=True)}
PROMPTS = ["def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
           "Question: Tom has 3 apples and buys 5 more. How many apples does he have? Answer step by step."]


def stream_bandwidth(megabytes: int = 1024, repeats: int = 5) -> float:
    """Bytes per second of a large copy (read + write), best of ``repeats``."""
    a = torch.ones(megabytes * 2**20 // 4)
    b = torch.empty_like(a)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        b.copy_(a)
        best = min(best, time.perf_counter() - start)
    return 2 * a.numel() * 4 / best


def read_bandwidth(megabytes: int = 1024, repeats: int = 5) -> float:
    """Bytes per second of a large reduction (reads only, like streaming weights), best of ``repeats``."""
    a = torch.ones(megabytes * 2**20 // 4)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        a.sum()
        best = min(best, time.perf_counter() - start)
    return a.numel() * 4 / best


def weight_bytes(model) -> int:
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total


def curves(adapters: dict, model, rounds: int = 2) -> dict:
    """Each adapter's cost curve, the adapters taking turns ``rounds`` times; the best per size.
    ``"eager, library linears"`` is the eager adapter with torch's linear layers swapped back in."""
    best: dict[str, list[float]] = {}
    for _ in range(rounds):
        for name, adapter in adapters.items():
            if name == "eager, library linears":
                with stock_linears(model):
                    c = CostModel.measure(adapter, sizes=SIZES)
            else:
                c = CostModel.measure(adapter, sizes=SIZES)
            best[name] = [min(a, b) for a, b in zip(best.get(name, c.seconds), c.seconds)]
    return {name: dict(zip(SIZES, (round(1e3 * s, 2) for s in secs))) for name, secs in best.items()}


def same_output(model, tokenizer, compiled) -> dict:
    reg = registry(build_plugin_manager())
    out = {}
    for strategy in ("autoregressive", "prompt_lookup"):
        eager = Engine(HFAdapter(model), reg.make("strategy", "autoregressive"), tokenizer=tokenizer)
        ours = Engine(compiled, reg.make("strategy", strategy), tokenizer=tokenizer)
        plain = Engine(compiled, reg.make("strategy", "autoregressive"), tokenizer=tokenizer)
        out[strategy] = [ours.generate(p, 64, chat=True).tokens == plain.generate(p, 64, chat=True).tokens
                         for p in PROMPTS]
        out[f"{strategy}_vs_eager"] = [ours.generate(p, 64, chat=True).tokens == eager.generate(p, 64, chat=True).tokens
                                       for p in PROMPTS]
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--warm-start", action="store_true", help="time a second process's warm start")
    parser.add_argument("--ready-only", help=argparse.SUPPRESS)  # the second process: warm up, print seconds
    parser.add_argument("--package-dir", default=str(DEFAULT_CACHE / "compiled"),
                        help="where packages are kept (the default is the one decode and bench use)")
    parser.add_argument("--inductor-gemm", action="store_true",
                        help="also time Inductor's C++ GEMM on the linear layers (compiles per row count)")
    parser.add_argument("--attention", action="store_true", help="also time the tree-attention op against SDPA")
    parser.add_argument("--out")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    model, tokenizer = load_model(args.model)
    if args.ready_only:
        adapter = compiled_adapter(model, **knobs(args.ready_only, args.package_dir))
        adapter.warm_up(progress=False)
        print(json.dumps({"ready_s": time.perf_counter() - start, "warm_up_s": adapter.compile_s}))
        return
    result = {"cpu": cpu_name(), "threads": args.threads, "torch": torch.__version__,
              "read_GBps": round(read_bandwidth() / 1e9, 1), "copy_GBps": round(stream_bandwidth() / 1e9, 1),
              "weight_MB": round(weight_bytes(model) / 1e6)}
    result["floor_ms"] = round(1e3 * weight_bytes(model) / (result["read_GBps"] * 1e9), 1)
    print(json.dumps(result), flush=True)
    result["linear_curves_ms"] = linear_curves(model, inductor=args.inductor_gemm)
    print(json.dumps({"linear_curves_ms": result["linear_curves_ms"]}), flush=True)
    if args.attention:
        from tree_attention import model_attention_curves  # benchmarks/tree_attention.py, beside this file

        result["attention_ms"] = model_attention_curves(model)
        print(json.dumps({"attention_ms (op, SDPA)": result["attention_ms"]}), flush=True)
    eager = HFAdapter(model)
    adapters = {"eager, library linears": eager, "eager": eager}
    for name in args.variants:
        adapter = compiled_adapter(model, **knobs(name, args.package_dir))
        per_bucket = {}
        for rows in adapter.runner.warm_up_rows():  # a graph per bucket, one package
            before = adapter.compile_s
            adapter.forward(torch.zeros(rows, dtype=torch.long))
            adapter.reset()
            per_bucket[rows] = round(adapter.compile_s - before, 1)
        result[f"{name}_compile_s"] = per_bucket
        print(json.dumps({f"{name}_compile_s": per_bucket}), flush=True)
        adapters[name] = adapter
        result[f"{name}_output"] = same_output(model, tokenizer, adapter)
        print(json.dumps({f"{name}_output": result[f"{name}_output"]}), flush=True)
    result["curves_ms"] = curves(adapters, model)
    print(json.dumps({"curves_ms": result["curves_ms"]}), flush=True)
    if args.warm_start:
        for name in args.variants:
            run = subprocess.run([sys.executable, __file__, "--model", args.model, "--threads", str(args.threads),
                                  "--ready-only", name], capture_output=True, text=True, check=True)
            result[f"{name}_warm_start"] = json.loads(run.stdout.strip().splitlines()[-1])
            print(json.dumps({f"{name}_warm_start": result[f"{name}_warm_start"]}), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


def knobs(variant: str, package_dir: str) -> dict:
    return {**VARIANTS[variant], **({"package_dir": package_dir} if variant == "packages" else {})}


if __name__ == "__main__":
    main()
