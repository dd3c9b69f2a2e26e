// The step plan's program (step_plan.cpp runs it, step_plan_checks.cpp checks it against each
// run's inputs; step_plan.cpp's header states what a plan is): its values, its instructions and
// what it keeps between runs.
#pragma once

#include <ATen/ATen.h>
#include <torch/custom_class.h>

#include <mutex>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "step_plan.h"

namespace llmc_plan {

enum Place : int64_t { kConstant, kInput, kTemporary, kOutput };

struct Value {
  Place place;
  int64_t index;   // constant, input or output number; a temporary's register
  int64_t width;   // elements per row (temporaries and outputs)
  bool seqs;       // rows are the gathered rows (IR dim R, logit rows), not the step's tokens
  int64_t stride;  // elements from one row to the next: an activation's width, a constant's row
                   // stride (0 if 1-D: one row for all); an input's is taken at each run
  bool indices = false;  // an output of int64 indices [rows] (a GEMM's greedy picks), not activations
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
  // An int64 output of one index a row (a GEMM's picks arg).
  int64_t index_output(bool seqs) { return add_value({kOutput, num_outputs_++, 1, seqs, 1, true}); }
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
  // outputs; with `timed`, each instruction's seconds (from the barrier before it to the one after,
  // on the team's first thread) and each thread's wait at the barrier after it ([instruction][thread]:
  // how unevenly the instruction split the work, and what a barrier costs)
  using Run = std::tuple<std::vector<at::Tensor>, std::vector<double>, std::vector<double>>;

  std::vector<at::Tensor> run(std::vector<at::Tensor> inputs, int64_t rows, int64_t seqs) {
    return std::get<0>(execute(std::move(inputs), rows, seqs, false));
  }
  Run run_timed(std::vector<at::Tensor> inputs, int64_t rows, int64_t seqs) {
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
  void check_linear_epilogue(const Instr& in) const;
  void check_collective(const Instr& in) const;
  std::string run_collective(const Instr& in, const Bound& b) const;
  void check_qembedding(const Instr& in) const;
  void check_picks(const Instr& in);

  Run execute(std::vector<at::Tensor> inputs, int64_t rows, int64_t seqs, bool timed);
  Bound& reuse(std::vector<at::Tensor> inputs, int64_t rows, int64_t seqs, int team);
  void plan_attention(const Instr& in, Bound& b, const at::Tensor& cache) const;
  std::vector<at::Tensor> bind(Bound& b);
  void check(const Instr& in, int64_t index, Bound& b) const;
  void check_cache(const at::Tensor& cache, int64_t layer, int64_t kv_heads, int64_t head_dim) const;
  void check_rope_kv_write(const Instr& in, const Bound& b) const;
  void bind_generated(const Instr& in, int64_t index, Bound& b) const;

  bool bf16_, int8_cache_;
  std::vector<at::Tensor> constants_;
  std::vector<at::ScalarType> input_types_;
  std::vector<Value> values_;
  std::vector<char*> constant_at_;          // value id -> a constant's address (null for the others)
  std::vector<int64_t> reg_bytes_;          // bytes of one row of each register's widest per-token value
  std::vector<int64_t> reg_seq_bytes_;      // and of its widest per-sequence value
  at::Tensor arena_;                        // the temporaries, kept between runs
  std::mutex running_;                      // one run at a time uses the arena, bound_ and team_scratch_
  Bound bound_;                             // the run's addresses, kept for their vectors' room (reuse)
  std::vector<TeamScratch> team_scratch_;   // each thread's attention and rotation scratch, kept likewise
  std::vector<std::pair<int64_t, int64_t>> claimed_;   // (instruction, panels): the GEMMs, whose panels are claimed
  std::vector<int64_t> attention_at_;       // the attention instructions (each takes items from Bound::next)
  std::vector<Instr> code_;
  std::vector<int64_t> attention_meta_;     // attention's kind and the tables, lengths (and query starts) it reads
  int64_t max_head_dim_ = 16;
  int64_t widened_per_row_ = 0;             // floats of fp32 scratch a quantized GEMM needs per row
  int64_t dequantized_ = 0;                 // floats of scratch per thread a prompt's quads GEMM on bf16 or
                                            // fp32 needs (Bound::dequantized)
  int64_t dequantized_from_ = INT64_MAX;    // from this many rows on (the least of those GEMMs' kMinTokens)
  int64_t num_outputs_ = 0;
  bool picks_ = false;                      // a GEMM picks (Bound::picks needs room)
  std::string group_;                       // the collectives' process group (set_group)
};

}  // namespace llmc_plan
