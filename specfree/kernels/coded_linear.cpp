// specfree::coded_linear -- y = x W^T + b with W held as small integer codes that reproduce its
// float32 values exactly.
//
// A model loaded from a quantized file (SmolLM2's GGUF: Q4_1 layers, a Q8_0 head) is dequantized
// into float32 weights that take only 16 (or 256) values per block of 32 inputs. Such a weight is
// stored here as those codes, per block of 32 inputs and output column:
//   affine4: w = fma(q, d, m), q in 0..15, two codes a byte  (4 bits + 8 bytes a block: 6 bits)
//   scaled8: w = q * d,        q in -128..127                (8 bits + 4 bytes a block: 9 bits)
// Every code is checked at packing (``codes.py``): the decoded weight equals the float32 weight
// bit for bit, or the layer keeps its float32 panels. A product reads 3.5-5x fewer bytes.
//
// The layout is the float32 panels' (``panel_linear.cpp``): panels of P output columns (P = 8
// AVX2, 16 AVX-512), K contiguous; codes [N/P, K/2, P] (affine4: byte (k/2, c) holds input k's code
// in its low nibble and k+1's in its high one) or [N/P, K, P] (scaled8), scales and offsets
// [N/P, K/32, P]. Each output is one lane of one accumulator, fma over k = 0..K-1 in order, then
// + bias: the float32 panel kernel's operations on the same weights, so a coded layer's output is
// bit-identical to the float32 one's, whatever the number of rows (batch invariant), and AVX2 and
// AVX-512 compute the same sums.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include "isa.h"

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

namespace {

using specfree::Isa;

constexpr int kBlock = 32;      // inputs per scale (GGUF's block)
constexpr int kGroupRows = 8;   // rows whose accumulators share the registers; more go in groups
constexpr int64_t kAhead = 1024;  // prefetch distance in the code stream (bytes)

#define UNROLL _Pragma("GCC unroll 16")

// Panels per block for a group of MB rows: MB*NB accumulators + 4*NB weight, scale and offset
// vectors fit the registers (32 AVX-512, 16 AVX2).
constexpr int kWidthAvx512[kGroupRows + 1] = {0, 4, 4, 3, 3, 2, 2, 2, 2};
constexpr int kWidthAvx2[kGroupRows + 1] = {0, 2, 2, 2, 1, 1, 1, 1, 1};

// The two ISAs differ only in vector width and how P bytes of codes widen to P int32 lanes.
struct Avx512 {
  using Vec = __m512;
  static constexpr int P = 16;
  SPECFREE_AVX512 static Vec zero() { return _mm512_setzero_ps(); }
  SPECFREE_AVX512 static Vec load(const float* p) { return _mm512_loadu_ps(p); }
  SPECFREE_AVX512 static Vec bcast(const float* p) { return _mm512_set1_ps(*p); }
  SPECFREE_AVX512 static Vec fma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
  SPECFREE_AVX512 static Vec mul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
  SPECFREE_AVX512 static void store(float* p, Vec v) { _mm512_storeu_ps(p, v); }
  // 16 bytes of nibble pairs -> the low and high nibbles as floats
  SPECFREE_AVX512 static void nibbles(const uint8_t* p, Vec& lo, Vec& hi) {
    const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    lo = _mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(15)));
    hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4));
  }
  SPECFREE_AVX512 static Vec bytes(const int8_t* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
};

struct Avx2 {
  using Vec = __m256;
  static constexpr int P = 8;
  SPECFREE_AVX2 static Vec zero() { return _mm256_setzero_ps(); }
  SPECFREE_AVX2 static Vec load(const float* p) { return _mm256_loadu_ps(p); }
  SPECFREE_AVX2 static Vec bcast(const float* p) { return _mm256_broadcast_ss(p); }
  SPECFREE_AVX2 static Vec fma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
  SPECFREE_AVX2 static Vec mul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
  SPECFREE_AVX2 static void store(float* p, Vec v) { _mm256_storeu_ps(p, v); }
  SPECFREE_AVX2 static void nibbles(const uint8_t* p, Vec& lo, Vec& hi) {
    const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    lo = _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(15)));
    hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4));
  }
  SPECFREE_AVX2 static Vec bytes(const int8_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  }
};

