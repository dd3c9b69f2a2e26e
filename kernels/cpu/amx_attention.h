// Prompt attention on AMX-BF16 tiles, 32 rows against each 64-key tile (amx_attention_resident.h
// holds head_dim 32 and 64's outputs in tiles instead, and run_chunk, the choice among the kernels).
//
// Contract: run_tiles_bf16's (paged_attention.cpp's, with the meaning of paged_attention_ref) for
// bf16 q and a bf16 cache, head_dim a multiple of 32: scores q.k of the bf16 values accumulated in
// fp32, scaled, soft-capped and masked in fp32, an online softmax in fp32, its probabilities
// (relative to the row's running reference, attention_tiles.h) rounded once to bf16 for the product
// with V, accumulated in fp32; the output rounded once to bf16. The rounding of the probabilities
// is the ref's (it rounds the normalised probabilities to q's dtype): each p is off by at most half
// a bf16 ulp (2^-9 relatively), so an output moves by at most 2^-9 max|v| from it, as the ref's does.
//
// How: an item's R rows (its queries x the query heads of its KV head, padded to a multiple of 32)
// meet a tile of up to 64 keys 32 rows at a time (so a row block's scores, probabilities and outputs
// stay in L1: the whole item's at once took a fifth longer), as two AMX GEMMs with the transposed
// scores of attention_tiles.h:
//   scores  S^T [keys][32] = K [keys][D] x Q^T: A tiles are 16 keys x 32 dims read in place from the
//           cache block (a block's partial tail copied into zeroed rows), B tiles Q^T as pairs of
//           dims [D/2][32] (packed once per item, row block by row block); C tiles of 16 keys x 16 rows.
//   softmax attention_tiles.h's (fp32, AVX-512) into bf16 pairs of keys P^T [keys/2][32].
//   values  O [32][D] += P [32][keys] x V [keys][D]: P^T transposed (16 x 16 uint32 blocks) into A
//           tiles of 16 rows x 32 keys; V as pairs of keys [keys/2][D] (two cache rows interleaved,
//           once per tile); O's C tiles loaded, accumulated and stored back, after the rows whose
//           softmax reference moved (alpha != 1: rare, see attention_tiles.h) were rescaled.
// Tiles past the item's last query are never read, as in run_tiles. The calling thread must be
// allowed the tile state (llmc_amx::support()); it loads the configuration per item and releases
// the tiles after it. Chosen per chunk where support() holds, LLMC_CPU_AMX is not "off" and head_dim
// is a multiple of 32 (amx_attention_usable; kernels/amx.py reports the choice).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "amx_gemm.h"
#include "attention_items.h"

