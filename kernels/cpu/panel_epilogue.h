// A float GEMM with a generated kernel as its epilogue, as the step plan's `linear_epilogue` runs it:
// what the AMX kernel (amx_epilogue.h) and the AVX-512 panel kernel share (the epilogue's description,
// the stage's layout), and the panel kernel's range, where the GEMM is not on AMX tiles (fp32; bf16
// without usable AMX or in a step too small for it).
//
// Contract: out never written; the epilogue's window function (compiler/codegen/cpp.py's NAME_cols:
// a column-local unit, output column j reading the GEMM's columns j, W + j, ..., (reads - 1) W + j)
// over rows row0 .. row0 + T - 1 of the values of x [T, K] times all the panels of an N-wide weight
// (panel_gemm_range's operands), N = reads x W, W a multiple of 32 (a panel). Each GEMM output is
// rounded to X once, as store_tile stores it, and the kernel reads those values: the results equal
// the GEMM then the kernel, bit for bit. panel_epilogue_range runs windows begin .. end - 1 (32
// output columns each) for every token on the calling thread.
//
// How: tokens go in the panel GEMM's blocks (token_block) and, within a block, kStageRows at a time;
// for each window the panels it reads (a gated activation's gate and up) meet those rows' tiles into
// a stage that holds just the window's columns for them, and the window function reads the stage at
// once (given it as the GEMM result's pointer, shifted so that the window's columns land on it). The
// GEMM's [T, N] result never goes to memory and back: a 512-token fp32 prefill's gate_up wrote 6 MiB
// a layer and silu_mul read it back after a barrier (SmolLM2 on a 2-core Xeon, the 30 gate_up
// instructions with their SiLU x up, the best of 4 timed prefills in 3 alternating rounds: 176-188 ms
// fused, 198-209 ms not).
#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>
#include <vector>

#include "panel_gemm.h"

namespace llmc_panels {

constexpr int64_t kStageRows = 4 * kTile;    // rows of a panel epilogue's stage (a few KiB a read: L1)

// compiler/codegen/cpp.py's window function: values' rows first .. last - 1, columns col0 .. col1 - 1.
using WindowFn = void (*)(char* const* ptrs, const int64_t* strides, int64_t first, int64_t last, int64_t col0,
                          int64_t col1);

// The epilogue of one GEMM call: its values as the generated kernel takes them (`source`: the GEMM's
// result), its output width W, how many W-wide column groups of the result it reads, and the plan
// row of the GEMM's first token.
struct Epilogue {
  WindowFn fn;
  std::vector<char*> ptrs;
  std::vector<int64_t> strides;
  int64_t source, width, reads, row0;
};

// `p` moved by `elements` (negative ones too) as an address: where a window function's row r,
// column j of the GEMM's result lands on the stage.
template <typename X>
X* moved(X* p, int64_t elements) {
  return reinterpret_cast<X*>(reinterpret_cast<uintptr_t>(p) + elements * int64_t{sizeof(X)});
}

// The stage's row stride in panels: the fewest m (from 2) at which a row's column groups, W / 32
// panels apart, fall on distinct panel slots of distinct rows (no (g - h) x W / 32 a multiple of m).
inline int64_t stage_slots(int64_t width, int64_t reads) {
  const int64_t apart = width / kPanel;
  for (int64_t m = 2;; ++m) {
    bool distinct = true;
    for (int64_t d = 1; d < reads; ++d) distinct = distinct && (d * apart) % m != 0;
    if (distinct) return m;
  }
}

// Elements of a stage of `rows` rows (stride: stage_slots panels).
inline int64_t stage_size(int64_t rows, int64_t stride, const Epilogue& e) {
  return rows * stride + (e.reads - 1) * e.width + kPanel;
}

// A thread's stage for one GEMM call's epilogue (Out: the GEMM result's dtype, which the window
// function reads), and the window function's values with the stage as the GEMM's result.
template <typename Out>
class EpilogueStage {
 public:
  EpilogueStage(const Epilogue& e, int64_t tokens)
      : e_(e), stride_(stage_slots(e.width, e.reads) * kPanel), rows_(std::min(tokens, kStageRows)),
        stage_(new Out[stage_size(rows_, stride_, e)]), ptrs_(e.ptrs), strides_(e.strides) {   // written before read
    strides_[e.source] = stride_;
  }

  int64_t rows() const { return rows_; }

  // Window w of rows r0 .. r1 - 1 (at most rows()): each column group g's tiles, its panel g W / 32 + w
  // read from panels_of(g) (a base that panel index holds), into the stage, then the window function.
  template <typename X, typename PanelsOf>
  void run(const X* x, PanelsOf panels_of, int64_t k_dim, const Out* bias, int64_t w, int64_t r0, int64_t r1) {
    const int64_t windows = e_.width / kPanel;
    Out* out = moved(stage_.get(), -r0 * stride_ - w * kPanel);     // row t, column g W + 32 w + c
    for (int64_t g = 0; g < e_.reads; ++g)
      for (int64_t t0 = r0; t0 < r1; t0 += kTile) {
        const int64_t tt = std::min<int64_t>(kTile, r1 - t0);
        run_tile(x, panels_of(g), k_dim, bias, out, t0, tt, g * windows + w, e_.reads * e_.width, stride_);
      }
    ptrs_[e_.source] = reinterpret_cast<char*>(moved(out, -e_.row0 * stride_));
    e_.fn(ptrs_.data(), strides_.data(), e_.row0 + r0, e_.row0 + r1, w * kPanel, (w + 1) * kPanel);
  }

 private:
  const Epilogue& e_;
  int64_t stride_, rows_;
  std::unique_ptr<Out[]> stage_;
  std::vector<char*> ptrs_;
  std::vector<int64_t> strides_;
};

// See the contract: windows begin .. end - 1 of every token, on the calling thread.
template <typename X>
void panel_epilogue_range(const X* x, const X* panels, int64_t tokens, int64_t k_dim, const X* bias,
                          const Epilogue& e, int64_t begin, int64_t end) {
  if (tokens == 0 || begin >= end) return;
  EpilogueStage<X> stage(e, tokens);
  const int64_t block = token_block(k_dim, sizeof(X), kTile);
  for (int64_t b0 = 0; b0 < tokens; b0 += block) {
    const int64_t b1 = std::min(tokens, b0 + block);
    for (int64_t w = begin; w < end; ++w)
      for (int64_t r0 = b0; r0 < b1; r0 += stage.rows())
        stage.run(x, [&](int64_t) { return panels; }, k_dim, bias, w, r0, std::min(b1, r0 + stage.rows()));
  }
}

}  // namespace llmc_panels
