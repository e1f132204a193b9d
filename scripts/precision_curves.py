"""Both precisions' row curves on SmolLM2's Q4_1 file, and what ``precision=auto`` chooses here
(issue 77; docs/bench/history.md, "precision=auto by a probe").

Prints, as JSON: the eager forward's ms at 1-16 rows after 256 tokens of context, exact and int8
(two models, timed in turns, best of the rounds); the 211 coded layers alone at each precision on
every ISA path this CPU runs, in turns (``kernels.passes``, the passes bench's linear curves time); and the
probe's times, its decision and how long it took, without a cache (``kernels.precision``).

    PYTHONPATH=. .venv/bin/python scripts/precision_curves.py [--rounds 5] [--threads 2] [--no-forward]

The forward runs the process's path; for the avx2 path on an AVX-512 machine, run it under
``scripts/avx2_only.py``: ``PYTHONPATH=.:scripts .venv/bin/python -c "import avx2_only, runpy, sys;
sys.argv[1:] = ['--rounds', '5']; runpy.run_path('scripts/precision_curves.py', run_name='__main__')"``.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from specfree.adapters.hf import HFAdapter
from specfree.cost import _time_sizes
from specfree.kernels import load_kernels
from specfree.kernels.codes import CodedLinear
from specfree.kernels.passes import best_ms, coded_passes, held_layers
from specfree.kernels.precision import decide, probe_precisions
from specfree.loading import load_model
from specfree.runinfo import cpu_name

ROWS = (1, 2, 4, 8, 16)
CONTEXT = 256


def forward_curves(rounds: int) -> dict[str, dict[int, float]]:
    adapters = {}
    for precision in ("exact", "int8"):
        model, _ = load_model("smollm2")
        adapters[precision] = HFAdapter(model, precision=precision)
    best = {p: {r: float("inf") for r in ROWS} for p in adapters}
    with torch.no_grad():
        for _ in range(rounds):  # the precisions take turns, so a slow spell slows both
            for precision, adapter in adapters.items():
                for rows, seconds in zip(ROWS, _time_sizes(adapter, CONTEXT, list(ROWS), repeats=2)):
                    best[precision][rows] = min(best[precision][rows], round(1e3 * seconds, 2))
    return best


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-forward", action="store_true", help="the coded layers and the probe only")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    isa = load_kernels(progress=False)
    model, _ = load_model("smollm2")
    start = time.perf_counter()
    probe = probe_precisions(model)
    probe_s = time.perf_counter() - start
    out = {"cpu": cpu_name(), "isa": isa, "threads": args.threads,
           "probe": {"ms": probe, "seconds": round(probe_s, 2), "choice": decide(probe, "probe").__dict__},
           "forward_ms": None if args.no_forward else forward_curves(args.rounds),
           "coded_layers_ms": coded_layers_on_every_path(model, isa, 4 * args.rounds)}
    print(json.dumps(out, indent=1))


def coded_layers_on_every_path(model, isa: str, rounds: int) -> dict[str, dict[int, float]]:
    """ms of one pass over every coded layer, by precision and path (each path's own panel width:
    the codes found again for the other), all of them in turns in the same rounds."""
    from specfree.kernels.codes import find_codes
    from specfree.kernels.panels import LANES

    modules = [m for m in model.modules() if isinstance(m, CodedLinear)]
    passes = {}
    for path in (["avx2", "avx512"] if isa == "avx512" else [isa]):
        held = held_layers(modules) if path == isa else \
            [(find_codes(m.rows(), LANES[path]), None, m.bias, m.out_features, m.in_features) for m in modules]
        passes.update({f"{precision}, {path}": per_rows for precision, per_rows in coded_passes(held, ROWS, path).items()})
    return best_ms(passes, ROWS, rounds)


if __name__ == "__main__":
    main()
