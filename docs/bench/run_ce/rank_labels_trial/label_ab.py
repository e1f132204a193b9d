"""The A/B of the rank labels trial (README.md): decode tok/s of the hybrid with prompt lookup's labels as
before (`before`: the trial's /alt suffix stripped) or with the trial's labels (`after`), on 20 held-out
Spec-Bench prompts (`cats`) or 24 MT-Bench ones (`mt`)."""
import json, sys
from collections import defaultdict
from specfree import Engine
from specfree.strategies.prompt_lookup import PromptLookup
from specfree.types import Proposal
import dataclasses
label, which = sys.argv[1], sys.argv[2]
if label == "before":  # one label for every match, as before the change
    propose = PromptLookup.propose
    def one_label(self, context, max_depth):
        p = propose(self, context, max_depth)
        return dataclasses.replace(p, labels=[l.removesuffix("/alt") for l in p.labels]) if p.labels else p
    PromptLookup.propose = one_label
qs = [json.loads(l) for l in open("../shared/bench/spec_bench_questions.jsonl")]
by = defaultdict(list)
for q in qs: by[q["category"]].append(q)
prompts = [q["turns"][0] for c in ("translation", "rag", "qa", "summarization", "math_reasoning") for q in by[c][4:8]] if which == "cats" else [q["turns"][0] for q in qs[::3][:24]]
engine = Engine.from_config(overrides=["threads=2", "compile=true", "strategy=hybrid"])
engine.generate(prompts[0], max_new_tokens=32)
tokens = decode = 0.0; rows = steps = 0
for p in prompts:
    g = engine.generate(p, max_new_tokens=128)
    tokens += len(g.tokens); decode += g.wall_s - g.prefill_s
    for s in g.steps: rows += s.rows; steps += 1
print(json.dumps({"labels": label, "prompts": which, "decode_tok_s": round(tokens / decode, 1), "rows_per_step": round(rows / steps, 2), "tokens_per_step": round(tokens / steps, 3)}), flush=True)
