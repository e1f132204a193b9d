// The CPU code paths both kernels choose between at run time, and how an op's `isa` argument
// picks one. Included by few_row_linear.cpp and tree_attention.cpp (one library).
#pragma once

#include <ATen/ATen.h>
#include <immintrin.h>

#include <string>

namespace specfree {

enum class Isa { kNone = 0, kAvx2 = 1, kAvx512 = 2 };

inline Isa best_isa() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")) return Isa::kAvx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return Isa::kAvx2;
  return Isa::kNone;
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

#define SPECFREE_AVX2 __attribute__((target("avx2,fma")))
#define SPECFREE_AVX512 __attribute__((target("avx512f,avx512bw,avx2,fma")))

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

}  // namespace specfree
