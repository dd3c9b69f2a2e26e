// The quantized panel GEMM's kernel (qpanel_gemm.cpp has the op and its contract): x widened to
// fp32 once (with int4's per-group sums of x), then tiles of up to kTile tokens x one panel of 32
// outputs, per-group partial sums scaled once per group. widen_rows and qpanel_gemm_range run a
// range of tokens or panels on the calling thread (the op splits them among the intra-op threads,
// a step plan among its team).
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include "kv_rows.h"
#include "panel_tiles.h"

namespace llmc_qpanels {

using llmc_cpu::Vec16;
using llmc_panels::kAhead;
using llmc_panels::kPanel;
using llmc_panels::load16;

// Tokens per tile: 8 accumulators + 8 partial sums + 4 weight vectors in AVX-512's 32 registers; a
// Vec16 is two of AVX2's 16, so 2 tokens there.
constexpr int kTile = llmc_cpu::kAvx512 ? 4 : 2;

using llmc_cpu::load16_half;

// 16 bytes of int4 pairs -> the low nibbles' codes and the high nibbles' codes, as fp32.
inline void load16_nibbles(const uint8_t* p, Vec16& lo, Vec16& hi) {
#ifdef __AVX512F__
  const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  lo = (Vec16)_mm512_cvtepi32_ps(_mm512_and_si512(bytes, _mm512_set1_epi32(15)));
  hi = (Vec16)_mm512_cvtepi32_ps(_mm512_srli_epi32(bytes, 4));
#elif defined(__AVX2__)
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)), nibble = _mm_set1_epi8(15);
  const __m128i low = _mm_and_si128(raw, nibble), high = _mm_and_si128(_mm_srli_epi16(raw, 4), nibble);
  const auto widen = [](__m128i b) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b)); };
  lo = llmc_cpu::join8(widen(low), widen(_mm_srli_si128(low, 8)));
  hi = llmc_cpu::join8(widen(high), widen(_mm_srli_si128(high, 8)));
#else
  float l[16], h[16];
  for (int i = 0; i < 16; ++i) l[i] = static_cast<float>(p[i] & 15), h[i] = static_cast<float>(p[i] >> 4);
  lo = llmc_cpu::load16(l), hi = llmc_cpu::load16(h);
#endif
}

struct QPanels {
  const void* codes;
  const c10::Half* scales;
  const c10::Half* mins;      // int4 only
  int64_t k_dim, group, groups;
};

// One group's partial sums: TT tokens (x0, row stride K, from input k0) times its codes. Inlined,
// so `part` stays in registers (a call kept it in memory: int8 ran 2x slower at 4 tokens).
template <int TT, int Bits>
__attribute__((always_inline)) inline void group_sums(const float* x0, const void* codes, int64_t k0, int64_t group, int64_t k_dim, Vec16 (&part)[TT][2]) {
  for (int t = 0; t < TT; ++t) part[t][0] = part[t][1] = Vec16{};
  if constexpr (Bits == 8) {
    const int8_t* c = static_cast<const int8_t*>(codes) + k0 * kPanel;
    for (int64_t k = k0; k < k0 + group; ++k, c += kPanel) {
      __builtin_prefetch(c + kAhead);
      const Vec16 w0 = llmc_cpu::load16_codes(c), w1 = llmc_cpu::load16_codes(c + 16);
      for (int t = 0; t < TT; ++t) {
        const Vec16 xv = llmc_cpu::splat(x0[t * k_dim + k]);
        part[t][0] += w0 * xv;
        part[t][1] += w1 * xv;
      }
    }
  } else {
    const uint8_t* c = static_cast<const uint8_t*>(codes) + k0 / 2 * kPanel;
    for (int64_t k = k0; k < k0 + group; k += 2, c += kPanel) {
      __builtin_prefetch(c + kAhead);
      Vec16 even[2], odd[2];
      load16_nibbles(c, even[0], odd[0]);
      load16_nibbles(c + 16, even[1], odd[1]);
      for (int t = 0; t < TT; ++t) {
        const Vec16 xe = llmc_cpu::splat(x0[t * k_dim + k]), xo = llmc_cpu::splat(x0[t * k_dim + k + 1]);
        for (int h = 0; h < 2; ++h) part[t][h] += even[h] * xe + odd[h] * xo;
      }
    }
  }
}

