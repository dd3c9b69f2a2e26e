// The two ways paged_attention.cpp runs one work item: (sequence, KV head, queries of one chunk).
// The item's rows are its queries times the G query heads sharing the KV head (row r = query
// r / G, head r % G), so each key and value is read from the cache, widened to fp32 (int8 rows
// dequantized) once per item and used by all its rows; run_tiles reads an fp32 cache's rows in place
// (no copy: `bench_attention --dtype float32` gave a 512-token prompt 1.40-1.42 ms a layer, 1.69-1.75
// ms with the copies, on a 2-core Xeon).
//
//   run_rows   a decode: each row folds one cache block (16 keys, one vector of scores) at a
//              time into its online softmax; few rows, so no tiles to pack.
//   run_tiles  a prompt chunk: tiles of kKeys keys are met by all rows at once as two small
//              GEMMs (attention_tiles.h); tiles past the item's last query, and with a window
//              the blocks before its first query's window, are never read; the mask is applied
//              only on the tiles it touches; a tile reads only its keys' rows, never the
//              padding of its last block. run_tiles_bf16 is the same
//              with bf16 operands (vdpbf16ps) for bf16 q where the CPU has AVX512_BF16;
//              amx_attention.h and amx_attention_resident.h have the AMX tiles' runs, the
//              latter run_chunk, which chooses among them.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "attention_tiles.h"
#include "kv_rows.h"
#include "vec16.h"

namespace llmc_cpu {

constexpr int64_t kBlock = 16;  // tokens per cache block
static_assert(kBlock == 16, "tiles::Blocked (attention_tiles.h) reads a cache block as 16 rows");

struct Geometry {
  int64_t heads, kv_heads, head_dim, groups;
};

// A decode item (one query) may take several KV heads, kv_head .. kv_head + kv_heads - 1, and only
// its keys [key_begin, key_end) where its decode is split (split >= 0: part `part` of `parts`,
// decode_splits.h); split < 0: every key.
struct Item {
  int64_t seq, kv_head, first_query, num_queries, kv_heads = 1;
  int64_t key_begin = 0, key_end = 0, split = -1, part = 0, parts = 1;
};

class DecodeSplits;

// The op's inputs, `layer`'s K and V halves of the cache, as raw pointers.
template <typename T, typename C>
struct Inputs {
  const T* q;
  T* out;
  const C* k_cache;
  const C* v_cache;
  const int32_t* tables;  // [S, width]
  int64_t width;
  const int32_t* lens;
  const int32_t* qsl;
  Geometry g;
  float scale;
  int64_t window = 0;    // > 0: a query at position p sees keys p - window < j <= p only
  float softcap = 0.f;   // > 0: scaled scores become softcap * tanh(score / softcap)
  DecodeSplits* splits = nullptr;   // where split decode items leave their parts (decode_splits.h)

