// The bf16 panel GEMM on AMX tiles, and the choice between it and the AVX-512 panel kernel
// (panel_gemm.h). amx_gemm.cpp has the ops: amx_panel_gemm (always AMX) and cpu_gemm_path.
//
// Contract: panel_gemm's (panel_gemm.cpp; the meaning is kernels/panels.py's panel_linear_ref) for
// bf16: x [T, K] bf16 (K even), panels [P, K/2, 32, 2] bf16, bias [N] bf16 or none -> out [T, N]
// bf16, products accumulated in fp32, bias added in fp32, each sum rounded once.
//
// How: the bf16 panels already hold AMX B tiles: 16 rows of input pairs x 16 outputs x 2 (64 bytes)
// at a row stride of 128 bytes, so the weight has one resident copy, the same one the AVX-512
// kernel reads. Tokens go 32 at a time (two A tiles of 16 tokens x 32 inputs, read in place at
// x's row stride) against a panel's two B tiles into four fp32 C tiles (2x2), one tdpbf16ps per
// pair for each 32 inputs; a K tail below 32 inputs and fewer than 16 tokens in all are copied
// into zero-padded tiles; a last token tile of fewer than 16 tokens is read shifted back to end at
// T (its rows before the tile's first are computed again and not stored). C tiles go to a 16x16
// fp32 buffer, then bias, one rounding, and only rows of the tile and columns below N are stored,
// while the AMX unit multiplies the next tile (TileBlock).
//
// The AMX path needs the CPU (CPUID.(EAX=7,ECX=0):EDX AMX-TILE bit 24, AMX-BF16 bit 22; the int8
// GEMM of amx_qgemm.h AMX-INT8 bit 25: support() and int8_support()) and the
// Linux kernel's leave to use the tile state (arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA),
// asked once per process, which holds for all its threads); without them, or with the override
// LLMC_CPU_AMX=off, bf16 GEMMs run on the AVX-512 panel kernel. Each thread that runs AMX loads the
// tile configuration first and releases the tiles after its range. Test hook:
// LLMC_AMX_TEST_REFUSE=1 asks the kernel for a feature it does not have (so the request fails as
// a refusal would), to check the fallback on a machine that would grant it.
#pragma once

#if defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include <cerrno>
#include <cstdlib>
#include <string>
#include <utility>
#include <vector>

#include "panel_gemm.h"

namespace llmc_amx {

using Bf16 = c10::BFloat16;

constexpr long kArchGetXcompPerm = 0x1022;
constexpr long kArchReqXcompPerm = 0x1023;
constexpr long kXfeatureXtiledata = 18;
constexpr long kBogusXfeature = 63;             // the test hook's request: no kernel has it
constexpr int64_t kRows = 16;                   // tokens of an A tile, outputs of a B / C tile
constexpr int64_t kDepth = 32;                  // inputs of an A tile (16 pairs of a B tile)
// Fewer tokens stay on the AVX-512 kernel: batch-1 decode reads each weight once and is bound by
// memory; from 4 tokens AMX took 0.40-0.48x the AVX-512 kernel's time on L2-resident weights
// (K 576-1536, N 576-1728; Xeon with AMX, 2 threads), 0.12x at 16.
constexpr int64_t kMinTokens = 4;
constexpr int64_t kBlockBytes = 1 << 20;        // x of one token block (llmc_panels::kBlockBytes: 256 KiB)

struct Support {
  bool usable;
  std::string why;                              // why not, when not
};

inline bool env_is(const char* name, const char* value) {
  const char* v = std::getenv(name);
  return v != nullptr && std::string(v) == value;
}

// Whether the CPU has the feature at CPUID.(EAX=7,ECX=0):EDX bit `edx_bit` (AMX-TILE 24, AMX-BF16 22,
// AMX-INT8 25).
inline bool cpu_has(unsigned edx_bit) {
#if defined(__x86_64__)
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  return __get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx) && (edx & (1u << edx_bit));
#else
  return false;
#endif
}

