// RMSNorm, optionally fused with the residual add before it, on the CPU.
//
// Contract (the meaning of kernels/rmsnorm.py's rmsnorm_ref / add_rmsnorm_ref):
//   x, residual  [T, N] f32 or bf16, rows contiguous (any row stride); weight [N], x's dtype
//   add_rmsnorm(x, residual, weight, eps) -> (normed [T, N], sum [T, N]): sum = x + residual,
//       rounded to x's dtype; normed = weight * (sum / sqrt(mean(sum^2) + eps)) with the mean and
//       the scaling in fp32
//   rmsnorm(x, weight, eps) -> normed
// N must be a multiple of 16. Rows are split across ATen's intra-op threads.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <tuple>
#include <type_traits>

#include "token_rows.h"

namespace {

using llmc_rows::norm_row;

void check(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be [T, N] with contiguous rows");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "x must be f32 or bf16, not ",
              x.scalar_type());
  TORCH_CHECK(weight.dim() == 1 && weight.is_contiguous() && weight.size(0) == x.size(1) &&
                  weight.scalar_type() == x.scalar_type(),
              "weight must be a contiguous [N] tensor of x's dtype");
  TORCH_CHECK(x.size(1) % 16 == 0, "width ", x.size(1), " is not a multiple of 16");
}

template <typename T>
void norm_rows(const at::Tensor& x, const at::Tensor* residual, const at::Tensor& weight, at::Tensor* sum,
               at::Tensor& out, double eps) {
  const int64_t n = x.size(1);
  at::parallel_for(0, x.size(0), 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      norm_row(x.const_data_ptr<T>() + t * x.stride(0),
               residual ? residual->const_data_ptr<T>() + t * residual->stride(0) : nullptr,
               weight.const_data_ptr<T>(), sum ? sum->data_ptr<T>() + t * n : nullptr,
               out.data_ptr<T>() + t * n, n, static_cast<float>(eps));
  });
}

template <typename F>
void dispatch(const at::Tensor& x, F&& f) {
  if (x.scalar_type() == at::kFloat)
    f(static_cast<float*>(nullptr));
  else
    f(static_cast<c10::BFloat16*>(nullptr));
}

std::tuple<at::Tensor, at::Tensor> add_rmsnorm(const at::Tensor& x, const at::Tensor& residual,
                                               const at::Tensor& weight, double eps) {
  check(x, weight);
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.stride(1) == 1 && residual.scalar_type() == x.scalar_type(),
              "residual must match x");
  at::Tensor out = at::empty(x.sizes(), x.options()), sum = at::empty(x.sizes(), x.options());
  dispatch(x, [&](auto* typed) { norm_rows<std::remove_pointer_t<decltype(typed)>>(x, &residual, weight, &sum, out, eps); });
  return {out, sum};
}

at::Tensor rmsnorm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check(x, weight);
  at::Tensor out = at::empty(x.sizes(), x.options());
  dispatch(x, [&](auto* typed) { norm_rows<std::remove_pointer_t<decltype(typed)>>(x, nullptr, weight, nullptr, out, eps); });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llmc, m) {
  m.def("add_rmsnorm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("rmsnorm(Tensor x, Tensor weight, float eps) -> Tensor");
}

TORCH_LIBRARY_IMPL(llmc, CPU, m) {
  m.impl("add_rmsnorm", &add_rmsnorm);
  m.impl("rmsnorm", &rmsnorm);
}
