// specfree::tile_linear -- y = x W^T + b for bfloat16 weights and activations on AMX tiles.
//
// On a CPU with AMX (Intel Sapphire Rapids and later) one tdpbf16ps multiplies a 16 x 32 tile of
// activations by a 32 x 16 tile of weights: a bfloat16 model's 1-16 verify rows cost one read of
// the weights. The widened AVX-512 panels (panel_linear) pay each extra row's FMAs: on an Intel
// Xeon VM (family 6 model 167), SmolLM2's 211 layers in bfloat16, 2 threads, ms at 1 / 2 / 4 / 8 /
// 16 rows: panels 11.5 / 12.4 / 13.1 / 15.3 / 23.7, tiles 11.1 / 11.4 / 11.7 / 12.2 / 12.9, the
// read floor 9.5. (AVX-512 BF16's vdpbf16ps, tried first, runs at a quarter of the FMA's rate there.)
//
// W is packed once into tiles [N/16, Kp/32, 16, 32] (tiles.py): for 16 output columns and 32
// inputs, 16 rows of pairs (k, k+1) x 16 columns, the layout tdpbf16ps reads; Kp is K rounded up
// to 32, the padding zeros, and so are the columns past N. A thread takes a run of 16-column
// panels, six at a time (six accumulator tiles), and every group of 16 rows meets a block of
// six panels before the next block is read (later groups from cache).
//
// An output (m, n) is one element of one accumulator tile, built by tdpbf16ps over the 32-input
// blocks in order: it depends on row m of x and column n of W alone, never on the other rows of
// the call (a row alone and the same row among 15 others have the same bits; tests check it).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <torch/library.h>
#include <unistd.h>

#include <cpuid.h>

#include <algorithm>
#include <cstring>

#include "isa.h"

// Compilers without AMX intrinsics (GCC < 11, Clang < 12) build the op without its tiles.
#if defined(__has_include)
#if __has_include(<amxtileintrin.h>)
#define SPECFREE_HAS_AMX 1
#endif
#endif

namespace {

// Six panels a block: more weight streams in flight (SmolLM2's 211 layers in bf16, one row: 11.1
// against 11.5 ms with four).
constexpr int64_t kPanelsPerBlock = 6;
constexpr int64_t kPanelCols = 16, kBlockK = 32, kTileRows = 16;

#ifdef SPECFREE_HAS_AMX

#define SPECFREE_AMX __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw")))

// AMX needs the kernel's permission once per process (Linux 5.16+: arch_prctl ARCH_REQ_XCOMP_PERM
// for XFEATURE_XTILEDATA); a CPU without it, or a kernel that refuses, runs the panels instead.
bool amx_ready() {
  static const bool ready = [] {
    // CPUID leaf 7: EDX bit 24 AMX-TILE, bit 22 AMX-BF16 (read directly: not every compiler's
    // __builtin_cpu_supports knows the AMX names)
    unsigned eax, ebx, ecx, edx;
    if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx) || !(edx & (1u << 24)) || !(edx & (1u << 22))) return false;
#if defined(__linux__) && defined(SYS_arch_prctl)
    constexpr long kReqXcompPerm = 0x1023, kXtileData = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0;
#else
    return false;
#endif
  }();
  return ready;
}

