// The argument checks the two quantized GEMM ops share (qpanel_gemm.cpp: codes widened in registers;
// qdot_gemm.cpp: int8 activations): n fits the panels, the scales (and int4's mins) are f16 [P, K/G, 32]
// panels, the bias is a contiguous [N] of x's dtype. Each op checks its own codes' layout and group rule.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>

#include "panel_tiles.h"

namespace llmc_qweights {

inline void check_params(const at::Tensor& t, int64_t panels, int64_t groups, const char* what) {
  TORCH_CHECK(t.scalar_type() == at::kHalf && t.is_contiguous() && t.dim() == 3 && t.size(0) == panels &&
                  t.size(1) == groups && t.size(2) == llmc_panels::kPanel,
              what, " must be contiguous f16 [", panels, ", ", groups, ", 32], not ", t.scalar_type(), " ", t.sizes());
}

inline void check_panel_params(const at::Tensor& x, const at::Tensor& scales, const std::optional<at::Tensor>& mins,
                               const at::Tensor& bias, int64_t n_dim, int64_t panels, int64_t groups, int64_t bits) {
  TORCH_CHECK(n_dim > (panels - 1) * llmc_panels::kPanel && n_dim <= panels * llmc_panels::kPanel, "n ", n_dim,
              " does not fit ", panels, " panels of 32 outputs");
  check_params(scales, panels, groups, "scales");
  if (bits == 4) {
    TORCH_CHECK(mins.has_value(), "int4 weights need mins");
    check_params(*mins, panels, groups, "mins");
  }
  if (bias.defined())
    TORCH_CHECK(bias.dim() == 1 && bias.size(0) == n_dim && bias.is_contiguous() &&
                    bias.scalar_type() == x.scalar_type(),
                "bias must be a contiguous [", n_dim, "] tensor of x's dtype");
}

}  // namespace llmc_qweights
