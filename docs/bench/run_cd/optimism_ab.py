"""Decode tok/s of a strategy on 24 Spec-Bench prompts with the pricer's curve correction
(``cost.Correction``) at the given ``optimism``, its other knobs at their defaults, for an A/B of that
knob alone:

    python docs/bench/run_cd/optimism_ab.py OPTIMISM [STRATEGY]
"""
import json, sys
from specfree import Engine
from specfree.cost import Correction
optimism = float(sys.argv[1]); strategy = sys.argv[2] if len(sys.argv) > 2 else "hybrid"
qs = [json.loads(l) for l in open("/work/shared/bench/spec_bench_questions.jsonl")]
prompts = [q["turns"][0] for q in qs[::3][:24]]
engine = Engine.from_config(overrides=[f"strategy={strategy}", "threads=2", "compile=true"])
engine.pricer.correction = Correction(optimism=optimism)  # before any step has taught the engine's own
engine.generate(prompts[0], max_new_tokens=32)
tokens = decode = 0.0; rows = steps = 0; big = [0, 0.0, 0.0]
for p in prompts:
    g = engine.generate(p, max_new_tokens=128)
    tokens += len(g.tokens); decode += g.wall_s - g.prefill_s
    for s in g.steps:
        rows += s.rows; steps += 1
        if s.rows >= 5 and s.predicted_s: big[0] += 1; big[1] += s.forward_s; big[2] += s.predicted_s
print(json.dumps({"optimism": optimism, "strategy": strategy, "decode_tok_s": round(tokens / decode, 1), "rows_per_step": round(rows / steps, 2),
                  "tokens_per_step": round(tokens / steps, 2), "steps_5plus": big[0], "pred_over_meas_5plus": round(big[2] / max(big[1], 1e-9), 2)}))
