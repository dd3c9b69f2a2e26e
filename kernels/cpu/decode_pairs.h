// The weighted sum of V for a bf16 cache on CPUs with AVX512_BF16 (attention_decode.h): the
// probabilities of two consecutive keys, rounded to bf16 (as the ref rounds them to q's
// dtype), times the two keys' V rows in one vdpbf16ps, products exact, sums in fp32.
//
//   pair_probabilities(p, rows, keys, pairs)   p [rows][kTile] fp32 -> pairs [rows][kTile/2]:
//                                              bf16(p[2m]) | bf16(p[2m+1]) << 16
//   accumulate_pairs_rows<R>(...)              o[r] = o[r] * alpha[r] + sum_n p[r][n] v[n]
//   store_unpaired(o, d, scale, out)           o's order back to the dimensions', scaled
//
// Two V rows a, b become pairs with vpunpck{l,h}wd, which work within 128-bit lanes: for a
// chunk of 32 dimensions the low result holds dimensions 8L + 0..3 of lane L as (a, b) pairs,
// the high one 8L + 4..7. The accumulators o keep that order ([lo 16 | hi 16] per chunk of
// 32), and store_unpaired restores the dimensions' order once, at the end of an item.
// d % 32 == 0.
#pragma once

#ifdef __AVX512BF16__

#include <immintrin.h>

#include <cstdint>

#include "attention_tiles.h"
#include "decode_blocks.h"
#include "vec16.h"

namespace llmc_cpu::decode {

// `keys` probabilities of each row (lanes up to a multiple of 16 past them are 0) as pairs.
inline void pair_probabilities(const float* p, int64_t p_row, int64_t rows, int64_t keys, uint32_t* pairs,
                               int64_t pairs_row) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t n = 0; n < keys; n += 32) {
      const Vec16 a = load16(p + r * p_row + n), b = n + 16 < keys ? load16(p + r * p_row + n + 16) : Vec16{};
      tiles::store_pairs(__builtin_shufflevector(a, b, 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30),
                         __builtin_shufflevector(a, b, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31),
                         pairs + r * pairs_row + n / 2);
    }
}

// R rows x NV vectors (NV / 2 chunks of 32 dimensions from c0) of o, in registers, over the
// keys; a missing partner of the last key (odd `keys`) is a zero row, not read.
template <int R, int NV>
inline void accumulate_pairs_strip(const uint32_t* pairs, int64_t pairs_row, const float* alpha,
                                   const TileRows<c10::BFloat16>& v, int64_t keys, int64_t c0, float* o, int64_t d) {
  Vec16 acc[R][NV];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < NV; ++c) acc[r][c] = load16(o + r * d + c0 + 16 * c) * alpha[r];
  const auto step = [&](int64_t n, bool partner) {
    __m512bh x[NV];
    for (int c = 0; c < NV; c += 2) {
      const __m512i a = _mm512_loadu_si512(v(n) + c0 + 16 * c);
      const __m512i b = partner ? _mm512_loadu_si512(v(n + 1) + c0 + 16 * c) : _mm512_setzero_si512();
      x[c] = tiles::in_register((__m512bh)_mm512_unpacklo_epi16(a, b));
      x[c + 1] = tiles::in_register((__m512bh)_mm512_unpackhi_epi16(a, b));
    }
    for (int r = 0; r < R; ++r) {
      const __m512bh w = tiles::Bf16Pairs::broadcast(pairs[r * pairs_row + n / 2]);
      for (int c = 0; c < NV; ++c) acc[r][c] = tiles::Bf16Pairs::step(acc[r][c], w, x[c]);
    }
  };
  int64_t n = 0;
  for (; n + 1 < keys; n += 2) step(n, true);
  if (n < keys) step(n, false);
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < NV; ++c) store16(o + r * d + c0 + 16 * c, acc[r][c]);
}

template <int R>
inline void accumulate_pairs_rows(const uint32_t* pairs, int64_t pairs_row, const float* alpha,
                                  const TileRows<c10::BFloat16>& v, int64_t keys, float* o, int64_t d) {
  constexpr int kWide = R <= 6 ? 4 : 2;
  int64_t c0 = 0;
  for (; c0 + 16 * kWide <= d; c0 += 16 * kWide)
    accumulate_pairs_strip<R, kWide>(pairs, pairs_row, alpha, v, keys, c0, o, d);
  if (c0 < d) accumulate_pairs_strip<R, 2>(pairs, pairs_row, alpha, v, keys, c0, o, d);
}

// One row of o in the pairs' order, times `scale`, to out in the dimensions' order.
template <typename T>
inline void store_unpaired(const float* o, int64_t d, float scale, T* out) {
  for (int64_t j = 0; j < d; j += 32) {
    const Vec16 lo = load16(o + j), hi = load16(o + j + 16);
    store16(out + j, __builtin_shufflevector(lo, hi, 0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23) * scale);
    store16(out + j + 16,
            __builtin_shufflevector(lo, hi, 8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31) * scale);
  }
}

}  // namespace llmc_cpu::decode

#endif
