// A decode work item of paged_attention.cpp: one query of one sequence against its whole cached
// context, for all its KV heads (rows h * G + g: the G query heads sharing KV head h). Made to
// run at the speed the cache can be read, not at the speed of its arithmetic:
//
//   * K and V are read where they lie in the cache: f32 as is; bf16 K straight into vdpbf16ps
//     and bf16 V as pairs of keys (decode_pairs.h) where the CPU has AVX512_BF16 and
//     D % 32 == 0; int8 K codes (exact in bf16) into vdpbf16ps with bf16 q, the rows' scales
//     applied to the scores; otherwise a K block widened once into L1 scratch for the G rows
//     (int8: dequantized) and V rows widened in registers (an int8 row's scale folded into its
//     probability).
//   * A block's 16 scores are 16 partial vectors reduced together by one transposing tree
//     (transpose_sum: 15 shuffle-add steps; with AVX2 two trees of 8 keys, 7 steps each), not 16
//     horizontal sums.
//   * The online softmax steps over tiles of kTile keys (four blocks): one max, one rescale of
//     the accumulators per tile; the weighted sum of V keeps each row's output in registers
//     (strips of NV vectors of dimensions for R <= 8 rows, sized to the ISA's registers).
//   * A block's KV heads lie next to each other, so an item reads K and V in runs of
//     KVH x 16 rows.
//   * With a window (Inputs::window) the item starts at the block holding its window's first
//     key: earlier blocks are not read; the keys before it in that block are masked, and a
//     softcap is applied to the scores before the mask (shape_scores).
//   * The reads are kept apart from the arithmetic: touch_blocks loads every line of the next
//     kTouched keys' blocks in a loop of nothing but loads (many misses in flight), then the
//     tiles compute from L2. Loads spread through the arithmetic keep few misses in flight; on
//     the Zen 5 VM measured, that ran at 7-8 GB/s on one core, and software prefetches ahead
//     (one or two tiles, one to eight blocks, t0 or nta, or the next 128-256 keys) did not
//     help or were slower; touching first doubled it.
//
// Numerics: scores, softmax and the weighted sum in fp32 (bf16 products are exact in fp32; a
// bf16 cache's probabilities are rounded to bf16 for V, as the ref rounds them to q's dtype);
// only the order of the additions differs from the ref. Values of keys past the sequence's
// length are never used (touch_blocks loads whole blocks and drops what it loads; those rows
// may hold anything, NaN included).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "attention_tiles.h"
#include "decode_blocks.h"
#include "decode_pairs.h"
#include "decode_splits.h"
#include "kv_rows.h"
#include "vec16.h"

