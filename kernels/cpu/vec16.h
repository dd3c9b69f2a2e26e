// 16-lane fp32 vectors for the CPU kernels, written with GCC/Clang vector extensions, so the
// compiler emits AVX-512, AVX2 or NEON code for whatever machine builds them (-march=native).
//
//   Vec16          16 floats
//   load16(p)      16 elements of float or bfloat16 at p, widened to fp32
//   load16_half(p) 16 f16 values at p widened to fp32 (exact)
//   store16(p, v)  16 floats to float or bfloat16 (round to nearest even; AVX512_BF16: fp32 subnormals
//                  flushed to 0) at p
//   hsum / hmax    horizontal sum / max
//   exp16(v)       e^v per lane, relative error ~2e-7; lanes below -87.3 give 0
//   exp_nonpositive(v)  e^v for v <= 0 (0 below 2^-125: never a subnormal), ~2e-7; half exp16's
//                  instructions on AVX-512 (pow2_of: 2^t)
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) || defined(__AVX__) || defined(__F16C__)
#include <immintrin.h>
#endif

namespace llmc_cpu {

#if defined(__AVX512F__)
constexpr bool kAvx512 = true;    // a Vec16 is one register (else two AVX2 ones, or four NEON ones)
#else
constexpr bool kAvx512 = false;
#endif

typedef float Vec16 __attribute__((vector_size(64)));
typedef int32_t Int16 __attribute__((vector_size(64)));
typedef uint32_t Uint16 __attribute__((vector_size(64)));
typedef uint16_t Half16 __attribute__((vector_size(32)));

// 8 floats, one AVX2 register: the register blocks of kernels built without AVX-512 are made of
// these (a Vec16 is two registers there, and blocks of Vec16s sized for AVX-512's 32 registers
// spilled out of AVX2's 16).
typedef float Vec8 __attribute__((vector_size(32)));
typedef uint32_t Uint8 __attribute__((vector_size(32)));
typedef uint16_t Half8 __attribute__((vector_size(16)));

// x in every lane. Not `Vec16{} + x`: GCC keeps that add (0 + -0 is +0), so a tile's every
// broadcast cost an add and a register shuffle on the FMA ports, which halved the fp32 GEMM.
inline Vec16 splat(float x) {
#ifdef __AVX512F__
  return (Vec16)_mm512_set1_ps(x);  // vbroadcastss from memory: a load, no arithmetic port
#else
  return Vec16{x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x};
#endif
}

// x in every lane of a Vec8 (vbroadcastss where the build has AVX).
inline Vec8 splat8(float x) {
#if defined(__AVX__)
  return (Vec8)_mm256_set1_ps(x);
#else
  return Vec8{x, x, x, x, x, x, x, x};
#endif
}

inline Vec8 load8(const float* p) {
  Vec8 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline Vec8 load8(const c10::BFloat16* p) {
  Half8 raw;
  std::memcpy(&raw, p, sizeof(raw));
  Uint8 bits = __builtin_convertvector(raw, Uint8) << 16;  // bf16 is the top half of an fp32
  Vec8 v;
  std::memcpy(&v, &bits, sizeof(v));
  return v;
}

inline void store8(float* p, Vec8 v) { std::memcpy(p, &v, sizeof(v)); }

inline Vec16 load16(const float* p) {
  Vec16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline Vec16 load16(const c10::BFloat16* p) {
#ifdef __AVX512F__  // GCC 12 widens the vector in two 256-bit halves: 5 instructions, not 2
  return (Vec16)_mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
#else
  Half16 raw;
  std::memcpy(&raw, p, sizeof(raw));
  Uint16 bits = __builtin_convertvector(raw, Uint16) << 16;  // bf16 is the top half of an fp32
  Vec16 v;
  std::memcpy(&v, &bits, sizeof(v));
  return v;
#endif
}

#if defined(__AVX2__) && !defined(__AVX512F__)
// Two AVX2 vectors as one Vec16: lanes 0-7, then 8-15. (GCC turns a byte vector's
// __builtin_convertvector to a 16-lane float vector into 16 scalar conversions on AVX2.)
inline Vec16 join8(__m256 lo, __m256 hi) {
  const __m256 halves[2] = {lo, hi};
  Vec16 v;
  std::memcpy(&v, halves, sizeof(v));
  return v;
}
#endif

// One vcvtph2ps (AVX-512), two (F16C); sixteen scalar conversions through memory were most of a
// batch-1 int4 GEMV's instructions (4 vectors of them a block of 512 code bytes).
inline Vec16 load16_half(const c10::Half* p) {
#if defined(__AVX512F__)
  return (Vec16)_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#elif defined(__F16C__)
  const __m256 halves[2] = {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
                            _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)))};
  Vec16 v;
  std::memcpy(&v, halves, sizeof(v));   // not join8: F16C without AVX2 exists
  return v;
#else
  float tmp[16];
  for (int i = 0; i < 16; ++i) tmp[i] = static_cast<float>(p[i]);
  return load16(tmp);
#endif
}

inline void store16(float* p, Vec16 v) { std::memcpy(p, &v, sizeof(v)); }

// Rounded to nearest even: by vcvtneps2bf16 where the CPU has AVX512_BF16 (one instruction; it
// flushes fp32 subnormals, below 2^-126, to zero), elsewhere by integer arithmetic on the bits.
inline void store16(c10::BFloat16* p, Vec16 v) {
#ifdef __AVX512BF16__
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh((__m512)v));
#else
  Uint16 bits;
  std::memcpy(&bits, &v, sizeof(bits));
  bits += 0x7FFFu + ((bits >> 16) & 1u);
  Half16 raw = __builtin_convertvector(bits >> 16, Half16);
  std::memcpy(p, &raw, sizeof(raw));
