// The int8-activation GEMM (qdot_gemm.h's contract: quantized x times int8 / int4 quads) on AMX-INT8
// tiles, and the choice between it and qdot_gemm.h's AVX512-VNNI kernel (qdot_range, which the op
// in qdot_gemm.cpp and the step plan both call). amx_qgemm.cpp has the op that always takes AMX.
//
// How: a panel's quads (4 consecutive inputs of each of 32 outputs, 128 bytes a row) are AMX B rows
// already; they are made signed int8 once per panel per token block for all its tokens (int8: the
// stored code + 128 less 128; int4: the two nibbles of an octet row become two quad rows of 0..15),
// so one tdpbssd of 16 tokens' codes of a block of 32 inputs (A: 16 rows x 32 bytes at x's row
// stride) by a block's 8 quad rows of 16 outputs (B: 8 rows x 64 bytes at a stride of 128) gives
// that block's exact int32 dots, with no + 128 offset to take back. Per block of 32 inputs (its own
// activation scale d per token) the four C tiles (32 tokens x 32 outputs) are stored and each dot,
// in fp32, times d is added to the group's partial sum; per group the partial sums times the
// group's scales (int4: plus the mins times the group's sum of d x codes): the VNNI kernel's fp32
// operations in its order on the same exact int32 dots, so the two paths give the same numbers.
// Fewer than 16 tokens are copied into a zero-padded tile; a last token tile is read shifted back
// to end at T (amx_gemm.h's rule).
//
// The path needs AMX-INT8 and the tile state (llmc_amx::int8_support(), asked once per process);
// LLMC_CPU_AMX=off (read at each GEMM) and a refusal keep the VNNI kernel, as below kMinTokens.
#pragma once

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "amx_gemm.h"
#include "qdot_gemm.h"