  int64_t first_pos(const Item& it) const { return lens[it.seq] - (qsl[it.seq + 1] - qsl[it.seq]) + it.first_query; }
  int64_t token(const Item& it, int64_t row) const { return qsl[it.seq] + it.first_query + row / g.groups; }
  int64_t head(const Item& it, int64_t row) const { return it.kv_head * g.groups + row % g.groups; }
  // The first key a query at `pos` sees (its window's start), and the first block holding it.
  int64_t first_key(int64_t pos) const { return window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0; }
  int64_t first_block(int64_t pos) const { return first_key(pos) / kBlock; }
  // Offset of the item's KV head's first row in block `b` of its sequence.
  int64_t block_offset(const Item& it, int64_t b) const {
    const int64_t block = tables[it.seq * width + b];
    return (block * g.kv_heads + it.kv_head) * kBlock * row_elems<C>(g.head_dim);
  }
};

// Per-thread working memory, reused from item to item.
struct Scratch {
  std::vector<float> q, qt, o, s, k, v, max, sum, alpha;
  std::vector<int32_t> pos;
  std::vector<uint32_t> qp, kp, vp, pp;  // bf16 pairs
  std::vector<uint32_t> tail;            // AMX: a partial block's K and V rows, zero-padded
};

// Zeroed outputs and fresh online-softmax state for `allocated` rows.
inline void reset_rows(int64_t allocated, int64_t d, Scratch& w) {
  w.o.assign(allocated * d, 0.f);
  w.max.assign(allocated, tiles::kNegInf);
  w.sum.assign(allocated, 0.f);
}

// The item's rows of q, widened to fp32 and multiplied by `scale` (1 or the op's), into w.q
// [rows][D]; zeroed outputs and fresh online-softmax state for `allocated` >= rows rows.
template <typename T, typename C>
void start_rows(const Inputs<T, C>& in, const Item& it, int64_t rows, int64_t allocated, float scale, Scratch& w) {
  const int64_t d = in.g.head_dim;
  w.q.resize(rows * d);
  for (int64_t r = 0; r < rows; ++r) {
    const T* src = in.q + (in.token(it, r) * in.g.heads + in.head(it, r)) * d;
    for (int64_t j = 0; j < d; j += 16) store16(w.q.data() + r * d + j, load16(src + j) * scale);
  }
  reset_rows(allocated, d, w);
}

template <typename T, typename C>
void finish_rows(const Inputs<T, C>& in, const Item& it, int64_t rows, const Scratch& w) {
  const int64_t d = in.g.head_dim;
  for (int64_t r = 0; r < rows; ++r) {
    T* dst = in.out + (in.token(it, r) * in.g.heads + in.head(it, r)) * d;
    const float inv = 1.f / w.sum[r];
    for (int64_t j = 0; j < d; j += 16) store16(dst + j, load16(w.o.data() + r * d + j) * inv);
  }
}

// Keys and values `first`..`first + count - 1` (within one block or a tile of blocks) as fp32
// rows into k and v [padded][D]; rows count..padded-1 zeroed.
template <typename T, typename C>
void load_keys(const Inputs<T, C>& in, const Item& it, int64_t first, int64_t count, int64_t padded, float* k,
               float* v) {
  const int64_t d = in.g.head_dim, row = row_elems<C>(d);
  for (int64_t n = 0; n < count; ++n) {
    const int64_t at = in.block_offset(it, (first + n) / kBlock) + ((first + n) % kBlock) * row;
    widen_row(in.k_cache + at, d, k + n * d);
    widen_row(in.v_cache + at, d, v + n * d);
  }
  std::fill(k + count * d, k + padded * d, 0.f);
  std::fill(v + count * d, v + padded * d, 0.f);
}

// Scores of one row against the `visible` first keys of a block ([16, D] rows of `k`).
inline Vec16 block_scores(const float* q, const float* k, int64_t visible, int64_t d) {
  Vec16 scores = splat(tiles::kNegInf);
  for (int64_t t = 0; t < visible; ++t) {
    Vec16 dot{};
    for (int64_t j = 0; j < d; j += 16) dot += load16(q + j) * load16(k + t * d + j);
    scores[t] = hsum(dot);
  }
  return scores;
}

// Folds one block into a row: rescale the accumulator to the new max, add p * v per key.
inline void fold_block(float* acc, float& max, float& sum, Vec16 scores, const float* v, int64_t visible,
                       int64_t d) {
  const float new_max = std::max(max, hmax(scores));
  const float rescale = std::exp(max - new_max);  // 0 on the first block
  const Vec16 p = exp16(scores - new_max);        // masked lanes: exp(-inf) = 0
  sum = sum * rescale + hsum(p);
  max = new_max;
  for (int64_t j = 0; j < d; j += 16) {
    Vec16 a = load16(acc + j) * rescale;
    for (int64_t t = 0; t < visible; ++t) a += p[t] * load16(v + t * d + j);
    store16(acc + j, a);
  }
}

// A row's scores of block b (keys b * 16 ..) with the softcap and, before key `lo`, the window
// applied; visible = the keys up to the row's position.
template <typename T, typename C>
Vec16 row_scores(const Inputs<T, C>& in, const float* q, const float* k, int64_t b, int64_t visible, int64_t lo) {
  Vec16 scores = block_scores(q, k, visible, in.g.head_dim);
  if (in.softcap > 0) scores = tiles::soft_cap(scores, in.softcap);
  if (lo <= b * kBlock) return scores;
  Int16 key;
  for (int t = 0; t < 16; ++t) key[t] = static_cast<int32_t>(b * kBlock + t);
  return key < static_cast<int32_t>(lo) ? splat(tiles::kNegInf) : scores;
}

template <typename T, typename C>
void run_rows(const Inputs<T, C>& in, const Item& it, Scratch& w) {
  const int64_t d = in.g.head_dim, rows = it.num_queries * in.g.groups, first_pos = in.first_pos(it);
  const int64_t last_pos = first_pos + it.num_queries - 1;
  start_rows(in, it, rows, rows, in.scale, w);
  w.k.resize(kBlock * d);
  w.v.resize(kBlock * d);
  for (int64_t b = in.first_block(first_pos); b * kBlock <= last_pos; ++b) {
    load_keys(in, it, b * kBlock, std::min(kBlock, last_pos + 1 - b * kBlock), kBlock, w.k.data(), w.v.data());
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t pos = first_pos + r / in.g.groups, visible = std::min(kBlock, pos + 1 - b * kBlock);
      if (visible <= 0 || (b + 1) * kBlock <= in.first_key(pos)) continue;
      const Vec16 scores = row_scores(in, w.q.data() + r * d, w.k.data(), b, visible, in.first_key(pos));
      fold_block(w.o.data() + r * d, w.max[r], w.sum[r], scores, w.v.data(), visible, d);
    }
  }
  finish_rows(in, it, rows, w);
}

