// What the CPU kernels that llmc codegen writes (compiler/codegen/cpp.py) are made of: a row of any
// width walked in chunks of 16 fp32 lanes (the last chunk partial), loads and stores of float,
// bfloat16 and half chunks, rounding to an IR dtype in registers, and the vector math of the row
// formulas (compiler/formula.py's primitives).
//
//   each_chunk<W>(body)  body(j, Full{}) for every whole chunk of a W-wide row, then
//                        body(j, Part<W % 16>{}) for the rest (if any); j is the chunk's first column
//   each_window<W>(c0, c1, body)  the same for columns c0 .. c1 - 1 only (c0 a multiple of 16, c1 a
//                        multiple of 16 or W): a window of the row
//   ld(p, n), st(p, v, n)  n = Full{}: 16 lanes (vec16.h's load16 / store16); Part<N>{}: the first N
//                        lanes only, nothing past them read or written (lanes past N load as 0)
//   keep(v, n)           v with the lanes past the row's end zeroed (before a row sum)
//   round_bf16, round_f16  each lane rounded to the dtype (nearest even) and widened back: what a
//                        store then a load gives
//   sqrt16, rsqrt16, sigmoid16, tanh16, max16, min16  per lane; max and min propagate NaN as torch's do
//
// Nothing here allocates, fails or keeps state.
#pragma once

#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>

#include "vec16.h"

namespace llmc_gen {

using llmc_cpu::exp16;
using llmc_cpu::exp_nonpositive;
using llmc_cpu::hsum;
using llmc_cpu::Int16;
using llmc_cpu::load16;
using llmc_cpu::splat;
using llmc_cpu::store16;
using llmc_cpu::Uint16;
using llmc_cpu::Vec16;

typedef _Float16 F16x16 __attribute__((vector_size(32)));

inline Vec16 load16(const c10::Half* p) {
  F16x16 h;
  std::memcpy(&h, p, sizeof(h));
  return __builtin_convertvector(h, Vec16);
}

inline void store16(c10::Half* p, Vec16 v) {
  const F16x16 h = __builtin_convertvector(v, F16x16);   // round to nearest even
  std::memcpy(p, &h, sizeof(h));
}

struct Full {};
template <int N>
struct Part {};

template <typename T>
inline Vec16 ld(const T* p, Full) {
  return load16(p);
}

template <typename T, int N>
inline Vec16 ld(const T* p, Part<N>) {
  T lanes[16];
  std::memset(static_cast<void*>(lanes), 0, sizeof(lanes));
  std::memcpy(static_cast<void*>(lanes), p, N * sizeof(T));
  return load16(lanes);
}

template <typename T>
inline void st(T* p, Vec16 v, Full) {
  store16(p, v);
}

template <typename T, int N>
inline void st(T* p, Vec16 v, Part<N>) {
  T lanes[16];
  store16(lanes, v);
  std::memcpy(static_cast<void*>(p), lanes, N * sizeof(T));
}

inline Vec16 keep(Vec16 v, Full) { return v; }

template <int N>
inline Vec16 keep(Vec16 v, Part<N>) {
  const Int16 lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  return lane < N ? v : splat(0.f);
}

template <int64_t W, typename Body>
inline void each_chunk(Body&& body) {
  for (int64_t j = 0; j + 16 <= W; j += 16) body(j, Full{});
  if constexpr (W % 16 != 0) body(W / 16 * 16, Part<W % 16>{});
}

template <int64_t W, typename Body>
inline void each_window(int64_t c0, int64_t c1, Body&& body) {
  for (int64_t j = c0; j + 16 <= c1; j += 16) body(j, Full{});
  if constexpr (W % 16 != 0)
    if (c1 == W) body(W / 16 * 16, Part<W % 16>{});
}

inline Vec16 round_bf16(Vec16 v) {
#ifdef __AVX512BF16__   // as vec16.h's store16 rounds: one vcvtneps2bf16 (fp32 subnormals flushed to 0)
  const __m256i h = (__m256i)_mm512_cvtneps_pbh((__m512)v);
  return (Vec16)_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16);
#else
  Uint16 bits;
  std::memcpy(&bits, &v, sizeof(bits));
  bits += 0x7FFFu + ((bits >> 16) & 1u);   // as vec16.h's store16 rounds
  bits &= 0xFFFF0000u;
  std::memcpy(&v, &bits, sizeof(v));
  return v;
#endif
}

inline Vec16 round_f16(Vec16 v) { return __builtin_convertvector(__builtin_convertvector(v, F16x16), Vec16); }

inline Vec16 sqrt16(Vec16 v) {
#ifdef __AVX512F__
  return (Vec16)_mm512_sqrt_ps((__m512)v);
#else
  for (int i = 0; i < 16; ++i) v[i] = __builtin_sqrtf(v[i]);
  return v;
#endif
}

inline Vec16 rsqrt16(Vec16 v) { return splat(1.f) / sqrt16(v); }

// 1 / (1 + e^-v) from z = e^-|v| in (0, 1]: 1 / (1 + z) where v >= 0, z / (1 + z) below, so nothing
// overflows and the reciprocal's argument is in [1, 2]: on AVX-512 vrcp14ps and one Newton step
// (relative error ~2^-28 before rounding), elsewhere a division. NaN stays NaN.
inline Vec16 sigmoid16(Vec16 v) {
  const Vec16 z = exp_nonpositive(v < 0 ? v : -v), d = splat(1.f) + z;
#ifdef __AVX512F__
  const __m512 r0 = _mm512_rcp14_ps((__m512)d);
  const Vec16 r = (Vec16)_mm512_fmadd_ps(r0, _mm512_fnmadd_ps((__m512)d, r0, _mm512_set1_ps(1.f)), r0);
#else
  const Vec16 r = splat(1.f) / d;
#endif
  const Vec16 s = v < 0 ? z * r : r;
  return v == v ? s : v;
}

// Cephes' tanhf: an odd polynomial below |x| = 0.625, 1 - 2 / (e^2|x| + 1) above (both within ~2 ulp).
inline Vec16 tanh16(Vec16 x) {
  const Vec16 a = x < 0 ? -x : x;
  const Vec16 z = x * x;
  Vec16 p = splat(-5.70498872745e-3f);
  p = p * z + 2.06390887954e-2f;
  p = p * z - 5.37397155531e-2f;
  p = p * z + 1.33314422036e-1f;
  p = p * z - 3.33332819422e-1f;
  const Vec16 small = p * z * x + x;
  Vec16 large = splat(1.f) - splat(2.f) / (exp16(a + a) + 1.f);
  large = x < 0 ? -large : large;
  return a < 0.625f ? small : large;
}

inline Vec16 max16(Vec16 a, Vec16 b) { return (a > b) | (a != a) ? a : b; }

inline Vec16 min16(Vec16 a, Vec16 b) { return (a < b) | (a != a) ? a : b; }

}  // namespace llmc_gen
