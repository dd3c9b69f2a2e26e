// The int8-activation GEMM's kernel (qdot_gemm.cpp has the op and its contract): x quantized to
// int8 per token per block of 32 inputs (quantize_rows), then tiles of up to kTile tokens x one
// panel of 32 outputs whose lanes are outputs, each block's products summed in int32 (AVX512-VNNI
// vpdpbusd: weight bytes unsigned, activation bytes signed) and scaled once per block, the
// weight's scale once per group. quantize_rows and qdot_gemm_range run a range of tokens or
// panels on the calling thread (the op splits them among the intra-op threads, a step plan among
// its team). Every tile has two builds of its integer part: VNNI (where the build has it) and a
// portable one, chosen per call (`vnni`), so the fallback is tested on every CPU.
#pragma once

#include <c10/util/Half.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include "panel_tiles.h"
#include "vec16.h"

namespace llmc_qdot {

using llmc_cpu::Int16;
using llmc_cpu::Vec16;
using llmc_panels::kAhead;
using llmc_panels::kPanel;

constexpr int64_t kBlock = 32;   // activation inputs per scale (llama.cpp's Q8_0 block)
// Tokens per tile: 8 int32 + 8 fp32 accumulators + 4 weight vectors in AVX-512's 32 registers; a
// Vec16 is two of AVX2's 16, so 2 tokens there.
constexpr int kTile = llmc_cpu::kAvx512 ? 4 : 2;
constexpr int kOffset = 128;     // int8 weight codes are stored as code + 128 (vpdpbusd's unsigned side)

// The build's integer dot products (`vnni` selects them, else the portable ones): AVX512-VNNI's
// vpdpbusd, or AVX2's vpmaddubsw + vpmaddwd (int8 weights signed there, so no pair of products
// saturates the int16 sums: |w| <= 128 times a signed activation, llama.cpp's sign trick).
#if defined(__AVX512VNNI__)
constexpr bool kHaveVnni = true;
constexpr const char* kDotIsa = "avx512-vnni";
#elif defined(__AVX2__)
constexpr bool kHaveVnni = true;
constexpr const char* kDotIsa = "avx2";
#else
constexpr bool kHaveVnni = false;
constexpr const char* kDotIsa = "portable";
#endif

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

// acc lane j += sum over i < 4 of w[4j + i] (unsigned) * x[i] (signed): vpdpbusd, portable.
inline Int16 dot4_portable(Int16 acc, const uint8_t* w, int32_t x4) {
  int8_t x[4];
  std::memcpy(x, &x4, 4);
  for (int j = 0; j < 16; ++j)
    acc[j] += w[4 * j] * x[0] + w[4 * j + 1] * x[1] + w[4 * j + 2] * x[2] + w[4 * j + 3] * x[3];
  return acc;
}

#if defined(__AVX2__) && !defined(__AVX512VNNI__)
// One step of block_dots on AVX2 (4 inputs of int8, 8 of int4, x 32 outputs: 128 code bytes at c)
// into dots [TT][4 vectors of 8 outputs]: vpmaddubsw sums two u8 x s8 products in int16, vpmaddwd
// the two int16 sums in int32. int8 codes (+ 128) become signed w: |w| (u8) times x with w's sign.
// int4's sums stay int16 over the block (vpmaddwd once after its 4 steps, qdot_tile_avx2): 16
// products of a nibble and an activation code (|code| <= 127, quantize_blocks) reach at most
// 16 x 15 x 127 = 30480 < 32767. The batched GEMM's rates on a Zen 3 (int8 ~195, int4 ~245 GFLOP/s)
// matched one vpmaddubsw or vpmaddwd a cycle per core: int4's 3 per 64 products a token become 2.25.
// Each sum is held in its register step by step: GCC otherwise reassociated a block's 8 steps into a
// tree, each step's product stored to the stack and read back (a 1-token int8 GEMV on a Zen 3).
template <int TT, int Bits>
__attribute__((always_inline)) inline void avx2_step(const uint8_t* c, const int8_t* const (&x)[TT], int s,
                                                     __m256i (&dots)[TT][4]) {
  const __m256i ones = _mm256_set1_epi16(1), nibble = _mm256_set1_epi8(15);
  for (int q = 0; q < 4; ++q) {
    const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + 32 * q));
    if constexpr (Bits == 8) {
      const __m256i w = _mm256_xor_si256(bytes, _mm256_set1_epi8(-128)), w_abs = _mm256_abs_epi8(w);
      for (int t = 0; t < TT; ++t) {
        const __m256i xs = _mm256_sign_epi8(_mm256_set1_epi32(quad_at(x[t] + 4 * s)), w);
        dots[t][q] = _mm256_add_epi32(dots[t][q], _mm256_madd_epi16(_mm256_maddubs_epi16(w_abs, xs), ones));
        asm("" : "+x"(dots[t][q]));   // a running sum in a register (see above)
      }
    } else {
      const __m256i lo = _mm256_and_si256(bytes, nibble), hi = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), nibble);
      for (int t = 0; t < TT; ++t) {
        const __m256i x0 = _mm256_set1_epi32(quad_at(x[t] + 8 * s)), x1 = _mm256_set1_epi32(quad_at(x[t] + 8 * s + 4));
        const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(lo, x0), _mm256_maddubs_epi16(hi, x1));
        dots[t][q] = _mm256_add_epi16(dots[t][q], pairs);
        asm("" : "+x"(dots[t][q]));
      }
    }
  }
}
#endif

