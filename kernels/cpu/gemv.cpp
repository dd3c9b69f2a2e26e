// GEMV and small-batch GEMM on the CPU: out = x @ w.T (+ bias) over row-major weights of f32, bf16,
// int8 or int4, each weight dequantized in registers and every product accumulated in fp32. The
// runtime keeps float weights as panels (panel_gemm.cpp); `gemv` over row-major float weights is
// the kernel those replaced, kept as the benchmarks' baseline (tools/bench_gemv.py).
//
// Contract (the meaning of kernels/gemv.py's gemv_ref: F.linear for float weights, kernels/quant.py's
// qlinear_ref for quantized ones):
//   x      [T, K] f32 or bf16; widened to fp32 (bf16 x times bf16 weights: bf16 pair products,
//          exact in fp32, where the CPU has AVX512-BF16)
//   weight f32 / bf16 [N, K] (x's dtype), or int8 codes i8 [N, K] with f16 scales [N, K/G]
//          (w = scale * code, G a multiple of 16), or int4 codes u8 [N, K/2] (blocks of 32 codes,
//          byte b holding code b low and code b + 16 high) with f16 scales and mins [N, K/G]
//          (w = scale * code + min, G a multiple of 32); all contiguous, as the artifact stores them
//   bias   [N] (x's dtype) or an undefined tensor; added in fp32
//   -> out [T, N] in x's dtype, rounded once from the fp32 sum.
// Float weights take any K; quantized ones K a multiple of G.
//
// How: output rows are split into contiguous ranges, one per ATen (OpenMP) thread, so every core
// streams its own part of the weight. Each pass takes R rows (for one token the format's kRows,
// else 6, or 4 for int4) and up to 4 tokens: R row streams are read once, dequantized in
// registers, and multiplied into R x TT fp32 accumulators, one 16-lane vector each; tokens beyond
// 4 reuse the R rows from L1 (quantized rows dequantized once into an fp32 buffer there, so more
// tokens cost no more dequantization). Each row stream prefetches the same place R rows on, in
// the next pass: rows are short (576 inputs), and a hardware prefetcher sees a new row only once
// it starts.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <type_traits>
#include <vector>

#include "gemv_formats.h"

