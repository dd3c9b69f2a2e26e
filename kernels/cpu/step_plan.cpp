// A step plan: one entry graph lowered to a list of native kernel calls (runtime/step_plan.py does
// the lowering and states the contract), run in one OpenMP parallel region by one team of
// threads with a barrier between calls (team_barrier.h: it spins a bounded time, then sleeps). A
// decode step of a small model is a few hundred short calls; launched one by one from Python, each
// pays the interpreter, the dispatcher, an output allocation and a fork/join of the threads, which
// together cost as much as a quarter of the step. Here a step costs one call from Python, and a
// barrier per kernel.
//
// Values live in four places: constants (weights, held by the plan), the step's inputs (given to
// run), temporaries (rows of one arena the plan keeps between runs; values whose lives do not
// overlap share a register, as runtime/step_plan.py assigned them) and outputs (fresh tensors
// each run). Every
// activation is [rows, width] in the plan's dtype (f32 or bf16), its rows the step's tokens or, after
// a gather (index_select), the rows gathered (one per sequence, or more where a step asks for
// logits at several positions); the KV cache is the plan's dtype or int8. Everything a kernel will read or write is checked before the parallel region (ids,
// slots, block tables, lengths, shapes), so nothing inside it can fail.
//
// Instructions: kernels/step_plan_isa.py describes each one (its args by name and role, in
// order, and its float arg); the step_plan_isa.h generated from it (kernels/native.py writes it
// into the build folder) numbers them and names their args, and this file and step_plan.h read an
// arg only by its name (arg::linear::bias), so a layout the description lacks does not compile.
// `generated` calls a generated kernel's C function (runtime/step_plan.py states its ABI) on the
// team's split of its first output's rows. `all_reduce` and `all_gather` (tensor parallelism,
// plan_collectives.h) run on the team's first thread, on the group set_group named, while the others
// wait at the barrier; one that fails stops the team after it and is raised once the region ends.
//
// The team splits a GEMM's panels, the tokens of a row op, and takes attention's work items
// (attention_work.h) one at a time; a quantized GEMM first widens or quantizes x into the run's
// scratch (split, then a barrier; in a small step every thread all of x for itself, no barrier), as the
// op does (step_plan.h: each thread's work).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <omp.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <chrono>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

#include "plan_collectives.h"
#include "step_plan.h"

namespace {

using namespace llmc_plan;  // Op, arg::, the tables of step_plan_isa.h; Instr, Bound

enum Place : int64_t { kConstant, kInput, kTemporary, kOutput };

struct Value {
  Place place;
  int64_t index;   // constant, input or output number; a temporary's register
  int64_t width;   // elements per row (temporaries and outputs)
  bool seqs;       // rows are the gathered rows (IR dim R, logit rows), not the step's tokens
  int64_t stride;  // elements from one row to the next: an activation's width, a constant's row
                   // stride (0 if 1-D: one row for all); an input's is taken at each run
};

class StepPlan : public torch::CustomClassHolder {
 public:
  StepPlan(bool bf16, bool int8_cache) : bf16_(bf16), int8_cache_(int8_cache) {}

