// specfree::panel_linear and specfree::coded_linear -- y = x W^T + b with W held in panels, in any
// of the formats of one table, run by one driver.
//
// A product of 1-16 rows is bound by reading W (or, on a few cores, by the FMAs that decode it). The
// model's own layout ([N, K]) makes a kernel that computes several outputs at once read several
// short rows of W side by side; packed, W is a sequence of panels [N/P, K, P]: P output columns (one
// vector: 8 floats AVX2, 16 AVX-512), K contiguous, zero columns past N. A thread takes a contiguous
// run of panels, one sequential stream; at each k one vector of weights meets every row's
// activation, broadcast from L1.
//
// The format table (``Format``; ggml's type traits are the model): one row a format, naming how a
// vector of P weights at input k is read, and how wide a block of panels a group of rows takes.
//   f32, f16, bf16  the weights themselves, widened in registers (exact)      [N/P, K, P]
//   affine4         w = fma(q, d, m), q in 0..15, eight codes a 32-bit word   [N/P, K/8, P] int32
//   affine8         w = fma(q, d, m), q in 0..255                             [N/P, K, P] uint8
//   scaled8         w = q * d,        q in -128..127                          [N/P, K, P] int8
// The coded formats carry scales d and offsets m per block of 16 or 32 inputs and output column,
// [N/P, K/B, P], float32 or float16, or a GGUF K-type's 8-bit sub-scales under its 256-input
// super-block's float16 scale (``ScaleStream``). A quantized GGUF's blocks map onto them
// (``gguf_blocks.py``); every code decodes, with the kernel's own operations, to the float32 value
// ``gguf``'s dequantize gives (one rounding there too: checked per type in the tests).
//
// Every output (m, n) is one lane of one accumulator, fma over k = 0..K-1 in order, then + bias:
// the same operations whatever the format, the number of rows, which panels share a block, or
// which thread runs it. So a row's bits never depend on the other rows of the call (batch
// invariance), a coded layer's output is bit-identical to the float32 panels of its decoded
// weights, and the AVX2 and AVX-512 paths compute the same sums, lane for lane.
//
// The activations are the table's other column: float32 as they come (every format; what the above
// says), or, for the coded formats at precision=int8, each row quantized alone to 8-bit codes per
// block of the weight's and multiplied as integers (``SPECFREE_INT8``: llama.cpp's arithmetic,
// other bits than float32, but again each row's own and the same on every ISA).
//
// The driver (``panel_range``) is the same for every format and activation type: row groups, block
// widths, the decode-once buffer of coded formats under many rows, the split among threads.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include "c_entries.h"
#include "isa.h"

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

namespace {

using specfree::Isa;

#define UNROLL _Pragma("GCC unroll 16")

// ---- the format table -------------------------------------------------------------------------
enum Format { kF32 = 0, kF16 = 1, kBF16 = 2, kAffine4 = 3, kAffine8 = 4, kScaled8 = 5 };
constexpr bool coded(int f) { return f >= kAffine4; }

// Rows whose accumulators share the registers; more rows go in groups, each group re-reading the
// block of panels from cache.
constexpr int kGroupRows = 8;

// Panels per block for a group of MB rows: MB*NB accumulators and the NB weight vectors fit the
// registers (16 vectors AVX2, 32 AVX-512); coded formats also hold NB scales and offsets.
// Plain formats: one row on AVX-512 reads 8 panels side by side, more weight streams in flight
// (Intel Xeon VM, family 6 model 167, SmolLM2's 211 layers, two threads, medians of 15
// interleaved passes: 1 row 1.17 -> 1.12x the read pass; 2-8 rows gained nothing from wider
// blocks). AVX2 groups of 4 rows against 2 panels measured no faster on Zen 3 than 8 against 1.
constexpr int kPlainAvx512[kGroupRows + 1] = {0, 8, 4, 4, 4, 4, 3, 3, 3};
constexpr int kPlainAvx2[kGroupRows + 1] = {0, 4, 4, 3, 2, 2, 2, 1, 1};
constexpr int kCodedAvx512[kGroupRows + 1] = {0, 4, 4, 3, 3, 2, 2, 2, 2};
constexpr int kCodedAvx2[kGroupRows + 1] = {0, 2, 2, 2, 1, 1, 1, 1, 1};

// Plain formats with more rows than a group go, on AVX2, in groups of 6 against 2 panels: 12 FMAs
// for 8 loads at each k where 8 rows against 1 panel need 9 loads for 8 FMAs (Zen 3, one core,
// weights in cache: 16-160 rows at 74-96 GFLOPS against 48-60; SmolLM2's 211 layers, two threads,
// 8-20% faster at 12-32 rows). Up to 8 rows one group of 8 against 1 panel stays: there the weight
// stream decides, and groups of 4 or 6 were measured 16-23% slower at 8 rows.
constexpr int kManyRowsAvx2 = 6;

// Coded formats under three groups of rows or more (a prefill, a wide tree) decode each block of
// panels once into a float32 buffer that every group then reads from cache as f32 panels. (Intel
// VM, SmolLM2's 211 layers: decoding per group cost a 300-token prefill's linears 15% over the
// float32 panels, the buffer 5%; at 16 rows the buffer was 11% slower than decoding twice.)
constexpr int64_t kDecodeOnceGroups = 3;

// Where a coded panel's per-block scales (or offsets) come from: float32 or float16, or, for a
// GGUF K-type, an 8-bit integer sub-scale times its 256-input super-block's float16 scale -- the
// product gguf computes (d * sc, one rounding; held this way a Q4_K weight costs 4.6 bits, not 6).
// K-type offsets are held with the super-block's minimum negated (-dmin: exact), so the product
// is the offset -(dmin * m) itself.
enum ScaleKind { kScale32 = 0, kScale16 = 1, kUnsigned8 = 2, kSigned8 = 3 };

struct ScaleStream {
  const uint8_t* values;  // panel 0's [K/B, P] scales
  const uint8_t* supers;  // panel 0's [K/256, P] float16 super-block scales (8-bit kinds only)
  int kind;
  int64_t panel_bytes, super_panel_bytes;  // one panel's bytes in each
  int64_t size() const { return kind == kScale32 ? 4 : kind == kScale16 ? 2 : 1; }
  ScaleStream at(int64_t p) const {
    return {values ? values + p * panel_bytes : nullptr, supers ? supers + p * super_panel_bytes : nullptr, kind,
            panel_bytes, super_panel_bytes};
  }
};
constexpr ScaleStream kNoScales{nullptr, nullptr, kScale32, 0, 0};  // plain weights, scaled8's offsets

// A layer's weights as the driver reads them.
struct Panels {
  const uint8_t* data;  // panel 0's weights or codes
  int64_t panel_bytes;  // one panel's
  int64_t k;
  Format format;
  int block;                    // coded: inputs per scale (16 or 32)
  ScaleStream scales, offsets;  // coded: offsets.values null for scaled8
  const uint8_t* at(int64_t p) const { return data + p * panel_bytes; }
};

// ---- the two ISAs: vector width, and how each format's elements widen to float lanes ----------
// Within a 128-bit lane of four dwords (four inputs' codes of four columns), byte 4i + j -> 4j + i.
SPECFREE_AVX2 inline __m128i quad_bytes() { return _mm_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15); }

