"""precision=int8 (panel_linear.cpp's ``SPECFREE_INT8``, ``kernels.codes.PRECISIONS``): a quantized
file's codes against 8-bit activations. Each row is quantized alone (checked against numpy's
reading of the rule), the op equals the same int8 arithmetic computed in float64, and a row's bits
are its own: whatever the other rows of the call, on AVX2, AVX-512 and AVX-512 without VNNI alike.
Tiny GGUF Llamas decode losslessly at int8 under every strategy, their verify rows bit-equal to
the one-row forward; the setting reaches the layers from ``Engine`` and the config."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T
from hypothesis import given, settings
from hypothesis import strategies as st

from specfree import Engine
from specfree.adapters.hf import HFAdapter
from specfree.errors import ConfigError
from specfree.kernels import LinearPath, linear_kind, linear_path, load_kernels, resolve_precision, set_precision
from specfree.kernels.codes import CodedLinear, from_blocks
from specfree.kernels.gguf_blocks import GGUF_TYPES, block_codes
from specfree.kernels.panels import LANES, pack
from specfree.loading import load_model
from specfree.settings import DEFAULTS, EngineSettings
from tests import tiny_models
from tests.test_gguf import PROMPT, STRATEGIES, random_blocks, tiny_file
from tests.test_tree_attention import CONTEXT, CONTINUATION, chain_and_tree_against_one_row

ISA = load_kernels(progress=False)
pytestmark = pytest.mark.skipif(ISA is None, reason="the kernel cannot be built or run on this machine")
# every code path of the int8 sums this CPU has: AVX2's maddubs, AVX-512's with and without VNNI
PATHS = ["avx2", "avx512", "avx512_novnni"] if ISA == "avx512" else ["avx2"]


def at(cache_dir, precision: str = "auto") -> EngineSettings:
    """The settings of an adapter at ``precision`` that caches under ``cache_dir``."""
    return DEFAULTS.changed(precision=precision, cache_dir=cache_dir)


def lanes(path: str) -> int:
    return LANES["avx2" if path == "avx2" else "avx512"]


def numpy_quantize(x: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
    """The rule, in numpy's float32: per block d = amax / 127, q = x / d rounded half to even,
    within +-127 (0 where d is 0)."""
    rows, k = x.shape
    blocks = x.astype(np.float32).reshape(rows, k // block, block)
    d = (np.abs(blocks).max(-1) / np.float32(127)).astype(np.float32)
    safe = np.where(d > 0, d, np.float32(1))[..., None]
    with np.errstate(over="ignore"):
        q = np.where(d[..., None] > 0, np.rint(blocks / safe), 0).clip(-127, 127)
    return q.astype(np.int8).reshape(rows, k), d


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 20), blocks=st.integers(1, 6), block=st.sampled_from([16, 32]),
       exponent=st.integers(-140, 100), seed=st.integers(0, 10**6))
def test_each_row_is_quantized_as_numpy_reads_the_rule(rows, blocks, block, exponent, seed):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((rows, block * blocks)) * 2.0 ** exponent).astype(np.float32)
    x[0, :block] = 0  # a block of zeros: d = 0, codes 0
    q, d = torch.ops.specfree.quantize_int8(torch.from_numpy(x), block)
    expected_q, expected_d = numpy_quantize(x, block)
    assert np.array_equal(d.numpy().view(np.uint32), expected_d.view(np.uint32))
    assert np.array_equal(q.numpy(), expected_q)


def test_ties_round_to_even_and_a_subnormal_scale_stays_within_127():
    x = np.zeros((3, 32), np.float32)
    x[0, :6] = [127, 2.5, 3.5, -2.5, -0.5, 1.5]  # d = 1: x / d ends in .5 exactly
    x[1, 0] = 1.4 * 127 * 2.0 ** -149  # d rounds to the smallest subnormal: x / d = 178 before clamping
    x[1, 1] = -x[1, 0]
    x[2] = np.linspace(-1, 1, 32, dtype=np.float32)
    q, d = torch.ops.specfree.quantize_int8(torch.from_numpy(x), 32)
    assert q[0, :6].tolist() == [127, 2, 4, -2, 0, 2] and d[0, 0].item() == 1.0
    assert q[1, :2].tolist() == [127, -127]
    expected_q, expected_d = numpy_quantize(x, 32)
    assert np.array_equal(q.numpy(), expected_q) and np.array_equal(d.numpy(), expected_d)


def int8_reference(x: torch.Tensor, codes, bias: torch.Tensor | None) -> torch.Tensor:
    """float64 sum over k of (x's code * its scale) * (w's code * its scale + its offset), + bias:
    the arithmetic precision=int8 rounds to float32 once per block."""
    q, d = numpy_quantize(x.numpy(), codes.block)
    xd = torch.from_numpy(q.astype(np.float64) * np.repeat(d.astype(np.float64), codes.block, axis=1))
    wq = torch.from_numpy(codes.q.astype(np.float64))
    wd = torch.from_numpy(np.repeat(codes.d.astype(np.float64), codes.block, axis=1))
    wm = 0 if codes.m is None else torch.from_numpy(np.repeat(codes.m.astype(np.float64), codes.block, axis=1))
    out = xd @ (wq * wd + wm).T
    # what each float32 rounding is relative to: every term's magnitude, the code and offset apart
    size = xd.abs() @ (wq * wd).abs().T + (xd.abs() @ torch.as_tensor(wm).abs().T if codes.m is not None else 0)
    if bias is not None:
        out, size = out + bias.double(), size + bias.double().abs()
    return out, size


@settings(max_examples=40, deadline=None)
@given(qtype=st.sampled_from(sorted(GGUF_TYPES)), rows=st.integers(1, 64), n=st.integers(1, 70),
       blocks=st.integers(1, 2), with_bias=st.booleans(), seed=st.integers(0, 10**6))
def test_the_int8_op_is_its_arithmetic_in_float64_the_same_bits_on_every_path(qtype, rows, n, blocks, with_bias,
                                                                                seed):
    """Every GGUF type (affine4, affine8, scaled8; float16 scales and K-types' 8-bit sub-scales,
    blocks of 16 and 32), odd shapes (a short last panel), 1-64 rows."""
    block, _ = GGML_QUANT_SIZES[qtype]
    k = block * blocks
    codes = block_codes(random_blocks(qtype, n, blocks, seed), qtype, n, k)
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=generator) * torch.rand(rows, 1, generator=generator) * 4
    bias = torch.randn(n, generator=generator) if with_bias else None
    outs = {path: from_blocks(codes, lanes(path)).linear(x, bias, n, path, "int8") for path in PATHS}
    out = outs[PATHS[-1]]
    assert all(torch.equal(o, out) for o in outs.values()), "the paths' bits differ"
    expected, size = int8_reference(x, codes, bias)
    rounding = (2 * (k // codes.block) + 4) * 2.0 ** -24  # two roundings a block, the scale product, the bias
    assert ((out.double() - expected).abs() <= rounding * size + 1e-30).all()
    for path in PATHS:  # precision=exact: the float32 panels' bits, on every path
        exact = from_blocks(codes, lanes(path)).linear(x, bias, n, path)
        panels = pack(torch.from_numpy(codes.values()), lanes(path))
        assert torch.equal(exact, torch.ops.specfree.panel_linear(x, panels, bias, n, path.removesuffix("_novnni")))


@settings(max_examples=12, deadline=None)
@given(qtype=st.sampled_from([T.Q4_1, T.Q8_0, T.Q5_1, T.Q6_K]), rows=st.integers(2, 16), seed=st.integers(0, 10**6))
def test_a_rows_bits_are_its_own_whatever_else_is_in_the_call(qtype, rows, seed):
    block, _ = GGML_QUANT_SIZES[qtype]
    n, k = 45, block * (2 if block == 32 else 1)
    codes = block_codes(random_blocks(qtype, n, k // block, seed), qtype, n, k)
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=generator)
    others = torch.randn(90, k, generator=generator) * 1000  # many groups of rows
    for path in PATHS:
        coded = from_blocks(codes, lanes(path))
        out = coded.linear(x, None, n, path, "int8")
        for r in range(rows):
            assert torch.equal(coded.linear(x[r:r + 1], None, n, path, "int8")[0], out[r])
        order = torch.randperm(rows, generator=generator)
        assert torch.equal(coded.linear(x[order], None, n, path, "int8"), out[order])
        mixed = torch.cat([others[:37], x, others[37:]])
        assert torch.equal(coded.linear(mixed, None, n, path, "int8")[37:37 + rows], out)


@pytest.mark.parametrize("qtype, code", [(T.Q4_1, 15), (T.Q8_0, -128), (T.Q8_0, 127), (T.Q5_1, 31)])
def test_the_largest_sums_a_block_can_hold_are_exact(qtype, code):
    """Every code at its extreme against activation codes of 127 of its sign: AVX2 sums a 4-bit
    block in 16 bits and a signed pair through vpsignb, so these are the sums nearest overflow."""
    block, _ = GGML_QUANT_SIZES[qtype]
    n, k = 9, 2 * block
    codes = block_codes(random_blocks(qtype, n, 2, 0), qtype, n, k)
    codes = dataclasses.replace(codes, q=np.full_like(codes.q, code))
    x = torch.full((3, k), -1.0 if code < 0 else 1.0)
    x[1] *= 3.0
    x[2, ::2] = 0.0
    expected, size = int8_reference(x, codes, None)
    rounding = (2 * (k // codes.block) + 4) * 2.0 ** -24  # as the float64 test above: 8 roundings here
    for path in PATHS:
        out = from_blocks(codes, lanes(path)).linear(x, None, n, path, "int8")
        assert ((out.double() - expected).abs() <= rounding * size).all(), path


def test_an_unknown_precision_is_refused():
    codes = block_codes(random_blocks(T.Q4_0, 8, 1, 0), T.Q4_0, 8, 32)
    with pytest.raises(RuntimeError, match="precision must be exact or int8, not int4"):
        from_blocks(codes, lanes(PATHS[0])).linear(torch.randn(1, 32), None, 8, PATHS[0], "int4")
    with pytest.raises(ConfigError, match="precision must be one of auto, exact, int8, not 'fp8'"):
        set_precision(torch.nn.Linear(2, 2), dataclasses.replace(DEFAULTS, precision="fp8"))


# ---- models ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def gguf_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("gguf-int8")


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K, T.Q5_1], ids=lambda t: t.name)
def test_every_strategy_is_lossless_at_int8_and_every_verify_row_equals_the_one_row_forward(qtype, gguf_dir,
                                                                                             tmp_path):
    path = tiny_file(gguf_dir, qtype)
    model, _ = load_model(str(path), cache_dir=tmp_path)
    plain = Engine.from_model(model, None, "autoregressive", precision="int8")
    assert linear_path(model) == f"few_row-coded-int8-{ISA}"
    assert linear_kind(model) == LinearPath("coded", ISA, int8="all")
    assert plain.adapter.path()["precision"] == "int8"
    assert all(m.precision == "int8" for m in model.modules() if isinstance(m, CodedLinear))
    expected = plain.generate(PROMPT, 12, ignore_eos=True).tokens
    for strategy in STRATEGIES:
        knobs = {"draft_tree_capacity": 16} if strategy == "logit_spec" else {}
        engine = Engine.from_model(model, None, strategy, precision="int8", **knobs)
        assert engine.generate(PROMPT, 12, ignore_eos=True).tokens == expected, strategy
    sampling = dict(do_sample=True, seed=5, temperature=0.8, precision="int8")
    sampled = Engine.from_model(model, None, "hybrid", **sampling).generate(PROMPT, 12, ignore_eos=True).tokens
    assert sampled == Engine.from_model(model, None, "autoregressive", **sampling).generate(
        PROMPT, 12, ignore_eos=True).tokens
    adapter = HFAdapter(model, check_tree_mask=False, precision="int8")
    chain, tree, alone = chain_and_tree_against_one_row(adapter, CONTEXT, CONTINUATION)
    assert torch.equal(chain, alone) and torch.equal(tree, alone)
    exact = HFAdapter(model, check_tree_mask=False, precision="exact")  # the same model at exact: other logits
    assert linear_path(model) == f"few_row-coded-{ISA}" and exact.path()["precision"] == "exact"
    _, _, exact_alone = chain_and_tree_against_one_row(exact, CONTEXT, CONTINUATION)
    assert not torch.equal(exact_alone, alone)
    # near: the same model, its activations rounded to 8 bits (a random one amplifies that most in Q6_K)
    assert torch.nn.functional.cosine_similarity(alone, exact_alone, dim=-1).min() > 0.9


def test_auto_runs_a_gguf_files_codes_at_int8_where_faster_and_float_weights_exact(gguf_dir, tmp_path):
    """The default: a model read from a quantized GGUF file gets the arithmetic llama.cpp's users get
    from it where the probe finds it faster here (its times injected: tests/test_precision.py);
    float weights that merely are some format's codes (found by the search) stay exact."""
    from specfree.kernels.precision import choose_precision

    from_file, _ = load_model(str(tiny_file(gguf_dir, T.Q4_0)), cache_dir=tmp_path)
    choose_precision(from_file, at(tmp_path), lambda model: {"exact": {1: 2.0, 8: 4.0}, "int8": {1: 1.0, 8: 2.0}})
    rounded = tiny_models.tiny_model.__wrapped__("llama_gguf")
    assert DEFAULTS.precision == "auto"
    for model, expected in ((from_file, "int8"), (rounded, "exact")):
        adapter = HFAdapter(model, check_tree_mask=False, cache_dir=tmp_path)
        coded = [m for m in model.modules() if isinstance(m, CodedLinear)]
        assert coded and {m.precision for m in coded} == {expected} and adapter.path()["precision"] == expected
        assert resolve_precision(model, at(tmp_path)) == expected
        assert resolve_precision(model, at(None, "exact")) == "exact"


