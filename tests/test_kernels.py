"""specfree's few-row linear kernel (specfree/kernels): against torch.matmul in float64 over odd
shapes, every code path this CPU has, fp32 and bf16 weights, 1 and 2 threads; each output row the
same bits whatever the row count; the library fallback; the layers swapped in and out."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from specfree.adapters.hf import HFAdapter
from specfree.errors import ConfigError
from specfree.kernels import (UnpackedLinear, find_compiler, library_linears, linear_path, load_kernels, prepare_linears,
                              stock_linears, unpacked_linear)
from tests.tiny_models import tiny_model

ISA = load_kernels(progress=False)
pytestmark = pytest.mark.skipif(ISA is None, reason="the kernel cannot be built or run on this machine")
# Every code path this CPU can run: AVX-512 machines run the AVX2 path too.
ISAS = ["avx2", "avx512"] if ISA == "avx512" else ["avx2"]


@contextlib.contextmanager
def num_threads(threads: int):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def reference(x, weight, bias):
    """The product in float64 from the same (rounded) inputs the kernel sees."""
    out = x.double() @ weight.double().T
    return out if bias is None else out + bias.double()


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 16), k=st.integers(1, 300), n=st.integers(1, 150), with_bias=st.booleans(),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), isa=st.sampled_from(ISAS), seed=st.integers(0, 99))
@pytest.mark.parametrize("threads", [1, 2])
def test_the_kernel_equals_matmul_in_float64(threads, rows, k, n, with_bias, dtype, isa, seed):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=generator)
    weight = torch.randn(n, k, generator=generator).to(dtype)
    bias = torch.randn(n, generator=generator).to(dtype) if with_bias else None
    with num_threads(threads):
        out = unpacked_linear(x, weight, bias, isa)
    assert out.shape == (rows, n) and out.dtype == torch.float32
    expected = reference(x, weight, bias)
    # fp32 accumulation over k terms of size ~|x||w|: the error grows like sqrt(k) * eps * scale
    tolerance = 1e-5 * (k ** 0.5) * (x.abs().max().item() * weight.float().abs().max().item() + 1)
    assert (out.double() - expected).abs().max().item() <= tolerance


@settings(max_examples=25, deadline=None)
@given(k=st.integers(1, 200), n=st.integers(1, 100), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       isa=st.sampled_from(ISAS), seed=st.integers(0, 99))
@pytest.mark.parametrize("threads", [1, 2])
def test_each_row_has_the_same_bits_whatever_the_row_count(threads, k, n, dtype, isa, seed):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(16, k, generator=generator)
    weight = torch.randn(n, k, generator=generator).to(dtype)
    bias = torch.randn(n, generator=generator).to(dtype)
    with num_threads(threads):
        alone = torch.stack([unpacked_linear(x[i : i + 1], weight, bias, isa)[0] for i in range(16)])
        for rows in range(1, 17):
            assert torch.equal(unpacked_linear(x[:rows], weight, bias, isa), alone[:rows]), rows


def test_thread_counts_give_the_same_bits():
    x, weight = torch.randn(5, 300), torch.randn(200, 300)
    with num_threads(1):
        one = unpacked_linear(x, weight)
    with num_threads(2):
        assert torch.equal(unpacked_linear(x, weight), one)


def test_more_rows_than_the_kernel_takes_go_to_the_library_gemm():
    x, weight, bias = torch.randn(3, 40, 24), torch.randn(10, 24), torch.randn(10)  # 120 rows, batched shape
    out = unpacked_linear(x, weight, bias)
    assert out.shape == (3, 40, 10)
    torch.testing.assert_close(out, F.linear(x, weight, bias))


def test_bf16_activations_come_back_in_bf16():
    x, weight = torch.randn(2, 64).bfloat16(), torch.randn(8, 64).bfloat16()
    out = unpacked_linear(x, weight)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), reference(x, weight, None).float(), rtol=1e-2, atol=1e-2)


def test_bad_inputs_are_refused_by_the_op_with_a_message():
    with pytest.raises(RuntimeError, match="do not multiply"):
        unpacked_linear(torch.randn(2, 5), torch.randn(3, 4))
    with pytest.raises(RuntimeError, match="isa must be auto, avx2 or avx512"):
        unpacked_linear(torch.randn(2, 4), torch.randn(3, 4), None, "sse")


def test_layers_swap_in_share_the_parameters_and_swap_back():
    model = tiny_model("llama", seed=3)
    linears = {name: m.weight for name, m in model.named_modules() if type(m) is nn.Linear}
    try:
        assert prepare_linears(model, pack=False) == len(linears) and linear_path(model) == f"few_row-unpacked-{ISA}"
        for name, module in model.named_modules():
            if name in linears:
                assert isinstance(module, UnpackedLinear) and module.weight is linears[name]  # shared, not copied
        with stock_linears(model):
            assert linear_path(model) == "library"
        assert linear_path(model) == f"few_row-unpacked-{ISA}"
    finally:
        assert library_linears(model) == len(linears)
    assert all(type(m) is not UnpackedLinear for m in model.modules())


def test_the_library_fallback_is_a_constructor_parameter():
    model = tiny_model("llama", seed=4)
    adapter = HFAdapter(model, check_tree_mask=False, linear_kernel="library")
    assert adapter.kernel_linears == 0 and linear_path(model) == "library"
    with pytest.raises(ConfigError, match="linear_kernel must be one of few_row, few_row_fp32, library"):
        HFAdapter(model, check_tree_mask=False, linear_kernel="mkl")


def test_where_a_forward_keeps_batch_invariance():
    """Each row of a step of several rows against the same row run alone over the same cache.
    The embedding, the norms and the linear layers (the kernel) give the same bits; so does
    specfree's tree attention (the adapter's default; torch's SDPA promises nothing of the kind),
    and then so do the logits (tests/test_tree_attention.py checks trees and many families)."""
    model = tiny_model("llama", seed=5)
    adapter = HFAdapter(model, check_tree_mask=False)
    layer = model.model.layers[0]
    watched = {"input_layernorm": layer.input_layernorm, "q_proj": layer.self_attn.q_proj,
               "v_proj": layer.self_attn.v_proj, "o_proj": layer.self_attn.o_proj}
    seen: dict[str, list[torch.Tensor]] = {name: [] for name in watched}
    handles = [module.register_forward_hook(lambda m, i, o, name=name: seen[name].append(o.detach().clone()))
               for name, module in watched.items()]
    prefix, rows = torch.tensor([5, 9, 11, 13]), torch.tensor([20, 21, 22, 23])
    try:
        adapter.prefill(prefix)
        for values in seen.values():
            values.clear()
        chain = adapter.forward(rows)  # 4 causal rows in one step
        adapter.reset()
        adapter.prefill(prefix)
        for values in seen.values():
            del values[1:]  # the second prefill's
        alone = []
        for token in rows.tolist():  # the same rows one step each
            alone.append(adapter.forward(torch.tensor([token]))[0])
            adapter.commit([0], rows=1)
    finally:
        for handle in handles:
            handle.remove()
    for name in ("input_layernorm", "q_proj", "v_proj", "o_proj"):
        steps = seen[name][1:]  # [0]: the four-row step
        assert torch.equal(torch.cat(steps, dim=1), seen[name][0]), name
    assert torch.equal(torch.stack(alone), chain)


def test_without_a_compiler_one_warning_and_the_library_path(tmp_path):
    """A fresh process with no C++ compiler on its PATH and no kernel built: one warning, torch's
    F.linear, and the same greedy tokens as transformers."""
    script = (
        "import warnings, sys\n"
        "from specfree.kernels import load_kernels, linear_path\n"
        "from specfree.adapters.hf import HFAdapter\n"
        "from specfree import Engine\n"
        "from specfree.plugins import build_plugin_manager, registry\n"
        "from tests.tiny_models import tiny_model, reference_greedy\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        f"    adapter = HFAdapter(tiny_model('llama'), cache_dir={str(tmp_path)!r})\n"
        "messages = [str(w.message) for w in caught if 'few-row linear kernel' in str(w.message)]\n"
        "assert len(messages) == 1 and 'no C++ compiler found' in messages[0], messages\n"
        "assert adapter.kernel_linears == 0 and linear_path(adapter.model) == 'library'\n"
        "engine = Engine(adapter, registry(build_plugin_manager()).make('strategy', 'prompt_lookup'))\n"
        "prompt = [3, 4, 5] * 4\n"
        "assert engine.generate(prompt, 16).tokens == reference_greedy(tiny_model('llama'), prompt, 16)\n"
        "print('ok')\n")
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=root,
                         env={**os.environ, "PATH": str(tmp_path), "PYTHONPATH": str(root)})
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stderr[-2000:]
    assert not list(tmp_path.rglob("*.so"))  # nothing half-built left behind


needs_compiler = pytest.mark.skipif(find_compiler() is None, reason="no C++ compiler here")


@needs_compiler
def test_the_sources_compile_side_by_side_into_one_library(tmp_path):
    import ctypes

    from specfree import kernels

    sources = []
    for name, value in (("a", 1), ("b", 2), ("c", 3)):
        sources.append(tmp_path / f"{name}.cpp")
        sources[-1].write_text(f'extern "C" int specfree_test_{name}() {{ return {value}; }}\n')
    library = kernels.build._build(tmp_path / "build", progress=False, sources=tuple(sources))
    loaded = ctypes.CDLL(str(library))
    assert [loaded.specfree_test_a(), loaded.specfree_test_b(), loaded.specfree_test_c()] == [1, 2, 3]
    assert [p.name for p in (tmp_path / "build").iterdir()] == [kernels.LIBRARY]  # no objects left


@needs_compiler
def test_a_source_that_does_not_compile_names_its_error_and_leaves_nothing(tmp_path):
    from specfree import kernels

    good, broken = tmp_path / "good.cpp", tmp_path / "broken.cpp"
    good.write_text("int specfree_good() { return 1; }\n")
    broken.write_text("int specfree_broken() { return undeclared_name; }\n")
    with pytest.raises(RuntimeError, match="failed: .*undeclared_name"):
        kernels.build._build(tmp_path / "build", progress=False, sources=(good, broken))
    assert list((tmp_path / "build").iterdir()) == []


def test_a_model_with_no_cpu_linear_never_asks_for_the_kernel():
    """A GPU model (here a float16 one, which the kernel does not take either) keeps nn.Linear, in a
    fresh process where the kernel was never loaded (the GPU path once failed there on best_isa)."""
    import subprocess
    import sys

    code = ("import torch, transformers; from specfree.kernels import prepare_linears; "
            "from tests.tiny_models import CONFIGS; "
            "m = transformers.AutoModelForCausalLM.from_config(CONFIGS['llama']()).to(torch.float16); "
            "print(prepare_linears(m))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[-1] == "0"


def test_swapping_a_model_again_keeps_the_kernel_layers():
    """A second adapter over the same model (``generate()`` builds one per call) finds nothing left
    to swap and must leave the first one's kernel layers in place, not turn them back."""
    import transformers

    from specfree.kernels import PanelLinear, prepare_linears
    from tests.tiny_models import CONFIGS

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(CONFIGS["llama"]())
    if load_kernels(progress=False) is None:
        pytest.skip("the kernel cannot be built here")
    first = prepare_linears(model)
    assert first > 0 and prepare_linears(model) == first
    assert sum(isinstance(m, (UnpackedLinear, PanelLinear)) for m in model.modules()) == first
