// The work each thread of a step plan's team does for one instruction (kernels/step_plan_isa.py
// describes the instructions, the generated step_plan_isa.h numbers them and names their args;
// step_plan_bound.h holds what they read, step_plan_gemm.h the GEMMs' work, step_plan.cpp the plan,
// step_plan_checks.cpp its checks; everything here runs inside the parallel region, on inputs the
// plan has checked, so nothing here fails).
#pragma once

#include <ATen/ATen.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

#include "attention_decode.h"
#include "attention_work.h"
#include "step_plan_bound.h"
#include "step_plan_gemm.h"
#include "token_rows.h"

namespace llmc_plan {

// Attention: the team takes the step's work items one at a time, most costly first; a decode
// (one query) runs attention_decode.h's run_decode, a prompt chunk attention_items.h's tiles.
template <typename X, typename C>
void attend(const Instr& in, const Bound& b, int64_t index, llmc_cpu::Scratch& scratch) {
  const AttentionArgs a = attention_args(in);
  const at::Tensor& cache = *b.tensor_at[a.cache];
  const C* k_cache = reinterpret_cast<const C*>(b.at[a.cache]) + a.layer * cache.stride(0);
  const at::Tensor& tables = *b.tensor_at[a.block_tables];
  const llmc_cpu::Geometry g{a.heads, a.kv_heads, a.head_dim, a.heads / a.kv_heads};
  const llmc_cpu::Inputs<X, C> inputs{reinterpret_cast<const X*>(b.at[a.q]), reinterpret_cast<X*>(b.at[a.out]),
                                      k_cache, k_cache + cache.stride(1), tables.const_data_ptr<int32_t>(),
                                      tables.size(1), reinterpret_cast<const int32_t*>(b.at[a.seq_lens]),
                                      b.qsl.data(), g, static_cast<float>(in.f), a.window,
                                      static_cast<float>(a.softcap), &b.splits};
  const int64_t count = b.items.size();
  for (int64_t i = b.next[index]++; i < count; i = b.next[index]++) {
    if (b.items[i].num_queries == 1)
      llmc_cpu::run_decode(inputs, b.items[i], scratch);
    else
      llmc_cpu::run_chunk(inputs, b.items[i], scratch);
  }
}

template <typename X>
void embed_rows(const Instr& in, const Bound& b, int64_t first, int64_t last) {
  namespace A = arg::embedding;
  const auto& a = in.a;
  const int64_t* ids = reinterpret_cast<const int64_t*>(b.at[a[A::ids]]);
  const X* table = reinterpret_cast<const X*>(b.at[a[A::table]]);
  const int64_t w = a[A::width];
  constexpr int64_t kPack = 4 / sizeof(X);                   // a panel lane's elements: f32 1, bf16 a pair
  constexpr int64_t kStride = kPack * llmc_panels::kPanel;   // [P, W / kPack, 32, kPack]: from a pair to the next
  const auto lane_of = [&](int64_t t) {                      // row ids[t]'s first elements in a panel table
    return table + ids[t] / llmc_panels::kPanel * w * llmc_panels::kPanel + ids[t] % llmc_panels::kPanel * kPack;
  };
  for (int64_t t = first; t < last; ++t) {
    X* out = reinterpret_cast<X*>(b.at[a[A::out]]) + t * w;
    if (a[A::layout] == 0) {
      std::memcpy(out, table + ids[t] * w, w * sizeof(X));
      continue;
    }
    // A panel table's row is a column of its panel, a cache line for each kPack elements: the next
    // row's lines are fetched while this one is read (a 512-token prompt's gather: 1.0 -> 0.7 ms).
    const X *lane = lane_of(t), *next = lane_of(std::min(t + 1, last - 1));
    for (int64_t j = 0; j < w / kPack; ++j) {
      __builtin_prefetch(next + j * kStride);
      for (int64_t e = 0; e < kPack; ++e) out[j * kPack + e] = lane[j * kStride + e];
    }
  }
}

// A quantized table's code `j` of row `id` and its group's index into scales and mins, in each
// layout of the qembedding instruction: 0 the artifact's rows (int4 in GGUF's block order: byte b
// of a 32-code block holds code b low, b + 16 high); 1 the quantized panels (kernels/panels.py:
// codes [P, W, 32] or int4 pairs [P, W/2, 32] with input 2i low, 2i + 1 high); 2 quads (int8
// activations: code + 128 [P, W/4, 32, 4], or int4 [P, W/8, 32, 4] with byte r of quad i holding
// input 8i + r low, 8i + 4 + r high). Scales and mins [P, W/G, 32] in layouts 1 and 2.
struct QTable {
  const uint8_t* codes;
  int64_t layout, width, bits, group;

