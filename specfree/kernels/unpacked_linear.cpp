// specfree::linear -- y = x W^T + b for a few rows on W in the model's own [N, K] layout: the
// unpacked fallback, for models specfree borrows (kernels.unpacked_linears) and heads tied to a layer
// it cannot repack. An engine's model runs panel_linear.cpp on weights packed into panels instead.
// (The op keeps its registered name, specfree::linear: AOTInductor packages already on disk call it
// by that name, and their cache key does not include the kernel library's source.)
//
// Few-row products are bound by streaming W from memory, not by arithmetic: the aim is to read
// every weight exactly once per call whatever the row count, and to do the FMAs while it streams.
// W stays in the model's own layout ([N, K], K contiguous), so no packed copy exists: each thread
// takes a contiguous range of output columns and walks NB rows of W side by side (NB streams),
// with the activations of up to 8 rows at a time in registers (more rows: a second group). Each
// output (m, n) is one vector accumulator
// summed over K in order, then reduced the same way, whatever the row count: every row of the
// result has the same bits as a one-row call (batch invariance).
//
// Two code paths, chosen at run time from the CPU's flags: AVX-512 (16 lanes) and AVX2 + FMA
// (8 lanes). They round differently from each other; within one process one path is used.
// Weights fp32 or bf16 (widened in registers); activations and accumulation fp32.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include "isa.h"

#include <algorithm>
#include <string>