namespace llmc_cpu {

namespace decode {

constexpr int64_t kTile = 64;  // keys per online-softmax step: four cache blocks
constexpr int kMaxRows = 8;    // rows whose accumulators live in registers at once
constexpr int64_t kTouched = 2 * kTile;  // keys brought into L2 by one touch_blocks
static_assert(sizeof(TileRows<float>::block) / sizeof(float*) == kTile / kBlock, "TileRows holds one tile");

// The softmax step over one row's scores s [keys] (lanes past `keys` are -inf): probabilities
// back into s, the row's max and sum updated; returns the factor for its earlier output.
inline float softmax_tile(float* s, int64_t keys, float& max, float& sum) {
  Vec16 m = splat(max);
  for (int64_t n = 0; n < keys; n += 16) m = vmax(m, load16(s + n));
  const float new_max = hmax(m);
  const float alpha = std::exp(max - new_max);  // 0 on the first tile (max = -inf)
  Vec16 total{};
  for (int64_t n = 0; n < keys; n += 16) {
    const Vec16 p = exp_nonpositive(load16(s + n) - new_max);
    total += p;
    store16(s + n, p);
  }
  max = new_max;
  sum = sum * alpha + hsum(total);
  return alpha;
}

// o[r][c0 ..] = o[r][c0 ..] * alpha[r] + sum_n p[r][n] v[n][c0 ..] for R rows and NV vectors
// (Lanes) of dimensions from c0, the accumulators in registers; p rows kTile apart.
template <typename C, int R, int NV>
inline void accumulate_strip(const float* p, const float* alpha, const TileRows<C>& v, int64_t keys, int64_t c0,
                             float* o, int64_t d) {
  Lanes acc[R][NV];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < NV; ++c) acc[r][c] = values(o + r * d + c0 + kLanes * c) * alpha[r];
  for (int64_t n = 0; n < keys; ++n) {
    Lanes x[NV];
    for (int c = 0; c < NV; ++c) x[c] = tiles::in_register(values(v(n) + c0 + kLanes * c));
    for (int r = 0; r < R; ++r) {
      const Lanes pr = splat_lanes(p[r * kTile + n]);
      for (int c = 0; c < NV; ++c) acc[r][c] += pr * x[c];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < NV; ++c) store_lanes(o + r * d + c0 + kLanes * c, acc[r][c]);
}

// Vectors of a strip of R rows: its R x NV accumulators, NV values and a broadcast in the registers
// (32 with AVX-512; AVX2's 16, less one to spare), 4 at most (the rest of d is 3 or fewer).
template <int R>
constexpr int strip_vectors() {
  return kLanes == 16 ? (R <= 6 ? 4 : 3) : std::clamp(14 / (R + 1), 1, 4);
}

// accumulate_strip over all d dimensions of R rows, strips of strip_vectors<R>() vectors.
template <typename C, int R>
inline void accumulate_rows(const float* p, const float* alpha, const TileRows<C>& v, int64_t keys, float* o,
                            int64_t d) {
  constexpr int kWide = strip_vectors<R>();
  int64_t c0 = 0;
  for (; c0 + kLanes * kWide <= d; c0 += kLanes * kWide) accumulate_strip<C, R, kWide>(p, alpha, v, keys, c0, o, d);
  switch ((d - c0) / kLanes) {
    case 3: return accumulate_strip<C, R, 3>(p, alpha, v, keys, c0, o, d);
    case 2: return accumulate_strip<C, R, 2>(p, alpha, v, keys, c0, o, d);
    case 1: return accumulate_strip<C, R, 1>(p, alpha, v, keys, c0, o, d);
    default: return;
  }
}

// Calls fn(std::integral_constant<int, R>{}) with R = rows, 1 .. kMaxRows.
template <typename Fn>
void with_rows(int64_t rows, Fn fn) {
  switch (rows) {
    case 1: return fn(std::integral_constant<int, 1>{});
    case 2: return fn(std::integral_constant<int, 2>{});
    case 3: return fn(std::integral_constant<int, 3>{});
    case 4: return fn(std::integral_constant<int, 4>{});
    case 5: return fn(std::integral_constant<int, 5>{});
    case 6: return fn(std::integral_constant<int, 6>{});
    case 7: return fn(std::integral_constant<int, 7>{});
    default: return fn(std::integral_constant<int, 8>{});
  }
}

// All `rows` rows, kMaxRows at a time.
template <typename C>
void accumulate(const float* p, const float* alpha, int64_t rows, const TileRows<C>& v, int64_t keys, float* o,
                int64_t d) {
  for (int64_t r = 0; r < rows; r += kMaxRows)
    with_rows(std::min<int64_t>(kMaxRows, rows - r), [&](auto n) {
      accumulate_rows<C, decltype(n)::value>(p + r * kTile, alpha + r, v, keys, o + r * d, d);
    });
}

// One tile's weighted sum of V for the G rows of one KV head (p, alpha, o at its rows): bf16
// pairs (decode_pairs.h) where `pairs`, else fp32 (an int8 row's scale folded into p).
template <typename C>
void weigh_values(float* p, const float* alpha, int64_t groups, const TileRows<C>& v, int64_t keys, float* o,
                  int64_t d, bool pairs, Scratch& w) {
#ifdef __AVX512BF16__
  if constexpr (std::is_same_v<C, c10::BFloat16>)
    if (pairs) {
      constexpr int64_t kPairsRow = kTile / 2;
      w.pp.resize(groups * kPairsRow);
      pair_probabilities(p, kTile, groups, keys, w.pp.data(), kPairsRow);
      for (int64_t r = 0; r < groups; r += kMaxRows)
        with_rows(std::min<int64_t>(kMaxRows, groups - r), [&](auto n) {
          accumulate_pairs_rows<decltype(n)::value>(w.pp.data() + r * kPairsRow, kPairsRow, alpha + r, v, keys,
                                                    o + r * d, d);
        });
      return;
    }
#endif
  if constexpr (std::is_same_v<C, int8_t>) fold_value_scales(v, keys, d, groups, p, kTile);
  accumulate<C>(p, alpha, groups, v, keys, o, d);
}

// Row r of o divided by its softmax sum, in q's dtype.
template <typename T>
void finish_row(const float* o, int64_t d, float sum, bool pairs, T* out) {
#ifdef __AVX512BF16__
  if (pairs) return store_unpaired(o, d, 1.f / sum, out);
#endif
  for (int64_t j = 0; j < d; j += 16) store16(out + j, load16(o + j) * (1.f / sum));
}

// The softcap and the window's start `lo` applied to a tile's scores s [rows][kTile] (keys
// first .. first + padded - 1); masked lanes stay -inf.
inline void shape_scores(float* s, int64_t rows, int64_t first, int64_t padded, int64_t lo, float softcap) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t n = 0; n < padded; n += 16) {
      Vec16 x = load16(s + r * kTile + n);
      if (softcap > 0) x = tiles::soft_cap(x, softcap);
      if (first + n < lo) {
        Int16 key;
        for (int t = 0; t < 16; ++t) key[t] = static_cast<int32_t>(first + n + t);
        x = key < static_cast<int32_t>(lo) ? splat(tiles::kNegInf) : x;
      }
      store16(s + r * kTile + n, x);
    }
}

