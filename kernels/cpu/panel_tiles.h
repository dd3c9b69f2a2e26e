// What the panel GEMMs share (panel_gemm.cpp for float weights, qpanel_gemm.cpp for quantized
// ones): the panel width, the walk over a range of panels and token blocks, and the store of a
// finished tile.
//
// A panel holds 32 output rows; a tile is up to TT tokens x those 32 outputs, in 2 TT fp32
// accumulator vectors (lanes are outputs), or x half of them in TileVec's 8-lane vectors where the
// build has no AVX-512. store_tile adds the bias (fp32) and rounds each sum once to the output
// dtype; a last panel past N stores only the columns below N.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "vec16.h"

namespace llmc_panels {

using llmc_cpu::load16;
using llmc_cpu::store16;
using llmc_cpu::Vec16;

constexpr int64_t kPanel = 32;              // outputs per panel: two 16-lane vectors

// A float tile's accumulator vector: one AVX-512 register (16 lanes, a tile covers a whole panel),
// else 8 lanes, an AVX2 register (a tile covers half a panel: two tiles a panel). A Vec16 there
// is two registers, and a 12-token tile's 24 Vec16 accumulators spilled out of AVX2's 16.
#if defined(__AVX512F__)
using TileVec = Vec16;
#else
using TileVec = llmc_cpu::Vec8;
#endif
constexpr int64_t kTileCols = 2 * sizeof(TileVec) / sizeof(float);   // outputs of a tile: 32 or 16

template <typename V>
inline V load_vec(const float* p) {
  V v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// x in every lane of a V (llmc_cpu::splat for Vec16: one broadcast, no add).
template <typename V>
inline V splat_vec(float x) {
  if constexpr (sizeof(V) == sizeof(Vec16)) {
    return llmc_cpu::splat(x);
  } else {
    return llmc_cpu::splat8(x);
  }
}
constexpr int64_t kBlockBytes = 256 << 10;  // fp32/bf16 x of one token block (L2-resident)
constexpr int64_t kAhead = 4096;            // bytes of software prefetch ahead in the weight stream

// Tokens of a block whose x (K elements of `element_bytes` a token) fits kBlockBytes, whole tiles.
inline int64_t token_block(int64_t k_dim, int64_t element_bytes, int64_t tile) {
  return std::max<int64_t>(tile, kBlockBytes / (k_dim * element_bytes) / tile * tile);
}

// Panels in the next group of a GEMV that meets up to `most` panels at a time, with `left` panels
// still to go: groups of even size (9 panels, most 4: 3 + 3 + 3, not 4 + 4 + 1).
inline int64_t gemv_group(int64_t left, int64_t most) {
  const int64_t groups = (left + most - 1) / most;
  return (left + groups - 1) / groups;
}

// Runs fn(p, t0, tt) for panels begin .. end - 1 and every tile of tt <= `tile` tokens from t0, on
// the calling thread: tokens go in blocks (token_block), and every panel meets a whole block before
// the next, so a panel is read from memory once per block.
template <typename Fn>
void walk_tiles(int64_t begin, int64_t end, int64_t tokens, int64_t k_dim, int64_t element_bytes, int64_t tile,
                Fn fn) {
  const int64_t block = token_block(k_dim, element_bytes, tile);
  for (int64_t b0 = 0; b0 < tokens; b0 += block) {
    const int64_t b1 = std::min(tokens, b0 + block);
    for (int64_t p = begin; p < end; ++p)
      for (int64_t t0 = b0; t0 < b1; t0 += tile) fn(p, t0, std::min(tile, b1 - t0));
  }
}

// The tile's sums into out rows t0 .. t0 + TT - 1 (`ld` elements apart), columns n0 .. n0 + 31 (those
// below N), plus bias.
template <int TT, typename Out>
void store_tile(const Vec16 (&acc)[TT][2], const Out* bias, Out* out, int64_t t0, int64_t n0, int64_t n_dim,
                int64_t ld) {
  Vec16 b[2] = {Vec16{}, Vec16{}};
  const int64_t cols = std::min(kPanel, n_dim - n0);
  if (bias) {
    float tmp[kPanel] = {};
    for (int64_t c = 0; c < cols; ++c) tmp[c] = static_cast<float>(bias[n0 + c]);
    b[0] = load16(tmp), b[1] = load16(tmp + 16);
  }
  for (int t = 0; t < TT; ++t) {
    Out* row = out + (t0 + t) * ld + n0;
    if (cols == kPanel) {
      store16(row, acc[t][0] + b[0]);
      store16(row + 16, acc[t][1] + b[1]);
    } else {
      Out tmp[kPanel];
      store16(tmp, acc[t][0] + b[0]);
      store16(tmp + 16, acc[t][1] + b[1]);
      std::memcpy(row, tmp, cols * sizeof(Out));
    }
  }
}

// The same for a half-panel tile of 8-lane vectors (builds without AVX-512): columns n0 .. n0 + 15.
template <int TT, typename Out, typename V, typename = std::enable_if_t<sizeof(V) == 32>>
void store_tile(const V (&acc)[TT][2], const Out* bias, Out* out, int64_t t0, int64_t n0, int64_t n_dim,
                int64_t ld) {
  constexpr int64_t kCols = 16;
  const int64_t cols = std::min(kCols, n_dim - n0);
  float b[kCols] = {};
  for (int64_t c = 0; bias && c < cols; ++c) b[c] = static_cast<float>(bias[n0 + c]);
  for (int t = 0; t < TT; ++t) {
    float sums[kCols];
    std::memcpy(sums, acc[t], sizeof(sums));
    Out* row = out + (t0 + t) * ld + n0;
    for (int64_t c = 0; c < cols; ++c) row[c] = static_cast<Out>(sums[c] + b[c]);
  }
}

// The same for a whole panel's tile of four 8-lane vectors a token (AVX2's GEMV): as two Vec16s.
template <int TT, typename Out, typename V, typename = std::enable_if_t<sizeof(V) == 32>>
void store_tile(const V (&acc)[TT][4], const Out* bias, Out* out, int64_t t0, int64_t n0, int64_t n_dim,
                int64_t ld) {
  Vec16 wide[TT][2];
  std::memcpy(wide, acc, sizeof(wide));
  store_tile<TT>(wide, bias, out, t0, n0, n_dim, ld);
}

// store_tile into out [T, N].
template <int TT, typename Out>
void store_tile(const Vec16 (&acc)[TT][2], const Out* bias, Out* out, int64_t t0, int64_t n0, int64_t n_dim) {
  store_tile<TT>(acc, bias, out, t0, n0, n_dim, n_dim);
}

}  // namespace llmc_panels
