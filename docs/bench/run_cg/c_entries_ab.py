"""A/B in one process: the same step inputs through the package with C entries and the one without
(proxy executor for every custom op), alternated, best of rounds. 1 and 8 rows after 256 tokens."""
import sys, time, torch
from pathlib import Path
from specfree.engine import Engine
from specfree.adapters.packaged import load_package, model_tensors, SlotStep, step_leaves
eng = Engine.from_config(overrides=["threads=2", "compile=true", "strategy=autoregressive"])
a = eng.adapter
pkg = a.runner.package
new = pkg.loaded_runner
old = load_package(Path(sys.argv[1]), model_tensors(SlotStep(pkg.model)))
seen = {}
orig = pkg.run
def spy(*inputs):
    seen["inputs"] = inputs
    return orig(*inputs)
pkg.run = spy
ids = torch.tensor([5 + i % 200 for i in range(264)])
for rows in (1, 8):
    a.reset(); a.prefill(ids[:256])
    a.forward(ids[256:256 + rows])
    leaves = step_leaves(*seen["inputs"])
    best = {"entries": 1e9, "proxy": 1e9}
    for r in range(40):
        for name, runner in (("entries", new), ("proxy", old)) if r % 2 else (("proxy", old), ("entries", new)):
            t = time.perf_counter(); runner.boxed_run(list(leaves)); best[name] = min(best[name], time.perf_counter() - t)
    print(rows, "rows:", {k: round(v * 1e3, 3) for k, v in best.items()})
