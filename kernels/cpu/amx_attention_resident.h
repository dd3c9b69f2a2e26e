// Prompt attention on AMX-BF16 tiles for head_dim 32 and 64, with each row block's outputs held in
// tiles, and run_chunk: the choice of kernel for a chunk of more than one query (this, amx_attention.h's
// run_tiles_amx, attention_items.h's run_tiles_bf16 with vdpbf16ps, or its fp32 run_tiles).
//
// Contract: amx_attention.h's (run_tiles_amx's values, to the same roundings).
//
// How: run_tiles_amx meets each 64-key tile 32 rows at a time and loads O's C tiles from memory and
// stores them back around every tile's product with V: on a 2-core Xeon those loads and stores were a
// fifth of a 512-token prompt's attention (bench_attention with them dropped). Where O's row block fits
// in four tiles (16 rows x head_dim 64 or 32 in fp32), the block keeps them there instead:
//   - the item's keys go in spans of kSpan: each span's K blocks are found and its V pairs made once
//     (amx_attention.h's key_blocks and pair_values), for all its row blocks;
//   - each block of 16 rows loads its O tiles (0 .. d/16 - 1), meets the span's tiles as two AMX GEMMs
//     and the softmax between them, and stores the tiles after the span;
//       scores  S^T [keys][16] on the other four tiles: C in 4 and 5 (two key blocks), K in 6, Q^T's
//               pairs in 7 (the same packed queries as run_tiles_amx);
//       softmax attention_tiles.h's over the 16 rows, P^T transposed into A rows of 16 x 32 keys;
//       values  O += P x V's pairs: P in tile 4, V's pairs in 5-7, one product per O tile a step;
//     a block whose rows' softmax reference moved (alpha != 1, rare) stores its tiles, is rescaled and
//     loads them again; a tile whose keys are all masked for the block's 16 rows (after its last
//     position, or before its first one's window) is skipped, as the softmax would leave it no weight.
// Scores now chain through two C tiles rather than four, so the gain is the stores' less that (at
// 2048 keys the two about cancel); bench_attention measures it against sdpa in the same run.
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "amx_attention.h"

