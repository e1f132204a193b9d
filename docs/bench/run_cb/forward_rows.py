"""The compiled forward's time at 1-16 rows after 256 tokens of context (``CostModel.measure``, best of
3 rounds of 7), SmolLM2-135M Q4_1 at the default precision, 2 threads, with whichever ``specfree`` is
imported: this tree's (q|k|v and gate|up each one shared call), or, for the calls separate, 2f58a20's
parent unpacked elsewhere (``run.sh``: renamed ``specfree_unshared`` in its imports, under ``PYTHONPATH=/tmp/unshared``).

    python docs/bench/run_cb/forward_rows.py LABEL [PACKAGE]
"""
import importlib
import json
import sys

package = sys.argv[2] if len(sys.argv) > 2 else "specfree"  # the old tree's copy is renamed, as run CA's was
CostModel = importlib.import_module(f"{package}.cost").CostModel
Engine = importlib.import_module(package).Engine

sizes = (1, 2, 4, 8, 16)
engine = Engine.from_config(overrides=["strategy=autoregressive", "threads=2", "compile=true"])
best = [float("inf")] * len(sizes)
for _ in range(3):
    curve = CostModel.measure(engine.adapter, context=256, sizes=sizes, repeats=7, longer=None)
    best = [min(b, curve(k)) for b, k in zip(best, sizes)]
print(json.dumps({"calls": sys.argv[1], "linears": str(engine.adapter.linears),
                  "ms": {k: round(1e3 * s, 3) for k, s in zip(sizes, best)}, "ratio_8_to_1": round(best[3] / best[0], 3)}))
