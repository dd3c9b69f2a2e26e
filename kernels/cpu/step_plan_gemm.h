// The GEMM instructions' work for each thread of a step plan's team (step_plan.h has the others):
// linear, linear_epilogue (a GEMM and its generated epilogue), qlinear over quantized panels or quads.
#pragma once

#include <cstdint>
#include <type_traits>

#include "amx_dequant_gemm.h"
#include "amx_epilogue.h"
#include "amx_gemm.h"
#include "amx_qgemm.h"
#include "f32_dequant_gemm.h"
#include "panel_epilogue.h"
#include "qpanel_gemm.h"
#include "row_picks.h"
#include "step_plan_bound.h"

namespace llmc_plan {

constexpr int64_t kTokenSplit = 64;   // tokens a thread gets before an AMX GEMM is split by tokens
constexpr int64_t kClaimRows = 4;     // up to this many rows (decode steps) a GEMM's panels are claimed
constexpr int64_t kMinClaim = 2;      // panels a claim takes at least (panel_claims.h)

// `run(begin, end)` on the panels of GEMM instruction `index` this thread computes: in a step of up to
// kClaimRows rows claimed (panel_claims.h: its own share first, then what the others leave), so the
// GEMM ends when the team's work does rather than when its slowest thread's share does; otherwise its
// even share (a prompt's GEMM is long enough for the shares to even out, and is split by tokens on AMX).
template <typename Run>
void for_panels(const Bound& b, int64_t index, int tid, int team, int64_t rows, int64_t num_panels, Run&& run) {
  if (rows <= kClaimRows && b.claims)
    return claim_panels(&b.claims[index * b.claim_team], tid, b.claim_team, kMinClaim, run);
  const auto [begin, end] = share(num_panels, tid, team);
  run(begin, end);
}

// A float GEMM: on AMX tiles with at least kTokenSplit tokens a thread (a prompt), split by tokens,
// each thread all the panels for the rows the row-wise kernels before and after it give that thread,
// so its x and out stay in that core's caches (a 512-token bf16 prefill on a 2-core Xeon: 2.5% less
// time, the median of 8 quiet runs); otherwise split by panels: a decode step's GEMV reads each
// weight once, and the AVX-512 panel kernel reads a panel once per block of ~100 tokens, which split
// by tokens each thread would do (an fp32 prefill took 4-8% more time). Each output is the same dot
// product either way.
template <typename X>
bool split_by_tokens(int64_t rows, int team) {
  return rows >= kTokenSplit * team && llmc_amx::on_amx<X>(rows / team);
}

// A GEMM's greedy picks (its `picks` arg; -1: none): each thread picks in every row of the columns it
// has just made (row_picks.h), while they are in its caches, into its own partials (Bound::picks,
// [team][rows]); `merge` then meets the team at a barrier and writes each row's pick of them all.
// Where the logits are made is where a greedy step's tokens are, without a pass over cold logits.
template <typename X>
class GemmPicks {
 public:
  GemmPicks(const Bound& b, int64_t picks, int tid, int team, int64_t rows, int64_t n, const X* out)
      : b_(b), tid_(tid), team_(team), rows_(rows), n_(n), out_(out),
        picks_(picks < 0 ? nullptr : reinterpret_cast<int64_t*>(b.at[picks])) {
    if (picks_) std::fill(partial(0), partial(rows), llmc_cpu::Pick{});
  }

  // Rows [r0, r1) of out in columns [c0, c1), made by this thread.
  void columns(int64_t r0, int64_t r1, int64_t c0, int64_t c1) const {
    if (!picks_ || c0 >= c1) return;
    for (int64_t r = r0; r < r1; ++r) llmc_cpu::pick_in(out_ + r * n_ + c0, c1 - c0, c0, *partial(r));
  }
  // Panels [begin, end) of every row.
  void panels(int64_t begin, int64_t end) const {
    columns(0, rows_, begin * llmc_panels::kPanel, std::min(end * llmc_panels::kPanel, n_));
  }