namespace llmc_cpu {

#if defined(__x86_64__) && defined(__AVX512BF16__)
namespace amx_attention {

constexpr int64_t kSpan = 512;   // keys whose K blocks and V pairs are set up before the row blocks meet them

// st [blocks * 16][16] = the blocks' keys . 16 rows' queries (qp: their [d/2][32-row block] pairs, the
// 16 rows at qp), on tiles 4 (even blocks) and 5 (odd) with K in 6 and Q^T in 7: tiles 0-3 hold O.
__attribute__((target("amx-tile,amx-bf16"))) inline void resident_scores(const Bf16* const* k, int64_t blocks,
                                                                         const uint32_t* qp, int64_t d, float* st) {
  constexpr int64_t kRowBytes = kBlock * sizeof(float);
  const int64_t k_stride = d * sizeof(Bf16), q_stride = kRowTile * sizeof(uint32_t);
  llmc_amx::memory_fence();
  for (int64_t b = 0; b < blocks; b += 2) {
    _tile_zero(4);
    _tile_zero(5);
    for (int64_t c = 0; c < d; c += kAmxDepth) {
      _tile_loadd(7, qp + c / 2 * kRowTile, q_stride);
      _tile_loadd(6, k[b] + c, k_stride);
      _tile_dpbf16ps(4, 6, 7);
      if (b + 1 < blocks) {
        _tile_loadd(6, k[b + 1] + c, k_stride);
        _tile_dpbf16ps(5, 6, 7);
      }
    }
    _tile_stored(4, st + b * kBlock * kBlock, kRowBytes);
    if (b + 1 < blocks) _tile_stored(5, st + (b + 1) * kBlock * kBlock, kRowBytes);
  }
  llmc_amx::memory_fence();
}

// O tiles 0 .. kDimTiles - 1 (16 rows x 16 dims each) += p [16 rows][kPairs pairs] x vp [steps * 16][d],
// 32 keys a step: P in tile 4, V's pairs in 5-7.
template <int kDimTiles>
__attribute__((target("amx-tile,amx-bf16"))) inline void resident_values(const uint32_t* p, int64_t steps,
                                                                         const uint32_t* vp, int64_t d) {
  const int64_t p_stride = kPairs * sizeof(uint32_t), v_stride = d * sizeof(uint32_t);
  llmc_amx::memory_fence();
  for (int64_t s = 0; s < steps; ++s) {
    const uint32_t* v = vp + s * 16 * d;
    _tile_loadd(4, p + s * 16, p_stride);
    _tile_loadd(5, v, v_stride);
    _tile_dpbf16ps(0, 4, 5);
    _tile_loadd(6, v + 16, v_stride);
    _tile_dpbf16ps(1, 4, 6);
    if constexpr (kDimTiles == 4) {
      _tile_loadd(7, v + 32, v_stride);
      _tile_dpbf16ps(2, 4, 7);
      _tile_loadd(5, v + 48, v_stride);
      _tile_dpbf16ps(3, 4, 5);
    }
  }
  llmc_amx::memory_fence();
}

// O tiles 0 .. kDimTiles - 1 to (store) or from (load) o [16][d].
template <int kDimTiles, bool kStore>
__attribute__((target("amx-tile"))) inline void move_outputs(float* o, int64_t d) {
  const int64_t stride = d * sizeof(float);
  llmc_amx::memory_fence();
  if constexpr (kStore) {
    _tile_stored(0, o, stride);
    _tile_stored(1, o + 16, stride);
    if constexpr (kDimTiles == 4) {
      _tile_stored(2, o + 32, stride);
      _tile_stored(3, o + 48, stride);
    }
  } else {
    _tile_loadd(0, o, stride);
    _tile_loadd(1, o + 16, stride);
    if constexpr (kDimTiles == 4) {
      _tile_loadd(2, o + 32, stride);
      _tile_loadd(3, o + 48, stride);
    }
  }
  llmc_amx::memory_fence();
}

// The span's key tiles (keys first .. first + keys - 1): block pointers into k and v (kKeys / 16 a
// tile), each tile's V pairs at w.vp + tile x kPairs x d, zero pairs to its last whole step.
inline void span_tiles(const Inputs<Bf16, Bf16>& in, const Item& it, int64_t first, int64_t keys, Scratch& w,
                       const Bf16** k, const Bf16** v) {
  const int64_t d = in.g.head_dim;
  for (int64_t t = 0; t * tiles::kKeys < keys; ++t) {
    const int64_t n = std::min(tiles::kKeys, keys - t * tiles::kKeys), pairs = (n + 15) / 16 * 8;
    const int64_t per = tiles::kKeys / kBlock, steps = (pairs + 15) / 16;
    key_blocks(in, it, first + t * tiles::kKeys, n, reinterpret_cast<Bf16*>(w.tail.data()), k + t * per, v + t * per);
    uint32_t* vp = w.vp.data() + t * kPairs * d;
    pair_values(v + t * per, pairs, d, vp);
    std::fill(vp + pairs * d, vp + steps * 16 * d, 0u);
  }
}

// One 16-row block (rows r ..) against the span's tiles its rows can see, its outputs in tiles.
template <int kDimTiles>
inline void resident_rows(const Inputs<Bf16, Bf16>& in, const Item& it, int64_t first, int64_t keys, int64_t r,
                          const Bf16* const* k, Scratch& w) {
  const int64_t d = in.g.head_dim, first_pos = in.first_pos(it), last_pos = first_pos + it.num_queries - 1;
  const int64_t block_last = w.pos[r + kBlock - 1], block_first = in.first_key(w.pos[r]);
  const tiles::ScoreRule rule{in.scale, in.softcap, in.window};
  const uint32_t* qp = w.qp.data() + r / kRowTile * kRowTile * d / 2 + r % kRowTile;
  for (int64_t t = 0; t * tiles::kKeys < keys; ++t) {
    const int64_t at = first + t * tiles::kKeys, n = std::min(tiles::kKeys, keys - t * tiles::kKeys);
    if (at > block_last || at + n <= block_first) continue;   // every key masked for these rows
    const int64_t padded = (n + 15) / 16 * 16, pairs = padded / 2, steps = (pairs + 15) / 16;
    resident_scores(k + t * (tiles::kKeys / kBlock), padded / kBlock, qp, d, w.s.data());
    tiles::softmax<true>(w.s.data(), kBlock, padded, at, w.pos.data() + r, masks(in, at, padded, first_pos, last_pos),
                         rule, w.max.data() + r, w.sum.data() + r, w.alpha.data() + r, w.pp.data());
    std::fill(w.pp.begin() + pairs * kBlock, w.pp.begin() + steps * 16 * kBlock, 0u);   // a half step: no keys
    for (int64_t s = 0; s < steps; ++s) transpose16(&w.pp[s * 16 * kBlock], kBlock, &w.kp[s * 16], kPairs);
    if (std::any_of(w.alpha.begin() + r, w.alpha.begin() + r + kBlock, [](float a) { return a != 1.f; })) {
      move_outputs<kDimTiles, true>(w.o.data() + r * d, d);
      tiles::rescale(w.alpha.data() + r, kBlock, d, w.o.data() + r * d);
      move_outputs<kDimTiles, false>(w.o.data() + r * d, d);
    }
    resident_values<kDimTiles>(w.kp.data(), steps, w.vp.data() + t * kPairs * d, d);
  }
}

}  // namespace amx_attention

// A prompt chunk on AMX tiles with head_dim 32 or 64 (the contract above): spans of kSpan keys set up
// once, then each 16-row block meets a span's tiles with its outputs held in tiles, not loaded from and
// stored to memory around every key tile's product with V.
template <int kDimTiles>
inline void run_resident_amx(const Inputs<c10::BFloat16, c10::BFloat16>& in, const Item& it, Scratch& w) {
  namespace A = amx_attention;
  const int64_t d = in.g.head_dim, rows = it.num_queries * in.g.groups, first_pos = in.first_pos(it);
  const int64_t last_pos = first_pos + it.num_queries - 1;
  A::start_item(in, it, rows, w);
  w.s.resize(tiles::kKeys * kBlock);
  w.pp.resize(A::kPairs * kBlock);
  w.kp.resize(kBlock * A::kPairs);
  w.vp.resize(A::kSpan / 2 * d);
  w.tail.resize(2 * kBlock * d / 2);
  const A::Bf16 *k[A::kSpan / kBlock], *v[A::kSpan / kBlock];
  llmc_amx::configure_tiles();
  for (int64_t first = in.first_block(first_pos) * kBlock; first <= last_pos; first += A::kSpan) {
    const int64_t keys = std::min(A::kSpan, last_pos + 1 - first);
    A::span_tiles(in, it, first, keys, w, k, v);
    for (int64_t r = 0; r < rows; r += kBlock) {
      A::move_outputs<kDimTiles, false>(w.o.data() + r * d, d);
      A::resident_rows<kDimTiles>(in, it, first, keys, r, k, w);
      A::move_outputs<kDimTiles, true>(w.o.data() + r * d, d);
    }
  }
  llmc_amx::release_tiles();
  finish_rows(in, it, rows, w);
}
#endif

// A chunk of more than one query: AMX tiles for bf16 q and cache where amx_attention_usable, bf16
// pairs (vdpbf16ps) for other bf16 q where the CPU has AVX512_BF16, else fp32 tiles.
template <typename T, typename C>
void run_chunk(const Inputs<T, C>& in, const Item& it, Scratch& w) {
#ifdef __AVX512BF16__
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
#if defined(__x86_64__)
    if constexpr (std::is_same_v<C, c10::BFloat16>)
      if (amx_attention_usable(in.g.head_dim)) {
        if (in.g.head_dim == 64) return run_resident_amx<4>(in, it, w);
        if (in.g.head_dim == 32) return run_resident_amx<2>(in, it, w);
        return run_tiles_amx(in, it, w);
      }
#endif
    return run_tiles_bf16(in, it, w);
  }
#endif
  run_tiles(in, it, w);
}

}  // namespace llmc_cpu