  int64_t constant(at::Tensor t) {
    TORCH_CHECK(t.is_contiguous() && t.device().is_cpu(), "a plan constant must be a contiguous CPU tensor");
    const int64_t stride = t.dim() >= 2 ? t.stride(0) : 0;
    constants_.push_back(std::move(t));
    const int64_t id = add_value({kConstant, static_cast<int64_t>(constants_.size()) - 1, 0, false, stride});
    constant_at_[id] = static_cast<char*>(constants_.back().data_ptr());
    return id;
  }
  int64_t input(int64_t index, at::Tensor like) {
    input_types_.resize(std::max<int64_t>(input_types_.size(), index + 1), at::kFloat);
    input_types_[index] = like.scalar_type();
    return add_value({kInput, index, 0, false, 0});
  }
  int64_t temporary(int64_t reg, int64_t width, bool seqs) {
    for (auto* bytes : {&reg_bytes_, &reg_seq_bytes_}) bytes->resize(std::max<int64_t>(bytes->size(), reg + 1), 0);
    int64_t& widest = (seqs ? reg_seq_bytes_ : reg_bytes_)[reg];
    widest = std::max(widest, (width * element_bytes() + 63) / 64 * 64);
    return add_value({kTemporary, reg, width, seqs, width});
  }
  int64_t output(int64_t width, bool seqs) { return add_value({kOutput, num_outputs_++, width, seqs, width}); }
  // The process group (c10d's name for it) the plan's collectives run on.
  void set_group(std::string name) { group_ = std::move(name); }
  // Instruction `op` (step_plan_isa.h's numbering) with its args, checked against the description.
  void add(int64_t op, std::vector<int64_t> args, double f) {
    TORCH_CHECK(op >= 0 && op < kNumOps, "plan op ", op, " is not one of step_plan_isa.h's ", kNumOps,
                " instructions");
    const int64_t count = args.size(), fixed = kFixedArgs[op];
    TORCH_CHECK(kVariadic[op] ? count >= fixed : count == fixed, "plan instruction ", kOpNames[op], " takes ", fixed,
                kVariadic[op] ? " args and a list of values" : " args", ", not ", count);
    const auto is_value = [&](int64_t v) { return v >= 0 && v < static_cast<int64_t>(values_.size()); };
    for (int64_t i = 0; i < fixed; ++i) {
      TORCH_CHECK(!(kValueArgs[op] >> i & 1) || is_value(args[i]), "arg ", kArgNames[op][i], " of ", kOpNames[op],
                  " is not a value");
      TORCH_CHECK(!(kOptionalArgs[op] >> i & 1) || args[i] == -1 || is_value(args[i]), "arg ", kArgNames[op][i],
                  " of ", kOpNames[op], " is neither -1 nor a value");
    }
    for (int64_t i = fixed; i < count; ++i)
      TORCH_CHECK(is_value(args[i]), "value ", i - fixed, " of ", kOpNames[op], "'s list is not a value");
    Instr in{static_cast<Op>(op), std::move(args), f};
    note(in);
    code_.push_back(std::move(in));
  }
  std::vector<at::Tensor> run(std::vector<at::Tensor> inputs, int64_t rows, int64_t seqs) {
    return std::get<0>(execute(std::move(inputs), rows, seqs, false));
  }
  // run, and each instruction's seconds (from the barrier before it to the one after).
  std::tuple<std::vector<at::Tensor>, std::vector<double>> run_timed(std::vector<at::Tensor> inputs, int64_t rows,
                                                                     int64_t seqs) {
    return execute(std::move(inputs), rows, seqs, true);
  }

 private:
  int64_t add_value(Value v) {
    values_.push_back(v);
    constant_at_.push_back(nullptr);
    return static_cast<int64_t>(values_.size()) - 1;
  }
  int64_t element_bytes() const { return bf16_ ? 2 : 4; }
  void note(const Instr& in);
  void check_generated(const Instr& in) const;
  void check_collective(const Instr& in) const;
  std::string run_collective(const Instr& in, const Bound& b) const;
  void check_qembedding(const Instr& in) const;

  std::tuple<std::vector<at::Tensor>, std::vector<double>> execute(std::vector<at::Tensor> inputs, int64_t rows,
                                                                   int64_t seqs, bool timed);
  void plan_attention(const Instr& in, Bound& b, const at::Tensor& cache) const;
  std::vector<at::Tensor> bind(Bound& b);
  void check(const Instr& in, int64_t index, Bound& b) const;
  void check_cache(const at::Tensor& cache, int64_t layer, int64_t kv_heads, int64_t head_dim) const;
  void bind_generated(const Instr& in, int64_t index, Bound& b) const;

