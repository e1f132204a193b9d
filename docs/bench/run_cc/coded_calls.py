"""Forward-ordered coded calls of SmolLM2 (int8), several builds alternated, bits checked against the
first. usage: mb2.py rows=1,8 rounds=8 threads=2 NS=path.so ..."""
import sys, time, torch
from specfree import Engine
from specfree.bench.roofline import coded_calls
opts = dict(a.split("=", 1) for a in sys.argv[1:])
rows = [int(r) for r in opts.pop("rows", "1,2,4,8,16").split(",")]
rounds = int(opts.pop("rounds", 8)); threads = int(opts.pop("threads", 2))
for ns, so in opts.items(): torch.ops.load_library(so)
names = list(opts)
torch.set_num_threads(threads)
engine = Engine.from_config(overrides=["strategy=autoregressive", f"threads={threads}", "compile=false"])
calls = coded_calls(engine.adapter.model)
def run(ns, c, x):
    k = c.codes
    return getattr(torch.ops, ns).coded_linear(x, k.codes, k.scales, k.offsets, c.bias, c.n, "auto", k.supers, k.super_offsets, precision=c.precision)
torch.manual_seed(0)
xs = {r: {k: torch.randn(r, k) for k in {c.k for c in calls}} for r in rows}
for ns in names[1:]:
    bad = sum(not torch.equal(run(names[0], c, xs[r][c.k]), run(ns, c, xs[r][c.k])) for r in rows for c in calls[:5] + calls[-1:])
    print(f"bits {ns} vs {names[0]}:", "equal" if not bad else f"{bad} MISMATCHES")
best = {(ns, r, i): 1e9 for ns in names for r in rows for i in range(len(calls))}
with torch.no_grad():
    for rnd in range(rounds):
        order = names[rnd % len(names):] + names[:rnd % len(names)]
        for ns in order:
            for r in rows:
                for i, c in enumerate(calls):
                    x = xs[r][c.k]
                    t = time.perf_counter(); run(ns, c, x); t = time.perf_counter() - t
                    best[ns, r, i] = min(best[ns, r, i], t)
shapes = {}
for i, c in enumerate(calls): shapes.setdefault(c.shape, []).append(i)
for r in rows:
    tot = " ".join(f"{ns}={sum(best[ns, r, i] for i in range(len(calls))) * 1e3:.2f}" for ns in names)
    per = " ".join(calls[ix[0]].layers.split('|')[0][:5] + ":" + "/".join(f"{sorted(best[ns, r, i] for i in ix)[len(ix)//2]*1e6:.0f}" for ns in names) for ix in shapes.values())
    print(f"rows {r:2d} ms: {tot} | us {per}")
