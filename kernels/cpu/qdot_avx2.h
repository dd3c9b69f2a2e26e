// The int8-activation GEMM's AVX2 tiles (qdot_gemm.h's qdot_tile takes them for its `vnni` dots on a
// build without AVX512-VNNI; qdot_gemm.cpp has the op and its contract): vpmaddubsw + vpmaddwd dots,
// the scaling in 8-lane vectors, and the batch-1 GEMV over several panels at once.
#pragma once

#include <c10/util/Half.h>

#include <cstdint>

#if defined(__AVX2__) && !defined(__AVX512VNNI__)
#include <immintrin.h>
#endif

#include "panel_tiles.h"
#include "qdot_acts.h"

namespace llmc_qdot {

using llmc_panels::kAhead;
using llmc_panels::kPanel;

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

#if defined(__AVX2__) && !defined(__AVX512VNNI__)
// qdot_tile with AVX2's `vnni` dots (signed: no offset to take out), the scaling in 8-lane vectors too:
// in Vec16s, two AVX2 registers each, GCC moved the block's dots through the stack and general
// registers, 29% of a batch-1 int8 GEMV's perf samples on a Zen 3. PP > 1 only at TT = 1 (a GEMV):
// PP consecutive panels, each block's steps meeting them in turn, so PP weight streams are in
// flight; each panel's sums are made in the order a one-panel tile makes them (a token's result
// does not depend on its batch).
template <int TT, int PP, int Bits, typename Out>
void qdot_tile_avx2(const QActs& x, int64_t t0, const QuadPanels& w, int64_t p, const Out* bias, Out* out,
                    int64_t n_dim) {
  static_assert(PP == 1 || TT == 1, "several panels only in a GEMV");
  const int64_t blocks = w.k_dim / kBlock, per_group = w.group / kBlock, block_bytes = Bits == 8 ? 1024 : 512;
  const int64_t panel_bytes = blocks * block_bytes;
  const uint8_t* codes = w.codes + p * panel_bytes;
  const c10::Half* scales = w.scales + p * w.groups * kPanel;
  const c10::Half* mins = Bits == 4 ? w.mins + p * w.groups * kPanel : nullptr;
  constexpr int kSteps = Bits == 8 ? 8 : 4;
  __m256 acc[PP][TT][4];
  for (int u = 0; u < PP; ++u)
    for (int t = 0; t < TT; ++t)
      for (int q = 0; q < 4; ++q) acc[u][t][q] = _mm256_setzero_ps();
  const int8_t* xrow[TT];
  for (int64_t g = 0; g < w.groups; ++g) {
    __m256 part[PP][TT][4];
    float msum[TT] = {};
    for (int u = 0; u < PP; ++u)
      for (int t = 0; t < TT; ++t)
        for (int q = 0; q < 4; ++q) part[u][t][q] = _mm256_setzero_ps();
    for (int64_t b = g * per_group; b < (g + 1) * per_group; ++b) {
      for (int t = 0; t < TT; ++t) xrow[t] = x.codes + (t0 + t) * w.k_dim + b * kBlock;
      // past its panel's end a stream's prefetch goes on in the next group's panel (PP panels on)
      const int64_t ahead = kAhead + ((b + 1) * block_bytes + kAhead > panel_bytes ? (PP - 1) * panel_bytes : 0);
      __m256i dots[PP][TT][4];
      for (int u = 0; u < PP; ++u)
        for (int t = 0; t < TT; ++t)
          for (int q = 0; q < 4; ++q) dots[u][t][q] = _mm256_setzero_si256();
      for (int s = 0; s < kSteps; ++s)
        for (int u = 0; u < PP; ++u) {
          const uint8_t* c = codes + u * panel_bytes + b * block_bytes + s * 4 * kPanel;
          __builtin_prefetch(c + ahead), __builtin_prefetch(c + 64 + ahead);
          avx2_step<TT, Bits>(c, xrow, s, dots[u]);
        }
      for (int u = 0; u < PP; ++u) {
        if constexpr (Bits == 4)   // the block's int16 sums (avx2_step) in int32
          for (int t = 0; t < TT; ++t)
            for (int q = 0; q < 4; ++q) dots[u][t][q] = _mm256_madd_epi16(dots[u][t][q], _mm256_set1_epi16(1));
        for (int t = 0; t < TT; ++t) {
          const __m256 d = _mm256_set1_ps(x.scales[(t0 + t) * blocks + b]);
          for (int q = 0; q < 4; ++q)
            part[u][t][q] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots[u][t][q]), d, part[u][t][q]);
        }
      }
      if constexpr (Bits == 4)
        for (int t = 0; t < TT; ++t)
          msum[t] += x.scales[(t0 + t) * blocks + b] * static_cast<float>(x.sums[(t0 + t) * blocks + b]);
    }
    for (int u = 0; u < PP; ++u)
      for (int q = 0; q < 4; ++q) {
        const int64_t at = (u * w.groups + g) * kPanel + 8 * q;
        const __m256 sq = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scales + at)));
        for (int t = 0; t < TT; ++t) acc[u][t][q] = _mm256_fmadd_ps(part[u][t][q], sq, acc[u][t][q]);
        if constexpr (Bits == 4) {
          const __m256 mq = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(mins + at)));
          for (int t = 0; t < TT; ++t) acc[u][t][q] = _mm256_fmadd_ps(mq, _mm256_set1_ps(msum[t]), acc[u][t][q]);
        }
      }
  }
  for (int u = 0; u < PP; ++u) llmc_panels::store_tile<TT>(acc[u], bias, out, t0, (p + u) * kPanel, n_dim, n_dim);
}

// Panels an AVX2 batch-1 GEMV meets at once, as measured on a Zen 3 (batch-1 decode steps, one process
// taking turns between the choices): int8 3 (12 int32 sums in registers; 2, 3 and 4 panels took 7.5%, 9%
// and 10% less time than 1), int4 1 (2, 3 or 4 for int4 weights too took 2-3% more time than int4 on 1,
// though their loop spills nothing either; why is not known).
template <int Bits>
constexpr int64_t kGemvPanels = Bits == 8 ? 3 : 1;

// One token times panels begin .. end - 1, up to kGemvPanels<Bits> at a time (panel_tiles.h's gemv_group).
template <int Bits, typename Out>
void qdot_gemv_avx2(const QActs& x, const QuadPanels& w, const Out* bias, Out* out, int64_t n_dim, int64_t begin,
                    int64_t end) {
  if constexpr (kGemvPanels<Bits> == 1) {
    for (int64_t p = begin; p < end; ++p) qdot_tile_avx2<1, 1, Bits>(x, 0, w, p, bias, out, n_dim);
    return;
  }
  for (int64_t p = begin; p < end;) {
    switch (llmc_panels::gemv_group(end - p, kGemvPanels<Bits>)) {
      case 3: qdot_tile_avx2<1, 3, Bits>(x, 0, w, p, bias, out, n_dim); p += 3; break;
      case 2: qdot_tile_avx2<1, 2, Bits>(x, 0, w, p, bias, out, n_dim); p += 2; break;
      default: qdot_tile_avx2<1, 1, Bits>(x, 0, w, p, bias, out, n_dim); p += 1;
    }
  }
}
#endif

}  // namespace llmc_qdot
