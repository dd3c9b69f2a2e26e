// The panel claims' contract (panel_claims.h), checked from Python (tests/test_panel_claims.py):
//   panel_claims_cover(count, shares, min_chunk, slow_us) -> (marks i64 [count], taken i64 [threads])
// The process's OpenMP team claims `count` panels set up as `shares` shares (the team a plan was built
// for; a smaller team takes the missing threads' shares too), each thread marking every panel of its
// claims; thread 0 spends `slow_us` microseconds on each panel it takes (a thread slowed by its core's
// neighbour), so the others finish first and take from its share. marks[p]: how many claims held panel
// p (1 everywhere where the contract holds); taken[t]: how many panels thread t took.

#include <ATen/ATen.h>
#include <omp.h>
#include <torch/library.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <tuple>

#include "panel_claims.h"

namespace {

void busy_wait(double us) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::duration<double, std::micro>(us);
  while (std::chrono::steady_clock::now() < until) {
  }
}

std::tuple<at::Tensor, at::Tensor> panel_claims_cover(int64_t count, int64_t shares, int64_t min_chunk,
                                                      double slow_us) {
  TORCH_CHECK(count >= 0 && count < (int64_t{1} << 31), "count must be in [0, 2^31), not ", count);
  TORCH_CHECK(shares >= 1 && min_chunk >= 1 && slow_us >= 0, "shares and min_chunk must be >= 1, slow_us >= 0");
  std::unique_ptr<llmc_plan::ShareClaims[]> claims(new llmc_plan::ShareClaims[shares]);
  llmc_plan::reset_claims(claims.get(), count, static_cast<int>(shares));
  std::unique_ptr<std::atomic<int64_t>[]> marks(new std::atomic<int64_t>[count]);
  for (int64_t p = 0; p < count; ++p) marks[p] = 0;
  const int threads = omp_get_max_threads();
  at::Tensor taken = at::zeros({threads}, at::kLong);
  auto* per_thread = taken.data_ptr<int64_t>();
#pragma omp parallel num_threads(threads)
  {
    const int tid = omp_get_thread_num();
    if (tid < shares)
      llmc_plan::claim_panels(claims.get(), tid, static_cast<int>(shares), min_chunk, [&](int64_t b, int64_t e) {
        for (int64_t p = b; p < e; ++p) {
          if (tid == 0) busy_wait(slow_us);
          marks[p].fetch_add(1, std::memory_order_relaxed);
        }
        per_thread[tid] += e - b;
      });
  }
  at::Tensor out = at::empty({count}, at::kLong);
  for (int64_t p = 0; p < count; ++p) out.data_ptr<int64_t>()[p] = marks[p].load();
  return {out, taken};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llmc, m) {
  m.def("panel_claims_cover(int count, int shares, int min_chunk, float slow_us) -> (Tensor, Tensor)",
        &panel_claims_cover);
}
