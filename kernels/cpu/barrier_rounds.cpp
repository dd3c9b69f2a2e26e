// Rounds of a step plan's shape through its team barrier (team_barrier.h), for a benchmark of the
// barrier's wait policy and a test of its contract.
//
// Contract (kernels/barrier_rounds.py has the meaning, barrier_rounds_ref):
//   x        f32, contiguous: the bytes the rounds read, cut into `rounds` equal slices
//   rounds   >= 1; in round r every thread of the team (the process's OpenMP threads) sums its share
//            of slice r, records r, and waits at the barrier; after it, it checks that every
//            teammate has recorded r (or r + 1, if it has already gone on)
//   spin_us, yield_us   the barrier's WaitPolicy (>= 0): microseconds a waiter spins, then yields
//   -> f64 [4]: the rounds' wall seconds, the waits that slept in the kernel, the checks that found
//      a teammate still behind (0 for a barrier that keeps its contract), and the sum of the slices
//      read (x's sum but for the tail of fewer than `rounds` x 16 elements)
// So the team does what a batch-1 decode step plan does between its few hundred barriers: streams a
// share of the weights each, then meets the others.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <omp.h>
#include <torch/library.h>

#include <atomic>
#include <chrono>
#include <vector>

#include "team_barrier.h"
#include "vec16.h"

namespace {

using llmc_cpu::Vec16;

// The sum of p[begin, end), 16 floats at a time (the caller's bounds are multiples of 16).
float slice_sum(const float* p, int64_t begin, int64_t end) {
  Vec16 acc[4] = {};
  int64_t i = begin;
  for (; i + 64 <= end; i += 64)
    for (int j = 0; j < 4; ++j) acc[j] += llmc_cpu::load16(p + i + 16 * j);
  for (; i < end; i += 16) acc[0] += llmc_cpu::load16(p + i);
  return llmc_cpu::hsum(acc[0] + acc[1] + acc[2] + acc[3]);
}

at::Tensor barrier_rounds(const at::Tensor& x, int64_t rounds, int64_t spin_us, int64_t yield_us) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous(), "x must be a contiguous f32 tensor, not ",
              x.scalar_type());
  TORCH_CHECK(rounds >= 1 && spin_us >= 0 && yield_us >= 0, "rounds must be >= 1 and the waits >= 0, not ",
              rounds, ", ", spin_us, ", ", yield_us);
  const float* p = x.const_data_ptr<float>();
  const int64_t slice = x.numel() / rounds / 16 * 16, team = at::get_num_threads();
  llmc_cpu::TeamBarrier barrier(
      llmc_cpu::WaitPolicy{std::chrono::microseconds(spin_us), std::chrono::microseconds(yield_us)});
  std::vector<std::atomic<int64_t>> seen(team);   // each thread's last round
  for (auto& s : seen) s.store(-1);
  std::vector<double> sums(team, 0.0);
  std::atomic<int64_t> behind{0};
  const auto start = std::chrono::steady_clock::now();
#pragma omp parallel num_threads(team)
  {
    const int tid = omp_get_thread_num(), size = omp_get_num_threads();
#pragma omp single
    barrier.reset(size);
    for (int64_t r = 0; r < rounds; ++r) {
      const int64_t share = slice / 16 * tid / size * 16, next = slice / 16 * (tid + 1) / size * 16;
      sums[tid] += slice_sum(p + r * slice, share, next);
      seen[tid].store(r, std::memory_order_relaxed);
      barrier.wait();
      for (int j = 0; j < size; ++j)
        if (seen[j].load(std::memory_order_relaxed) < r) behind.fetch_add(1, std::memory_order_relaxed);
    }
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  double total = 0.0;
  for (double s : sums) total += s;
  return at::tensor({seconds, static_cast<double>(barrier.sleeps()), static_cast<double>(behind.load()), total},
                    at::TensorOptions().dtype(at::kDouble));
}

// The step plans' WaitPolicy: microseconds of spinning, then of yielding.
std::vector<int64_t> barrier_wait_policy() {
  const llmc_cpu::WaitPolicy policy;
  return {policy.spin.count(), policy.yield.count()};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llmc, m) {
  m.def("barrier_rounds(Tensor x, int rounds, int spin_us, int yield_us) -> Tensor");
  m.def("barrier_wait_policy() -> int[]", &barrier_wait_policy);
}

TORCH_LIBRARY_IMPL(llmc, CPU, m) { m.impl("barrier_rounds", &barrier_rounds); }
