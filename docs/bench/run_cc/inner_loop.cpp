// inner-loop microbench: MB rows x 1 panel (8 cols) x 32-input blocks of affine4 codes, L1-resident
#include <immintrin.h>
#include <chrono>
#include <cstdio>
#include <cstdint>
#include <cstring>
#include <vector>
#define UNROLL _Pragma("GCC unroll 16")
constexpr int K = 576, B = K / 32;
alignas(64) int32_t codes[B * 32];          // [B][4][8] words
alignas(64) float dsc[B * 8], osc[B * 8];
alignas(64) int8_t xq[8][K];
alignas(64) int8_t xrep[8][B][8][32];       // x replicated: [row][block][t] 32 bytes = 8 copies of the word
alignas(64) float xd[8][B], xs[8][B];
float out[8][8];

template <int MB, int MODE>
__attribute__((target("avx2,fma"), noinline)) void kern() {
  __m256 acc[MB];
  UNROLL for (int m = 0; m < MB; ++m) acc[m] = _mm256_setzero_ps();
  const __m256i mask = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
  for (int b = 0; b < B; ++b) {
    __m256i w[8];
    UNROLL for (int g = 0; g < 4; ++g) {
      __m256i v = _mm256_load_si256((const __m256i*)(codes + b * 32 + g * 8));
      w[2 * g] = _mm256_and_si256(v, mask);
      w[2 * g + 1] = _mm256_and_si256(_mm256_srli_epi32(v, 4), mask);
    }
    const __m256 d = _mm256_load_ps(dsc + b * 8), o = _mm256_load_ps(osc + b * 8);
    UNROLL for (int m = 0; m < MB; ++m) {
      __m256i sum;
      if constexpr (MODE == 0) {  // broadcast from memory
        const int8_t* x = xq[m] + b * 32;
        int32_t wd; memcpy(&wd, x, 4);
        sum = _mm256_maddubs_epi16(w[0], _mm256_set1_epi32(wd));
        UNROLL for (int t = 1; t < 8; ++t) { memcpy(&wd, x + 4 * t, 4); sum = _mm256_add_epi16(sum, _mm256_maddubs_epi16(w[t], _mm256_set1_epi32(wd))); }
      } else if constexpr (MODE == 1) {  // replicated full loads
        sum = _mm256_maddubs_epi16(w[0], _mm256_load_si256((const __m256i*)xrep[m][b][0]));
        UNROLL for (int t = 1; t < 8; ++t) sum = _mm256_add_epi16(sum, _mm256_maddubs_epi16(w[t], _mm256_load_si256((const __m256i*)xrep[m][b][t])));
      } else {  // one 16-byte load to both lanes + vpshufd x4, two loads
        __m256i xs0 = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)(xq[m] + b * 32)));
        __m256i xs1 = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)(xq[m] + b * 32 + 16)));
        sum = _mm256_maddubs_epi16(w[0], _mm256_shuffle_epi32(xs0, 0x00));
        sum = _mm256_add_epi16(sum, _mm256_maddubs_epi16(w[1], _mm256_shuffle_epi32(xs0, 0x55)));
        sum = _mm256_add_epi16(sum, _mm256_maddubs_epi16(w[2], _mm256_shuffle_epi32(xs0, 0xAA)));
        sum = _mm256_add_epi16(sum, _mm256_maddubs_epi16(w[3], _mm256_shuffle_epi32(xs0, 0xFF)));
        sum = _mm256_add_epi16(sum, _mm256_maddubs_epi16(w[4], _mm256_shuffle_epi32(xs1, 0x00)));
        sum = _mm256_add_epi16(sum, _mm256_maddubs_epi16(w[5], _mm256_shuffle_epi32(xs1, 0x55)));
        sum = _mm256_add_epi16(sum, _mm256_maddubs_epi16(w[6], _mm256_shuffle_epi32(xs1, 0xAA)));
        sum = _mm256_add_epi16(sum, _mm256_maddubs_epi16(w[7], _mm256_shuffle_epi32(xs1, 0xFF)));
      }
      const __m256i isum = _mm256_madd_epi16(sum, ones);
      acc[m] = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_broadcast_ss(&xd[m][b])), _mm256_cvtepi32_ps(isum), acc[m]);
      acc[m] = _mm256_fmadd_ps(o, _mm256_broadcast_ss(&xs[m][b]), acc[m]);
    }
  }
  UNROLL for (int m = 0; m < MB; ++m) _mm256_storeu_ps(out[m], acc[m]);
}

template <int MB, int MODE> void run(const char* name) {
  const int reps = 200000;
  double best = 1e9;
  for (int r = 0; r < 5; ++r) {
    auto t = std::chrono::steady_clock::now();
    for (int i = 0; i < reps; ++i) { kern<MB, MODE>(); asm volatile("" ::: "memory"); }
    double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
    best = std::min(best, s);
  }
  double macs = double(reps) * MB * 8 * K;
  printf("%s MB=%d: %.1f GMAC/s, %.1f ns/row-block\n", name, MB, macs / best / 1e9, best / reps / (MB * B) * 1e9);
}
int main() {
  for (int i = 0; i < B * 32; ++i) codes[i] = i * 2654435761u;
  for (int i = 0; i < B * 8; ++i) dsc[i] = 0.01f * (i % 7), osc[i] = -0.02f;
  for (int m = 0; m < 8; ++m) for (int i = 0; i < K; ++i) xq[m][i] = (i * 31 + m) % 200 - 100;
  run<1, 0>("bcast"); run<2, 0>("bcast"); run<4, 0>("bcast"); run<8, 0>("bcast");
  run<1, 1>("repl "); run<4, 1>("repl "); run<8, 1>("repl ");
  run<1, 2>("pshuf"); run<4, 2>("pshuf"); run<8, 2>("pshuf");
}
