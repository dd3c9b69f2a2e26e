// Rows of the paged KV cache, read as and written from fp32, for the three cache types:
//   float, bfloat16  one row of D elements per (token, KV head)
//   int8_t           D codes then the row's fp32 scale in its last 4 bytes (kernels/quant.py):
//                    scale = amax(|x|) / 127, code = rint(x / scale) clamped to [-127, 127]
//                    (all 0 for a zero row), read back as code * scale in fp32.
//
//   row_elems<C>(d)          elements of C per cache row
//   widen_row(row, d, dst)   a cache row as d floats (int8: dequantized)
//   store_row(x, d, row)     d floats into a cache row (bf16: rounded; int8: quantized)
// D must be a multiple of 16.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include "vec16.h"

namespace llmc_cpu {

typedef int8_t Byte16 __attribute__((vector_size(16)));

constexpr int64_t kScaleBytes = 4;
constexpr float kInt8Max = 127.f;

template <typename C>
constexpr int64_t row_elems(int64_t d) {
  return std::is_same_v<C, int8_t> ? d + kScaleBytes : d;
}

inline float row_scale(const int8_t* row, int64_t d) {
  float scale;
  std::memcpy(&scale, row + d, sizeof(scale));
  return scale;
}

// 16 int8 codes widened to fp32 (exact). GCC 12 turns the vector conversion into 16 scalar
// ones, so AVX-512 CPUs take vpmovsxbd + vcvtdq2ps.
inline Vec16 load16_codes(const int8_t* p) {
#ifdef __AVX512F__
  return (Vec16)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#elif defined(__AVX2__)
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return join8(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(raw)),
               _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(raw, 8))));
#else
  Byte16 raw;
  std::memcpy(&raw, p, sizeof(raw));
  return __builtin_convertvector(raw, Vec16);
#endif
}

// 8 int8 codes widened to fp32 (exact): load16_codes' lanes on an 8-lane vector.
inline Vec8 load8_codes(const int8_t* p) {
#if defined(__AVX2__)
  return (Vec8)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
#else
  typedef int8_t Byte8 __attribute__((vector_size(8)));
  Byte8 raw;
  std::memcpy(&raw, p, sizeof(raw));
  return __builtin_convertvector(raw, Vec8);
#endif
}

// In 8-lane vectors where the build has no AVX-512 (GCC took AVX2's 16-lane bf16 and int8 widening
// through general registers).
template <typename C>
inline void widen_row(const C* row, int64_t d, float* dst) {
#if defined(__AVX512F__)
  for (int64_t j = 0; j < d; j += 16) store16(dst + j, load16(row + j));
#else
  for (int64_t j = 0; j < d; j += 8) store8(dst + j, load8(row + j));
#endif
}

inline void widen_row(const int8_t* row, int64_t d, float* dst) {
#if defined(__AVX512F__)
  const Vec16 scale = splat(row_scale(row, d));
  for (int64_t j = 0; j < d; j += 16) store16(dst + j, load16_codes(row + j) * scale);
#else
  const Vec8 scale = splat8(row_scale(row, d));
  for (int64_t j = 0; j < d; j += 8) store8(dst + j, load8_codes(row + j) * scale);
#endif
}

template <typename C>
inline void store_row(const float* x, int64_t d, C* row) {
  for (int64_t j = 0; j < d; j += 16) store16(row + j, load16(x + j));
}

// quantize_kv_rows's rule, bit for bit: fp32 amax, fp32 division, round half to even.
inline void store_row(const float* x, int64_t d, int8_t* row) {
  Vec16 amax{};
  for (int64_t j = 0; j < d; j += 16) {
    const Vec16 v = load16(x + j);
    amax = vmax(amax, v < 0 ? -v : v);
  }
  const float scale = hmax(amax) / kInt8Max;
  for (int64_t j = 0; j < d; ++j)
    row[j] = scale > 0 ? static_cast<int8_t>(std::clamp(std::nearbyint(x[j] / scale), -kInt8Max, kInt8Max)) : 0;
  std::memcpy(row + d, &scale, sizeof(scale));
}

}  // namespace llmc_cpu
