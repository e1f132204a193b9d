"""By row count: the priced steps' measured forward time beside the predicted, accepted drafts beside
the expected, and the correction per count, on 24 Spec-Bench prompts (compiled, 2 threads):

    python docs/bench/optimism_cap/rows.py hybrid suffix
"""
import json, sys
from collections import defaultdict
from specfree import Engine
qs = [json.loads(l) for l in open("../shared/bench/spec_bench_questions.jsonl")]
prompts = [q["turns"][0] for q in qs[::3][:24]]
for strategy in sys.argv[1:]:
    engine = Engine.from_config(overrides=[f"strategy={strategy}", "threads=2", "compile=true"])
    engine.generate(prompts[0], max_new_tokens=32)
    by = defaultdict(lambda: [0, 0.0, 0.0, 0.0, 0.0])
    for p in prompts:
        for s in engine.generate(p, max_new_tokens=128).steps:
            if s.predicted_s is None: continue
            b = by[s.rows]; b[0] += 1; b[1] += s.forward_s; b[2] += s.predicted_s; b[3] += s.accepted; b[4] += s.expected or 0
    print(strategy, "correction", {k: round(v, 2) for k, v in sorted(engine.pricer.correction.ratio.items())})
    print(" rows  steps  measured_ms  predicted_ms  pred/meas  accepted  expected")
    for rows in sorted(by):
        n, f, pr, a, e = by[rows]
        print(f"{rows:5d} {n:6d} {1e3*f/n:11.2f} {1e3*pr/n:12.2f} {pr/f:9.2f} {a/n:9.2f} {e/n:9.2f}")
    print("curve", engine.costs.as_dict())
