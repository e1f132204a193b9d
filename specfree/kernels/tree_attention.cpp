// specfree::tree_attention -- attention for the rows of one step over the KV store, with each
// row's result independent of everything but the keys it sees (batch invariance by construction).
//
// query [B, H, Q, D] (any strides), key/value [B, Hkv, S, D] (D contiguous: the cache's own
// tensors, static slots included), mask [B or 1, 1, Q, S] (bool: true = visible; or additive
// float: -inf or the dtype's lowest value = hidden, anything else is added to the score) or none
// (causal, aligned to the last key). Output [B, Q, H, D], the layout transformers expects back.
//
// Why every row gets the same bits whatever else is in the call: a row's result is a fixed
// sequence of float operations over the keys it sees, in position order, and nothing else:
//   score_j = dot(q, k_j) * scale (+ mask)    one vector accumulator over D, then a fixed reduction
//                                             (soft-capped first where asked: Gemma 2)
//   m       = max_j score_j                   exact: the order of a max does not matter
//   p_j     = exp(score_j - m)                elementwise, the same polynomial in every lane
//   l       = sum_j p_j,  o = sum_j p_j v_j   added in key order, one key at a time
//   out     = o / l
// Keys a row may not see are skipped, never added as exp(-inf) * v (an empty slot may hold
// anything). The exact max makes the usual online rescaling (whose blocks would depend on where
// the keys sit) unnecessary: two passes over the keys, K then V.
//
// The work is split by (batch, key/value head, chunk of its rows): each task reads each key and
// value that some row sees once, for all the query rows of its chunk (Q * H/Hkv rows make a
// group); keys no row sees (empty static slots, keys outside every row's window) are never read.
// Two code paths chosen at run time (AVX-512, AVX2); they round differently from each other;
// within one process one path is used. float32 or bfloat16 (a bf16 model's query, keys and values
// are widened exactly as they are read, every sum is float32, and the output is rounded once).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include "c_entries.h"
#include "isa.h"

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