// A split decode's part (decode_splits.h): its rows' state into its slot; the split's last part
// merges every part's, in part order, into the output rows `out`.
template <typename T>
void finish_part(const Item& it, int64_t rows, int64_t d, bool pairs, Scratch& w, DecodeSplits& splits, T* out) {
  std::copy(w.o.begin(), w.o.begin() + rows * d, splits.output(it));
  std::copy(w.max.begin(), w.max.begin() + rows, splits.maxima(it));
  std::copy(w.sum.begin(), w.sum.begin() + rows, splits.sums(it));
  if (!splits.last(it)) return;
  Item part = it;
  for (int64_t r = 0; r < rows; ++r) {
    float max = tiles::kNegInf, sum = 0.f;
    for (part.part = 0; part.part < it.parts; ++part.part) max = std::max(max, splits.maxima(part)[r]);
    float* o = w.o.data() + r * d;
    std::fill(o, o + d, 0.f);
    for (part.part = 0; part.part < it.parts; ++part.part) {
      const float m = splits.maxima(part)[r], f = m == tiles::kNegInf ? 0.f : std::exp(m - max);
      sum += splits.sums(part)[r] * f;
      const float* po = splits.output(part) + r * d;
      for (int64_t j = 0; j < d; j += 16) store16(o + j, load16(o + j) + load16(po + j) * f);
    }
    finish_row(o, d, sum, pairs, out + r * d);
  }
}

}  // namespace decode

// One decode item: the sequence's newest token against its seq_len keys (with a window, the
// last `window` of them: the blocks before are not read), tile by tile, for the G rows of each
// of the item's KV heads (row h * G + g: query head (kv_head + h) * G + g); a part of a split
// decode against the keys of its part only, its rows left for finish_part to merge.
template <typename T, typename C>
void run_decode(const Inputs<T, C>& in, const Item& it, Scratch& w) {
  using namespace decode;
  const int64_t d = in.g.head_dim, groups = in.g.groups, rows = it.kv_heads * groups, keys_total = in.lens[it.seq];
  const int64_t row = row_elems<C>(d), head_rows = kBlock * row;  // a block of one head: [16][row]
  BlockScorer<T, C> scorer(in, it, w);
  w.o.assign(rows * d, 0.f);
  w.max.assign(rows, tiles::kNegInf);
  w.sum.assign(rows, 0.f);
  w.alpha.resize(rows);
  w.s.resize(rows * kTile);
  TileRows<C> v{{}, row};
  const bool pairs = std::is_same_v<C, c10::BFloat16> && d % 32 == 0;  // used where AVX512_BF16 is
  const int64_t lo = in.first_key(keys_total - 1), end = it.split < 0 ? keys_total : it.key_end;
  const int64_t start = std::max(lo / kBlock * kBlock, it.split < 0 ? int64_t{0} : it.key_begin);
  for (int64_t first = start; first < end; first += kTile) {
    const int64_t keys = std::min(kTile, end - first), padded = (keys + 15) / 16 * 16;
    if ((first - start) % kTouched == 0)
      touch_blocks(in, it, first / kBlock, std::min(first + kTouched, end + kBlock - 1) / kBlock);
    for (int64_t n = 0; n < keys; n += kBlock) {
      const int64_t at = in.block_offset(it, (first + n) / kBlock);
      v.block[n / kBlock] = in.v_cache + at;
      for (int64_t h = 0; h < it.kv_heads; ++h)
        scorer.score_block(in.k_cache + at + h * head_rows, std::min(kBlock, keys - n), h * groups, w.s.data() + n,
                           kTile);
    }
    if (in.softcap > 0 || first < lo) shape_scores(w.s.data(), rows, first, padded, lo, in.softcap);
    for (int64_t r = 0; r < rows; ++r) w.alpha[r] = softmax_tile(w.s.data() + r * kTile, padded, w.max[r], w.sum[r]);
    for (int64_t h = 0; h < it.kv_heads; ++h) {
      weigh_values(w.s.data() + h * groups * kTile, w.alpha.data() + h * groups, groups, v, keys,
                   w.o.data() + h * groups * d, d, pairs, w);
      for (int64_t i = 0; i < padded / kBlock; ++i) v.block[i] += head_rows;  // the next head's rows
    }
  }
  T* out = in.out + (in.token(it, 0) * in.g.heads + it.kv_head * groups) * d;
  if (it.split >= 0) return finish_part(it, rows, d, pairs, w, *in.splits, out);
  for (int64_t r = 0; r < rows; ++r) finish_row(w.o.data() + r * d, d, w.sum[r], pairs, out + r * d);
}

}  // namespace llmc_cpu