// What a kernel reads: codes (decoded in registers), or float32 panels a call decoded once into a
// buffer for its many rows (the same values, so the same sums).
enum Format { kAffine4 = 0, kScaled8 = 1, kDecoded = 2 };

// MB rows against NB adjacent panels, all of K. ``out`` is [MB, NB*P], row stride ldo.
// Two inputs a step: affine4 decodes both from one load of P bytes.
#define SPECFREE_CODED(ATTR, ISA)                                                                      \
  template <int MB, int NB, int FORMAT, bool PREFETCH>                                                 \
  ATTR void coded_##ISA(const float* x, int64_t ldx, const uint8_t* codes, const float* scales,        \
                        const float* offsets, int64_t k, float* out, int64_t ldo) {                    \
    using V = ISA;                                                                                     \
    constexpr int P = V::P;                                                                            \
    constexpr bool AFFINE = FORMAT == kAffine4;                                                        \
    typename V::Vec acc[MB][NB];                                                                       \
    UNROLL for (int m = 0; m < MB; ++m) UNROLL for (int j = 0; j < NB; ++j) acc[m][j] = V::zero();     \
    const int64_t cstride = (AFFINE ? k / 2 : k) * P, sstride = k / kBlock * P;  /* one panel */       \
    const float* decoded = reinterpret_cast<const float*>(codes);                                      \
    for (int64_t b = 0; b < k / kBlock; ++b) {                                                         \
      typename V::Vec d[NB], o[NB];                                                                    \
      if constexpr (FORMAT != kDecoded) UNROLL for (int j = 0; j < NB; ++j) {                          \
        d[j] = V::load(scales + j * sstride + b * P);                                                  \
        if constexpr (AFFINE) o[j] = V::load(offsets + j * sstride + b * P);                           \
        if constexpr (PREFETCH)                                                                        \
          _mm_prefetch(reinterpret_cast<const char*>(codes + j * cstride + (b * kBlock * P >> AFFINE) + kAhead), \
                       _MM_HINT_T0);                                                                   \
      }                                                                                                \
      UNROLL for (int i = 0; i < kBlock; i += 2) {                                                     \
        const int64_t at = b * kBlock + i;                                                             \
        typename V::Vec w0[NB], w1[NB];                                                                \
        UNROLL for (int j = 0; j < NB; ++j) {                                                          \
          if constexpr (FORMAT == kDecoded) {                                                          \
            w0[j] = V::load(decoded + j * k * P + at * P);                                             \
            w1[j] = V::load(decoded + j * k * P + (at + 1) * P);                                       \
          } else if constexpr (AFFINE) {                                                               \
            V::nibbles(codes + j * cstride + at / 2 * P, w0[j], w1[j]);                                \
            w0[j] = V::fma(w0[j], d[j], o[j]);                                                         \
            w1[j] = V::fma(w1[j], d[j], o[j]);                                                         \
          } else {                                                                                     \
            const int8_t* c = reinterpret_cast<const int8_t*>(codes) + j * cstride + at * P;           \
            w0[j] = V::mul(V::bytes(c), d[j]);                                                         \
            w1[j] = V::mul(V::bytes(c + P), d[j]);                                                     \
          }                                                                                            \
        }                                                                                              \
        UNROLL for (int m = 0; m < MB; ++m) {                                                          \
          const typename V::Vec x0 = V::bcast(x + m * ldx + at), x1 = V::bcast(x + m * ldx + at + 1);  \
          UNROLL for (int j = 0; j < NB; ++j) acc[m][j] = V::fma(x0, w0[j], acc[m][j]);                \
          UNROLL for (int j = 0; j < NB; ++j) acc[m][j] = V::fma(x1, w1[j], acc[m][j]);                \
        }                                                                                              \
      }                                                                                                \
    }                                                                                                  \
    UNROLL for (int m = 0; m < MB; ++m) UNROLL for (int j = 0; j < NB; ++j) V::store(out + m * ldo + j * P, acc[m][j]); \
  }

