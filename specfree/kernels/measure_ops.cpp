// The cost curves' ops (specfree/bench/linear_curves.py, which `python -m specfree bench` runs for its
// cost_curves): measurement only, no model calls them. They stay in the shipped library because the
// bench a user runs reads the linear layers' curves against read_pass's floor.
//
// specfree::read_pass -- the floor a product cannot beat: one read of the same bytes with the same
// split among threads as panel_linear.
// specfree::linear_pass -- specfree::panel_linear over a list of products, called one after another
// from C++ through the dispatcher, as a compiled forward calls them.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <immintrin.h>
#include <torch/library.h>

#include "isa.h"

#include <algorithm>
#include <optional>
#include <vector>

namespace {

using specfree::Isa;

#define UNROLL _Pragma("GCC unroll 16")

// One read of every byte of ``tensors``, each split among threads as panel_linear splits it; each
// thread reads its share as ``streams`` equal parts side by side. One stream a thread is not the
// fastest read: on Zen 3 one thread reads 113 MB in 6.6 ms as one stream and in 4.9 ms as four,
// as the one-row kernel reads four panels. The floor is the fastest of these.
template <int S>
SPECFREE_AVX2 float sum_streams(const float* p, int64_t count) {
  const int64_t part = count / S / 16 * 16;  // two vectors a step in each stream; the rest is read after
  __m256 acc[S][2];
  UNROLL for (int s = 0; s < S; ++s) acc[s][0] = acc[s][1] = _mm256_setzero_ps();
  for (int64_t i = 0; i < part; i += 16)
    UNROLL for (int s = 0; s < S; ++s) {
      acc[s][0] = _mm256_add_ps(acc[s][0], _mm256_loadu_ps(p + s * part + i));
      acc[s][1] = _mm256_add_ps(acc[s][1], _mm256_loadu_ps(p + s * part + i + 8));
    }
  float total = 0;
  for (int s = 0; s < S; ++s) total += specfree::sum8(_mm256_add_ps(acc[s][0], acc[s][1]));
  for (int64_t i = S * part; i < count; ++i) total += p[i];
  return total;
}

at::Tensor read_pass(at::TensorList tensors, int64_t streams) {
  TORCH_CHECK(specfree::best_isa() != Isa::kNone, "specfree::read_pass needs AVX2");
  TORCH_CHECK(streams >= 1 && streams <= 8, "specfree::read_pass: streams must be 1 to 8, not ", streams);
  double total = 0;
  for (const at::Tensor& t : tensors) {
    TORCH_CHECK(t.is_contiguous() && t.device().is_cpu(), "specfree::read_pass reads contiguous CPU tensors");
    const int64_t floats = t.numel() * t.element_size() / 4;
    const float* p = static_cast<const float*>(t.data_ptr());
    const int64_t chunk = 4096;
    std::vector<float> sums(at::get_num_threads(), 0.f);
    at::parallel_for(0, (floats + chunk - 1) / chunk, 1, [&](int64_t begin, int64_t end) {
      const int64_t count = std::min(floats, end * chunk) - begin * chunk;
      sums[at::get_thread_num()] += specfree::for_rows(streams, [&](auto s) {
        return sum_streams<decltype(s)::value>(p + begin * chunk, count);
      });
    });
    for (float s : sums) total += s;
  }
  return at::scalar_tensor(total, at::kDouble);
}

// Products one after another, each called from C++ through the dispatcher as a compiled forward
// calls them, for the cost curves: called from Python, SmolLM2's 211 products at one row cost 2 ms
// more (of 18), which the compiled forward does not pay.
void linear_pass(at::TensorList xs, at::TensorList panels, const c10::List<std::optional<at::Tensor>>& biases,
                 at::IntArrayRef ns, c10::string_view isa) {
  TORCH_CHECK(xs.size() == panels.size() && biases.size() == panels.size() && ns.size() == panels.size(),
              "specfree::linear_pass: one activation, bias and output count per panels tensor");
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("specfree::panel_linear", "")
      .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, int64_t,
                        c10::string_view)>();
  for (size_t i = 0; i < panels.size(); ++i) op.call(xs[i], panels[i], biases.get(i), ns[i], isa);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specfree, m) {
  m.def("linear_pass(Tensor[] xs, Tensor[] panels, Tensor?[] biases, int[] n, str isa='auto') -> ()");
  m.def("read_pass(Tensor[] tensors, int streams=1) -> Tensor");
}

TORCH_LIBRARY_IMPL(specfree, CPU, m) {
  m.impl("linear_pass", &linear_pass);
  m.impl("read_pass", &read_pass);
}