struct Avx512 {
  using Vec = __m512;
  using Int = __m512i;
  static constexpr int P = 16;
  SPECFREE_AVX512 static Vec zero() { return _mm512_setzero_ps(); }
  SPECFREE_AVX512 static Vec bcast(const float* p) { return _mm512_set1_ps(*p); }
  SPECFREE_AVX512 static Vec fma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
  SPECFREE_AVX512 static Vec mul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
  SPECFREE_AVX512 static void store(float* p, Vec v) { _mm512_storeu_ps(p, v); }
  template <typename W>
  SPECFREE_AVX512 static Vec load(const W* p) { return specfree::load16(p); }
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
    if (s.kind == kScale32) return _mm512_loadu_ps(reinterpret_cast<const float*>(at));
    if (s.kind == kScale16) return halves(at);
    const Vec super = halves(s.supers + b * sb / 256 * P * 2);
    return mul(s.kind == kUnsigned8 ? ubytes(at) : bytes(reinterpret_cast<const int8_t*>(at)), super);
  }
  // 8-bit activations: a lane holds four codes of one output column (four inputs), as unsigned
  // bytes, against four activation codes broadcast as one 32-bit word.
  SPECFREE_AVX512 static Int izero() { return _mm512_setzero_si512(); }
  SPECFREE_AVX512 static Int ibcast(const int8_t* p) { return _mm512_set1_epi32(specfree::word_at(p)); }
  SPECFREE_AVX512 static Int isub(Int v, int32_t s) { return _mm512_sub_epi32(v, _mm512_set1_epi32(s)); }
  SPECFREE_AVX512 static Vec to_float(Int v) { return _mm512_cvtepi32_ps(v); }
  // a word of eight 4-bit codes (input 8g+i in bits 4i..4i+3): inputs 0, 2, 4, 6 as the low
  // nibbles of its four bytes, inputs 1, 3, 5, 7 as the high ones
  SPECFREE_AVX512 static Int low_nibbles(Int v) { return _mm512_and_si512(v, _mm512_set1_epi8(15)); }
  SPECFREE_AVX512 static Int high_nibbles(Int v) { return _mm512_and_si512(_mm512_srli_epi32(v, 4), _mm512_set1_epi8(15)); }
  // Four inputs' byte codes [4, P] (row stride P: 64 contiguous bytes) as P lanes of four bytes;
  // ``flip`` makes signed codes unsigned (q + 128: the top bit flipped). Three instructions where
  // unpacking row against row took fifteen: the 4x4 dwords transposed across the 128-bit lanes
  // (lane L takes dword L of each input: columns 4L..4L+3), then each lane's 4x4 bytes.
  SPECFREE_AVX512 static Int quads(const uint8_t* p, bool flip) {
    const Int dwords = _mm512_permutexvar_epi32(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15),
                                                _mm512_loadu_si512(p));
    const Int v = _mm512_shuffle_epi8(dwords, _mm512_broadcast_i32x4(quad_bytes()));
    return flip ? _mm512_xor_si512(v, _mm512_set1_epi8(static_cast<char>(0x80))) : v;
  }
  // acc + the sum of each lane's four products of unsigned codes ``w`` and signed codes ``x``, exact.
  // Without VNNI: maddubs (pairs to 16 bits) and madd (pairs to 32); codes of 8 bits go as two
  // nibbles each, so no pair of products can saturate 16 bits (15 * 127 * 2 < 2^15).
  template <bool SMALL>
  SPECFREE_AVX512 static Int dot(Int acc, Int w, Int x) {
    const Int ones = _mm512_set1_epi16(1);
    if constexpr (SMALL) return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(w, x), ones));
    const Int low = _mm512_madd_epi16(_mm512_maddubs_epi16(low_nibbles(w), x), ones);
    const Int high = _mm512_madd_epi16(_mm512_maddubs_epi16(high_nibbles(w), x), ones);
    return _mm512_add_epi32(acc, _mm512_add_epi32(low, _mm512_slli_epi32(high, 4)));
  }
  // A block's integer dot product: Q lanes of codes against a row's codes, four at a time (signed
  // codes come flipped, their 128 * sum taken off after: ``kFlipSigned``).
  static constexpr bool kFlipSigned = true;
  template <int FORMAT, int Q>
  SPECFREE_AVX512 static Int block_dot(const Int* w, const int8_t* x) {
    Int acc = izero();
    UNROLL for (int t = 0; t < Q; ++t) acc = dot<FORMAT == kAffine4>(acc, w[t], ibcast(x + 4 * t));
    return acc;
  }
};

// AVX-512 with VNNI (Intel Ice Lake and later, AMD Zen 4 and later): vpdpbusd sums each lane's four
// byte products into 32 bits in one instruction (no saturation).
struct Avx512Vnni : Avx512 {
  template <bool SMALL>
  SPECFREE_AVX512_VNNI static Int dot(Int acc, Int w, Int x) { return _mm512_dpbusd_epi32(acc, w, x); }
  template <int FORMAT, int Q>
  SPECFREE_AVX512_VNNI static Int block_dot(const Int* w, const int8_t* x) {
    Int acc = izero();
    UNROLL for (int t = 0; t < Q; ++t) acc = dot<true>(acc, w[t], ibcast(x + 4 * t));
    return acc;
  }
};