namespace {

using specfree::Isa;
using specfree::best_isa;
using specfree::sum16;
using specfree::sum8;

constexpr int64_t kPad = 16;  // score rows are padded to whole vectors, so exp needs no scalar tail
constexpr float kLowest = -0.5f * FLT_MAX;  // float mask entries below this hide their key

// The per-ISA pieces: each is called once per key (or per row), never per (row, key) pair.
//   scores(q, rows, d, k, out, stride, scale): out[r * stride] = dot(q[r], k) * scale for every row
//   accumulate(acc, p, stride, seen, rows, d, v, l): for rows that see the key: acc[r] += p[r] v, l[r] += p[r]
//   exp_shifted(x, n, m): x[i] = exp(x[i] - m), n a multiple of kPad; exp(-inf) = 0

// exp(x) for x <= 0: x = n ln2 + r with |r| <= ln2/2, a degree-6 polynomial in r, times 2^n. Below
// -87.3 (where 2^n would be subnormal) the result is 0. Every lane computes the same formula.
#define SPECFREE_EXP(ATTR, NAME, VEC, SET1, ADD, SUB, MUL, FMA, ROUND, CVT, SHIFT, ADDI, CASTI, BLEND_ZERO)  \
  ATTR inline VEC NAME(VEC x) {                                                                    \
    const VEC low = SET1(-87.3f);                                                                  \
    VEC n = ROUND(MUL(x, SET1(1.44269504088896341f)));                                             \
    VEC r = FMA(n, SET1(-0.693359375f), x);                                                        \
    r = FMA(n, SET1(2.12194440e-4f), r);                                                           \
    VEC p = SET1(1.9875691500e-4f);                                                                \
    p = FMA(p, r, SET1(1.3981999507e-3f));                                                         \
    p = FMA(p, r, SET1(8.3334519073e-3f));                                                         \
    p = FMA(p, r, SET1(4.1665795894e-2f));                                                         \
    p = FMA(p, r, SET1(1.6666665459e-1f));                                                         \
    p = FMA(p, r, SET1(5.0000001201e-1f));                                                         \
    p = FMA(p, MUL(r, r), ADD(r, SET1(1.0f)));                                                     \
    VEC scale = CASTI(SHIFT(ADDI(CVT(n), 127), 23));                                               \
    return BLEND_ZERO(MUL(p, scale), x, low);                                                      \
  }

SPECFREE_AVX2 inline __m256 round8(__m256 x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
SPECFREE_AVX2 inline __m256i add8i(__m256i a, int b) { return _mm256_add_epi32(a, _mm256_set1_epi32(b)); }
SPECFREE_AVX2 inline __m256 zero_below8(__m256 y, __m256 x, __m256 low) {
  // x < low (and NaN-free -inf) gives 0; elsewhere y (the clamp keeps 2^n a normal number)
  return _mm256_and_ps(y, _mm256_cmp_ps(x, low, _CMP_GE_OQ));
}
SPECFREE_AVX512 inline __m512 round16(__m512 x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
SPECFREE_AVX512 inline __m512i add16i(__m512i a, int b) { return _mm512_add_epi32(a, _mm512_set1_epi32(b)); }
SPECFREE_AVX512 inline __m512 zero_below16(__m512 y, __m512 x, __m512 low) {
  return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, low, _CMP_GE_OQ), y);
}

SPECFREE_EXP(SPECFREE_AVX2, exp8, __m256, _mm256_set1_ps, _mm256_add_ps, _mm256_sub_ps, _mm256_mul_ps,
             _mm256_fmadd_ps, round8, _mm256_cvtps_epi32, _mm256_slli_epi32, add8i, _mm256_castsi256_ps,
             zero_below8)
SPECFREE_EXP(SPECFREE_AVX512, exp16, __m512, _mm512_set1_ps, _mm512_add_ps, _mm512_sub_ps, _mm512_mul_ps,
             _mm512_fmadd_ps, round16, _mm512_cvtps_epi32, _mm512_slli_epi32, add16i, _mm512_castsi512_ps,
             zero_below16)


// Logit soft-capping (Gemma 2): cap * tanh(x / cap), lane by lane. tanh(y) = sign(y) (1 - e) / (1 + e)
// with e = exp(-2|y|); below |y| = 0.3125 that quotient loses digits to cancellation, so an odd
// Taylor polynomial to y^13 (error under 1e-9 relative there) takes its place. Every score of
// every path goes through this one function (softcap1 is its lane 0), so a score's bits do not
// depend on the path, the block or the other rows.
SPECFREE_AVX2 inline __m256 softcap8(__m256 x, float cap) {
  const __m256 capv = _mm256_set1_ps(cap), sign = _mm256_set1_ps(-0.0f), one = _mm256_set1_ps(1.0f);
  const __m256 y = _mm256_div_ps(x, capv);
  const __m256 a = _mm256_andnot_ps(sign, y);
  const __m256 e = exp8(_mm256_mul_ps(a, _mm256_set1_ps(-2.0f)));
  const __m256 big = _mm256_div_ps(_mm256_sub_ps(one, e), _mm256_add_ps(one, e));
  const __m256 a2 = _mm256_mul_ps(a, a);
  __m256 p = _mm256_set1_ps(21844.0f / 6081075.0f);
  p = _mm256_fmadd_ps(p, a2, _mm256_set1_ps(-1382.0f / 155925.0f));
  p = _mm256_fmadd_ps(p, a2, _mm256_set1_ps(62.0f / 2835.0f));
  p = _mm256_fmadd_ps(p, a2, _mm256_set1_ps(-17.0f / 315.0f));
  p = _mm256_fmadd_ps(p, a2, _mm256_set1_ps(2.0f / 15.0f));
  p = _mm256_fmadd_ps(p, a2, _mm256_set1_ps(-1.0f / 3.0f));
  const __m256 small = _mm256_fmadd_ps(_mm256_mul_ps(p, a2), a, a);
  const __m256 t = _mm256_blendv_ps(small, big, _mm256_cmp_ps(a, _mm256_set1_ps(0.3125f), _CMP_GE_OQ));
  return _mm256_mul_ps(_mm256_or_ps(t, _mm256_and_ps(sign, y)), capv);
}
SPECFREE_AVX2 inline float softcap1(float x, float cap) { return _mm256_cvtss_f32(softcap8(_mm256_set1_ps(x), cap)); }

#define SPECFREE_PIECES(ATTR, SUFFIX, VEC, LANES, ZERO, LOAD, STORE, SET1, FMA, MAX, SUM, EXP)          \
  template <typename T>                                                                                  \
  ATTR void scores_##SUFFIX(const float* q, int64_t rows, int64_t d, const T* k, float* out,               \
                            int64_t stride, float scale) {                                                \
    const int64_t full = d - d % LANES;                                                                  \
    for (int64_t r = 0; r < rows; ++r) {                                                                 \
      const float* qr = q + r * d;                                                                       \
      VEC acc = ZERO();                                                                                  \
      for (int64_t i = 0; i < full; i += LANES) acc = FMA(LOAD(qr + i), LOAD(k + i), acc);               \
      float dot = SUM(acc);                                                                              \
      for (int64_t i = full; i < d; ++i) dot += qr[i] * static_cast<float>(k[i]);                        \
      out[r * stride] = dot * scale;                                                                     \
    }                                                                                                    \
  }                                                                                                      \
  template <typename T>                                                                                  \
  ATTR void accumulate_##SUFFIX(float* acc, const float* p, int64_t stride, const uint8_t* seen,          \
                                int64_t rows, int64_t d, const T* v, float* l) {                         \
    const int64_t full = d - d % LANES;                                                                  \
    for (int64_t r = 0; r < rows; ++r) {                                                                 \
      if (!seen[r]) continue;                                                                            \
      const float pr = p[r * stride];                                                                    \
      const VEC pv = SET1(pr);                                                                           \
      float* ar = acc + r * d;                                                                           \
      for (int64_t i = 0; i < full; i += LANES) STORE(ar + i, FMA(pv, LOAD(v + i), LOAD(ar + i)));       \
      for (int64_t i = full; i < d; ++i) ar[i] += pr * static_cast<float>(v[i]);                         \
      l[r] += pr;                                                                                        \
    }                                                                                                    \
  }                                                                                                      \
  ATTR float max_##SUFFIX(const float* x, int64_t n) {                                                   \
    VEC m = SET1(-std::numeric_limits<float>::infinity());                                               \
    for (int64_t i = 0; i < n; i += LANES) m = MAX(m, LOAD(x + i));                                      \
    alignas(64) float lanes[LANES];                                                                      \
    STORE(lanes, m);                                                                                     \
    return *std::max_element(lanes, lanes + LANES);                                                      \
  }                                                                                                      \
  ATTR void exp_shifted_##SUFFIX(float* x, int64_t n, float m) {                                         \
    const VEC mv = SET1(m);                                                                              \
    for (int64_t i = 0; i < n; i += LANES) STORE(x + i, EXP(_##SUFFIX##_sub(LOAD(x + i), mv)));          \
  }

SPECFREE_AVX2 inline __m256 _avx2_sub(__m256 a, __m256 b) { return _mm256_sub_ps(a, b); }
SPECFREE_AVX512 inline __m512 _avx512_sub(__m512 a, __m512 b) { return _mm512_sub_ps(a, b); }

// LOAD widens bf16 keys and values exactly (specfree::load8/load16); float32 loads as it is.
SPECFREE_PIECES(SPECFREE_AVX2, avx2, __m256, 8, _mm256_setzero_ps, specfree::load8, _mm256_storeu_ps,
                _mm256_set1_ps, _mm256_fmadd_ps, _mm256_max_ps, sum8, exp8)
SPECFREE_PIECES(SPECFREE_AVX512, avx512, __m512, 16, _mm512_setzero_ps, specfree::load16, _mm512_storeu_ps,
                _mm512_set1_ps, _mm512_fmadd_ps, _mm512_max_ps, sum16, exp16)

// A block of up to kBlock keys for every row, with the head dim a whole number ND of vectors: a
// row's query (pass 1) or accumulator (pass 2) stays in registers over the block, and the keys'
// chains are independent of each other. Per (row, key) the arithmetic is exactly the generic
// pieces' above (same vectors, same order), so which path or block a key falls in changes no bit.
constexpr int kBlock = 8;
constexpr int64_t kMinChunkRows = 4;

struct Block {
  const int64_t* keys;  // ascending key indices
  int count;
  bool run;               // kBlock keys in a row (keys[j] = keys[0] + j): most blocks of a step
  const uint8_t* seen;    // [Q, W]
  const uint8_t* seen_t;  // [W, Q]
  const float* bias;      // [Q, W] or null
  int64_t q_len, width;  // width: the row stride of seen and bias (Visibility::width)
  const int64_t* qrow;  // per row of the chunk, its query position (a table: no division per block)
  float softcap;        // > 0: scores soft-capped (softcap8) before the mask's values are added
};

// Whether a row sees all kBlock keys of a run (its kBlock visibility bytes are all 1).
inline bool all_seen(const uint8_t* flags) {
  uint64_t word;
  std::memcpy(&word, flags, sizeof word);
  return word == 0x0101010101010101ull;
}
static_assert(kBlock == 8, "all_seen reads one byte per key of a block");

#define SPECFREE_ACCUMULATE_BLOCK(ATTR, SUFFIX, VEC, LANES, LOAD, STORE, SET1, FMA)                    \
  template <int ND, typename T>                                                                       \
  ATTR void accumulate_block_##SUFFIX(const Block& b, float* acc, const float* p, int64_t stride,     \
                                      int64_t rows, const T* v, int64_t vs, float* l) {                \
    /* Two rows that see the whole run share each value's loads, and their accumulators make twice \
       the independent FMA chains; per row and dim the same FMAs in the same key order. */           \
    constexpr bool kPairs = 3 * ND + 2 <= (LANES == 16 ? 32 : 16); /* accumulators, values, p */      \
    int64_t r = 0;                                                                                    \
    for (; kPairs && b.run && r + 1 < rows; r += 2) {                                                 \
      if (!all_seen(b.seen + b.qrow[r] * b.width + b.keys[0]) ||                                      \
          !all_seen(b.seen + b.qrow[r + 1] * b.width + b.keys[0]))                                    \
        break;                                                                                        \
      VEC a0[ND], a1[ND];                                                                             \
      float* ar0 = acc + r * ND * LANES;                                                              \
      float* ar1 = ar0 + ND * LANES;                                                                  \
      for (int i = 0; i < ND; ++i) a0[i] = LOAD(ar0 + i * LANES), a1[i] = LOAD(ar1 + i * LANES);      \
      float l0 = l[r], l1 = l[r + 1];                                                                 \
      const float* p0 = p + r * stride + b.keys[0];                                                   \
      const float* p1 = p0 + stride;                                                                  \
      const T* vj = v + b.keys[0] * vs;                                                               \
      for (int j = 0; j < kBlock; ++j, vj += vs) {                                                    \
        const VEC pv0 = SET1(p0[j]), pv1 = SET1(p1[j]);                                               \
        for (int i = 0; i < ND; ++i) {                                                                \
          const VEC vv = LOAD(vj + i * LANES);                                                        \
          a0[i] = FMA(pv0, vv, a0[i]);                                                                \
          a1[i] = FMA(pv1, vv, a1[i]);                                                                \
        }                                                                                             \
        l0 += p0[j];                                                                                  \
        l1 += p1[j];                                                                                  \
      }                                                                                               \
      for (int i = 0; i < ND; ++i) STORE(ar0 + i * LANES, a0[i]), STORE(ar1 + i * LANES, a1[i]);      \
      l[r] = l0;                                                                                      \
      l[r + 1] = l1;                                                                                  \
    }                                                                                                 \
    for (; r < rows; ++r) {                                                                           \
      VEC a[ND];                                                                                      \
      float* ar = acc + r * ND * LANES;                                                               \
      for (int i = 0; i < ND; ++i) a[i] = LOAD(ar + i * LANES);                                       \
      float lr = l[r];                                                                                \
      const int64_t qi = b.qrow[r];                                                                   \
      if (b.run && all_seen(b.seen + qi * b.width + b.keys[0])) { /* the same sums, no test per key */ \
        const float* pr = p + r * stride + b.keys[0];                                                 \
        const T* vj = v + b.keys[0] * vs;                                                             \
        for (int j = 0; j < kBlock; ++j, vj += vs) {                                                  \
          const VEC pv = SET1(pr[j]);                                                                 \
          for (int i = 0; i < ND; ++i) a[i] = FMA(pv, LOAD(vj + i * LANES), a[i]);                    \
          lr += pr[j];                                                                                \
        }                                                                                             \
      } else {                                                                                        \
        for (int j = 0; j < b.count; ++j) {                                                           \
          const int64_t s = b.keys[j];                                                                \
          if (!b.seen_t[s * b.q_len + qi]) continue;                                                  \
          const float pr = p[r * stride + s];                                                         \
          const VEC pv = SET1(pr);                                                                    \
          const T* vj = v + s * vs;                                                                   \
          for (int i = 0; i < ND; ++i) a[i] = FMA(pv, LOAD(vj + i * LANES), a[i]);                    \
          lr += pr;                                                                                   \
        }                                                                                             \
      }                                                                                               \
      for (int i = 0; i < ND; ++i) STORE(ar + i * LANES, a[i]);                                       \
      l[r] = lr;                                                                                      \
    }                                                                                                 \
  }