SPECFREE_CODED(SPECFREE_AVX512, Avx512)
SPECFREE_CODED(SPECFREE_AVX2, Avx2)

// One panel's codes decoded into float32 [K, P], with the kernel's own instructions.
#define SPECFREE_DECODE(ATTR, ISA)                                                                     \
  template <bool AFFINE>                                                                               \
  ATTR void decode_##ISA(const uint8_t* codes, const float* scales, const float* offsets, int64_t k,   \
                         float* out) {                                                                 \
    using V = ISA;                                                                                     \
    constexpr int P = V::P;                                                                            \
    for (int64_t b = 0; b < k / kBlock; ++b) {                                                         \
      const typename V::Vec d = V::load(scales + b * P), o = AFFINE ? V::load(offsets + b * P) : V::zero(); \
      for (int i = 0; i < kBlock; i += 2) {                                                            \
        const int64_t at = b * kBlock + i;                                                             \
        typename V::Vec w0, w1;                                                                        \
        if constexpr (AFFINE) {                                                                        \
          V::nibbles(codes + at / 2 * P, w0, w1);                                                      \
          w0 = V::fma(w0, d, o);                                                                       \
          w1 = V::fma(w1, d, o);                                                                       \
        } else {                                                                                       \
          const int8_t* c = reinterpret_cast<const int8_t*>(codes) + at * P;                           \
          w0 = V::mul(V::bytes(c), d);                                                                 \
          w1 = V::mul(V::bytes(c + P), d);                                                             \
        }                                                                                              \
        V::store(out + at * P, w0);                                                                    \
        V::store(out + (at + 1) * P, w1);                                                              \
      }                                                                                                \
    }                                                                                                  \
  }

SPECFREE_DECODE(SPECFREE_AVX512, Avx512)
SPECFREE_DECODE(SPECFREE_AVX2, Avx2)

using CodedFn = void (*)(const float*, int64_t, const uint8_t*, const float*, const float*, int64_t, float*, int64_t);

// The kernel for a group of MB rows over nb panels: the group's own width, a full group's (the
// width of a call whose later groups follow a full one), or 1 at a range's end.
template <int MB, int FORMAT, bool PREFETCH>
CodedFn pick_rows(Isa isa, int nb) {
  if (isa == Isa::kAvx512) {
    constexpr int own = kWidthAvx512[MB], full = kWidthAvx512[kGroupRows];
    return nb == own    ? coded_Avx512<MB, own, FORMAT, PREFETCH>
           : nb == full ? coded_Avx512<MB, full, FORMAT, PREFETCH>
                        : coded_Avx512<MB, 1, FORMAT, PREFETCH>;
  }
  constexpr int own = kWidthAvx2[MB], full = kWidthAvx2[kGroupRows];
  return nb == own    ? coded_Avx2<MB, own, FORMAT, PREFETCH>
         : nb == full ? coded_Avx2<MB, full, FORMAT, PREFETCH>
                      : coded_Avx2<MB, 1, FORMAT, PREFETCH>;
}

// Codes stream from memory (prefetched); a decoded block is read from cache.
CodedFn pick(Isa isa, int nb, int64_t mb, Format format) {
  return specfree::for_rows(mb, [&](auto rows) {
    constexpr int r = decltype(rows)::value;
    return format == kAffine4   ? pick_rows<r, kAffine4, true>(isa, nb)
           : format == kScaled8 ? pick_rows<r, kScaled8, true>(isa, nb)
                                : pick_rows<r, kDecoded, false>(isa, nb);
  });
}

// Panels [p_begin, p_end) for all m rows into y [m, n]. Up to two groups of rows decode the codes
// in registers; more rows (a prefill, a wide tree) decode each block of panels once into a buffer
// that every group then reads from cache. (Intel VM, SmolLM2's 211 layers: decoding per group cost
// a 300-token prefill's linears 15% over the float32 panels, the buffer 5%; at 16 rows the
// buffer was 11% slower than decoding twice.)
constexpr int64_t kDecodeOnceGroups = 3;

