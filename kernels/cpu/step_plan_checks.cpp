// A step plan's checks (step_plan.cpp states what a plan is): each instruction's args when it is
// added, and before every run what each instruction will touch against that run's inputs (ids,
// slots, block tables, lengths, shapes), so that nothing inside the parallel region can fail; and
// the collectives, run on the team's first thread.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <string>
#include <vector>

#include "plan_collectives.h"
#include "step_plan_program.h"

namespace llmc_plan {

// A quantized table's constants hold every row the instruction may read, in its layout.
void StepPlan::check_qembedding(const Instr& in) const {
  namespace A = arg::qembedding;
  const auto& a = in.a;
  const int64_t bits = a[A::bits], width = a[A::width], group = a[A::group], layout = a[A::layout];
  TORCH_CHECK((bits == 8 || (bits == 4 && width % 32 == 0)) && group > 0 && width % group == 0 &&
                  layout >= 0 && layout <= 2 && a[A::vocab] > 0,
              "qembedding of ", bits, " bits, width ", width, ", group ", group, " and layout ", layout,
              " is not a quantized table the plan reads");
  const int64_t rows = layout == 0 ? a[A::vocab] : (a[A::vocab] + llmc_panels::kPanel - 1) / llmc_panels::kPanel *
                                                        llmc_panels::kPanel;
  const auto bytes = [&](int64_t id) {   // a constant's bytes, -1 for any other value
    return id >= 0 && values_[id].place == kConstant ? constants_[values_[id].index].nbytes() : int64_t{-1};
  };
  TORCH_CHECK(bytes(a[A::codes]) == rows * width * bits / 8 && bytes(a[A::scales]) == rows * (width / group) * 2 &&
                  (a[A::mins] < 0 ? bits == 8 : bytes(a[A::mins]) == rows * (width / group) * 2),
              "qembedding's codes, scales and mins are not constants of ", rows, " rows of ", width, " values");
}

// A GEMM's picks are an index output with out's rows, which only it writes.
void StepPlan::check_picks(const Instr& in) {
  const int64_t picks = in.op == kLinear ? in.a[arg::linear::picks] : in.a[arg::qlinear::picks];
  const int64_t out = in.op == kLinear ? in.a[arg::linear::out] : in.a[arg::qlinear::out];
  if (picks < 0) return;
  TORCH_CHECK(values_[picks].place == kOutput && values_[picks].indices && values_[picks].seqs == values_[out].seqs,
              "a GEMM's picks must be an index output (index_output) with the rows of its out");
  for (const Instr& earlier : code_)
    TORCH_CHECK(!(earlier.op == kLinear && earlier.a[arg::linear::picks] == picks) &&
                    !(earlier.op == kQlinear && earlier.a[arg::qlinear::picks] == picks),
                "two GEMMs write the same picks");
  picks_ = true;
}

// A generated kernel writes temporaries or outputs, and every activation it touches has the rows
// of its first output.
void StepPlan::check_generated(const Instr& in) const {
  const GeneratedArgs g = generated_args(in);
  const int64_t fn = in.op == kGenerated ? in.a[arg::generated::fn] : epilogue_args(in).fn;
  TORCH_CHECK(fn != 0, "a generated kernel's fn is a null address");
  TORCH_CHECK(g.num_inputs >= 0 && g.num_inputs < g.count, "a generated kernel of ", g.count,
              " values cannot take ", g.num_inputs, " of them as inputs and write at least one");
  const bool seqs = values_[g.values[g.num_inputs]].seqs;
  for (int64_t i = 0; i < g.count; ++i) {
    const Value& v = values_[g.values[i]];
    const bool activation = v.place == kTemporary || (v.place == kOutput && !v.indices);
    TORCH_CHECK(i < g.num_inputs || activation, "output ", i - g.num_inputs,
                " of a generated kernel is not a temporary or an output of the plan");
    TORCH_CHECK(!activation || v.seqs == seqs, "value ", i,
                " of a generated kernel has other rows than its first output");
  }
}

// A GEMM's epilogue (linear_epilogue, qlinear_epilogue): a window function, the GEMM's result among its inputs, and
// N = reads x W with W whole panels; then its values as a generated kernel's.
void StepPlan::check_linear_epilogue(const Instr& in) const {
  const EpilogueArgs e = epilogue_args(in);
  const GeneratedArgs g = generated_args(in);
  TORCH_CHECK(e.window_fn != 0, "a GEMM epilogue's window_fn is a null address");
  TORCH_CHECK(e.source >= 0 && e.source < g.num_inputs && g.values[e.source] == e.out,
              "a GEMM epilogue's source ", e.source, " is not the input that is the GEMM's result");
  TORCH_CHECK(e.width > 0 && e.width % llmc_panels::kPanel == 0 && e.reads >= 1 && e.reads * e.width == e.n,
              "a GEMM epilogue of width ", e.width, " reading ", e.reads, " column groups does not fit a ", e.n,
              "-wide GEMM in whole panels");
  TORCH_CHECK(in.op != kQlinearEpilogue || in.a[arg::qlinear_epilogue::picks] == -1,
              "a quantized GEMM with an epilogue picks nothing (its result is the epilogue's)");
  check_generated(in);
}

// A collective reads an activation and writes one `size` times as wide (all_gather) or as wide
// (all_reduce), on the group set_group named.
void StepPlan::check_collective(const Instr& in) const {
  const bool gather = in.op == kAllGather;
  const int64_t out = gather ? in.a[arg::all_gather::out] : in.a[arg::all_reduce::out];
  const int64_t x = gather ? in.a[arg::all_gather::x] : in.a[arg::all_reduce::x];
  const int64_t width = gather ? in.a[arg::all_gather::width] : in.a[arg::all_reduce::width];
  const int64_t size = gather ? in.a[arg::all_gather::size] : in.a[arg::all_reduce::size];
  TORCH_CHECK(!group_.empty(), kOpNames[in.op], " needs the plan's process group: call set_group first");
  const auto activation = [&](int64_t id) { return values_[id].place == kTemporary || values_[id].place == kOutput; };
  TORCH_CHECK(size >= 1 && activation(x) && activation(out) && values_[x].width == width &&
                  values_[out].width == (gather ? size : 1) * width && values_[x].seqs == values_[out].seqs,
              kOpNames[in.op], " of ", size, " ranks does not read an activation of ", width,
              " values and write one of ", (gather ? size : 1) * width);
}

// Instruction `in`'s collective on this run's rows (the team's first thread): "" or why it failed.
std::string StepPlan::run_collective(const Instr& in, const Bound& b) const {
  const bool gather = in.op == kAllGather;
  const int64_t out = gather ? in.a[arg::all_gather::out] : in.a[arg::all_reduce::out];
  const int64_t x = gather ? in.a[arg::all_gather::x] : in.a[arg::all_reduce::x];
  const int64_t rows = b.rows_at[x], width = values_[x].width, size = in.a[arg::all_gather::size];
  const auto options = at::TensorOptions().dtype(bf16_ ? at::kBFloat16 : at::kFloat);
  const at::Tensor x_rows = at::from_blob(b.at[x], {rows, width}, options);
  const at::Tensor out_rows = at::from_blob(b.at[out], {rows, values_[out].width}, options);
  return gather ? plan_all_gather(x_rows, out_rows, size, group_) : plan_all_reduce(x_rows, out_rows, group_);
}

// What instruction `index` (`in`) will touch, checked against this run's inputs.
void StepPlan::check(const Instr& in, int64_t index, Bound& b) const {
  const auto& a = in.a;
  if (in.op == kEmbedding || in.op == kQembedding) {
    const bool q = in.op == kQembedding;
    const int64_t vocab = q ? a[arg::qembedding::vocab] : a[arg::embedding::vocab];
    const at::Tensor& ids = *b.tensor_at[q ? a[arg::qembedding::ids] : a[arg::embedding::ids]];
    TORCH_CHECK(ids.numel() == b.rows, "the step has ", b.rows, " tokens but ", ids.numel(), " token ids");
    const int64_t* p = ids.const_data_ptr<int64_t>();
    for (int64_t t = 0; t < b.rows; ++t)
      TORCH_CHECK(p[t] >= 0 && p[t] < vocab, "token id ", p[t], " is outside the vocabulary of ", vocab);
  } else if (in.op == kIndexSelect) {
    namespace A = arg::index_select;
    const at::Tensor& indices = *b.tensor_at[a[A::indices]];
    const int64_t from = b.rows_at[a[A::x]], rows = b.rows_at[a[A::out]];
    TORCH_CHECK(indices.numel() == rows, "index_select needs ", rows, " indices, not ", indices.numel());
    const int64_t* p = indices.const_data_ptr<int64_t>();
    for (int64_t s = 0; s < indices.numel(); ++s)
      TORCH_CHECK(p[s] >= 0 && p[s] < from, "row index ", p[s], " is outside the step's ", from, " rows");
  } else if (in.op == kRopeKvWrite) {
    check_rope_kv_write(in, b);
  } else if (in.op == kPagedDecodeAttention || in.op == kPagedAttention) {
    const AttentionArgs x = attention_args(in);
    const at::Tensor& cache = *b.tensor_at[x.cache];
    check_cache(cache, x.layer, x.kv_heads, x.head_dim);
    if (b.qsl.empty()) plan_attention(in, b, cache);
  } else if (in.op == kGenerated || in.op == kLinearEpilogue || in.op == kQlinearEpilogue) {
    bind_generated(in, index, b);
  }
}

// A rotation's tables hold every position the step turns by; its slots are within the cache.
void StepPlan::check_rope_kv_write(const Instr& in, const Bound& b) const {
  const auto& a = in.a;
  namespace A = arg::rope_kv_write;
  const at::Tensor& cache = *b.tensor_at[a[A::cache]];
  check_cache(cache, a[A::layer], a[A::kv_heads], a[A::head_dim]);
  const at::Tensor& slots = *b.tensor_at[a[A::slots]];
  TORCH_CHECK(a[A::rotary_dim] > 0 && a[A::rotary_dim] % 2 == 0 && a[A::rotary_dim] <= a[A::head_dim],
              "rope_kv_write's rotary_dim ", a[A::rotary_dim], " is not even and within head_dim");
  const at::Tensor &positions = *b.tensor_at[a[A::positions]], &cos = *b.tensor_at[a[A::cos]];
  const int64_t half = a[A::rotary_dim] / 2, turns = cos.numel() / half;   // the positions the tables hold
  TORCH_CHECK(slots.numel() == b.rows && positions.numel() == b.rows, "slot_mapping and positions need one entry "
              "per token");
  TORCH_CHECK(cos.numel() % half == 0 && b.tensor_at[a[A::sin]]->numel() == cos.numel(), "the RoPE tables must be "
              "[P, ", half, "] cos and sin");
  const int64_t* turn = positions.const_data_ptr<int64_t>();
  for (int64_t t = 0; t < b.rows; ++t)
    TORCH_CHECK(turn[t] >= 0 && turn[t] < turns, "position ", turn[t], " is outside the RoPE tables' ", turns,
                " rows");
  const int64_t span = a[A::norm_span], d = a[A::head_dim];
  TORCH_CHECK(span >= 0 && span <= 2, "rope_kv_write's norm_span ", span, " is not 0, 1 or 2");
  TORCH_CHECK(a[A::norm_product] == 0 || a[A::norm_product] == 1, "rope_kv_write's norm_product ",
              a[A::norm_product], " is not 0 or 1");
  const auto elems = [&](int64_t id) {   // a norm weight: a plan constant
    return id >= 0 && values_[id].place == kConstant ? constants_[values_[id].index].numel() : -1;
  };
  if (span)
    TORCH_CHECK(elems(a[A::q_norm]) == (span == 1 ? d : a[A::heads] * d) &&
                    elems(a[A::k_norm]) == (span == 1 ? d : a[A::kv_heads] * d),
                "rope_kv_write's q_norm and k_norm are not constants that fit its norm_span ", span);
  const int64_t* p = slots.const_data_ptr<int64_t>();
  for (int64_t t = 0; t < b.rows; ++t)
    TORCH_CHECK(p[t] < cache.size(2) * llmc_cpu::kBlock, "slot ", p[t], " is outside the cache's ",
                cache.size(2) * llmc_cpu::kBlock, " slots");
}

void StepPlan::check_cache(const at::Tensor& cache, int64_t layer, int64_t kv_heads, int64_t d) const {
  TORCH_CHECK(cache.dim() == 6 && cache.size(4) == llmc_cpu::kBlock && cache.size(3) == kv_heads &&
                  cache.size(5) == d + (int8_cache_ ? llmc_cpu::kScaleBytes : 0) && layer < cache.size(0),
              "the KV cache ", cache.sizes(), " is not the [L, 2, NB, ", kv_heads, ", 16, ", d,
              "] cache this plan was built for");
}

// A generated kernel's ptrs and strides for this run; a constant or input it reads row by row
// has at least the rows of its outputs.
void StepPlan::bind_generated(const Instr& in, int64_t index, Bound& b) const {
  const GeneratedArgs g = generated_args(in);
  const int64_t rows = b.rows_at[g.values[g.num_inputs]];
  for (int64_t i = 0; i < g.count; ++i) {
    const int64_t id = g.values[i];
    b.ptrs[index].push_back(b.at[id]);
    b.strides[index].push_back(b.stride_at[id]);
    const Value& v = values_[id];
    if (v.place == kConstant || v.place == kInput) {
      const at::Tensor& t = v.place == kConstant ? constants_[v.index] : *b.tensor_at[id];
      TORCH_CHECK(b.stride_at[id] == 0 || t.size(0) >= rows, "input ", i, " of a generated kernel has ", t.size(0),
                  " rows, fewer than its outputs' ", rows);
    }
  }
}

// The first attention call's inputs, checked, and the step's work items for every layer's call:
// each sequence's query rows (a decode step's one each), the reads within the cache, the items
// most costly first.
void StepPlan::plan_attention(const Instr& in, Bound& b, const at::Tensor& cache) const {
  const AttentionArgs a = attention_args(in);
  const at::Tensor& tables = *b.tensor_at[a.block_tables];
  const at::Tensor& lens = *b.tensor_at[a.seq_lens];
  const int64_t num_seqs = lens.numel();
  TORCH_CHECK(tables.dim() == 2 && tables.size(0) == num_seqs, "attention needs a block-table row per sequence");
  if (in.op == kPagedDecodeAttention) {
    TORCH_CHECK(b.rows == num_seqs, "a decode step has one token per sequence");
    for (int64_t s = 0; s <= num_seqs; ++s) b.qsl.push_back(static_cast<int32_t>(s));
  } else {
    const at::Tensor& starts = *b.tensor_at[a.query_start_loc];
    TORCH_CHECK(starts.numel() == num_seqs + 1, "query_start_loc needs S+1 entries");
    b.qsl.assign(starts.const_data_ptr<int32_t>(), starts.const_data_ptr<int32_t>() + num_seqs + 1);
  }
  const int32_t* seq_lens = lens.const_data_ptr<int32_t>();
  llmc_cpu::check_layout(b.qsl.data(), seq_lens, tables.const_data_ptr<int32_t>(), num_seqs, tables.size(1), b.rows,
                         cache.size(2));
  const auto items =
      llmc_cpu::plan_items(b.qsl.data(), seq_lens, num_seqs, cache.size(3), true, at::get_num_threads());
  for (int64_t i : llmc_cpu::by_cost(items, seq_lens, b.qsl.data())) b.items.push_back(items[i]);
  b.splits.reserve(b.items, a.heads, a.head_dim);
}

}  // namespace llmc_plan
