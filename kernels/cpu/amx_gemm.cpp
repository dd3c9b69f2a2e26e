// The AMX bf16 panel GEMM as ops (amx_gemm.h has the kernel, its contract and the path choice):
//   amx_panel_gemm(x, panels, n, bias) -> out   panel_gemm's contract for bf16, always on AMX tiles
//                                               (at every token count; an error where AMX is not
//                                               usable): the kernel's own check
//   amx_gemm_epilogue(x, panels, bias, window_fn, reads, out)
//                                               amx_epilogue.h's fused GEMM, for tests: a one-input
//                                               generated epilogue (window_fn: its NAME_cols
//                                               address) over the GEMM's result into out [T, W]
//                                               (N = reads x W), the tokens split among ATen's threads
//   cpu_gemm_path() -> (str, str)               the path a bf16 GEMM of kMinTokens or more tokens
//                                               takes here: ("amx-bf16", ""), or ("avx512-bf16",
//                                               why AMX is not taken)
// panel_gemm itself, and the step plan's linear, take AMX for bf16 from llmc_amx::kMinTokens tokens
// where it is usable (llmc_amx::linear_range).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <string>
#include <tuple>

#include "amx_epilogue.h"
#include "amx_gemm.h"

namespace {

at::Tensor amx_panel_gemm(const at::Tensor& x, const at::Tensor& panels, int64_t n_dim,
                          const std::optional<at::Tensor>& bias_opt) {
  const at::Tensor bias = bias_opt.value_or(at::Tensor());
  TORCH_CHECK(llmc_amx::support().usable, "AMX is not usable here: ", llmc_amx::support().why);
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kBFloat16,
              "x must be a contiguous bf16 [T, K] tensor");
  const int64_t k_dim = x.size(1), num_panels = panels.size(0);
  TORCH_CHECK(panels.scalar_type() == at::kBFloat16 && panels.is_contiguous() && panels.dim() == 4 &&
                  panels.size(1) * 2 == k_dim && panels.size(2) == llmc_panels::kPanel && panels.size(3) == 2,
              "panels ", panels.sizes(), " do not hold [N, K=", k_dim, "] bf16 weights as [P, K/2, 32, 2]");
  TORCH_CHECK(n_dim > (num_panels - 1) * llmc_panels::kPanel && n_dim <= num_panels * llmc_panels::kPanel, "n ",
              n_dim, " does not fit ", num_panels, " panels of 32 outputs");
  if (bias.defined())
    TORCH_CHECK(bias.dim() == 1 && bias.size(0) == n_dim && bias.is_contiguous() &&
                    bias.scalar_type() == at::kBFloat16,
                "bias must be a contiguous bf16 [", n_dim, "] tensor");
  at::Tensor out = at::empty({x.size(0), n_dim}, x.options());
#if defined(__x86_64__)
  const auto* xp = x.const_data_ptr<c10::BFloat16>();
  const auto* wp = panels.const_data_ptr<c10::BFloat16>();
  const auto* bp = bias.defined() ? bias.const_data_ptr<c10::BFloat16>() : nullptr;
  auto* op = out.data_ptr<c10::BFloat16>();
  at::parallel_for(0, num_panels, 1, [&](int64_t begin, int64_t end) {
    llmc_amx::gemm_range(xp, wp, x.size(0), k_dim, bp, op, n_dim, begin, end);
  });
#endif
  return out;
}

void amx_gemm_epilogue(const at::Tensor& x, const at::Tensor& panels, const std::optional<at::Tensor>& bias,
                       int64_t window_fn, int64_t reads, const at::Tensor& out) {
  TORCH_CHECK(llmc_amx::support().usable, "AMX is not usable here: ", llmc_amx::support().why);
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kBFloat16 && panels.dim() == 4 &&
                  panels.is_contiguous() && panels.scalar_type() == at::kBFloat16 && panels.size(1) * 2 == x.size(1),
              "x must be a contiguous bf16 [T, K] tensor and panels bf16 [P, K/2, 32, 2]");
  const int64_t width = out.size(1), n_dim = panels.size(0) * llmc_panels::kPanel;
  TORCH_CHECK(out.dim() == 2 && out.is_contiguous() && out.scalar_type() == at::kBFloat16 &&
                  out.size(0) == x.size(0) && width % llmc_panels::kPanel == 0 && reads >= 1 && reads * width == n_dim,
              "out must be a contiguous bf16 [T, W] tensor, W a multiple of 32 and N = ", n_dim, " = reads x W");
  TORCH_CHECK(!bias || (bias->is_contiguous() && bias->numel() == n_dim && bias->scalar_type() == at::kBFloat16),
              "bias must be a contiguous bf16 [N] tensor");
#if defined(__x86_64__)
  const auto* bp = bias ? bias->const_data_ptr<c10::BFloat16>() : nullptr;
  at::parallel_for(0, x.size(0), 1, [&](int64_t begin, int64_t end) {
    const llmc_panels::Epilogue e{reinterpret_cast<llmc_panels::WindowFn>(static_cast<intptr_t>(window_fn)),
                                  {nullptr, static_cast<char*>(out.data_ptr())}, {n_dim, width}, 0, width, reads,
                                  begin};
    llmc_amx::epilogue_range(x.const_data_ptr<c10::BFloat16>() + begin * x.size(1),
                             panels.const_data_ptr<c10::BFloat16>(), end - begin, x.size(1), bp, e);
  });
#endif
}

std::tuple<std::string, std::string> cpu_gemm_path() {
  auto [path, why] = llmc_amx::gemm_path();
  return {path, why};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llmc, m) {
  m.def("amx_panel_gemm(Tensor x, Tensor panels, int n, Tensor? bias) -> Tensor");
  m.def("amx_gemm_epilogue(Tensor x, Tensor panels, Tensor? bias, int window_fn, int reads, Tensor(a!) out) -> ()");
  m.def("cpu_gemm_path() -> (str, str)", &cpu_gemm_path);
}

TORCH_LIBRARY_IMPL(llmc, CPU, m) {
  m.impl("amx_panel_gemm", &amx_panel_gemm);
  m.impl("amx_gemm_epilogue", &amx_gemm_epilogue);
}