SPECFREE_ACCUMULATE_BLOCK(SPECFREE_AVX2, avx2, __m256, 8, specfree::load8, _mm256_storeu_ps, _mm256_set1_ps,
                          _mm256_fmadd_ps)
SPECFREE_ACCUMULATE_BLOCK(SPECFREE_AVX512, avx512, __m512, 16, specfree::load16, _mm512_storeu_ps, _mm512_set1_ps,
                          _mm512_fmadd_ps)

// Lane j of the result is sum8(a[j]) bit for bit (the same additions, in the same tree), for eight
// keys at once: one horizontal sum per key cost more than the key's eight FMAs.
SPECFREE_AVX2 inline __m256 sum8x8(const __m256 a[8]) {
  __m256 t[4];  // lo + hi of keys j and j + 4, side by side
  for (int j = 0; j < 4; ++j)
    t[j] = _mm256_add_ps(_mm256_permute2f128_ps(a[j], a[j + 4], 0x20), _mm256_permute2f128_ps(a[j], a[j + 4], 0x31));
  // s0 + s2, s1 + s3 of keys 0, 1 (4, 5) and 2, 3 (6, 7)
  const __m256 w01 = _mm256_add_ps(_mm256_shuffle_ps(t[0], t[1], _MM_SHUFFLE(1, 0, 1, 0)),
                                   _mm256_shuffle_ps(t[0], t[1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m256 w23 = _mm256_add_ps(_mm256_shuffle_ps(t[2], t[3], _MM_SHUFFLE(1, 0, 1, 0)),
                                   _mm256_shuffle_ps(t[2], t[3], _MM_SHUFFLE(3, 2, 3, 2)));
  return _mm256_add_ps(_mm256_shuffle_ps(w01, w23, _MM_SHUFFLE(2, 0, 2, 0)),  // keys 0..7 in order
                       _mm256_shuffle_ps(w01, w23, _MM_SHUFFLE(3, 1, 3, 1)));
}

// A block's eight scores of one row, ``sums`` (lane j: key j's dot product), scaled, soft-capped
// and masked into the row's scores: hidden keys -inf, mask values added.
SPECFREE_AVX2 inline void store_block_scores(const Block& b, int64_t r, __m256 sums, float* out, int64_t stride,
                                             float scale) {
  const __m256 scaled = _mm256_mul_ps(sums, _mm256_set1_ps(scale));
  const __m256 scores = b.softcap > 0 ? softcap8(scaled, b.softcap) : scaled;
  const int64_t qrow = b.qrow[r];
  if (b.run) {  // the eight scores (+ mask values) stored at once, hidden keys -inf as below
    const int64_t s0 = b.keys[0];
    const __m128i flags = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b.seen + qrow * b.width + s0));
    const __m256 shown = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_cvtepu8_epi32(flags), _mm256_setzero_si256()));
    const __m256 value = b.bias ? _mm256_add_ps(scores, _mm256_loadu_ps(b.bias + qrow * b.width + s0)) : scores;
    const __m256 hidden = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
    _mm256_storeu_ps(out + r * stride + s0, _mm256_blendv_ps(hidden, value, shown));
    return;
  }
  alignas(32) float x[kBlock];
  _mm256_store_ps(x, scores);
  for (int j = 0; j < b.count; ++j) {
    const int64_t s = b.keys[j];
    out[r * stride + s] = !b.seen_t[s * b.q_len + qrow] ? -std::numeric_limits<float>::infinity()
                          : b.bias ? x[j] + b.bias[qrow * b.width + s] : x[j];
  }
}

