// specfree::coded_linear -- y = x W^T + b with W held as small integer codes that reproduce its
// float32 values exactly.
//
// A quantized GGUF's weight takes, per block of 16 or 32 inputs of an output column, only the
// values of a small integer code under a scale (and an offset). Such a weight is stored here as
// those codes, per block and output column (GGUF's types map onto these in ``gguf_blocks.py``):
//   affine4: w = fma(q, d, m), q in 0..15, eight codes a word (4 bits + 4 bytes a block: 5 bits)
//   affine8: w = fma(q, d, m), q in 0..255, one byte each    (5-bit and 2-bit GGUF types)
//   scaled8: w = q * d,        q in -128..127                (8 bits + 2 bytes a block: 8.5 bits)
// Blocks are 32 inputs, or 16 for affine8 and scaled8 (Q6_K, Q3_K, Q2_K scale every 16). Every
// code decodes, with the kernel's own operations, to the float32 value ``gguf``'s dequantize gives
// (one rounding there too: checked per type in the tests). d and m are float16 where every one is
// a float16 value (a GGUF file's are; else float32, a block 4 bytes more). A product reads 3.7-6x
// fewer bytes than float32.
//
// The layout is the float32 panels' (``panel_linear.cpp``): panels of P output columns (P = 8
// AVX2, 16 AVX-512), K contiguous; codes [N/P, K/8, P] int32 (affine4: word (g, c) holds input
// 8g+i's code in bits 4i..4i+3, so one load of P words gives 8 inputs), [N/P, K, P] uint8
// (affine8) or int8 (scaled8), scales and offsets [N/P, K/B, P] for blocks of B inputs. Each output is one lane of one accumulator, fma
// over k = 0..K-1 in order, then + bias: the float32 panel kernel's operations on the same
// weights, so a coded layer's output is bit-identical to the float32 one's, whatever the number
// of rows (batch invariant), and AVX2 and AVX-512 compute the same sums.

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

constexpr int kGroupRows = 8;   // rows whose accumulators share the registers; more go in groups
// Prefetching: while a block of NB panels runs, the same block of the next NB panels (the panels
// a thread runs are contiguous, so that is the next stretch of its streams), every line of the
// codes and the scale and offset lines. On the Intel VM, SmolLM2's 211 layers at 1 / 2 / 4 / 8 /
// 16 rows took 6 / 13 / 15 / 10 / 7% less than prefetching 1 KB ahead within each panel, which
// left the start of every panel but the last cold; a block's lines alone took 8-13% more than all.
// (Past a thread's last panels this reads ahead into the next thread's, or past the tensor: a
// prefetch is a hint and never faults.)

#define UNROLL _Pragma("GCC unroll 16")

// Panels per block for a group of MB rows: MB*NB accumulators + 4*NB weight, scale and offset
// vectors fit the registers (32 AVX-512, 16 AVX2).
constexpr int kWidthAvx512[kGroupRows + 1] = {0, 4, 4, 3, 3, 2, 2, 2, 2};
constexpr int kWidthAvx2[kGroupRows + 1] = {0, 2, 2, 2, 1, 1, 1, 1, 1};

// Where a panel's per-block scales (or offsets) come from: read as float32 or float16, or, for a
// GGUF K-type, an 8-bit integer sub-scale times its 256-input super-block's float16 scale -- the
// product gguf computes (d * sc, one rounding; held this way a Q4_K weight costs 4.6 bits, not 6).
// K-type offsets are held with the super-block's minimum negated (-dmin: exact), so the product
// is the offset -(dmin * m) itself.
enum ScaleKind { kFloat32 = 0, kFloat16 = 1, kUnsigned8 = 2, kSigned8 = 3 };

struct ScaleStream {
  const uint8_t* values;  // panel 0's [K/B, P] scales
  const uint8_t* supers;  // panel 0's [K/256, P] float16 super-block scales (8-bit kinds only)
  int kind;
  int64_t panel_bytes, super_panel_bytes;  // one panel's bytes in each
  int64_t size() const { return kind == kFloat32 ? 4 : kind == kFloat16 ? 2 : 1; }
  ScaleStream at(int64_t p) const {
    return {values ? values + p * panel_bytes : nullptr, supers ? supers + p * super_panel_bytes : nullptr, kind,
            panel_bytes, super_panel_bytes};
  }
};