namespace {

using namespace llmc_gemv;

constexpr int kMaxTokens = 4;          // tokens per pass

// Rows n0..n0+R-1 times tokens x[0..TT-1] ([TT, K], row stride K) -> sums[t * R + r].
template <int R, int TT, typename W, typename X>
void tile(const W& w, int64_t n0, const X* x, float* sums) {
  constexpr int V = W::kStep / 16;
  const int64_t k_dim = w.k_dim, k_main = k_dim - k_dim % W::kStep;
  const char* rows[R];
  for (int r = 0; r < R; ++r) rows[r] = w.row(n0 + r);
  const int64_t ahead = R * W::offset(k_dim);     // prefetch: the same place in the next pass's rows
  Vec16 acc[R][TT];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < TT; ++t) acc[r][t] = Vec16{};
  Vec16 s16[R], m16[R];
  for (int64_t g = 0, g0 = 0; g0 < k_main; ++g, g0 += w.group) {
    if (g % 16 == 0)
      for (int r = 0; r < R; ++r) w.params16(n0 + r, g, s16[r], m16[r]);
    Vec16 s[R], m[R];
    for (int r = 0; r < R; ++r) s[r] = lane(s16[r], g % 16), m[r] = lane(m16[r], g % 16);
    const int64_t g_end = std::min(g0 + w.group, k_main);
    for (int64_t k = g0; k < g_end; k += W::kStep) {
      Vec16 wv[R][V];
      for (int r = 0; r < R; ++r) {
        __builtin_prefetch(rows[r] + W::offset(k) + ahead);
        w.load(rows[r], k, s[r], m[r], wv[r]);
      }
      for (int t = 0; t < TT; ++t)
        for (int v = 0; v < V; ++v) {
          const Vec16 xv = load16(x + t * k_dim + k + 16 * v);
          for (int r = 0; r < R; ++r) acc[r][t] = fma16(wv[r][v], xv, acc[r][t]);
        }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < TT; ++t) {
      float sum = llmc_cpu::hsum(acc[r][t]);
      for (int64_t k = k_main; k < k_dim; ++k) sum += w.at(n0 + r, k) * static_cast<float>(x[t * k_dim + k]);
      sums[t * R + r] = sum;
    }
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define LLMC_INT4_NIBBLE_ORDER 1
// int4 for up to 4 tokens, in nibble order: 64 bytes of codes (4 blocks, 128 inputs) load as 16
// dwords, and nibble j of every dword is one vector of 16 codes, by shift and mask alone (no
// byte-widening shuffles, which cap the plain order's rate). x is permuted once per call into the
// same order (`nibble_input`); the K % 128 inputs left over run in the plain order.
constexpr int64_t kChunk = 128;

// The input (within its chunk) that lane i of nibble vector j holds: byte 4i + j/2, low or high nibble.
inline int64_t nibble_input(int64_t j, int64_t i) {
  const int64_t byte = 4 * i + (j >> 1);
  return (byte / 16) * 32 + byte % 16 + 16 * (j & 1);
}

// x [T, K] fp32 -> xp [T, K]: each whole chunk of 128 inputs in nibble order, the rest as it is.
void nibble_order(const float* x, int64_t tokens, int64_t k_dim, float* xp) {
  const int64_t k_chunks = k_dim - k_dim % kChunk;
  for (int64_t t = 0; t < tokens; ++t) {
    const float* src = x + t * k_dim;
    float* dst = xp + t * k_dim;
    for (int64_t c = 0; c < k_chunks; c += kChunk)
      for (int64_t j = 0; j < 8; ++j)
        for (int64_t i = 0; i < 16; ++i) dst[c + 16 * j + i] = src[c + nibble_input(j, i)];
    std::memcpy(dst + k_chunks, src + k_chunks, (k_dim - k_chunks) * sizeof(float));
  }
}

// The scales (or mins) of the 1, 2 or 4 groups of a chunk, as lanes: lane i is in block i / 4.
inline Vec16 chunk_params(const c10::Half* p, int64_t groups_in_chunk, __m512i lane_group) {
  const __m128i halves = _mm_maskz_loadu_epi16(static_cast<__mmask8>((1u << groups_in_chunk) - 1), p);
  return _mm512_permutexvar_ps(lane_group, _mm512_cvtph_ps(_mm256_castsi128_si256(halves)));
}

template <int R, int TT>
void tile_nibbles(const Int4Rows& w, int64_t n0, const float* xp, float* sums) {
  const int64_t k_dim = w.k_dim, k_chunks = k_dim - k_dim % kChunk, blocks_per_group = w.group / 32;
  const int64_t groups_in_chunk = kChunk / w.group > 0 ? kChunk / w.group : 1;
  const llmc_cpu::Int16 block_of_lane = {0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3};
  const __m512i lane_group = reinterpret_cast<__m512i>(block_of_lane / static_cast<int32_t>(blocks_per_group));
  Vec16 acc[R][TT];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < TT; ++t) acc[r][t] = Vec16{};
  for (int64_t c = 0; c < k_chunks; c += kChunk) {
    for (int r = 0; r < R; ++r) {
      const char* row = w.row(n0 + r) + c / 2;
      __builtin_prefetch(row + R * (k_dim / 2));        // the next pass's rows
      llmc_cpu::Uint16 raw;
      std::memcpy(&raw, row, sizeof(raw));
      const int64_t gi = (n0 + r) * w.groups + c / w.group;
      const Vec16 s = chunk_params(w.scales + gi, groups_in_chunk, lane_group);
      const Vec16 m = chunk_params(w.mins + gi, groups_in_chunk, lane_group);
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) {
        const llmc_cpu::Int16 code = __builtin_convertvector((raw >> (4 * j)) & 15u, llmc_cpu::Int16);
        const Vec16 wv = fma16(__builtin_convertvector(code, Vec16), s, m);
        for (int t = 0; t < TT; ++t) acc[r][t] = fma16(wv, load16(xp + t * k_dim + c + 16 * j), acc[r][t]);
      }
    }
  }
  for (int64_t k = k_chunks; k < k_dim; k += Int4Rows::kStep)      // the blocks past the last chunk
    for (int r = 0; r < R; ++r) {
      const int64_t gi = (n0 + r) * w.groups + k / w.group;
      Vec16 v[2];
      w.load(w.row(n0 + r), k, splat(half_to_float(w.scales[gi])), splat(half_to_float(w.mins[gi])), v);
      for (int t = 0; t < TT; ++t)
        acc[r][t] = fma16(v[1], load16(xp + t * k_dim + k + 16), fma16(v[0], load16(xp + t * k_dim + k), acc[r][t]));
    }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < TT; ++t) sums[t * R + r] = llmc_cpu::hsum(acc[r][t]);
}
#endif