// Each row's position in w.pos [R] (padding rows: the last query's) and scratch for one tile.
template <typename T, typename C>
void tile_positions(const Inputs<T, C>& in, const Item& it, int64_t rows, int64_t padded_rows, Scratch& w) {
  const int64_t d = in.g.head_dim, first_pos = in.first_pos(it);
  w.pos.assign(padded_rows, static_cast<int32_t>(first_pos + it.num_queries - 1));
  for (int64_t r = 0; r < rows; ++r) w.pos[r] = static_cast<int32_t>(first_pos + r / in.g.groups);
  w.k.resize(tiles::kKeys * d);
  w.v.resize(tiles::kKeys * d);
  w.s.resize(tiles::kKeys * padded_rows);
  w.alpha.resize(padded_rows);
}

// The tiles' shared set-up: queries (scaled by `scale`) in w.q, fresh rows, tile_positions.
template <typename T, typename C>
void start_tiles(const Inputs<T, C>& in, const Item& it, int64_t rows, int64_t padded_rows, float scale, Scratch& w) {
  start_rows(in, it, rows, padded_rows, scale, w);
  tile_positions(in, it, rows, padded_rows, w);
}

// Whether a tile of keys first .. first + padded - 1 needs the mask for rows at positions
// first_pos .. last_pos: a key past the first row (causal) or before the last row's window.
template <typename T, typename C>
bool masks(const Inputs<T, C>& in, int64_t first, int64_t padded, int64_t first_pos, int64_t last_pos) {
  return first + padded - 1 > first_pos || first < in.first_key(last_pos);
}

#ifdef __AVX512F__
// dst[j * dst_stride + i] = src[i * src_stride + j] for a 16 x 16 block of uint32.
inline void transpose16(const uint32_t* src, int64_t src_stride, uint32_t* dst, int64_t dst_stride) {
  __m512i r[16], t[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(src + i * src_stride);
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {   // per 128-bit lane L: columns 4L .. 4L + 3 of rows i .. i + 3
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int h = 0; h < 16; h += 8)
    for (int j = 0; j < 4; ++j) {
      t[h + j] = _mm512_shuffle_i32x4(r[h + j], r[h + j + 4], 0x88);
      t[h + j + 4] = _mm512_shuffle_i32x4(r[h + j], r[h + j + 4], 0xdd);
    }
  for (int j = 0; j < 8; ++j) {       // column j from t[j] (rows 0-7) and t[j + 8] (rows 8-15)
    _mm512_storeu_si512(dst + j * dst_stride, _mm512_shuffle_i32x4(t[j], t[j + 8], 0x88));
    _mm512_storeu_si512(dst + (j + 8) * dst_stride, _mm512_shuffle_i32x4(t[j], t[j + 8], 0xdd));
  }
}
#endif

// w.qt [D][R] = w.q's rows [R][D] transposed (rows past `rows` zero): by 16 x 16 blocks on AVX-512.
inline void transpose_queries(Scratch& w, int64_t rows, int64_t padded_rows, int64_t d) {
#ifdef __AVX512F__
  w.qt.resize(d * padded_rows);
  w.q.resize(padded_rows * d);
  std::fill(w.q.begin() + rows * d, w.q.end(), 0.f);
  for (int64_t r = 0; r < padded_rows; r += 16)
    for (int64_t j = 0; j < d; j += 16)
      transpose16(reinterpret_cast<const uint32_t*>(&w.q[r * d + j]), d,
                  reinterpret_cast<uint32_t*>(&w.qt[j * padded_rows + r]), padded_rows);
#else
  w.qt.assign(d * padded_rows, 0.f);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < d; ++j) w.qt[j * padded_rows + r] = w.q[r * d + j];
#endif
}

