// SiLU-and-multiply (the SwiGLU gate) on the CPU.
//
// Contract (the meaning of kernels/activation.py's silu_mul_ref):
//   gate, up  [T, N] f32 or bf16, rows contiguous (any row stride: the halves of a merged
//             gate/up GEMM's output are passed as two views)
//   returns   [T, N] contiguous in the input dtype: silu(gate) * up, computed in fp32 and
//             rounded once. N must be a multiple of 16.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <type_traits>

#include "token_rows.h"

namespace {

template <typename T>
void silu_mul_rows(const at::Tensor& gate, const at::Tensor& up, at::Tensor& out) {
  const int64_t n = gate.size(1);
  at::parallel_for(0, gate.size(0), 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      llmc_rows::silu_mul_row(gate.const_data_ptr<T>() + t * gate.stride(0), up.const_data_ptr<T>() + t * up.stride(0),
                              out.data_ptr<T>() + t * n, n);
    }
  });
}

at::Tensor silu_mul(const at::Tensor& gate, const at::Tensor& up) {
  TORCH_CHECK(gate.dim() == 2 && gate.stride(1) == 1 && up.sizes() == gate.sizes() && up.stride(1) == 1,
              "gate and up must be [T, N] with contiguous rows");
  TORCH_CHECK(gate.scalar_type() == up.scalar_type() &&
                  (gate.scalar_type() == at::kFloat || gate.scalar_type() == at::kBFloat16),
              "gate and up must both be f32 or bf16");
  TORCH_CHECK(gate.size(1) % 16 == 0, "width ", gate.size(1), " is not a multiple of 16");
  at::Tensor out = at::empty(gate.sizes(), gate.options());
  if (gate.scalar_type() == at::kFloat)
    silu_mul_rows<float>(gate, up, out);
  else
    silu_mul_rows<c10::BFloat16>(gate, up, out);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llmc, m) { m.def("silu_mul(Tensor gate, Tensor up) -> Tensor"); }

TORCH_LIBRARY_IMPL(llmc, CPU, m) { m.impl("silu_mul", &silu_mul); }