// A block's scores: per (row, key) the FMAs of scores_avx2 / scores_avx512, eight keys'
// accumulators side by side (independent chains), each folded to 8 lanes as sum16 folds it (AVX-512;
// AVX2's are 8 already), then the eight reduced together by sum8x8: the bits of one sum8 / sum16 per
// key, without a horizontal sum per key (which cost more than the key's FMAs).
#define SPECFREE_SCORES_BLOCK(ATTR, NAME, VEC, LANES, ZERO, LOAD, FMA, FOLD)                           \
  template <int ND, typename T>                                                                        \
  ATTR void NAME(const Block& b, const float* q, int64_t rows, const T* k, int64_t ks, float* out,     \
                 int64_t stride, float scale) {                                                        \
    alignas(64) static const T zeros[ND * LANES] = {};                                                 \
    const T* kj[kBlock]; /* a block's missing keys read zeros (their scores are not stored) */         \
    for (int j = 0; j < kBlock; ++j) kj[j] = j < b.count ? k + b.keys[j] * ks : zeros;                \
    for (int64_t r = 0; r < rows; ++r) {                                                               \
      const float* qr = q + r * ND * LANES;                                                            \
      VEC acc[kBlock];                                                                                 \
      _Pragma("GCC unroll 8") for (int j = 0; j < kBlock; ++j) acc[j] = ZERO();                        \
      for (int i = 0; i < ND; ++i) { /* per key, the dims in the order the per-key piece takes them */ \
        const VEC qi = LOAD(qr + i * LANES);                                                           \
        _Pragma("GCC unroll 8") for (int j = 0; j < kBlock; ++j) acc[j] = FMA(qi, LOAD(kj[j] + i * LANES), acc[j]); \
      }                                                                                                \
      __m256 folded[kBlock];                                                                           \
      _Pragma("GCC unroll 8") for (int j = 0; j < kBlock; ++j) folded[j] = FOLD(acc[j]);               \
      store_block_scores(b, r, sum8x8(folded), out, stride, scale);                                    \
    }                                                                                                  \
  }