def test_precision_reaches_the_layers_from_the_config_and_is_recorded(gguf_dir):
    path = tiny_file(gguf_dir, T.Q4_1)
    engine = Engine.from_config(overrides=["model=local", f"model.path={path}", "strategy=autoregressive",
                                           "compile=false", "precision=int8"])
    coded = [m for m in engine.adapter.model.modules() if isinstance(m, CodedLinear)]
    assert coded and all(m.precision == "int8" for m in coded)
    assert engine.adapter.path()["linear_kernel"] == f"few_row-coded-int8-{ISA}"
    assert "precision=int8" in repr(coded[0])
    with pytest.raises(ConfigError, match="precision must be one of auto, exact, int8"):
        Engine.from_config(overrides=["model=local", f"model.path={path}", "compile=false", "precision=int4"])


@pytest.mark.slow  # an AOTInductor package of its own: 60 s on the 2-core AMD EPYC Zen 4 VM
@pytest.mark.skipif(tiny_models.DEVICE != "cpu", reason="AOTInductor packages are the CPU path")
def test_a_compiled_int8_step_decodes_as_the_eager_one_in_a_package_of_its_own(tmp_path):
    """The op's precision is traced into the package (its logits are the eager int8 forward's bit
    for bit, adapters/pinned.py), keyed apart from an exact package; verify rows equal the compiled
    one-row step bit for bit, so speculation is lossless on it."""
    from specfree.adapters.compiled import make_adapter
    from specfree.plugins import build_plugin_manager, registry

    knobs = dict(cache_dir=tmp_path, max_autotune=False, progress=False, buckets=(1, 8))
    compiled = make_adapter(tiny_models.tiny_model.__wrapped__("llama_gguf"), compile="true", precision="int8", **knobs)
    assert compiled.compiled and compiled.linears == f"few_row-coded-int8-{ISA}", compiled.failure
    chain, tree, alone = chain_and_tree_against_one_row(compiled, CONTEXT, CONTINUATION)
    assert torch.equal(chain, alone) and torch.equal(tree, alone)
    eager = {precision: chain_and_tree_against_one_row(HFAdapter(tiny_models.tiny_model.__wrapped__("llama_gguf"),
                                                                 check_tree_mask=False, precision=precision),
                                                       CONTEXT, CONTINUATION)[2] for precision in ("int8", "exact")}
    assert torch.equal(alone, eager["int8"]) and not torch.equal(alone, eager["exact"])
    reg = registry(build_plugin_manager())
    prompt = [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6]
    tokens = {name: Engine(compiled, reg.make("strategy", name)).generate(prompt, 16, ignore_eos=True).tokens
              for name in ("autoregressive", "prompt_lookup")}
    assert tokens["prompt_lookup"] == tokens["autoregressive"]
    exact = make_adapter(tiny_models.tiny_model.__wrapped__("llama_gguf"), compile="auto", **knobs)
    assert not exact.compiled and exact.linears == f"few_row-coded-{ISA}"  # the int8 package is not its
