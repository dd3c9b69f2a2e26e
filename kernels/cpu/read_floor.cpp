// The machine's read-bandwidth floor: one pass over a buffer, as fast as this CPU can read memory,
// so that no llmc kernel that reads the same bytes can beat it (a floor that is a ceiling).
//
// Contract (the meaning of kernels/read_floor.py's read_floor_ref: the sum of the buffer):
//   x      f32, contiguous, any length (a multiple of 128 floats is read at full speed)
//   ahead  bytes of software prefetch ahead of the loads (0: none, the hardware prefetcher alone);
//          which distance reads fastest differs between CPUs, so the caller tries several
//   keep   prefetch for the caches (as the panel GEMVs do) or, false, as a line read once
//          (non-temporal); the caller tries both
//   -> out f32 scalar tensor: the sum of every element, accumulated in fp32 per thread and lane
//          (another order than torch.sum: equal within fp32 rounding, not bit for bit). The sum
//          is what keeps the compiler from dropping the loads.
//
// How: the threads (the process's OpenMP team, as the GEMMs use) take contiguous slices, so each
// streams its own part front to back as a panel GEMV does; eight independent 16-lane accumulators
// per thread keep eight 64-byte loads in flight per iteration (one add chain would stall on its
// latency), each 64-byte line prefetched `ahead` bytes early where asked, either way the panel
// GEMVs could (on the Zen 5 VM a non-temporal prefetch 16-64 KiB ahead read ~20% faster than
// none). That is the whole of the work: no multiplies, no stores. The strategies tried include the
// GEMVs' own (4 KiB ahead, for the caches), so no GEMV can read the same bytes faster.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <vector>

#include "vec16.h"

namespace {

using llmc_cpu::Vec16;

constexpr int64_t kStride = 8 * 16;  // floats per iteration: eight Vec16 loads

// Eight accumulators over [i, end) in whole iterations, each line prefetched `lead` floats ahead
// with temporal locality `Locality` (0: read once; 3: for the caches); returns where it stopped.
template <int Locality>
int64_t prefetched_loop(const float* p, int64_t i, int64_t end, int64_t lead, Vec16* acc) {
  for (; i + kStride <= end; i += kStride)
    for (int j = 0; j < 8; ++j) {
      __builtin_prefetch(p + i + 16 * j + lead, 0, Locality);
      acc[j] += llmc_cpu::load16(p + i + 16 * j);
    }
  return i;
}

float read_slice(const float* p, int64_t begin, int64_t end, int64_t ahead, bool keep) {
  Vec16 acc[8] = {};
  int64_t i = begin;
  if (ahead > 0)
    i = keep ? prefetched_loop<3>(p, i, end, ahead / 4, acc) : prefetched_loop<0>(p, i, end, ahead / 4, acc);
  for (; i + kStride <= end; i += kStride)
    for (int j = 0; j < 8; ++j) acc[j] += llmc_cpu::load16(p + i + 16 * j);
  float tail = 0.0f;
  for (; i < end; ++i) tail += p[i];
  for (int j = 1; j < 8; ++j) acc[0] += acc[j];
  return llmc_cpu::hsum(acc[0]) + tail;
}

at::Tensor read_floor(const at::Tensor& x, int64_t ahead, bool keep) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous(), "x must be a contiguous f32 tensor, not ",
              x.scalar_type());
  TORCH_CHECK(ahead >= 0, "the prefetch distance must be >= 0, not ", ahead);
  const float* p = x.const_data_ptr<float>();
  const int64_t n = x.numel(), threads = at::get_num_threads();
  const int64_t chunk = (n / threads + kStride - 1) / kStride * kStride;   // whole iterations per thread
  std::vector<float> partial(threads, 0.0f);
  at::parallel_for(0, threads, 1, [&](int64_t first, int64_t last) {
    for (int64_t t = first; t < last; ++t)
      partial[t] = read_slice(p, std::min(n, t * chunk), t + 1 == threads ? n : std::min(n, (t + 1) * chunk), ahead, keep);
  });
  float total = 0.0f;
  for (float s : partial) total += s;
  return at::scalar_tensor(total, x.options());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llmc, m) { m.def("read_floor(Tensor x, int ahead, bool keep) -> Tensor"); }

TORCH_LIBRARY_IMPL(llmc, CPU, m) { m.impl("read_floor", &read_floor); }