#endif
}

// Lane i + shift (mod 16) moved to lane i: the steps of a log2(16)-deep reduction tree.
inline Vec16 rotate8(Vec16 v) { return __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7); }
inline Vec16 rotate4(Vec16 v) { return __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11); }
inline Vec16 rotate2(Vec16 v) { return __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13); }
inline Vec16 rotate1(Vec16 v) { return __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14); }

inline float hsum(Vec16 v) {
  v += rotate8(v);
  v += rotate4(v);
  v += rotate2(v);
  v += rotate1(v);
  return v[0];
}

// Lanewise a > b ? a : b (b where either is NaN). On AVX2 two vmaxps: GCC took the 16-lane select
// apart into scalar vmaxss through the stack there (most of a prompt attention tile's softmax).
inline Vec16 vmax(Vec16 a, Vec16 b) {
#if defined(__AVX2__) && !defined(__AVX512F__)
  __m256 x[2], y[2];
  std::memcpy(x, &a, sizeof(a));
  std::memcpy(y, &b, sizeof(b));
  return join8(_mm256_max_ps(x[0], y[0]), _mm256_max_ps(x[1], y[1]));
#else
  return a > b ? a : b;
#endif
}

inline float hmax(Vec16 v) {
  v = vmax(v, rotate8(v));
  v = vmax(v, rotate4(v));
  v = vmax(v, rotate2(v));
  v = vmax(v, rotate1(v));
  return v[0];
}

inline Vec16 exp16(Vec16 x) {
  const Vec16 lo = splat(-87.3f), hi = splat(88.3f);
  Int16 underflow = x < lo;
  x = x < lo ? lo : x;
  x = x > hi ? hi : x;
  // e^x = 2^n * e^r with n = round(x / ln 2), |r| <= ln2 / 2
  Vec16 n = x * 1.44269504088896341f;
  n = __builtin_convertvector(__builtin_convertvector(n + (Vec16)(n >= 0 ? splat(0.5f) : splat(-0.5f)), Int16), Vec16);
  Vec16 r = x - n * 0.693359375f + n * 2.12194440e-4f;
  Vec16 p = splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  Int16 scale = (__builtin_convertvector(n, Int16) + 127) << 23;
  Vec16 two_n;
  std::memcpy(&two_n, &scale, sizeof(two_n));
  Vec16 out = p * two_n;
  return underflow ? splat(0.f) : out;
}

// 2^f for |f| <= 1/2, Horner's coefficients from the highest power: pow2_of's polynomial on either ISA.
constexpr float kPow2Poly[] = {1.326472708006744e-3f, 9.671512862236187e-3f, 5.5507337456463635e-2f,
                               0.24022242081842402f, 0.6931469775965883f, 1.f};

#ifdef __AVX512F__
// 2^t = 2^f * 2^n, |f| <= 1/2: a degree-5 polynomial for 2^f (fitted for relative error, 1.9e-7
// in fp32) and vscalefps for 2^n. Lanes below -125 (-inf, NaN) give 0 by the scale's zero mask,
// never a subnormal: a subnormal result takes a microcode assist, which made a tile whose keys were
// half masked ten times as slow.
inline __m512 pow2_of(__m512 t) {
  const __mmask16 live = _mm512_cmp_ps_mask(t, _mm512_set1_ps(-125.f), _CMP_GE_OQ);
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);           // NaN where t is -inf or NaN: those lanes are masked
  __m512 p = _mm512_set1_ps(kPow2Poly[0]);
  for (int i = 1; i < 6; ++i) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(kPow2Poly[i]));
  return _mm512_maskz_scalef_ps(live, p, n);
}

inline Vec16 pow2_lanes(Vec16 t) { return (Vec16)pow2_of((__m512)t); }
#elif defined(__AVX2__)
// pow2_of's arithmetic on an AVX2 register, for t < 128: the same polynomial and FMAs, 2^n made in
// the exponent bits (n >= -125 in a live lane, a normal number, so p x 2^n is exact, as vscalefps'
// result is), lanes below -125 (-inf, NaN) 0. exp16 took three times the instructions on AVX2 (GCC
// moves some of its 16-lane steps through scalar registers there).
inline __m256 pow2_of(__m256 t) {
  const __m256 live = _mm256_cmp_ps(t, _mm256_set1_ps(-125.f), _CMP_GE_OQ);
  const __m256 n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(t, n);           // NaN where t is -inf or NaN: those lanes are masked
  __m256 p = _mm256_set1_ps(kPow2Poly[0]);
  for (int i = 1; i < 6; ++i) p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(kPow2Poly[i]));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(live, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

// 2^t per lane (t < 128): pow2_of on each half.
inline Vec16 pow2_lanes(Vec16 t) {
  __m256 halves[2];
  std::memcpy(halves, &t, sizeof(t));
  return join8(pow2_of(halves[0]), pow2_of(halves[1]));
}
#endif

// e^x for x <= 0 (-inf and NaN give 0, as does any e^x below 2^-125), relative error ~2e-7. With
// AVX-512 or AVX2 pow2_lanes(x log2 e), about half the instructions of exp16, which other CPUs use.
inline Vec16 exp_nonpositive(Vec16 x) {
#if defined(__AVX512F__) || defined(__AVX2__)
  return pow2_lanes(x * 1.44269504088896341f);
#else
  return exp16(x);
#endif
}

}  // namespace llmc_cpu
