// The inner loops of tiled (flash-style) attention on the CPU: one tile of query rows against
// one tile of up to kKeys keys, as two small GEMMs with fp32 accumulation and an online softmax
// between them. Scores are kept transposed, st [keys][R] (R = rows rounded up to 16), so the
// queries are transposed once per item rather than each key tile once per tile, and the
// softmax runs down the columns: 16 rows per vector, no horizontal reductions.
//
//   scores(qt, R, d, k, keys, st)        st[n][r] = q[r] . k[n]: qt = Q transposed [d][R],
//                                        k [keys][d] (rows as read from the cache), keys % 16 == 0
//   softmax(st, R, keys, ...)            st scaled, causally masked, turned into probabilities
//                                        against each row's running max in place; alpha[r] the
//                                        factor that rescales row r's earlier output
//   accumulate(st, alpha, R, keys, v, d, o)   o[r] = o[r] * alpha[r] + sum_n st[n][r] v[n],
//                                        v [keys][d], o [R][d]
// A register block is kRows x up to 64 columns (24 accumulators, 4 operands, a broadcast).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "vec16.h"

namespace llmc_cpu::tiles {

constexpr int64_t kKeys = 64;  // keys per K/V tile: four cache blocks of 16
constexpr int kRows = 6;       // rows of a register block
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// A loaded vector held in a register: without this GCC folds the load into each of the MR
// FMAs that use it, and the GEMMs become bound by loads rather than FMAs.
inline Vec16 in_register(Vec16 v) {
  asm("" : "+v"(v));
  return v;
}

// out[m][c] (+)= sum_j a[m * a_row + j * a_step] * b[j * b_row + 16c ..]: MR broadcast rows
// of `a` against NV vectors of each row of `b`, j < depth; `out` rows `out_row` apart.
template <int MR, int NV, bool kAccumulate>
inline void gemm_block(const float* a, int64_t a_row, int64_t a_step, const float* b, int64_t b_row, int64_t depth,
                       float* out, int64_t out_row, const float* out_scale) {
  Vec16 acc[MR][NV];
  for (int m = 0; m < MR; ++m)
    for (int c = 0; c < NV; ++c) acc[m][c] = kAccumulate ? load16(out + m * out_row + 16 * c) * out_scale[m] : Vec16{};
  for (int64_t j = 0; j < depth; ++j) {
    Vec16 x[NV];
    for (int c = 0; c < NV; ++c) x[c] = in_register(load16(b + j * b_row + 16 * c));
    for (int m = 0; m < MR; ++m) {
      const Vec16 w = splat(a[m * a_row + j * a_step]);
      for (int c = 0; c < NV; ++c) acc[m][c] += w * x[c];
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int c = 0; c < NV; ++c) store16(out + m * out_row + 16 * c, acc[m][c]);
}

// gemm_block over all `cols` (a multiple of 16) of b and out, 64 at a time.
template <int MR, bool kAccumulate>
inline void gemm_rows(const float* a, int64_t a_row, int64_t a_step, const float* b, int64_t b_row, int64_t depth,
                      int64_t cols, float* out, int64_t out_row, const float* out_scale) {
  int64_t c = 0;
  for (; c + 64 <= cols; c += 64)
    gemm_block<MR, 4, kAccumulate>(a, a_row, a_step, b + c, b_row, depth, out + c, out_row, out_scale);
  switch ((cols - c) / 16) {
    case 3: return gemm_block<MR, 3, kAccumulate>(a, a_row, a_step, b + c, b_row, depth, out + c, out_row, out_scale);
    case 2: return gemm_block<MR, 2, kAccumulate>(a, a_row, a_step, b + c, b_row, depth, out + c, out_row, out_scale);
    case 1: return gemm_block<MR, 1, kAccumulate>(a, a_row, a_step, b + c, b_row, depth, out + c, out_row, out_scale);
    default: return;
  }
}

// All `rows` rows of the product, kRows at a time.
template <bool kAccumulate>
inline void gemm(const float* a, int64_t a_row, int64_t a_step, int64_t rows, const float* b, int64_t b_row,
                 int64_t depth, int64_t cols, float* out, int64_t out_row, const float* out_scale) {
  int64_t m = 0;
  for (; m + kRows <= rows; m += kRows)
    gemm_rows<kRows, kAccumulate>(a + m * a_row, a_row, a_step, b, b_row, depth, cols, out + m * out_row, out_row,
                                  out_scale + m);
  for (; m + 2 <= rows; m += 2)
    gemm_rows<2, kAccumulate>(a + m * a_row, a_row, a_step, b, b_row, depth, cols, out + m * out_row, out_row,
                              out_scale + m);
  if (m < rows)
    gemm_rows<1, kAccumulate>(a + m * a_row, a_row, a_step, b, b_row, depth, cols, out + m * out_row, out_row,
                              out_scale + m);
}

inline void scores(const float* qt, int64_t rows, int64_t d, const float* k, int64_t keys, float* st) {
  gemm<false>(k, d, 1, keys, qt, rows, d, rows, st, rows, nullptr);
}

inline void accumulate(const float* st, const float* alpha, int64_t rows, int64_t keys, const float* v, int64_t d,
                       float* o) {
  gemm<true>(st, 1, rows, rows, v, d, keys, d, o, d, alpha);
}

// The online-softmax step over a tile of transposed scores st [keys][rows] whose key indices
// start at first_key; pos[r] is row r's position (keys after it are masked where `diagonal`).
// max, sum, alpha are [rows]; every row must see a key in its first tile.
inline void softmax(float* st, int64_t rows, int64_t keys, int64_t first_key, const int32_t* pos, bool diagonal,
                    float* max, float* sum, float* alpha) {
  for (int64_t r = 0; r < rows; r += 16) {
    Int16 last;
    std::memcpy(&last, pos + r, sizeof(last));
    Vec16 m = load16(max + r);
    for (int64_t n = 0; n < keys; ++n) {
      Vec16 x = load16(st + n * rows + r);
      if (diagonal) x = last < static_cast<int32_t>(first_key + n) ? splat(kNegInf) : x;
      store16(st + n * rows + r, x);
      m = vmax(m, x);
    }
    const Vec16 old = load16(max + r);
    const Vec16 a = exp16(old - m);  // old = -inf on the first tile: exp16 gives 0
    Vec16 total{};
    for (int64_t n = 0; n < keys; ++n) {
      const Vec16 p = exp16(load16(st + n * rows + r) - m);
      store16(st + n * rows + r, p);
      total += p;
    }
    store16(max + r, m);
    store16(sum + r, load16(sum + r) * a + total);
    store16(alpha + r, a);
  }
}

}  // namespace llmc_cpu::tiles