SPECFREE_AVX2 inline __m256 fold8(__m256 v) { return v; }
SPECFREE_AVX512 inline __m256 fold16(__m512 v) {  // sum16's first step: low 8 lanes + high 8 lanes
  return _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}
SPECFREE_SCORES_BLOCK(SPECFREE_AVX2, scores_block8_avx2, __m256, 8, _mm256_setzero_ps, specfree::load8,
                      _mm256_fmadd_ps, fold8)
SPECFREE_SCORES_BLOCK(SPECFREE_AVX512, scores_block16_avx512, __m512, 16, _mm512_setzero_ps, specfree::load16,
                      _mm512_fmadd_ps, fold16)

// T: the keys' and values' element type (float32, or bf16 widened exactly as it is loaded).
template <typename T>
struct Pieces {
  void (*scores)(const float*, int64_t, int64_t, const T*, float*, int64_t, float);
  void (*accumulate)(float*, const float*, int64_t, const uint8_t*, int64_t, int64_t, const T*, float*);
  float (*max)(const float*, int64_t);
  void (*exp_shifted)(float*, int64_t, float);
  // null: the head dim has no block path (the generic pieces run)
  void (*scores_block)(const Block&, const float*, int64_t, const T*, int64_t, float*, int64_t, float);
  void (*accumulate_block)(const Block&, float*, const float*, int64_t, int64_t, const T*, int64_t, float*);
};

// Head dims 64 and 128 (most models) get the block path.
template <typename T>
Pieces<T> pieces(Isa isa, int64_t d) {
  if (isa == Isa::kAvx512) {
    Pieces<T> f{scores_avx512<T>, accumulate_avx512<T>, max_avx512, exp_shifted_avx512, nullptr, nullptr};
    if (d == 64) f.scores_block = scores_block16_avx512<4, T>, f.accumulate_block = accumulate_block_avx512<4, T>;
    if (d == 128) f.scores_block = scores_block16_avx512<8, T>, f.accumulate_block = accumulate_block_avx512<8, T>;
    return f;
  }
  Pieces<T> f{scores_avx2<T>, accumulate_avx2<T>, max_avx2, exp_shifted_avx2, nullptr, nullptr};
  if (d == 64) f.scores_block = scores_block8_avx2<8, T>, f.accumulate_block = accumulate_block_avx2<8, T>;
  return f;  // 128 would need 16 accumulators plus the query: more than AVX2's 16 registers
}

