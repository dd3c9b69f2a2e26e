// The reads of attention_decode.h: one cache block's 16 scores for each of an item's rows, a V
// row's dimensions as fp32 a Lanes at a time, the reads that bring blocks into L2 ahead of them.
//
//   Lanes                    the vector of the kernel's register blocks: Vec16 with AVX-512,
//                            else Vec8 (a Vec16 is two AVX2 registers: blocks of them sized for
//                            AVX-512's 32 spilled out of AVX2's 16, and an AVX2 Zen 3's decode
//                            ran at 15% of its read bandwidth, every loop through the stack)
//   transpose_sum(part)      lane t = the sum of part[t]'s lanes, for as many vectors as lanes:
//                            levels of (shuffle, shuffle, add) halve the vectors and the lanes
//   BlockScorer<T, C>        the item's queries, prepared once; score_block(k, visible, first,
//                            s, s_row) writes the scores of rows first .. first + G - 1 (one
//                            KV head's) against its block of keys k [16][row] to s[r * s_row
//                            ..], scaled; lanes from `visible` on are -inf and the cache rows
//                            behind them are not read
//   TileRows<C>              where a tile's V rows of one KV head lie
//   values(row + j)          a Lanes of a V row's values as fp32 (int8: the codes; the caller
//                            applies the row's scale, fold_value_scales)
//   touch_blocks(in, it, b0, b1)  every cache line of the item's K and V rows (all its
//                            heads) in blocks b0 .. b1 - 1, loaded and dropped
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "attention_items.h"
#include "attention_tiles.h"
#include "kv_rows.h"
#include "vec16.h"

