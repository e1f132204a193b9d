"""Decode tok/s of one system on 20 Spec-Bench prompts the bench does not pick (questions 5-8 of
translation, rag, qa, summarization and math_reasoning), compiled, 2 threads; overrides after LABEL:

    python docs/bench/run_ce/held_out_categories.py hybrid strategy=hybrid
"""
import json, sys
from specfree import Engine
label = sys.argv[1]; overrides = sys.argv[2:]
qs = [json.loads(l) for l in open("../shared/bench/spec_bench_questions.jsonl")]
from collections import defaultdict
by = defaultdict(list)
for q in qs: by[q["category"]].append(q)
prompts = [q["turns"][0] for c in ("translation", "rag", "qa", "summarization", "math_reasoning") for q in by[c][4:8]]
engine = Engine.from_config(overrides=["threads=2", "compile=true", *overrides])
engine.generate(prompts[0], max_new_tokens=32)
tokens = decode = 0.0; rows = steps = 0; draft = 0.0; other = 0.0
for p in prompts:
    g = engine.generate(p, max_new_tokens=128)
    tokens += len(g.tokens); decode += g.wall_s - g.prefill_s
    for s in g.steps:
        rows += s.rows; steps += 1; draft += s.draft_s; other += s.mask_s + s.verify_s + s.other_s
print(json.dumps({"system": label, "decode_tok_s": round(tokens / decode, 1), "rows_per_step": round(rows / steps, 2),
                  "tokens_per_step": round(tokens / steps, 3), "draft_ms": round(1e3 * draft / steps, 3), "other_ms": round(1e3 * other / steps, 3)}), flush=True)
