// A step plan: one entry graph lowered to a list of native kernel calls (runtime/step_plan.py does
// the lowering and states the contract), run in one OpenMP parallel region by one team of
// threads with a barrier between calls (team_barrier.h: it spins a bounded time, yields its core a
// bounded time, then sleeps). A decode step of a small model is a few hundred short calls; launched
// one by one from Python, each pays the interpreter, the dispatcher, an output allocation and a
// fork/join of the threads, which together cost as much as a quarter of the step. Here a step costs
// one call from Python, and a barrier per kernel.
//
// Values live in four places: constants (weights, held by the plan), the step's inputs (given to
// run), temporaries (rows of one arena the plan keeps between runs; values whose lives do not
// overlap share a register, as runtime/step_plan.py assigned them) and outputs (fresh tensors
// each run). Every activation is [rows, width] in the plan's dtype (f32 or bf16), its rows the
// step's tokens or, after a gather (index_select), the rows gathered (one per sequence, or more
// where a step asks for logits at several positions); the KV cache is the plan's dtype or int8.
// Everything a kernel will read or write is checked before the parallel region (ids, slots, block
// tables, lengths, shapes: step_plan_checks.cpp), so nothing inside it can fail.
//
// Instructions: kernels/step_plan_isa.py describes each one (its args by name and role, in
// order, and its float arg); the step_plan_isa.h generated from it (kernels/native.py writes it
// into the build folder) numbers them and names their args, and this file and step_plan.h read an
// arg only by its name (arg::linear::bias), so a layout the description lacks does not compile.
// `generated` calls a generated kernel's C function (runtime/step_plan.py states its ABI) on the
// team's split of its first output's rows; `linear_epilogue` is a float GEMM with a column-local
// generated kernel as its epilogue (step_plan.h, amx_epilogue.h), `qlinear_epilogue` a quantized one
// (f32_dequant_gemm.h). `all_reduce` and `all_gather` (tensor parallelism,
// plan_collectives.h) run on the team's first thread, on the group set_group named, while the others
// wait at the barrier; one that fails stops the team after it and is raised once the region ends.
//
// The team claims a decode step's GEMM panels (each thread its own share first, then what the
// others leave: panel_claims.h) and splits a prompt's, splits the tokens of a row op, and takes
// attention's work items (attention_work.h) one at a time; a quantized GEMM first widens or
// quantizes x into the run's scratch (split, then a barrier; in a small step every thread all of x
// for itself, no barrier), as the op does (step_plan.h: each thread's work).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <omp.h>
#include <torch/library.h>

#include <chrono>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

#include "step_plan_program.h"

namespace llmc_plan {

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
    } else if (v.place == kOutput && v.indices) {
      outputs[v.index] = at::empty({b.rows_at[i]}, at::TensorOptions().dtype(at::kLong));
      b.at[i] = static_cast<char*>(outputs[v.index].data_ptr());
    } else if (v.place == kOutput) {
      outputs[v.index] = at::empty({b.rows_at[i], v.width},
                                   at::TensorOptions().dtype(bf16_ ? at::kBFloat16 : at::kFloat));
      b.at[i] = static_cast<char*>(outputs[v.index].data_ptr());
    }
  }
  return outputs;
}