#ifdef __AVX512BF16__
// bf16 rows read as pairs for vdpbf16ps: each instruction adds 32 products (bf16 x bf16, exact in
// fp32) into 16 fp32 lanes, twice the multiply rate of widening to fp32 and one FMA per lane.
struct DotBf16Rows {
  static constexpr int kStep = 32;
  static constexpr int kRows = 4;          // measured: 8 rows of pair products stream no faster
  static constexpr bool kFloat = true;
  const c10::BFloat16* w;
  int64_t k_dim, group;
  const char* row(int64_t n) const { return reinterpret_cast<const char*>(w + n * k_dim); }
  float at(int64_t n, int64_t k) const { return static_cast<float>(w[n * k_dim + k]); }
};

template <int R, int TT>
void tile(const DotBf16Rows& w, int64_t n0, const c10::BFloat16* x, float* sums) {
  const int64_t k_dim = w.k_dim, k_main = k_dim - k_dim % DotBf16Rows::kStep;
  const c10::BFloat16* rows[R];
  for (int r = 0; r < R; ++r) rows[r] = w.w + (n0 + r) * k_dim;
  __m512 acc[R][TT];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < TT; ++t) acc[r][t] = _mm512_setzero_ps();
  for (int64_t k = 0; k < k_main; k += DotBf16Rows::kStep) {
    __m512bh wv[R];
    for (int r = 0; r < R; ++r) {
      __builtin_prefetch(rows[r] + k + R * k_dim);       // the next pass's rows
      wv[r] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(rows[r] + k));
    }
    for (int t = 0; t < TT; ++t) {
      const __m512bh xv = reinterpret_cast<__m512bh>(_mm512_loadu_si512(x + t * k_dim + k));
      for (int r = 0; r < R; ++r) acc[r][t] = _mm512_dpbf16_ps(acc[r][t], wv[r], xv);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < TT; ++t) {
      float sum = _mm512_reduce_add_ps(acc[r][t]);
      for (int64_t k = k_main; k < k_dim; ++k) sum += w.at(n0 + r, k) * static_cast<float>(x[t * k_dim + k]);
      sums[t * R + r] = sum;
    }
}
#endif

// Weight rows n0..n0+R-1 for all T tokens, written (with bias) into output rows n_out..n_out+R-1 of
// out [T, N].
template <int R, bool Nibbles = false, typename W, typename X, typename Out>
void row_block(const W& w, int64_t n0, int64_t n_out, const X* x, int64_t tokens, const Out* bias, Out* out,
               int64_t n_dim) {
  float sums[kMaxTokens * R];
  for (int64_t t0 = 0; t0 < tokens; t0 += kMaxTokens) {
    const int64_t tt = std::min<int64_t>(kMaxTokens, tokens - t0);
    const X* xt = x + t0 * w.k_dim;
#ifdef LLMC_INT4_NIBBLE_ORDER
    if constexpr (Nibbles) {
      switch (tt) {
        case 4: tile_nibbles<R, 4>(w, n0, xt, sums); break;
        case 3: tile_nibbles<R, 3>(w, n0, xt, sums); break;
        case 2: tile_nibbles<R, 2>(w, n0, xt, sums); break;
        default: tile_nibbles<R, 1>(w, n0, xt, sums); break;
      }
    } else
#endif
    switch (tt) {
      case 4: tile<R, 4>(w, n0, xt, sums); break;
      case 3: tile<R, 3>(w, n0, xt, sums); break;
      case 2: tile<R, 2>(w, n0, xt, sums); break;
      default: tile<R, 1>(w, n0, xt, sums); break;
    }
    for (int64_t t = 0; t < tt; ++t)
      for (int r = 0; r < R; ++r) {
        const float b = bias ? static_cast<float>(bias[n_out + r]) : 0.f;
        out[(t0 + t) * n_dim + n_out + r] = static_cast<Out>(sums[t * R + r] + b);
      }
  }
}

