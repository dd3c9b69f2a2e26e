// GEMV and GEMM on the CPU over weights stored in column panels: out = x @ w.T (+ bias), one kernel
// for every token count, from batch-1 decode to a prompt of thousands of tokens.
//
// Contract (the meaning of kernels/panels.py's panel_linear_ref: F.linear on the unpacked weight):
//   x       [T, K] f32 or bf16, contiguous
//   panels  f32  [P, K, 32]       panel p holds output rows 32p .. 32p + 31; its input k is 32
//                                 consecutive weights, one per row (rows past N are zero)
//           bf16 [P, K/2, 32, 2]  the same with inputs in pairs (2j, 2j + 1) next to each other
//                                 (K even); the panels' dtype is x's
//   n       N, the output features: 32 (P - 1) < N <= 32 P
//   bias    [N] in x's dtype, or undefined; added in fp32
//   -> out  [T, N] in x's dtype: products accumulated in fp32, input by input, rounded once.
//
// How: the threads split the panels, so each streams its own contiguous part of the weight (one
// stream, front to back, which the hardware prefetcher follows). A tile of up to kTile tokens x 32
// outputs lives in 2 kTile accumulator registers whose lanes are outputs (AVX2: 6 tokens x 16
// outputs in 8-lane registers, two tiles a panel): for each input k the panel's two vectors meet
// that input of every token, broadcast (f32: FMA; bf16: one vdpbf16ps per pair of inputs where the
// CPU has AVX512_BF16, else widened), so no horizontal sums are needed. Tokens are taken kTile at a
// time within blocks whose x fits in L2, and every panel of a thread meets a whole block before the
// next, so a panel is read from memory once per block (batch-1 decode: exactly once, kGemvPanels
// panels at a time, so that 8 accumulator chains (AVX2: 12), not 2, hide the FMA / vdpbf16ps
// latency; each output is still summed input by input).
//
// panel_gemm_epilogue: the same GEMM with a generated column-local kernel as its epilogue, the
// GEMM's result never written (panel_epilogue.h states its contract): out [T, W] in x's dtype, N =
// reads x W; the threads split the windows of 32 output columns.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "amx_gemm.h"
#include "panel_epilogue.h"

namespace {

using llmc_panels::kPanel;

template <typename X>
void panel_gemm_typed(const at::Tensor& x, const at::Tensor& panels, int64_t n_dim, const at::Tensor& bias,
                      at::Tensor& out) {
  const int64_t tokens = x.size(0), k_dim = x.size(1), num_panels = panels.size(0);
  const X* xp = x.const_data_ptr<X>();
  const X* wp = panels.const_data_ptr<X>();
  const X* bp = bias.defined() ? bias.const_data_ptr<X>() : nullptr;
  X* op = out.data_ptr<X>();
  at::parallel_for(0, num_panels, 1, [&](int64_t begin, int64_t end) {
    llmc_amx::linear_range(xp, wp, tokens, k_dim, bp, op, n_dim, begin, end);
  });
}

// x, panels, n and bias as the contract states them, or an error naming the one that is not.
void check_operands(const at::Tensor& x, const at::Tensor& panels, int64_t n_dim, const at::Tensor& bias) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be a contiguous [T, K] tensor");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "x must be f32 or bf16, not ",
              x.scalar_type());
  TORCH_CHECK(panels.scalar_type() == x.scalar_type() && panels.is_contiguous(), "panels must be contiguous ",
              x.scalar_type(), ", not ", panels.scalar_type());
  const int64_t k_dim = x.size(1);
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  const bool shaped = bf16 ? panels.dim() == 4 && panels.size(1) * 2 == k_dim && panels.size(2) == kPanel &&
                                 panels.size(3) == 2
                           : panels.dim() == 3 && panels.size(1) == k_dim && panels.size(2) == kPanel;
  TORCH_CHECK(shaped && k_dim % (bf16 ? 2 : 1) == 0, "panels ", panels.sizes(), " do not hold [N, K=", k_dim,
              "] weights as [P, K, 32] (f32) or [P, K/2, 32, 2] (bf16)");
  TORCH_CHECK(n_dim > (panels.size(0) - 1) * kPanel && n_dim <= panels.size(0) * kPanel, "n ", n_dim,
              " does not fit ", panels.size(0), " panels of 32 outputs");
  if (bias.defined())
    TORCH_CHECK(bias.dim() == 1 && bias.size(0) == n_dim && bias.is_contiguous() &&
                    bias.scalar_type() == x.scalar_type(),
                "bias must be a contiguous [", n_dim, "] tensor of x's dtype");
}

at::Tensor panel_gemm(const at::Tensor& x, const at::Tensor& panels, int64_t n_dim,
                      const std::optional<at::Tensor>& bias_opt) {
  const at::Tensor bias = bias_opt.value_or(at::Tensor());
  check_operands(x, panels, n_dim, bias);
  at::Tensor out = at::empty({x.size(0), n_dim}, x.options());
  if (x.scalar_type() == at::kBFloat16)
    panel_gemm_typed<c10::BFloat16>(x, panels, n_dim, bias, out);
  else
    panel_gemm_typed<float>(x, panels, n_dim, bias, out);
  return out;
}

template <typename X>
void panel_gemm_epilogue_typed(const at::Tensor& x, const at::Tensor& panels, const at::Tensor& bias, int64_t window_fn,
                               int64_t reads, const at::Tensor& out) {
  const int64_t width = out.size(1);
  const X* bp = bias.defined() ? bias.const_data_ptr<X>() : nullptr;
  at::parallel_for(0, width / kPanel, 1, [&](int64_t begin, int64_t end) {
    const llmc_panels::Epilogue e{reinterpret_cast<llmc_panels::WindowFn>(static_cast<intptr_t>(window_fn)),
                                  {nullptr, static_cast<char*>(out.data_ptr())}, {reads * width, width}, 0, width,
                                  reads, 0};
    llmc_panels::panel_epilogue_range(x.const_data_ptr<X>(), panels.const_data_ptr<X>(), x.size(0), x.size(1), bp, e,
                                      begin, end);
  });
}

void panel_gemm_epilogue(const at::Tensor& x, const at::Tensor& panels, const std::optional<at::Tensor>& bias_opt,
                         int64_t window_fn, int64_t reads, const at::Tensor& out) {
  const at::Tensor bias = bias_opt.value_or(at::Tensor());
  const int64_t width = out.size(1), n_dim = panels.size(0) * kPanel;
  TORCH_CHECK(out.dim() == 2 && out.is_contiguous() && out.scalar_type() == x.scalar_type() &&
                  out.size(0) == x.size(0) && width % kPanel == 0 && reads >= 1 && reads * width == n_dim,
              "out must be a contiguous [T, W] tensor of x's dtype, W a multiple of 32 and N = ", n_dim,
              " = reads x W");
  check_operands(x, panels, n_dim, bias);
  if (x.scalar_type() == at::kBFloat16)
    panel_gemm_epilogue_typed<c10::BFloat16>(x, panels, bias, window_fn, reads, out);
  else
    panel_gemm_epilogue_typed<float>(x, panels, bias, window_fn, reads, out);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llmc, m) {
  m.def("panel_gemm(Tensor x, Tensor panels, int n, Tensor? bias) -> Tensor");
  m.def("panel_gemm_epilogue(Tensor x, Tensor panels, Tensor? bias, int window_fn, int reads, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(llmc, CPU, m) {
  m.impl("panel_gemm", &panel_gemm);
  m.impl("panel_gemm_epilogue", &panel_gemm_epilogue);
}