// Which keys each query row sees: seen[q * W + s] for the keys up to the last one some row sees
// (W of them: a static cache's empty slots past it are never scanned again), hidden-or-added
// mask values; plus the keys some row sees (the only ones read).
struct Visibility {
  int64_t width = 0;           // W: one past the last key some row sees
  std::vector<uint8_t> seen;   // [Q, W]
  std::vector<float> bias;     // [Q, W] additive values (empty: none)
  std::vector<int64_t> keys;   // ascending keys some row sees
  std::vector<uint8_t> seen_t; // [W, Q]: per key, which rows see it
};

// One past the last key a bool mask's ``row`` sees (0: none), scanning from the end a word at
// a time where the keys are contiguous: a static cache's mask is mostly empty slots at its end.
int64_t last_seen(const bool* row, int64_t ss, int64_t s_len) {
  int64_t s = s_len;
  if (ss == 1) {
    for (; s >= 8; s -= 8) {
      uint64_t word;
      std::memcpy(&word, row + s - 8, sizeof word);
      if (word) break;
    }
  }
  for (; s > 0; --s)
    if (row[(s - 1) * ss]) return s;
  return 0;
}

Visibility visibility(const std::optional<at::Tensor>& mask, int64_t b, int64_t q_len, int64_t s_len) {
  Visibility vis;
  if (!mask.has_value() || !mask->defined()) {  // causal, the last query row on the last key
    vis.width = s_len;
    vis.seen.assign(q_len * s_len, 0);
    for (int64_t q = 0; q < q_len; ++q)
      for (int64_t s = 0; s <= s_len - q_len + q && s < s_len; ++s) vis.seen[q * s_len + s] = 1;
  } else {
    // [Q, S] of this batch row, read through its strides (a select and a contiguous copy per call
    // cost more than the loop at a few rows); bool or float (tree_attention converts other dtypes)
    const at::Tensor& m = *mask;
    const int64_t sq = m.stride(2), ss = m.stride(3), offset = m.size(0) == 1 ? 0 : b * m.stride(0);
    if (m.scalar_type() == at::kBool) {
      const bool* data = m.data_ptr<bool>() + offset;
      for (int64_t q = 0; q < q_len; ++q) vis.width = std::max(vis.width, last_seen(data + q * sq, ss, s_len));
      const int64_t w = vis.width;
      vis.seen.assign(q_len * w, 0);
      for (int64_t q = 0; q < q_len; ++q)
        for (int64_t s = 0; s < w; ++s) vis.seen[q * w + s] = data[q * sq + s * ss];
    } else {
      const float* data = m.data_ptr<float>() + offset;
      for (int64_t q = 0; q < q_len; ++q) {
        int64_t s = s_len;
        while (s > vis.width && !(data[q * sq + (s - 1) * ss] >= kLowest)) --s;
        vis.width = std::max(vis.width, s);
      }
      const int64_t w = vis.width;
      vis.seen.assign(q_len * w, 0);
      bool any_bias = false;
      for (int64_t q = 0; q < q_len; ++q)
        for (int64_t s = 0; s < w; ++s) {
          const float x = data[q * sq + s * ss];
          vis.seen[q * w + s] = x >= kLowest;
          any_bias |= x >= kLowest && x != 0.0f;
        }
      if (any_bias) {
        vis.bias.resize(q_len * w);
        for (int64_t q = 0; q < q_len; ++q)
          for (int64_t s = 0; s < w; ++s) vis.bias[q * w + s] = data[q * sq + s * ss];
      }
    }
  }
  const int64_t w = vis.width;
  vis.seen_t.assign(w * q_len, 0);
  for (int64_t s = 0; s < w; ++s) {
    bool any = false;
    for (int64_t q = 0; q < q_len; ++q) {
      vis.seen_t[s * q_len + q] = vis.seen[q * w + s];
      any |= vis.seen[q * w + s];
    }
    if (any) vis.keys.push_back(s);
  }
  return vis;
}

// Where one (batch, key/value head)'s rows live: row r = q * G + g is query head h * G + g at
// position q, read from the query and written to the output through their strides (no reshaped
// copies of either: at a few rows those ATen calls cost more than the arithmetic).
template <typename T>
struct HeadRows {
  const T* q;  // [b, h * G, 0, 0]
  int64_t q_head, q_pos;
  T* out;      // [b, 0, h * G, 0] of the [B, Q, H, D] result
  int64_t out_head, out_pos;
  int64_t groups;
};

// The rows (keys or values) of the block of keys starting at keys[first], asked for ahead of use:
// a one-row step streams each head's keys and values once, and waits on memory without it.
constexpr int64_t kAheadKeys = 4 * kBlock;
template <typename T>
inline void prefetch_rows(const T* base, int64_t stride, int64_t bytes, const int64_t* keys, int64_t first,
                          int64_t n_keys) {
  const int64_t last = std::min(first + kBlock, n_keys);
  for (int64_t j = first; j < last; ++j) {
    const char* row = reinterpret_cast<const char*>(base + keys[j] * stride);
    for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch(row + b, _MM_HINT_T0);
  }
}