struct Avx2 {
  using Vec = __m256;
  using Int = __m256i;
  static constexpr int P = 8;
  SPECFREE_AVX2 static Vec zero() { return _mm256_setzero_ps(); }
  SPECFREE_AVX2 static Vec bcast(const float* p) { return _mm256_broadcast_ss(p); }
  SPECFREE_AVX2 static Vec fma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
  SPECFREE_AVX2 static Vec mul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
  SPECFREE_AVX2 static void store(float* p, Vec v) { _mm256_storeu_ps(p, v); }
  template <typename W>
  SPECFREE_AVX2 static Vec load(const W* p) { return specfree::load8(p); }
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
    if (s.kind == kScale32) return _mm256_loadu_ps(reinterpret_cast<const float*>(at));
    if (s.kind == kScale16) return halves(at);
    const Vec super = halves(s.supers + b * sb / 256 * P * 2);
    return mul(s.kind == kUnsigned8 ? ubytes(at) : bytes(reinterpret_cast<const int8_t*>(at)), super);
  }
  SPECFREE_AVX2 static Int izero() { return _mm256_setzero_si256(); }
  SPECFREE_AVX2 static Int ibcast(const int8_t* p) { return _mm256_set1_epi32(specfree::word_at(p)); }
  SPECFREE_AVX2 static Int isub(Int v, int32_t s) { return _mm256_sub_epi32(v, _mm256_set1_epi32(s)); }
  SPECFREE_AVX2 static Vec to_float(Int v) { return _mm256_cvtepi32_ps(v); }
  SPECFREE_AVX2 static Int low_nibbles(Int v) { return _mm256_and_si256(v, _mm256_set1_epi8(15)); }
  SPECFREE_AVX2 static Int high_nibbles(Int v) { return _mm256_and_si256(_mm256_srli_epi32(v, 4), _mm256_set1_epi8(15)); }
  SPECFREE_AVX2 static Int quads(const uint8_t* p, bool flip) {  // as Avx512's, over [4, 8]: 32 bytes
    const Int dwords = _mm256_permutevar8x32_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)),
                                                   _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7));
    const Int v = _mm256_shuffle_epi8(dwords, _mm256_broadcastsi128_si256(quad_bytes()));
    return flip ? _mm256_xor_si256(v, _mm256_set1_epi8(static_cast<char>(0x80))) : v;
  }
  // A block's integer dot product, with fewer multiplies than a madd per lane:
  //   affine4: the Q products of maddubs summed in 16 bits, one madd after (each 16-bit lane then
  //     holds 2Q products of a code below 16 and one of at most 127: 2 * 8 * 15 * 127 < 2^15);
  //   scaled8: signed codes as they are, |w| times x with w's sign (vpsignb), so one maddubs a
  //     lane (a pair: 2 * 128 * 127 < 2^15) where flipped codes take two, as two nibbles;
  //   affine8: codes to 255, two nibbles a lane.
  // Every sum is exact, so it is the same integer as the other ISAs' (no ``kFlipSigned`` here).
  static constexpr bool kFlipSigned = false;
  template <int FORMAT, int Q>
  SPECFREE_AVX2 static Int block_dot(const Int* w, const int8_t* x) {
    const Int ones = _mm256_set1_epi16(1);
    if constexpr (FORMAT == kAffine4) {
      static_assert(Q <= 8, "16-bit sums of more than 16 products of 4-bit codes can overflow");
      Int sum = _mm256_maddubs_epi16(w[0], ibcast(x));
      UNROLL for (int t = 1; t < Q; ++t) sum = _mm256_add_epi16(sum, _mm256_maddubs_epi16(w[t], ibcast(x + 4 * t)));
      return _mm256_madd_epi16(sum, ones);
    }
    Int acc = izero();
    UNROLL for (int t = 0; t < Q; ++t) {
      const Int xt = ibcast(x + 4 * t);
      if constexpr (FORMAT == kScaled8) {
        const Int pairs = _mm256_maddubs_epi16(_mm256_abs_epi8(w[t]), _mm256_sign_epi8(xt, w[t]));
        acc = _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, ones));
      } else {
        const Int low = _mm256_madd_epi16(_mm256_maddubs_epi16(low_nibbles(w[t]), xt), ones);
        const Int high = _mm256_madd_epi16(_mm256_maddubs_epi16(high_nibbles(w[t]), xt), ones);
        acc = _mm256_add_epi32(acc, _mm256_add_epi32(low, _mm256_slli_epi32(high, 4)));
      }
    }
    return acc;
  }
};

// ---- the block kernels: MB rows against NB adjacent panels, all of K --------------------------
// ``out`` is [MB, NB*P], row stride ldo. Loops over rows and panels unroll, so the accumulators
// live in registers (without it GCC 12 keeps acc[][] on the stack and stores it every step: 4x
// slower at 8 rows).

// Software prefetch this far ahead in each stream of plain weights (bytes; SmolLM2's 211 shapes).
constexpr int64_t kAhead = 1024;

// Plain formats: the k loop steps one cache line of each panel at a time (STEP vectors), and with
// PREFETCH touches the line kAhead bytes on once per step (a test and a prefetch at every k cost
// half the FMA throughput at 8 rows: Zen 3, 22 against 42 GFMA/s a core, weights in cache). One k:
// NB weight vectors meet MB broadcast activations. (A macro, not a lambda: a lambda would not take
// the enclosing function's target ISA.)
#define SPECFREE_PLAIN_K(I)                                                                            \
  {                                                                                                    \
    const int64_t ik = (I);                                                                            \
    Vec w[NB];                                                                                         \
    UNROLL for (int j = 0; j < NB; ++j) w[j] = V::load(panels + ik * P + j * stride);                  \
    UNROLL for (int m = 0; m < MB; ++m) {                                                              \
      const Vec xm = V::bcast(x + m * ldx + ik);                                                       \
      UNROLL for (int j = 0; j < NB; ++j) acc[m][j] = V::fma(xm, w[j], acc[m][j]);                     \
    }                                                                                                  \
  }

#define SPECFREE_PLAIN(ATTR, ISA)                                                                      \
  template <int MB, int NB, bool PREFETCH, typename W>                                                 \
  ATTR void plain_##ISA(const float* x, int64_t ldx, const void* weights, int64_t k, float* out, int64_t ldo) { \
    using V = ISA;                                                                                     \
    using Vec = typename V::Vec;                                                                       \
    constexpr int P = V::P;                                                                            \
    const W* panels = static_cast<const W*>(weights);                                                  \
    Vec acc[MB][NB];                                                                                   \
    UNROLL for (int m = 0; m < MB; ++m) UNROLL for (int j = 0; j < NB; ++j) acc[m][j] = V::zero();     \
    const int64_t stride = k * P; /* one panel */                                                      \
    constexpr int64_t ahead = kAhead / sizeof(W);                                                      \
    constexpr int STEP = std::max<int>(1, 64 / sizeof(W) / P);                                         \
    int64_t i = 0;                                                                                     \
    for (; i + STEP <= k; i += STEP) {                                                                 \
      if constexpr (PREFETCH)                                                                          \
        UNROLL for (int j = 0; j < NB; ++j)                                                            \
          _mm_prefetch(reinterpret_cast<const char*>(panels + i * P + j * stride + ahead), _MM_HINT_T0); \
      UNROLL for (int s = 0; s < STEP; ++s) SPECFREE_PLAIN_K(i + s);                                   \
    }                                                                                                  \
    for (; i < k; ++i) SPECFREE_PLAIN_K(i);                                                            \
    UNROLL for (int m = 0; m < MB; ++m) UNROLL for (int j = 0; j < NB; ++j) V::store(out + m * ldo + j * P, acc[m][j]); \
  }

