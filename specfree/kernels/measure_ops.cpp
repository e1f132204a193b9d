// The cost curves' ops (specfree/bench/linear_curves.py, which `python -m specfree bench` runs for its
// cost_curves): measurement only, no model calls them. They stay in the shipped library because the
// bench a user runs reads the linear layers' curves against read_pass's floor.
//
// specfree::read_pass -- the floor a product cannot beat: one read of the same bytes with the same
// split among threads as panel_linear.
// specfree::linear_pass -- specfree::panel_linear over a list of products, called one after another
// from C++ through the dispatcher, as a compiled forward calls them.
// specfree::fma_peak, specfree::int8_peak -- the arithmetic ceilings of bench's roofline
// (specfree/bench/roofline.py): multiply-adds per second on every thread, on registers only.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <immintrin.h>
#include <torch/library.h>

#include "isa.h"

#include <algorithm>
#include <chrono>
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

// ---- the arithmetic peaks: multiply-adds per second, counted as the roofline counts a product's
// (one float32 or one int8 multiply-add each; a flop count is twice the float32 one) -------------

constexpr int64_t kPeakSteps = 1 << 21;  // steps a thread runs: milliseconds at any clock, past timer noise
constexpr int kChains = 12;  // independent accumulators: more than FMA latency times FMA ports (4 x 2)

// NAME(steps): ``steps`` of kChains float32 FMAs of vector type V, each accumulator its own chain;
// returns the lanes' sum (no dead code).
#define FMA_CHAINS(ATTR, NAME, V, SET1, FMA, SUM)                                   \
  ATTR float NAME(int64_t steps) {                                                  \
    const V a = SET1(0.5f), b = SET1(1e-3f);                                        \
    V acc[kChains];                                                                 \
    UNROLL for (int c = 0; c < kChains; ++c) acc[c] = SET1(c + 1.f);  /* distinct: not merged */ \
    for (int64_t i = 0; i < steps; ++i)                                             \
      UNROLL for (int c = 0; c < kChains; ++c) acc[c] = FMA(acc[c], a, b);          \
    float total = 0;                                                                \
    for (int c = 0; c < kChains; ++c) total += SUM(acc[c]);                         \
    return total;                                                                   \
  }
FMA_CHAINS(SPECFREE_AVX2, fma_avx2, __m256, _mm256_set1_ps, _mm256_fmadd_ps, specfree::sum8)
FMA_CHAINS(SPECFREE_AVX512, fma_avx512, __m512, _mm512_set1_ps, _mm512_fmadd_ps, specfree::sum16)

// int8 as panel_linear's int8 kernels sum 4-bit codes against 8-bit activations: unsigned weight
// bytes times signed activation bytes, four a 32-bit lane. NAME(steps): W weight vectors against X
// activation vectors into W*X accumulators, as the kernel's block of panels against rows. The
// weights pass an empty asm (register class REG) each step, so the compiler takes them as new:
// products of loop-invariant inputs would otherwise be hoisted out of the loop.
#define INT8_BLOCK(ATTR, NAME, I, W, X, REG, SET1, DOT, SUM)                                              \
  ATTR int64_t NAME(int64_t steps) {                                                                      \
    I w[W], x[X], acc[W * X];                                                                             \
    UNROLL for (int i = 0; i < W; ++i) w[i] = SET1(static_cast<char>(3 + i));                             \
    UNROLL for (int j = 0; j < X; ++j) x[j] = SET1(static_cast<char>(-2 - j));                            \
    UNROLL for (int c = 0; c < W * X; ++c) acc[c] = SET1(static_cast<char>(c));                           \
    for (int64_t s = 0; s < steps; ++s) {                                                                 \
      UNROLL for (int i = 0; i < W; ++i) asm volatile("" : "+" REG(w[i]));                                \
      UNROLL for (int c = 0; c < W * X; ++c) acc[c] = DOT(acc[c], w[c / X], x[c % X]);                    \
    }                                                                                                     \
    int64_t total = 0;                                                                                    \
    for (int c = 0; c < W * X; ++c) total += SUM(acc[c]);                                                 \
    return total;                                                                                         \
  }

SPECFREE_AVX2 int64_t lanes8(__m256i v) {
  alignas(32) int32_t out[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(out), v);
  int64_t total = 0;
  for (int32_t o : out) total += o;
  return total;
}
SPECFREE_AVX512 int64_t lanes16(__m512i v) { return _mm512_reduce_add_epi32(v); }

