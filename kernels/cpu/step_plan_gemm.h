// The GEMM instructions' work for each thread of a step plan's team (step_plan.h has the others):
// linear, linear_epilogue (a GEMM and its generated epilogue), qlinear over quantized panels or quads.
#pragma once

#include <cstdint>
#include <type_traits>

#include "amx_epilogue.h"
#include "amx_gemm.h"
#include "amx_qgemm.h"
#include "qpanel_gemm.h"
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

template <typename X>
void linear(const Instr& in, int64_t index, const Bound& b, int tid, int team, int64_t rows, int64_t first,
            int64_t last) {
  namespace A = arg::linear;
  const auto& a = in.a;
  const auto x_at = [&](int64_t value) { return reinterpret_cast<X*>(b.at[value]); };
  const int64_t k = a[A::k], n = a[A::n];
  X* bias = a[A::bias] < 0 ? nullptr : x_at(a[A::bias]);
  if (split_by_tokens<X>(rows, team)) {
    llmc_amx::linear_range(x_at(a[A::x]) + first * k, x_at(a[A::panels]), last - first, k, bias,
                           x_at(a[A::out]) + first * n, n, 0, a[A::num_panels]);
    return;
  }
  for_panels(b, index, tid, team, rows, a[A::num_panels], [&](int64_t begin, int64_t end) {
    llmc_amx::linear_range(x_at(a[A::x]), x_at(a[A::panels]), rows, k, bias, x_at(a[A::out]), n, begin, end);
  });
}

// A float GEMM and its generated epilogue (instruction linear_epilogue): on AMX tiles split by
// tokens as `linear`, the epilogue's window function on each 32 columns as the GEMM makes them
// (amx_epilogue.h); otherwise `linear`, a barrier (the epilogue reads every thread's panels), and the
// epilogue's kernel on the team's split of the rows. The same values either way, bit for bit.
template <typename X>
void linear_epilogue(const Instr& in, int64_t index, const Bound& b, int tid, int team, int64_t rows, int64_t first,
                     int64_t last) {
  namespace A = arg::linear_epilogue;
  const auto& a = in.a;
  const auto x_at = [&](int64_t value) { return reinterpret_cast<X*>(b.at[value]); };
  const int64_t k = a[A::k];
  X* bias = a[A::bias] < 0 ? nullptr : x_at(a[A::bias]);
#if defined(__x86_64__)
  if constexpr (std::is_same_v<X, llmc_amx::Bf16>) {
    if (split_by_tokens<X>(rows, team)) {
      const llmc_amx::Epilogue e{reinterpret_cast<llmc_amx::WindowFn>(static_cast<intptr_t>(a[A::window_fn])),
                                 b.ptrs[index], b.strides[index], a[A::source], a[A::width], a[A::reads], first};
      llmc_amx::epilogue_range(x_at(a[A::x]) + first * k, x_at(a[A::panels]), last - first, k, bias, e);
      return;
    }
  }
#endif
  const auto [begin, end] = share(a[A::num_panels], tid, team);
  llmc_amx::linear_range(x_at(a[A::x]), x_at(a[A::panels]), rows, k, bias, x_at(a[A::out]), a[A::n], begin, end);
  b.barrier->wait();
  if (first < last)
    reinterpret_cast<GeneratedFn>(static_cast<intptr_t>(a[A::fn]))(b.ptrs[index].data(), b.strides[index].data(),
                                                                   first, last);
}

// A quantized GEMM over quads (int8 activations): x quantized per block of 32 (the step's blocks
// split, so one token's are shared too, then a barrier; in a small step each thread all of them for
// itself), then the panels split (for_panels).
template <typename X>
void qdot_linear(const Instr& in, int64_t index, const Bound& b, int tid, int team, int64_t rows) {
  namespace A = arg::qlinear;
  const auto& a = in.a;
  const auto x_at = [&](int64_t value) { return reinterpret_cast<X*>(b.at[value]); };
  const int64_t k = a[A::k], group = a[A::group];
  const llmc_qdot::QActs q = llmc_qdot::qacts_in(reinterpret_cast<char*>(x_scratch(b, tid)), rows, k);
  const int64_t blocks = rows * (k / llmc_qdot::kBlock);
  if (b.widened_alone) {
    llmc_qdot::quantize_blocks(x_at(a[A::x]), q, 0, blocks);
  } else {
    const auto [qfirst, qlast] = share(blocks, tid, team);
    llmc_qdot::quantize_blocks(x_at(a[A::x]), q, qfirst, qlast);
    b.barrier->wait();
  }
  const auto* mins = a[A::mins] < 0 ? nullptr : reinterpret_cast<const c10::Half*>(b.at[a[A::mins]]);
  const llmc_qdot::QuadPanels w{reinterpret_cast<const uint8_t*>(b.at[a[A::codes]]),
                                reinterpret_cast<const c10::Half*>(b.at[a[A::scales]]), mins, k, group, k / group};
  X* bias = a[A::bias] < 0 ? nullptr : x_at(a[A::bias]);
  for_panels(b, index, tid, team, rows, a[A::num_panels], [&](int64_t begin, int64_t end) {
    if (a[A::bits] == 8)
      llmc_amx_int8::qdot_range<8>(q, w, rows, bias, x_at(a[A::out]), a[A::n], begin, end, true);
    else
      llmc_amx_int8::qdot_range<4>(q, w, rows, bias, x_at(a[A::out]), a[A::n], begin, end, true);
  });
}

// A quantized GEMM: x widened to fp32 (tokens split, then a barrier; in a small step each thread all of
// them for itself), then the panels split (for_panels).
template <typename X>
void qlinear(const Instr& in, int64_t index, const Bound& b, int tid, int team, int64_t rows, int64_t first,
             int64_t last) {
  namespace A = arg::qlinear;
  const auto& a = in.a;
  if (a[A::layout] == 1) return qdot_linear<X>(in, index, b, tid, team, rows);
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
  for_panels(b, index, tid, team, rows, a[A::num_panels], [&](int64_t begin, int64_t end) {
    if (bits == 8)
      llmc_qpanels::qpanel_gemm_range<8>(xf, nullptr, w, rows, bias, x_at(a[A::out]), a[A::n], begin, end);
    else
      llmc_qpanels::qpanel_gemm_range<4>(xf, xsum, w, rows, bias, x_at(a[A::out]), a[A::n], begin, end);
  });
}

}  // namespace llmc_plan
