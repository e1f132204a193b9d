"""Which families' verify rows equal the one-row forward bit for bit: a Markdown table.

    PYTHONPATH=. python benchmarks/bit_identity.py            # every tiny family of the tests
    PYTHONPATH=. python benchmarks/bit_identity.py --smollm2  # and SmolLM2-135M

For each family a tiny random model (``tests/tiny_models.py``) runs a step over a 7-token
continuation as a causal chain and as a tree with a sibling after every node, against one-row
forwards over the same tokens (``tests/test_tree_attention.chain_and_tree_against_one_row``),
eager, with the kernels an engine gives it. The table names the attention and linear paths and how
many rows have the same bits; where not all do, the worst logit difference.
"""

from __future__ import annotations

import argparse
import warnings

import torch

from specfree.adapters.attention import attention_path
from specfree.adapters.hf import HFAdapter
from specfree.kernels import linear_path
from tests.test_tree_attention import CONTEXT, CONTINUATION, chain_and_tree_against_one_row
from tests.tiny_models import FAMILIES, tiny_model


def verdict(adapter, context, continuation) -> list[str]:
    chain, tree, alone = chain_and_tree_against_one_row(adapter, context, continuation)
    rows = len(alone)
    equal = [int(sum(torch.equal(a, b) for a, b in zip(x, alone))) for x in (chain, tree)]
    worst = max((x - alone).abs().max().item() for x in (chain, tree))
    return [attention_path(adapter.model), linear_path(adapter.model), f"{equal[0]}/{rows}", f"{equal[1]}/{rows}",
            "0" if worst == 0 else f"{worst:.1e}"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--smollm2", action="store_true")
    args = parser.parse_args()
    print("| family | attention | linears | chain rows bit-equal | tree rows bit-equal | worst logit difference |")
    print("|---|---|---|---:|---:|---:|")
    for family in FAMILIES:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            adapter = HFAdapter(tiny_model(family, seed=31), check_tree_mask=False)
            print("| " + " | ".join([family, *verdict(adapter, CONTEXT, CONTINUATION)]) + " |", flush=True)
    if args.smollm2:
        from specfree import Engine

        adapter = Engine.from_pretrained("smollm2", "autoregressive").adapter
        continuation = torch.tensor([1000, 2000, 3000, 400, 5, 600, 7000, 80])
        print("| " + " | ".join(["SmolLM2-135M", *verdict(adapter, torch.arange(100, 400, 7), continuation)]) + " |")


if __name__ == "__main__":
    main()
