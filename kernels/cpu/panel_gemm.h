// The float panel GEMM's kernel (panel_gemm.cpp has the op and its contract): tiles of up to kTile
// tokens x kTileCols outputs (a panel of 32 with AVX-512, half of one with AVX2; one token: x up to
// kGemvPanels whole panels) in registers, and panel_gemm_range, which runs a range of panels on the
// calling thread (the op splits the panels among the intra-op threads, a step plan among its team).
#pragma once

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#include "panel_tiles.h"

namespace llmc_panels {

// Tokens per tile: 2 kTile accumulators + 2 weight vectors + a broadcast x in 32 AVX-512 registers,
// or in AVX2's 16. Panels a batch-1 GEMV runs at once: 8 accumulator chains with AVX-512; with AVX2
// 12, a panel's 32 outputs in four 8-lane vectors (kGemvVecs), its weights read as memory operands.
#if defined(__AVX512F__)
constexpr int kTile = 12;
constexpr int kGemvPanels = 4;
#else
constexpr int kTile = 6;
constexpr int kGemvPanels = 3;
#endif
constexpr int kGemvVecs = kPanel / (sizeof(TileVec) / sizeof(float));   // TileVecs across a GEMV's panel

// Bytes a GEMV's prefetch at input k of its PP panels [K, 32] adds to kAhead: once kAhead reaches
// past a panel's end, the stream goes on in the next group's panel (PP panels on), not in the
// panel after it, which a stream of this group reads.
template <int PP>
inline int64_t next_group_jump(int64_t k, int64_t k_dim, int64_t elem) {
  const int64_t panel_bytes = k_dim * kPanel * elem;
  return PP > 1 && k * kPanel * elem + kAhead >= panel_bytes ? (PP - 1) * panel_bytes : 0;
}

// The weight row's bytes a tile of NV vectors V reads at each input, prefetched `ahead` bytes early:
// one line, or two.
template <typename V, int NV>
inline void prefetch_row(const void* w, int64_t ahead) {
  __builtin_prefetch(static_cast<const char*>(w) + ahead);
  if constexpr (NV * sizeof(V) > 64) __builtin_prefetch(static_cast<const char*>(w) + ahead + 64);
}

// f32: TT tokens (rows of x from x0, stride K) times PP consecutive panels [K, 32] from `panel`, their
// columns c0 .. c0 + NV lanes(V) - 1 (out's columns n0 + c0 on; NV 2, or a whole panel). PP > 1 only
// at TT = 1 (a GEMV, whole panels): one panel's chains of FMAs would wait on the FMA latency.
template <typename V, int TT, int PP, int NV, typename Out>
void tile_f32(const float* x0, const float* panel, int64_t c0, int64_t k_dim, const Out* bias, Out* out, int64_t t0,
              int64_t n0, int64_t n_dim, int64_t ld) {
  constexpr int kLanes = sizeof(V) / sizeof(float);
  V acc[PP][TT][NV];
  for (int u = 0; u < PP; ++u)
    for (int t = 0; t < TT; ++t)
      for (int c = 0; c < NV; ++c) acc[u][t][c] = V{};
  for (int64_t k = 0; k < k_dim; ++k) {
    const int64_t ahead = kAhead + next_group_jump<PP>(k, k_dim, sizeof(float));
#pragma GCC unroll 4
    for (int u = 0; u < PP; ++u) {
      const float* w = panel + (u * k_dim + k) * kPanel + c0;
      prefetch_row<V, NV>(w, ahead);
      V wv[NV];
      for (int c = 0; c < NV; ++c) wv[c] = load_vec<V>(w + c * kLanes);
#pragma GCC unroll 12
      for (int t = 0; t < TT; ++t) {
        const V xv = splat_vec<V>(x0[t * k_dim + k]);
        for (int c = 0; c < NV; ++c) acc[u][t][c] += wv[c] * xv;
      }
    }
  }
  for (int u = 0; u < PP; ++u) store_tile<TT>(acc[u], bias, out, t0, n0 + c0 + u * kPanel, n_dim, ld);
}

// bf16: TT tokens times PP consecutive panels [K/2, 32, 2] of input pairs, columns as tile_f32's (PP
// > 1 at TT = 1 only, as for f32: a vdpbf16ps chain waits on its latency). With AVX512_BF16 a tile
// covers whole panels (V is Vec16, c0 0); without it the pairs are widened to fp32 FMAs.
template <typename V, int TT, int PP, int NV>
void tile_bf16(const c10::BFloat16* x0, const c10::BFloat16* panel, int64_t c0, int64_t k_dim,
               const c10::BFloat16* bias, c10::BFloat16* out, int64_t t0, int64_t n0, int64_t n_dim, int64_t ld) {
  constexpr int kLanes = sizeof(V) / sizeof(float);
  typedef uint32_t Bits __attribute__((vector_size(sizeof(V))));
  V acc[PP][TT][NV];
  for (int u = 0; u < PP; ++u)
    for (int t = 0; t < TT; ++t)
      for (int c = 0; c < NV; ++c) acc[u][t][c] = V{};
  for (int64_t k = 0; k < k_dim; k += 2) {
    const int64_t ahead = kAhead + next_group_jump<PP>(k, k_dim, sizeof(c10::BFloat16));
#pragma GCC unroll 4
    for (int u = 0; u < PP; ++u) {
      const c10::BFloat16* w = panel + (u * k_dim + k) * kPanel + 2 * c0;     // rows from c0 x (k, k + 1)
      prefetch_row<V, NV>(w, ahead);
#if defined(__AVX512BF16__)
      const __m512bh w0 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(w));
      const __m512bh w1 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(w + 32));
#pragma GCC unroll 12
      for (int t = 0; t < TT; ++t) {
        int32_t pair;
        std::memcpy(&pair, x0 + t * k_dim + k, sizeof(pair));
        const __m512bh xv = reinterpret_cast<__m512bh>(_mm512_set1_epi32(pair));
        Vec16* a = acc[u][t];
        a[0] = reinterpret_cast<Vec16>(_mm512_dpbf16_ps(reinterpret_cast<__m512>(a[0]), w0, xv));
        a[1] = reinterpret_cast<Vec16>(_mm512_dpbf16_ps(reinterpret_cast<__m512>(a[1]), w1, xv));
      }
#else
      V even[NV], odd[NV];                             // inputs k and k + 1 of each vector's rows
      for (int h = 0; h < NV; ++h) {
        Bits bits;
        std::memcpy(&bits, w + 2 * kLanes * h, sizeof(bits));
        const Bits lo = bits << 16, hi = bits & 0xFFFF0000u;
        std::memcpy(&even[h], &lo, sizeof(lo));
        std::memcpy(&odd[h], &hi, sizeof(hi));
      }
      for (int t = 0; t < TT; ++t) {
        uint32_t pair;
        std::memcpy(&pair, x0 + t * k_dim + k, sizeof(pair));
        const Bits pairs = Bits{} + pair, lo = pairs << 16, hi = pairs & 0xFFFF0000u;   // one broadcast
        V xe, xo;
        std::memcpy(&xe, &lo, sizeof(xe));
        std::memcpy(&xo, &hi, sizeof(xo));
        for (int h = 0; h < NV; ++h) acc[u][t][h] += even[h] * xe + odd[h] * xo;
      }
#endif
    }
  }
  for (int u = 0; u < PP; ++u) store_tile<TT>(acc[u], bias, out, t0, n0 + c0 + u * kPanel, n_dim, ld);
}