namespace llmc_amx_int8 {

using llmc_cpu::Int16;
using llmc_cpu::Vec16;
using llmc_panels::kPanel;
using llmc_qdot::kBlock;
using llmc_qdot::QActs;
using llmc_qdot::QuadPanels;

constexpr int64_t kRows = 16;                  // tokens of an A / C tile, outputs of a B / C tile
constexpr int64_t kQuadRow = kPanel * 4;       // bytes of one quad row of a panel (a B row is half of it)
constexpr int64_t kBlockRows = kBlock / 4;     // quad rows of a block of 32 inputs (B tile rows)
constexpr int64_t kXBlockBytes = 256 << 10;    // x codes of one token block
constexpr int64_t kChunk = 4;                  // blocks whose C tiles are stored before their fp32 part
// Fewer tokens stay on the VNNI kernel: each block's C tiles go through memory to their fp32
// scaling, which bounds AMX here; measured on one thread (Xeon with AMX, shared machine), AMX took
// int4 0.63-0.94x VNNI's time from 32 tokens (0.95-1.04x at 16, 1.4x at 8) and int8 0.83-1.19x.
constexpr int64_t kMinTokens = 32;

inline bool use_amx(int64_t tokens) {
  return tokens >= kMinTokens && llmc_amx::int8_support().usable && !llmc_amx::env_is("LLMC_CPU_AMX", "off");
}

// ("amx-int8", "") or the fallback's name ("avx512-vnni", "avx2" or "portable") and why it is taken.
inline std::pair<std::string, std::string> qgemm_path() {
  const std::string fallback = llmc_qdot::kDotIsa;
  if (!llmc_amx::int8_support().usable) return {fallback, llmc_amx::int8_support().why};
  if (llmc_amx::env_is("LLMC_CPU_AMX", "off")) return {fallback, "LLMC_CPU_AMX=off"};
  return {"amx-int8", ""};
}

#if defined(__x86_64__)
// Tiles 0-3: C (token tile m, output half h at 2m + h), 16 rows x 16 int32; 4, 5: A, 16 tokens x 32
// codes; 6, 7: B, 8 quad rows x 16 outputs x 4.
constexpr llmc_amx::TileConfig tile_config() {
  llmc_amx::TileConfig cfg{};
  cfg.palette = 1;
  for (int t = 0; t < 8; ++t) cfg.colsb[t] = 64, cfg.rows[t] = kRows;
  cfg.colsb[4] = cfg.colsb[5] = kBlock;
  cfg.rows[6] = cfg.rows[7] = kBlockRows;
  return cfg;
}

__attribute__((target("amx-tile"))) inline void configure_tiles() {
  static constexpr llmc_amx::TileConfig kConfig = tile_config();
  _tile_loadconfig(&kConfig);
}

// Panel `codes` as signed int8 quads [K/4, 32, 4] in `b`.
template <int Bits>
void signed_quads(const uint8_t* codes, int64_t k_dim, int8_t* b) {
  if constexpr (Bits == 8) {
    for (int64_t i = 0; i < k_dim * kPanel; ++i) b[i] = static_cast<int8_t>(codes[i] ^ 0x80);
  } else {
    for (int64_t i = 0; i < k_dim / 8; ++i)
      for (int64_t j = 0; j < kQuadRow; ++j) {
        b[2 * i * kQuadRow + j] = static_cast<int8_t>(codes[i * kQuadRow + j] & 15);
        b[(2 * i + 1) * kQuadRow + j] = static_cast<int8_t>(codes[i * kQuadRow + j] >> 4);
      }
  }
}

// c[2m + h] = the exact int32 dots of one block: A tile m (16 tokens' codes from a0, a1 at stride
// K) times output half h of the block's signed quads `b`.
template <int M>
__attribute__((target("amx-tile,amx-int8"))) inline void block_dots(const int8_t* a0, const int8_t* a1,
                                                                     int64_t k_dim, const int8_t* b,
                                                                     int32_t (*c)[kRows][kRows]) {
  _tile_zero(0);
  _tile_zero(1);
  if constexpr (M == 2) {
    _tile_zero(2);
    _tile_zero(3);
  }
  _tile_loadd(6, b, kQuadRow);
  _tile_loadd(7, b + kQuadRow / 2, kQuadRow);
  _tile_loadd(4, a0, k_dim);
  if constexpr (M == 2) _tile_loadd(5, a1, k_dim);
  _tile_dpbssd(0, 4, 6);
  _tile_dpbssd(1, 4, 7);
  if constexpr (M == 2) {
    _tile_dpbssd(2, 5, 6);
    _tile_dpbssd(3, 5, 7);
  }
  _tile_stored(0, c[0], kRows * sizeof(int32_t));
  _tile_stored(1, c[1], kRows * sizeof(int32_t));
  if constexpr (M == 2) {
    _tile_stored(2, c[2], kRows * sizeof(int32_t));
    _tile_stored(3, c[3], kRows * sizeof(int32_t));
  }
  llmc_amx::memory_fence();
}

// One tile's place: output rows t0 .. t0 + tt - 1 (tt <= 32), A tiles from rows s[0], s[1].
struct TokenTile {
  int64_t t0, tt, s[2];
  int64_t c_row(int64_t i) const { return t0 + i - s[i >= kRows]; }    // row of token t0 + i in its C tile
};

// Per token of a tile, the sums the VNNI kernel keeps in registers (qdot_tile), carried from one
// chunk of blocks to the next: the group's partial sums, int4's d x code sums, the output sums.
struct TileSums {
  Vec16 acc[2 * kRows][2], part[2 * kRows][2];
  float msum[2 * kRows];
};

// Blocks c0 .. c1 - 1 (at most kChunk) of a tile: their C tiles, and at a block that ends a group
// that group's scales (int4: mins) in fp32.
struct ChunkTiles {
  alignas(64) int32_t c[kChunk][4][kRows][kRows];
  Vec16 scale[kChunk][2], group_min[kChunk][2];
  bool group_ends[kChunk];
};

template <int M, int Bits>
void chunk_tiles(const QActs& x, const int8_t* b, const QuadPanels& w, int64_t p, const TokenTile& tile, int64_t c0,
                 int64_t c1, ChunkTiles& ct) {
  const int64_t per_group = w.group / kBlock;
  for (int64_t blk = c0; blk < c1; ++blk) {
    ct.group_ends[blk - c0] = (blk + 1) % per_group == 0;
    block_dots<M>(x.codes + tile.s[0] * x.k_dim + blk * kBlock, x.codes + tile.s[1] * x.k_dim + blk * kBlock,
                  x.k_dim, b + blk * kBlockRows * kQuadRow, ct.c[blk - c0]);
    const int64_t at = (p * w.groups + blk / per_group) * kPanel;
    for (int h = 0; ct.group_ends[blk - c0] && h < 2; ++h) {
      ct.scale[blk - c0][h] = llmc_qdot::load16_half(w.scales + at + 16 * h);
      if constexpr (Bits == 4) ct.group_min[blk - c0][h] = llmc_qdot::load16_half(w.mins + at + 16 * h);
    }
  }
}

// Blocks c0 .. c1 - 1 of `tile` into its sums: per token per block part += dot x d (int4: msum +=
// d x code sum), and at a group's last block acc += part x the group's scales (int4: + mins x
// msum), part and msum back to 0.
template <int M, int Bits>
void chunk_sums(const QActs& x, const int8_t* b, const QuadPanels& w, int64_t p, const TokenTile& tile, int64_t c0,
                int64_t c1, TileSums& sums) {
  const int64_t blocks = x.k_dim / kBlock;
  ChunkTiles ct;
  chunk_tiles<M, Bits>(x, b, w, p, tile, c0, c1, ct);
  for (int64_t i = 0; i < tile.tt; ++i) {
    const int64_t t = tile.t0 + i, m = i >= kRows, row = tile.c_row(i);
    Vec16 part[2] = {sums.part[i][0], sums.part[i][1]}, acc[2] = {sums.acc[i][0], sums.acc[i][1]};
    float msum = sums.msum[i];
    for (int64_t blk = c0; blk < c1; ++blk) {
      const float d = x.scales[t * blocks + blk];
      for (int h = 0; h < 2; ++h) {
        Int16 dots;
        std::memcpy(&dots, ct.c[blk - c0][2 * m + h][row], sizeof(dots));
        part[h] += __builtin_convertvector(dots, Vec16) * llmc_cpu::splat(d);
      }
      if constexpr (Bits == 4) msum += d * static_cast<float>(x.sums[t * blocks + blk]);
      if (!ct.group_ends[blk - c0]) continue;
      for (int h = 0; h < 2; ++h) acc[h] += part[h] * ct.scale[blk - c0][h], part[h] = Vec16{};
      if constexpr (Bits == 4)
        for (int h = 0; h < 2; ++h) acc[h] += ct.group_min[blk - c0][h] * llmc_cpu::splat(msum);
      msum = 0.f;
    }
    for (int h = 0; h < 2; ++h) sums.part[i][h] = part[h], sums.acc[i][h] = acc[h];
    sums.msum[i] = msum;
  }
}

// Output rows of `tile` for panel p (its signed quads in `b`): all blocks' sums, then stored.
template <int M, int Bits, typename Out>
void tile_rows(const QActs& x, const int8_t* b, const QuadPanels& w, int64_t p, const TokenTile& tile,
               const Out* bias, Out* out, int64_t n_dim) {
  TileSums sums;
  for (int64_t i = 0; i < tile.tt; ++i)
    sums.acc[i][0] = sums.acc[i][1] = sums.part[i][0] = sums.part[i][1] = Vec16{}, sums.msum[i] = 0.f;
  const int64_t blocks = x.k_dim / kBlock;
  for (int64_t c0 = 0; c0 < blocks; c0 += kChunk)
    chunk_sums<M, Bits>(x, b, w, p, tile, c0, std::min(blocks, c0 + kChunk), sums);
  for (int64_t i = 0; i < tile.tt; ++i) {
    const Vec16 row[1][2] = {{sums.acc[i][0], sums.acc[i][1]}};
    llmc_panels::store_tile<1>(row, bias, out, tile.t0 + i, p * kPanel, n_dim);
  }
}

// out [T, N] columns of panels begin .. end - 1 = quantized x times those panels (+ bias), on AMX,
// on the calling thread (which must be allowed the tile state: int8_support().usable). Tokens go in
// blocks whose codes fit kXBlockBytes; each panel's signed quads are made once per block.
template <int Bits, typename Out>
void gemm_range(QActs x, const QuadPanels& w, int64_t tokens, const Out* bias, Out* out, int64_t n_dim,
                int64_t begin, int64_t end) {
  if (begin >= end || tokens == 0) return;
  std::vector<int8_t> padded;                                 // fewer than 16 tokens: zero rows after
  if (tokens < kRows) {
    padded.assign(kRows * x.k_dim, 0);
    std::memcpy(padded.data(), x.codes, tokens * x.k_dim);
    x.codes = padded.data();
  }
  std::vector<int8_t> quads(w.k_dim * kPanel);
  const int64_t panel_bytes = w.k_dim * kPanel / (Bits == 8 ? 1 : 2), tile = 2 * kRows;
  const int64_t last = std::max(tokens, kRows) - kRows;       // the last row an A tile may start at
  const int64_t block = std::max(tile, kXBlockBytes / w.k_dim / tile * tile);
  configure_tiles();
  for (int64_t b0 = 0; b0 < tokens; b0 += block) {
    const int64_t b1 = std::min(tokens, b0 + block);
    for (int64_t p = begin; p < end; ++p) {
      signed_quads<Bits>(w.codes + p * panel_bytes, w.k_dim, quads.data());
      for (int64_t t0 = b0; t0 < b1; t0 += tile) {
        const TokenTile tt{t0, std::min(tile, b1 - t0), {std::min(t0, last), std::min(t0 + kRows, last)}};
        if (tt.tt > kRows)
          tile_rows<2, Bits>(x, quads.data(), w, p, tt, bias, out, n_dim);
        else
          tile_rows<1, Bits>(x, quads.data(), w, p, tt, bias, out, n_dim);
      }
    }
  }
  llmc_amx::release_tiles();
}
#endif

// A qdot GEMM's share (panels begin .. end - 1) on AMX where use_amx(tokens), else the VNNI kernel
// (`vnni`), or the portable integer dots.
template <int Bits, typename Out>
void qdot_range(const QActs& x, const QuadPanels& w, int64_t tokens, const Out* bias, Out* out, int64_t n_dim,
                int64_t begin, int64_t end, bool vnni) {
#if defined(__x86_64__)
  if (vnni && use_amx(tokens)) return gemm_range<Bits>(x, w, tokens, bias, out, n_dim, begin, end);
#endif
  llmc_qdot::qdot_gemm_range<Bits>(x, w, tokens, bias, out, n_dim, begin, end, vnni);
}

}  // namespace llmc_amx_int8