// One fp32 tile of run_tiles: keys first .. first + keys - 1 (rows k(n), v(n) for n < keys) met by the
// item's `padded_rows` rows. Only those key rows are read: the scores' rows from `keys` to the tile's
// padding keep whatever they held, which the mask replaces (their keys are past every row's position),
// and the product with V stops at `keys`.
template <typename T, typename C, typename KRows, typename VRows>
void tile_step(const Inputs<T, C>& in, const Item& it, Scratch& w, int64_t padded_rows, int64_t first, int64_t keys,
               const KRows& k, const VRows& v) {
  const int64_t d = in.g.head_dim, padded = (keys + 15) / 16 * 16;
  const int64_t first_pos = in.first_pos(it), last_pos = first_pos + it.num_queries - 1;
  const tiles::ScoreRule rule{1.f, in.softcap, in.window};  // q holds the scale
  tiles::scores<tiles::F32>(w.qt.data(), padded_rows, d, k, keys, w.s.data());
  tiles::softmax<false>(w.s.data(), padded_rows, padded, first, w.pos.data(), masks(in, first, padded, first_pos,
                        last_pos), rule, w.max.data(), w.sum.data(), w.alpha.data(), nullptr);
  tiles::rescale(w.alpha.data(), padded_rows, d, w.o.data());
  tiles::accumulate<tiles::F32>(w.s.data(), padded_rows, keys, v, d, w.o.data());
}

template <typename T, typename C>
void run_tiles(const Inputs<T, C>& in, const Item& it, Scratch& w) {
  const int64_t d = in.g.head_dim, rows = it.num_queries * in.g.groups, first_pos = in.first_pos(it);
  const int64_t last_pos = first_pos + it.num_queries - 1, padded_rows = (rows + 15) / 16 * 16;
  start_tiles(in, it, rows, padded_rows, in.scale, w);
  transpose_queries(w, rows, padded_rows, d);
  for (int64_t first = in.first_block(first_pos) * kBlock; first <= last_pos; first += tiles::kKeys) {
    const int64_t keys = std::min(tiles::kKeys, last_pos + 1 - first), padded = (keys + 15) / 16 * 16;
    if constexpr (std::is_same_v<C, float>) {
      const float* k_blocks[tiles::kKeys / kBlock];
      const float* v_blocks[tiles::kKeys / kBlock];
      for (int64_t b = 0; b < padded / kBlock; ++b) {
        const int64_t at = in.block_offset(it, first / kBlock + b);
        k_blocks[b] = in.k_cache + at, v_blocks[b] = in.v_cache + at;
      }
      const tiles::Blocked<float> k{k_blocks, d}, v{v_blocks, d};   // read in place
      tile_step(in, it, w, padded_rows, first, keys, k, v);
    } else {
      load_keys(in, it, first, keys, padded, w.k.data(), w.v.data());
      const tiles::Strided<float> k{w.k.data(), d}, v{w.v.data(), d};   // widened copies
      tile_step(in, it, w, padded_rows, first, keys, k, v);
    }
  }
  finish_rows(in, it, rows, w);
}