// A tile of TileVecs: NV 2 for a prompt's tiles (columns c0 on), kGemvVecs for a GEMV's whole panels
// (c0 0). Out: x's dtype, or bf16 for fp32 x and panels (f32_dequant_gemm.h's, for a bf16 step).
template <int TT, int PP, int NV, typename X, typename Out>
void tile(const X* x0, const X* panel, int64_t c0, int64_t k_dim, const Out* bias, Out* out, int64_t t0, int64_t n0,
          int64_t n_dim, int64_t ld) {
  if constexpr (std::is_same_v<X, float>) {
    tile_f32<TileVec, TT, PP, NV>(x0, panel, c0, k_dim, bias, out, t0, n0, n_dim, ld);
  } else {
    static_assert(std::is_same_v<X, Out>, "bf16 tiles write bf16");
#if defined(__AVX512BF16__)
    static_assert(NV == 2, "vdpbf16ps tiles cover whole panels");
#endif
    tile_bf16<TileVec, TT, PP, NV>(x0, panel, c0, k_dim, bias, out, t0, n0, n_dim, ld);
  }
}

// Tokens t0 .. t0 + tt - 1 (tt <= kTile) times panel p, into out's rows `ld` elements apart: a tile
// per kTileCols columns below N.
template <typename X, typename Out>
void run_tile(const X* x, const X* panels, int64_t k_dim, const Out* bias, Out* out, int64_t t0, int64_t tt, int64_t p,
              int64_t n_dim, int64_t ld) {
  const X* x0 = x + t0 * k_dim;
  const X* panel = panels + p * k_dim * kPanel;
  const int64_t n0 = p * kPanel;
  for (int64_t c0 = 0; c0 < kPanel && n0 + c0 < n_dim; c0 += kTileCols) {
    switch (tt) {
#define LLMC_TILE(n) \
  case n: tile<n, 1, 2>(x0, panel, c0, k_dim, bias, out, t0, n0, n_dim, ld); break;
      LLMC_TILE(12) LLMC_TILE(11) LLMC_TILE(10) LLMC_TILE(9) LLMC_TILE(8) LLMC_TILE(7)
      LLMC_TILE(6) LLMC_TILE(5) LLMC_TILE(4) LLMC_TILE(3) LLMC_TILE(2)
#undef LLMC_TILE
      default: tile<1, 1, 2>(x0, panel, c0, k_dim, bias, out, t0, n0, n_dim, ld);
    }
  }
}