// The kernel's leave for the tile state, asked here (once per process: see probe_feature).
inline Support probe_tile_state() {
#if !defined(__x86_64__)
  return {false, "this CPU has no AMX"};
#else
  const long feature = env_is("LLMC_AMX_TEST_REFUSE", "1") ? kBogusXfeature : kXfeatureXtiledata;
  if (syscall(SYS_arch_prctl, kArchReqXcompPerm, feature) != 0)
    return {false, "AMX tile state refused by the kernel (arch_prctl errno " + std::to_string(errno) + ")"};
  unsigned long granted = 0;
  if (syscall(SYS_arch_prctl, kArchGetXcompPerm, &granted) != 0 || !(granted & (1ul << kXfeatureXtiledata)))
    return {false, "the kernel did not grant the AMX tile state (arch_prctl ARCH_GET_XCOMP_PERM)"};
  return {true, ""};
#endif
}

// One AMX feature (`edx_bit`, named `name`): the CPU's bits, then the tile state.
inline Support probe_feature(unsigned edx_bit, const std::string& name) {
  if (!cpu_has(24) || !cpu_has(edx_bit)) return {false, "this CPU has no " + name};
  static const Support tiles = probe_tile_state();     // the kernel's leave holds for the whole process
  return tiles;
}

inline const Support& support() {
  static const Support s = probe_feature(22, "AMX-BF16");
  return s;
}

inline const Support& int8_support() {
  static const Support s = probe_feature(25, "AMX-INT8");
  return s;
}

// Whether a bf16 GEMM of `tokens` rows runs on AMX now (the override is read at each call).
inline bool use_amx(int64_t tokens) {
  return tokens >= kMinTokens && support().usable && !env_is("LLMC_CPU_AMX", "off");
}

// ("amx-bf16", "") or the fallback's name and why it is taken.
inline std::pair<std::string, std::string> gemm_path() {
#if defined(__AVX512F__)
  const std::string fallback = "avx512-bf16";
#else
  const std::string fallback = "vec16-bf16";
#endif
  if (!support().usable) return {fallback, support().why};
  if (env_is("LLMC_CPU_AMX", "off")) return {fallback, "LLMC_CPU_AMX=off"};
  return {"amx-bf16", ""};
}