// What the plan keeps for an instruction's kind: the scratch a rotation and a quantized GEMM
// need, the one layout every attention call shares, which instructions claim panels or take
// attention items; a generated kernel's values, checked.
void StepPlan::note(const Instr& in) {
  const auto& a = in.a;
  if (in.op == kRopeKvWrite) max_head_dim_ = std::max(max_head_dim_, a[arg::rope_kv_write::head_dim]);
  if (in.op == kQlinear || in.op == kQlinearEpilogue) {   // qlinear_epilogue's args: qlinear's, then more
    namespace A = arg::qlinear;
    widened_per_row_ = std::max(widened_per_row_, a[A::k] + a[A::k] / a[A::group]);
    if (a[A::layout] == 1 && a[A::prompts] == 1) {   // bf16 elements, two a float
      dequantized_ = std::max(dequantized_, (llmc_amx_dq::scratch_elems(a[A::k]) + 1) / 2);
      dequantized_from_ = std::min(dequantized_from_, llmc_amx_dq::kMinTokens);
    }
    if (a[A::layout] == 1 && a[A::prompts] == 2) {
      dequantized_ = std::max(dequantized_, llmc_f32_dq::scratch_floats(a[A::k]));
      if (in.op == kQlinearEpilogue)
        dequantized_ = std::max(dequantized_, llmc_f32_dq::epilogue_scratch_floats(
                                                  a[A::k], in.a[arg::qlinear_epilogue::reads]));
      dequantized_from_ = std::min(dequantized_from_, llmc_f32_dq::kMinTokens);
    }
  }
  if (in.op == kPagedDecodeAttention || in.op == kPagedAttention) {   // the step's work items: made once, every layer
    const AttentionArgs x = attention_args(in);
    const std::vector<int64_t> meta{in.op, x.block_tables, x.seq_lens, x.query_start_loc};
    TORCH_CHECK(attention_meta_.empty() || attention_meta_ == meta,
                "every attention of a plan must be of one kind and read the same block tables and lengths");
    TORCH_CHECK(x.window >= 0 && x.window <= INT32_MAX && x.softcap >= 0 && std::isfinite(x.softcap),
                "attention window ", x.window, " and softcap ", x.softcap, " must be 0 (off) or positive");
    attention_meta_ = meta;
  }
  if (in.op == kGenerated) check_generated(in);
  if (in.op == kLinearEpilogue || in.op == kQlinearEpilogue) check_linear_epilogue(in);
  if (in.op == kAllReduce || in.op == kAllGather) check_collective(in);
  if (in.op == kQembedding) check_qembedding(in);
  if (in.op == kLinear || in.op == kQlinear) check_picks(in);
  const int64_t index = static_cast<int64_t>(code_.size());   // listed once every check above has passed
  const int64_t panels = in.op == kLinear           ? a[arg::linear::num_panels]
                         : in.op == kLinearEpilogue ? a[arg::linear_epilogue::num_panels]
                         : in.op == kQlinear        ? a[arg::qlinear::num_panels]
                         : in.op == kQlinearEpilogue ? a[arg::qlinear_epilogue::num_panels]
                                                    : 0;
  if (panels > 0) claimed_.push_back({index, panels});
  if (in.op == kPagedDecodeAttention || in.op == kPagedAttention) attention_at_.push_back(index);
}

// The plan's Bound emptied for a run of `rows` tokens and `seqs` gathered rows by `team` threads:
// every vector a run fills is cleared or sized here (keeping its room), the claims and attention
// counters reallocated only when the plan or the team grew and reset only for the instructions that
// use them (note lists them: reading every instruction's args each run cost cache misses).
Bound& StepPlan::reuse(std::vector<at::Tensor> inputs, int64_t rows, int64_t seqs, int team) {
  Bound& b = bound_;
  b.rows = rows;
  b.seqs = seqs;
  b.inputs = std::move(inputs);
  b.items.clear();
  b.qsl.clear();
  b.ptrs.resize(code_.size());
  b.strides.resize(code_.size());
  for (size_t i = 0; i < code_.size(); ++i) b.ptrs[i].clear(), b.strides[i].clear();
  const int64_t widened = widened_per_row_ * std::max(rows, seqs);    // the team's x scratch
  b.widened_alone = widened <= kAloneFloats ? widened : 0;             // and each thread's own, in a small step
  b.widened.resize(widened + b.widened_alone * team);
  b.dequantized_per_thread = std::max(rows, seqs) >= dequantized_from_ ? dequantized_ : 0;
  b.dequantized.resize(std::max(b.dequantized.size(), static_cast<size_t>(b.dequantized_per_thread * team)));
  if (picks_) b.picks.resize(team * std::max(rows, seqs));
  const size_t counters = code_.size() * team;
  if (counters > b.counters) {
    b.next.reset(new std::atomic<int64_t>[counters]);   // one per instruction needs no more
    b.claims.reset(new ShareClaims[counters]);
    b.counters = counters;
  }
  b.claim_team = team;
  for (const auto& [i, panels] : claimed_) reset_claims(&b.claims[i * team], panels, team);
  for (const int64_t i : attention_at_) b.next[i] = 0;
  team_scratch_.resize(team);
  for (TeamScratch& s : team_scratch_) s.row.resize(2 * max_head_dim_);
  return b;
}