// The two ISAs differ only in vector width and how codes widen to float lanes.
struct Avx512 {
  using Vec = __m512;
  using Int = __m512i;
  static constexpr int P = 16;
  SPECFREE_AVX512 static Vec zero() { return _mm512_setzero_ps(); }
  SPECFREE_AVX512 static Vec load(const float* p) { return _mm512_loadu_ps(p); }
  SPECFREE_AVX512 static Vec bcast(const float* p) { return _mm512_set1_ps(*p); }
  SPECFREE_AVX512 static Vec fma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
  SPECFREE_AVX512 static Vec mul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
  SPECFREE_AVX512 static void store(float* p, Vec v) { _mm512_storeu_ps(p, v); }
  SPECFREE_AVX512 static Int words(const int32_t* p) { return _mm512_loadu_si512(p); }
  // Code i of each word as a float: a table lookup (vpermps reads an index's low 4 bits), one
  // instruction where masking and converting take two. i is a constant once the loop unrolls.
  SPECFREE_AVX512 static Vec nibble(Int v, int i) {
    const Vec values = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    return _mm512_permutexvar_ps(i ? _mm512_srli_epi32(v, 4 * i) : v, values);
  }
  SPECFREE_AVX512 static Vec bytes(const int8_t* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  SPECFREE_AVX512 static Vec ubytes(const uint8_t* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  SPECFREE_AVX512 static Vec halves(const uint8_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  // Block b's scales (b counts blocks of sb inputs) of one panel.
  SPECFREE_AVX512 static Vec block_scale(const ScaleStream& s, int64_t b, int sb) {
    const uint8_t* at = s.values + b * P * s.size();
    if (s.kind == kFloat32) return _mm512_loadu_ps(reinterpret_cast<const float*>(at));
    if (s.kind == kFloat16) return halves(at);
    const Vec super = halves(s.supers + b * sb / 256 * P * 2);
    return mul(s.kind == kUnsigned8 ? ubytes(at) : bytes(reinterpret_cast<const int8_t*>(at)), super);
  }
};

struct Avx2 {
  using Vec = __m256;
  using Int = __m256i;
  static constexpr int P = 8;
  SPECFREE_AVX2 static Vec zero() { return _mm256_setzero_ps(); }
  SPECFREE_AVX2 static Vec load(const float* p) { return _mm256_loadu_ps(p); }
  SPECFREE_AVX2 static Vec bcast(const float* p) { return _mm256_broadcast_ss(p); }
  SPECFREE_AVX2 static Vec fma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
  SPECFREE_AVX2 static Vec mul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
  SPECFREE_AVX2 static void store(float* p, Vec v) { _mm256_storeu_ps(p, v); }
  SPECFREE_AVX2 static Int words(const int32_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  SPECFREE_AVX2 static Vec nibble(Int v, int i) {  // vpermps indexes 8 values here: mask and convert
    return _mm256_cvtepi32_ps(_mm256_and_si256(i ? _mm256_srli_epi32(v, 4 * i) : v, _mm256_set1_epi32(15)));
  }
  SPECFREE_AVX2 static Vec bytes(const int8_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  }
  SPECFREE_AVX2 static Vec ubytes(const uint8_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  }
  SPECFREE_AVX2 static Vec halves(const uint8_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  SPECFREE_AVX2 static Vec block_scale(const ScaleStream& s, int64_t b, int sb) {
    const uint8_t* at = s.values + b * P * s.size();
    if (s.kind == kFloat32) return _mm256_loadu_ps(reinterpret_cast<const float*>(at));
    if (s.kind == kFloat16) return halves(at);
    const Vec super = halves(s.supers + b * sb / 256 * P * 2);
    return mul(s.kind == kUnsigned8 ? ubytes(at) : bytes(reinterpret_cast<const int8_t*>(at)), super);
  }
};

// What a kernel reads: codes (decoded in registers), or float32 panels a call decoded once into a
// buffer for its many rows (the same values, so the same sums).
enum Format { kAffine4 = 0, kScaled8 = 1, kDecoded = 2, kAffine8 = 3 };

// MB rows against NB adjacent panels, all of K, in blocks of SB inputs per scale. ``out`` is
// [MB, NB*P], row stride ldo. Inputs go 8 at a time: affine4 decodes all 8 from one load of P words.
#define SPECFREE_CODED(ATTR, ISA)                                                                      \
  template <int MB, int NB, int FORMAT, int SB, bool PREFETCH>                                         \
  ATTR void coded_##ISA(const float* x, int64_t ldx, const uint8_t* codes, const ScaleStream& scales,  \
                        const ScaleStream& offsets, int64_t k, float* out, int64_t ldo) {              \
    using V = ISA;                                                                                     \
    using Vec = typename V::Vec;                                                                       \
    constexpr int P = V::P;                                                                            \
    constexpr bool AFFINE = FORMAT == kAffine4 || FORMAT == kAffine8;                                  \
    constexpr int64_t block_bytes = FORMAT == kAffine4 ? SB * P / 2 : SB * P;                          \
    Vec acc[MB][NB];                                                                                   \
    UNROLL for (int m = 0; m < MB; ++m) UNROLL for (int j = 0; j < NB; ++j) acc[m][j] = V::zero();     \
    const int64_t cstride = k / SB * block_bytes; /* one panel */                                      \
    const float* decoded = reinterpret_cast<const float*>(codes);                                      \
    for (int64_t b = 0; b < k / SB; ++b) {                                                             \
      Vec d[NB], o[NB];                                                                                \
      if constexpr (FORMAT != kDecoded) UNROLL for (int j = 0; j < NB; ++j) {                          \
        d[j] = V::block_scale(scales.at(j), b, SB);                                                    \
        if constexpr (AFFINE) o[j] = V::block_scale(offsets.at(j), b, SB);                             \
        if constexpr (PREFETCH) {                                                                      \
          const char* c = reinterpret_cast<const char*>(codes + (NB + j) * cstride + b * block_bytes);  \
          UNROLL for (int64_t line = 0; line < block_bytes; line += 64) _mm_prefetch(c + line, _MM_HINT_T0); \
          const int64_t at = b * P * scales.size();                                                    \
          _mm_prefetch(reinterpret_cast<const char*>(scales.at(NB + j).values + at), _MM_HINT_T0);     \
          if constexpr (AFFINE) _mm_prefetch(reinterpret_cast<const char*>(offsets.at(NB + j).values + at), _MM_HINT_T0); \
        }                                                                                              \
      }                                                                                                \
      UNROLL for (int g = 0; g < SB; g += 8) {                                                         \
        typename V::Int v[NB];                                                                         \
        if constexpr (FORMAT == kAffine4) UNROLL for (int j = 0; j < NB; ++j)                          \
          v[j] = V::words(reinterpret_cast<const int32_t*>(codes + j * cstride + b * block_bytes) + g / 8 * P); \
        UNROLL for (int i = 0; i < 8; ++i) {                                                           \
          const int64_t at = b * SB + g + i;                                                           \
          Vec w[NB];                                                                                   \
          UNROLL for (int j = 0; j < NB; ++j) {                                                        \
            if constexpr (FORMAT == kDecoded) w[j] = V::load(decoded + j * k * P + at * P);             \
            else if constexpr (FORMAT == kAffine4) w[j] = V::fma(V::nibble(v[j], i), d[j], o[j]);      \
            else if constexpr (FORMAT == kAffine8)                                                     \
              w[j] = V::fma(V::ubytes(codes + j * cstride + at * P), d[j], o[j]);                      \
            else w[j] = V::mul(V::bytes(reinterpret_cast<const int8_t*>(codes) + j * cstride + at * P), d[j]); \
          }                                                                                            \
          UNROLL for (int m = 0; m < MB; ++m) {                                                        \
            const Vec xm = V::bcast(x + m * ldx + at);                                                 \
            UNROLL for (int j = 0; j < NB; ++j) acc[m][j] = V::fma(xm, w[j], acc[m][j]);               \
          }                                                                                            \
        }                                                                                              \
      }                                                                                                \
    }                                                                                                  \
    UNROLL for (int m = 0; m < MB; ++m) UNROLL for (int j = 0; j < NB; ++j) V::store(out + m * ldo + j * P, acc[m][j]); \
  }

SPECFREE_CODED(SPECFREE_AVX512, Avx512)
SPECFREE_CODED(SPECFREE_AVX2, Avx2)

// One panel's codes decoded into float32 [K, P], with the kernel's own instructions.
#define SPECFREE_DECODE(ATTR, ISA)                                                                     \
  template <int FORMAT, int SB>                                                                        \
  ATTR void decode_##ISA(const uint8_t* codes, const ScaleStream& scales, const ScaleStream& offsets,  \
                         int64_t k, float* out) {                                                      \
    using V = ISA;                                                                                     \
    constexpr int P = V::P;                                                                            \
    constexpr bool AFFINE = FORMAT != kScaled8;                                                        \
    for (int64_t b = 0; b < k / SB; ++b) {                                                             \
      const typename V::Vec d = V::block_scale(scales, b, SB);                                         \
      const typename V::Vec o = AFFINE ? V::block_scale(offsets, b, SB) : V::zero();                   \
      for (int64_t at = b * SB; at < (b + 1) * SB; at += 8) {                                          \
        if constexpr (FORMAT == kAffine4) {                                                            \
          const typename V::Int v = V::words(reinterpret_cast<const int32_t*>(codes) + at / 8 * P);     \
          UNROLL for (int i = 0; i < 8; ++i) V::store(out + (at + i) * P, V::fma(V::nibble(v, i), d, o)); \
        } else if constexpr (FORMAT == kAffine8) {                                                     \
          for (int64_t i = at; i < at + 8; ++i) V::store(out + i * P, V::fma(V::ubytes(codes + i * P), d, o)); \
        } else {                                                                                       \
          for (int64_t i = at; i < at + 8; ++i)                                                        \
            V::store(out + i * P, V::mul(V::bytes(reinterpret_cast<const int8_t*>(codes) + i * P), d)); \
        }                                                                                              \
      }                                                                                                \
    }                                                                                                  \
  }

SPECFREE_DECODE(SPECFREE_AVX512, Avx512)
SPECFREE_DECODE(SPECFREE_AVX2, Avx2)

using CodedFn = void (*)(const float*, int64_t, const uint8_t*, const ScaleStream&, const ScaleStream&, int64_t,
                         float*, int64_t);

// The kernel for a group of MB rows over nb panels: the group's own width, a full group's (the
// width of a call whose later groups follow a full one), or 1 at a range's end.
template <int MB, int FORMAT, int SB, bool PREFETCH>
CodedFn pick_rows(Isa isa, int nb) {
  if (isa == Isa::kAvx512) {
    constexpr int own = kWidthAvx512[MB], full = kWidthAvx512[kGroupRows];
    return nb == own    ? coded_Avx512<MB, own, FORMAT, SB, PREFETCH>
           : nb == full ? coded_Avx512<MB, full, FORMAT, SB, PREFETCH>
                        : coded_Avx512<MB, 1, FORMAT, SB, PREFETCH>;
  }
  constexpr int own = kWidthAvx2[MB], full = kWidthAvx2[kGroupRows];
  return nb == own    ? coded_Avx2<MB, own, FORMAT, SB, PREFETCH>
         : nb == full ? coded_Avx2<MB, full, FORMAT, SB, PREFETCH>
                      : coded_Avx2<MB, 1, FORMAT, SB, PREFETCH>;
}

// Codes stream from memory (prefetched); a decoded block is read from cache. ``sb``: inputs per
// scale (16 or 32; affine4 and the decoded buffer take 32).
CodedFn pick(Isa isa, int nb, int64_t mb, Format format, int sb) {
  return specfree::for_rows(mb, [&](auto rows) {
    constexpr int r = decltype(rows)::value;
    switch (format) {
      case kAffine4: return pick_rows<r, kAffine4, 32, true>(isa, nb);
      case kAffine8: return sb == 16 ? pick_rows<r, kAffine8, 16, true>(isa, nb) : pick_rows<r, kAffine8, 32, true>(isa, nb);
      case kScaled8: return sb == 16 ? pick_rows<r, kScaled8, 16, true>(isa, nb) : pick_rows<r, kScaled8, 32, true>(isa, nb);
      default: return pick_rows<r, kDecoded, 32, false>(isa, nb);
    }
  });
}

using DecodeFn = void (*)(const uint8_t*, const ScaleStream&, const ScaleStream&, int64_t, float*);

template <int FORMAT>
DecodeFn pick_decode_format(Isa isa, int sb) {
  if (isa == Isa::kAvx512) return sb == 16 ? decode_Avx512<FORMAT, 16> : decode_Avx512<FORMAT, 32>;
  return sb == 16 ? decode_Avx2<FORMAT, 16> : decode_Avx2<FORMAT, 32>;
}

DecodeFn pick_decode(Isa isa, Format format, int sb) {
  return format == kAffine4   ? pick_decode_format<kAffine4>(isa, 32)
         : format == kAffine8 ? pick_decode_format<kAffine8>(isa, sb)
                              : pick_decode_format<kScaled8>(isa, sb);
}

// Panels [p_begin, p_end) for all m rows into y [m, n]. Up to two groups of rows decode the codes
// in registers; more rows (a prefill, a wide tree) decode each block of panels once into a buffer
// that every group then reads from cache. (Intel VM, SmolLM2's 211 layers: decoding per group cost
// a 300-token prefill's linears 15% over the float32 panels, the buffer 5%; at 16 rows the
// buffer was 11% slower than decoding twice.)
constexpr int64_t kDecodeOnceGroups = 3;

// A layer's codes: pointers to panel 0 and the bytes of one panel of codes; scales and offsets
// as ``ScaleStream``s (float16 where every one is a float16 value, as a GGUF file's are, else
// float32; or a K-type's 8-bit sub-scales under float16 super-block scales).
struct Stream {
  const uint8_t* codes;
  int64_t code_bytes;
  ScaleStream scales, offsets;  // offsets.values null: scaled8
  Format format;
  int block;  // inputs per scale
  const uint8_t* codes_at(int64_t p) const { return codes + p * code_bytes; }
};

void coded_range(Isa isa, const float* x, int64_t m, const Stream& w, int64_t k, const float* bias, int64_t n,
                 int64_t p_begin, int64_t p_end, float* y) {
  const int P = isa == Isa::kAvx512 ? 16 : 8;
  const int64_t first = std::min<int64_t>(kGroupRows, m);
  const int nb = (isa == Isa::kAvx512 ? kWidthAvx512 : kWidthAvx2)[first];
  const int64_t groups = (m + kGroupRows - 1) / kGroupRows;
  const bool decode_once = groups >= kDecodeOnceGroups;
  std::vector<float> block(decode_once ? nb * k * P : 0);
  float out[kGroupRows * 4 * 16];
  const int64_t ldo = nb * P;
  const ScaleStream none{nullptr, nullptr, kFloat32, 0, 0};
  for (int64_t p = p_begin; p < p_end;) {
    const int width = p + nb <= p_end ? nb : 1;
    if (decode_once)
      for (int j = 0; j < width; ++j)
        pick_decode(isa, w.format, w.block)(w.codes_at(p + j), w.scales.at(p + j), w.offsets.at(p + j), k,
                                            block.data() + j * k * P);
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t mb = std::min<int64_t>(kGroupRows, m - g * kGroupRows);
      if (decode_once)
        pick(isa, width, mb, kDecoded, 32)(x + g * kGroupRows * k, k, reinterpret_cast<const uint8_t*>(block.data()),
                                           none, none, k, out, ldo);
      else
        pick(isa, width, mb, w.format, w.block)(x + g * kGroupRows * k, k, w.codes_at(p), w.scales.at(p),
                                                w.offsets.at(p), k, out, ldo);
      specfree::store_block(out, ldo, mb, width * P, bias, p * P, n, y + g * kGroupRows * n);
    }
    p += width;
  }
}

constexpr int64_t kPanelsPerTask = 4;  // a thread's share: a contiguous run of panels, one stream

struct Checked {
  int64_t k, P;
  Format format;
  int block;
  int scale_kind, offset_kind;
};

// Checks shared by both ops. The format follows from the codes' dtype: int32 affine4 (eight a
// word), uint8 affine8, int8 scaled8; the scales' kind from theirs: float32 or float16 read as
// they are, uint8 or int8 sub-scales under ``supers`` (float16 [N/P, K/256, P]; offsets, uint8,
// under ``super_offsets``, the super-blocks' minimums negated).
Checked check_codes(const at::Tensor& codes, const at::Tensor& scales, const std::optional<at::Tensor>& offsets,
                    const std::optional<at::Tensor>& supers, const std::optional<at::Tensor>& super_offsets,
                    const char* op) {
  const bool affine = offsets.has_value() && offsets->defined();
  const auto stype = scales.scalar_type();
  const bool sub = stype == at::kByte || stype == at::kChar;
  TORCH_CHECK(codes.device().is_cpu() && scales.device().is_cpu(), op, " runs on the CPU");
  TORCH_CHECK(codes.dim() == 3 && codes.is_contiguous() && scales.dim() == 3 && scales.is_contiguous() &&
              scales.size(1) > 0 && (stype == at::kFloat || stype == at::kHalf || sub), op,
              ": codes [N/P, K/8 or K, P] and float32, float16 or 8-bit scales [N/P, K/B, P], contiguous "
              "(specfree.kernels.codes), not ", codes.sizes(), " and ", scales.sizes());
  const auto type = codes.scalar_type();
  TORCH_CHECK(affine ? (type == at::kInt || type == at::kByte) : type == at::kChar, op, ": ",
              affine ? "affine codes are int32 (affine4, eight a word) or uint8 (affine8)" : "scaled8 codes are int8");
  const Format format = type == at::kInt ? kAffine4 : type == at::kByte ? kAffine8 : kScaled8;
  const int64_t P = codes.size(2), k = codes.size(1) * (format == kAffine4 ? 8 : 1);
  const int64_t block = k / scales.size(1);
  TORCH_CHECK(scales.size(0) == codes.size(0) && scales.size(2) == P && block * scales.size(1) == k &&
              (block == 32 || (block == 16 && format != kAffine4)), op,
              ": codes ", codes.sizes(), " do not match scales ", scales.sizes(),
              " (blocks of 32 inputs, or 16 for uint8 and int8 codes)");
  const auto check_supers = [&](const std::optional<at::Tensor>& t, const char* name) {
    TORCH_CHECK(t.has_value() && t->defined() && t->scalar_type() == at::kHalf && t->is_contiguous() &&
                t->dim() == 3 && k % 256 == 0 && t->size(0) == codes.size(0) && t->size(1) == k / 256 &&
                t->size(2) == P, op, ": 8-bit sub-scales need float16 ", name, " [N/P, K/256, P]");
  };
  if (sub) check_supers(supers, "supers");
  if (affine) {
    TORCH_CHECK(offsets->sizes() == scales.sizes() && offsets->is_contiguous() &&
                offsets->scalar_type() == (sub ? at::kByte : stype), op,
                ": offsets must be shaped like the scales and of their dtype (uint8 under 8-bit sub-scales)");
    if (sub) check_supers(super_offsets, "super_offsets");
  }
  const int kind = stype == at::kFloat ? kFloat32 : stype == at::kHalf ? kFloat16 : stype == at::kByte ? kUnsigned8 : kSigned8;
  return {k, P, format, static_cast<int>(block), kind, sub ? static_cast<int>(kUnsigned8) : kind};
}

ScaleStream scale_stream(const at::Tensor& values, const std::optional<at::Tensor>& supers, int kind) {
  const bool sub = kind == kUnsigned8 || kind == kSigned8;
  return {static_cast<const uint8_t*>(values.data_ptr()),
          sub ? static_cast<const uint8_t*>(supers->data_ptr()) : nullptr, kind,
          values.size(1) * values.size(2) * values.element_size(), sub ? supers->size(1) * supers->size(2) * 2 : 0};
}

at::Tensor coded_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                        const std::optional<at::Tensor>& offsets, const std::optional<at::Tensor>& bias,
                        int64_t n, c10::string_view isa_name, const std::optional<at::Tensor>& supers,
                        const std::optional<at::Tensor>& super_offsets) {
  const Checked c = check_codes(codes, scales, offsets, supers, super_offsets, "specfree::coded_linear");
  const int64_t k = c.k, P = c.P;
  const bool affine = c.format != kScaled8;
  const Isa isa = specfree::parse_isa(std::string(isa_name), "specfree::coded_linear");
  const int64_t count = codes.size(0);
  TORCH_CHECK(P == (isa == Isa::kAvx512 ? 16 : 8), "specfree::coded_linear: codes in panels of ", P,
              " columns cannot run the ", isa == Isa::kAvx512 ? "avx512" : "avx2", " path; code for it");
  TORCH_CHECK(x.device().is_cpu() && x.size(-1) == k && n <= count * P && n > count * P - P,
              "specfree::coded_linear: shapes ", x.sizes(), " and codes for ", k, " inputs and ", n,
              " outputs do not multiply");
  const int64_t m = x.numel() / std::max<int64_t>(k, 1);
  const at::Tensor x32 = specfree::float_rows(x), b = specfree::bias_as(bias, at::kFloat);
  at::Tensor y = specfree::output_rows(x, n);
  if (m > 0) {
    const Stream w{static_cast<const uint8_t*>(codes.data_ptr()), codes.size(1) * P * codes.element_size(),
                   scale_stream(scales, supers, c.scale_kind),
                   affine ? scale_stream(*offsets, super_offsets, c.offset_kind) : ScaleStream{nullptr, nullptr, 0, 0, 0},
                   c.format, c.block};
    at::parallel_for(0, count, kPanelsPerTask, [&](int64_t begin, int64_t end) {
      coded_range(isa, x32.data_ptr<float>(), m, w, k, b.defined() ? b.data_ptr<float>() : nullptr, n, begin, end,
                  y.data_ptr<float>());
    });
  }
  return x.scalar_type() == at::kFloat ? y : y.to(x.scalar_type());
}

// Each block's float32 scales [N/P, K/B, P]: as held, or sub-scale times super-block scale (one
// rounding, as the kernel computes it).
at::Tensor block_scales(const at::Tensor& values, const std::optional<at::Tensor>& supers, int block) {
  if (values.scalar_type() == at::kFloat || values.scalar_type() == at::kHalf) return values.to(at::kFloat);  // exact
  return values.to(at::kFloat) * supers->to(at::kFloat).repeat_interleave(256 / block, 1);
}

// The float32 panels [N/P, K, P] the codes stand for, decoded with the kernel's own operations
// (fmaf is the vector fma, correctly rounded; q * d is one rounding): what packing compares with
// the original weight, and what ``.weight`` and the state dict unpack.
at::Tensor decode_panels(const at::Tensor& codes, const at::Tensor& scales, const std::optional<at::Tensor>& offsets,
                         const std::optional<at::Tensor>& supers, const std::optional<at::Tensor>& super_offsets) {
  const Checked checked = check_codes(codes, scales, offsets, supers, super_offsets, "specfree::decode_panels");
  const int64_t k = checked.k, P = checked.P, block = checked.block;
  const Format format = checked.format;
  const bool affine = format != kScaled8;
  const int64_t count = codes.size(0);
  at::Tensor panels = at::empty({count, k, P}, codes.options().dtype(at::kFloat));
  const auto* c = static_cast<const uint8_t*>(codes.data_ptr());
  const at::Tensor d32 = block_scales(scales, supers, block).contiguous();
  const at::Tensor o32 = affine ? block_scales(*offsets, super_offsets, block).contiguous() : at::Tensor();
  const float *d = d32.data_ptr<float>(), *o = affine ? o32.data_ptr<float>() : nullptr;
  float* w = panels.data_ptr<float>();
  at::parallel_for(0, count, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p)
      for (int64_t i = 0; i < k; ++i)
        for (int64_t col = 0; col < P; ++col) {
          const int64_t s = (p * (k / block) + i / block) * P + col;
          float q;
          if (format == kAffine4) {
            const auto word = static_cast<uint32_t>(reinterpret_cast<const int32_t*>(c)[(p * (k / 8) + i / 8) * P + col]);
            q = static_cast<float>(word >> (4 * (i % 8)) & 15);
            w[(p * k + i) * P + col] = std::fmaf(q, d[s], o[s]);
          } else if (format == kAffine8) {
            q = static_cast<float>(c[(p * k + i) * P + col]);
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
        "str isa='auto', Tensor? supers=None, Tensor? super_offsets=None) -> Tensor");
  m.def("decode_panels(Tensor codes, Tensor scales, Tensor? offsets, Tensor? supers=None, "
        "Tensor? super_offsets=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(specfree, CPU, m) {
  m.impl("coded_linear", &coded_linear);
  m.impl("decode_panels", &decode_panels);
}