  bool bf16_, int8_cache_;
  std::vector<at::Tensor> constants_;
  std::vector<at::ScalarType> input_types_;
  std::vector<Value> values_;
  std::vector<char*> constant_at_;          // value id -> a constant's address (null for the others)
  std::vector<int64_t> reg_bytes_;          // bytes of one row of each register's widest per-token value
  std::vector<int64_t> reg_seq_bytes_;      // and of its widest per-sequence value
  at::Tensor arena_;                        // the temporaries, kept between runs
  std::mutex running_;                      // one run at a time uses the arena
  std::vector<Instr> code_;
  std::vector<int64_t> attention_meta_;     // attention's kind and the tables, lengths (and query starts) it reads
  int64_t max_head_dim_ = 16;
  int64_t widened_per_row_ = 0;             // floats of fp32 scratch a quantized GEMM needs per row
  int64_t num_outputs_ = 0;
  std::string group_;                       // the collectives' process group (set_group)
};

// Addresses of every value for the run's rows: constants where they are, the arena's registers
// laid out one after another, each as large as its largest value (rows rounded up to 64 bytes),
// and fresh output tensors. The arena is kept from run to run and grown when a run needs more.
std::vector<at::Tensor> StepPlan::bind(Bound& b) {
  int64_t bytes = 0;
  std::vector<int64_t> reg_offset(reg_bytes_.size());
  for (size_t r = 0; r < reg_bytes_.size(); ++r) {
    reg_offset[r] = bytes;
    bytes += std::max(reg_bytes_[r] * b.rows, reg_seq_bytes_[r] * b.seqs);
  }
  if (!arena_.defined() || arena_.numel() < bytes)
    arena_ = at::empty({std::max<int64_t>(bytes, 1)}, at::TensorOptions().dtype(at::kByte));
  char* arena = static_cast<char*>(arena_.data_ptr());
  std::vector<at::Tensor> outputs(num_outputs_);
  b.at = constant_at_;
  b.rows_at.assign(values_.size(), 0);
  b.stride_at.assign(values_.size(), 0);
  b.tensor_at.assign(values_.size(), nullptr);
  for (size_t i = 0; i < values_.size(); ++i) {
    const Value& v = values_[i];
    b.rows_at[i] = v.seqs ? b.seqs : b.rows;
    b.stride_at[i] = v.stride;
    if (v.place == kInput) {
      b.tensor_at[i] = &b.inputs[v.index];
      b.at[i] = static_cast<char*>(b.inputs[v.index].data_ptr());
      b.stride_at[i] = b.inputs[v.index].dim() >= 1 ? b.inputs[v.index].stride(0) : 0;
    } else if (v.place == kTemporary) {
      b.at[i] = arena + reg_offset[v.index];
    } else if (v.place == kOutput) {
      outputs[v.index] = at::empty({b.rows_at[i], v.width},
                                   at::TensorOptions().dtype(bf16_ ? at::kBFloat16 : at::kFloat));
      b.at[i] = static_cast<char*>(outputs[v.index].data_ptr());
    }
  }
  return outputs;
}

// What the plan keeps for an instruction's kind: the scratch a rotation and a quantized GEMM
// need, the one layout every attention call shares; a generated kernel's values, checked.
void StepPlan::note(const Instr& in) {
  const auto& a = in.a;
  if (in.op == kRopeKvWrite) max_head_dim_ = std::max(max_head_dim_, a[arg::rope_kv_write::head_dim]);
  if (in.op == kQlinear) {
    namespace A = arg::qlinear;
    widened_per_row_ = std::max(widened_per_row_, a[A::k] + a[A::k] / a[A::group]);
  }
  if (in.op == kPagedDecodeAttention || in.op == kPagedAttention) {   // the step's work items: made once, for every layer
    const AttentionArgs x = attention_args(in);
    const std::vector<int64_t> meta{in.op, x.block_tables, x.seq_lens, x.query_start_loc};
    TORCH_CHECK(attention_meta_.empty() || attention_meta_ == meta,
                "every attention of a plan must be of one kind and read the same block tables and lengths");
    TORCH_CHECK(x.window >= 0 && x.window <= INT32_MAX && x.softcap >= 0 && std::isfinite(x.softcap),
                "attention window ", x.window, " and softcap ", x.softcap, " must be 0 (off) or positive");
    attention_meta_ = meta;
  }
  if (in.op == kGenerated) check_generated(in);
  if (in.op == kAllReduce || in.op == kAllGather) check_collective(in);
  if (in.op == kQembedding) check_qembedding(in);
}

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

// A generated kernel writes temporaries or outputs, and every activation it touches has the rows
// of its first output.
void StepPlan::check_generated(const Instr& in) const {
  const GeneratedArgs g = generated_args(in);
  TORCH_CHECK(in.a[arg::generated::fn] != 0, "a generated kernel's fn is a null address");
  TORCH_CHECK(g.num_inputs >= 0 && g.num_inputs < g.count, "a generated kernel of ", g.count,
              " values cannot take ", g.num_inputs, " of them as inputs and write at least one");
  const bool seqs = values_[g.values[g.num_inputs]].seqs;
  for (int64_t i = 0; i < g.count; ++i) {
    const Value& v = values_[g.values[i]];
    const bool activation = v.place == kTemporary || v.place == kOutput;
    TORCH_CHECK(i < g.num_inputs || activation, "output ", i - g.num_inputs,
                " of a generated kernel is not a temporary or an output of the plan");
    TORCH_CHECK(!activation || v.seqs == seqs, "value ", i, " of a generated kernel has other rows than its first output");
  }
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
    namespace A = arg::rope_kv_write;
    const at::Tensor& cache = *b.tensor_at[a[A::cache]];
    check_cache(cache, a[A::layer], a[A::kv_heads], a[A::head_dim]);
    const at::Tensor& slots = *b.tensor_at[a[A::slots]];
    TORCH_CHECK(a[A::rotary_dim] > 0 && a[A::rotary_dim] % 2 == 0 && a[A::rotary_dim] <= a[A::head_dim],
                "rope_kv_write's rotary_dim ", a[A::rotary_dim], " is not even and within head_dim");
    TORCH_CHECK(slots.numel() == b.rows && b.tensor_at[a[A::cos]]->numel() == b.rows * a[A::rotary_dim] / 2,
                "slot_mapping and the RoPE tables need one row per token");
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
  } else if (in.op == kPagedDecodeAttention || in.op == kPagedAttention) {
    const AttentionArgs x = attention_args(in);
    const at::Tensor& cache = *b.tensor_at[x.cache];
    check_cache(cache, x.layer, x.kv_heads, x.head_dim);
    if (b.qsl.empty()) plan_attention(in, b, cache);
  } else if (in.op == kGenerated) {
    bind_generated(in, index, b);
  }
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
  const auto items = llmc_cpu::plan_items(b.qsl.data(), num_seqs, cache.size(3), true, at::get_num_threads());
  for (int64_t i : llmc_cpu::by_cost(items, seq_lens, b.qsl.data())) b.items.push_back(items[i]);
}