void coded_range(Isa isa, const float* x, int64_t m, const uint8_t* codes, const float* scales,
                 const float* offsets, int64_t k, const float* bias, int64_t n, int64_t p_begin, int64_t p_end,
                 float* y) {
  const int P = isa == Isa::kAvx512 ? 16 : 8;
  const bool affine = offsets != nullptr;
  const int64_t first = std::min<int64_t>(kGroupRows, m);
  const int nb = (isa == Isa::kAvx512 ? kWidthAvx512 : kWidthAvx2)[first];
  const int64_t groups = (m + kGroupRows - 1) / kGroupRows;
  const int64_t cstride = (affine ? k / 2 : k) * P, sstride = k / kBlock * P;
  const bool decode_once = groups >= kDecodeOnceGroups;
  std::vector<float> block(decode_once ? nb * k * P : 0);
  float out[kGroupRows * 4 * 16];
  const int64_t ldo = nb * P;
  for (int64_t p = p_begin; p < p_end;) {
    const int width = p + nb <= p_end ? nb : 1;
    if (decode_once)
      for (int j = 0; j < width; ++j) {
        const uint8_t* c = codes + (p + j) * cstride;
        const float *d = scales + (p + j) * sstride, *o = affine ? offsets + (p + j) * sstride : nullptr;
        float* into = block.data() + j * k * P;
        if (isa == Isa::kAvx512) affine ? decode_Avx512<true>(c, d, o, k, into) : decode_Avx512<false>(c, d, o, k, into);
        else affine ? decode_Avx2<true>(c, d, o, k, into) : decode_Avx2<false>(c, d, o, k, into);
      }
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t mb = std::min<int64_t>(kGroupRows, m - g * kGroupRows);
      if (decode_once)
        pick(isa, width, mb, kDecoded)(x + g * kGroupRows * k, k, reinterpret_cast<const uint8_t*>(block.data()),
                                       nullptr, nullptr, k, out, ldo);
      else
        pick(isa, width, mb, affine ? kAffine4 : kScaled8)(x + g * kGroupRows * k, k, codes + p * cstride,
                                                           scales + p * sstride,
                                                           affine ? offsets + p * sstride : nullptr, k, out, ldo);
      specfree::store_block(out, ldo, mb, width * P, bias, p * P, n, y + g * kGroupRows * n);
    }
    p += width;
  }
}

constexpr int64_t kPanelsPerTask = 4;  // a thread's share: a contiguous run of panels, one stream

// Checks shared by both ops; returns (K, P) and whether the codes are affine4.
std::tuple<int64_t, int64_t, bool> check_codes(const at::Tensor& codes, const at::Tensor& scales,
                                               const std::optional<at::Tensor>& offsets, const char* op) {
  const bool affine = offsets.has_value() && offsets->defined();
  TORCH_CHECK(codes.device().is_cpu() && scales.device().is_cpu(), op, " runs on the CPU");
  TORCH_CHECK(codes.dim() == 3 && codes.is_contiguous() && scales.dim() == 3 && scales.is_contiguous() &&
              scales.scalar_type() == at::kFloat, op, ": codes [N/P, K/2 or K, P] and float32 scales "
              "[N/P, K/32, P], contiguous (specfree.kernels.codes), not ", codes.sizes(), " and ", scales.sizes());
  TORCH_CHECK(codes.scalar_type() == (affine ? at::kByte : at::kChar), op, ": ",
              affine ? "affine4 codes are uint8 (two a byte)" : "scaled8 codes are int8");
  const int64_t P = codes.size(2), k = scales.size(1) * kBlock;
  TORCH_CHECK(scales.size(0) == codes.size(0) && scales.size(2) == P && codes.size(1) == (affine ? k / 2 : k), op,
              ": codes ", codes.sizes(), " do not match scales ", scales.sizes());
  if (affine)
    TORCH_CHECK(offsets->sizes() == scales.sizes() && offsets->is_contiguous() &&
                offsets->scalar_type() == at::kFloat, op, ": offsets must be float32 shaped like the scales");
  return {k, P, affine};
}

