import sys, time, torch
from specfree import Engine
from specfree.batching import EXACT_CHUNK
prec = sys.argv[1]
e = Engine.from_pretrained("smollm2", "autoregressive", precision=prec, compile=False)
a = e.adapter
print(a.linears, e.reuse_off)
g = torch.Generator().manual_seed(0)
ids = torch.randint(100, a.vocab_size - 100, (int(sys.argv[2]),), generator=g)
def one():
    a.reset(); t = time.perf_counter(); a.prefill(ids); return time.perf_counter() - t
def chunked():
    a.reset(); t = time.perf_counter()
    for at in range(0, len(ids), EXACT_CHUNK):
        a.prefill(ids[at:at + EXACT_CHUNK])
    return time.perf_counter() - t
one(); chunked()
res = {"one": [], "chunked": []}
for r in range(int(sys.argv[3])):
    res["one"].append(one()); res["chunked"].append(chunked())
for k, v in res.items():
    print(k, [round(len(ids)/x, 1) for x in v], "tok/s min-time", round(len(ids) / min(v), 1), "median", round(len(ids) / sorted(v)[len(v)//2], 1))
print("ratio chunked/one (best times)", round(min(res["one"]) / min(res["chunked"]), 3))