// Rows [row0, row0 + rows) of one (batch, key/value head). A row's arithmetic does not depend on
// which other rows run beside it, so the rows of a group can be split into chunks that run in
// parallel (SmolLM2 has 3 key/value heads: 3 tasks would keep one of 2 threads idle half the time).
template <typename T>
void head_group(const Pieces<T>& f, const Visibility& vis, const HeadRows<T>& place, const T* k, const T* v,
                int64_t ks, int64_t vs, int64_t q_len, int64_t row0, int64_t rows, int64_t d,
                float scale, float softcap) {
  std::vector<int64_t> qrow(rows);
  std::vector<float> q(rows * d);  // the chunk's query rows side by side, [rows, D]
  for (int64_t r = 0; r < rows; ++r) {
    qrow[r] = (row0 + r) / place.groups;
    const T* src = place.q + (row0 + r) % place.groups * place.q_head + qrow[r] * place.q_pos;
    std::copy(src, src + d, q.data() + r * d);  // bf16 widened exactly
  }
  // Score rows span the keys up to the last one some row sees, not every slot: over static slots
  // (2304 for SmolLM2's package) the max and exp passes would otherwise run over the empty ones.
  // Neither depends on the span (an exact max; exp lane by lane), so the bits do not either.
  const int64_t n_keys = static_cast<int64_t>(vis.keys.size());
  const int64_t span = n_keys ? vis.keys.back() + 1 : 0;
  const int64_t width = (span + kPad - 1) / kPad * kPad;
  std::vector<float> score(rows * width, -std::numeric_limits<float>::infinity());
  std::vector<uint8_t> seen(rows);
  auto block = [&](int64_t j) {
    const int count = static_cast<int>(std::min<int64_t>(kBlock, n_keys - j));
    const bool run = count == kBlock && vis.keys[j + kBlock - 1] - vis.keys[j] == kBlock - 1;
    return Block{vis.keys.data() + j, count, run, vis.seen.data(), vis.seen_t.data(),
                 vis.bias.empty() ? nullptr : vis.bias.data(), q_len, vis.width, qrow.data(), softcap};
  };
  if (f.scores_block) {  // pass 1: every row's score on each key some row sees
    for (int64_t j = 0; j < n_keys; j += kBlock) {
      prefetch_rows(k, ks, d * sizeof(T), vis.keys.data(), j + kAheadKeys, n_keys);
      f.scores_block(block(j), q.data(), rows, k, ks, score.data(), width, scale);
    }
  } else {
    for (const int64_t s : vis.keys) {
      f.scores(q.data(), rows, d, k + s * ks, score.data() + s, width, scale);
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t qi = qrow[r];
        float& x = score[r * width + s];
        if (softcap > 0) x = softcap1(x, softcap);
        x = vis.seen_t[s * q_len + qi] ? (vis.bias.empty() ? x : x + vis.bias[qi * vis.width + s])
                                       : -std::numeric_limits<float>::infinity();
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) {  // p = exp(score - max), hidden keys 0 (and skipped below)
    float* row = score.data() + r * width;
    const float m = f.max(row, width);
    if (m != -std::numeric_limits<float>::infinity()) f.exp_shifted(row, width, m);
  }
  std::vector<float> acc(rows * d, 0.0f), l(rows, 0.0f);
  if (f.accumulate_block) {  // pass 2: values, in key order for every row
    for (int64_t j = 0; j < n_keys; j += kBlock) {
      prefetch_rows(v, vs, d * sizeof(T), vis.keys.data(), j + kAheadKeys, n_keys);
      f.accumulate_block(block(j), acc.data(), score.data(), width, rows, v, vs, l.data());
    }
  } else {
    for (const int64_t s : vis.keys) {
      for (int64_t r = 0; r < rows; ++r) seen[r] = vis.seen_t[s * q_len + qrow[r]];
      f.accumulate(acc.data(), score.data() + s, width, seen.data(), rows, d, v + s * vs, l.data());
    }
  }
  for (int64_t r = 0; r < rows; ++r) {  // a row that sees nothing gets zeros
    const float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
    T* out = place.out + (row0 + r) % place.groups * place.out_head + qrow[r] * place.out_pos;
    for (int64_t i = 0; i < d; ++i) out[i] = static_cast<T>(acc[r * d + i] * inv);  // bf16: rounded once
  }
}

Isa parse_isa(const std::string& name) { return specfree::parse_isa(name, "specfree::tree_attention"); }

at::Tensor tree_attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                          const std::optional<at::Tensor>& mask, double scale, c10::string_view isa_name,
                          double softcap) {
  TORCH_CHECK(query.device().is_cpu() && key.device().is_cpu() && value.device().is_cpu(),
              "specfree::tree_attention runs on the CPU");
  TORCH_CHECK(query.dim() == 4 && key.dim() == 4 && value.dim() == 4,
              "specfree::tree_attention: query, key and value must be [B, heads, rows, head_dim]");
  TORCH_CHECK((query.scalar_type() == at::kFloat || query.scalar_type() == at::kBFloat16) &&
                  key.scalar_type() == query.scalar_type() && value.scalar_type() == query.scalar_type(),
              "specfree::tree_attention: query, key and value must all be float32 or all bfloat16");
  const int64_t batch = query.size(0), heads = query.size(1), q_len = query.size(2), d = query.size(3);
  const int64_t kv_heads = key.size(1), s_len = key.size(2);
  TORCH_CHECK(key.sizes() == value.sizes() && key.size(0) == batch && key.size(3) == d,
              "specfree::tree_attention: key and value must be [B, kv_heads, keys, head_dim] like the query's");
  TORCH_CHECK(kv_heads > 0 && heads % kv_heads == 0, "specfree::tree_attention: ", heads,
              " query heads do not share ", kv_heads, " key/value heads evenly");
  if (mask.has_value() && mask->defined())
    TORCH_CHECK(mask->dim() == 4 && (mask->size(0) == 1 || mask->size(0) == batch) && mask->size(1) == 1 &&
                    mask->size(2) == q_len && mask->size(3) == s_len,
                "specfree::tree_attention: the mask must be [B or 1, 1, rows, keys], not ", mask->sizes());
  TORCH_CHECK(softcap >= 0, "specfree::tree_attention: softcap must be 0 (none) or positive, not ", softcap);
  const Isa isa = parse_isa(std::string(isa_name));
  const int64_t groups = heads / kv_heads;
  const at::Tensor q = query.stride(3) == 1 ? query : query.contiguous();
  const at::Tensor k = key.stride(3) == 1 ? key : key.contiguous();
  const at::Tensor v = value.stride(3) == 1 ? value : value.contiguous();
  at::Tensor out = at::empty({batch, q_len, heads, d}, query.options());  // what transformers expects back
  std::optional<at::Tensor> m = mask;  // a mask neither bool nor float is converted once, for every batch row
  if (m.has_value() && m->defined() && m->scalar_type() != at::kBool && m->scalar_type() != at::kFloat)
    m = m->to(at::kFloat);
  std::vector<Visibility> vis;
  for (int64_t b = 0; b < batch; ++b) vis.push_back(visibility(m, b, q_len, s_len));
  const int64_t rows = q_len * groups;
  // Tasks: (batch, key/value head, chunk of its rows), up to 2 per thread. A chunk has at least
  // kMinChunkRows rows: each chunk reads its group's keys and values again (a one-row step over
  // 1536 tokens of SmolLM2 was 10-30% slower split into its 3 rows, 4 rows 20-28% faster split).
  // Up to 4 per thread read them twice as often: on the Intel Xeon VM, 2 threads, SmolLM2's 30
  // layers over 512-1536 tokens, 4 rows took 2.1-2.2 / 4.3 / 6.7-7.2 ms with 2 a thread against
  // 2.3-2.4 / 4.7-5.1 / 7.4-8.5 ms with 4, 8 rows 3.2-3.7 / 6.6-6.9 / 10.0-11.7 against 3.9-4.0 /
  // 7.3-7.9 / 11.0-12.6. (A task count the threads share evenly measured level on Zen 3.)
  const int64_t heads_total = batch * kv_heads;
  const int64_t chunks = std::max<int64_t>(1, std::min(rows / kMinChunkRows,
                                                       (2 * at::get_num_threads() + heads_total - 1) / heads_total));
  const int64_t chunk = (rows + chunks - 1) / chunks;
  auto run = [&](auto zero) {
    using T = decltype(zero);
    const Pieces<T> f = pieces<T>(isa, d);
    at::parallel_for(0, heads_total * chunks, 1, [&](int64_t begin, int64_t end) {
      for (int64_t task = begin; task < end; ++task) {
        const int64_t group = task / chunks, row0 = task % chunks * chunk;
        const int64_t n = std::min(chunk, rows - row0);
        if (n <= 0) continue;
        const int64_t b = group / kv_heads, h = group % kv_heads;
        const HeadRows<T> place{q.data_ptr<T>() + b * q.stride(0) + h * groups * q.stride(1), q.stride(1),
                                q.stride(2), out.data_ptr<T>() + b * out.stride(0) + h * groups * d, d, heads * d,
                                groups};
        head_group<T>(f, vis[b], place, k.data_ptr<T>() + b * k.stride(0) + h * k.stride(1),
                      v.data_ptr<T>() + b * v.stride(0) + h * v.stride(1), k.stride(2), v.stride(2), q_len, row0,
                      n, d, static_cast<float>(scale), static_cast<float>(softcap));
      }
    });
  };
  if (query.scalar_type() == at::kFloat)
    run(0.0f);
  else
    run(at::BFloat16());
  return out;
}

}  // namespace

SPECFREE_C_ENTRY aoti_torch_cpu_tree_attention(AtenTensorHandle query, AtenTensorHandle key, AtenTensorHandle value,
                                              AtenTensorHandle* mask, double scale, const char* isa, double softcap,
                                              AtenTensorHandle* out) {
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
    specfree::hand_back(tree_attention(specfree::tensor_of(query), specfree::tensor_of(key), specfree::tensor_of(value),
                                       specfree::optional_of(mask), scale, isa, softcap),
                        out);
  });
}

TORCH_LIBRARY_FRAGMENT(specfree, m) {
  m.def("tree_attention(Tensor query, Tensor key, Tensor value, Tensor? mask, float scale, str isa='auto', "
        "float softcap=0.0) -> Tensor");
}

TORCH_LIBRARY_IMPL(specfree, CPU, m) { m.impl("tree_attention", &tree_attention); }