// Quantized rows for more tokens than one pass takes: dequantize the R rows once into `rows`
// (R x K fp32, in L1/L2), then run the float kernel over them for every token.
template <int R, typename W, typename X, typename Out>
void dequantized_row_block(const W& w, int64_t n0, const X* x, int64_t tokens, const Out* bias, Out* out,
                           int64_t n_dim, float* rows) {
  const int64_t k_dim = w.k_dim;
  for (int r = 0; r < R; ++r) {
    const char* row = w.row(n0 + r);
    Vec16 s16, m16;
    for (int64_t g = 0, g0 = 0; g0 < k_dim; ++g, g0 += w.group) {
      if (g % 16 == 0) w.params16(n0 + r, g, s16, m16);
      const Vec16 s = lane(s16, g % 16), m = lane(m16, g % 16);
      for (int64_t k = g0; k < g0 + w.group; k += W::kStep) {
        Vec16 v[W::kStep / 16];
        w.load(row, k, s, m, v);
        for (int i = 0; i < W::kStep / 16; ++i) llmc_cpu::store16(rows + r * k_dim + k + 16 * i, v[i]);
      }
    }
  }
  row_block<R>(FloatRows<float>{rows, k_dim, k_dim}, 0, n0, x, tokens, bias, out, n_dim);
}

template <int R, typename W, typename X, typename Out>
void gemv_rows_of(const W& w, int64_t n_dim, const at::Tensor& x, const at::Tensor& bias, at::Tensor& out) {
  const int64_t tokens = x.size(0);
  const X* xf = x.const_data_ptr<X>();
  const Out* b = bias.defined() ? bias.const_data_ptr<Out>() : nullptr;
  Out* o = out.data_ptr<Out>();
  const int64_t blocks = (n_dim + R - 1) / R;
  const bool dequantize_once = !W::kFloat && tokens > kMaxTokens;
  const X* xp = xf;                   // x in the order the rows' kernel reads it
#ifdef LLMC_INT4_NIBBLE_ORDER
  at::Tensor nibble_x;
  if constexpr (std::is_same_v<W, Int4Rows> && std::is_same_v<X, float>) {
    if (!dequantize_once) {
      nibble_x = at::empty_like(x);
      nibble_order(xf, tokens, w.k_dim, nibble_x.data_ptr<float>());
      xp = nibble_x.const_data_ptr<float>();
    }
  }
#endif
  at::parallel_for(0, blocks, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> rows(dequantize_once ? R * w.k_dim : 0);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t n0 = i * R;
      if (n0 + R > n_dim) {
        for (int64_t n = n0; n < n_dim; ++n) row_block<1>(w, n, n, xf, tokens, b, o, n_dim);
        continue;
      }
      if constexpr (!W::kFloat) {
        if (dequantize_once) {
          dequantized_row_block<R>(w, n0, xf, tokens, b, o, n_dim, rows.data());
          continue;
        }
      }
#ifdef LLMC_INT4_NIBBLE_ORDER
      if constexpr (std::is_same_v<W, Int4Rows> && std::is_same_v<X, float>) {
        row_block<R, true>(w, n0, n0, xp, tokens, b, o, n_dim);
        continue;
      }
#endif
      row_block<R>(w, n0, n0, xf, tokens, b, o, n_dim);
    }
  });
}

// One token: W::kRows rows per pass (more row streams in flight). More tokens: 6 rows x 4 tokens,
// whose 24 accumulators and 6 weight vectors fit AVX-512's 32 registers (measured 1.1-1.15x over
// 4 rows for f32 at 16-128 tokens); int4's nibble pass also holds codes, scales and mins: 4 rows.
template <typename W, typename X, typename Out>
void gemv_rows(const W& w, int64_t n_dim, const at::Tensor& x, const at::Tensor& bias, at::Tensor& out) {
  constexpr int kRowsForTokens = std::is_same_v<W, Int4Rows> ? 4 : 6;
  if (x.size(0) == 1 && W::kRows == 8)
    gemv_rows_of<8, W, X, Out>(w, n_dim, x, bias, out);
  else
    gemv_rows_of<kRowsForTokens, W, X, Out>(w, n_dim, x, bias, out);
}

void check_x(const at::Tensor& x, int64_t k_dim, const at::Tensor& bias, int64_t n_dim) {
  TORCH_CHECK(k_dim > 0 && x.dim() == 2 && x.size(1) == k_dim, "x must be [T, ", k_dim, "], not ", x.sizes());
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "x must be f32 or bf16, not ",
              x.scalar_type());
  if (bias.defined())
    TORCH_CHECK(bias.dim() == 1 && bias.size(0) == n_dim && bias.is_contiguous() &&
                    bias.scalar_type() == x.scalar_type(),
                "bias must be a contiguous [", n_dim, "] tensor of x's dtype");
}