#if defined(__x86_64__)
struct alignas(64) TileConfig {
  uint8_t palette;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Tiles 0-3: C (token tile i, output half j at 2i + j); 4, 5: A; 6, 7: B. All 16 rows x 64 bytes.
constexpr TileConfig tile_config() {
  TileConfig cfg{};
  cfg.palette = 1;
  for (int t = 0; t < 8; ++t) cfg.colsb[t] = 64, cfg.rows[t] = kRows;
  return cfg;
}

// GCC 12's tile intrinsics are asm statements that name only a pointer, not the memory behind it:
// without this fence the compiler may drop stores to a buffer a tile load reads, or read a buffer
// before the tile store that fills it.
inline void memory_fence() { __asm__ __volatile__("" ::: "memory"); }

// (From static memory: GCC 12 dropped a stack configuration's stores before ldtilecfg.)
__attribute__((target("amx-tile"))) inline void configure_tiles() {
  static constexpr TileConfig kConfig = tile_config();
  _tile_loadconfig(&kConfig);
}

__attribute__((target("amx-tile"))) inline void release_tiles() { _tile_release(); }

// C tiles += A tiles (rows a0, a1 at stride a_stride bytes) x the panel's B tiles (pair rows from b).
template <int M>
__attribute__((target("amx-tile,amx-bf16"))) inline void multiply(const Bf16* a0, const Bf16* a1, int64_t a_stride,
                                                                   const Bf16* b, int64_t b_stride) {
  _tile_loadd(6, b, b_stride);
  _tile_loadd(7, b + kRows * 2, b_stride);
  _tile_loadd(4, a0, a_stride);
  _tile_dpbf16ps(0, 4, 6);
  _tile_dpbf16ps(1, 4, 7);
  if constexpr (M == 2) {
    _tile_loadd(5, a1, a_stride);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
}

// The last k_dim % 32 inputs: A rows and B pair rows copied into zero-padded tiles.
template <int M>
__attribute__((target("amx-tile,amx-bf16"))) inline void multiply_tail(const Bf16* a0, const Bf16* a1, int64_t k_dim,
                                                                        const Bf16* b, int64_t rem) {
  alignas(64) Bf16 a_pad[2][kRows][kDepth] = {};
  alignas(64) Bf16 b_pad[kRows][kDepth * 2] = {};
  for (int64_t r = 0; r < kRows; ++r)
    for (int m = 0; m < M; ++m) std::memcpy(a_pad[m][r], (m ? a1 : a0) + r * k_dim, rem * sizeof(Bf16));
  for (int64_t j = 0; j < rem / 2; ++j) std::memcpy(b_pad[j], b + j * kDepth * 2, sizeof(b_pad[j]));
  memory_fence();
  multiply<M>(&a_pad[0][0][0], &a_pad[1][0][0], kDepth * sizeof(Bf16), &b_pad[0][0], sizeof(b_pad[0]));
}

// Cache lines of the next panel to fetch into L2 while this one is multiplied: `lines` a K step from
// `from` (none: nullptr). The hardware prefetchers do not run ahead of tile loads into the next panel,
// whose first tiles then waited on memory (a prompt's weights come from L3 or DRAM): with it, a
// 512-token bf16 prefill's GEMMs took 52.4 ms, not 58.3 (2-core Xeon, the mean of three A/B runs).
struct Prefetch {
  const char* from;
  int64_t lines;
};

// Times a panel's K loop hands the core's other work (`while_busy`) a part: at most this many, so each
// part's vector work stays small beside the multiplies issued before it.
constexpr int64_t kBusyParts = 6;

// c[2i + j] = A tile i (16 tokens from a0, a1) x the panel's output half j, over all K inputs;
// `while_busy(part, parts)` runs `parts` times (part 1 .. parts), spread over the K loop after the
// multiplies, each time to do the part-th of its work: the AMX unit multiplies while the core's
// vector units do it. Run once after the whole loop, work larger than the core's reorder window
// (a gated epilogue's 16 rows) stalled the issue of the next panel's tiles until it retired.
template <int M, typename Busy>
__attribute__((target("amx-tile,amx-bf16"))) inline void panel_tiles(const Bf16* a0, const Bf16* a1, int64_t k_dim,
                                                                      const Bf16* panel, float (*c)[kRows][kRows],
                                                                      Prefetch ahead, Busy&& while_busy) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  const int64_t full = k_dim / kDepth * kDepth, a_stride = k_dim * sizeof(Bf16);
  const int64_t b_stride = llmc_panels::kPanel * 2 * sizeof(Bf16);     // one pair row of the panel
  const int64_t steps = full / kDepth, parts = std::max<int64_t>(1, std::min(steps, kBusyParts));
  int64_t part = 0;
  for (int64_t step = 0; step < steps; ++step) {
    const int64_t k = step * kDepth;
    multiply<M>(a0 + k, a1 + k, a_stride, panel + k * llmc_panels::kPanel, b_stride);
    for (int64_t i = 0; ahead.from && i < ahead.lines; ++i)
      _mm_prefetch(ahead.from + (step * ahead.lines + i) * 64, _MM_HINT_T1);
    if ((step + 1) * parts / steps > part) while_busy(++part, parts);
  }
  if (full < k_dim) multiply_tail<M>(a0 + full, a1 + full, k_dim, panel + full * llmc_panels::kPanel, k_dim - full);
  if (part == 0) while_busy(1, 1);
  _tile_stored(0, c[0], kRows * sizeof(float));
  _tile_stored(1, c[1], kRows * sizeof(float));
  if constexpr (M == 2) {
    _tile_stored(2, c[2], kRows * sizeof(float));
    _tile_stored(3, c[3], kRows * sizeof(float));
  }
  memory_fence();
}

// Where a GEMM's outputs go: row t, column c (c < n_dim) at out + t * stride + c (bf16, or fp32 for
// the quantized GEMM of amx_dequant_gemm.h).
template <typename Out>
struct Dest {
  Out* out;
  int64_t stride, n_dim;
};

// Output rows from .. to - 1 of a C tile pair (c[0], c[1]: row t is row t - s there), columns n0 ..
// n0 + 31 below N, plus bias, rounded once.
template <typename Out>
void store_rows(const float (*c)[kRows][kRows], int64_t s, int64_t from, int64_t to, const Out* bias,
                const Dest<Out>& d, int64_t n0) {
  const int64_t cols = std::min(llmc_panels::kPanel, d.n_dim - n0);
  float b[llmc_panels::kPanel] = {};
  for (int64_t j = 0; bias && j < cols; ++j) b[j] = static_cast<float>(bias[n0 + j]);
  for (int64_t t = from; t < to; ++t) {
    Out row[llmc_panels::kPanel], *dst = d.out + t * d.stride + n0;
    Out* to_row = cols == llmc_panels::kPanel ? dst : row;   // a whole panel straight to out: a memcpy of
    for (int h = 0; h < 2; ++h)                                // variable length per row was a libc call,
      llmc_cpu::store16(to_row + kRows * h, llmc_cpu::load16(c[h][t - s]) + llmc_cpu::load16(b + kRows * h));
    if (to_row == row) std::memcpy(dst, row, cols * sizeof(Out));   // 8% of a bf16 prefill on one thread
  }
}

// A token tile's C tiles of one panel, stored from the tiles and waiting for their epilogue (bias,
// one rounding, the stores to `dest`): rows t0 .. t0 + tt - 1 (tt <= 32, none: tt 0), the A tiles
// having started at rows s0 and s1, the panel's first column n0.
template <typename Out>
struct TileBlock {
  alignas(64) float c[4][kRows][kRows];
  int64_t s0 = 0, s1 = 0, t0 = 0, tt = 0, n0 = 0, stored = 0;
  Dest<Out> dest{nullptr, 0, 0};

