"""Run CF's replay: the agent loop's 12 tasks for the systems named, one process, each engine warmed
up first; per system its decode tok/s, tokens and rows a step, the forward's predicted and measured
milliseconds, and at the end the priced and measured cost of each row count at 700 tokens of context.

    cp docs/bench/run_cf/curve_before.json ~/.cache/specfree/costs/<the model's curve>.json
    PYTHONPATH=. python docs/bench/run_cf/hybrid_steps.py hybrid,hybrid[suffix]
"""
import sys, time, json, collections
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[3] / "benchmarks"))
import torch
torch.set_num_threads(2)
from agent_loop_bench import load_tasks, tools_for, run_loop, TASKS
from json_schema_bench import SYSTEMS
from specfree import Engine
names = sys.argv[1].split(",")
tasks = load_tasks(TASKS, 12)
engines = {n: Engine.from_pretrained("smollm2", SYSTEMS[n][0], prompt_cache=True, **SYSTEMS[n][1]) for n in names}
for n, e in engines.items():
    print(n, "curve", [round(x * 1e3, 2) for x in e.costs.seconds] if hasattr(e.costs, "seconds") else e.costs)
steps = {n: [] for n in names}
for n, eng in engines.items():
    orig = eng.generate
    def gen(*a, _o=orig, _n=n, **k):
        r = _o(*a, **k); steps[_n].extend(r.steps); return r
    eng.generate = gen
    run_loop(eng, tasks[0], tools_for(tasks[0], tasks[0]), 1, 4); steps[n].clear()
tot = collections.defaultdict(float)
for i, task in enumerate(tasks):
    tools = tools_for(task, tasks[(i + 1) % len(tasks)])
    for n, eng in engines.items():
        reps = run_loop(eng, task, tools, 3, 96)
        tot[n, "tok"] += sum(r["n_tokens"] for r in reps); tot[n, "s"] += sum(r["decode_s"] for r in reps)
for n in names:
    st = steps[n]; k = len(st)
    pred = [s for s in st if s.predicted_s is not None]
    print(n, f"{tot[n,'tok']/tot[n,'s']:.1f} tok/s steps {k} emitted/step {sum(s.emitted for s in st)/k:.2f} rows {sum(s.rows for s in st)/k:.2f} offered {sum(s.offered for s in st)/k:.2f} "
          f"fwd {sum(s.forward_s for s in st)/k*1e3:.2f} pred {sum(s.predicted_s for s in pred)/max(1,len(pred))*1e3:.2f} expected {sum(s.expected for s in pred)/max(1,len(pred)):.2f} accepted {sum(s.accepted for s in pred)/max(1,len(pred)):.2f} priced {len(pred)}")
    src = collections.Counter(); 
    for s in st: src.update(s.sources)
    print("   sources", dict(src), "rows hist", sorted(collections.Counter(s.rows for s in st).items())[:12])
import numpy as np
for n, e in engines.items():
    c = e.pricer.curve_at(700)
    print(n, "priced at 700:", [round(c(r) * 1e3, 2) for r in (1, 2, 4, 6, 8, 10, 13, 16)], "ratio", {k: round(v, 2) for k, v in sorted(e.pricer.correction.ratio.items())})
    print(n, "raw at 700:", [round(e.pricer.cost.at(700)(r) * 1e3, 2) if hasattr(e.pricer.cost, "at") else None for r in (1, 2, 4, 6, 8, 10, 13, 16)])
    fw = collections.defaultdict(list)
    for s in steps[n]: fw[s.rows].append(s.forward_s)
    print(n, "measured median:", {r: round(float(np.median(v)) * 1e3, 2) for r, v in sorted(fw.items()) if len(v) > 2})