  // Each row's pick over the team's partials (every thread calls it; rows split after a barrier).
  void merge() const {
    if (!picks_) return;
    b_.barrier->wait();
    const auto [first, last] = share(rows_, tid_, team_);
    for (int64_t r = first; r < last; ++r) {
      llmc_cpu::Pick best;
      for (int t = 0; t < team_; ++t)
        if (llmc_cpu::better(b_.picks[t * rows_ + r], best)) best = b_.picks[t * rows_ + r];
      picks_[r] = best.index;
    }
  }

 private:
  llmc_cpu::Pick* partial(int64_t r) const { return b_.picks.data() + tid_ * rows_ + r; }

  const Bound& b_;
  int tid_, team_;
  int64_t rows_, n_;
  const X* out_;
  int64_t* picks_;
};

template <typename X>
void linear(const Instr& in, int64_t index, const Bound& b, int tid, int team, int64_t rows, int64_t first,
            int64_t last) {
  namespace A = arg::linear;
  const auto& a = in.a;
  const auto x_at = [&](int64_t value) { return reinterpret_cast<X*>(b.at[value]); };
  const int64_t k = a[A::k], n = a[A::n];
  X* bias = a[A::bias] < 0 ? nullptr : x_at(a[A::bias]);
  const GemmPicks<X> picks(b, a[A::picks], tid, team, rows, n, x_at(a[A::out]));
  if (split_by_tokens<X>(rows, team)) {
    llmc_amx::linear_range(x_at(a[A::x]) + first * k, x_at(a[A::panels]), last - first, k, bias,
                           x_at(a[A::out]) + first * n, n, 0, a[A::num_panels]);
    picks.columns(first, last, 0, n);
  } else {
    for_panels(b, index, tid, team, rows, a[A::num_panels], [&](int64_t begin, int64_t end) {
      llmc_amx::linear_range(x_at(a[A::x]), x_at(a[A::panels]), rows, k, bias, x_at(a[A::out]), n, begin, end);
      picks.panels(begin, end);
    });
  }
  picks.merge();
}

// A float GEMM and its generated epilogue (instruction linear_epilogue): on AMX tiles split by
// tokens as `linear`, the epilogue's window function on each 32 columns as the GEMM makes them
// (amx_epilogue.h); on the AVX-512 panel kernel with more than kClaimRows rows, the windows split,
// each as its panels meet a few rows (panel_epilogue.h); otherwise (a decode step's GEMVs, whose
// panels go kGemvPanels at a time, or AMX split by panels) `linear`, a barrier (the epilogue reads
// every thread's panels), and the epilogue's kernel on the team's split of the rows. The same values
// every way, bit for bit.
template <typename X>
void linear_epilogue(const Instr& in, int64_t index, const Bound& b, int tid, int team, int64_t rows, int64_t first,
                     int64_t last) {
  namespace A = arg::linear_epilogue;
  const auto& a = in.a;
  const auto x_at = [&](int64_t value) { return reinterpret_cast<X*>(b.at[value]); };
  const int64_t k = a[A::k];
  X* bias = a[A::bias] < 0 ? nullptr : x_at(a[A::bias]);
  const auto epilogue = [&](int64_t row0) {
    return llmc_panels::Epilogue{reinterpret_cast<llmc_panels::WindowFn>(static_cast<intptr_t>(a[A::window_fn])),
                                 b.ptrs[index], b.strides[index], a[A::source], a[A::width], a[A::reads], row0};
  };
#if defined(__x86_64__)
  if constexpr (std::is_same_v<X, llmc_amx::Bf16>) {
    if (split_by_tokens<X>(rows, team))
      return llmc_amx::epilogue_range(x_at(a[A::x]) + first * k, x_at(a[A::panels]), last - first, k, bias,
                                      epilogue(first));
  }
#endif
  if (rows > kClaimRows && !llmc_amx::on_amx<X>(rows)) {
    const auto [begin, end] = share(a[A::width] / llmc_panels::kPanel, tid, team);
    return llmc_panels::panel_epilogue_range(x_at(a[A::x]), x_at(a[A::panels]), rows, k, bias, epilogue(0), begin,
                                             end);
  }
  for_panels(b, index, tid, team, rows, a[A::num_panels], [&](int64_t begin, int64_t end) {
    llmc_amx::linear_range(x_at(a[A::x]), x_at(a[A::panels]), rows, k, bias, x_at(a[A::out]), a[A::n], begin, end);
  });
  b.barrier->wait();
  if (first < last)
    reinterpret_cast<GeneratedFn>(static_cast<intptr_t>(a[A::fn]))(b.ptrs[index].data(), b.strides[index].data(),
                                                                   first, last);
}

// The quads of a qlinear instruction, as the kernels read them.
inline llmc_qdot::QuadPanels quad_panels(const Instr& in, const Bound& b) {
  namespace A = arg::qlinear;
  const auto& a = in.a;
  const auto* mins = a[A::mins] < 0 ? nullptr : reinterpret_cast<const c10::Half*>(b.at[a[A::mins]]);
  return {reinterpret_cast<const uint8_t*>(b.at[a[A::codes]]), reinterpret_cast<const c10::Half*>(b.at[a[A::scales]]),
          mins, a[A::k], a[A::group], a[A::k] / a[A::group]};
}

// x [rows, k] as T (bf16 or fp32): itself, or x rounded (widened) into the run's scratch (the rows
// split, then a barrier; in a small step each thread all of them for itself).
template <typename T, typename X>
const T* rows_as(const X* x, int64_t k, const Bound& b, int tid, int64_t rows, int64_t first, int64_t last) {
  if constexpr (std::is_same_v<X, T>) {
    return x;
  } else {
    auto* to = reinterpret_cast<T*>(x_scratch(b, tid));
    if (b.widened_alone) {
      llmc_amx_dq::round_rows(x, to, k, 0, rows);
    } else {
      llmc_amx_dq::round_rows(x, to, k, first, last);
      b.barrier->wait();
    }
    return to;
  }
}

// Columns of panels begin .. end - 1 of a prompt's quads GEMM with the weight dequantized: x bf16 on
// AMX-BF16 (amx_dequant_gemm.h), or x fp32 in the float tiles (f32_dequant_gemm.h).
template <int Bits, typename Out>
void dequant_range(const llmc_amx::Bf16* x, const llmc_qdot::QuadPanels& w, int64_t rows, const Out* bias, Out* out,
                   int64_t n, int64_t begin, int64_t end, llmc_amx::Bf16* panels) {
#if defined(__x86_64__)
  llmc_amx_dq::gemm_range<Bits>(x, w, rows, bias, out, n, begin, end, panels);
#endif
}

template <int Bits, typename Out>
void dequant_range(const float* x, const llmc_qdot::QuadPanels& w, int64_t rows, const Out* bias, Out* out,
                   int64_t n, int64_t begin, int64_t end, float* panels) {
  llmc_f32_dq::gemm_range<Bits>(x, w, rows, bias, out, n, begin, end, panels);
}

// A prompt's quantized GEMM over quads with the weight dequantized to T: bf16 on AMX-BF16 (`prompts`
// 1), fp32 (`prompts` 2). x as T (rows_as), then the panels split, each thread dequantizing only its
// own into its part of the plan's scratch (Bound::dequantized).
template <typename X, typename T>
void qdot_dequant_linear(const Instr& in, int64_t index, const Bound& b, int tid, int team, int64_t rows,
                         int64_t first, int64_t last) {
  namespace A = arg::qlinear;
  const auto& a = in.a;
  const auto x_at = [&](int64_t value) { return reinterpret_cast<X*>(b.at[value]); };
  const T* xt = rows_as<T>(x_at(a[A::x]), a[A::k], b, tid, rows, first, last);
  const llmc_qdot::QuadPanels w = quad_panels(in, b);
  X* bias = a[A::bias] < 0 ? nullptr : x_at(a[A::bias]);
  const GemmPicks<X> picks(b, a[A::picks], tid, team, rows, a[A::n], x_at(a[A::out]));
  auto* panels = reinterpret_cast<T*>(b.dequantized.data() + tid * b.dequantized_per_thread);
  for_panels(b, index, tid, team, rows, a[A::num_panels], [&](int64_t begin, int64_t end) {
    if (a[A::bits] == 8)
      dequant_range<8>(xt, w, rows, bias, x_at(a[A::out]), a[A::n], begin, end, panels);
    else
      dequant_range<4>(xt, w, rows, bias, x_at(a[A::out]), a[A::n], begin, end, panels);
    picks.panels(begin, end);
  });
  picks.merge();
}

// A quantized GEMM over quads (int8 activations): x quantized per block of 32 (the step's blocks
// split, so one token's are shared too, then a barrier; in a small step each thread all of them for
// itself), then the panels split (for_panels). A prompt's with `prompts` 1 on AMX-BF16, or with
// `prompts` 2: qdot_dequant_linear.
template <typename X>
void qdot_linear(const Instr& in, int64_t index, const Bound& b, int tid, int team, int64_t rows, int64_t first,
                 int64_t last) {
  namespace A = arg::qlinear;
  const auto& a = in.a;
  if (llmc_amx_dq::use_bf16(rows, a[A::prompts] == 1))
    return qdot_dequant_linear<X, llmc_amx::Bf16>(in, index, b, tid, team, rows, first, last);
  if (llmc_f32_dq::use_f32(rows, a[A::prompts] == 2))
    return qdot_dequant_linear<X, float>(in, index, b, tid, team, rows, first, last);
  const auto x_at = [&](int64_t value) { return reinterpret_cast<X*>(b.at[value]); };
  const int64_t k = a[A::k];
  const llmc_qdot::QActs q = llmc_qdot::qacts_in(reinterpret_cast<char*>(x_scratch(b, tid)), rows, k);
  const int64_t blocks = rows * (k / llmc_qdot::kBlock);
  if (b.widened_alone) {
    llmc_qdot::quantize_blocks(x_at(a[A::x]), q, 0, blocks);
  } else {
    const auto [qfirst, qlast] = share(blocks, tid, team);
    llmc_qdot::quantize_blocks(x_at(a[A::x]), q, qfirst, qlast);
    b.barrier->wait();
  }
  const llmc_qdot::QuadPanels w = quad_panels(in, b);
  X* bias = a[A::bias] < 0 ? nullptr : x_at(a[A::bias]);
  const GemmPicks<X> picks(b, a[A::picks], tid, team, rows, a[A::n], x_at(a[A::out]));
  for_panels(b, index, tid, team, rows, a[A::num_panels], [&](int64_t begin, int64_t end) {
    if (a[A::bits] == 8)
      llmc_amx_int8::qdot_range<8>(q, w, rows, bias, x_at(a[A::out]), a[A::n], begin, end, true);
    else
      llmc_amx_int8::qdot_range<4>(q, w, rows, bias, x_at(a[A::out]), a[A::n], begin, end, true);
    picks.panels(begin, end);
  });
  picks.merge();
}

// A quantized GEMM: x widened to fp32 (tokens split, then a barrier; in a small step each thread all of
// them for itself), then the panels split (for_panels).
template <typename X>
void qlinear(const Instr& in, int64_t index, const Bound& b, int tid, int team, int64_t rows, int64_t first,
             int64_t last) {
  namespace A = arg::qlinear;
  const auto& a = in.a;
  if (a[A::layout] == 1) return qdot_linear<X>(in, index, b, tid, team, rows, first, last);
  const auto x_at = [&](int64_t value) { return reinterpret_cast<X*>(b.at[value]); };
  const int64_t k = a[A::k], group = a[A::group], bits = a[A::bits];
  float* xf = x_scratch(b, tid);
  float* xsum = xf + rows * k;
  if (b.widened_alone) {
    llmc_qpanels::widen_rows(x_at(a[A::x]), k, group, static_cast<int>(bits), xf, xsum, 0, rows);
  } else {
    llmc_qpanels::widen_rows(x_at(a[A::x]), k, group, static_cast<int>(bits), xf, xsum, first, last);
    b.barrier->wait();
  }
  const auto* mins = a[A::mins] < 0 ? nullptr : reinterpret_cast<const c10::Half*>(b.at[a[A::mins]]);
  const llmc_qpanels::QPanels w{b.at[a[A::codes]], reinterpret_cast<const c10::Half*>(b.at[a[A::scales]]), mins, k,
                                group, k / group};
  X* bias = a[A::bias] < 0 ? nullptr : x_at(a[A::bias]);
  const GemmPicks<X> picks(b, a[A::picks], tid, team, rows, a[A::n], x_at(a[A::out]));
  for_panels(b, index, tid, team, rows, a[A::num_panels], [&](int64_t begin, int64_t end) {
    if (bits == 8)
      llmc_qpanels::qpanel_gemm_range<8>(xf, nullptr, w, rows, bias, x_at(a[A::out]), a[A::n], begin, end);
    else
      llmc_qpanels::qpanel_gemm_range<4>(xf, xsum, w, rows, bias, x_at(a[A::out]), a[A::n], begin, end);
    picks.panels(begin, end);
  });
  picks.merge();
}

// qlinear_epilogue's args up to prompts are qlinear's, in qlinear's places, so qlinear and quad_panels
// read it as they read a qlinear.
#define LLMC_SAME_ARG(name) static_assert(arg::qlinear_epilogue::name == arg::qlinear::name, "qlinear's " #name);
LLMC_SAME_ARG(out) LLMC_SAME_ARG(picks) LLMC_SAME_ARG(x) LLMC_SAME_ARG(codes) LLMC_SAME_ARG(scales)
LLMC_SAME_ARG(mins) LLMC_SAME_ARG(bias) LLMC_SAME_ARG(k) LLMC_SAME_ARG(n) LLMC_SAME_ARG(num_panels)
LLMC_SAME_ARG(bits) LLMC_SAME_ARG(group) LLMC_SAME_ARG(layout) LLMC_SAME_ARG(prompts)
#undef LLMC_SAME_ARG

// A quantized GEMM and its generated epilogue (instruction qlinear_epilogue): with f32 prompts from
// llmc_f32_dq::kMinTokens rows (more than kClaimRows), x as fp32 (rows_as), the windows split, each
// window's panels dequantized by the thread that takes it and met a stage of rows at a time
// (f32_dequant_gemm.h's epilogue_range: the result never goes to memory); otherwise `qlinear`, a
// barrier (the epilogue reads every thread's panels), and the epilogue's kernel on the team's split of
// the rows. The same values either way, bit for bit, as linear_epilogue's.
template <typename X>
void qlinear_epilogue(const Instr& in, int64_t index, const Bound& b, int tid, int team, int64_t rows,
                      int64_t first, int64_t last) {
  namespace A = arg::qlinear_epilogue;
  const auto& a = in.a;
  if (a[A::layout] == 1 && llmc_f32_dq::use_f32(rows, a[A::prompts] == 2) && rows > kClaimRows) {
    const auto x_at = [&](int64_t value) { return reinterpret_cast<X*>(b.at[value]); };
    const float* xf = rows_as<float>(x_at(a[A::x]), a[A::k], b, tid, rows, first, last);
    const llmc_qdot::QuadPanels w = quad_panels(in, b);
    X* bias = a[A::bias] < 0 ? nullptr : x_at(a[A::bias]);
    const llmc_panels::Epilogue e{reinterpret_cast<llmc_panels::WindowFn>(static_cast<intptr_t>(a[A::window_fn])),
                                  b.ptrs[index], b.strides[index], a[A::source], a[A::width], a[A::reads], 0};
    const auto [begin, end] = share(a[A::width] / llmc_panels::kPanel, tid, team);
    float* panels = b.dequantized.data() + tid * b.dequantized_per_thread;
    if (a[A::bits] == 8)
      llmc_f32_dq::epilogue_range<8>(xf, w, rows, bias, e, begin, end, panels);
    else
      llmc_f32_dq::epilogue_range<4>(xf, w, rows, bias, e, begin, end, panels);
    return;
  }
  qlinear<X>(in, index, b, tid, team, rows, first, last);
  b.barrier->wait();
  if (first < last)
    reinterpret_cast<GeneratedFn>(static_cast<intptr_t>(a[A::fn]))(b.ptrs[index].data(), b.strides[index].data(),
                                                                   first, last);
}

}  // namespace llmc_plan