// Runs `w` over x widened to fp32; the output in x's dtype.
template <typename W>
at::Tensor launch(const W& w, int64_t n_dim, const at::Tensor& x, const at::Tensor& bias) {
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  at::Tensor out = at::empty({x.size(0), n_dim}, x.options());
  if (x.scalar_type() == at::kFloat)
    gemv_rows<W, float, float>(w, n_dim, xf, bias, out);
  else
    gemv_rows<W, float, c10::BFloat16>(w, n_dim, xf, bias, out);
  return out;
}

// bf16 weights times bf16 x: with AVX512-BF16, products of bf16 pairs into fp32 lanes, x as it is.
at::Tensor launch_bf16(const at::Tensor& weight, const at::Tensor& x, const at::Tensor& bias) {
  const int64_t n_dim = weight.size(0), k_dim = weight.size(1);
#ifdef __AVX512BF16__
  const at::Tensor xc = x.contiguous();
  at::Tensor out = at::empty({x.size(0), n_dim}, x.options());
  gemv_rows<DotBf16Rows, c10::BFloat16, c10::BFloat16>(
      DotBf16Rows{weight.const_data_ptr<c10::BFloat16>(), k_dim, k_dim}, n_dim, xc, bias, out);
  return out;
#else
  return launch(FloatRows<c10::BFloat16>{weight.const_data_ptr<c10::BFloat16>(), k_dim, k_dim}, n_dim, x, bias);
#endif
}

at::Tensor gemv(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias_opt) {
  const at::Tensor bias = bias_opt.value_or(at::Tensor());
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous(), "weight must be a contiguous [N, K] tensor");
  const int64_t n_dim = weight.size(0), k_dim = weight.size(1);
  check_x(x, k_dim, bias, n_dim);
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "weight ", weight.scalar_type(), " is not x's dtype ",
              x.scalar_type());
  if (weight.scalar_type() == at::kFloat)
    return launch(FloatRows<float>{weight.const_data_ptr<float>(), k_dim, k_dim}, n_dim, x, bias);
  return launch_bf16(weight, x, bias);
}

void check_groups(const at::Tensor& t, int64_t n_dim, int64_t groups, const char* what) {
  TORCH_CHECK(t.scalar_type() == at::kHalf && t.is_contiguous() && t.dim() == 2 && t.size(0) == n_dim &&
                  t.size(1) == groups,
              what, " must be contiguous f16 [", n_dim, ", ", groups, "], not ", t.scalar_type(), " ", t.sizes());
}

at::Tensor qgemv(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                 const std::optional<at::Tensor>& mins_opt, const std::optional<at::Tensor>& bias_opt, int64_t bits,
                 int64_t group) {
  const at::Tensor bias = bias_opt.value_or(at::Tensor());
  TORCH_CHECK(bits == 8 || bits == 4, "bits must be 8 or 4, not ", bits);
  TORCH_CHECK(codes.dim() == 2 && codes.is_contiguous() &&
                  codes.scalar_type() == (bits == 8 ? at::kChar : at::kByte),
              "codes must be contiguous ", bits == 8 ? "int8 [N, K]" : "uint8 [N, K/2]");
  const int64_t n_dim = codes.size(0), k_dim = codes.size(1) * (bits == 8 ? 1 : 2);
  TORCH_CHECK(group > 0 && k_dim % group == 0 && group % (bits == 8 ? 16 : 32) == 0, "group size ", group,
              " must divide K=", k_dim, " and be a multiple of ", bits == 8 ? 16 : 32);
  check_x(x, k_dim, bias, n_dim);
  check_groups(scales, n_dim, k_dim / group, "scales");
  if (bits == 8)
    return launch(Int8Rows{codes.const_data_ptr<int8_t>(), scales.const_data_ptr<c10::Half>(), k_dim, group,
                           k_dim / group},
                  n_dim, x, bias);
  TORCH_CHECK(mins_opt.has_value(), "int4 weights need mins");
  check_groups(*mins_opt, n_dim, k_dim / group, "mins");
  return launch(Int4Rows{codes.const_data_ptr<uint8_t>(), scales.const_data_ptr<c10::Half>(),
                         mins_opt->const_data_ptr<c10::Half>(), k_dim, group, k_dim / group},
                n_dim, x, bias);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llmc, m) {
  m.def("gemv(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.def("qgemv(Tensor x, Tensor codes, Tensor scales, Tensor? mins, Tensor? bias, int bits, int group_size) -> Tensor");
}

TORCH_LIBRARY_IMPL(llmc, CPU, m) {
  m.impl("gemv", &gemv);
  m.impl("qgemv", &qgemv);
}
