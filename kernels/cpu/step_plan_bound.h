// What every instruction of a step plan reads: the instruction, its args by name, and one run's
// addresses (Bound), shared by step_plan.h's instruction bodies and step_plan_gemm.h's.
#pragma once

#include <ATen/ATen.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <utility>
#include <vector>

#include "attention_work.h"
#include "decode_splits.h"
#include "panel_claims.h"
#include "row_picks.h"
#include "step_plan_isa.h"   // generated into the build folder by kernels/native.py
#include "team_barrier.h"

namespace llmc_plan {

struct Instr {
  Op op;                     // step_plan_isa.h's, numbered as kernels/step_plan_isa.py describes
  std::vector<int64_t> a;    // its args, read only as a[arg::<instruction>::<name>]
  double f;
};

// A generated kernel's C function (runtime/step_plan.py states its ABI): rows [first, last) of
// every output; ptrs and strides hold its inputs', then its outputs' first rows and row strides.
using GeneratedFn = void (*)(char* const* ptrs, const int64_t* strides, int64_t first, int64_t last);

// A "float" arg (kernels/step_plan_isa.py): a double that travels as its IEEE-754 bits.
inline double float_arg(int64_t bits) {
  double x;
  std::memcpy(&x, &bits, sizeof(x));
  return x;
}

// The args the two attention instructions share, read by name (a decode has no query_start_loc: -1).
struct AttentionArgs {
  int64_t out, q, cache, block_tables, seq_lens, query_start_loc, layer, heads, kv_heads, head_dim, window;
  double softcap;
};

inline AttentionArgs attention_args(const Instr& in) {
  const auto& a = in.a;
  if (in.op == kPagedAttention) {
    namespace A = arg::paged_attention;
    return {a[A::out],   a[A::q],     a[A::cache],    a[A::block_tables], a[A::seq_lens], a[A::query_start_loc],
            a[A::layer], a[A::heads], a[A::kv_heads], a[A::head_dim],     a[A::window],   float_arg(a[A::softcap])};
  }
  namespace A = arg::paged_decode_attention;
  return {a[A::out],   a[A::q],     a[A::cache],    a[A::block_tables], a[A::seq_lens], -1,
          a[A::layer], a[A::heads], a[A::kv_heads], a[A::head_dim],     a[A::window],   float_arg(a[A::softcap])};
}

// A generated kernel's values: the first of them, how many inputs, and how many in all.
struct GeneratedArgs {
  const int64_t* values;
  int64_t num_inputs, count;
};

inline GeneratedArgs generated_args(const Instr& in) {
  if (in.op == kLinearEpilogue) {
    namespace A = arg::linear_epilogue;
    return {in.a.data() + A::values, in.a[A::num_inputs], static_cast<int64_t>(in.a.size()) - A::values};
  }
  if (in.op == kQlinearEpilogue) {
    namespace A = arg::qlinear_epilogue;
    return {in.a.data() + A::values, in.a[A::num_inputs], static_cast<int64_t>(in.a.size()) - A::values};
  }
  namespace A = arg::generated;
  return {in.a.data() + A::values, in.a[A::num_inputs], static_cast<int64_t>(in.a.size()) - A::values};
}

// A GEMM with a generated epilogue (linear_epilogue, qlinear_epilogue): the GEMM's result and width,
// the epilogue's kernel, its window form, which of its values is the result, its width and reads.
struct EpilogueArgs {
  int64_t out, n, fn, window_fn, source, width, reads;
};

inline EpilogueArgs epilogue_args(const Instr& in) {
  const auto& a = in.a;
  if (in.op == kQlinearEpilogue) {
    namespace A = arg::qlinear_epilogue;
    return {a[A::out], a[A::n], a[A::fn], a[A::window_fn], a[A::source], a[A::width], a[A::reads]};
  }
  namespace A = arg::linear_epilogue;
  return {a[A::out], a[A::n], a[A::fn], a[A::window_fn], a[A::source], a[A::width], a[A::reads]};
}

// The value an instruction's rows are split by: its (first) result.
inline int64_t result_of(const Instr& in) {
  const auto& a = in.a;
  switch (in.op) {
    case kEmbedding: return a[arg::embedding::out];
    case kQembedding: return a[arg::qembedding::out];
    case kLinear: return a[arg::linear::out];
    case kLinearEpilogue: return a[arg::linear_epilogue::out];
    case kQlinear: return a[arg::qlinear::out];
    case kQlinearEpilogue: return a[arg::qlinear_epilogue::out];
    case kRopeKvWrite: return a[arg::rope_kv_write::q_out];
    case kIndexSelect: return a[arg::index_select::out];
    case kAllReduce: return a[arg::all_reduce::out];
    case kAllGather: return a[arg::all_gather::out];
    case kGenerated: {
      const GeneratedArgs g = generated_args(in);
      return g.values[g.num_inputs];
    }
    case kPagedDecodeAttention:
    case kPagedAttention:
    case kNumOps: break;
  }
  return attention_args(in).out;
}

// One run's addresses and the attention work every attention call of the step shares. The plan keeps
// one Bound from run to run (StepPlan::reuse empties it) so that its vectors keep their room: a decode
// step allocating them afresh paid a malloc and a free per generated kernel with the caches cold.
struct Bound {
  int64_t rows, seqs;                         // the step's tokens, and the rows a gather makes
  std::vector<char*> at;                      // value id -> its first row
  std::vector<int64_t> rows_at;               // value id -> its rows (activations)
  std::vector<int64_t> stride_at;             // value id -> elements from one row to the next (0: one row for all)
  std::vector<const at::Tensor*> tensor_at;   // value id -> the input tensor (inputs)
  std::vector<at::Tensor> inputs;
  std::vector<llmc_cpu::Item> items;          // attention's work items, most costly first
  std::vector<int32_t> qsl;                   // each sequence's first query row (decode: 0, 1, ..., S)
  mutable llmc_cpu::DecodeSplits splits;      // where split decode items leave their parts
  std::vector<std::vector<char*>> ptrs;       // per instruction: a generated kernel's ptrs
  std::vector<std::vector<int64_t>> strides;  // and strides (empty for the others)
  mutable std::vector<float> widened;         // a quantized GEMM's x in fp32, then int4's group sums, or
                                              // x quantized (the team writes it)
  int64_t widened_alone = 0;                  // > 0: a small step, each thread's own x scratch of this
                                              // many floats, after the team's (x_scratch)
  mutable std::vector<float> dequantized;   // each thread's panels of a prompt's quantized GEMM: bf16
  int64_t dequantized_per_thread = 0;       // (amx_dequant_gemm.h) or fp32 (f32_dequant_gemm.h), this many
                                            // floats' room each
  std::unique_ptr<std::atomic<int64_t>[]> next;   // per instruction: the next attention item to take
  std::unique_ptr<ShareClaims[]> claims;       // per instruction, claim_team of them: a GEMV's panels
  int claim_team = 0;                         // (panel_claims.h; the GEMMs' shares of the others unused)
  size_t counters = 0;                        // room in claims (and in next: one per instruction)
  llmc_cpu::TeamBarrier* barrier = nullptr;   // the team's (team_barrier.h), between kernels and inside one
  mutable std::vector<llmc_cpu::Pick> picks;  // a picking GEMM's partials, [team][rows] (step_plan_gemm.h)
};

// A thread's scratch in a run, kept by the plan from run to run like Bound: attention's, and a
// rotation's normed head and rotated row.
struct alignas(64) TeamScratch {
  llmc_cpu::Scratch attention;
  std::vector<float> row;
};

// A quantized GEMM's x of at most this many floats of scratch (rows x (K + K/G)) is prepared (quantized or
// widened) by every thread for itself, with no barrier: a few thousand values take about as long as a
// barrier, and a batch-1 decode met one per quantized GEMM while one thread did the whole token.
constexpr int64_t kAloneFloats = 4096;

// Where thread `tid` prepares a quantized GEMM's x: the team's scratch, or its own in a small step.
inline float* x_scratch(const Bound& b, int tid) {
  return b.widened.data() + (b.widened_alone ? (1 + tid) * b.widened_alone : 0);
}

}  // namespace llmc_plan