StepPlan::Run StepPlan::execute(std::vector<at::Tensor> inputs, int64_t rows, int64_t seqs, bool timed) {
  TORCH_CHECK(inputs.size() >= input_types_.size(), "the plan takes ", input_types_.size(), " inputs, not ",
              inputs.size());
  for (size_t i = 0; i < input_types_.size(); ++i)
    TORCH_CHECK(inputs[i].is_contiguous() && inputs[i].device().is_cpu() && inputs[i].scalar_type() == input_types_[i],
                "plan input ", i, " must be a contiguous CPU ", input_types_[i], " tensor, not ",
                inputs[i].scalar_type());
  const std::lock_guard<std::mutex> hold(running_);
  const int64_t threads = at::get_num_threads();
  Bound& b = reuse(std::move(inputs), rows, seqs, static_cast<int>(threads));
  struct Release {   // the plan keeps no tensor of a step past its run, a refused one included
    Bound& b;
    ~Release() { b.inputs.clear(); }
  } release{b};
  std::vector<at::Tensor> outputs = bind(b);
  for (size_t i = 0; i < code_.size(); ++i) check(code_[i], i, b);
  using Clock = std::chrono::steady_clock;
  std::vector<Clock::time_point> stamps(timed ? code_.size() + 1 : 0);
  std::vector<double> waits(timed ? code_.size() * threads : 0);   // [instruction][thread]: at the barrier after it
  llmc_cpu::TeamBarrier barrier;            // spins, yields, then sleeps (team_barrier.h)
  b.barrier = &barrier;
  std::atomic<int64_t> failed_at{-1};       // a collective that failed: the team stops after it
  std::string failure;
  const auto typed = [&](auto* x_type, auto* c_type) {
    using X = std::remove_pointer_t<decltype(x_type)>;
    using C = std::remove_pointer_t<decltype(c_type)>;
#pragma omp parallel num_threads(threads)
    {
      const int tid = omp_get_thread_num(), team = omp_get_num_threads();
      TeamScratch& scratch = team_scratch_[tid];
#pragma omp single
      barrier.reset(team);
      if (timed && tid == 0) stamps[0] = Clock::now();
      for (size_t i = 0; i < code_.size(); ++i) {
        if (code_[i].op == kAllReduce || code_[i].op == kAllGather) {
          if (tid == 0 && !(failure = run_collective(code_[i], b)).empty()) failed_at = static_cast<int64_t>(i);
        } else {
          llmc_plan::run_instruction<X, C>(code_[i], i, b, tid, team, scratch.attention, scratch.row.data());
        }
        const auto arrived = timed ? Clock::now() : Clock::time_point{};
        barrier.wait();
        if (timed) waits[i * threads + tid] = std::chrono::duration<double>(Clock::now() - arrived).count();
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
  return {outputs, seconds, waits};
}

}  // namespace llmc_plan

namespace {

// The description (kernels/step_plan_isa.py) this build's step_plan_isa.h was rendered from.
std::string step_plan_isa_hash() { return llmc_plan::kIsaHash; }

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
  m.class_<llmc_plan::StepPlan>("StepPlan")
      .def(torch::init<bool, bool>())
      .def("constant", &llmc_plan::StepPlan::constant)
      .def("input", &llmc_plan::StepPlan::input)
      .def("temporary", &llmc_plan::StepPlan::temporary)
      .def("output", &llmc_plan::StepPlan::output)
      .def("index_output", &llmc_plan::StepPlan::index_output)
      .def("add", &llmc_plan::StepPlan::add)
      .def("set_group", &llmc_plan::StepPlan::set_group)
      .def("run", &llmc_plan::StepPlan::run)
      .def("run_timed", &llmc_plan::StepPlan::run_timed)
      .def("address", [](const c10::intrusive_ptr<llmc_plan::StepPlan>& self) {
        return reinterpret_cast<int64_t>(self.get());   // for run_plan (plan_binding.cpp), while self lives
      });
}