struct TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0-5: accumulators (rows x 16 floats); 6: activations (rows x 32 bfloat16); 7: weights (one
// tile register for all six panels measured 1-3% faster than two alternating with four accumulators).
SPECFREE_AMX void configure(int rows) {
  TileConfig config;
  for (int t = 0; t < 7; ++t) config.bytes_per_row[t] = 64, config.rows[t] = rows;
  config.bytes_per_row[7] = 64, config.rows[7] = kTileRows;
  _tile_loadconfig(&config);
}

// Tile numbers are immediates: one block of NP panels (1-6) for one group of rows.
template <int NP>
SPECFREE_AMX void block(const at::BFloat16* x, int64_t ldx, const at::BFloat16* tiles, int64_t blocks,
                        float* out /* [16, NP * 16] */) {
  _tile_zero(0);
  if constexpr (NP > 1) _tile_zero(1);
  if constexpr (NP > 2) _tile_zero(2);
  if constexpr (NP > 3) _tile_zero(3);
  if constexpr (NP > 4) _tile_zero(4);
  if constexpr (NP > 5) _tile_zero(5);
  const int64_t panel = blocks * kTileRows * kBlockK;
  for (int64_t b = 0; b < blocks; ++b) {
    const at::BFloat16* w = tiles + b * kTileRows * kBlockK;
    _tile_loadd(6, x + b * kBlockK, ldx * 2);
    _tile_loadd(7, w, 64); _tile_dpbf16ps(0, 6, 7);
    if constexpr (NP > 1) { _tile_loadd(7, w + panel, 64); _tile_dpbf16ps(1, 6, 7); }
    if constexpr (NP > 2) { _tile_loadd(7, w + 2 * panel, 64); _tile_dpbf16ps(2, 6, 7); }
    if constexpr (NP > 3) { _tile_loadd(7, w + 3 * panel, 64); _tile_dpbf16ps(3, 6, 7); }
    if constexpr (NP > 4) { _tile_loadd(7, w + 4 * panel, 64); _tile_dpbf16ps(4, 6, 7); }
    if constexpr (NP > 5) { _tile_loadd(7, w + 5 * panel, 64); _tile_dpbf16ps(5, 6, 7); }
  }
  constexpr int64_t ldo = NP * kPanelCols * 4;
  _tile_stored(0, out, ldo);
  if constexpr (NP > 1) _tile_stored(1, out + kPanelCols, ldo);
  if constexpr (NP > 2) _tile_stored(2, out + 2 * kPanelCols, ldo);
  if constexpr (NP > 3) _tile_stored(3, out + 3 * kPanelCols, ldo);
  if constexpr (NP > 4) _tile_stored(4, out + 4 * kPanelCols, ldo);
  if constexpr (NP > 5) _tile_stored(5, out + 5 * kPanelCols, ldo);
}

// Panels [p_begin, p_end) for the rows of x ([groups * 16 or m rows, Kp], row stride ldx) into y [m, n].
SPECFREE_AMX void tile_range(const at::BFloat16* x, int64_t ldx, int64_t m, const at::BFloat16* tiles,
                             int64_t blocks, const at::BFloat16* bias, int64_t n, int64_t p_begin, int64_t p_end,
                             float* y) {
  const int rows = static_cast<int>(std::min(m, kTileRows));
  configure(rows);
  alignas(64) float out[kTileRows * kPanelsPerBlock * kPanelCols];
  const int64_t panel = blocks * kTileRows * kBlockK;
  for (int64_t p = p_begin; p < p_end; p += kPanelsPerBlock) {
    const int np = static_cast<int>(std::min(kPanelsPerBlock, p_end - p));
    for (int64_t g = 0; g * kTileRows < m; ++g) {
      const at::BFloat16* xg = x + g * kTileRows * ldx;
      const at::BFloat16* w = tiles + p * panel;
      switch (np) {
        case 6: block<6>(xg, ldx, w, blocks, out); break;
        case 5: block<5>(xg, ldx, w, blocks, out); break;
        case 4: block<4>(xg, ldx, w, blocks, out); break;
        case 3: block<3>(xg, ldx, w, blocks, out); break;
        case 2: block<2>(xg, ldx, w, blocks, out); break;
        default: block<1>(xg, ldx, w, blocks, out); break;
      }
      const int64_t cols = np * kPanelCols;
      specfree::store_block(out, cols, std::min(kTileRows, m - g * kTileRows), cols, bias, p * kPanelCols, n,
                            y + g * kTileRows * n);
    }
  }
  _tile_release();
}

#else
bool amx_ready() { return false; }
void tile_range(const at::BFloat16*, int64_t, int64_t, const at::BFloat16*, int64_t, const at::BFloat16*, int64_t,
                int64_t, int64_t, float*) {}
#endif

at::Tensor tile_linear(const at::Tensor& x, const at::Tensor& tiles, const std::optional<at::Tensor>& bias,
                       int64_t n) {
  TORCH_CHECK(amx_ready(), "specfree::tile_linear needs AMX (amx-tile, amx-bf16) and the OS's permission to use it");
  TORCH_CHECK(x.device().is_cpu() && tiles.device().is_cpu(), "specfree::tile_linear runs on the CPU");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && tiles.scalar_type() == at::kBFloat16,
              "specfree::tile_linear multiplies bfloat16 activations by bfloat16 weights, not ", x.scalar_type(),
              " by ", tiles.scalar_type());
  TORCH_CHECK(tiles.dim() == 4 && tiles.is_contiguous() && tiles.size(2) == kTileRows && tiles.size(3) == kBlockK,
              "specfree::tile_linear: tiles must be a contiguous [N/16, Kp/32, 16, 32] tensor "
              "(specfree.kernels.tiles.pack_tiles), not ", tiles.sizes());
  const int64_t k = x.size(-1), blocks = tiles.size(1), kp = blocks * kBlockK, count = tiles.size(0);
  TORCH_CHECK(k <= kp && k > kp - kBlockK && n <= count * kPanelCols && n > count * kPanelCols - kPanelCols,
              "specfree::tile_linear: shapes ", x.sizes(), " and tiles ", tiles.sizes(), " for ", n,
              " outputs do not multiply");
  const int64_t m = x.numel() / std::max<int64_t>(k, 1);
  // Rows padded to a whole tile of rows past 16, inputs to a whole block: zeros, which add nothing.
  const int64_t padded_rows = m > kTileRows ? (m + kTileRows - 1) / kTileRows * kTileRows : m;
  at::Tensor xs = x.reshape({m, k});
  if (kp != k || padded_rows != m) {
    at::Tensor wide = at::zeros({padded_rows, kp}, x.options());
    wide.narrow(0, 0, m).narrow(1, 0, k).copy_(xs);
    xs = wide;
  } else {
    xs = xs.contiguous();
  }
  const at::Tensor b = specfree::bias_as(bias, at::kBFloat16);
  at::Tensor y = specfree::output_rows(x, n);
  if (m > 0) {
    at::parallel_for(0, count, kPanelsPerBlock, [&](int64_t begin, int64_t end) {
      tile_range(xs.data_ptr<at::BFloat16>(), kp, m, tiles.data_ptr<at::BFloat16>(), blocks,
                 b.defined() ? b.data_ptr<at::BFloat16>() : nullptr, n, begin, end, y.data_ptr<float>());
    });
  }
  return y.to(at::kBFloat16);
}

at::Tensor amx_code() { return at::scalar_tensor(amx_ready(), at::kBool); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(specfree, m) {
  m.def("tile_linear(Tensor x, Tensor tiles, Tensor? bias, int n) -> Tensor");
  m.def("has_amx() -> Tensor");
}

TORCH_LIBRARY_IMPL(specfree, CPU, m) { m.impl("tile_linear", &tile_linear); }
TORCH_LIBRARY_IMPL(specfree, CompositeExplicitAutograd, m) { m.impl("has_amx", &amx_code); }
