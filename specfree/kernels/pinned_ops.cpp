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

#include <ATen/ATen.h>
#include <torch/library.h>

#include <string>
#include <tuple>

namespace {

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  return at::rms_norm(x, {weight.size(0)}, weight, eps);
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

TORCH_LIBRARY_FRAGMENT(specfree, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("rotary(Tensor positions, Tensor inv_freq, float scaling, ScalarType dtype) -> (Tensor, Tensor)");
  m.def("activation(Tensor x, str name) -> Tensor");
}

TORCH_LIBRARY_IMPL(specfree, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("rotary", &rotary);
  m.impl("activation", &activation);
}
