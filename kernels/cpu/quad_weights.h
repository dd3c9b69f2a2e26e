// A quads weight (qdot_gemm.cpp's layout) read back as fp32 weights, 4 inputs x a vector of outputs at a
// time: what the GEMMs that dequantize a panel before multiplying it share (amx_dequant_gemm.h into
// bf16 pairs, f32_dequant_gemm.h into fp32 panels). w = scale x code in fp32 (int8: the stored byte
// less 128, exact), int4: scale x nibble + min (the product exact, the sum rounded once): kernels/
// quant.py's dequantize_weight.
#pragma once

#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>

#if defined(__F16C__)
#include <immintrin.h>
#endif

#include "qdot_gemm.h"
#include "vec16.h"

namespace llmc_quads {

using llmc_panels::kPanel;
using llmc_qdot::QuadPanels;

constexpr int64_t kQuadRow = kPanel * 4;       // bytes of a quad (int8) or octet (int4) row of a panel

// The f16 values at p widened to fp32, as many as V has lanes (16, or AVX2's 8).
template <typename V>
inline V load_half_lanes(const c10::Half* p) {
  if constexpr (sizeof(V) == sizeof(llmc_cpu::Vec16)) {
    return llmc_cpu::load16_half(p);
  } else {
    static_assert(sizeof(V) == 32, "8 or 16 lanes");
#if defined(__F16C__)
    return (V)_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
    float tmp[8];
    for (int i = 0; i < 8; ++i) tmp[i] = static_cast<float>(p[i]);
    V v;
    std::memcpy(&v, tmp, sizeof(v));
    return v;
#endif
  }
}

// Panel p of `w` read in order: fn(k, c0, w0, w1, w2, w3) with wr the weights of input k + r of the
// panel's outputs c0 .. c0 + lanes(V) - 1, for every fourth input k and every c0. V a vector of 16
// floats, or of 8 (one AVX2 register: GCC took a 16-lane vector's halves through the stack there).
template <int Bits, typename V, typename Fn>
__attribute__((always_inline)) inline void for_quad_weights(const QuadPanels& w, int64_t p, Fn fn) {
  typedef uint32_t U __attribute__((vector_size(sizeof(V))));
  typedef int32_t I __attribute__((vector_size(sizeof(V))));
  constexpr int64_t kLanes = sizeof(V) / sizeof(float);
  constexpr int64_t kInputs = Bits == 8 ? 4 : 8;             // inputs of a row of the panel's codes
  const uint8_t* codes = w.codes + p * (w.k_dim / kInputs) * kQuadRow;
  const c10::Half* scales = w.scales + p * w.groups * kPanel;
  const c10::Half* mins = Bits == 4 ? w.mins + p * w.groups * kPanel : nullptr;
  const auto weight = [](U code, V scale, V min) {
    if constexpr (Bits == 8) return __builtin_convertvector((I)code - 128, V) * scale;
    else return __builtin_convertvector((I)code, V) * scale + min;
  };
  for (int64_t g = 0; g < w.groups; ++g)
    for (int64_t c0 = 0; c0 < kPanel; c0 += kLanes) {
      const V scale = load_half_lanes<V>(scales + g * kPanel + c0);
      const V min = Bits == 4 ? load_half_lanes<V>(mins + g * kPanel + c0) : V{};
      for (int64_t i = g * w.group / kInputs; i < (g + 1) * w.group / kInputs; ++i) {
        U quads;
        std::memcpy(&quads, codes + i * kQuadRow + 4 * c0, sizeof(quads));
        const U low = Bits == 8 ? quads : quads & 0x0F0F0F0Fu;
        fn(i * kInputs, c0, weight(low & 0xFFu, scale, min), weight((low >> 8) & 0xFFu, scale, min),
           weight((low >> 16) & 0xFFu, scale, min), weight(low >> 24, scale, min));
        if constexpr (Bits == 4) {
          const U high = (quads >> 4) & 0x0F0F0F0Fu;
          fn(i * kInputs + 4, c0, weight(high & 0xFFu, scale, min), weight((high >> 8) & 0xFFu, scale, min),
             weight((high >> 16) & 0xFFu, scale, min), weight(high >> 24, scale, min));
        }
      }
    }
}

}  // namespace llmc_quads