// One block's integer dot products: TT tokens (codes x[t], from the block's first input) times the
// block's codes c (32 inputs x 32 outputs), into dots[t][half] (int8: still with the + 128 offset).
// AVX2's `vnni` dots are qdot_tile_avx2's, not these.
template <int TT, int Bits, bool Vnni>
__attribute__((always_inline)) inline void block_dots(const uint8_t* c, const int8_t* const (&x)[TT],
                                                      Int16 (&dots)[TT][2]) {
  for (int t = 0; t < TT; ++t) dots[t][0] = dots[t][1] = Int16{};
  constexpr int kSteps = Bits == 8 ? 8 : 4;              // quads (int8) or octets (int4) of inputs
  for (int s = 0; s < kSteps; ++s, c += 4 * kPanel) {
    __builtin_prefetch(c + kAhead), __builtin_prefetch(c + 64 + kAhead);
    uint8_t w[2][2][64];                                   // [half][low, high nibbles]: 16 outputs x 4 inputs
#ifdef __AVX512VNNI__
    if constexpr (Vnni) {
      __m512i wv[2][2];
      for (int h = 0; h < 2; ++h) {
        const __m512i bytes = _mm512_loadu_si512(c + 64 * h);
        wv[h][0] = Bits == 8 ? bytes : _mm512_and_si512(bytes, _mm512_set1_epi8(15));
        wv[h][1] = Bits == 8 ? bytes : _mm512_and_si512(_mm512_srli_epi16(bytes, 4), _mm512_set1_epi8(15));
      }
      for (int t = 0; t < TT; ++t)
        for (int n = 0; n < (Bits == 8 ? 1 : 2); ++n) {
          const __m512i xb = _mm512_set1_epi32(quad_at(x[t] + s * (Bits == 8 ? 4 : 8) + 4 * n));
          for (int h = 0; h < 2; ++h)
            dots[t][h] = (Int16)_mm512_dpbusd_epi32((__m512i)dots[t][h], wv[h][n], xb);
        }
      continue;
    }
#endif
    for (int h = 0; h < 2; ++h)
      for (int i = 0; i < 64; ++i) {
        const uint8_t byte = c[64 * h + i];
        w[h][0][i] = Bits == 8 ? byte : byte & 15;
        w[h][1][i] = byte >> 4;
      }
    for (int t = 0; t < TT; ++t)
      for (int n = 0; n < (Bits == 8 ? 1 : 2); ++n)
        for (int h = 0; h < 2; ++h)
          dots[t][h] = dot4_portable(dots[t][h], w[h][n], quad_at(x[t] + s * (Bits == 8 ? 4 : 8) + 4 * n));
  }
}

using llmc_cpu::load16_half;

