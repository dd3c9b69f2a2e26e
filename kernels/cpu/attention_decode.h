// A decode work item of paged_attention.cpp: one query of one sequence against its whole cached
// context, for the G query heads that share a KV head (the item's G rows). Made to run at the
// speed the cache can be read, not at the speed of its arithmetic:
//
//   * K and V are read where they lie in the cache (f32 as is; bf16 K straight into vdpbf16ps
//     where the CPU has AVX512_BF16 and D % 32 == 0; otherwise a block widened once into L1
//     scratch, int8 rows dequantized as code * scale, for all G rows). V rows are widened in
//     registers (an int8 row's scale is folded into its probability).
//   * A block's 16 scores are 16 partial vectors reduced together by one transposing tree
//     (transpose_sum: 15 shuffle-add steps), not 16 horizontal sums.
//   * The online softmax steps over tiles of kTile keys (four blocks): one max, one rescale of
//     the accumulators per tile; the weighted sum of V keeps each row's output in registers
//     (strips of NV x 16 dimensions for R <= 8 rows).
//   * An item takes all KV heads of its sequence: a block's heads lie next to each other, so K
//     and V are read as streams of KVH x 16 rows, not 16.
//   * The reads are kept apart from the arithmetic: touch_blocks loads every line of the next
//     kTouched keys' blocks in a loop of nothing but loads (many misses in flight), then the
//     tiles compute from L2. Loads spread through the arithmetic keep few misses in flight; on
//     the Zen 5 VM measured, that ran at 7-8 GB/s on one core, and software prefetches ahead
//     (one or two tiles, one to eight blocks, t0 or nta) did not change it; touching first
//     doubled it.
//
// Numerics: scores, softmax and the weighted sum in fp32 (bf16 q.k products are exact in fp32);
// only the order of the additions differs from the ref. Keys past the sequence's length are
// never read (those cache rows may hold anything, NaN included).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "attention_tiles.h"
#include "decode_blocks.h"
#include "kv_rows.h"
#include "vec16.h"