std::tuple<std::vector<at::Tensor>, std::vector<double>> StepPlan::execute(std::vector<at::Tensor> inputs,
                                                                           int64_t rows, int64_t seqs, bool timed) {
  TORCH_CHECK(inputs.size() >= input_types_.size(), "the plan takes ", input_types_.size(), " inputs, not ",
              inputs.size());
  for (size_t i = 0; i < input_types_.size(); ++i)
    TORCH_CHECK(inputs[i].is_contiguous() && inputs[i].device().is_cpu() && inputs[i].scalar_type() == input_types_[i],
                "plan input ", i, " must be a contiguous CPU ", input_types_[i], " tensor, not ",
                inputs[i].scalar_type());
  const std::lock_guard<std::mutex> hold(running_);
  Bound b;
  b.rows = rows;
  b.seqs = seqs;
  b.inputs = std::move(inputs);
  std::vector<at::Tensor> outputs = bind(b);
  const int64_t widened = widened_per_row_ * std::max(rows, seqs);    // the team's x scratch
  b.widened_alone = widened <= kAloneFloats ? widened : 0;             // and each thread's own, in a small step
  b.widened.resize(widened + b.widened_alone * at::get_num_threads());
  b.ptrs.assign(code_.size(), {});
  b.strides.assign(code_.size(), {});
  for (size_t i = 0; i < code_.size(); ++i) check(code_[i], i, b);
  b.next.reset(new std::atomic<int64_t>[code_.size()]);
  for (size_t i = 0; i < code_.size(); ++i) b.next[i] = 0;
  using Clock = std::chrono::steady_clock;
  std::vector<Clock::time_point> stamps(timed ? code_.size() + 1 : 0);
  llmc_cpu::TeamBarrier barrier;            // spins a while, then sleeps (team_barrier.h)
  b.barrier = &barrier;
  std::atomic<int64_t> failed_at{-1};       // a collective that failed: the team stops after it
  std::string failure;
  const auto typed = [&](auto* x_type, auto* c_type) {
    using X = std::remove_pointer_t<decltype(x_type)>;
    using C = std::remove_pointer_t<decltype(c_type)>;
#pragma omp parallel num_threads(at::get_num_threads())
    {
      const int tid = omp_get_thread_num(), team = omp_get_num_threads();
      llmc_cpu::Scratch scratch;
      std::vector<float> row(2 * max_head_dim_);  // a rotation's scratch: its normed head and rotated row
#pragma omp single
      barrier.reset(team);
      if (timed && tid == 0) stamps[0] = Clock::now();
      for (size_t i = 0; i < code_.size(); ++i) {
        if (code_[i].op == kAllReduce || code_[i].op == kAllGather) {
          if (tid == 0 && !(failure = run_collective(code_[i], b)).empty()) failed_at = static_cast<int64_t>(i);
        } else {
          llmc_plan::run_instruction<X, C>(code_[i], i, b, tid, team, scratch, row.data());
        }
        barrier.wait();
        if (timed && tid == 0) stamps[i + 1] = Clock::now();
        if (failed_at.load() == static_cast<int64_t>(i)) break;
      }
    }
  };
  if (bf16_ && int8_cache_)
    typed(static_cast<c10::BFloat16*>(nullptr), static_cast<int8_t*>(nullptr));
  else if (bf16_)
    typed(static_cast<c10::BFloat16*>(nullptr), static_cast<c10::BFloat16*>(nullptr));
  else if (int8_cache_)
    typed(static_cast<float*>(nullptr), static_cast<int8_t*>(nullptr));
  else
    typed(static_cast<float*>(nullptr), static_cast<float*>(nullptr));
  TORCH_CHECK(failed_at.load() < 0, "the step plan's ", kOpNames[code_[std::max<int64_t>(failed_at.load(), 0)].op],
              " failed: ", failure);
  std::vector<double> seconds;
  for (size_t i = 0; i + 1 < stamps.size(); ++i)
    seconds.push_back(std::chrono::duration<double>(stamps[i + 1] - stamps[i]).count());
  return {outputs, seconds};
}

