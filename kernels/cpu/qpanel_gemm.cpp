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

#include <cstring>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

#include "kv_rows.h"
#include "panel_tiles.h"

namespace {

using llmc_cpu::Vec16;
using llmc_panels::kAhead;
using llmc_panels::kPanel;

constexpr int kTile = 4;   // tokens per tile: 8 accumulators + 8 partial sums + 4 weight vectors

// 16 f16 values widened to fp32.
inline Vec16 load16_half(const c10::Half* p) {
#ifdef __AVX512F__
  return (Vec16)_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#else
  float tmp[16];
  for (int i = 0; i < 16; ++i) tmp[i] = static_cast<float>(p[i]);
  return llmc_cpu::load16(tmp);
#endif
}

// 16 bytes of int4 pairs -> the low nibbles' codes and the high nibbles' codes, as fp32.
inline void load16_nibbles(const uint8_t* p, Vec16& lo, Vec16& hi) {
#ifdef __AVX512F__
  const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  lo = (Vec16)_mm512_cvtepi32_ps(_mm512_and_si512(bytes, _mm512_set1_epi32(15)));
  hi = (Vec16)_mm512_cvtepi32_ps(_mm512_srli_epi32(bytes, 4));
#else
  float l[16], h[16];
  for (int i = 0; i < 16; ++i) l[i] = static_cast<float>(p[i] & 15), h[i] = static_cast<float>(p[i] >> 4);
  lo = llmc_cpu::load16(l), hi = llmc_cpu::load16(h);
#endif
}

struct QPanels {
  const void* codes;
  const c10::Half* scales;
  const c10::Half* mins;      // int4 only
  int64_t k_dim, group, groups;
};

// One group's partial sums: TT tokens (x0, row stride K, from input k0) times its codes. Inlined,
// so `part` stays in registers (a call kept it in memory: int8 ran 2x slower at 4 tokens).
template <int TT, int Bits>
__attribute__((always_inline)) inline void group_sums(const float* x0, const void* codes, int64_t k0, int64_t group, int64_t k_dim, Vec16 (&part)[TT][2]) {
  for (int t = 0; t < TT; ++t) part[t][0] = part[t][1] = Vec16{};
  if constexpr (Bits == 8) {
    const int8_t* c = static_cast<const int8_t*>(codes) + k0 * kPanel;
    for (int64_t k = k0; k < k0 + group; ++k, c += kPanel) {
      __builtin_prefetch(c + kAhead);
      const Vec16 w0 = llmc_cpu::load16_codes(c), w1 = llmc_cpu::load16_codes(c + 16);
      for (int t = 0; t < TT; ++t) {
        const Vec16 xv = llmc_cpu::splat(x0[t * k_dim + k]);
        part[t][0] += w0 * xv;
        part[t][1] += w1 * xv;
      }
    }
  } else {
    const uint8_t* c = static_cast<const uint8_t*>(codes) + k0 / 2 * kPanel;
    for (int64_t k = k0; k < k0 + group; k += 2, c += kPanel) {
      __builtin_prefetch(c + kAhead);
      Vec16 even[2], odd[2];
      load16_nibbles(c, even[0], odd[0]);
      load16_nibbles(c + 16, even[1], odd[1]);
      for (int t = 0; t < TT; ++t) {
        const Vec16 xe = llmc_cpu::splat(x0[t * k_dim + k]), xo = llmc_cpu::splat(x0[t * k_dim + k + 1]);
        for (int h = 0; h < 2; ++h) part[t][h] += even[h] * xe + odd[h] * xo;
      }
    }
  }
}

// TT tokens times panel p: per group, partial sums scaled once (and int4's min times the group's x sum).
template <int TT, int Bits, typename Out>
void qtile(const float* x0, const float* xsum0, const QPanels& w, int64_t p, const Out* bias, Out* out, int64_t t0,
           int64_t n_dim) {
  const int64_t panel_codes = (Bits == 8 ? w.k_dim : w.k_dim / 2) * kPanel;
  const void* codes = static_cast<const int8_t*>(w.codes) + p * panel_codes;
  const c10::Half* scales = w.scales + p * w.groups * kPanel;
  const c10::Half* mins = Bits == 4 ? w.mins + p * w.groups * kPanel : nullptr;
  Vec16 acc[TT][2], part[TT][2];
  for (int t = 0; t < TT; ++t) acc[t][0] = acc[t][1] = Vec16{};
  for (int64_t g = 0; g < w.groups; ++g) {
    group_sums<TT, Bits>(x0, codes, g * w.group, w.group, w.k_dim, part);
    const Vec16 s[2] = {load16_half(scales + g * kPanel), load16_half(scales + g * kPanel + 16)};
    for (int t = 0; t < TT; ++t)
      for (int h = 0; h < 2; ++h) acc[t][h] += part[t][h] * s[h];
    if constexpr (Bits == 4) {
      const Vec16 m[2] = {load16_half(mins + g * kPanel), load16_half(mins + g * kPanel + 16)};
      for (int t = 0; t < TT; ++t)
        for (int h = 0; h < 2; ++h) acc[t][h] += m[h] * llmc_cpu::splat(xsum0[t * w.groups + g]);
    }
  }
  llmc_panels::store_tile<TT>(acc, bias, out, t0, p * kPanel, n_dim);
}

template <int Bits, typename Out>
void run_tile(const float* x, const float* xsum, const QPanels& w, int64_t p, const Out* bias, Out* out, int64_t t0,
              int64_t tt, int64_t n_dim) {
  const float* x0 = x + t0 * w.k_dim;
  const float* s0 = xsum ? xsum + t0 * w.groups : nullptr;
  switch (tt) {
    case 4: qtile<4, Bits>(x0, s0, w, p, bias, out, t0, n_dim); break;
    case 3: qtile<3, Bits>(x0, s0, w, p, bias, out, t0, n_dim); break;
    case 2: qtile<2, Bits>(x0, s0, w, p, bias, out, t0, n_dim); break;
    default: qtile<1, Bits>(x0, s0, w, p, bias, out, t0, n_dim);
  }
}

template <int Bits, typename Out>
void qpanel_gemm_typed(const at::Tensor& xf, const at::Tensor& xsum, const QPanels& w, int64_t num_panels,
                       int64_t n_dim, const at::Tensor& bias, at::Tensor& out) {
  const int64_t tokens = xf.size(0);
  const float* x = xf.const_data_ptr<float>();
  const float* s = xsum.defined() ? xsum.const_data_ptr<float>() : nullptr;
  const Out* b = bias.defined() ? bias.const_data_ptr<Out>() : nullptr;
  Out* o = out.data_ptr<Out>();
  llmc_panels::for_each_tile(num_panels, tokens, w.k_dim, sizeof(float), kTile, [&](int64_t p, int64_t t0, int64_t tt) {
    run_tile<Bits>(x, s, w, p, b, o, t0, tt, n_dim);
  });
}

void check_params(const at::Tensor& t, int64_t panels, int64_t groups, const char* what) {
  TORCH_CHECK(t.scalar_type() == at::kHalf && t.is_contiguous() && t.dim() == 3 && t.size(0) == panels &&
                  t.size(1) == groups && t.size(2) == kPanel,
              what, " must be contiguous f16 [", panels, ", ", groups, ", 32], not ", t.scalar_type(), " ", t.sizes());
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
  TORCH_CHECK(n_dim > (panels - 1) * kPanel && n_dim <= panels * kPanel, "n ", n_dim, " does not fit ", panels,
              " panels of 32 outputs");
  check_params(scales, panels, k_dim / group, "scales");
  if (bits == 4) {
    TORCH_CHECK(mins_opt.has_value(), "int4 weights need mins");
    check_params(*mins_opt, panels, k_dim / group, "mins");
  }
  if (bias.defined())
    TORCH_CHECK(bias.dim() == 1 && bias.size(0) == n_dim && bias.is_contiguous() &&
                    bias.scalar_type() == x.scalar_type(),
                "bias must be a contiguous [", n_dim, "] tensor of x's dtype");
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  const at::Tensor xsum = bits == 4 ? xf.view({x.size(0), k_dim / group, group}).sum(-1).contiguous() : at::Tensor();
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
