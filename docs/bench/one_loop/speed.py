"""Old (a2c1c97, as specfree_old) against new (this worktree) in one process, alternated: tok/s of one request."""
import sys, time, statistics
sys.path.insert(0, "/tmp/i78/old")
import copy
import torch
import specfree, specfree_old
from tests.tiny_models import tiny_model
from tests.test_prompt_cache import conversation

which = sys.argv[1]  # tiny | tiny_compiled | smollm2
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 5
new_tokens = int(sys.argv[3]) if len(sys.argv) > 3 else 48
engines = {}
from importlib import import_module
for name, pkg in (("old", specfree_old), ("new", specfree)):
    # one fixed curve for both: a curve measured on this loaded, shared machine is noise
    curve = import_module(pkg.__name__ + ".cost").CostModel([1, 2, 4, 8, 16, 32], [1.0, 1.2, 1.5, 1.8, 2.0, 2.4])
    if which == "smollm2":
        engines[name] = pkg.Engine.from_pretrained("smollm2", "hybrid", compile=False, costs=curve)
    elif which == "tiny":
        engines[name] = pkg.Engine.from_model(copy.deepcopy(tiny_model("llama")), None, "hybrid", costs=curve)
    else:
        from importlib import import_module
        comp = import_module(pkg.__name__ + ".adapters.compiled")
        plugins = import_module(pkg.__name__ + ".plugins")
        reg = plugins.registry(plugins.build_plugin_manager())
        adapter = comp.compiled_adapter(copy.deepcopy(tiny_model("qwen2")), backend="eager", min_slots=64, buckets=(1, 8))
        engines[name] = pkg.Engine(adapter, reg.make("strategy", "hybrid"), costs=curve)
print({k: (e.adapter.linears, e.adapter.compiled) for k, e in engines.items()})
if which == "smollm2":
    prompts = [engines["new"].encode(p, chat=True) for p in (
        "Write a short poem about the sea.", "Explain what a hash table is, with an example in Python.",
        "List five facts about the moon.")]
else:
    prompts = conversation(5, 3, 60)
outs, times = {"old": [], "new": []}, {"old": [], "new": []}
for r in range(rounds + 1):
    for name in (("old", "new") if r % 2 == 0 else ("new", "old")):
        total_t, total_n, toks = 0.0, 0, []
        for p in prompts:
            t0 = time.perf_counter()
            g = engines[name].generate(p, new_tokens, ignore_eos=True)
            total_t += time.perf_counter() - t0
            total_n += len(g.tokens)
            toks.append(g.tokens)
        if r:  # round 0 warms up
            times[name].append(total_n / total_t)
        outs[name].append(toks)
print("same tokens old/new:", outs["old"] == outs["new"])
for name in times:
    print(name, "tok/s (prefill included, wall) per round", [round(t, 1) for t in times[name]], "median", round(statistics.median(times[name]), 1))
ratios = [n / o for n, o in zip(times["new"], times["old"])]
print("new/old per round", [round(x, 3) for x in ratios], "median", round(statistics.median(ratios), 3))