#if defined(__AVX2__) && !defined(__AVX512VNNI__)
// qdot_tile with AVX2's `vnni` dots (signed: no offset to take out), the scaling in 8-lane vectors too:
// in Vec16s, two AVX2 registers each, GCC moved the block's dots through the stack and general
// registers, 29% of a batch-1 int8 GEMV's perf samples on a Zen 3.
template <int TT, int Bits, typename Out>
void qdot_tile_avx2(const QActs& x, int64_t t0, const QuadPanels& w, int64_t p, const Out* bias, Out* out,
                    int64_t n_dim) {
  const int64_t blocks = w.k_dim / kBlock, per_group = w.group / kBlock, block_bytes = Bits == 8 ? 1024 : 512;
  const uint8_t* codes = w.codes + p * blocks * block_bytes;
  const c10::Half* scales = w.scales + p * w.groups * kPanel;
  const c10::Half* mins = Bits == 4 ? w.mins + p * w.groups * kPanel : nullptr;
  constexpr int kSteps = Bits == 8 ? 8 : 4;
  __m256 acc[TT][4];
  for (int t = 0; t < TT; ++t)
    for (int q = 0; q < 4; ++q) acc[t][q] = _mm256_setzero_ps();
  const int8_t* xrow[TT];
  for (int64_t g = 0; g < w.groups; ++g) {
    __m256 part[TT][4];
    float msum[TT] = {};
    for (int t = 0; t < TT; ++t)
      for (int q = 0; q < 4; ++q) part[t][q] = _mm256_setzero_ps();
    for (int64_t b = g * per_group; b < (g + 1) * per_group; ++b) {
      for (int t = 0; t < TT; ++t) xrow[t] = x.codes + (t0 + t) * w.k_dim + b * kBlock;
      __m256i dots[TT][4];
      for (int t = 0; t < TT; ++t)
        for (int q = 0; q < 4; ++q) dots[t][q] = _mm256_setzero_si256();
      const uint8_t* c = codes + b * block_bytes;
      for (int s = 0; s < kSteps; ++s, c += 4 * kPanel) {
        __builtin_prefetch(c + kAhead), __builtin_prefetch(c + 64 + kAhead);
        avx2_step<TT, Bits>(c, xrow, s, dots);
      }
      if constexpr (Bits == 4)   // the block's int16 sums (avx2_step) in int32
        for (int t = 0; t < TT; ++t)
          for (int q = 0; q < 4; ++q) dots[t][q] = _mm256_madd_epi16(dots[t][q], _mm256_set1_epi16(1));
      for (int t = 0; t < TT; ++t) {
        const float d = x.scales[(t0 + t) * blocks + b];
        for (int q = 0; q < 4; ++q)
          part[t][q] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots[t][q]), _mm256_set1_ps(d), part[t][q]);
        if constexpr (Bits == 4) msum[t] += d * static_cast<float>(x.sums[(t0 + t) * blocks + b]);
      }
    }
    for (int q = 0; q < 4; ++q) {
      const __m256 sq = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scales + g * kPanel + 8 * q)));
      for (int t = 0; t < TT; ++t) acc[t][q] = _mm256_fmadd_ps(part[t][q], sq, acc[t][q]);
      if constexpr (Bits == 4) {
        const __m256 mq = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(mins + g * kPanel + 8 * q)));
        for (int t = 0; t < TT; ++t) acc[t][q] = _mm256_fmadd_ps(mq, _mm256_set1_ps(msum[t]), acc[t][q]);
      }
    }
  }
  llmc_panels::store_tile<TT>(acc, bias, out, t0, p * kPanel, n_dim, n_dim);
}
#endif

