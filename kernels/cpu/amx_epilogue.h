// A bf16 GEMM on AMX tiles with a generated kernel as its epilogue: the kernel runs on each 32
// columns of its output while the GEMM makes the next 32, and the GEMM's own output is never
// written out (the step plan's `linear_epilogue`, on a prompt's tokens).
//
// Contract: panel_epilogue.h's (the epilogue's window function over the GEMM's values, each rounded
// to bf16 once, as gemm_range stores it: equal to the GEMM then the kernel, bit for bit), for x [T, K]
// bf16 and all the panels of an N-wide weight, every window on the calling thread.
//
// How: for each window of 32 output columns the panels it reads (the gate's and the up's for a
// gated activation) meet the token block one after the other, their outputs go to a stage that
// holds just those columns for the block's rows (two stages, taken in turn), and while the next
// window's panels are multiplied the window function reads the stage a few rows at a time (given
// it as the GEMM result's pointer, shifted so that the window's columns land on it): the vector
// work of the activation runs beside the AMX unit's (a 512-token bf16 prefill on a 2-core Xeon,
// medians of 15 alternating runs: 82.3-82.7 ms unfused, 80.6 with each window's epilogue after
// it, 76.8-78.1 beside the next window).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "amx_gemm.h"
#include "panel_epilogue.h"

namespace llmc_amx {

using llmc_panels::Epilogue;
using llmc_panels::moved;
using llmc_panels::stage_slots;
using llmc_panels::WindowFn;

#if defined(__x86_64__)
// The window whose stage is full and whose rows the window function has yet to run on.
struct WindowRows {
  int64_t stage = 0, window = 0, first = 0, next = 0, end = 0;   // plan rows: the stage's first, to go
};

// out never written; the epilogue's outputs for rows e.row0 .. e.row0 + tokens - 1 (see contract).
// A window's epilogue runs a few rows at a time while the AMX unit multiplies the next window's
// tiles (two stages: one filled while the other is read).
inline void epilogue_range(const Bf16* x, const Bf16* panels, int64_t tokens, int64_t k_dim, const Bf16* bias,
                           const Epilogue& e) {
  if (tokens == 0) return;
  const int64_t kPanel = llmc_panels::kPanel, windows = e.width / kPanel;
  std::vector<int64_t> order;
  for (int64_t w = 0; w < windows; ++w)
    for (int64_t g = 0; g < e.reads; ++g) order.push_back(g * windows + w);
  const int64_t stride = stage_slots(e.width, e.reads) * kPanel, rows = std::max(tokens, int64_t{32});
  const int64_t size = llmc_panels::stage_size(rows, stride, e);
  const std::unique_ptr<Bf16[]> stages[2] = {std::unique_ptr<Bf16[]>(new Bf16[size]),
                                             std::unique_ptr<Bf16[]>(new Bf16[size])};   // written before read
  std::vector<char*> ptrs = e.ptrs;
  std::vector<int64_t> strides = e.strides;
  strides[e.source] = stride;
  int64_t filled = 0;                                           // windows whose stages were filled
  WindowRows ready;
  // rows a token tile, so that the next window's reads x tiles token tiles cover the whole block
  const int64_t chunk = (2 * kRows + e.reads - 1) / e.reads;
  const auto run = [&](int64_t upto) {
    const int64_t to = std::min(upto, ready.end), w = ready.window;
    if (ready.next >= to) return;
    ptrs[e.source] = reinterpret_cast<char*>(moved(stages[ready.stage].get(), -ready.first * stride - w * kPanel));
    e.fn(ptrs.data(), strides.data(), ready.next, to, w * kPanel, (w + 1) * kPanel);
    ready.next = to;
  };
  const auto dest_of = [&](int64_t b0, int64_t w) {            // row t, column c at stage row t - b0, c - 32 w
    return Dest<Bf16>{moved(stages[filled % 2].get(), -b0 * stride - w * kPanel), stride, e.reads * e.width};
  };
  const auto finished = [&](int64_t b0, int64_t b1, int64_t w) {
    run(ready.end);
    ready = {filled++ % 2, w, e.row0 + b0, e.row0 + b0, e.row0 + b1};
  };
  int64_t from = 0;                                             // where this token tile's share began
  const auto during = [&](int64_t part, int64_t parts) {
    if (part == 1) from = ready.next;
    run(from + (chunk * part + parts - 1) / parts);
  };
  gemm_groups(x, panels, tokens, k_dim, bias, order, e.reads, dest_of, finished, during);
  run(ready.end);
}
#endif

}  // namespace llmc_amx
