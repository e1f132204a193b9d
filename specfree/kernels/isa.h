// The CPU code paths both kernels choose between at run time, and how an op's `isa` argument
// picks one. Included by every source of the one library.
#pragma once

#include <ATen/ATen.h>
#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <type_traits>

namespace specfree {

enum class Isa { kNone = 0, kAvx2 = 1, kAvx512 = 2 };

inline Isa detect_isa() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")) return Isa::kAvx512;
  // every AVX2 CPU has F16C too (float16 scales); checked all the same
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
    return Isa::kAvx2;
  return Isa::kNone;
}

// Decided once per process (the first call; thread-safe), not on every op call: the CPU does not
// change under a process.
inline Isa best_isa() {
  static const Isa best = detect_isa();
  return best;
}

// "auto" (the best this CPU has), "avx2" or "avx512"; `op` names the caller in errors.
inline Isa parse_isa(const std::string& name, const char* op) {
  const Isa best = best_isa();
  Isa asked = best;
  if (name == "avx2") asked = Isa::kAvx2;
  else if (name == "avx512") asked = Isa::kAvx512;
  else TORCH_CHECK(name == "auto", op, ": isa must be auto, avx2 or avx512, not ", name);
  TORCH_CHECK(static_cast<int>(asked) <= static_cast<int>(best) && asked != Isa::kNone,
              op, ": this CPU cannot run the ", name, " code path");
  return asked;
}

#define SPECFREE_AVX2 __attribute__((target("avx2,fma,f16c")))
#define SPECFREE_AVX512 __attribute__((target("avx512f,avx512bw,avx2,fma,f16c")))
#define SPECFREE_AVX512_VNNI __attribute__((target("avx512f,avx512bw,avx512vnni,avx2,fma,f16c")))

// Whether the CPU has AVX-512 VNNI (vpdpbusd: four byte products summed into 32 bits).
inline bool has_avx512_vnni() {
  static const bool vnni = [] {  // once per process, as best_isa
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512vnni") != 0;
  }();
  return vnni;
}

// Four bytes as one 32-bit word (no aliasing).
inline int32_t word_at(const int8_t* p) {
  int32_t w;
  std::memcpy(&w, p, 4);
  return w;
}

// Horizontal sums in one fixed order: both ops reduce lanes the same way, whatever the row count.
SPECFREE_AVX2 inline float sum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
SPECFREE_AVX512 inline float sum16(__m512 v) {
  __m256 s8 = _mm256_add_ps(_mm512_castps512_ps256(v),
                            _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Vectors of 8 (AVX2) or 16 (AVX-512) weights, fp32 or bf16 widened to fp32 (bf16 is fp32's top half).
SPECFREE_AVX2 inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
SPECFREE_AVX2 inline __m256 load8(const at::BFloat16* p) {
  __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
SPECFREE_AVX2 inline __m256 load8(const at::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
SPECFREE_AVX512 inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
SPECFREE_AVX512 inline __m512 load16(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
SPECFREE_AVX512 inline __m512 load16(const at::BFloat16* p) {
  __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// ``x`` as contiguous float32 rows, converted only where it is not that already: each ATen call
// costs microseconds, and a forward makes 211 products (Intel VM, the 211 layers from Python: 1 row
// 23.4 -> 22.7 ms, 8 rows 26.3 -> 25.7, medians of 20).
inline at::Tensor float_rows(const at::Tensor& x) {
  return x.scalar_type() == at::kFloat && x.is_contiguous() ? x : x.to(at::kFloat).contiguous();
}

// A product's float32 output [..., n] for rows ``x`` [..., k].
inline at::Tensor output_rows(const at::Tensor& x, int64_t n) {
  auto sizes = x.sizes().vec();
  sizes.back() = n;
  return at::empty(sizes, x.options().dtype(at::kFloat));
}

// ``bias`` as a contiguous ``dtype`` tensor, converted only where it is not that already;
// undefined where there is none.
inline at::Tensor bias_as(const std::optional<at::Tensor>& bias, at::ScalarType dtype) {
  if (!bias.has_value() || !bias->defined()) return at::Tensor();
  return bias->scalar_type() == dtype && bias->is_contiguous() ? *bias : bias->to(dtype).contiguous();
}

// One group's results for a block of columns, ``out`` [rows, cols] (row stride ldo), into the
// rows of ``y`` [*, n] from column col0, plus the bias; columns at or past n (a last panel's
// padding) dropped.
template <typename B>
inline void store_block(const float* out, int64_t ldo, int64_t rows, int64_t cols, const B* bias, int64_t col0,
                        int64_t n, float* y) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols && col0 + c < n; ++c)
      y[r * n + col0 + c] = bias ? out[r * ldo + c] + static_cast<float>(bias[col0 + c]) : out[r * ldo + c];
}

// ``pick(std::integral_constant<int, MB>{})`` for a group of ``rows`` (1-8, more as 8): a block
// kernel compiled for each row count, chosen at run time.
template <typename Pick>
auto for_rows(int64_t rows, Pick&& pick) {
  switch (rows) {
    case 1: return pick(std::integral_constant<int, 1>{});  case 2: return pick(std::integral_constant<int, 2>{});
    case 3: return pick(std::integral_constant<int, 3>{});  case 4: return pick(std::integral_constant<int, 4>{});
    case 5: return pick(std::integral_constant<int, 5>{});  case 6: return pick(std::integral_constant<int, 6>{});
    case 7: return pick(std::integral_constant<int, 7>{});  default: return pick(std::integral_constant<int, 8>{});
  }
}

}  // namespace specfree
