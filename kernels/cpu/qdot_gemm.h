// The int8-activation GEMM's kernel (qdot_gemm.cpp has the op and its contract): x quantized to
// int8 per token per block of 32 inputs (quantize_rows), then tiles of up to kTile tokens x one
// panel of 32 outputs whose lanes are outputs, each block's products summed in int32 (AVX512-VNNI
// vpdpbusd: weight bytes unsigned, activation bytes signed) and scaled once per block, the
// weight's scale once per group. quantize_rows and qdot_gemm_range run a range of tokens or
// panels on the calling thread (the op splits them among the intra-op threads, a step plan among
// its team). Every tile has two builds of its integer part: VNNI (where the build has it) and a
// portable one, chosen per call (`vnni`), so the fallback is tested on every CPU. qdot_acts.h has
// x's quantization, qdot_avx2.h AVX2's `vnni` tiles and its batch-1 GEMV over several panels.
#pragma once

#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include "panel_tiles.h"
#include "qdot_acts.h"
#include "qdot_avx2.h"
#include "vec16.h"

namespace llmc_qdot {

using llmc_cpu::Int16;
using llmc_cpu::Vec16;
using llmc_panels::kAhead;
using llmc_panels::kPanel;

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

// acc lane j += sum over i < 4 of w[4j + i] (unsigned) * x[i] (signed): vpdpbusd, portable.
inline Int16 dot4_portable(Int16 acc, const uint8_t* w, int32_t x4) {
  int8_t x[4];
  std::memcpy(x, &x4, 4);
  for (int j = 0; j < 16; ++j)
    acc[j] += w[4 * j] * x[0] + w[4 * j + 1] * x[1] + w[4 * j + 2] * x[2] + w[4 * j + 3] * x[3];
  return acc;
}

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

// TT tokens from t0 times panel p: per block, the int32 dots (int8: less 128 x the block's code
// sum) in fp32 times the block's scale; per group those partial sums times the group's scales,
// and int4's mins times the group's sum of d x codes.
template <int TT, int Bits, bool Vnni, typename Out>
void qdot_tile(const QActs& x, int64_t t0, const QuadPanels& w, int64_t p, const Out* bias, Out* out,
               int64_t n_dim) {
#if defined(__AVX2__) && !defined(__AVX512VNNI__)
  if constexpr (Vnni) return qdot_tile_avx2<TT, 1, Bits>(x, t0, w, p, bias, out, n_dim);
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
#if defined(__AVX2__) && !defined(__AVX512VNNI__)
  if (tokens == 1 && vnni) return qdot_gemv_avx2<Bits>(x, w, bias, out, n_dim, begin, end);
#endif
  llmc_panels::walk_tiles(begin, end, tokens, w.k_dim, 1, kTile, [&](int64_t p, int64_t t0, int64_t tt) {
    if (vnni && kHaveVnni)
      run_tile<Bits, true>(x, t0, tt, w, p, bias, out, n_dim);
    else
      run_tile<Bits, false>(x, t0, tt, w, p, bias, out, n_dim);
  });
}

}  // namespace llmc_qdot
