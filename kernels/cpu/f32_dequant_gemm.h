// A prompt's quantized GEMM in fp32 where the CPU's integer dot products are AVX2's: x (fp32) times the
// weight its quads hold, dequantized to fp32 once per call, in the float panel GEMM's tiles (the step
// plan's qlinear over quads with `prompts` 2, and qdot_gemm.cpp's op with prompts 2, from kMinTokens
// tokens; below that the int8-activation GEMM runs); epilogue_range the same with a generated epilogue
// (the plan's qlinear_epilogue).
//
// Contract (the meaning of kernels/quant.py's qlinear_ref on the weight the quads hold):
//   x        [T, K] fp32 (a bf16 x widened, exact)
//   w        quads, scales, mins as qdot_gemm.cpp's, dequantized as quad_weights.h says
//   -> out   [T, N] (fp32 or bf16) = x times the fp32 weight, products summed input by input in fp32
//            (panel_gemm.h's tiles), plus bias in fp32, rounded once.
//
// Why: without VNNI an int8 dot of 32 inputs costs vpmaddubsw, vpmaddwd, the sign trick's two
// instructions and an add (qdot_gemm.h), and each block's sums are scaled apart: on a 2-core AMD
// EPYC Zen 3 the int8-activation GEMM took 1.2-3.6x the fp32 panel GEMM's time from 8 tokens on
// (N 3072 x K 576, N 576 x K 1536). Dequantizing a weight costs a few instructions per 8 weights once
// per call, against 2 T flops of FMAs per weight. llama.cpp makes the same choice for a batch on a BLAS
// build (the weight dequantized, then a float GEMM).
//
// How: a thread's panels go in chunks of about kChunkBytes of fp32, each dequantized into fp32 panels
// [K, 32] (panel_gemm.h's layout) in the caller's scratch, which stays in the core's L2 while all the
// tokens' tiles meet it (panel_tiles.h's walk_tiles, token blocks outer). The scratch is the caller's
// to keep from call to call (amx_dequant_gemm.h says why).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "panel_epilogue.h"
#include "panel_gemm.h"
#include "quad_weights.h"

namespace llmc_f32_dq {

using llmc_panels::kPanel;
using llmc_qdot::QuadPanels;

constexpr int64_t kMinTokens = 16;
constexpr int64_t kChunkBytes = 256 << 10;     // fp32 panels dequantized at a time (beside a token block of x)

// Whether a quads GEMM of `tokens` rows that asked for fp32 prompts runs here.
inline bool use_f32(int64_t tokens, bool f32_prompts) { return f32_prompts && tokens >= kMinTokens; }

// Floats of scratch gemm_range needs for K inputs: a chunk, at least one panel.
inline int64_t scratch_floats(int64_t k_dim) {
  return std::max(kChunkBytes / int64_t{sizeof(float)}, k_dim * kPanel);
}

// Floats of scratch epilogue_range needs: a window's `reads` panels.
inline int64_t epilogue_scratch_floats(int64_t k_dim, int64_t reads) { return reads * k_dim * kPanel; }

// Panel p of `w` as fp32 [K, 32] in `out`.
template <int Bits>
void dequantize_panel(const QuadPanels& w, int64_t p, float* out) {
  using V = llmc_panels::TileVec;
  llmc_quads::for_quad_weights<Bits, V>(w, p, [&](int64_t k, int64_t c0, V w0, V w1, V w2, V w3) {
    float* to = out + k * kPanel + c0;
    std::memcpy(to, &w0, sizeof(V));
    std::memcpy(to + kPanel, &w1, sizeof(V));
    std::memcpy(to + 2 * kPanel, &w2, sizeof(V));
    std::memcpy(to + 3 * kPanel, &w3, sizeof(V));
  });
}

// out [T, N] columns of panels begin .. end - 1 = x [T, K] (fp32) times those panels' weight
// dequantized to fp32 (+ bias), on the calling thread: a chunk of panels dequantized into `panels`
// (scratch_floats(K)), then every token block's tiles over the chunk.
template <int Bits, typename Out>
void gemm_range(const float* x, const QuadPanels& w, int64_t tokens, const Out* bias, Out* out, int64_t n_dim,
                int64_t begin, int64_t end, float* panels) {
  if (begin >= end || tokens == 0) return;
  const int64_t panel = w.k_dim * kPanel, chunk = std::min(scratch_floats(w.k_dim) / panel, end - begin);
  for (int64_t p0 = begin; p0 < end; p0 += chunk) {
    const int64_t count = std::min(chunk, end - p0), n0 = p0 * kPanel;
    for (int64_t i = 0; i < count; ++i) dequantize_panel<Bits>(w, p0 + i, panels + i * panel);
    const Out* chunk_bias = bias ? bias + n0 : nullptr;
    llmc_panels::walk_tiles(0, count, tokens, w.k_dim, sizeof(float), llmc_panels::kTile,
                            [&](int64_t p, int64_t t0, int64_t tt) {
                              llmc_panels::run_tile(x, panels, w.k_dim, chunk_bias, out + n0, t0, tt, p, n_dim - n0,
                                                    n_dim);
                            });
  }
}

// The GEMM of gemm_range over all N columns with a generated epilogue (panel_epilogue.h's contract,
// x fp32 and the weight dequantized): windows begin .. end - 1 of every token, on the calling thread,
// each window's `reads` panels dequantized into `panels` (epilogue_scratch_floats) once, then met by
// every token's tiles a stage of rows at a time (x streams past the panels, which stay in L2).
template <int Bits, typename Out>
void epilogue_range(const float* x, const QuadPanels& w, int64_t tokens, const Out* bias,
                    const llmc_panels::Epilogue& e, int64_t begin, int64_t end, float* panels) {
  if (tokens == 0 || begin >= end) return;
  llmc_panels::EpilogueStage<Out> stage(e, tokens);
  const int64_t windows = e.width / kPanel, panel = w.k_dim * kPanel;
  for (int64_t win = begin; win < end; ++win) {
    for (int64_t g = 0; g < e.reads; ++g) dequantize_panel<Bits>(w, g * windows + win, panels + g * panel);
    const auto panels_of = [&](int64_t g) {         // panel g W / 32 + win at panels + g panels
      return llmc_panels::moved(panels + g * panel, -(g * windows + win) * panel);
    };
    for (int64_t r0 = 0; r0 < tokens; r0 += stage.rows())
      stage.run(x, panels_of, w.k_dim, bias, win, r0, std::min(tokens, r0 + stage.rows()));
  }
}

}  // namespace llmc_f32_dq
