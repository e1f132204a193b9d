// specfree::panel_linear -- y = x W^T + b with W packed once into panels (the verify step's linears).
//
// A product of 1-16 rows is bound by reading W. The model's own layout ([N, K]) makes a kernel
// that computes several outputs at once read several short rows of W side by side, several streams
// per thread; on Zen 3 that cost 25-50% over one read of the weights. Packed, W is a sequence of
// panels [N/P, K, P]: P output columns (one vector: 8 floats AVX2, 16 AVX-512), K contiguous, zero
// columns past N. A thread takes a contiguous run of panels, one sequential stream; at each k one
// vector of weights meets every row's activation, broadcast from L1.
//
// Every output (m, n) is one lane of one accumulator, fma over k = 0..K-1 in order, then + bias:
// the same operations whatever the number of rows, which panels share a block, or which thread
// runs it, so a row's bits never depend on the other rows of the call (batch invariance) -- and
// the AVX2 and AVX-512 paths, lane for lane, compute the same sums.
//
// The cost curves' ops (specfree::read_pass, the floor; specfree::linear_pass, the products called
// from C++) are in measure_ops.cpp.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include "isa.h"

#include <algorithm>
#include <string>
#include <vector>

namespace {

using specfree::Isa;
using specfree::load16;
using specfree::load8;

// Rows in one pass over a block of panels: their accumulators fill the registers. More rows go in
// groups, each group re-reading the block from cache. (AVX2 in groups of 4 rows against 2 panels,
// so each broadcast meets two weight vectors, measured no faster on Zen 3: 8 rows 1.82x the read
// pass against 1.69x in one group of 8.)
constexpr int kGroupRows = 8;
// More rows than that go, on AVX2, in groups of 6 against 2 panels: 12 FMAs for 8 loads at each k
// where 8 rows against 1 panel need 9 loads for 8 FMAs. Zen 3, one core, weights in cache: 16-160
// rows at 74-96 GFLOPS against 48-60; the model's 211 layers (two threads, streamed) 8-20% faster
// at 12-32 rows. (Up to 8 rows one group of 8 against 1 panel stays: there the weight stream
// decides, and groups of 4 or 6 were measured 16-23% slower at 8 rows.)
constexpr int kManyRowsAvx2 = 6;

// Software prefetch this far ahead in each stream (bytes). Measured on SmolLM2's 211 shapes.
constexpr int64_t kAhead = 1024;

SPECFREE_AVX2 inline __m256 bcast8(const float* p) { return _mm256_broadcast_ss(p); }
SPECFREE_AVX512 inline __m512 bcast16(const float* p) { return _mm512_set1_ps(*p); }

// Loops over rows and panels unrolled, so the accumulators live in registers (without it GCC 12
// keeps acc[][] on the stack and stores it every step: 4x slower at 8 rows).
#define UNROLL _Pragma("GCC unroll 16")

// One k of SPECFREE_PANELS: NB weight vectors meet MB broadcast activations.
#define SPECFREE_PANEL_K(I, VEC, LANES, LOAD, FMA, BCAST)                                          \
  {                                                                                                \
    const int64_t ik = (I);                                                                        \
    VEC ws[NB];                                                                                    \
    UNROLL for (int j = 0; j < NB; ++j) ws[j] = LOAD(panels + ik * LANES + j * stride);            \
    UNROLL for (int m = 0; m < MB; ++m) {                                                          \
      VEC xv = BCAST(x + m * ldx + ik);                                                            \
      UNROLL for (int j = 0; j < NB; ++j) acc[m][j] = FMA(xv, ws[j], acc[m][j]);                   \
    }                                                                                              \
  }

// MB rows against NB adjacent panels (P = LANES columns each), all of K. Registers: MB*NB
// accumulators, NB weight vectors, one broadcast. ``out`` is [MB, NB*LANES], row stride ldo.
// The k loop steps one cache line of each panel at a time (STEP vectors), and with PREFETCH
// touches the line kAhead bytes on once per step: a test and a prefetch loop at every k cost
// half the FMA throughput at 8 rows (Zen 3: 22 against 42 GFMA/s a core, weights in cache).
#define SPECFREE_PANELS(ATTR, NAME, VEC, LANES, ZERO, LOAD, FMA, BCAST, STORE)                     \
  template <int MB, int NB, bool PREFETCH, typename W>                                             \
  ATTR void NAME(const float* x, int64_t ldx, const W* panels, int64_t k, float* out, int64_t ldo) { \
    VEC acc[MB][NB];                                                                               \
    UNROLL for (int m = 0; m < MB; ++m)                                                            \
      UNROLL for (int j = 0; j < NB; ++j) acc[m][j] = ZERO();                                      \
    const int64_t stride = k * LANES; /* one panel */                                              \
    constexpr int64_t ahead = kAhead / sizeof(W);                                                  \
    constexpr int STEP = std::max<int>(1, 64 / sizeof(W) / LANES);                                 \
    int64_t i = 0;                                                                                 \
    for (; i + STEP <= k; i += STEP) {                                                             \
      if constexpr (PREFETCH)                                                                      \
        UNROLL for (int j = 0; j < NB; ++j)                                                        \
          _mm_prefetch(reinterpret_cast<const char*>(panels + i * LANES + j * stride + ahead), _MM_HINT_T0); \
      UNROLL for (int s = 0; s < STEP; ++s) SPECFREE_PANEL_K(i + s, VEC, LANES, LOAD, FMA, BCAST); \
    }                                                                                              \
    for (; i < k; ++i) SPECFREE_PANEL_K(i, VEC, LANES, LOAD, FMA, BCAST);                          \
    UNROLL for (int m = 0; m < MB; ++m)                                                            \
      UNROLL for (int j = 0; j < NB; ++j) STORE(out + m * ldo + j * LANES, acc[m][j]);             \
  }

SPECFREE_PANELS(SPECFREE_AVX2, panels_avx2, __m256, 8, _mm256_setzero_ps, load8, _mm256_fmadd_ps,
                bcast8, _mm256_storeu_ps)
SPECFREE_PANELS(SPECFREE_AVX512, panels_avx512, __m512, 16, _mm512_setzero_ps, load16, _mm512_fmadd_ps,
                bcast16, _mm512_storeu_ps)

template <typename W>
using PanelFn = void (*)(const float*, int64_t, const W*, int64_t, float*, int64_t);

// Panels per block for a group of MB rows, from the register budget (16 vectors AVX2, 32 AVX-512).
// One row on AVX-512 reads 8 panels side by side: more weight streams in flight. Intel Xeon VM
// (family 6 model 167), SmolLM2's 211 layers, two threads, medians of 15 interleaved passes: 1 row
// 1.17 -> 1.12x the read pass; 2-8 rows gained nothing from wider blocks (6 at 3-4 rows, 5 at 5).
constexpr int kBlockAvx2[kGroupRows + 1] = {0, 4, 4, 3, 2, 2, 2, 1, 1};
constexpr int kBlockAvx512[kGroupRows + 1] = {0, 8, 4, 4, 4, 4, 3, 3, 3};

// The kernel for MB rows and nb panels: a call's blocks are as wide as its first group allows
// (that group's own width, or a full group's when later groups follow), the last panels of a
// thread's range in narrower blocks (``narrower``); only those widths are compiled.
template <int MB, bool PREFETCH, typename W>
PanelFn<W> pick_rows(Isa isa, int nb) {
  if (isa == Isa::kAvx512) {
    constexpr int own = kBlockAvx512[MB], full = kBlockAvx512[kGroupRows];
    return nb == own    ? panels_avx512<MB, own, PREFETCH, W>
           : nb == full ? panels_avx512<MB, full, PREFETCH, W>
           : nb == 4    ? panels_avx512<MB, 4, PREFETCH, W>
           : nb == 2    ? panels_avx512<MB, 2, PREFETCH, W>
                        : panels_avx512<MB, 1, PREFETCH, W>;
  }
  constexpr int own = kBlockAvx2[MB], full = kBlockAvx2[kManyRowsAvx2];
  return nb == own    ? panels_avx2<MB, own, PREFETCH, W>
         : nb == full ? panels_avx2<MB, full, PREFETCH, W>
         : nb == 2    ? panels_avx2<MB, 2, PREFETCH, W>
                      : panels_avx2<MB, 1, PREFETCH, W>;
}

// The next block width down for the panels left at the end of a range: 4 (AVX-512), 2, then 1.
// (Blocks of 8 with single-panel tails would run a thread's 6 panels of a 192-column layer one
// at a time.)
inline int narrower(Isa isa, int width) {
  return width > 4 && isa == Isa::kAvx512 ? 4 : width > 2 ? 2 : 1;
}

// The first group of rows streams the block from memory (prefetching); later ones read it from cache.
template <typename W>
PanelFn<W> pick(Isa isa, int nb, int64_t mb, bool first) {
  return specfree::for_rows(mb, [&](auto rows) {
    constexpr int r = decltype(rows)::value;
    return first ? pick_rows<r, true, W>(isa, nb) : pick_rows<r, false, W>(isa, nb);
  });
}

// Panels [p_begin, p_end) for all m rows into y [m, n]. Blocks are as wide as the first group
// allows; every group meets a block before the next block is read (later groups from cache).
template <typename W, typename B>
void panel_range(Isa isa, int lanes, const float* x, int64_t m, const W* panels, int64_t k, const B* bias,
                 int64_t n, int64_t p_begin, int64_t p_end, float* y) {
  const int* widths = isa == Isa::kAvx512 ? kBlockAvx512 : kBlockAvx2;
  const int64_t group = isa == Isa::kAvx2 && m > kGroupRows ? kManyRowsAvx2 : kGroupRows;
  const int64_t first = std::min(group, m);  // (GCC 12 miscompiles min() inside a[])
  const int nb = widths[first];
  const int64_t groups = (m + group - 1) / group;
  float out[kGroupRows * 4 * 16];  // one group's results for one block, [rows, nb * lanes]
  const int64_t ldo = nb * lanes;
  for (int64_t p = p_begin; p < p_end;) {
    int width = nb;
    while (p + width > p_end) width = narrower(isa, width);
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t mb = std::min(group, m - g * group);
      pick<W>(isa, width, mb, g == 0)(x + g * group * k, k, panels + p * k * lanes, k, out, ldo);
      specfree::store_block(out, ldo, mb, width * lanes, bias, p * lanes, n, y + g * group * n);
    }
    p += width;
  }
}

