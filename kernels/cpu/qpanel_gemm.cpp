// GEMV and GEMM over int8 / int4 weights in column panels: out = x @ w.T (+ bias), w = scale * code
// (+ min) per group of G inputs, dequantized in registers; panel_gemm.cpp's kernel for quantized weights.
//
// Contract (the meaning of kernels/panels.py's qpanel_linear_ref: kernels/quant.py's qlinear_ref on
// the weight the panels hold):
//   x       [T, K] f32 or bf16 (widened to fp32 once per call)
//   codes   int8 [P, K, 32]: codes[p, k, j] is input k of row 32p + j; or, int4, uint8 [P, K/2, 32]:
//           byte [p, i, j] holds input 2i of row 32p + j in its low nibble, input 2i + 1 in its high
//   scales  f16 [P, K/G, 32] (group g of row 32p + j at [p, g, j]); mins (int4) the same layout
//   n       N, the output features (32 (P - 1) < N <= 32 P; rows past N are zero)
//   bias    [N] in x's dtype, or undefined; added in fp32
//   -> out  [T, N] in x's dtype, rounded once from the fp32 sum.
// G must divide K (int8: a multiple of 16; int4: of 32).
//
// How: as panel_gemm.cpp (threads split the panels; tiles of tokens x 32 outputs whose lanes are
// outputs), with tiles of up to kTile tokens. Within a group the codes (exact in fp32) multiply x
// into partial sums, which meet the group's scales once per group; int4's mins meet the group's
// sum of x (computed once per call), so a code costs one widening and one FMA per token.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <tuple>

#include "qpanel_gemm.h"
#include "qweight_checks.h"

namespace {

using llmc_panels::kPanel;
using llmc_qpanels::QPanels;

template <int Bits, typename Out>
void qpanel_gemm_typed(const at::Tensor& xf, const at::Tensor& xsum, const QPanels& w, int64_t num_panels,
                       int64_t n_dim, const at::Tensor& bias, at::Tensor& out) {
  const float* x = xf.const_data_ptr<float>();
  const float* s = xsum.defined() ? xsum.const_data_ptr<float>() : nullptr;
  const Out* b = bias.defined() ? bias.const_data_ptr<Out>() : nullptr;
  Out* o = out.data_ptr<Out>();
  at::parallel_for(0, num_panels, 1, [&](int64_t begin, int64_t end) {
    llmc_qpanels::qpanel_gemm_range<Bits>(x, s, w, xf.size(0), b, o, n_dim, begin, end);
  });
}

// x widened to fp32 (and int4's group sums of x), the tokens split among the intra-op threads.
template <typename X>
std::tuple<at::Tensor, at::Tensor> widen(const at::Tensor& x, int64_t group, int64_t bits) {
  const int64_t tokens = x.size(0), k_dim = x.size(1);
  at::Tensor xf = at::empty({tokens, k_dim}, x.options().dtype(at::kFloat));
  at::Tensor xsum = bits == 4 ? at::empty({tokens, k_dim / group}, xf.options()) : at::Tensor();
  const X* xp = x.const_data_ptr<X>();
  float* sp = bits == 4 ? xsum.data_ptr<float>() : nullptr;
  at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
    llmc_qpanels::widen_rows(xp, k_dim, group, static_cast<int>(bits), xf.data_ptr<float>(), sp, begin, end);
  });
  return {xf, xsum};
}

at::Tensor qpanel_gemm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                       const std::optional<at::Tensor>& mins_opt, int64_t n_dim,
                       const std::optional<at::Tensor>& bias_opt, int64_t bits, int64_t group) {
  const at::Tensor bias = bias_opt.value_or(at::Tensor());
  TORCH_CHECK(bits == 8 || bits == 4, "bits must be 8 or 4, not ", bits);
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "x must be a [T, K] f32 or bf16 tensor");
  const int64_t k_dim = x.size(1), panels = codes.size(0);
  TORCH_CHECK(codes.dim() == 3 && codes.is_contiguous() && codes.size(2) == kPanel &&
                  codes.scalar_type() == (bits == 8 ? at::kChar : at::kByte) &&
                  codes.size(1) * (bits == 8 ? 1 : 2) == k_dim,
              "codes must be contiguous ", bits == 8 ? "int8 [P, K, 32]" : "uint8 [P, K/2, 32]", " for K=", k_dim,
              ", not ", codes.sizes());
  TORCH_CHECK(group > 0 && k_dim % group == 0 && group % (bits == 8 ? 16 : 32) == 0, "group size ", group,
              " must divide K=", k_dim, " and be a multiple of ", bits == 8 ? 16 : 32);
  llmc_qweights::check_panel_params(x, scales, mins_opt, bias, n_dim, panels, k_dim / group, bits);
  const at::Tensor xc = x.contiguous();
  const auto [xf, xsum] = x.scalar_type() == at::kFloat ? widen<float>(xc, group, bits)
                                                         : widen<c10::BFloat16>(xc, group, bits);
  const QPanels w{codes.const_data_ptr(), scales.const_data_ptr<c10::Half>(),
                  bits == 4 ? mins_opt->const_data_ptr<c10::Half>() : nullptr, k_dim, group, k_dim / group};
  at::Tensor out = at::empty({x.size(0), n_dim}, x.options());
  const bool f32 = x.scalar_type() == at::kFloat;
  if (bits == 8 && f32)
    qpanel_gemm_typed<8, float>(xf, xsum, w, panels, n_dim, bias, out);
  else if (bits == 8)
    qpanel_gemm_typed<8, c10::BFloat16>(xf, xsum, w, panels, n_dim, bias, out);
  else if (f32)
    qpanel_gemm_typed<4, float>(xf, xsum, w, panels, n_dim, bias, out);
  else
    qpanel_gemm_typed<4, c10::BFloat16>(xf, xsum, w, panels, n_dim, bias, out);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llmc, m) {
  m.def("qpanel_gemm(Tensor x, Tensor codes, Tensor scales, Tensor? mins, int n, Tensor? bias, int bits, "
        "int group_size) -> Tensor");
}

TORCH_LIBRARY_IMPL(llmc, CPU, m) { m.impl("qpanel_gemm", &qpanel_gemm); }