namespace llmc_cpu {

constexpr int64_t kAmxDepth = 32;  // head_dim multiple for the AMX path (one A tile's 32 bf16)

inline bool amx_attention_usable(int64_t head_dim) {
  return head_dim % kAmxDepth == 0 && llmc_amx::support().usable && !llmc_amx::env_is("LLMC_CPU_AMX", "off");
}

#if defined(__x86_64__) && defined(__AVX512BF16__)
namespace amx_attention {

using Bf16 = c10::BFloat16;
constexpr int64_t kRowTile = 32;           // rows per pair of A (values) / B (scores) tiles
constexpr int64_t kPairs = tiles::kKeys / 2;  // P's row: the key tile's pairs

// vp [pairs][d] = rows 2m and 2m + 1 of V interleaved (key pairs), v[b] the tile's block b (16 rows).
inline void pair_values(const Bf16* const* v, int64_t pairs, int64_t d, uint32_t* vp) {
  alignas(64) static constexpr uint16_t kLo[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                                   8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  const __m512i lo_idx = _mm512_load_si512(kLo), hi_idx = _mm512_add_epi16(lo_idx, _mm512_set1_epi16(16));
  for (int64_t m = 0; m < pairs; ++m) {
    const Bf16* even = v[2 * m / kBlock] + (2 * m % kBlock) * d;
    for (int64_t c = 0; c < d; c += kAmxDepth) {
      const __m512i a = _mm512_loadu_si512(even + c), b = _mm512_loadu_si512(even + d + c);
      _mm512_storeu_si512(vp + m * d + c, _mm512_permutex2var_epi16(a, lo_idx, b));
      _mm512_storeu_si512(vp + m * d + c + 16, _mm512_permutex2var_epi16(a, hi_idx, b));
    }
  }
}

// The tile's key blocks: in place in the cache, a block holding keys past `keys` copied into
// `tail` [2][16][d] (K, V) with zero rows after them.
inline void key_blocks(const Inputs<Bf16, Bf16>& in, const Item& it, int64_t first, int64_t keys, Bf16* tail,
                       const Bf16** k, const Bf16** v) {
  const int64_t d = in.g.head_dim;
  for (int64_t b = 0; b * kBlock < keys; ++b) {
    const int64_t at = in.block_offset(it, first / kBlock + b), n = std::min(kBlock, keys - b * kBlock);
    k[b] = in.k_cache + at;
    v[b] = in.v_cache + at;
    if (n == kBlock) continue;
    std::memset(tail, 0, 2 * kBlock * d * sizeof(Bf16));
    std::memcpy(tail, k[b], n * d * sizeof(Bf16));
    std::memcpy(tail + kBlock * d, v[b], n * d * sizeof(Bf16));
    k[b] = tail;
    v[b] = tail + kBlock * d;
  }
}

// st [blocks * 16][rows] = the blocks' keys . the rows' queries (qp: [d/2][rows] pairs).
__attribute__((target("amx-tile,amx-bf16"))) inline void scores(const Bf16* const* k, int64_t blocks,
                                                                const uint32_t* qp, int64_t rows, int64_t d,
                                                                float* st) {
  const int64_t row_bytes = rows * sizeof(float);
  llmc_amx::memory_fence();                       // the tail rows and qp, stored before: see amx_gemm.h
  for (int64_t b = 0; b < blocks; b += 2)
    for (int64_t r = 0; r < rows; r += kRowTile) {
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int64_t c = 0; c < d; c += kAmxDepth) {
        const Bf16* q = reinterpret_cast<const Bf16*>(qp + c / 2 * rows + r);
        if (b + 1 < blocks)
          llmc_amx::multiply<2>(k[b] + c, k[b + 1] + c, d * sizeof(Bf16), q, row_bytes);
        else
          llmc_amx::multiply<1>(k[b] + c, nullptr, d * sizeof(Bf16), q, row_bytes);
      }
      float* out = st + b * kBlock * rows + r;
      _tile_stored(0, out, row_bytes);
      _tile_stored(1, out + 16, row_bytes);
      if (b + 1 < blocks) {
        _tile_stored(2, out + kBlock * rows, row_bytes);
        _tile_stored(3, out + kBlock * rows + 16, row_bytes);
      }
    }
  llmc_amx::memory_fence();
}

// o [rows][d] += p [rows][kPairs pairs] x vp [steps * 16][d], 32 keys a step: C tiles loaded from o
// and stored back.
__attribute__((target("amx-tile,amx-bf16"))) inline void values(const uint32_t* p, int64_t rows, int64_t steps,
                                                                const uint32_t* vp, int64_t d, float* o) {
  const int64_t row_bytes = d * sizeof(float);
  llmc_amx::memory_fence();                       // p, vp and o, stored before
  for (int64_t r = 0; r < rows; r += kRowTile)
    for (int64_t col = 0; col < d; col += kAmxDepth) {
      float* c = o + r * d + col;
      _tile_loadd(0, c, row_bytes);
      _tile_loadd(1, c + 16, row_bytes);
      _tile_loadd(2, c + 16 * d, row_bytes);
      _tile_loadd(3, c + 16 * d + 16, row_bytes);
      const Bf16* a = reinterpret_cast<const Bf16*>(p + r * kPairs);   // a row: kPairs pairs, 2 kPairs bf16
      const Bf16* b = reinterpret_cast<const Bf16*>(vp + col);
      for (int64_t s = 0; s < steps; ++s)
        llmc_amx::multiply<2>(a + 32 * s, a + 32 * (kPairs + s), kPairs * sizeof(uint32_t), b + 32 * s * d,
                              d * sizeof(uint32_t));
      _tile_stored(0, c, row_bytes);
      _tile_stored(1, c + 16, row_bytes);
      _tile_stored(2, c + 16 * d, row_bytes);
      _tile_stored(3, c + 16 * d + 16, row_bytes);
    }
  llmc_amx::memory_fence();
}

// w.qp [R/32][D/2][32] = each block of 32 of the item's bf16 query rows as pairs of dimensions (a
// bf16 row is its own row of pairs), copied into w.pp [R][D/2] with zero padding rows and transposed
// in 16 x 16 blocks.
inline void pack_queries(const Inputs<Bf16, Bf16>& in, const Item& it, int64_t rows, int64_t padded_rows,
                         Scratch& w) {
  const int64_t d = in.g.head_dim, half = d / 2;
  w.pp.resize(padded_rows * half);
  for (int64_t r = 0; r < rows; ++r)
    std::memcpy(&w.pp[r * half], in.q + (in.token(it, r) * in.g.heads + in.head(it, r)) * d, d * sizeof(Bf16));
  std::fill(w.pp.begin() + rows * half, w.pp.begin() + padded_rows * half, 0u);
  w.qp.resize(half * padded_rows);
  for (int64_t r = 0; r < padded_rows; r += 16)
    for (int64_t j = 0; j < half; j += 16)
      transpose16(&w.pp[r * half + j], half, &w.qp[r / kRowTile * kRowTile * half + j * kRowTile + r % kRowTile],
                  kRowTile);
}

// An item's `rows` set up in w for the AMX kernels: fresh outputs and softmax state, each row's
// position and the packed queries, over the rows padded to a multiple of kRowTile (returned).
inline int64_t start_item(const Inputs<Bf16, Bf16>& in, const Item& it, int64_t rows, Scratch& w) {
  const int64_t padded_rows = (rows + kRowTile - 1) / kRowTile * kRowTile;
  reset_rows(padded_rows, in.g.head_dim, w);
  tile_positions(in, it, rows, padded_rows, w);
  pack_queries(in, it, rows, padded_rows, w);
  return padded_rows;
}

// One key tile (keys first .. first + keys - 1) of an item whose rows are set up in w.
inline void key_tile(const Inputs<Bf16, Bf16>& in, const Item& it, int64_t first, int64_t keys, int64_t rows,
                     Scratch& w) {
  const int64_t d = in.g.head_dim, padded = (keys + 15) / 16 * 16, pairs = padded / 2, steps = (pairs + 15) / 16;
  const int64_t first_pos = in.first_pos(it), last_pos = first_pos + it.num_queries - 1;
  const Bf16 *k[tiles::kKeys / kBlock], *v[tiles::kKeys / kBlock];
  key_blocks(in, it, first, keys, reinterpret_cast<Bf16*>(w.tail.data()), k, v);
  pair_values(v, pairs, d, w.vp.data());
  std::fill(w.vp.begin() + pairs * d, w.vp.begin() + steps * 16 * d, 0u);
  const tiles::ScoreRule rule{in.scale, in.softcap, in.window};
  const bool masked = masks(in, first, padded, first_pos, last_pos);
  for (int64_t r = 0; r < rows; r += kRowTile) {
    scores(k, padded / kBlock, w.qp.data() + r * d / 2, kRowTile, d, w.s.data());
    tiles::softmax<true>(w.s.data(), kRowTile, padded, first, w.pos.data() + r, masked, rule, w.max.data() + r,
                         w.sum.data() + r, w.alpha.data() + r, w.pp.data());
    std::fill(w.pp.begin() + pairs * kRowTile, w.pp.begin() + steps * 16 * kRowTile, 0u);   // a half step: no keys
    for (int64_t h = 0; h < kRowTile; h += 16)
      for (int64_t s = 0; s < steps; ++s)
        transpose16(&w.pp[s * 16 * kRowTile + h], kRowTile, &w.kp[h * kPairs + s * 16], kPairs);
    tiles::rescale(w.alpha.data() + r, kRowTile, d, w.o.data() + r * d);
    values(w.kp.data(), kRowTile, steps, w.vp.data(), d, w.o.data() + r * d);
  }
}

}  // namespace amx_attention

// A prompt chunk on AMX tiles (the contract above); the thread must be allowed the tile state.
inline void run_tiles_amx(const Inputs<c10::BFloat16, c10::BFloat16>& in, const Item& it, Scratch& w) {
  const int64_t d = in.g.head_dim, rows = it.num_queries * in.g.groups, first_pos = in.first_pos(it);
  const int64_t last_pos = first_pos + it.num_queries - 1;
  const int64_t padded_rows = amx_attention::start_item(in, it, rows, w);
  w.pp.resize(tiles::kKeys / 2 * amx_attention::kRowTile);
  w.kp.resize(amx_attention::kRowTile * amx_attention::kPairs);
  w.vp.resize(tiles::kKeys / 2 * d);
  w.tail.resize(2 * kBlock * d / 2);                // two blocks of bf16 rows, as uint32 pairs
  llmc_amx::configure_tiles();
  for (int64_t first = in.first_block(first_pos) * kBlock; first <= last_pos; first += tiles::kKeys)
    amx_attention::key_tile(in, it, first, std::min(tiles::kKeys, last_pos + 1 - first), padded_rows, w);
  llmc_amx::release_tiles();
  finish_rows(in, it, rows, w);
}
#endif

}  // namespace llmc_cpu
