// specfree::top_ids -- the ids of each row's k largest logits, largest first.
//
// Token recycling and LogitSpec read every verified row's top-k ids each step. torch.topk over a
// 49152-entry row costs ~150 us on the 2-core Zen 3 VM, about what the whole row takes to read
// 50 times; a step of 5 rows spent half a millisecond there. One pass suffices: keep the k best
// so far in a sorted list and look at a vector of 8 entries only when one of them beats the k-th
// best (a few dozen times a row, for logits). Rows holding NaN, or fewer than k entries above
// -inf, go to torch.topk instead, so the values always equal torch's; among equal values the
// lower id comes first (torch.topk leaves their order unspecified).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include "isa.h"

#include <cstdint>
#include <limits>

namespace {

constexpr int64_t kMaxK = 64;

// Returns false where the row needs torch.topk (a NaN, or fewer than k entries above -inf).
SPECFREE_AVX2 bool row_top(const float* x, int64_t n, int64_t k, int64_t* out) {
  float vals[kMaxK];
  int64_t ids[kMaxK];
  int64_t have = 0;
  float thr = -std::numeric_limits<float>::infinity();
  auto insert = [&](float v, int64_t id) {
    if (!(v > thr)) return;  // thr only rises, so a bit set by an older thr may no longer qualify
    int64_t pos = have < k ? have++ : k - 1;
    while (pos > 0 && vals[pos - 1] < v) {  // equal values keep the earlier id first
      vals[pos] = vals[pos - 1];
      ids[pos] = ids[pos - 1];
      --pos;
    }
    vals[pos] = v;
    ids[pos] = id;
    if (have == k) thr = vals[k - 1];
  };
  int nan = 0;
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    nan |= _mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    int above = _mm256_movemask_ps(_mm256_cmp_ps(v, _mm256_set1_ps(thr), _CMP_GT_OQ));
    while (above) {
      const int j = __builtin_ctz(above);
      above &= above - 1;
      insert(x[i + j], i + j);
    }
  }
  for (; i < n; ++i) {
    nan |= x[i] != x[i];
    insert(x[i], i);
  }
  if (nan || have < k) return false;
  for (int64_t j = 0; j < k; ++j) out[j] = ids[j];
  return true;
}

at::Tensor top_ids(const at::Tensor& logits, int64_t k) {
  TORCH_CHECK(logits.device().is_cpu() && logits.dim() == 2, "specfree::top_ids takes [rows, vocab] CPU logits");
  TORCH_CHECK(k >= 1 && k <= kMaxK && k <= logits.size(1), "specfree::top_ids: k must be in [1, min(",
              kMaxK, ", vocab)], not ", k);
  if (logits.scalar_type() != at::kFloat || specfree::best_isa() == specfree::Isa::kNone)
    return std::get<1>(at::topk(logits, k, -1));
  const at::Tensor x = logits.contiguous();
  const int64_t rows = x.size(0), n = x.size(1);
  at::Tensor out = at::empty({rows, k}, x.options().dtype(at::kLong));
  std::vector<uint8_t> done(rows, 0);
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      done[r] = row_top(x.data_ptr<float>() + r * n, n, k, out.data_ptr<int64_t>() + r * k);
  });
  for (int64_t r = 0; r < rows; ++r)
    if (!done[r]) out[r].copy_(std::get<1>(at::topk(x[r], k)));
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specfree, m) { m.def("top_ids(Tensor logits, int k) -> Tensor"); }

TORCH_LIBRARY_IMPL(specfree, CPU, m) { m.impl("top_ids", &top_ids); }
