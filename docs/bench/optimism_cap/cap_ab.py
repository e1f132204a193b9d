"""Decode tok/s of STRATEGY on 24 Spec-Bench prompts with the correction capped at OPT (counts the curve
has no point for) and TIMED (counts it has) per extra row; ran on a trial Correction (see README.md):

    python docs/bench/optimism_cap/cap_ab.py STRATEGY OPT TIMED LABEL
"""
import json, sys
from specfree import Engine
from specfree.cost import Correction
strategy, opt, timed, label = sys.argv[1], float(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
qs = [json.loads(l) for l in open("../shared/bench/spec_bench_questions.jsonl")]
prompts = [q["turns"][0] for q in qs[::3][:24]]
engine = Engine.from_config(overrides=[f"strategy={strategy}", "threads=2", "compile=true"])
engine.pricer.correction = Correction(optimism=opt, timed_optimism=timed)
engine.generate(prompts[0], max_new_tokens=32)
tokens = decode = 0.0; rows = steps = 0; fwd = pred = 0.0
for p in prompts:
    g = engine.generate(p, max_new_tokens=128)
    tokens += len(g.tokens); decode += g.wall_s - g.prefill_s
    for s in g.steps:
        rows += s.rows; steps += 1
        if s.predicted_s: fwd += s.forward_s; pred += s.predicted_s
print(json.dumps({"curve": label, "strategy": strategy, "optimism": opt, "timed": timed, "decode_tok_s": round(tokens / decode, 1),
                  "rows_per_step": round(rows / steps, 2), "tokens_per_step": round(tokens / steps, 3), "pred_over_meas": round(pred / fwd, 3)}), flush=True)