// Coded formats: blocks of SB inputs, each with its scales (and offsets) a panel; inputs go 8 at a
// time, so affine4 decodes all 8 from one load of P words. Prefetching: while a block of NB panels
// runs, the same block of the next NB panels (a thread's panels are contiguous, so that is the next
// stretch of its streams), every line of the codes and the scale and offset lines. (Intel VM,
// SmolLM2's 211 layers at 1 / 2 / 4 / 8 / 16 rows: 6 / 13 / 15 / 10 / 7% less time than
// prefetching 1 KB ahead within each panel. Past a thread's last panels this reads ahead into the
// next thread's, or past the tensor: a prefetch is a hint and never faults.)
#define SPECFREE_CODED(ATTR, ISA)                                                                      \
  template <int MB, int NB, int FORMAT, int SB>                                                        \
  ATTR void coded_##ISA(const float* x, int64_t ldx, const uint8_t* codes, const ScaleStream& scales,  \
                        const ScaleStream& offsets, int64_t k, float* out, int64_t ldo) {              \
    using V = ISA;                                                                                     \
    using Vec = typename V::Vec;                                                                       \
    constexpr int P = V::P;                                                                            \
    constexpr bool AFFINE = FORMAT != kScaled8;                                                        \
    constexpr int64_t block_bytes = FORMAT == kAffine4 ? SB * P / 2 : SB * P;                          \
    Vec acc[MB][NB];                                                                                   \
    UNROLL for (int m = 0; m < MB; ++m) UNROLL for (int j = 0; j < NB; ++j) acc[m][j] = V::zero();     \
    const int64_t cstride = k / SB * block_bytes; /* one panel */                                      \
    for (int64_t b = 0; b < k / SB; ++b) {                                                             \
      Vec d[NB], o[NB];                                                                                \
      UNROLL for (int j = 0; j < NB; ++j) {                                                            \
        d[j] = V::block_scale(scales.at(j), b, SB);                                                    \
        if constexpr (AFFINE) o[j] = V::block_scale(offsets.at(j), b, SB);                             \
        const char* c = reinterpret_cast<const char*>(codes + (NB + j) * cstride + b * block_bytes);    \
        UNROLL for (int64_t line = 0; line < block_bytes; line += 64) _mm_prefetch(c + line, _MM_HINT_T0); \
        const int64_t at = b * P * scales.size();                                                      \
        _mm_prefetch(reinterpret_cast<const char*>(scales.at(NB + j).values + at), _MM_HINT_T0);       \
        if constexpr (AFFINE) _mm_prefetch(reinterpret_cast<const char*>(offsets.at(NB + j).values + at), _MM_HINT_T0); \
      }                                                                                                \
      UNROLL for (int g = 0; g < SB; g += 8) {                                                         \
        typename V::Int v[NB];                                                                         \
        if constexpr (FORMAT == kAffine4) UNROLL for (int j = 0; j < NB; ++j)                          \
          v[j] = V::words(reinterpret_cast<const int32_t*>(codes + j * cstride + b * block_bytes) + g / 8 * P); \
        UNROLL for (int i = 0; i < 8; ++i) {                                                           \
          const int64_t at = b * SB + g + i;                                                           \
          Vec w[NB];                                                                                   \
          UNROLL for (int j = 0; j < NB; ++j) {                                                        \
            if constexpr (FORMAT == kAffine4) w[j] = V::fma(V::nibble(v[j], i), d[j], o[j]);           \
            else if constexpr (FORMAT == kAffine8) w[j] = V::fma(V::ubytes(codes + j * cstride + at * P), d[j], o[j]); \
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

// One coded panel decoded into float32 [K, P], with the block kernel's own instructions.
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

// ---- 8-bit activations ------------------------------------------------------------------------
// precision=int8 (llama.cpp's arithmetic on a quantized file's own codes): each row of x is
// quantized alone, per block of the weight's SB inputs, to signed 8 bits under one float32 scale
// (``quantize_rows``: d = amax / 127, q = x / d rounded to nearest, ties to even, within +-127),
// and each output
// is, over its blocks b = 0..K/SB-1 in order,
//   acc = fma(w_d * x_d, float(isum), acc)   isum = the block's integer dot product, exact in int32
//   acc = fma(w_m, x_s, acc)                 formats with offsets: x_s = x_d * float(sum of x's codes)
// then + bias. Every operation is one lane's and the integer sums are exact, so a row's bits
// depend on nothing else in the call (the other rows, their count, the thread) nor on the ISA or
// whether it has VNNI.
//
// The codes meet the activations four inputs at a time: one 32-bit lane of bytes per output column
// (affine4: a word's low or high nibbles, its even or odd inputs, so x's codes are stored in that
// order; affine8 and scaled8: four inputs' bytes interleaved; ISAs that take unsigned codes only
// flip scaled8's to q + 128 and take the sum of x's codes times 128 off after: ``kFlipSigned``).
// Each ISA sums a block as it does best (``block_dot``); the sums are exact, so the same integers.
// A block of NB panels is unpacked this way into registers, then a group of up to ``kInt8Group``
// rows runs against it, their accumulators in registers across all of K; a call's further groups
// unpack the panels again from cache, or, in a prefill, read them as the first group staged them.
struct Int8Rows {
  int8_t* q;     // [m, K] codes (affine4: each run of 8 inputs as 0, 2, 4, 6, 1, 3, 5, 7)
  float* d;      // [m, K/SB] scales
  float* s;      // [m, K/SB] d * float(sum of the block's codes)
  int32_t* sum;  // [m, K/SB] sum of the block's codes
};

// Rows against one unpacked block of panels, accumulators in registers. (AMD EPYC Zen 3, AVX2, SmolLM2
// Q4_1's coded calls in a forward's order, two threads: groups of 8 ran 8 rows 4-8% faster than
// groups of 4, and 1-16 rows 4-20% faster than every row of the call against a block with its
// results kept in memory between blocks.)
constexpr int kInt8Group = 8;
static_assert(kInt8Group <= kGroupRows, "a group's results fit the driver's block buffer");

// A call of kDecodeOnceGroups groups of rows or more (a prefill) has its first group write each
// block of panels as unpacked (codes as the sums take them, float32 scales) into a buffer that the
// later groups read back, so the codes are unpacked once a call; fewer groups unpack as they go.
enum Stage { kUnpack = 0, kWriteStaged = 1, kReadStaged = 2 };
constexpr int64_t kStagedBytes = 8 * 64 + 2 * 64;  // one panel's block unpacked: Q <= 8 lanes, P <= 16
static_assert(kStagedBytes % 64 == 0, "staged in whole cache lines");

#define SPECFREE_INT8(ATTR, ISA)                                                                       \
  template <int MB, int NB, int FORMAT, int SB, int STAGE>                                             \
  ATTR void int8_##ISA(const Int8Rows& xq, int64_t r0, const uint8_t* codes, const ScaleStream& scales, \
                       const ScaleStream& offsets, int64_t k, float* out, int64_t ldo, uint8_t* staged) { \
    using V = ISA;                                                                                     \
    using Vec = typename V::Vec;                                                                       \
    using Int = typename V::Int;                                                                       \
    constexpr int P = V::P;                                                                            \
    constexpr bool AFFINE = FORMAT != kScaled8;                                                        \
    constexpr bool FLIP = FORMAT == kScaled8 && V::kFlipSigned;                                        \
    constexpr int Q = SB / 4;                  /* lanes of four inputs a block */                      \
    constexpr int64_t block_bytes = FORMAT == kAffine4 ? SB * P / 2 : SB * P;                          \
    const int64_t cstride = k / SB * block_bytes, blocks = k / SB;                                     \
    Vec acc[MB][NB];                                                                                   \
    UNROLL for (int m = 0; m < MB; ++m) UNROLL for (int j = 0; j < NB; ++j) acc[m][j] = V::zero();     \
    Int* staged_w = reinterpret_cast<Int*>(staged);                   /* [blocks][NB][Q] */            \
    Vec* staged_s = reinterpret_cast<Vec*>(staged_w + blocks * NB * Q); /* [blocks][2][NB] */          \
    for (int64_t b = 0; b < blocks; ++b) {                                                             \
      Vec d[NB], o[NB];                                                                                \
      Int w[NB][Q];                                                                                    \
      if constexpr (STAGE == kReadStaged) {                                                            \
        UNROLL for (int j = 0; j < NB; ++j) {                                                          \
          UNROLL for (int t = 0; t < Q; ++t) w[j][t] = staged_w[(b * NB + j) * Q + t];                 \
          d[j] = staged_s[(2 * b) * NB + j];                                                           \
          o[j] = staged_s[(2 * b + 1) * NB + j];                                                       \
        }                                                                                              \
      } else UNROLL for (int j = 0; j < NB; ++j) {                                                     \
        d[j] = V::block_scale(scales.at(j), b, SB);                                                    \
        if constexpr (AFFINE) o[j] = V::block_scale(offsets.at(j), b, SB);                             \
        const uint8_t* c = codes + j * cstride + b * block_bytes;                                      \
        const char* next = reinterpret_cast<const char*>(c + NB * cstride);                            \
        UNROLL for (int64_t line = 0; line < block_bytes; line += 64) _mm_prefetch(next + line, _MM_HINT_T0); \
        const int64_t at = b * P * scales.size();                                                      \
        _mm_prefetch(reinterpret_cast<const char*>(scales.at(NB + j).values + at), _MM_HINT_T0);       \
        if constexpr (AFFINE) _mm_prefetch(reinterpret_cast<const char*>(offsets.at(NB + j).values + at), _MM_HINT_T0); \
        if constexpr (FORMAT == kAffine4) {                                                            \
          UNROLL for (int g = 0; g < SB / 8; ++g) {                                                    \
            const Int v = V::words(reinterpret_cast<const int32_t*>(c) + g * P);                       \
            w[j][2 * g] = V::low_nibbles(v);                                                           \
            w[j][2 * g + 1] = V::high_nibbles(v);                                                      \
          }                                                                                            \
        } else {                                                                                       \
          UNROLL for (int t = 0; t < Q; ++t) w[j][t] = V::quads(c + 4 * t * P, FLIP);                  \
        }                                                                                              \
        if constexpr (STAGE == kWriteStaged) {                                                         \
          UNROLL for (int t = 0; t < Q; ++t) staged_w[(b * NB + j) * Q + t] = w[j][t];                 \
          staged_s[(2 * b) * NB + j] = d[j];                                                           \
          staged_s[(2 * b + 1) * NB + j] = AFFINE ? o[j] : V::zero();                                  \
        }                                                                                              \
      }                                                                                                \
      UNROLL for (int m = 0; m < MB; ++m) {                                                            \
        const int64_t at = (r0 + m) * blocks + b;                                                      \
        const int8_t* x = xq.q + (r0 + m) * k + b * SB;                                                \
        const Vec xd = V::bcast(xq.d + at);                                                            \
        UNROLL for (int j = 0; j < NB; ++j) {                                                          \
          const Int dot = V::template block_dot<FORMAT, Q>(w[j], x);                                   \
          const Int isum = FLIP ? V::isub(dot, 128 * xq.sum[at]) : dot;                                \
          acc[m][j] = V::fma(V::mul(d[j], xd), V::to_float(isum), acc[m][j]);                          \
          if constexpr (AFFINE) acc[m][j] = V::fma(o[j], V::bcast(xq.s + at), acc[m][j]);              \
        }                                                                                              \
      }                                                                                                \
    }                                                                                                  \
    UNROLL for (int m = 0; m < MB; ++m) UNROLL for (int j = 0; j < NB; ++j) V::store(out + m * ldo + j * P, acc[m][j]); \
  }

// Rows [r_begin, r_end) of x [m, k] quantized for blocks of ``sb`` inputs into ``rows`` (its
// arrays sized for all m rows); ``nibble_order``: each run of 8 inputs stored as affine4's lanes
// take them. One code for every ISA (AVX2: the AVX-512 path runs it too), lane-wise operations
// and an exact maximum: the codes and scales of a row are the same whatever else runs.
SPECFREE_AVX2 void quantize_rows(const float* x, int64_t r_begin, int64_t r_end, int64_t k, int sb,
                                 bool nibble_order, const Int8Rows& rows) {
  const int64_t blocks = k / sb;
  const __m256 sign = _mm256_set1_ps(-0.0f);
  alignas(32) int32_t q[32];
  for (int64_t r = r_begin; r < r_end; ++r)
    for (int64_t b = 0; b < blocks; ++b) {
      const float* v = x + r * k + b * sb;
      __m256 top = _mm256_setzero_ps();
      for (int i = 0; i < sb; i += 8) top = _mm256_max_ps(top, _mm256_andnot_ps(sign, _mm256_loadu_ps(v + i)));
      alignas(32) float lanes[8];
      _mm256_store_ps(lanes, top);
      float amax = 0.0f;
      for (float lane : lanes) amax = std::max(amax, lane);
      const float d = amax / 127.0f;
      const __m256 dv = _mm256_set1_ps(d);
      for (int i = 0; i < sb; i += 8) {
        const __m256 scaled = d > 0.0f ? _mm256_div_ps(_mm256_loadu_ps(v + i), dv) : _mm256_setzero_ps();
        const __m256i rounded = _mm256_cvtps_epi32(_mm256_round_ps(scaled, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        // clamped: only a subnormal d (amax below 127 * 2^-126) can round past 127
        _mm256_store_si256(reinterpret_cast<__m256i*>(q + i),
                           _mm256_max_epi32(_mm256_min_epi32(rounded, _mm256_set1_epi32(127)), _mm256_set1_epi32(-127)));
      }
      int8_t* out = rows.q + r * k + b * sb;
      int32_t total = 0;
      for (int i = 0; i < sb; ++i) {
        total += q[i];
        // nibble order: within each 8, inputs 0, 2, 4, 6 then 1, 3, 5, 7
        const int at = nibble_order ? (i & ~7) + (i & 1) * 4 + (i & 7) / 2 : i;
        out[at] = static_cast<int8_t>(q[i]);
      }
      const int64_t at = r * blocks + b;
      rows.d[at] = d;
      rows.s[at] = d * static_cast<float>(total);
      rows.sum[at] = total;
    }
}

SPECFREE_PLAIN(SPECFREE_AVX512, Avx512)
SPECFREE_PLAIN(SPECFREE_AVX2, Avx2)
SPECFREE_CODED(SPECFREE_AVX512, Avx512)
SPECFREE_CODED(SPECFREE_AVX2, Avx2)
SPECFREE_DECODE(SPECFREE_AVX512, Avx512)
SPECFREE_DECODE(SPECFREE_AVX2, Avx2)
SPECFREE_INT8(SPECFREE_AVX512_VNNI, Avx512Vnni)
SPECFREE_INT8(SPECFREE_AVX512, Avx512)
SPECFREE_INT8(SPECFREE_AVX2, Avx2)

// ---- choosing a compiled kernel ---------------------------------------------------------------
using PlainFn = void (*)(const float*, int64_t, const void*, int64_t, float*, int64_t);
using CodedFn = void (*)(const float*, int64_t, const uint8_t*, const ScaleStream&, const ScaleStream&, int64_t,
                         float*, int64_t);
using DecodeFn = void (*)(const uint8_t*, const ScaleStream&, const ScaleStream&, int64_t, float*);

// Only the widths a call can ask for are compiled: a group's own, a full group's (a call whose
// later groups follow a full one), and the narrower ones a range's last panels take (``narrower``).
template <int MB, bool PREFETCH, typename W>
PlainFn pick_plain_rows(Isa isa, int nb) {
  if (isa == Isa::kAvx512) {
    constexpr int own = kPlainAvx512[MB], full = kPlainAvx512[kGroupRows];
    return nb == own    ? plain_Avx512<MB, own, PREFETCH, W>
           : nb == full ? plain_Avx512<MB, full, PREFETCH, W>
           : nb == 4    ? plain_Avx512<MB, 4, PREFETCH, W>
           : nb == 2    ? plain_Avx512<MB, 2, PREFETCH, W>
                        : plain_Avx512<MB, 1, PREFETCH, W>;
  }
  constexpr int own = kPlainAvx2[MB], full = kPlainAvx2[kManyRowsAvx2];
  return nb == own    ? plain_Avx2<MB, own, PREFETCH, W>
         : nb == full ? plain_Avx2<MB, full, PREFETCH, W>
         : nb == 2    ? plain_Avx2<MB, 2, PREFETCH, W>
                      : plain_Avx2<MB, 1, PREFETCH, W>;
}

// Plain weights stream from memory in the first group of rows (prefetched), from cache after.
PlainFn pick_plain(Isa isa, Format format, int nb, int64_t mb, bool first) {
  return specfree::for_rows(mb, [&](auto rows) {
    constexpr int r = decltype(rows)::value;
    switch (format) {
      case kF16: return first ? pick_plain_rows<r, true, at::Half>(isa, nb) : pick_plain_rows<r, false, at::Half>(isa, nb);
      case kBF16:
        return first ? pick_plain_rows<r, true, at::BFloat16>(isa, nb) : pick_plain_rows<r, false, at::BFloat16>(isa, nb);
      default: return first ? pick_plain_rows<r, true, float>(isa, nb) : pick_plain_rows<r, false, float>(isa, nb);
    }
  });
}

template <int MB, int FORMAT, int SB>
CodedFn pick_coded_rows(Isa isa, int nb) {
  if (isa == Isa::kAvx512) {
    constexpr int own = kCodedAvx512[MB], full = kCodedAvx512[kGroupRows];
    return nb == own    ? coded_Avx512<MB, own, FORMAT, SB>
           : nb == full ? coded_Avx512<MB, full, FORMAT, SB>
                        : coded_Avx512<MB, 1, FORMAT, SB>;
  }
  constexpr int own = kCodedAvx2[MB], full = kCodedAvx2[kGroupRows];
  return nb == own ? coded_Avx2<MB, own, FORMAT, SB> : nb == full ? coded_Avx2<MB, full, FORMAT, SB> : coded_Avx2<MB, 1, FORMAT, SB>;
}

// ``sb``: inputs per scale (16 or 32; affine4 takes 32).
CodedFn pick_coded(Isa isa, Format format, int nb, int64_t mb, int sb) {
  return specfree::for_rows(mb, [&](auto rows) {
    constexpr int r = decltype(rows)::value;
    switch (format) {
      case kAffine4: return pick_coded_rows<r, kAffine4, 32>(isa, nb);
      case kAffine8: return sb == 16 ? pick_coded_rows<r, kAffine8, 16>(isa, nb) : pick_coded_rows<r, kAffine8, 32>(isa, nb);
      default: return sb == 16 ? pick_coded_rows<r, kScaled8, 16>(isa, nb) : pick_coded_rows<r, kScaled8, 32>(isa, nb);
    }
  });
}

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

using Int8Fn = void (*)(const Int8Rows&, int64_t, const uint8_t*, const ScaleStream&, const ScaleStream&, int64_t,
                        float*, int64_t, uint8_t*);

// Panels side by side under 8-bit activations: NB * SB/4 lanes of codes stay in registers while the
// rows run (AVX-512: 32 registers, two panels of 8 lanes; AVX2: 16, one).
constexpr int kInt8Avx512 = 2, kInt8Avx2 = 1;

template <int MB, int FORMAT, int SB, int STAGE>
Int8Fn pick_int8_block(Isa isa, bool vnni, int nb) {
  if (isa == Isa::kAvx512) {
    if (vnni)
      return nb == kInt8Avx512 ? int8_Avx512Vnni<MB, kInt8Avx512, FORMAT, SB, STAGE>
                               : int8_Avx512Vnni<MB, 1, FORMAT, SB, STAGE>;
    return nb == kInt8Avx512 ? int8_Avx512<MB, kInt8Avx512, FORMAT, SB, STAGE> : int8_Avx512<MB, 1, FORMAT, SB, STAGE>;
  }
  return int8_Avx2<MB, kInt8Avx2, FORMAT, SB, STAGE>;
}

template <int MB, int STAGE>
Int8Fn pick_int8_rows(Isa isa, bool vnni, Format format, int nb, int sb) {
  switch (format) {
    case kAffine4: return pick_int8_block<MB, kAffine4, 32, STAGE>(isa, vnni, nb);
    case kAffine8:
      return sb == 16 ? pick_int8_block<MB, kAffine8, 16, STAGE>(isa, vnni, nb)
                      : pick_int8_block<MB, kAffine8, 32, STAGE>(isa, vnni, nb);
    default:
      return sb == 16 ? pick_int8_block<MB, kScaled8, 16, STAGE>(isa, vnni, nb)
                      : pick_int8_block<MB, kScaled8, 32, STAGE>(isa, vnni, nb);
  }
}

// Only full groups write and read the staged buffer (a call's last, shorter group unpacks again):
// fewer kernels to compile.
Int8Fn pick_int8(Isa isa, bool vnni, Format format, int nb, int sb, int64_t mb, Stage stage) {
  if (stage == kWriteStaged) return pick_int8_rows<kInt8Group, kWriteStaged>(isa, vnni, format, nb, sb);
  if (stage == kReadStaged && mb == kInt8Group) return pick_int8_rows<kInt8Group, kReadStaged>(isa, vnni, format, nb, sb);
  return specfree::for_rows(mb, [&](auto rows) { return pick_int8_rows<decltype(rows)::value, kUnpack>(isa, vnni, format, nb, sb); });
}

// The next block width down for the panels left at the end of a range: plain 4 (AVX-512), 2, then
// 1 (blocks of 8 with single-panel tails would run a thread's 6 panels of a 192-column layer one
// at a time); coded straight to 1.
int narrower(Isa isa, Format format, int width) {
  if (coded(format)) return 1;
  return width > 4 && isa == Isa::kAvx512 ? 4 : width > 2 ? 2 : 1;
}

// ---- the driver -------------------------------------------------------------------------------
int lanes_of(Isa isa) { return isa == Isa::kAvx512 ? 16 : 8; }

// The activations' type: float32 as they come (every format), or 8-bit codes per block (``q8``,
// coded formats; ``vnni``: the AVX-512 path sums with vpdpbusd).
struct Activations {
  const float* x;
  const Int8Rows* q8;
  bool vnni;
};

// Panels [p_begin, p_end) for all m rows into y [m, n]. Blocks are as wide as the first group of
// rows allows; every group meets a block before the next block is read (later groups from cache).
template <typename B>
void panel_range(Isa isa, const Activations& a, int64_t m, const Panels& w, const B* bias, int64_t n,
                 int64_t p_begin, int64_t p_end, float* y) {
  const bool avx512 = isa == Isa::kAvx512, is_coded = coded(w.format), int8 = a.q8 != nullptr;
  const float* x = a.x;
  const int P = lanes_of(isa);
  const int64_t k = w.k;
  const int* widths = is_coded ? (avx512 ? kCodedAvx512 : kCodedAvx2) : (avx512 ? kPlainAvx512 : kPlainAvx2);
  const int64_t group = int8 ? kInt8Group : !is_coded && !avx512 && m > kGroupRows ? kManyRowsAvx2 : kGroupRows;
  const int64_t first = std::min(group, m);  // (GCC 12 miscompiles min() inside a[])
  const int nb = int8 ? (avx512 ? kInt8Avx512 : kInt8Avx2) : widths[first];
  const int64_t groups = (m + group - 1) / group;
  const bool decode_once = is_coded && !int8 && groups >= kDecodeOnceGroups;
  std::vector<float> decoded(decode_once ? nb * k * P : 0);
  const bool stage_codes = int8 && groups >= kDecodeOnceGroups;
  struct alignas(64) Line { uint8_t bytes[64]; };  // the staged vectors' alignment
  std::vector<Line> staged_lines(stage_codes ? nb * (k / w.block) * kStagedBytes / 64 : 0);
  uint8_t* staged = stage_codes ? staged_lines.data()->bytes : nullptr;
  float out[kGroupRows * 4 * 16];  // one group's results for one block, [rows, nb * P]
  const int64_t ldo = nb * P;
  for (int64_t p = p_begin; p < p_end;) {
    int width = nb;
    while (p + width > p_end) width = int8 ? 1 : narrower(isa, w.format, width);
    if (int8) {  // each group of rows against the block of codes
      for (int64_t r0 = 0; r0 < m; r0 += group) {
        const int64_t rows = std::min(group, m - r0);
        const Stage stage = !stage_codes ? kUnpack : r0 == 0 ? kWriteStaged : kReadStaged;
        pick_int8(isa, a.vnni, w.format, width, w.block, rows, stage)(*a.q8, r0, w.at(p), w.scales.at(p),
                                                                      w.offsets.at(p), k, out, ldo, staged);
        specfree::store_block(out, ldo, rows, width * P, bias, p * P, n, y + r0 * n);
      }
      p += width;
      continue;
    }
    if (decode_once)
      for (int j = 0; j < width; ++j)
        pick_decode(isa, w.format, w.block)(w.at(p + j), w.scales.at(p + j), w.offsets.at(p + j), k,
                                            decoded.data() + j * k * P);
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t mb = std::min(group, m - g * group);
      const float* rows = x + g * group * k;
      if (decode_once)
        pick_plain(isa, kF32, width, mb, false)(rows, k, decoded.data(), k, out, ldo);
      else if (is_coded)
        pick_coded(isa, w.format, width, mb, w.block)(rows, k, w.at(p), w.scales.at(p), w.offsets.at(p), k, out, ldo);
      else
        pick_plain(isa, w.format, width, mb, g == 0)(rows, k, w.at(p), k, out, ldo);
      specfree::store_block(out, ldo, mb, width * P, bias, p * P, n, y + g * group * n);
    }
    p += width;
  }
}

constexpr int64_t kPanelsPerTask = 4;  // a thread's share: a contiguous run of panels, one stream

// Every row count runs the driver, a long prompt's prefill included, so a prompt's rows keep the
// one-row kernel's bits on both paths. (Until 2026-11-26 AVX-512 handed more than 160 rows to the
// library's GEMM on unpacked tiles. Intel Xeon VM, family 6 model 167, two threads, SmolLM2's 211
// layers, medians of 15 interleaved passes, ms, groups / GEMM: 256 rows 235 / 306, 512 rows 441 /
// 502, 1024 and 2048 rows level. On Zen 3 AVX2's groups of 6 run level with MKL's GEMM at 256-4096.)
// ``int8``: coded weights against 8-bit activations (``vnni``: with vpdpbusd, AVX-512), each row
// quantized first (rows split among threads: a row's codes are its own either way).
template <typename B>
at::Tensor run_panels(Isa isa, const at::Tensor& x, const Panels& w, int64_t count, const B* bias, int64_t n,
                      bool int8 = false, bool vnni = false) {
  const int64_t m = x.numel() / std::max<int64_t>(w.k, 1);
  const at::Tensor x32 = specfree::float_rows(x);
  at::Tensor y = specfree::output_rows(x, n);
  Activations a{x32.data_ptr<float>(), nullptr, vnni};
  std::vector<int8_t> q;
  std::vector<float> scales;
  std::vector<int32_t> sums;
  Int8Rows rows{};
  if (int8 && m > 0) {
    const int64_t blocks = m * (w.k / w.block);
    q.resize(m * w.k);
    scales.resize(2 * blocks);
    sums.resize(blocks);
    rows = {q.data(), scales.data(), scales.data() + blocks, sums.data()};
    at::parallel_for(0, m, 16, [&](int64_t begin, int64_t end) {
      quantize_rows(a.x, begin, end, w.k, w.block, w.format == kAffine4, rows);
    });
    a.q8 = &rows;
  }
  if (m > 0)
    at::parallel_for(0, count, kPanelsPerTask, [&](int64_t begin, int64_t end) {
      panel_range(isa, a, m, w, bias, n, begin, end, y.data_ptr<float>());
    });
  return x.scalar_type() == at::kFloat ? y : y.to(x.scalar_type());
}

const char* isa_label(Isa isa) { return isa == Isa::kAvx512 ? "avx512" : "avx2"; }

// ---- the ops ----------------------------------------------------------------------------------
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
              isa_label(isa), " path (", lanes_of(isa), " columns); pack for it");
  TORCH_CHECK(x.size(-1) == k && n <= count * lanes && n > count * lanes - lanes, "specfree::panel_linear: shapes ",
              x.sizes(), " and panels ", panels.sizes(), " for ", n, " outputs do not multiply");
  const Format format = dtype == at::kFloat ? kF32 : dtype == at::kHalf ? kF16 : kBF16;
  const Panels w{static_cast<const uint8_t*>(panels.data_ptr()), k * lanes * panels.element_size(), k, format, 0,
                 kNoScales, kNoScales};
  // A bias in float32 stays float32 (16-bit weights computed in float32, the model's float32 bias);
  // else it is taken in the weights' dtype, as a 16-bit model holds it.
  const bool wide_bias = bias.has_value() && bias->defined() && bias->scalar_type() == at::kFloat;
  const at::Tensor b = specfree::bias_as(bias, wide_bias ? at::kFloat : dtype);
  if (!b.defined()) return run_panels<float>(isa, x, w, count, nullptr, n);
  if (b.scalar_type() == at::kFloat) return run_panels(isa, x, w, count, b.data_ptr<float>(), n);
  if (b.scalar_type() == at::kHalf) return run_panels(isa, x, w, count, b.data_ptr<at::Half>(), n);
  return run_panels(isa, x, w, count, b.data_ptr<at::BFloat16>(), n);
}

struct Checked {
  int64_t k, P;
  Format format;
  int block;
  int scale_kind, offset_kind;
};

// Checks shared by the coded ops. The format follows from the codes' dtype: int32 affine4 (eight a
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
  const int kind = stype == at::kFloat ? kScale32 : stype == at::kHalf ? kScale16 : stype == at::kByte ? kUnsigned8 : kSigned8;
  return {k, P, format, static_cast<int>(block), kind, sub ? static_cast<int>(kUnsigned8) : kind};
}

ScaleStream scale_stream(const at::Tensor& values, const std::optional<at::Tensor>& supers, int kind) {
  const bool sub = kind == kUnsigned8 || kind == kSigned8;
  return {static_cast<const uint8_t*>(values.data_ptr()),
          sub ? static_cast<const uint8_t*>(supers->data_ptr()) : nullptr, kind,
          values.size(1) * values.size(2) * values.element_size(), sub ? supers->size(1) * supers->size(2) * 2 : 0};
}

// ``precision``: "exact" (float32 activations: the float32 panels' bits) or "int8" (8-bit
// activations, ``SPECFREE_INT8``). ``isa`` may also be "avx512_novnni": the AVX-512 path summing
// without VNNI (the same bits; for tests on a CPU that has it).
at::Tensor coded_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                        const std::optional<at::Tensor>& offsets, const std::optional<at::Tensor>& bias,
                        int64_t n, c10::string_view isa_name, const std::optional<at::Tensor>& supers,
                        const std::optional<at::Tensor>& super_offsets, c10::string_view precision) {
  const Checked c = check_codes(codes, scales, offsets, supers, super_offsets, "specfree::coded_linear");
  const bool no_vnni = isa_name == "avx512_novnni";
  const Isa isa = specfree::parse_isa(no_vnni ? std::string("avx512") : std::string(isa_name), "specfree::coded_linear");
  TORCH_CHECK(precision == "exact" || precision == "int8",
              "specfree::coded_linear: precision must be exact or int8, not ", std::string(precision));
  const bool int8 = precision == "int8";
  const int64_t count = codes.size(0);
  TORCH_CHECK(c.P == lanes_of(isa), "specfree::coded_linear: codes in panels of ", c.P,
              " columns cannot run the ", isa_label(isa), " path; code for it");
  TORCH_CHECK(x.device().is_cpu() && x.size(-1) == c.k && n <= count * c.P && n > count * c.P - c.P,
              "specfree::coded_linear: shapes ", x.sizes(), " and codes for ", c.k, " inputs and ", n,
              " outputs do not multiply");
  const bool affine = c.format != kScaled8;
  const Panels w{static_cast<const uint8_t*>(codes.data_ptr()), codes.size(1) * c.P * codes.element_size(), c.k,
                 c.format, c.block, scale_stream(scales, supers, c.scale_kind),
                 affine ? scale_stream(*offsets, super_offsets, c.offset_kind) : kNoScales};
  const at::Tensor b = specfree::bias_as(bias, at::kFloat);
  return run_panels(isa, x, w, count, b.defined() ? b.data_ptr<float>() : nullptr, n, int8,
                    int8 && isa == Isa::kAvx512 && !no_vnni && specfree::has_avx512_vnni());
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

// Rows ``x`` [..., K] as precision=int8 quantizes them for blocks of ``block`` inputs: the codes
// [..., K] int8 in input order and the scales [..., K/block] float32 (what the tests check the rule on).
std::tuple<at::Tensor, at::Tensor> quantize_int8(const at::Tensor& x, int64_t block) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() >= 1 && (block == 16 || block == 32) && x.size(-1) % block == 0,
              "specfree::quantize_int8: rows [..., K] on the CPU, K a multiple of the block (16 or 32)");
  TORCH_CHECK(specfree::best_isa() != Isa::kNone, "specfree::quantize_int8 needs AVX2");
  const at::Tensor x32 = specfree::float_rows(x);
  const int64_t k = x.size(-1), m = k ? x.numel() / k : 0;
  at::Tensor q = at::empty(x.sizes(), x.options().dtype(at::kChar));
  auto sizes = x.sizes().vec();
  sizes.back() = k / block;
  at::Tensor d = at::empty(sizes, x.options().dtype(at::kFloat));
  std::vector<float> s(m * (k / block));
  std::vector<int32_t> sums(m * (k / block));
  const Int8Rows rows{q.data_ptr<int8_t>(), d.data_ptr<float>(), s.data(), sums.data()};
  if (m > 0) quantize_rows(x32.data_ptr<float>(), 0, m, k, static_cast<int>(block), false, rows);
  return {q, d};
}

}  // namespace

