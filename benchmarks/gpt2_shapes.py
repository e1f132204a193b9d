"""GPT-2 small's shapes with random weights (fp32, 2 threads): ms per eager forward at 256 tokens of
context for 1-16 rows, stock (``Conv1D`` through ``addmm``, SDPA) against specfree's (``Conv1D``
packed into panels, tree attention), the two taking turns in one process.

    PYTHONPATH=. python benchmarks/gpt2_shapes.py
"""

from __future__ import annotations

import warnings

import torch
import transformers

from specfree.adapters.attention import attention_path, stock_attention
from specfree.adapters.hf import HFAdapter
from specfree.runinfo import cpu_name
from specfree.cost import CostModel
from specfree.kernels import linear_path, stock_linears

SIZES = (1, 2, 4, 8, 16)


def main(rounds: int = 3) -> None:
    torch.set_num_threads(2)
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_embd=768, n_layer=12, n_head=12, n_positions=1024, vocab_size=50257)
    model = transformers.GPT2LMHeadModel(config).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        adapter = HFAdapter(model, check_tree_mask=False)
    print(f"{cpu_name()}; specfree: {attention_path(model)}, {linear_path(model)}")
    best: dict[str, list[float]] = {}
    for _ in range(rounds):
        for name in ("stock", "specfree"):
            if name == "stock":
                with stock_linears(model), stock_attention(model):
                    seconds = CostModel.measure(adapter, context=256, sizes=SIZES, longer=None).seconds
            else:
                seconds = CostModel.measure(adapter, context=256, sizes=SIZES, longer=None).seconds
            best[name] = [min(a, b) for a, b in zip(best.get(name, seconds), seconds)]
    for name, seconds in best.items():
        print(f"{name:9s}", " / ".join(f"{1e3 * s:6.1f}" for s in seconds), "ms at", SIZES, "rows")


if __name__ == "__main__":
    main()