// The description (kernels/step_plan_isa.py) this build's step_plan_isa.h was rendered from.
std::string step_plan_isa_hash() { return kIsaHash; }

// Ends the calling thread's idle OpenMP workers (OpenMP 5's soft pause; the runtime starts new ones
// if this thread opens a parallel region again); 0 when done, nonzero when the runtime could not (the
// caller is inside a parallel region). Each thread that opens a parallel region keeps its own pool of
// workers, and libgomp counts every pool's workers against the cores: once they outnumber the cores
// its barrier waits spin ~100 times instead of ~300000 and then sleep in the kernel, which costs a
// team that meets a barrier after every kernel (a step plan) a futex wake each time. So the thread
// that built an engine releases its workers before an engine loop's thread computes the steps.
int64_t release_idle_threads() { return omp_pause_resource_all(omp_pause_soft); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(llmc, m) {
  m.def("step_plan_isa_hash() -> str", &step_plan_isa_hash);
  m.def("release_idle_threads() -> int", &release_idle_threads);
  m.class_<StepPlan>("StepPlan")
      .def(torch::init<bool, bool>())
      .def("constant", &StepPlan::constant)
      .def("input", &StepPlan::input)
      .def("temporary", &StepPlan::temporary)
      .def("output", &StepPlan::output)
      .def("add", &StepPlan::add)
      .def("set_group", &StepPlan::set_group)
      .def("run", &StepPlan::run)
      .def("run_timed", &StepPlan::run_timed);
}
