// The weight formats of the CPU GEMV (kernels/cpu/gemv.cpp) and the conversions they dequantize
// with: each format gives one row's dequantized 16-lane vectors at an input k, and the scales and
// mins of its groups. Layouts: kernels/quant.py (int8, int4) and gemv.cpp's contract.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "vec16.h"
#ifdef __x86_64__
#include <immintrin.h>
#endif

namespace llmc_gemv {

using llmc_cpu::load16;
using llmc_cpu::splat;
using llmc_cpu::Vec16;

typedef int8_t Int8x16 __attribute__((vector_size(16)));
typedef uint8_t Uint8x16 __attribute__((vector_size(16)));


// a * b + c in one rounding (the build is ISO C++, so the compiler does not contract on its own)
inline Vec16 fma16(Vec16 a, Vec16 b, Vec16 c) {
#ifdef __AVX512F__
  return _mm512_fmadd_ps(a, b, c);
#else
  return a * b + c;
#endif
}

inline float half_to_float(c10::Half h) {
#ifdef __F16C__
  return _cvtsh_ss(h.x);
#else
  return static_cast<float>(h);
#endif
}

// 16 bytes to 16 floats through 32-bit integers (vpmovsxbd / vpmovzxbd + vcvtdq2ps); GCC turns the
// plain vector-extension conversion of signed bytes into scalar code, so AVX-512 says it directly.
inline Vec16 to_float(Int8x16 v) {
#ifdef __AVX512F__
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(reinterpret_cast<__m128i>(v)));
#else
  return __builtin_convertvector(__builtin_convertvector(v, llmc_cpu::Int16), Vec16);
#endif
}

inline Vec16 to_float(Uint8x16 v) {
#ifdef __AVX512F__
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(reinterpret_cast<__m128i>(v)));
#else
  return __builtin_convertvector(__builtin_convertvector(v, llmc_cpu::Int16), Vec16);
#endif
}

// 16 bf16 to fp32 in one zero-extension (vec16.h's load16 takes two halves on GCC 12)
inline Vec16 load_weights16(const float* p) { return load16(p); }
inline Vec16 load_weights16(const c10::BFloat16* p) {
#ifdef __AVX512F__
  __m512i bits = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16);
  return reinterpret_cast<Vec16>(bits);
#else
  return load16(p);
#endif
}

// The fp32 values of `count` (<= 16 used) f16 scales or mins at p, lanes past `count` zero.
inline Vec16 load_halves(const c10::Half* p, int64_t count) {
#ifdef __AVX512F__
  if (count >= 16) return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#endif
  float values[16] = {};
  for (int64_t i = 0; i < std::min<int64_t>(count, 16); ++i) values[i] = half_to_float(p[i]);
  return load16(values);
}

// Lane i of v in every lane.
inline Vec16 lane(Vec16 v, int64_t i) {
#ifdef __AVX512F__
  return _mm512_permutexvar_ps(_mm512_set1_epi32(static_cast<int>(i)), v);
#else
  return splat(v[i]);
#endif
}

// A weight format: kRows rows per pass for one token, kStep inputs per step (kStep / 16 vectors),
// groups of `group` inputs sharing a scale and min; `params16` gives the scales and mins of 16
// groups of a row from group g, and `load` the dequantized vectors of one row at input k (given
// its group's scale and min broadcast).
template <typename T>
struct FloatRows {
  static constexpr int kStep = 16;
  static constexpr int kRows = 8;          // rows per pass for one token (8 streams beat 4 for f32)
  static constexpr bool kFloat = true;
  const T* w;
  int64_t k_dim, group;
  const char* row(int64_t n) const { return reinterpret_cast<const char*>(w + n * k_dim); }
  static int64_t offset(int64_t k) { return k * static_cast<int64_t>(sizeof(T)); }
  void params16(int64_t, int64_t, Vec16& s, Vec16& m) const { s = splat(1.f), m = Vec16{}; }
  void load(const char* row, int64_t k, Vec16, Vec16, Vec16* v) const {
    v[0] = load_weights16(reinterpret_cast<const T*>(row) + k);
  }
  float at(int64_t n, int64_t k) const { return static_cast<float>(w[n * k_dim + k]); }
};

struct Int8Rows {
  static constexpr int kStep = 16;
  static constexpr int kRows = 8;          // (and for int8)
  static constexpr bool kFloat = false;
  const int8_t* codes;
  const c10::Half* scales;
  int64_t k_dim, group, groups;      // groups = K / G
  const char* row(int64_t n) const { return reinterpret_cast<const char*>(codes + n * k_dim); }
  static int64_t offset(int64_t k) { return k; }
  void params16(int64_t n, int64_t g, Vec16& s, Vec16& m) const {
    s = load_halves(scales + n * groups + g, groups - g), m = Vec16{};
  }
  void load(const char* row, int64_t k, Vec16 s, Vec16, Vec16* v) const {
    Int8x16 raw;
    std::memcpy(&raw, row + k, sizeof(raw));
    v[0] = to_float(raw) * s;
  }
  float at(int64_t, int64_t) const { return 0.f; }        // no tail: K is a multiple of G
};

struct Int4Rows {
  static constexpr int kStep = 32;
  static constexpr int kRows = 4;          // 8 rows of nibble-order codes, scales and mins spill registers
  static constexpr bool kFloat = false;
  const uint8_t* codes;
  const c10::Half* scales;
  const c10::Half* mins;
  int64_t k_dim, group, groups;
  const char* row(int64_t n) const { return reinterpret_cast<const char*>(codes + n * (k_dim / 2)); }
  static int64_t offset(int64_t k) { return k / 2; }
  void params16(int64_t n, int64_t g, Vec16& s, Vec16& m) const {
    const int64_t i = n * groups + g;
    s = load_halves(scales + i, groups - g), m = load_halves(mins + i, groups - g);
  }
  void load(const char* row, int64_t k, Vec16 s, Vec16 m, Vec16* v) const {
    Uint8x16 raw;
    std::memcpy(&raw, row + k / 2, sizeof(raw));               // 32 codes: inputs k..k+15 low, k+16..k+31 high
    v[0] = fma16(to_float(raw & 0xF), s, m);
    v[1] = fma16(to_float(raw >> 4), s, m);
  }
  float at(int64_t, int64_t) const { return 0.f; }
};

}  // namespace llmc_gemv
