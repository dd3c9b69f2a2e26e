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
// outputs lives in 2 kTile accumulator registers whose lanes are outputs: for each input k the
// panel's two 16-lane vectors meet that input of every token, broadcast (f32: FMA; bf16: one
// vdpbf16ps per pair of inputs where the CPU has AVX512_BF16, else widened), so no horizontal sums
// are needed. Tokens are taken kTile at a time within blocks whose x fits in L2, and every panel
// of a thread meets a whole block before the next, so a panel is read from memory once per block
// (batch-1 decode: exactly once).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <type_traits>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#include "panel_tiles.h"

namespace {

using llmc_cpu::load16;
using llmc_cpu::Vec16;
using llmc_panels::kAhead;
using llmc_panels::kPanel;
using llmc_panels::store_tile;

constexpr int kTile = 12;                // tokens per tile: 24 accumulators + 2 weight vectors in 32 registers

// f32: TT tokens (rows of x from x0, stride K) times one panel [K, 32].
template <int TT, typename Out>
void tile_f32(const float* x0, const float* panel, int64_t k_dim, const Out* bias, Out* out, int64_t t0, int64_t n0,
              int64_t n_dim) {
  Vec16 acc[TT][2];
  for (int t = 0; t < TT; ++t) acc[t][0] = acc[t][1] = Vec16{};
  for (int64_t k = 0; k < k_dim; ++k) {
    const float* w = panel + k * kPanel;
    __builtin_prefetch(reinterpret_cast<const char*>(w) + kAhead);
    __builtin_prefetch(reinterpret_cast<const char*>(w) + kAhead + 64);
    const Vec16 w0 = load16(w), w1 = load16(w + 16);
#pragma GCC unroll 12
    for (int t = 0; t < TT; ++t) {
      const Vec16 xv = llmc_cpu::splat(x0[t * k_dim + k]);
      acc[t][0] += w0 * xv;
      acc[t][1] += w1 * xv;
    }
  }
  store_tile<TT>(acc, bias, out, t0, n0, n_dim);
}

// bf16: TT tokens times one panel [K/2, 32, 2] of input pairs.
template <int TT>
void tile_bf16(const c10::BFloat16* x0, const c10::BFloat16* panel, int64_t k_dim, const c10::BFloat16* bias,
               c10::BFloat16* out, int64_t t0, int64_t n0, int64_t n_dim) {
  Vec16 acc[TT][2];
  for (int t = 0; t < TT; ++t) acc[t][0] = acc[t][1] = Vec16{};
  for (int64_t k = 0; k < k_dim; k += 2) {
    const c10::BFloat16* w = panel + k * kPanel;      // 32 rows x (k, k + 1)
    __builtin_prefetch(reinterpret_cast<const char*>(w) + kAhead);
    __builtin_prefetch(reinterpret_cast<const char*>(w) + kAhead + 64);
#if defined(__AVX512BF16__)
    const __m512bh w0 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(w));
    const __m512bh w1 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(w + 32));
#pragma GCC unroll 12
    for (int t = 0; t < TT; ++t) {
      int32_t pair;
      std::memcpy(&pair, x0 + t * k_dim + k, sizeof(pair));
      const __m512bh xv = reinterpret_cast<__m512bh>(_mm512_set1_epi32(pair));
      acc[t][0] = reinterpret_cast<Vec16>(_mm512_dpbf16_ps(reinterpret_cast<__m512>(acc[t][0]), w0, xv));
      acc[t][1] = reinterpret_cast<Vec16>(_mm512_dpbf16_ps(reinterpret_cast<__m512>(acc[t][1]), w1, xv));
    }
#else
    Vec16 even[2], odd[2];                             // inputs k and k + 1 of rows 0-15 and 16-31
    for (int h = 0; h < 2; ++h) {
      llmc_cpu::Uint16 bits;
      std::memcpy(&bits, w + 32 * h, sizeof(bits));
      const llmc_cpu::Uint16 lo = bits << 16, hi = bits & 0xFFFF0000u;
      std::memcpy(&even[h], &lo, sizeof(lo));
      std::memcpy(&odd[h], &hi, sizeof(hi));
    }
    for (int t = 0; t < TT; ++t) {
      const Vec16 xe = llmc_cpu::splat(static_cast<float>(x0[t * k_dim + k]));
      const Vec16 xo = llmc_cpu::splat(static_cast<float>(x0[t * k_dim + k + 1]));
      for (int h = 0; h < 2; ++h) acc[t][h] += even[h] * xe + odd[h] * xo;
    }
#endif
  }
  store_tile<TT>(acc, bias, out, t0, n0, n_dim);
}

template <int TT, typename X>
void tile(const X* x0, const X* panel, int64_t k_dim, const X* bias, X* out, int64_t t0, int64_t n0,
          int64_t n_dim) {
  if constexpr (std::is_same_v<X, float>)
    tile_f32<TT>(x0, panel, k_dim, bias, out, t0, n0, n_dim);
  else
    tile_bf16<TT>(x0, panel, k_dim, bias, out, t0, n0, n_dim);
}

// Tokens t0 .. t0 + tt - 1 (tt <= kTile) times panel p.
template <typename X>
void run_tile(const X* x, const X* panels, int64_t k_dim, const X* bias, X* out, int64_t t0, int64_t tt, int64_t p,
              int64_t n_dim) {
  const X* x0 = x + t0 * k_dim;
  const X* panel = panels + p * k_dim * kPanel;
  const int64_t n0 = p * kPanel;
  switch (tt) {
#define LLMC_TILE(n) \
  case n: tile<n>(x0, panel, k_dim, bias, out, t0, n0, n_dim); break;
    LLMC_TILE(12) LLMC_TILE(11) LLMC_TILE(10) LLMC_TILE(9) LLMC_TILE(8) LLMC_TILE(7)
    LLMC_TILE(6) LLMC_TILE(5) LLMC_TILE(4) LLMC_TILE(3) LLMC_TILE(2)
#undef LLMC_TILE
    default: tile<1>(x0, panel, k_dim, bias, out, t0, n0, n_dim);
  }
}

template <typename X>
void panel_gemm_typed(const at::Tensor& x, const at::Tensor& panels, int64_t n_dim, const at::Tensor& bias,
                      at::Tensor& out) {
  const int64_t tokens = x.size(0), k_dim = x.size(1), num_panels = panels.size(0);
  const X* xp = x.const_data_ptr<X>();
  const X* wp = panels.const_data_ptr<X>();
  const X* bp = bias.defined() ? bias.const_data_ptr<X>() : nullptr;
  X* op = out.data_ptr<X>();
  llmc_panels::for_each_tile(num_panels, tokens, k_dim, sizeof(X), kTile, [&](int64_t p, int64_t t0, int64_t tt) {
    run_tile(xp, wp, k_dim, bp, op, t0, tt, p, n_dim);
  });
}

at::Tensor panel_gemm(const at::Tensor& x, const at::Tensor& panels, int64_t n_dim,
                      const std::optional<at::Tensor>& bias_opt) {
  const at::Tensor bias = bias_opt.value_or(at::Tensor());
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
  at::Tensor out = at::empty({x.size(0), n_dim}, x.options());
  if (bf16)
    panel_gemm_typed<c10::BFloat16>(x, panels, n_dim, bias, out);
  else
    panel_gemm_typed<float>(x, panels, n_dim, bias, out);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llmc, m) { m.def("panel_gemm(Tensor x, Tensor panels, int n, Tensor? bias) -> Tensor"); }

TORCH_LIBRARY_IMPL(llmc, CPU, m) { m.impl("panel_gemm", &panel_gemm); }