#ifdef __AVX512BF16__
// w.qp [D/2][R] = w.q's rows (bf16 values held in fp32) transposed, as bf16 pairs of dimensions;
// padding rows zero. A bf16 row is its own row of pairs: where D/2 is a multiple of 16 the rows
// are rounded (exactly) into w.pp [R][D/2] and transposed in 16 x 16 blocks.
inline void pack_query_pairs(Scratch& w, int64_t rows, int64_t padded_rows, int64_t d) {
  const int64_t half = d / 2;
  w.qp.assign(half * padded_rows, 0u);
  if (half % 16 == 0) {
    w.pp.assign(padded_rows * half, 0u);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t j = 0; j < d; j += 16)
        store16(reinterpret_cast<c10::BFloat16*>(&w.pp[r * half]) + j, load16(&w.q[r * d + j]));
    for (int64_t r = 0; r < padded_rows; r += 16)
      for (int64_t j = 0; j < half; j += 16)
        transpose16(&w.pp[r * half + j], half, &w.qp[j * padded_rows + r], padded_rows);
    return;
  }
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < half; ++j) {
      uint32_t lo, hi;
      std::memcpy(&lo, &w.q[r * d + 2 * j], 4);
      std::memcpy(&hi, &w.q[r * d + 2 * j + 1], 4);
      w.qp[j * padded_rows + r] = (lo >> 16) | (hi & 0xFFFF0000u);
    }
}

// run_tiles with bf16 operands and fp32 accumulation (vdpbf16ps): q as it is, K and V rounded
// to bf16 (exact for a bf16 cache; an int8 row's code * scale rounded, as the ref rounds it to
// q's dtype), the scale applied to the fp32 scores, probabilities rounded to bf16 (as the
// ref's are) for the product with V. Operands are pairs along each GEMM's depth.
template <typename C>
void run_tiles_bf16(const Inputs<c10::BFloat16, C>& in, const Item& it, Scratch& w) {
  const int64_t d = in.g.head_dim, rows = it.num_queries * in.g.groups, first_pos = in.first_pos(it);
  const int64_t last_pos = first_pos + it.num_queries - 1, padded_rows = (rows + 15) / 16 * 16;
  start_tiles(in, it, rows, padded_rows, 1.f, w);  // w.q holds q's bf16 values exactly
  pack_query_pairs(w, rows, padded_rows, d);
  w.kp.resize(tiles::kKeys * d / 2);
  w.vp.resize(tiles::kKeys * d / 2);
  w.pp.resize(tiles::kKeys / 2 * padded_rows);
  const tiles::ScoreRule rule{in.scale, in.softcap, in.window};
  for (int64_t first = in.first_block(first_pos) * kBlock; first <= last_pos; first += tiles::kKeys) {
    const int64_t keys = std::min(tiles::kKeys, last_pos + 1 - first), padded = (keys + 15) / 16 * 16;
    load_keys(in, it, first, keys, padded, w.k.data(), w.v.data());
    for (int64_t i = 0; i < padded * d; i += 16)  // a bf16 K row is its own row of pairs
      store16(reinterpret_cast<c10::BFloat16*>(w.kp.data()) + i, load16(w.k.data() + i));
    for (int64_t m = 0; m < padded / 2; ++m) tiles::pair_rows(&w.v[2 * m * d], &w.v[(2 * m + 1) * d], d, &w.vp[m * d]);
    tiles::scores<tiles::Bf16Pairs>(w.qp.data(), padded_rows, d / 2, tiles::Strided<uint32_t>{w.kp.data(), d / 2},
                                   padded, w.s.data());
    tiles::softmax<true>(w.s.data(), padded_rows, padded, first, w.pos.data(),
                         masks(in, first, padded, first_pos, last_pos), rule, w.max.data(), w.sum.data(),
                         w.alpha.data(), w.pp.data());
    tiles::rescale(w.alpha.data(), padded_rows, d, w.o.data());
    tiles::accumulate<tiles::Bf16Pairs>(w.pp.data(), padded_rows, padded / 2, tiles::Strided<uint32_t>{w.vp.data(), d},
                                       d, w.o.data());
  }
  finish_rows(in, it, rows, w);
}
#endif

}  // namespace llmc_cpu
