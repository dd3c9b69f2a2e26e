// A prompt's quantized GEMM on AMX-BF16 tiles: x rounded to bf16 times the weight its quads hold,
// dequantized to bf16 once per call, products summed in fp32 (the step plan's qlinear over quads with
// `prompts` 1, and qdot_gemm.cpp's op with bf16_prompts, from kMinTokens tokens where AMX-BF16 is
// usable; below that, and wherever it is not, the int8-activation GEMM of amx_qgemm.h runs).
//
// Contract (the meaning of kernels/quant.py's qlinear_bf16_ref on the weight the quads hold):
//   x        [T, K] bf16 (round_rows rounds an fp32 x to nearest even; where the CPU has AVX512_BF16
//            it flushes fp32 subnormals, below 2^-126, to 0)
//   w        quads, scales, mins as qdot_gemm.cpp's: w = scale x code (int8: the stored byte less
//            128; int4: the nibble, plus min), in fp32 (the product is exact), rounded to bf16
//            (nearest even)
//   -> out   [T, N] (fp32 or bf16) = the bf16 products summed in fp32 (AMX's order), plus bias in
//            fp32, rounded once.
//
// Why: the int8-activation GEMM on AMX-INT8 brings every 32-input block's int32 dots out of the tiles
// for their scales (the token's block scale, then the group's), vector work that bounds it (a 512-token
// int4 prefill: 245 ms against a bf16 artifact's 85 on a 2-core Xeon); here the sums stay in the tiles
// over all of K, at AMX-BF16's rate. It is llama.cpp's choice for a batch of 32 or more tokens on a
// BLAS build (the weight dequantized, then a float GEMM), and IPEX's weight-only quantization in bf16.
//
// How: a thread's panels go in chunks of about kChunkBytes of bf16; each chunk is dequantized into
// bf16 panels ([K/2, 32, 2]: AMX B tiles, amx_gemm.h's layout) in the caller's scratch, which stays in
// the core's L2, then multiplied by all the tokens as amx_gemm.h's gemm_groups multiplies a bf16
// weight's panels. The scratch is the caller's to keep from call to call: a fresh 512 KiB each call
// met ~128 page faults per GEMM per thread (a 512-token int4 prefill took ~30 ms more).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <string>
#include <utility>
#include <vector>

#include "amx_gemm.h"
#include "qdot_gemm.h"
#include "quad_weights.h"

