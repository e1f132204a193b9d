"""One process of the old-against-new speed check (issue 78): tok/s of one request, compiled, for the plain
loop and the priced hybrid on one fixed cost curve. Run it alternately for each package; the old one is
a2c1c97's ``specfree/`` copied as ``specfree_old`` (see README.md here):

    PYTHONPATH=/tmp/i78/old python docs/bench/one_loop/speed_proc.py specfree_old 48
    python docs/bench/one_loop/speed_proc.py specfree 48
"""
import importlib
import json
import sys
import time

package, new_tokens = sys.argv[1], int(sys.argv[2])
pkg = importlib.import_module(package)
cost = importlib.import_module(package + ".cost")
PROMPTS = ("Write a short poem about the sea.", "Explain what a hash table is, with an example in Python.",
           "List five facts about the moon.", "Rewrite in the past tense: The fox jumps over the dog.")
row = {"package": package}
for strategy in ("autoregressive", "hybrid"):
    # one fixed curve (DESIGN.md's shape) for both packages, so that pricing cannot differ between them
    curve = cost.CostModel([1, 2, 4, 8, 16, 32], [1.0, 1.1, 1.25, 1.5, 1.9, 2.6])
    engine = pkg.Engine.from_pretrained("smollm2", strategy, compile=True, precision="int8", costs=curve)
    prompts = [engine.encode(p, chat=True) for p in PROMPTS]
    engine.generate(prompts[0], 8)  # warm-up
    tokens, seconds, outs = 0, 0.0, []
    for p in prompts:
        t0 = time.perf_counter()
        g = engine.generate(p, new_tokens, ignore_eos=True)
        seconds += time.perf_counter() - t0
        tokens += len(g.tokens)
        outs.append(list(g.tokens))
    row[strategy] = {"tok_s": round(tokens / seconds, 2), "tokens": outs, "linears": str(engine.adapter.linears)}
print(json.dumps(row))
