// specfree::rms_norm, specfree::rotary, specfree::activation -- ATen's own kernels behind ops that
// a compiled step calls as they are.
//
// Inductor generates its own code for the operations it compiles, and for reductions and
// transcendentals that code rounds differently from ATen's kernels: an RMSNorm's sum of squares in
// another order, cos/sin of a rotary table and GELU's erf/tanh from other approximations (measured
// on torch 2.13: 1 ulp on some RMSNorm outputs and rotary entries, GELU on 40% of values). At
// exact precision those last bits rarely change a token; at int8 they move an activation across a
// rounding boundary of its 8-bit code, and the compiled and eager loops chose different tokens on
// most prompts. An op of this library is opaque to Inductor: the compiled step calls these
// functions, which call the ATen kernels the eager step calls, so both compute the same bits.
// Each function is the arithmetic of the transformers layer it stands in for (the Python twins in
// specfree/adapters/pinned.py check that on probes before swapping a layer).
//
// specfree::rms_norm_rows is the one function here of specfree's own: an RMSNorm in one fixed order
// per row, for models whose coded layers run int8 (their output is not transformers' anyway).
// ATen composes RMSNorm of about ten ops, each a trip through the dispatcher: 12 us a call on the
// 2-core Zen 4 VM, 61 calls a step on SmolLM2, a tenth of its compiled one-row step. This is one
// pass over the row: sum of squares in 16 float lanes, k in order, the lanes added in order, one
// IEEE sqrt and division, then (x * r) * w; one code for every ISA, a row's bits its own.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include "c_entries.h"
#include "isa.h"

#include <cmath>
#include <string>
#include <tuple>

namespace {

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  return at::rms_norm(x, {weight.size(0)}, weight, eps);
}

SPECFREE_AVX2 void norm_row(const float* x, const float* w, float* y, int64_t n, float eps) {
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256 v0 = _mm256_loadu_ps(x + i), v1 = _mm256_loadu_ps(x + i + 8);
    a0 = _mm256_fmadd_ps(v0, v0, a0);
    a1 = _mm256_fmadd_ps(v1, v1, a1);
  }
  alignas(32) float lanes[16];
  _mm256_store_ps(lanes, a0);
  _mm256_store_ps(lanes + 8, a1);
  float sum = 0.0f;
  for (float lane : lanes) sum += lane;
  for (; i < n; ++i) sum = std::fma(x[i], x[i], sum);
  const float r = 1.0f / std::sqrt(sum / static_cast<float>(n) + eps);
  const __m256 rv = _mm256_set1_ps(r);
  for (i = 0; i + 8 <= n; i += 8)
    _mm256_storeu_ps(y + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(x + i), rv), _mm256_loadu_ps(w + i)));
  for (; i < n; ++i) y[i] = (x[i] * r) * w[i];
}

at::Tensor rms_norm_rows(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat && x.device().is_cpu() &&
                  weight.dim() == 1 && x.size(-1) == weight.size(0),
              "specfree::rms_norm_rows takes float32 CPU rows [..., n] and a weight [n]");
  TORCH_CHECK(specfree::best_isa() != specfree::Isa::kNone, "specfree::rms_norm_rows needs AVX2");
  const at::Tensor rows = x.contiguous(), w = weight.contiguous();
  at::Tensor y = at::empty_like(rows);
  const int64_t n = w.size(0), m = n ? rows.numel() / n : 0;
  at::parallel_for(0, m, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      norm_row(rows.data_ptr<float>() + r * n, w.data_ptr<float>(), y.data_ptr<float>() + r * n, n,
               static_cast<float>(eps));
  });
  return y;
}

// transformers' default rotary embedding: freqs = positions * inv_freq (float32), emb = [freqs,
// freqs], (cos(emb) * scaling, sin(emb) * scaling), in the dtype of the layer's input.
std::tuple<at::Tensor, at::Tensor> rotary(const at::Tensor& positions, const at::Tensor& inv_freq, double scaling,
                                          at::ScalarType dtype) {
  const at::Tensor freqs = positions.unsqueeze(-1).to(at::kFloat) * inv_freq.to(at::kFloat);
  const at::Tensor emb = at::cat({freqs, freqs}, -1);
  return {(emb.cos() * scaling).to(dtype), (emb.sin() * scaling).to(dtype)};
}

at::Tensor activation(const at::Tensor& x, const std::string& name) {
  if (name == "silu") return at::silu(x);
  if (name == "gelu") return at::gelu(x, "none");
  if (name == "gelu_tanh") return at::gelu(x, "tanh");
  TORCH_CHECK(false, "specfree::activation: no activation named '", name, "' (silu, gelu, gelu_tanh)");
}

}  // namespace

SPECFREE_C_ENTRY aoti_torch_cpu_rms_norm_rows(AtenTensorHandle x, AtenTensorHandle weight, double eps,
                                             AtenTensorHandle* out) {
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE(
      { specfree::hand_back(rms_norm_rows(specfree::tensor_of(x), specfree::tensor_of(weight), eps), out); });
}

SPECFREE_C_ENTRY aoti_torch_cpu_activation(AtenTensorHandle x, const char* name, AtenTensorHandle* out) {
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({ specfree::hand_back(activation(specfree::tensor_of(x), name), out); });
}

TORCH_LIBRARY_FRAGMENT(specfree, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("rms_norm_rows(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("rotary(Tensor positions, Tensor inv_freq, float scaling, ScalarType dtype) -> (Tensor, Tensor)");
  m.def("activation(Tensor x, str name) -> Tensor");
}

TORCH_LIBRARY_IMPL(specfree, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("rms_norm_rows", &rms_norm_rows);
  m.impl("rotary", &rotary);
  m.impl("activation", &activation);
}
