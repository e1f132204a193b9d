// The CPU code paths both kernels choose between at run time, and how an op's `isa` argument
// picks one. Included by few_row_linear.cpp and tree_attention.cpp (one library).
#pragma once

#include <ATen/ATen.h>

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

}  // namespace specfree