// One token times panels begin .. end - 1, up to kGemvPanels at a time in groups of even size (9
// panels: 3 + 3 + 3, not 4 + 4 + 1, whose last would run on 2 chains): each output is still summed
// input by input (as in a tile of many tokens, so a token's result does not depend on its batch),
// but 2 kGemvPanels chains are in flight, and as many weight streams.
template <typename X>
void run_gemv(const X* x, const X* panels, int64_t k_dim, const X* bias, X* out, int64_t begin, int64_t end,
              int64_t n_dim) {
  for (int64_t p = begin; p < end;) {
    const X* panel = panels + p * k_dim * kPanel;
    const int64_t n0 = p * kPanel;
    switch (gemv_group(end - p, kGemvPanels)) {
      case 4: tile<1, 4, kGemvVecs>(x, panel, 0, k_dim, bias, out, 0, n0, n_dim, n_dim); p += 4; break;
      case 3: tile<1, 3, kGemvVecs>(x, panel, 0, k_dim, bias, out, 0, n0, n_dim, n_dim); p += 3; break;
      case 2: tile<1, 2, kGemvVecs>(x, panel, 0, k_dim, bias, out, 0, n0, n_dim, n_dim); p += 2; break;
      default: tile<1, 1, kGemvVecs>(x, panel, 0, k_dim, bias, out, 0, n0, n_dim, n_dim); p += 1;
    }
  }
}

// out [T, N] columns of panels begin .. end - 1 = x [T, K] times those panels (+ bias).
template <typename X>
void panel_gemm_range(const X* x, const X* panels, int64_t tokens, int64_t k_dim, const X* bias, X* out,
                      int64_t n_dim, int64_t begin, int64_t end) {
  if (tokens == 1) return run_gemv(x, panels, k_dim, bias, out, begin, end, n_dim);
  walk_tiles(begin, end, tokens, k_dim, sizeof(X), kTile, [&](int64_t p, int64_t t0, int64_t tt) {
    run_tile(x, panels, k_dim, bias, out, t0, tt, p, n_dim, n_dim);
  });
}

}  // namespace llmc_panels