  int code(int64_t id, int64_t j) const {
    const int64_t bytes = width * bits / 8, lane = id % llmc_panels::kPanel;
    const uint8_t* panel = codes + id / llmc_panels::kPanel * bytes * llmc_panels::kPanel;
    if (layout == 2 && bits == 8) return panel[(j / 4 * llmc_panels::kPanel + lane) * 4 + j % 4] - 128;
    if (layout == 2) {
      const uint8_t quad = panel[(j / 8 * llmc_panels::kPanel + lane) * 4 + j % 4];
      return j % 8 >= 4 ? quad >> 4 : quad & 0xF;
    }
    if (bits == 8)
      return static_cast<int8_t>(layout == 0 ? codes[id * bytes + j] : panel[j * llmc_panels::kPanel + lane]);
    const uint8_t pair = layout == 0 ? codes[id * bytes + j / 32 * 16 + j % 16]
                                     : panel[j / 2 * llmc_panels::kPanel + lane];
    return (layout == 0 ? j % 32 >= 16 : j % 2 == 1) ? pair >> 4 : pair & 0xF;
  }
  int64_t group_at(int64_t id, int64_t j) const {
    const int64_t groups = width / group, lane = id % llmc_panels::kPanel;
    return layout == 0 ? id * groups + j / group
                       : (id / llmc_panels::kPanel * groups + j / group) * llmc_panels::kPanel + lane;
  }
};

// Rows of a quantized table: scale * code (+ min) in fp32, rounded once to X, as qembedding_ref.
template <typename X>
void qembed_rows(const Instr& in, const Bound& b, int64_t first, int64_t last) {
  namespace A = arg::qembedding;
  const auto& a = in.a;
  const QTable table{reinterpret_cast<const uint8_t*>(b.at[a[A::codes]]), a[A::layout], a[A::width], a[A::bits],
                     a[A::group]};
  const auto* scales = reinterpret_cast<const c10::Half*>(b.at[a[A::scales]]);
  const auto* mins = a[A::mins] < 0 ? nullptr : reinterpret_cast<const c10::Half*>(b.at[a[A::mins]]);
  const int64_t* ids = reinterpret_cast<const int64_t*>(b.at[a[A::ids]]);
  for (int64_t t = first; t < last; ++t) {
    X* out = reinterpret_cast<X*>(b.at[a[A::out]]) + t * table.width;
    for (int64_t j = 0; j < table.width; ++j) {
      const int64_t g = table.group_at(ids[t], j);
      const float w = static_cast<float>(table.code(ids[t], j)) * static_cast<float>(scales[g]);
      out[j] = static_cast<X>(mins ? w + static_cast<float>(mins[g]) : w);
    }
  }
}

template <typename X, typename C>
void rope_kv_write(const Instr& in, const Bound& b, int64_t first, int64_t last, float* row) {
  namespace A = arg::rope_kv_write;
  const auto& a = in.a;
  const auto x_at = [&](int64_t value) { return reinterpret_cast<X*>(b.at[value]); };
  const at::Tensor& cache = *b.tensor_at[a[A::cache]];
  const llmc_rows::KvLayout s{a[A::heads],     a[A::kv_heads], a[A::head_dim],
                              llmc_cpu::kBlock, cache.size(2),  a[A::rotary_dim]};
  C* k_cache = reinterpret_cast<C*>(b.at[a[A::cache]]) + a[A::layer] * cache.stride(0);
  const int64_t width = a[A::row_width], half = s.rotary_dim / 2;
  const float* cos = reinterpret_cast<const float*>(b.at[a[A::cos]]);
  const float* sin = reinterpret_cast<const float*>(b.at[a[A::sin]]);
  const int64_t* slots = reinterpret_cast<const int64_t*>(b.at[a[A::slots]]);
  const int64_t* positions = reinterpret_cast<const int64_t*>(b.at[a[A::positions]]);
  llmc_rows::QkNorm<X> norm;
  if (a[A::norm_span])
    norm = {x_at(a[A::q_norm]), x_at(a[A::k_norm]), a[A::norm_span], static_cast<float>(in.f),
            a[A::norm_product] != 0};
  for (int64_t t = first; t < last; ++t)
    llmc_rows::rope_token(x_at(a[A::q]) + t * width + a[A::q_col], x_at(a[A::k]) + t * width + a[A::k_col],
                          x_at(a[A::v]) + t * width + a[A::v_col], cos + positions[t] * half,
                          sin + positions[t] * half, slots[t], k_cache,
                          k_cache + cache.stride(1), x_at(a[A::q_out]) + t * s.heads * s.head_dim, s, norm, row);
}

// Thread `tid`'s share of one instruction (attention's items are taken in attend).
template <typename X, typename C>
void run_instruction(const Instr& in, int64_t index, const Bound& b, int tid, int team, llmc_cpu::Scratch& scratch,
                     float* row) {
  const auto& a = in.a;
  const auto x_at = [&](int64_t value) { return reinterpret_cast<X*>(b.at[value]); };
  const int64_t rows = b.rows_at[result_of(in)];     // the step's tokens, or the gathered rows
  const auto [first, last] = share(rows, tid, team);
  switch (in.op) {
    case kEmbedding:
      embed_rows<X>(in, b, first, last);
      break;
    case kQembedding:
      qembed_rows<X>(in, b, first, last);
      break;
    case kLinear:
      linear<X>(in, index, b, tid, team, rows, first, last);
      break;
    case kLinearEpilogue:
      linear_epilogue<X>(in, index, b, tid, team, rows, first, last);
      break;
    case kQlinear:
      qlinear<X>(in, index, b, tid, team, rows, first, last);
      break;
    case kQlinearEpilogue:
      qlinear_epilogue<X>(in, index, b, tid, team, rows, first, last);
      break;
    case kRopeKvWrite:
      rope_kv_write<X, C>(in, b, first, last, row);
      break;
    case kPagedDecodeAttention:
    case kPagedAttention:
      attend<X, C>(in, b, index, scratch);
      break;
    case kIndexSelect: {
      namespace A = arg::index_select;
      const int64_t* indices = reinterpret_cast<const int64_t*>(b.at[a[A::indices]]);
      const int64_t w = a[A::width];
      for (int64_t r = first; r < last; ++r)
        std::memcpy(x_at(a[A::out]) + r * w, x_at(a[A::x]) + indices[r] * w, w * sizeof(X));
      break;
    }
    case kGenerated:
      if (first < last)
        reinterpret_cast<GeneratedFn>(static_cast<intptr_t>(a[arg::generated::fn]))(
            b.ptrs[index].data(), b.strides[index].data(), first, last);
      break;
    case kAllReduce:   // the team's first thread runs a collective (step_plan.cpp, plan_collectives.h)
    case kAllGather:
    case kNumOps:
      break;
  }
}

}  // namespace llmc_plan