// The kernel's sums, each accumulating in place (the last step as asm: GCC 12 otherwise copies
// every accumulator to another register each step, instructions the kernel's loop does not pay).
// AVX2 and AVX-512 without VNNI: maddubs (byte pairs to 16 bits), madd (to 32), add.
SPECFREE_AVX2 inline __m256i dot_avx2(__m256i acc, __m256i w, __m256i x) {
  const __m256i sum = _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1));
  asm("vpaddd %1, %0, %0" : "+x"(acc) : "x"(sum));
  return acc;
}
SPECFREE_AVX512 inline __m512i dot_avx512(__m512i acc, __m512i w, __m512i x) {
  const __m512i sum = _mm512_madd_epi16(_mm512_maddubs_epi16(w, x), _mm512_set1_epi16(1));
  asm("vpaddd %1, %0, %0" : "+v"(acc) : "v"(sum));
  return acc;
}
SPECFREE_AVX512_VNNI inline __m512i dot_vnni(__m512i acc, __m512i w, __m512i x) {  // _mm512_dpbusd_epi32
  asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(w), "v"(x));
  return acc;
}
INT8_BLOCK(SPECFREE_AVX2, int8_avx2, __m256i, 2, 3, "x", _mm256_set1_epi8, dot_avx2, lanes8)  // 16 registers
INT8_BLOCK(SPECFREE_AVX512, int8_avx512, __m512i, 4, 3, "v", _mm512_set1_epi8, dot_avx512, lanes16)
INT8_BLOCK(SPECFREE_AVX512_VNNI, int8_vnni, __m512i, 4, 3, "v", _mm512_set1_epi8, dot_vnni, lanes16)

// ``per_thread(steps)`` on every thread torch uses at once; multiply-adds per second over them all
// (``per_step``: one thread's multiply-adds a step). The result is kept (no dead code).
template <typename Fn>
double on_every_thread(Fn per_thread, double per_step) {
  const int64_t threads = at::get_num_threads();
  std::vector<double> kept(threads, 0);
  const auto start = std::chrono::steady_clock::now();
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) kept[t] = static_cast<double>(per_thread(kPeakSteps));
  });
  const std::chrono::duration<double> took = std::chrono::steady_clock::now() - start;
  double sink = 0;
  for (double k : kept) sink += k;
  volatile double keep = sink;  // the results are read: the chains are not dead code
  (void)keep;
  return threads * kPeakSteps * per_step / took.count();
}

double fma_peak(c10::string_view isa_name) {
  const Isa isa = specfree::parse_isa(std::string(isa_name), "specfree::fma_peak");
  if (isa == Isa::kAvx512) return on_every_thread(fma_avx512, kChains * 16.0);
  return on_every_thread(fma_avx2, kChains * 8.0);
}

// ``isa``: as coded_linear's: "avx512" sums with VNNI where the CPU has it, "avx512_novnni" without.
double int8_peak(c10::string_view isa_name) {
  const bool no_vnni = isa_name == "avx512_novnni";
  const Isa isa = specfree::parse_isa(no_vnni ? std::string("avx512") : std::string(isa_name), "specfree::int8_peak");
  if (isa == Isa::kAvx2) return on_every_thread(int8_avx2, 2 * 3 * 32.0);
  if (!no_vnni && specfree::has_avx512_vnni()) return on_every_thread(int8_vnni, 4 * 3 * 64.0);
  return on_every_thread(int8_avx512, 4 * 3 * 64.0);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specfree, m) {
  m.def("linear_pass(Tensor[] xs, Tensor[] panels, Tensor?[] biases, int[] n, str isa='auto') -> ()");
  m.def("read_pass(Tensor[] tensors, int streams=1) -> Tensor");
  m.def("fma_peak(str isa='auto') -> float");
  m.def("int8_peak(str isa='auto') -> float");
}

TORCH_LIBRARY_IMPL(specfree, CPU, m) {
  m.impl("linear_pass", &linear_pass);
  m.impl("read_pass", &read_pass);
}

// No tensor arguments: no backend to dispatch on.
TORCH_LIBRARY_IMPL(specfree, CompositeExplicitAutograd, m) {
  m.impl("fma_peak", &fma_peak);
  m.impl("int8_peak", &int8_peak);
}