namespace llmc_cpu {

namespace decode {

constexpr int64_t kTile = 64;  // keys per online-softmax step: four cache blocks
constexpr int kMaxRows = 8;    // rows whose accumulators live in registers at once
constexpr int64_t kTouched = 2 * kTile;  // keys brought into L2 by one touch_blocks

// The softmax step over one row's scores s [keys] (lanes past `keys` are -inf): probabilities
// back into s, the row's max and sum updated; returns the factor for its earlier output.
inline float softmax_tile(float* s, int64_t keys, float& max, float& sum) {
  Vec16 m = splat(max);
  for (int64_t n = 0; n < keys; n += 16) m = vmax(m, load16(s + n));
  const float new_max = hmax(m);
  const float alpha = std::exp(max - new_max);  // 0 on the first tile (max = -inf)
  Vec16 total{};
  for (int64_t n = 0; n < keys; n += 16) {
    const Vec16 p = tiles::exp_nonpositive(load16(s + n) - new_max);
    total += p;
    store16(s + n, p);
  }
  max = new_max;
  sum = sum * alpha + hsum(total);
  return alpha;
}

// o[r][c0 ..] = o[r][c0 ..] * alpha[r] + sum_n p[r][n] v[n][c0 ..] for R rows and NV vectors
// of dimensions from c0, the accumulators in registers; p rows kTile apart.
template <typename C, int R, int NV>
inline void accumulate_strip(const float* p, const float* alpha, const TileRows<C>& v, int64_t keys, int64_t c0,
                             float* o, int64_t d) {
  Vec16 acc[R][NV];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < NV; ++c) acc[r][c] = load16(o + r * d + c0 + 16 * c) * alpha[r];
  for (int64_t n = 0; n < keys; ++n) {
    Vec16 x[NV];
    for (int c = 0; c < NV; ++c) x[c] = tiles::in_register(value16(v(n) + c0 + 16 * c));
    for (int r = 0; r < R; ++r) {
      const Vec16 pr = splat(p[r * kTile + n]);
      for (int c = 0; c < NV; ++c) acc[r][c] += pr * x[c];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < NV; ++c) store16(o + r * d + c0 + 16 * c, acc[r][c]);
}

// accumulate_strip over all d dimensions of R rows, strips of up to 24 / R vectors.
template <typename C, int R>
inline void accumulate_rows(const float* p, const float* alpha, const TileRows<C>& v, int64_t keys, float* o,
                            int64_t d) {
  constexpr int kWide = R <= 6 ? 4 : 3;
  int64_t c0 = 0;
  for (; c0 + 16 * kWide <= d; c0 += 16 * kWide) accumulate_strip<C, R, kWide>(p, alpha, v, keys, c0, o, d);
  switch ((d - c0) / 16) {
    case 3: return accumulate_strip<C, R, 3>(p, alpha, v, keys, c0, o, d);
    case 2: return accumulate_strip<C, R, 2>(p, alpha, v, keys, c0, o, d);
    case 1: return accumulate_strip<C, R, 1>(p, alpha, v, keys, c0, o, d);
    default: return;
  }
}

// All `rows` rows, kMaxRows at a time.
template <typename C>
void accumulate(const float* p, const float* alpha, int64_t rows, const TileRows<C>& v, int64_t keys, float* o,
                int64_t d) {
  for (int64_t r = 0; r < rows; r += kMaxRows) {
    const float* pr = p + r * kTile;
    const float* ar = alpha + r;
    float* orow = o + r * d;
    switch (std::min<int64_t>(kMaxRows, rows - r)) {
      case 1: accumulate_rows<C, 1>(pr, ar, v, keys, orow, d); break;
      case 2: accumulate_rows<C, 2>(pr, ar, v, keys, orow, d); break;
      case 3: accumulate_rows<C, 3>(pr, ar, v, keys, orow, d); break;
      case 4: accumulate_rows<C, 4>(pr, ar, v, keys, orow, d); break;
      case 5: accumulate_rows<C, 5>(pr, ar, v, keys, orow, d); break;
      case 6: accumulate_rows<C, 6>(pr, ar, v, keys, orow, d); break;
      case 7: accumulate_rows<C, 7>(pr, ar, v, keys, orow, d); break;
      default: accumulate_rows<C, 8>(pr, ar, v, keys, orow, d); break;
    }
  }
}

}  // namespace decode

// One decode item: the sequence's newest token against its seq_len keys, tile by tile, for
// the G rows of each of the item's KV heads (row h * G + g: query head (kv_head + h) * G + g).
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
  for (int64_t first = 0; first < keys_total; first += kTile) {
    const int64_t keys = std::min(kTile, keys_total - first), padded = (keys + 15) / 16 * 16;
    if (first % kTouched == 0)
      touch_blocks(in, it, first / kBlock, std::min(first + kTouched, keys_total + kBlock - 1) / kBlock);
    for (int64_t n = 0; n < keys; n += kBlock) {
      const int64_t at = in.block_offset(it, (first + n) / kBlock);
      v.block[n / kBlock] = in.v_cache + at;
      for (int64_t h = 0; h < it.kv_heads; ++h)
        scorer.score_block(in.k_cache + at + h * head_rows, std::min(kBlock, keys - n), h * groups, w.s.data() + n,
                           kTile);
    }
    for (int64_t r = 0; r < rows; ++r) w.alpha[r] = softmax_tile(w.s.data() + r * kTile, padded, w.max[r], w.sum[r]);
    for (int64_t h = 0; h < it.kv_heads; ++h) {
      float* p = w.s.data() + h * groups * kTile;
      if constexpr (std::is_same_v<C, int8_t>) fold_value_scales(v, keys, d, groups, p, kTile);
      accumulate<C>(p, w.alpha.data() + h * groups, groups, v, keys, w.o.data() + h * groups * d, d);
      for (int64_t i = 0; i < padded / kBlock; ++i) v.block[i] += head_rows;  // the next head's rows
    }
  }
  T* out = in.out + (in.token(it, 0) * in.g.heads + it.kv_head * groups) * d;
  for (int64_t r = 0; r < rows; ++r) {
    const float inv = 1.f / w.sum[r];
    for (int64_t j = 0; j < d; j += 16) store16(out + r * d + j, load16(w.o.data() + r * d + j) * inv);
  }
}

}  // namespace llmc_cpu