// TT tokens from t0 times panel p: per block, the int32 dots (int8: less 128 x the block's code
// sum) in fp32 times the block's scale; per group those partial sums times the group's scales,
// and int4's mins times the group's sum of d x codes.
template <int TT, int Bits, bool Vnni, typename Out>
void qdot_tile(const QActs& x, int64_t t0, const QuadPanels& w, int64_t p, const Out* bias, Out* out,
               int64_t n_dim) {
#if defined(__AVX2__) && !defined(__AVX512VNNI__)
  if constexpr (Vnni) return qdot_tile_avx2<TT, Bits>(x, t0, w, p, bias, out, n_dim);
#endif
  const int64_t blocks = w.k_dim / kBlock, per_group = w.group / kBlock, block_bytes = Bits == 8 ? 1024 : 512;
  const uint8_t* codes = w.codes + p * blocks * block_bytes;
  const c10::Half* scales = w.scales + p * w.groups * kPanel;
  const c10::Half* mins = Bits == 4 ? w.mins + p * w.groups * kPanel : nullptr;
  constexpr bool kOffsetDots = Bits == 8;   // AVX2's signed `vnni` dots never get here
  Vec16 acc[TT][2], part[TT][2];
  for (int t = 0; t < TT; ++t) acc[t][0] = acc[t][1] = Vec16{};
  const int8_t* xrow[TT];
  for (int64_t g = 0; g < w.groups; ++g) {
    float msum[TT] = {};
    for (int t = 0; t < TT; ++t) part[t][0] = part[t][1] = Vec16{};
    for (int64_t b = g * per_group; b < (g + 1) * per_group; ++b) {
      for (int t = 0; t < TT; ++t) xrow[t] = x.codes + (t0 + t) * w.k_dim + b * kBlock;
      Int16 dots[TT][2];
      block_dots<TT, Bits, Vnni>(codes + b * block_bytes, xrow, dots);
      for (int t = 0; t < TT; ++t) {
        const float d = x.scales[(t0 + t) * blocks + b];
        const int32_t sum = x.sums[(t0 + t) * blocks + b];
        for (int h = 0; h < 2; ++h)
          part[t][h] += __builtin_convertvector(kOffsetDots ? dots[t][h] - kOffset * sum : dots[t][h], Vec16) *
                        llmc_cpu::splat(d);
        if constexpr (Bits == 4) msum[t] += d * static_cast<float>(sum);
      }
    }
    const Vec16 s[2] = {load16_half(scales + g * kPanel), load16_half(scales + g * kPanel + 16)};
    for (int t = 0; t < TT; ++t)
      for (int h = 0; h < 2; ++h) acc[t][h] += part[t][h] * s[h];
    if constexpr (Bits == 4) {
      const Vec16 m[2] = {load16_half(mins + g * kPanel), load16_half(mins + g * kPanel + 16)};
      for (int t = 0; t < TT; ++t)
        for (int h = 0; h < 2; ++h) acc[t][h] += m[h] * llmc_cpu::splat(msum[t]);
    }
  }
  llmc_panels::store_tile<TT>(acc, bias, out, t0, p * kPanel, n_dim);
}

template <int Bits, bool Vnni, typename Out>
void run_tile(const QActs& x, int64_t t0, int64_t tt, const QuadPanels& w, int64_t p, const Out* bias, Out* out,
              int64_t n_dim) {
  switch (tt) {
    case 4: qdot_tile<4, Bits, Vnni>(x, t0, w, p, bias, out, n_dim); break;
    case 3: qdot_tile<3, Bits, Vnni>(x, t0, w, p, bias, out, n_dim); break;
    case 2: qdot_tile<2, Bits, Vnni>(x, t0, w, p, bias, out, n_dim); break;
    default: qdot_tile<1, Bits, Vnni>(x, t0, w, p, bias, out, n_dim);
  }
}

// out [T, N] columns of panels begin .. end - 1 = quantized x times those panels (+ bias), through
// VNNI where `vnni` (and the build has it), else the portable integer dots.
template <int Bits, typename Out>
void qdot_gemm_range(const QActs& x, const QuadPanels& w, int64_t tokens, const Out* bias, Out* out, int64_t n_dim,
                     int64_t begin, int64_t end, bool vnni) {
  llmc_panels::walk_tiles(begin, end, tokens, w.k_dim, 1, kTile, [&](int64_t p, int64_t t0, int64_t tt) {
    if (vnni && kHaveVnni)
      run_tile<Bits, true>(x, t0, tt, w, p, bias, out, n_dim);
    else
      run_tile<Bits, false>(x, t0, tt, w, p, bias, out, n_dim);
  });
}

}  // namespace llmc_qdot