// TT tokens times panel p: per group, partial sums scaled once (and int4's min times the group's x sum).
template <int TT, int Bits, typename Out>
void qtile(const float* x0, const float* xsum0, const QPanels& w, int64_t p, const Out* bias, Out* out, int64_t t0,
           int64_t n_dim) {
  const int64_t panel_codes = (Bits == 8 ? w.k_dim : w.k_dim / 2) * kPanel;
  const void* codes = static_cast<const int8_t*>(w.codes) + p * panel_codes;
  const c10::Half* scales = w.scales + p * w.groups * kPanel;
  const c10::Half* mins = Bits == 4 ? w.mins + p * w.groups * kPanel : nullptr;
  Vec16 acc[TT][2], part[TT][2];
  for (int t = 0; t < TT; ++t) acc[t][0] = acc[t][1] = Vec16{};
  for (int64_t g = 0; g < w.groups; ++g) {
    group_sums<TT, Bits>(x0, codes, g * w.group, w.group, w.k_dim, part);
    const Vec16 s[2] = {load16_half(scales + g * kPanel), load16_half(scales + g * kPanel + 16)};
    for (int t = 0; t < TT; ++t)
      for (int h = 0; h < 2; ++h) acc[t][h] += part[t][h] * s[h];
    if constexpr (Bits == 4) {
      const Vec16 m[2] = {load16_half(mins + g * kPanel), load16_half(mins + g * kPanel + 16)};
      for (int t = 0; t < TT; ++t)
        for (int h = 0; h < 2; ++h) acc[t][h] += m[h] * llmc_cpu::splat(xsum0[t * w.groups + g]);
    }
  }
  llmc_panels::store_tile<TT>(acc, bias, out, t0, p * kPanel, n_dim);
}

template <int Bits, typename Out>
void run_tile(const float* x, const float* xsum, const QPanels& w, int64_t p, const Out* bias, Out* out, int64_t t0,
              int64_t tt, int64_t n_dim) {
  const float* x0 = x + t0 * w.k_dim;
  const float* s0 = xsum ? xsum + t0 * w.groups : nullptr;
  switch (tt) {
    case 4: qtile<4, Bits>(x0, s0, w, p, bias, out, t0, n_dim); break;
    case 3: qtile<3, Bits>(x0, s0, w, p, bias, out, t0, n_dim); break;
    case 2: qtile<2, Bits>(x0, s0, w, p, bias, out, t0, n_dim); break;
    default: qtile<1, Bits>(x0, s0, w, p, bias, out, t0, n_dim);
  }
}

// Tokens begin .. end - 1 of x [T, K] widened into xf [T, K] (fp32, exact) and, for int4, each
// group's sum of x, in order, into xsum [T, K/G].
template <typename X>
void widen_rows(const X* x, int64_t k_dim, int64_t group, int bits, float* xf, float* xsum, int64_t begin,
                int64_t end) {
  for (int64_t t = begin; t < end; ++t) {
    for (int64_t j = 0; j < k_dim; ++j) xf[t * k_dim + j] = static_cast<float>(x[t * k_dim + j]);
    if (bits != 4) continue;
    for (int64_t g = 0; g < k_dim / group; ++g) {
      float sum = 0.f;
      for (int64_t j = g * group; j < (g + 1) * group; ++j) sum += xf[t * k_dim + j];
      xsum[t * (k_dim / group) + g] = sum;
    }
  }
}

// out [T, N] columns of panels begin .. end - 1 = widened x times those panels (+ bias).
template <int Bits, typename Out>
void qpanel_gemm_range(const float* x, const float* xsum, const QPanels& w, int64_t tokens, const Out* bias,
                       Out* out, int64_t n_dim, int64_t begin, int64_t end) {
  llmc_panels::walk_tiles(begin, end, tokens, w.k_dim, sizeof(float), kTile, [&](int64_t p, int64_t t0, int64_t tt) {
    run_tile<Bits>(x, xsum, w, p, bias, out, t0, tt, n_dim);
  });
}

}  // namespace llmc_qpanels
