// A row's greedy pick, shared by argmax_rows.cpp (the op) and a step plan's GEMMs, which pick as
// they make the panels (step_plan_gemm.h): first_max(row, v) is torch.argmax's meaning over one row
// of v values (its smallest index holding its maximum, a NaN counting as larger than every number:
// a row with NaNs gives its first NaN); Pick and `better` merge the picks of parts of a row taken
// in any order into that row's.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>

#include "vec16.h"

namespace llmc_cpu {

// Bit i set where lane i of x equals y (ordered: never for a NaN lane).
inline uint32_t equal_lanes(Vec16 x, float y) {
#ifdef __AVX512F__
  return _mm512_cmp_ps_mask((__m512)x, _mm512_set1_ps(y), _CMP_EQ_OQ);
#else
  uint32_t bits = 0;
  for (int i = 0; i < 16; ++i) bits |= static_cast<uint32_t>(x[i] == y) << i;
  return bits;
#endif
}

// Bit i set where lane i of x is a NaN.
inline uint32_t nan_lanes(Vec16 x) {
#ifdef __AVX512F__
  return _mm512_cmp_ps_mask((__m512)x, (__m512)x, _CMP_UNORD_Q);
#else
  uint32_t bits = 0;
  for (int i = 0; i < 16; ++i) bits |= static_cast<uint32_t>(x[i] != x[i]) << i;
  return bits;
#endif
}

// The first index j < v of `row` where pick(value) holds, scanning 16 lanes at a time.
template <typename T, typename Lanes, typename One>
int64_t first_where(const T* row, int64_t v, Lanes lanes, One one) {
  int64_t j = 0;
  for (; j + 16 <= v; j += 16)
    if (const uint32_t bits = lanes(llmc_cpu::load16(row + j))) return j + __builtin_ctz(bits);
  for (; j < v; ++j)
    if (one(static_cast<float>(row[j]))) return j;
  return 0;   // not reached: the caller knows such an index exists
}

template <typename T>
int64_t first_max(const T* row, int64_t v) {
  Vec16 lane_max = llmc_cpu::splat(-std::numeric_limits<float>::infinity());
  uint32_t nans = 0;
  int64_t j = 0;
  for (; j + 16 <= v; j += 16) {
    const Vec16 x = llmc_cpu::load16(row + j);
    nans |= nan_lanes(x);
    lane_max = x > lane_max ? x : lane_max;    // a NaN lane keeps the running max
  }
  float best = llmc_cpu::hmax(lane_max);
  for (; j < v; ++j) {
    const float x = static_cast<float>(row[j]);
    nans |= x != x;
    best = x > best ? x : best;
  }
  if (nans)
    return first_where(row, v, [](Vec16 x) { return nan_lanes(x); }, [](float x) { return x != x; });
  return first_where(row, v, [best](Vec16 x) { return equal_lanes(x, best); }, [best](float x) { return x == best; });
}

// A part of a row's pick: its value and index (index < 0: none yet).
struct Pick {
  float value = 0.f;
  int64_t index = -1;
};

// Whether `a` is the row's pick over `b`: a NaN over any number, a larger number over a smaller, and
// between equals (or two NaNs) the smaller index; anything over none.
inline bool better(const Pick& a, const Pick& b) {
  if (a.index < 0) return false;
  if (b.index < 0) return true;
  const bool a_nan = a.value != a.value, b_nan = b.value != b.value;
  if (a_nan != b_nan) return a_nan;
  if (!a_nan && a.value != b.value) return a.value > b.value;
  return a.index < b.index;
}

// `best` updated with the pick of row[0 .. v) (v >= 1), whose first element is the row's `first`.
template <typename T>
void pick_in(const T* row, int64_t v, int64_t first, Pick& best) {
  const int64_t j = first_max(row, v);
  const Pick part{static_cast<float>(row[j]), first + j};
  if (better(part, best)) best = part;
}

}  // namespace llmc_cpu