namespace llmc_cpu::decode {

#if defined(__AVX512F__)
using Lanes = Vec16;
inline Lanes splat_lanes(float x) { return splat(x); }
inline Lanes values(const float* p) { return load16(p); }
inline Lanes values(const c10::BFloat16* p) { return load16(p); }
inline Lanes values(const int8_t* p) { return load16_codes(p); }
inline void store_lanes(float* p, Lanes v) { store16(p, v); }
#else
using Lanes = Vec8;
inline Lanes splat_lanes(float x) { return splat8(x); }
inline Lanes values(const float* p) { return load8(p); }
inline Lanes values(const c10::BFloat16* p) { return load8(p); }
inline Lanes values(const int8_t* p) { return load8_codes(p); }
inline void store_lanes(float* p, Lanes v) { store8(p, v); }
#endif
constexpr int kLanes = sizeof(Lanes) / sizeof(float);

// Lanes [a's first s, b's first s] (lo) and [a's second s, b's second s] (hi) of each group
// of 2s lanes, summed: the vectors' lane groups of s halved and interleaved.
template <int S>
inline Vec16 fold_pair(Vec16 a, Vec16 b) {
  if constexpr (S == 8)
    return __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  else if constexpr (S == 4)
    return __builtin_shufflevector(a, b, 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27) +
           __builtin_shufflevector(a, b, 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
  else if constexpr (S == 2)
    return __builtin_shufflevector(a, b, 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29) +
           __builtin_shufflevector(a, b, 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
  else
    return __builtin_shufflevector(a, b, 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30) +
           __builtin_shufflevector(a, b, 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
}

// The same on 8 lanes.
template <int S>
inline Vec8 fold_pair(Vec8 a, Vec8 b) {
  if constexpr (S == 4)
    return __builtin_shufflevector(a, b, 0, 1, 2, 3, 8, 9, 10, 11) +
           __builtin_shufflevector(a, b, 4, 5, 6, 7, 12, 13, 14, 15);
  else if constexpr (S == 2)
    return __builtin_shufflevector(a, b, 0, 1, 8, 9, 4, 5, 12, 13) +
           __builtin_shufflevector(a, b, 2, 3, 10, 11, 6, 7, 14, 15);
  else
    return __builtin_shufflevector(a, b, 0, 8, 2, 10, 4, 12, 6, 14) +
           __builtin_shufflevector(a, b, 1, 9, 3, 11, 5, 13, 7, 15);
}

// Pairing i with i + 8 (16 lanes), then i + 4, i + 2, i + 1 leaves part[t]'s sum in lane t.
template <typename V>
inline V transpose_sum(V* part) {
  if constexpr (sizeof(V) == sizeof(Vec16))
    for (int i = 0; i < 8; ++i) part[i] = fold_pair<8>(part[i], part[i + 8]);
  for (int i = 0; i < 4; ++i) part[i] = fold_pair<4>(part[i], part[i + 4]);
  for (int i = 0; i < 2; ++i) part[i] = fold_pair<2>(part[i], part[i + 2]);
  return fold_pair<1>(part[0], part[1]);
}

// q . k[t] for kLanes fp32 rows of k [kLanes][d]: a partial vector per key, d % kLanes == 0.
inline Lanes scores(const float* q, const float* k, int64_t d) {
  Lanes part[kLanes] = {};
  for (int64_t j = 0; j < d; j += kLanes) {
    const Lanes qj = tiles::in_register(values(q + j));
    for (int t = 0; t < kLanes; ++t) part[t] += qj * values(k + t * d + j);
  }
  return transpose_sum(part);
}

// q . k[t] for the 16 fp32 rows of k [16][d] into s [16], in Lanes of keys.
inline void store_scores16(const float* q, const float* k, int64_t d, float* s) {
  for (int t = 0; t < kBlock; t += kLanes) store_lanes(s + t, scores(q, k + t * d, d));
}

#ifdef __AVX512BF16__
// The same from bf16 rows k [16][d] and q as pairs of bf16 dimensions [d/2]; d % 32 == 0.
inline Vec16 scores16(const uint32_t* q, const c10::BFloat16* k, int64_t d) {
  Vec16 part[16] = {};
  for (int64_t j = 0; j < d; j += 32) {
    const __m512bh qj = tiles::in_register(tiles::Bf16Pairs::load(q + j / 2));
    for (int t = 0; t < 16; ++t)
      part[t] = tiles::Bf16Pairs::step(part[t], qj, (__m512bh)_mm512_loadu_si512(k + t * d + j));
  }
  return transpose_sum(part);
}
#endif

// The V rows of a tile of keys for one KV head: key n is row n % 16 of the tile's block n / 16.
template <typename C>
struct TileRows {
  const C* block[4];
  int64_t row;  // elements per cache row
  const C* operator()(int64_t n) const { return block[n / kBlock] + (n % kBlock) * row; }
};

// Reads every cache line of the item's K and V rows in blocks b0 .. b1 - 1 and drops them:
// a loop of nothing but independent loads keeps many more misses in flight than the kernel's
// own loads between its arithmetic do, so it brings the blocks into L2 at the read bandwidth.
template <typename T, typename C>
void touch_blocks(const Inputs<T, C>& in, const Item& it, int64_t b0, int64_t b1) {
  // One register's load a line (AVX2: its first 32 bytes; GCC took 64-byte ones through the stack)
  typedef uint32_t Bits __attribute__((vector_size(sizeof(Lanes))));
  const int64_t bytes = it.kv_heads * kBlock * row_elems<C>(in.g.head_dim) * sizeof(C);
  Bits seen{};
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t at = in.block_offset(it, b);
    const char* k = reinterpret_cast<const char*>(in.k_cache + at);
    const char* v = reinterpret_cast<const char*>(in.v_cache + at);
    for (int64_t i = 0; i < bytes; i += 64) {
      Bits a, c;
      std::memcpy(&a, k + i, sizeof(a));
      std::memcpy(&c, v + i, sizeof(c));
      seen |= a | c;
    }
  }
  asm volatile("" : : "m"(seen));  // the loads stay: their result is used
}

// Each row's probabilities s[r * s_row + n] times V row n's int8 scale.
inline void fold_value_scales(const TileRows<int8_t>& v, int64_t keys, int64_t d, int64_t rows, float* s,
                              int64_t s_row) {
  float scales[64];
  for (int64_t n = 0; n < keys; ++n) scales[n] = row_scale(v(n), d);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t n = 0; n < keys; ++n) s[r * s_row + n] *= scales[n];
}

template <typename T, typename C>
class BlockScorer {
 public:
  // The item's rows (G per KV head, query head it.kv_head * G + r for row r) of its one
  // query, scaled, as fp32 in w.q [rows][D] (bf16 pairs: unscaled in w.qp).
  BlockScorer(const Inputs<T, C>& in, const Item& it, Scratch& w) : d_(in.g.head_dim), groups_(in.g.groups),
                                                                     scale_(in.scale), w_(w) {
    const int64_t rows = it.kv_heads * groups_;
    const T* q = in.q + (in.token(it, 0) * in.g.heads + it.kv_head * groups_) * d_;
    w.q.resize(rows * d_);
    w.k.resize(kBlock * d_);
    for (int64_t i = 0; i < rows * d_; i += 16) store16(w.q.data() + i, load16(q + i) * scale_);
#ifdef __AVX512BF16__
    if constexpr (kPairs) {
      pairs_ = d_ % 32 == 0;
      w.qp.resize(rows * d_ / 2);
      w.kp.resize(kBlock * d_ / 2);
      std::memcpy(w.qp.data(), q, rows * d_ * sizeof(T));
    }
#endif
  }

  // Rows first .. first + G - 1 (one KV head's) against that head's block of keys k.
  void score_block(const C* k, int64_t visible, int64_t first, float* s, int64_t s_row) {
#ifdef __AVX512BF16__
    if constexpr (kPairs)
      if (pairs_) return score_pairs(k, visible, first, s, s_row);
#endif
    const float* rows = widened(k, visible);
    for (int64_t r = first; r < first + groups_; ++r) {
      store_scores16(w_.q.data() + r * d_, rows, d_, s + r * s_row);
      std::fill(s + r * s_row + visible, s + r * s_row + kBlock, tiles::kNegInf);
    }
  }

 private:
  // bf16 q.k as vdpbf16ps: a bf16 cache's rows as they are; int8 codes (exact in bf16) with
  // bf16 q, the rows' scales applied to the scores.
  static constexpr bool kPairs = std::is_same_v<T, c10::BFloat16> && !std::is_same_v<C, float>;

  // The block's keys as fp32 rows [16][D]: f32 rows in place when all 16 are visible, else
  // widened into scratch (int8: dequantized), rows past `visible` zero.
  const float* widened(const C* k, int64_t visible) {
    if constexpr (std::is_same_v<C, float>)
      if (visible == kBlock) return k;
    const int64_t row = row_elems<C>(d_);
    for (int64_t t = 0; t < visible; ++t) widen_row(k + t * row, d_, w_.k.data() + t * d_);
    std::fill(w_.k.begin() + visible * d_, w_.k.end(), 0.f);
    return w_.k.data();
  }

#ifdef __AVX512BF16__
  static Vec16 masked(Vec16 x, int64_t visible) {
    if (visible == kBlock) return x;
    Int16 lane;
    for (int t = 0; t < 16; ++t) lane[t] = t;
    return lane < static_cast<int32_t>(visible) ? x : splat(tiles::kNegInf);
  }

  void score_pairs(const C* k, int64_t visible, int64_t first, float* s, int64_t s_row) {
    if constexpr (std::is_same_v<C, int8_t>) {
      score_codes(k, visible, first, s, s_row);
    } else {
      if (visible < kBlock) {
        auto* copy = reinterpret_cast<C*>(w_.kp.data());
        std::memcpy(copy, k, visible * d_ * sizeof(C));
        std::fill(copy + visible * d_, copy + kBlock * d_, C(0.f));
        k = copy;
      }
      for (int64_t r = first; r < first + groups_; ++r)
        store16(s + r * s_row, masked(scores16(w_.qp.data() + r * d_ / 2, k, d_) * scale_, visible));
    }
  }

  // The block's codes as bf16 rows in w.kp (rows past `visible` zero), their scales times
  // the op's scale as a vector.
  void score_codes(const int8_t* k, int64_t visible, int64_t first, float* s, int64_t s_row) {
    auto* rows = reinterpret_cast<c10::BFloat16*>(w_.kp.data());
    float scales[kBlock] = {};
    for (int64_t t = 0; t < visible; ++t) {
      const int8_t* row = k + t * row_elems<int8_t>(d_);
      scales[t] = row_scale(row, d_) * scale_;
      for (int64_t j = 0; j < d_; j += 32) {
        const __m512bh pair = _mm512_cvtne2ps_pbh((__m512)load16_codes(row + j + 16), (__m512)load16_codes(row + j));
        std::memcpy(rows + t * d_ + j, &pair, sizeof(pair));
      }
    }
    std::fill(rows + visible * d_, rows + kBlock * d_, c10::BFloat16(0.f));
    const Vec16 scale = load16(scales);
    for (int64_t r = first; r < first + groups_; ++r)
      store16(s + r * s_row, masked(scores16(w_.qp.data() + r * d_ / 2, rows, d_) * scale, visible));
  }
  bool pairs_ = false;
#endif

  int64_t d_, groups_;
  float scale_;
  Scratch& w_;
};

}  // namespace llmc_cpu::decode