namespace llmc_amx_dq {

using llmc_amx::Bf16;
using llmc_cpu::Uint16;
using llmc_cpu::Vec16;
using llmc_panels::kPanel;
using llmc_qdot::QuadPanels;

// Fewer tokens take the int8-activation GEMM (a decode step reads each weight once: its bytes, not its
// arithmetic, decide). The ops on 2 threads (Xeon with AMX; N 3072 x K 576 and N 576 x K 1536) took in
// bf16 1.14-1.92x the int8 path's time at 16 tokens, 0.72-1.08x at 32 (int4 0.72-0.74, int8 0.90-1.08),
// 0.46-0.57x at 128.
constexpr int64_t kMinTokens = 32;
constexpr int64_t kChunkBytes = 512 << 10;     // bf16 panels dequantized at a time (stay in a core's L2)

// Whether a quads GEMM of `tokens` rows asked for bf16 prompts (`bf16_prompts`) runs here now: from
// kMinTokens where AMX-BF16 is usable and LLMC_CPU_AMX is not off (read at each call).
inline bool use_bf16(int64_t tokens, bool bf16_prompts) {
  return bf16_prompts && tokens >= kMinTokens && llmc_amx::use_amx(tokens);
}

// ("amx-bf16", "") or ("", why a prompt's quads GEMM keeps int8 activations): the bf16 GEMMs' choice.
inline std::pair<std::string, std::string> prompt_path() {
  const auto [path, why] = llmc_amx::gemm_path();
  return {why.empty() ? path : "", why};
}

// Elements of scratch gemm_range needs for K inputs: a chunk, at least one panel.
inline int64_t scratch_elems(int64_t k_dim) { return std::max(kChunkBytes / int64_t{sizeof(Bf16)}, k_dim * kPanel); }

// Rows first .. last - 1 of x [T, K] (K a multiple of 16) as T_ into to [T, K]: rounded to bf16, or
// widened to fp32 (exact).
template <typename X, typename T_>
void round_rows(const X* x, T_* to, int64_t k_dim, int64_t first, int64_t last) {
  for (int64_t i = first * k_dim; i < last * k_dim; i += 16) llmc_cpu::store16(to + i, llmc_cpu::load16(x + i));
}

// Two inputs' 16 lanes rounded to bf16 (nearest even, as torch's .to(bfloat16) for finite values) and
// interleaved: lane j = (a_j, b_j), a pair row's 16 outputs.
inline Uint16 bf16_pairs(Vec16 a, Vec16 b) {
  Uint16 ua, ub;
  std::memcpy(&ua, &a, sizeof(ua));
  std::memcpy(&ub, &b, sizeof(ub));
  ua = (ua + 0x7FFFu + ((ua >> 16) & 1u)) >> 16;
  ub = (ub + 0x7FFFu + ((ub >> 16) & 1u)) >> 16;
  return ua | (ub << 16);
}

// Panel p of `w` as bf16 pairs [K/2, 32, 2] in `out`: inputs k, k + 1 of output j at pair row k / 2.
template <int Bits>
void dequantize_panel(const QuadPanels& w, int64_t p, Bf16* out) {
  llmc_quads::for_quad_weights<Bits, Vec16>(w, p, [&](int64_t k, int64_t c0, Vec16 w0, Vec16 w1, Vec16 w2, Vec16 w3) {
    const Uint16 rows[2] = {bf16_pairs(w0, w1), bf16_pairs(w2, w3)};
    Bf16* to = out + k * kPanel + 2 * c0;                    // pair row k / 2, outputs c0 on
    std::memcpy(to, &rows[0], sizeof(rows[0]));
    std::memcpy(to + 2 * kPanel, &rows[1], sizeof(rows[1]));
  });
}

#if defined(__x86_64__)
// out [T, N] columns of panels begin .. end - 1 = xb [T, K] (bf16) times those panels' weight
// dequantized to bf16 (+ bias), on AMX, on the calling thread (which must be allowed the tile state:
// llmc_amx::support().usable): a chunk of panels dequantized into `panels` (scratch_elems(K)), then
// multiplied (amx_gemm.h).
template <int Bits, typename Out>
void gemm_range(const Bf16* xb, const QuadPanels& w, int64_t tokens, const Out* bias, Out* out, int64_t n_dim,
                int64_t begin, int64_t end, Bf16* panels) {
  if (begin >= end || tokens == 0) return;
  const int64_t panel = w.k_dim * kPanel, chunk = std::min(scratch_elems(w.k_dim) / panel, end - begin);
  std::vector<int64_t> order;
  for (int64_t p0 = begin; p0 < end; p0 += chunk) {
    const int64_t count = std::min(chunk, end - p0), n0 = p0 * kPanel;
    for (int64_t i = 0; i < count; ++i) dequantize_panel<Bits>(w, p0 + i, panels + i * panel);
    order.resize(count);
    std::iota(order.begin(), order.end(), 0);
    const auto to_out = [&](int64_t, int64_t) { return llmc_amx::Dest<Out>{out + n0, n_dim, n_dim - n0}; };
    llmc_amx::gemm_groups(xb, panels, tokens, w.k_dim, bias ? bias + n0 : nullptr, order, count, to_out,
                          [](int64_t, int64_t, int64_t) {}, [](int64_t, int64_t) {});
  }
}
#endif

}  // namespace llmc_amx_dq