  // The part-th of `parts` of the rows (through row tt x part / parts); the last part ends the block.
  void store(const Out* bias, int64_t part = 1, int64_t parts = 1) {
    const int64_t upto = tt * part / parts, split = std::min(upto, kRows);
    if (stored < split) store_rows(c, s0, t0 + stored, t0 + split, bias, dest, n0);
    if (std::max(stored, kRows) < upto) store_rows(c + 2, s1, t0 + std::max(stored, kRows), t0 + upto, bias, dest, n0);
    stored = upto;
    if (part == parts) tt = 0, stored = 0;
  }
};

// Rows t0 .. t0 + tt - 1 (tt <= 32) of panel p into `done`'s C tiles (A tiles from rows s0 and s1, a
// last tile shifted back to end at row `last` + 16), while the AMX unit multiplies, the epilogue of
// `waiting`, the previous tile's: its stores to out (lines from L2 or memory) overlap the multiplies
// instead of waiting for them (K 576 x N 3072, one thread with weights hot: 1187 -> 1425 GFLOP/s).
// Then, still while it multiplies, `during(part, parts)`: other work of the caller's, in the same parts.
template <typename Out, typename During>
void panel_rows(const Bf16* x, const Bf16* panels, int64_t k_dim, const Out* bias, const Dest<Out>& dest, int64_t p,
                int64_t t0, int64_t tt, int64_t last, Prefetch ahead, TileBlock<Out>& done, TileBlock<Out>& waiting,
                During&& during) {
  const Bf16* panel = panels + p * k_dim * llmc_panels::kPanel;
  const int64_t s0 = std::min(t0, last), s1 = std::min(t0 + kRows, last);
  const auto store_waiting = [&](int64_t part, int64_t parts) {
    waiting.store(bias, part, parts);
    during(part, parts);
  };
  if (tt > kRows)
    panel_tiles<2>(x + s0 * k_dim, x + s1 * k_dim, k_dim, panel, done.c, ahead, store_waiting);
  else
    panel_tiles<1>(x + s0 * k_dim, nullptr, k_dim, panel, done.c, ahead, store_waiting);
  done.s0 = s0, done.s1 = s1, done.t0 = t0, done.tt = tt, done.n0 = p * llmc_panels::kPanel, done.dest = dest;
}

// The share of panel `next` (none: -1) that token tile `tile` of `tiles` prefetches: the panel's lines
// split evenly among the tiles, each tile's spread over its whole K steps (a K tail prefetches none).
inline Prefetch next_panel_share(const Bf16* panels, int64_t k_dim, int64_t next, int64_t tile, int64_t tiles) {
  const int64_t steps = k_dim / kDepth, lines = k_dim * llmc_panels::kPanel * int64_t{sizeof(Bf16)} / 64;
  if (next < 0 || steps == 0) return {nullptr, 0};
  const int64_t share = (lines + tiles - 1) / tiles, from = std::min(tile * share, lines);
  return {reinterpret_cast<const char*>(panels + next * k_dim * llmc_panels::kPanel) + from * 64,
          (std::min(share, lines - from) + steps - 1) / steps};
}

// x [T, K] times the panels of `order`, in that order, on AMX, on the calling thread (which must be
// allowed the tile state: support().usable), `group` panels at a time: a group's outputs go to
// dest_of(b0, g), and once they are all stored finished(b0, b1, g) runs (b0 .. b1 - 1 the block's
// tokens, g the group); during(part, parts) runs in parts over each token tile's multiplies. Tokens go
// in blocks whose x fits kBlockBytes, every panel meeting a whole block before the next
// (panel_tiles.h's walk_tiles, with blocks 4x the AVX-512 kernel's: AMX consumes a panel ~10x
// faster, so the weight is read fewer times; K 1536 x N 576 at 512 tokens on one thread: 543 ->
// 1067 GFLOP/s).
template <typename Out, typename DestOf, typename Finished, typename During>
void gemm_groups(const Bf16* x, const Bf16* panels, int64_t tokens, int64_t k_dim, const Out* bias,
                 const std::vector<int64_t>& order, int64_t group, DestOf&& dest_of, Finished&& finished,
                 During&& during) {
  std::vector<Bf16> padded;                                  // fewer than 16 tokens: zero rows after
  if (tokens < kRows) {
    padded.assign(kRows * k_dim, Bf16(0.0f));
    std::memcpy(padded.data(), x, tokens * k_dim * sizeof(Bf16));
    x = padded.data();
  }
  const int64_t last = std::max(tokens, kRows) - kRows;      // the last row an A tile may start at
  configure_tiles();
  const int64_t tile = 2 * kRows, block = std::max(tile, kBlockBytes / (k_dim * int64_t{sizeof(Bf16)}) / tile * tile);
  const int64_t count = static_cast<int64_t>(order.size());
  TileBlock<Out> blocks[2];                                  // one filled while the other is stored
  int64_t n = 0;
  for (int64_t b0 = 0; b0 < tokens; b0 += block) {
    const int64_t b1 = std::min(tokens, b0 + block), tiles = (b1 - b0 + tile - 1) / tile;
    for (int64_t i = 0; i < count; ++i) {
      const auto dest = dest_of(b0, i / group);
      for (int64_t t0 = b0; t0 < b1; t0 += tile, ++n)
        panel_rows(x, panels, k_dim, bias, dest, order[i], t0, std::min(tile, b1 - t0), last,
                   next_panel_share(panels, k_dim, i + 1 < count ? order[i + 1] : -1, (t0 - b0) / tile, tiles),
                   blocks[n % 2], blocks[(n + 1) % 2], during);
      if ((i + 1) % group == 0 || i + 1 == count) {
        blocks[(n + 1) % 2].store(bias);                   // the group's last tile
        finished(b0, b1, i / group);
      }
    }
  }
  release_tiles();
}

// out [T, N] columns of panels begin .. end - 1 = x [T, K] times those panels (+ bias), on AMX (as
// gemm_groups, the panels in order, one group).
inline void gemm_range(const Bf16* x, const Bf16* panels, int64_t tokens, int64_t k_dim, const Bf16* bias, Bf16* out,
                       int64_t n_dim, int64_t begin, int64_t end) {
  if (begin >= end || tokens == 0) return;
  std::vector<int64_t> order(end - begin);
  for (int64_t p = begin; p < end; ++p) order[p - begin] = p;
  const auto to_out = [&](int64_t, int64_t) { return Dest<Bf16>{out, n_dim, n_dim}; };
  gemm_groups(x, panels, tokens, k_dim, bias, order, end - begin, to_out, [](int64_t, int64_t, int64_t) {},
              [](int64_t, int64_t) {});
}

#endif

// Whether a float GEMM of `tokens` runs on AMX tiles (linear_range's choice): bf16 where use_amx.
template <typename X>
bool on_amx(int64_t tokens) {
  return std::is_same_v<X, Bf16> && use_amx(tokens);
}

// A float GEMM's share (panels begin .. end - 1) on the path use_amx chose for its token count.
template <typename X>
void linear_range(const X* x, const X* panels, int64_t tokens, int64_t k_dim, const X* bias, X* out, int64_t n_dim,
                  int64_t begin, int64_t end) {
#if defined(__x86_64__)
  if constexpr (std::is_same_v<X, Bf16>) {
    if (use_amx(tokens)) return gemm_range(x, panels, tokens, k_dim, bias, out, n_dim, begin, end);
  }
#endif
  llmc_panels::panel_gemm_range(x, panels, tokens, k_dim, bias, out, n_dim, begin, end);
}

}  // namespace llmc_amx