SPECFREE_C_ENTRY aoti_torch_cpu_coded_linear(AtenTensorHandle x, AtenTensorHandle codes, AtenTensorHandle scales,
                                            AtenTensorHandle* offsets, AtenTensorHandle* bias, int64_t n,
                                            const char* isa, AtenTensorHandle* supers,
                                            AtenTensorHandle* super_offsets, const char* precision,
                                            AtenTensorHandle* out) {
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
    specfree::hand_back(coded_linear(specfree::tensor_of(x), specfree::tensor_of(codes), specfree::tensor_of(scales),
                                     specfree::optional_of(offsets), specfree::optional_of(bias), n, isa,
                                     specfree::optional_of(supers), specfree::optional_of(super_offsets), precision),
                        out);
  });
}

TORCH_LIBRARY_FRAGMENT(specfree, m) {
  m.def("panel_linear(Tensor x, Tensor panels, Tensor? bias, int n, str isa='auto') -> Tensor");
  m.def("coded_linear(Tensor x, Tensor codes, Tensor scales, Tensor? offsets, Tensor? bias, int n, "
        "str isa='auto', Tensor? supers=None, Tensor? super_offsets=None, str precision='exact') -> Tensor");
  m.def("quantize_int8(Tensor x, int block) -> (Tensor, Tensor)");
  m.def("decode_panels(Tensor codes, Tensor scales, Tensor? offsets, Tensor? supers=None, "
        "Tensor? super_offsets=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(specfree, CPU, m) {
  m.impl("panel_linear", &panel_linear);
  m.impl("coded_linear", &coded_linear);
  m.impl("decode_panels", &decode_panels);
  m.impl("quantize_int8", &quantize_int8);
}
