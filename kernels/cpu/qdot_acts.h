// The int8-activation GEMM's operands (qdot_gemm.h has its kernel, qdot_gemm.cpp the op and its
// contract): x quantized to int8 per token per block of 32 inputs (quantize_blocks, quantize_rows) as
// QActs, and the weight's codes in quads (QuadPanels, quad_weights.h).
#pragma once

#include <c10/util/Half.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include "vec16.h"

namespace llmc_qdot {

using llmc_cpu::Vec16;

constexpr int64_t kBlock = 32;   // activation inputs per scale (llama.cpp's Q8_0 block)

// The quantized activations of a call: codes [T, K], per block of 32 its scale and its codes' sum.
struct QActs {
  int8_t* codes;
  float* scales;      // [T, K/32]
  int32_t* sums;      // [T, K/32]
  int64_t k_dim;
};

// Bytes of scratch QActs needs per token.
inline int64_t qacts_bytes_per_row(int64_t k_dim) { return k_dim + k_dim / kBlock * 8; }

// QActs laid out in `scratch` (at least qacts_bytes_per_row(K) * rows bytes, 4-byte aligned).
inline QActs qacts_in(char* scratch, int64_t rows, int64_t k_dim) {
  const int64_t blocks = rows * (k_dim / kBlock);
  float* scales = reinterpret_cast<float*>(scratch);
  int32_t* sums = reinterpret_cast<int32_t*>(scales + blocks);
  return {reinterpret_cast<int8_t*>(sums + blocks), scales, sums, k_dim};
}

#if defined(__AVX2__) && !defined(__AVX512F__)
// 8 inputs from p as fp32 (a bf16 is the top half of an fp32).
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {
  const __m256i halves = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(halves, 16));
}

inline float hmax8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

inline int32_t hsum8(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1)));
}
#endif

// Blocks first .. last - 1 of x [T, K] (block i: token i / (K/32), its inputs 32 (i % (K/32)) on):
// d = max|x| / 127 and codes round(x * (1/d)) (nearest, ties to even; all 0 where d is 0), and the
// codes' sum. A range of blocks, not of tokens, so a team splits one token's blocks too (batch 1).
template <typename X>
void quantize_blocks(const X* x, const QActs& q, int64_t first, int64_t last) {
  for (int64_t i = first; i < last; ++i) {
    const X* v = x + i * kBlock;                   // x [T, K] is the blocks [T * K/32, 32] in order
    int8_t* codes = q.codes + i * kBlock;
#ifdef __AVX512F__
    const Vec16 v0 = llmc_cpu::load16(v), v1 = llmc_cpu::load16(v + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps((__m512)v0), _mm512_abs_ps((__m512)v1)));
    const float d = amax / 127.f, inv = d != 0.f ? 1.f / d : 0.f;
    // vcvtps2dq rounds as MXCSR says: to nearest, ties to even (std::nearbyint's default mode)
    const __m512i c0 = _mm512_cvtps_epi32((__m512)(v0 * inv)), c1 = _mm512_cvtps_epi32((__m512)(v1 * inv));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(codes), _mm512_cvtepi32_epi8(c0));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + 16), _mm512_cvtepi32_epi8(c1));
    q.sums[i] = _mm512_reduce_add_epi32(_mm512_add_epi32(c0, c1));
#elif defined(__AVX2__)
    __m256 part[4], amax = _mm256_setzero_ps();
    for (int j = 0; j < 4; ++j) {
      part[j] = load8(v + 8 * j);
      amax = _mm256_max_ps(amax, _mm256_andnot_ps(_mm256_set1_ps(-0.f), part[j]));
    }
    const float d = hmax8(amax) / 127.f, inv = d != 0.f ? 1.f / d : 0.f;
    __m256i c[4], sum = _mm256_setzero_si256();
    for (int j = 0; j < 4; ++j) {   // vcvtps2dq: to nearest, ties to even, as std::nearbyint
      c[j] = _mm256_cvtps_epi32(_mm256_mul_ps(part[j], _mm256_set1_ps(inv)));
      sum = _mm256_add_epi32(sum, c[j]);
    }
    // packs interleave 128-bit lanes: 32-bit groups 0 4 1 5 2 6 3 7 hold codes 0-3, 16-19, 4-7, ... in order
    const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]), _mm256_packs_epi32(c[2], c[3]));
    const __m256i ordered = _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes), ordered);
    q.sums[i] = hsum8(sum);
#else
    float amax = 0.f;
    for (int64_t j = 0; j < kBlock; ++j) amax = std::fmax(amax, std::fabs(static_cast<float>(v[j])));
    const float d = amax / 127.f, inv = d != 0.f ? 1.f / d : 0.f;
    int32_t sum = 0;
    for (int64_t j = 0; j < kBlock; ++j) {
      codes[j] = static_cast<int8_t>(std::nearbyint(static_cast<float>(v[j]) * inv));
      sum += codes[j];
    }
    q.sums[i] = sum;
#endif
    q.scales[i] = d;
  }
}

// Tokens begin .. end - 1 of x [T, K], each block as quantize_blocks.
template <typename X>
void quantize_rows(const X* x, const QActs& q, int64_t begin, int64_t end) {
  quantize_blocks(x, q, begin * (q.k_dim / kBlock), end * (q.k_dim / kBlock));
}

struct QuadPanels {
  const uint8_t* codes;       // int8: [P, K/4, 32, 4] (code + 128); int4: [P, K/8, 32, 4] (nibbles)
  const c10::Half* scales;    // [P, K/G, 32]
  const c10::Half* mins;      // int4 only
  int64_t k_dim, group, groups;
};

// The 4 activation codes from `p` as one int32 (vpdpbusd's broadcast operand).
inline int32_t quad_at(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

}  // namespace llmc_qdot