at::Tensor coded_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                        const std::optional<at::Tensor>& offsets, const std::optional<at::Tensor>& bias,
                        int64_t n, c10::string_view isa_name) {
  const auto [k, P, affine] = check_codes(codes, scales, offsets, "specfree::coded_linear");
  const Isa isa = specfree::parse_isa(std::string(isa_name), "specfree::coded_linear");
  const int64_t count = codes.size(0);
  TORCH_CHECK(P == (isa == Isa::kAvx512 ? 16 : 8), "specfree::coded_linear: codes in panels of ", P,
              " columns cannot run the ", isa == Isa::kAvx512 ? "avx512" : "avx2", " path; code for it");
  TORCH_CHECK(x.device().is_cpu() && x.size(-1) == k && n <= count * P && n > count * P - P,
              "specfree::coded_linear: shapes ", x.sizes(), " and codes for ", k, " inputs and ", n,
              " outputs do not multiply");
  const int64_t m = x.numel() / std::max<int64_t>(k, 1);
  auto out_sizes = x.sizes().vec();
  out_sizes.back() = n;
  const at::Tensor x32 = specfree::float_rows(x);
  at::Tensor b;
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias) b = bias->scalar_type() == at::kFloat && bias->is_contiguous() ? *bias : bias->to(at::kFloat).contiguous();
  at::Tensor y = at::empty(out_sizes, x32.options());
  if (m > 0) {
    const auto* code_bytes = static_cast<const uint8_t*>(codes.data_ptr());
    at::parallel_for(0, count, kPanelsPerTask, [&](int64_t begin, int64_t end) {
      coded_range(isa, x32.data_ptr<float>(), m, code_bytes, scales.data_ptr<float>(),
                  affine ? offsets->data_ptr<float>() : nullptr, k, has_bias ? b.data_ptr<float>() : nullptr, n,
                  begin, end, y.data_ptr<float>());
    });
  }
  return x.scalar_type() == at::kFloat ? y : y.to(x.scalar_type());
}

// The float32 panels [N/P, K, P] the codes stand for, decoded with the kernel's own operations
// (fmaf is the vector fma, correctly rounded; q * d is one rounding): what packing compares with
// the original weight, and what ``.weight`` and the state dict unpack.
at::Tensor decode_panels(const at::Tensor& codes, const at::Tensor& scales, const std::optional<at::Tensor>& offsets) {
  const auto [k, P, affine] = check_codes(codes, scales, offsets, "specfree::decode_panels");
  const int64_t count = codes.size(0);
  at::Tensor panels = at::empty({count, k, P}, scales.options());
  const auto* c = static_cast<const uint8_t*>(codes.data_ptr());
  const float *d = scales.data_ptr<float>(), *o = affine ? offsets->data_ptr<float>() : nullptr;
  float* w = panels.data_ptr<float>();
  at::parallel_for(0, count, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p)
      for (int64_t i = 0; i < k; ++i)
        for (int64_t col = 0; col < P; ++col) {
          const int64_t s = (p * (k / kBlock) + i / kBlock) * P + col;
          float q;
          if (affine) {
            const uint8_t byte = c[(p * (k / 2) + i / 2) * P + col];
            q = static_cast<float>(i % 2 ? byte >> 4 : byte & 15);
            w[(p * k + i) * P + col] = std::fmaf(q, d[s], o[s]);
          } else {
            q = static_cast<float>(static_cast<int8_t>(c[(p * k + i) * P + col]));
            w[(p * k + i) * P + col] = q * d[s];
          }
        }
  });
  return panels;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specfree, m) {
  m.def("coded_linear(Tensor x, Tensor codes, Tensor scales, Tensor? offsets, Tensor? bias, int n, "
        "str isa='auto') -> Tensor");
  m.def("decode_panels(Tensor codes, Tensor scales, Tensor? offsets) -> Tensor");
}

TORCH_LIBRARY_IMPL(specfree, CPU, m) {
  m.impl("coded_linear", &coded_linear);
  m.impl("decode_panels", &decode_panels);
}