int lanes_of(Isa isa) { return isa == Isa::kAvx512 ? 16 : 8; }

// Panels per task: a thread's share is a contiguous run of panels, one stream.
constexpr int64_t kPanelsPerTask = 4;

// Every row count runs here, a long prompt's prefill included, so a prompt's rows keep the one-row
// kernel's bits on both paths. (Until 2026-11-26 AVX-512 handed more than 160 rows to the library's
// GEMM on unpacked tiles. On an Intel Xeon VM, family 6 model 167, two threads, SmolLM2's 211
// layers, medians of 15 interleaved passes, ms, groups / GEMM: 256 rows 235 / 306, 512 rows 441 /
// 502, 1024 and 2048 rows level, 936 / 920 and 1871 / 1871. On Zen 3 AVX2's groups of 6 run level
// with MKL's GEMM at 256-4096 rows.)

at::Tensor panel_linear(const at::Tensor& x, const at::Tensor& panels, const std::optional<at::Tensor>& bias,
                        int64_t n, c10::string_view isa_name) {
  TORCH_CHECK(x.device().is_cpu() && panels.device().is_cpu(), "specfree::panel_linear runs on the CPU");
  TORCH_CHECK(panels.dim() == 3 && panels.is_contiguous(), "specfree::panel_linear: panels must be a contiguous "
              "[N/P, K, P] tensor (specfree.kernels.panels.pack), not ", panels.sizes());
  const auto dtype = panels.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf,
              "specfree::panel_linear: weights must be float32, bfloat16 or float16");
  const Isa isa = specfree::parse_isa(std::string(isa_name), "specfree::panel_linear");
  const int64_t k = panels.size(1), lanes = panels.size(2), count = panels.size(0);
  TORCH_CHECK(lanes == lanes_of(isa), "specfree::panel_linear: panels of ", lanes, " columns cannot run the ",
              isa == Isa::kAvx512 ? "avx512" : "avx2", " path (", lanes_of(isa), " columns); pack for it");
  TORCH_CHECK(x.size(-1) == k && n <= count * lanes && n > count * lanes - lanes, "specfree::panel_linear: shapes ",
              x.sizes(), " and panels ", panels.sizes(), " for ", n, " outputs do not multiply");
  const int64_t m = x.numel() / std::max<int64_t>(k, 1);
  // A bias in float32 stays float32 (16-bit weights computed in float32, the model's float32 bias);
  // else it is taken in the weights' dtype, as a 16-bit model holds it.
  const bool wide_bias = bias.has_value() && bias->defined() && bias->scalar_type() == at::kFloat;
  const at::Tensor x32 = specfree::float_rows(x), b = specfree::bias_as(bias, wide_bias ? at::kFloat : dtype);
  at::Tensor y = specfree::output_rows(x, n);
  if (m > 0) {
    at::parallel_for(0, count, kPanelsPerTask, [&](int64_t begin, int64_t end) {
      const auto run = [&](auto* w, auto* bias_values) {
        panel_range(isa, lanes, x32.data_ptr<float>(), m, w, k, bias_values, n, begin, end, y.data_ptr<float>());
      };
      const float* wide = wide_bias ? b.data_ptr<float>() : nullptr;
      if (dtype == at::kFloat)
        run(panels.data_ptr<float>(), b.defined() ? b.data_ptr<float>() : nullptr);
      else if (dtype == at::kBFloat16)
        wide || !b.defined() ? run(panels.data_ptr<at::BFloat16>(), wide) : run(panels.data_ptr<at::BFloat16>(), b.data_ptr<at::BFloat16>());
      else
        wide || !b.defined() ? run(panels.data_ptr<at::Half>(), wide) : run(panels.data_ptr<at::Half>(), b.data_ptr<at::Half>());
    });
  }
  return x.scalar_type() == at::kFloat ? y : y.to(x.scalar_type());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specfree, m) {
  m.def("panel_linear(Tensor x, Tensor panels, Tensor? bias, int n, str isa='auto') -> Tensor");
}

TORCH_LIBRARY_IMPL(specfree, CPU, m) {
  m.impl("panel_linear", &panel_linear);
}
