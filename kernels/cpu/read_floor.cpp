// The machine's read-bandwidth floor: one pass over a buffer, as fast as this CPU can read memory,
// so that no llmc kernel that reads the same bytes can beat it (a floor that is a ceiling).
//
// Contract (the meaning of kernels/read_floor.py's read_floor_ref: the sum of the buffer):
//   x      f32, contiguous, any length (a multiple of 128 floats is read at full speed)
//   ahead  bytes of software prefetch ahead of the loads (0: none, the hardware prefetcher alone);
//          which distance reads fastest differs between CPUs, so the caller tries several
//   -> out f32 scalar tensor: the sum of every element, accumulated in fp32 per thread and lane
//          (another order than torch.sum: equal within fp32 rounding, not bit for bit). The sum
//          is what keeps the compiler from dropping the loads.
//
// How: the threads (the process's OpenMP team, as the GEMMs use) take contiguous slices, so each
// streams its own part front to back as a panel GEMV does; eight independent 16-lane accumulators
// per thread keep eight 64-byte loads in flight per iteration (one add chain would stall on its
// latency), each 64-byte line prefetched `ahead` bytes early where asked, as a line read once (the
// panel GEMVs prefetch too; on the Zen 5 VM a non-temporal prefetch 16-64 KiB ahead read ~20%
// faster). That is the whole of the work: no multiplies, no stores.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <vector>

#include "vec16.h"

namespace {

using llmc_cpu::Vec16;

constexpr int64_t kStride = 8 * 16;  // floats per iteration: eight Vec16 loads

float read_slice(const float* p, int64_t begin, int64_t end, int64_t ahead) {
  Vec16 acc[8] = {};
  int64_t i = begin;
  if (ahead > 0) {
    const int64_t lead = ahead / 4;  // floats
    for (; i + kStride <= end; i += kStride)
      for (int j = 0; j < 8; ++j) {
        __builtin_prefetch(p + i + 16 * j + lead, 0, 0);  // read, no temporal locality: streamed once
        acc[j] += llmc_cpu::load16(p + i + 16 * j);
      }
  }
  for (; i + kStride <= end; i += kStride)
    for (int j = 0; j < 8; ++j) acc[j] += llmc_cpu::load16(p + i + 16 * j);
  float tail = 0.0f;
  for (; i < end; ++i) tail += p[i];
  for (int j = 1; j < 8; ++j) acc[0] += acc[j];
  return llmc_cpu::hsum(acc[0]) + tail;
}

at::Tensor read_floor(const at::Tensor& x, int64_t ahead) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous(), "x must be a contiguous f32 tensor, not ",
              x.scalar_type());
  TORCH_CHECK(ahead >= 0, "the prefetch distance must be >= 0, not ", ahead);
  const float* p = x.const_data_ptr<float>();
  const int64_t n = x.numel(), threads = at::get_num_threads();
  const int64_t chunk = (n / threads + kStride - 1) / kStride * kStride;   // whole iterations per thread
  std::vector<float> partial(threads, 0.0f);
  at::parallel_for(0, threads, 1, [&](int64_t first, int64_t last) {
    for (int64_t t = first; t < last; ++t)
      partial[t] = read_slice(p, std::min(n, t * chunk), t + 1 == threads ? n : std::min(n, (t + 1) * chunk), ahead);
  });
  float total = 0.0f;
  for (float s : partial) total += s;
  return at::scalar_tensor(total, x.options());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llmc, m) { m.def("read_floor(Tensor x, int ahead) -> Tensor"); }

TORCH_LIBRARY_IMPL(llmc, CPU, m) { m.impl("read_floor", &read_floor); }
