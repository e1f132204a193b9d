"""A pytest plugin (and script prelude) for development only: run specfree as an AVX2-only CPU
would, on an AVX-512 machine, where no such CPU is at hand (issue 77). It is never imported by
specfree itself.

    PYTHONPATH=.:scripts .venv/bin/python -m pytest -p avx2_only tests/test_codes.py tests/test_int8.py ...

The process's ISA reads "avx2" wherever specfree asks for it (so models are packed and coded in
panels of 8, and ``linear_path`` and the tests' ``ISA`` name avx2), and every op called with
``isa="auto"`` (what the layers call) runs the avx2 path. What it cannot simulate: the C++
refusing the avx512 path (asked for, it runs here: ``test_a_cpu_without_avx512_refuses_its_path``
fails under it), and an AVX2-only CPU's own speed and caches. The avx2 int8 sums never use VNNI
(maddubs, then madd), so that part is as on an AVX2-only CPU.
"""
import torch

import specfree.kernels as kernels
import specfree.kernels.build as build
import specfree.kernels.layers as layers

_real_load = build.load_kernels
# op -> index of its isa argument
ISA_ARG = {"linear": 3, "panel_linear": 4, "coded_linear": 6, "tree_attention": 5, "linear_pass": 4}
_wrapped = False


def _force(op, index):
    def call(*args, **kwargs):
        args = list(args)
        if len(args) > index:
            if args[index] == "auto":
                args[index] = "avx2"
        elif kwargs.get("isa", "auto") == "auto":
            kwargs["isa"] = "avx2"
        return op(*args, **kwargs)
    return call


def _wrap_ops():
    global _wrapped
    if _wrapped or not build.registered():
        return
    namespace = torch.ops.specfree
    for name, index in ISA_ARG.items():
        setattr(namespace, name, _force(getattr(namespace, name), index))
    _wrapped = True


def _avx2_only(*args, **kwargs):
    isa = _real_load(*args, **kwargs)
    _wrap_ops()
    return "avx2" if isa else None


def _process_isa():
    return "avx2"


for module in (kernels, build, layers):
    if hasattr(module, "load_kernels"):
        module.load_kernels = _avx2_only
    module.process_isa = _process_isa
import importlib

for name in ("specfree.kernels.precision", "specfree.kernels.passes", "specfree.bench.linear_curves"):
    try:
        module = importlib.import_module(name)
    except ImportError:
        continue
    for attribute, value in (("load_kernels", _avx2_only), ("process_isa", _process_isa)):
        if hasattr(module, attribute):
            setattr(module, attribute, value)