namespace {

// Weights are prefetched into L2 this far ahead of the block being read. W's rows are short (K
// floats), too short for the hardware prefetcher to settle on each; and with several rows the
// FMAs of a block take long enough that a prefetch one block ahead arrives late. Measured on the
// 211 SmolLM2 shapes (Xeon, AVX-512, 2 threads): 8 rows 28 ms a block ahead into L1, 25 ms 32 KB
// ahead into L2; 1 row unchanged.
constexpr int64_t kPrefetchBytes = 32768;

constexpr int64_t kMaxRows = 16;  // more rows go to the library's GEMM (compute bound there)

using specfree::Isa;
using specfree::load16;
using specfree::load8;
using specfree::best_isa;
using specfree::sum16;
using specfree::sum8;

inline float widen(float v) { return v; }
inline float widen(at::BFloat16 v) { return static_cast<float>(v); }

// The tail of K past the last full vector, and the bias, added in one fixed order per output.
template <typename W>
inline float finish(float sum, const float* x, const W* w, int64_t from, int64_t k, const W* bias, int64_t n) {
  for (int64_t i = from; i < k; ++i) sum += x[i] * widen(w[i]);
  return bias ? sum + widen(bias[n]) : sum;
}

// One block: MB rows of x against NB rows of w, over all of K. The NB weight vectors of a step
// are loaded once and meet every row's activations. Registers: MB*NB accumulators + NB + 1.
// ``ahead``: elements from this block to the one prefetched now (kPrefetchBytes, in whole blocks).
#define SPECFREE_BLOCK(ATTR, NAME, VEC, LANES, ZERO, LOAD, FMA, SUM)                                \
  template <int MB, int NB, typename W>                                                           \
  ATTR void NAME(const float* x, int64_t ldx, const W* w, int64_t k, const W* bias, int64_t n0,   \
                 float* y, int64_t ldy, int64_t ahead) {                                          \
    VEC acc[MB][NB];                                                                              \
    for (int m = 0; m < MB; ++m)                                                                  \
      for (int j = 0; j < NB; ++j) acc[m][j] = ZERO();                                            \
    const int64_t full = k - k % LANES;                                                           \
    const W* next = w + ahead;                                                                    \
    for (int64_t i = 0; i < full; i += LANES) {                                                   \
      VEC ws[NB];                                                                                 \
      for (int j = 0; j < NB; ++j) ws[j] = LOAD(w + j * k + i);                                   \
      if ((i * sizeof(W)) % 64 == 0) /* one a cache line; a prefetch never faults */              \
        for (int j = 0; j < NB; ++j) _mm_prefetch(reinterpret_cast<const char*>(next + j * k + i), _MM_HINT_T1); \
      for (int m = 0; m < MB; ++m) {                                                              \
        VEC xv = LOAD(x + m * ldx + i);                                                           \
        for (int j = 0; j < NB; ++j) acc[m][j] = FMA(xv, ws[j], acc[m][j]);                       \
      }                                                                                           \
    }                                                                                             \
    for (int m = 0; m < MB; ++m)                                                                  \
      for (int j = 0; j < NB; ++j)                                                                \
        y[m * ldy + n0 + j] = finish(SUM(acc[m][j]), x + m * ldx, w + j * k, full, k, bias, n0 + j); \
  }

SPECFREE_BLOCK(SPECFREE_AVX2, block_avx2, __m256, 8,
               _mm256_setzero_ps, load8, _mm256_fmadd_ps, sum8)
SPECFREE_BLOCK(SPECFREE_AVX512, block_avx512, __m512, 16,
               _mm512_setzero_ps, load16, _mm512_fmadd_ps, sum16)

// A block kernel for MB rows and NB columns, as a function pointer: the group loop below picks
// one per group of rows (a call per block of W is thousands of FMAs; the call is noise).
template <typename W>
using BlockFn = void (*)(const float*, int64_t, const W*, int64_t, const W*, int64_t, float*, int64_t, int64_t);

// Rows are taken in groups of at most kGroupRows: a group's accumulators fill the registers
// (AVX2 has 16 vector registers, AVX-512 32). Block widths per group size (columns of W read
// side by side), from the register budget MB * NB + NB + 1.
constexpr int64_t kGroupRows = 8;
constexpr int kWidthAvx2[kGroupRows + 1] = {0, 8, 4, 2, 2, 1, 1, 1, 1};
// AVX-512, 3 and 4 rows: 6 columns rather than 4, measured interleaved in one process on Zen 4:
// 4 rows 20.1-20.4 ms against 20.3-21.8 (8 rows the same either way).
constexpr int kWidthAvx512[kGroupRows + 1] = {0, 8, 8, 6, 6, 3, 2, 2, 2};

// The block kernel for MB rows and nb columns. A call's first group is as wide as its own size
// allows, the groups after it as wide as a full group's, the last columns one at a time: only
// those widths are compiled (every width for every size would triple the build).
template <int MB, typename W>
BlockFn<W> pick_rows(Isa isa, int nb) {
  if (isa == Isa::kAvx512) {
    constexpr int own = kWidthAvx512[MB], full = kWidthAvx512[kGroupRows];
    return nb == own ? block_avx512<MB, own, W> : nb == full ? block_avx512<MB, full, W> : block_avx512<MB, 1, W>;
  }
  constexpr int own = kWidthAvx2[MB], full = kWidthAvx2[kGroupRows];
  return nb == own ? block_avx2<MB, own, W> : nb == full ? block_avx2<MB, full, W> : block_avx2<MB, 1, W>;
}

template <typename W>
BlockFn<W> pick(Isa isa, int nb, int64_t mb) {
  return specfree::for_rows(mb, [&](auto rows) { return pick_rows<decltype(rows)::value, W>(isa, nb); });
}

// Columns [n_begin, n_end) for all m_rows rows: NB columns of W at a time, then single columns.
// AVX-512: each block of W is read from memory once and every group of rows meets it, the later
// ones from cache. AVX2 (one column a block for 8 rows): each group sweeps all columns in turn.
// Measured on SmolLM2's 211 shapes, 16 rows (Zen 4, 2 threads): AVX-512 64 ms in one 16-row
// group, 40 ms in two interleaved 8-row groups; AVX2 45 ms in two sweeps, 65 ms interleaved.
template <typename W>
void columns(Isa isa, const float* x, int64_t m_rows, const W* w, int64_t k, const W* bias, int64_t n_begin,
             int64_t n_end, float* y, int64_t ldy) {
  const int64_t first = std::min(kGroupRows, m_rows);
  const int nb = (isa == Isa::kAvx512 ? kWidthAvx512 : kWidthAvx2)[first];
  const int64_t groups = (m_rows + kGroupRows - 1) / kGroupRows;
  BlockFn<W> wide[kMaxRows / kGroupRows], narrow[kMaxRows / kGroupRows];
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t mb = std::min(kGroupRows, m_rows - g * kGroupRows);
    wide[g] = pick<W>(isa, nb, mb);
    narrow[g] = pick<W>(isa, 1, mb);
  }
  const int64_t block_bytes = nb * k * static_cast<int64_t>(sizeof(W));
  const int64_t ahead = (kPrefetchBytes + block_bytes - 1) / block_bytes * nb * k;
  auto sweep = [&](int64_t g_begin, int64_t g_end) {  // groups [g_begin, g_end) over every column
    int64_t n = n_begin;
    for (; n + nb <= n_end; n += nb)
      for (int64_t g = g_begin; g < g_end; ++g)
        wide[g](x + g * kGroupRows * k, k, w + n * k, k, bias, n, y + g * kGroupRows * ldy, ldy,
                g == g_begin ? ahead : 0);
    for (; n < n_end; ++n)
      for (int64_t g = g_begin; g < g_end; ++g)
        narrow[g](x + g * kGroupRows * k, k, w + n * k, k, bias, n, y + g * kGroupRows * ldy, ldy, k);
  };
  if (isa == Isa::kAvx512) {
    sweep(0, groups);
  } else {
    for (int64_t g = 0; g < groups; ++g) sweep(g, g + 1);
  }
}

