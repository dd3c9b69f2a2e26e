// The machine's read-bandwidth floor: one pass over a buffer, as fast as this CPU can read memory,
// so that no llmc kernel that reads the same bytes can beat it (a floor that is a ceiling).
//
// Contract (the meaning of kernels/read_floor.py's read_floor_ref: the sum of the buffer):
//   x      f32, contiguous, any length (a multiple of 128 floats is read at full speed)
//   ahead  bytes of software prefetch ahead of the loads (0: none, the hardware prefetcher alone);
//          which distance reads fastest differs between CPUs, so the caller tries several
//   keep   prefetch for the caches (as the panel GEMVs do) or, false, as a line read once
//          (non-temporal); the caller tries both
//   streams 1, 2 or 4: each thread reads its slice as that many equal parts side by side (a batch-1
//          GEMV streams up to 4 weight panels at once, and on some CPUs several streams a core read
//          faster than one: an AMD EPYC's GEMV beat a one-stream floor by 10%); the caller tries each
//   -> out f32 scalar tensor: the sum of every element, accumulated in fp32 per thread and lane
//          (another order than torch.sum: equal within fp32 rounding, not bit for bit). The sum
//          is what keeps the compiler from dropping the loads.
//
// How: the threads (the process's OpenMP team, as the GEMMs use) take contiguous slices, so each
// streams its own part front to back as a panel GEMV does; eight independent 16-lane accumulators
// per thread keep eight 64-byte loads in flight per iteration (one add chain would stall on its
// latency), each 64-byte line prefetched `ahead` bytes early where asked, either way the panel
// GEMVs could (on the Zen 5 VM a non-temporal prefetch 16-64 KiB ahead read ~20% faster than
// none). With several streams the eight loads of an iteration go to the parts in turn (4 streams:
// two 64-byte lines of each, as the 4-panel GEMV reads 128 bytes of each panel per input). That is
// the whole of the work: no multiplies, no stores. The strategies tried include the GEMVs' own (4
// KiB ahead, for the caches, 4 streams), so no GEMV can read the same bytes faster.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <vector>

#include "vec16.h"

namespace {

using llmc_cpu::Vec16;

constexpr int64_t kStride = 8 * 16;  // floats per iteration: eight Vec16 loads

// Eight accumulators over [begin, end) cut into S equal parts of whole iterations, read side by
// side (each iteration: 8 / S loads from every part), each line prefetched `lead` floats ahead with
// temporal locality `Locality` (0: read once; 3: for the caches) when Prefetch; returns where the
// parts end (the rest, under S iterations, is the caller's).
template <int S, bool Prefetch, int Locality>
int64_t streamed_loop(const float* p, int64_t begin, int64_t end, int64_t lead, Vec16* acc) {
  constexpr int kPer = 8 / S;                                        // loads per part per iteration
  const int64_t part = (end - begin) / (S * kStride) * kStride;       // floats in each part
  for (int64_t i = 0; i < part; i += 16 * kPer)
    for (int s = 0; s < S; ++s)
      for (int j = 0; j < kPer; ++j) {
        const float* q = p + begin + s * part + i + 16 * j;
        if constexpr (Prefetch) __builtin_prefetch(q + lead, 0, Locality);
        acc[s * kPer + j] += llmc_cpu::load16(q);
      }
  return begin + S * part;
}

template <int S>
int64_t parts_loop(const float* p, int64_t begin, int64_t end, int64_t ahead, bool keep, Vec16* acc) {
  if (ahead == 0) return streamed_loop<S, false, 0>(p, begin, end, 0, acc);
  return keep ? streamed_loop<S, true, 3>(p, begin, end, ahead / 4, acc)
              : streamed_loop<S, true, 0>(p, begin, end, ahead / 4, acc);
}

float read_slice(const float* p, int64_t begin, int64_t end, int64_t ahead, bool keep, int64_t streams) {
  Vec16 acc[8] = {};
  int64_t i = streams == 4   ? parts_loop<4>(p, begin, end, ahead, keep, acc)
              : streams == 2 ? parts_loop<2>(p, begin, end, ahead, keep, acc)
                             : parts_loop<1>(p, begin, end, ahead, keep, acc);
  for (; i + kStride <= end; i += kStride)
    for (int j = 0; j < 8; ++j) acc[j] += llmc_cpu::load16(p + i + 16 * j);
  float tail = 0.0f;
  for (; i < end; ++i) tail += p[i];
  for (int j = 1; j < 8; ++j) acc[0] += acc[j];
  return llmc_cpu::hsum(acc[0]) + tail;
}

at::Tensor read_floor(const at::Tensor& x, int64_t ahead, bool keep, int64_t streams) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous(), "x must be a contiguous f32 tensor, not ",
              x.scalar_type());
  TORCH_CHECK(ahead >= 0, "the prefetch distance must be >= 0, not ", ahead);
  TORCH_CHECK(streams == 1 || streams == 2 || streams == 4, "streams must be 1, 2 or 4, not ", streams);
  const float* p = x.const_data_ptr<float>();
  const int64_t n = x.numel(), threads = at::get_num_threads();
  const int64_t chunk = (n / threads + kStride - 1) / kStride * kStride;   // whole iterations per thread
  std::vector<float> partial(threads, 0.0f);
  at::parallel_for(0, threads, 1, [&](int64_t first, int64_t last) {
    for (int64_t t = first; t < last; ++t) {
      const int64_t begin = std::min(n, t * chunk), end = t + 1 == threads ? n : std::min(n, (t + 1) * chunk);
      partial[t] = read_slice(p, begin, end, ahead, keep, streams);
    }
  });
  float total = 0.0f;
  for (float s : partial) total += s;
  return at::scalar_tensor(total, x.options());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llmc, m) { m.def("read_floor(Tensor x, int ahead, bool keep, int streams) -> Tensor"); }

TORCH_LIBRARY_IMPL(llmc, CPU, m) { m.impl("read_floor", &read_floor); }
