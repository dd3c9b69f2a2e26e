// A step plan's instructions and the work each thread of its team does for one (step_plan.cpp
// holds the plan, the instruction table and its checks; everything here runs inside the parallel
// region, on inputs the plan has checked, so nothing here fails).
#pragma once

#include <ATen/ATen.h>

#include <atomic>
#include <cstring>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

#include "attention_decode.h"
#include "attention_work.h"
#include "panel_gemm.h"
#include "qpanel_gemm.h"
#include "token_rows.h"

namespace llmc_plan {

// The instructions (step_plan.cpp lists each one's args); runtime/step_plan.py's OPCODES number them alike.
enum Op : int64_t {
  kEmbedding, kRmsnorm, kAddRmsnorm, kLinear, kRopeKvWrite, kDecodeAttention, kSiluMul, kQLinear, kPagedAttention,
  kIndexSelect, kNumOps
};

struct Instr {
  Op op;
  std::vector<int64_t> a;
  double f;
};

// Items [first, second) of `count` for thread `tid` of a team of `team`.
inline std::pair<int64_t, int64_t> share(int64_t count, int tid, int team) {
  return {count * tid / team, count * (tid + 1) / team};
}

// One run's addresses and the attention work every attention call of the step shares.
struct Bound {
  int64_t rows, seqs;                         // the step's tokens, and the rows a gather makes
  std::vector<char*> at;                      // value id -> its first row
  std::vector<int64_t> rows_at;               // value id -> its rows (activations)
  std::vector<const at::Tensor*> tensor_at;   // value id -> the input tensor (inputs)
  std::vector<at::Tensor> inputs;
  std::vector<llmc_cpu::Item> items;          // attention's work items, most costly first
  std::vector<int32_t> qsl;                   // each sequence's first query row (decode: 0, 1, ..., S)
  mutable std::vector<float> widened;         // a quantized GEMM's x in fp32, then int4's group sums
                                              // (the team writes it)
  std::unique_ptr<std::atomic<int64_t>[]> next;   // per instruction: the next attention item to take
};

// Attention: the team takes the step's work items one at a time, most costly first; a decode
// (one query) runs attention_decode.h's run_decode, a prompt chunk attention_items.h's tiles.
template <typename X, typename C>
void attend(const Instr& in, const Bound& b, int64_t index, llmc_cpu::Scratch& scratch) {
  const auto& a = in.a;
  const int64_t o = in.op == kPagedAttention;           // its args have query_start_loc before the layer
  const at::Tensor& cache = *b.tensor_at[a[2]];
  const C* k_cache = reinterpret_cast<const C*>(b.at[a[2]]) + a[5 + o] * cache.stride(0);
  const at::Tensor& tables = *b.tensor_at[a[3]];
  const llmc_cpu::Geometry g{a[6 + o], a[7 + o], a[8 + o], a[6 + o] / a[7 + o]};
  const llmc_cpu::Inputs<X, C> inputs{reinterpret_cast<const X*>(b.at[a[1]]), reinterpret_cast<X*>(b.at[a[0]]),
                                      k_cache, k_cache + cache.stride(1), tables.const_data_ptr<int32_t>(),
                                      tables.size(1), reinterpret_cast<const int32_t*>(b.at[a[4]]), b.qsl.data(),
                                      g, static_cast<float>(in.f)};
  const int64_t count = b.items.size();
  for (int64_t i = b.next[index]++; i < count; i = b.next[index]++) {
    if (b.items[i].num_queries == 1)
      llmc_cpu::run_decode(inputs, b.items[i], scratch);
    else
      llmc_cpu::run_chunk(inputs, b.items[i], scratch);
  }
}

// Thread `tid`'s share of one instruction (attention's items are taken in attend).
template <typename X, typename C>
void run_instruction(const Instr& in, int64_t index, const Bound& b, int tid, int team, llmc_cpu::Scratch& scratch,
                     float* row) {
  const auto& a = in.a;
  const auto x_at = [&](int64_t value) { return reinterpret_cast<X*>(b.at[value]); };
  const int64_t rows = b.rows_at[a[0]];        // of the result: the step's tokens, or the gathered rows
  const auto [first, last] = share(rows, tid, team);
  switch (in.op) {
    case kEmbedding: {
      const int64_t* ids = reinterpret_cast<const int64_t*>(b.at[a[2]]);
      const X* table = x_at(a[1]);
      const int64_t w = a[5];
      for (int64_t t = first; t < last; ++t) {
        X* out = x_at(a[0]) + t * w;
        const int64_t id = ids[t], lane = id % llmc_panels::kPanel;
        if (a[3] == 0) {
          std::memcpy(out, table + id * w, w * sizeof(X));
        } else if constexpr (std::is_same_v<X, float>) {         // [P, W, 32]
          const X* panel = table + id / llmc_panels::kPanel * w * llmc_panels::kPanel;
          for (int64_t j = 0; j < w; ++j) out[j] = panel[j * llmc_panels::kPanel + lane];
        } else {                                                   // [P, W/2, 32, 2]
          const X* panel = table + id / llmc_panels::kPanel * w * llmc_panels::kPanel;
          for (int64_t j = 0; j < w; ++j) out[j] = panel[(j / 2 * llmc_panels::kPanel + lane) * 2 + j % 2];
        }
      }
      break;
    }
    case kRmsnorm:
    case kAddRmsnorm: {
      const bool add = in.op == kAddRmsnorm;
      const int64_t w = a[add ? 5 : 3];
      for (int64_t t = first; t < last; ++t)
        llmc_rows::norm_row(x_at(a[add ? 2 : 1]) + t * w, add ? x_at(a[3]) + t * w : nullptr, x_at(a[add ? 4 : 2]),
                            add ? x_at(a[1]) + t * w : nullptr, x_at(a[0]) + t * w, w, static_cast<float>(in.f));
      break;
    }
    case kLinear: {
      const auto [begin, end] = share(a[6], tid, team);
      llmc_panels::panel_gemm_range(x_at(a[1]), x_at(a[2]), rows, a[4], a[3] < 0 ? nullptr : x_at(a[3]),
                                    x_at(a[0]), a[5], begin, end);
      break;
    }
    case kQLinear: {
      const int64_t k = a[6], group = a[10], bits = a[9];
      float* xf = b.widened.data();
      float* xsum = xf + rows * k;
      llmc_qpanels::widen_rows(x_at(a[1]), k, group, static_cast<int>(bits), xf, xsum, first, last);
#pragma omp barrier
      const llmc_qpanels::QPanels w{b.at[a[2]], reinterpret_cast<const c10::Half*>(b.at[a[3]]),
                                    a[4] < 0 ? nullptr : reinterpret_cast<const c10::Half*>(b.at[a[4]]), k, group,
                                    k / group};
      const auto [begin, end] = share(a[8], tid, team);
      X* bias = a[5] < 0 ? nullptr : x_at(a[5]);
      if (bits == 8)
        llmc_qpanels::qpanel_gemm_range<8>(xf, nullptr, w, rows, bias, x_at(a[0]), a[7], begin, end);
      else
        llmc_qpanels::qpanel_gemm_range<4>(xf, xsum, w, rows, bias, x_at(a[0]), a[7], begin, end);
      break;
    }
    case kRopeKvWrite: {
      const at::Tensor& cache = *b.tensor_at[a[10]];
      const llmc_rows::KvLayout s{a[13], a[14], a[15], llmc_cpu::kBlock, cache.size(2)};
      C* k_cache = reinterpret_cast<C*>(b.at[a[10]]) + a[12] * cache.stride(0);
      const int64_t width = a[7], half = s.head_dim / 2;
      const float* cos = reinterpret_cast<const float*>(b.at[a[8]]);
      const float* sin = reinterpret_cast<const float*>(b.at[a[9]]);
      const int64_t* slots = reinterpret_cast<const int64_t*>(b.at[a[11]]);
      for (int64_t t = first; t < last; ++t)
        llmc_rows::rope_token(x_at(a[1]) + t * width + a[4], x_at(a[2]) + t * width + a[5],
                              x_at(a[3]) + t * width + a[6], cos + t * half, sin + t * half, slots[t], k_cache,
                              k_cache + cache.stride(1), x_at(a[0]) + t * s.heads * s.head_dim, s, row);
      break;
    }
    case kSiluMul: {
      const int64_t width = a[5], n = a[6];
      for (int64_t t = first; t < last; ++t)
        llmc_rows::silu_mul_row(x_at(a[1]) + t * width + a[3], x_at(a[2]) + t * width + a[4], x_at(a[0]) + t * n, n);
      break;
    }
    case kDecodeAttention:
    case kPagedAttention:
      attend<X, C>(in, b, index, scratch);
      break;
    case kIndexSelect: {
      const int64_t* indices = reinterpret_cast<const int64_t*>(b.at[a[2]]);
      for (int64_t r = first; r < last; ++r)
        std::memcpy(x_at(a[0]) + r * a[3], x_at(a[1]) + indices[r] * a[3], a[3] * sizeof(X));
      break;
    }
    default:
      break;
  }
}

}  // namespace llmc_plan