constexpr int64_t kColumnsPerTask = 64;  // a thread's share is a contiguous run of W's rows

template <typename W>
void run(Isa isa, const float* x, int64_t m, const W* w, int64_t n, int64_t k, const W* bias, float* y) {
  at::parallel_for(0, (n + kColumnsPerTask - 1) / kColumnsPerTask, 1, [&](int64_t begin, int64_t end) {
    const int64_t n_begin = begin * kColumnsPerTask, n_end = std::min(n, end * kColumnsPerTask);
    columns<W>(isa, x, m, w, k, bias, n_begin, n_end, y, n);
  });
}

Isa parse_isa(const std::string& name) { return specfree::parse_isa(name, "specfree::linear"); }

at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                  c10::string_view isa_name) {
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "specfree::linear runs on the CPU");
  TORCH_CHECK(weight.dim() == 2 && x.size(-1) == weight.size(1), "specfree::linear: shapes ", x.sizes(),
              " and ", weight.sizes(), " do not multiply");
  TORCH_CHECK(weight.scalar_type() == at::kFloat || weight.scalar_type() == at::kBFloat16,
              "specfree::linear: weights must be float32 or bfloat16");
  const int64_t k = weight.size(1), n = weight.size(0), m = x.numel() / std::max<int64_t>(k, 1);
  auto out_sizes = x.sizes().vec();
  out_sizes.back() = n;
  const bool has_bias = bias.has_value() && bias->defined();
  if (m > kMaxRows || k == 0) {  // the library's GEMM runs near the compute peak for many rows
    return at::linear(x, weight.to(x.scalar_type()), has_bias ? std::optional<at::Tensor>(bias->to(x.scalar_type())) : std::nullopt);
  }
  const Isa isa = parse_isa(std::string(isa_name));
  const at::Tensor x32 = x.to(at::kFloat).contiguous();
  const at::Tensor w = weight.contiguous();
  at::Tensor b;
  if (has_bias) b = bias->to(weight.scalar_type()).contiguous();
  at::Tensor y = at::empty({m, n}, x32.options());
  if (weight.scalar_type() == at::kFloat)
    run<float>(isa, x32.data_ptr<float>(), m, w.data_ptr<float>(), n, k, has_bias ? b.data_ptr<float>() : nullptr,
               y.data_ptr<float>());
  else
    run<at::BFloat16>(isa, x32.data_ptr<float>(), m, w.data_ptr<at::BFloat16>(), n, k,
                      has_bias ? b.data_ptr<at::BFloat16>() : nullptr, y.data_ptr<float>());
  return y.view(out_sizes).to(x.scalar_type());
}


at::Tensor isa_code() { return at::scalar_tensor(static_cast<int64_t>(best_isa()), at::kLong); }

}  // namespace

TORCH_LIBRARY(specfree, m) {
  m.def("linear(Tensor x, Tensor weight, Tensor? bias, str isa='auto') -> Tensor");
  m.def("best_isa() -> Tensor");
}

TORCH_LIBRARY_IMPL(specfree, CPU, m) { m.impl("linear", &linear); }
TORCH_LIBRARY_IMPL(specfree, CompositeExplicitAutograd, m) { m.impl("best_isa", &isa_code); }
