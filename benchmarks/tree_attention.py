"""specfree's tree-attention op against torch's SDPA on a model's attention shapes, ms per forward
(every layer), for a step of k chain rows over a cache of n tokens:

    PYTHONPATH=. python benchmarks/tree_attention.py --threads 2

Two KV layouts: the growing cache (keys = n + k, as the eager adapter runs) and static slots
(keys = capacity, mostly empty, as the compiled adapter runs; SDPA reads every slot under the
mask, the op only the filled ones). Defaults: SmolLM2-135M (9 query heads, 3 KV heads, head dim
64, 30 layers). On a shared machine the figures are noisy: read them against each other.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from specfree.kernels import load_kernels
from specfree.kernels.tree_attention import tree_attention

LOWEST = torch.finfo(torch.float32).min


def sdpa(query, key, value, mask, scale):
    """What the adapter ran before the op: grouped SDPA under the 4D mask (none for one row)."""
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale, enable_gqa=True)
    return out.transpose(1, 2).contiguous()


def timed(fn, layers, repeats: int) -> float:
    """The best ms of one pass over every layer's inputs (the least disturbed on a shared machine)."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for inputs in layers:
            fn(*inputs)
        times.append(time.perf_counter() - start)
    return min(times) * 1e3


def layer_inputs(rows, context, slots, heads, kv_heads, head_dim, layers, generator):
    """Per layer (query, key, value, mask) for ``rows`` causal rows after ``context`` cached tokens in
    a store of ``slots`` keys (None: exactly context + rows)."""
    keys = slots or context + rows
    seen = torch.zeros(rows, keys, dtype=torch.bool)
    seen[:, :context] = True
    seen[:, context:context + rows] = torch.ones(rows, rows, dtype=torch.bool).tril()
    mask = torch.zeros(rows, keys).masked_fill(~seen, LOWEST)[None, None]
    if rows == 1 and slots is None:
        mask = None  # the one-row step over a growing cache needs none
    scale = head_dim ** -0.5
    return [(torch.randn(1, rows, heads, head_dim, generator=generator).transpose(1, 2),
             torch.randn(1, kv_heads, keys, head_dim, generator=generator),
             torch.randn(1, kv_heads, keys, head_dim, generator=generator), mask, scale) for _ in range(layers)]


def attention_curves(heads: int, kv_heads: int, head_dim: int, layers: int, rows=(1, 2, 4, 8, 16),
                     contexts=(64, 256, 1024, 2048), slots: int = 2304, repeats: int = 7) -> dict:
    """{layout: {context: {rows: [op ms, SDPA ms]}}} for one forward's attention (every layer)."""
    generator = torch.Generator().manual_seed(0)
    result: dict = {}
    for layout, store in (("growing cache", None), (f"{slots} static slots", slots)):
        for context in contexts:
            for k in rows:
                inputs = layer_inputs(k, context, store, heads, kv_heads, head_dim, layers, generator)
                for fn in (tree_attention, sdpa):  # warm up both
                    timed(fn, inputs, 1)
                cell = [round(timed(fn, inputs, repeats), 2) for fn in (tree_attention, sdpa)]
                result.setdefault(layout, {}).setdefault(context, {})[k] = cell
    return result


def model_attention_curves(model, repeats: int = 7) -> dict:
    """``attention_curves`` on ``model``'s attention shapes (after ``load_kernels``)."""
    config = model.config
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return attention_curves(heads, getattr(config, "num_key_value_heads", None) or heads, head_dim,
                            config.num_hidden_layers, repeats=repeats)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--context", type=int, nargs="+", default=[64, 256, 1024, 2048])
    parser.add_argument("--slots", type=int, default=2304, help="static slots (the compiled layout)")
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    too_long = [c for c in args.context if c + max(args.rows) > args.slots]
    if too_long:
        parser.error(f"--slots {args.slots} cannot hold a context of {too_long[0]} tokens plus {max(args.rows)} "
                     f"rows: give --slots of at least {max(too_long) + max(args.rows)}, or shorter contexts")
    torch.set_num_threads(args.threads)
    isa = load_kernels()
    print(f"op: {isa}; {args.threads} threads; {args.layers} layers of {args.heads} heads / {args.kv_heads} KV "
          f"heads, head dim {args.head_dim}; ms per forward's attention (best of {args.repeats})")
    curves = attention_curves(args.heads, args.kv_heads, args.head_dim, args.layers, args.rows, args.context,
                              args.slots, args.repeats)
    for layout, table in curves.items():
        print(f"\n{layout}: op / SDPA")
        print("context " + "".join(f"{f'{k} rows':>18}" for k in args.rows))
        for context, cells in table.items():
            print(f"{context:>7} " + "".join(f"{f'{op:7.2f} / {ref:7.2f}':>18}" for op, ref in cells.values()))


if __name__ == "__main__":
    main()
