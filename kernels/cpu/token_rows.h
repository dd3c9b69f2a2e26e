// The per-token work of RoPE + KV write, one token's row at a time on the calling thread:
// rope_kv_write.cpp (which holds the contract) splits the tokens among the intra-op threads, a
// step plan (step_plan.cpp) among its team. (The elementwise and row-wise ops are generated C++:
// compiler/codegen/cpp.py.)
//
//   rope_token    q and k of a token normed (QkNorm, optional) and rotated (rotate-half), k and v
//                 stored at its cache slot
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "kv_rows.h"
#include "vec16.h"

namespace llmc_rows {

using llmc_cpu::load16;
using llmc_cpu::store16;
using llmc_cpu::Vec16;

// Rotates `heads` heads of one token from `src` into `dst` (T or float): each head's first r
// values turn (rotate-half over them; r = d but for a partial rotary), the rest are copied.
template <typename T, typename O>
void rotate_heads(const T* src, O* dst, int64_t heads, int64_t d, int64_t r, const float* cos, const float* sin) {
  const int64_t half = r / 2, vectors = half / 16 * 16;
  for (int64_t h = 0; h < heads; ++h, src += d, dst += d) {
    for (int64_t j = 0; j < vectors; j += 16) {
      const Vec16 x1 = load16(src + j), x2 = load16(src + half + j), c = load16(cos + j), s = load16(sin + j);
      store16(dst + j, x1 * c - x2 * s);
      store16(dst + half + j, x2 * c + x1 * s);
    }
    for (int64_t j = vectors; j < half; ++j) {   // a partial rotary's last angles (fewer than 16)
      const float x1 = static_cast<float>(src[j]), x2 = static_cast<float>(src[half + j]);
      dst[j] = static_cast<O>(x1 * cos[j] - x2 * sin[j]);
      dst[half + j] = static_cast<O>(x2 * cos[j] + x1 * sin[j]);
    }
    for (int64_t j = r; j < d; ++j) dst[j] = static_cast<O>(static_cast<float>(src[j]));
  }
}

// rotary_dim: the values of a head that turn (cos and sin hold rotary_dim / 2 angles a token).
struct KvLayout {
  int64_t heads, kv_heads, head_dim, block_size, num_blocks, rotary_dim;
};

// rope_kv_write's q/k norms before the rotation (compiler/ops/rope.py, qk_norm): span 0 none,
// 1 each head over its D values with one weight [D] (head_rmsnorm), 2 the token's whole row with
// a weight of its width (rmsnorm). As rmsnorm_ref: mean of squares and rsqrt in fp32, then
// (product false, "normed") the normed value rounded to T, times the weight rounded to T, or
// (product true, "product": Gemma, OLMo-2) the fp32 product with the weight rounded once.
template <typename T>
struct QkNorm {
  const T* q_weight = nullptr;
  const T* k_weight = nullptr;
  int64_t span = 0;
  float eps = 0.f;
  bool product = false;
};

// 1 / sqrt(mean(x^2) + eps) of n values (a multiple of 16), fp32.
template <typename T>
float inv_rms(const T* x, int64_t n, float eps) {
  Vec16 acc{};
  for (int64_t j = 0; j < n; j += 16) {
    const Vec16 v = load16(x + j);
    acc += v * v;
  }
  return 1.f / std::sqrt(llmc_cpu::hsum(acc) / static_cast<float>(n) + eps);
}

// One head normed: out[j] = T(T(head[j] * scale) * weight[j]), or with `product`
// T(head[j] * scale * weight[j]), as floats.
template <typename T>
void norm_head(const T* head, const T* weight, float scale, int64_t d, bool product, float* out) {
  for (int64_t j = 0; j < d; ++j) {
    const float scaled = static_cast<float>(head[j]) * scale;
    const float n = product ? scaled : static_cast<float>(static_cast<T>(scaled));
    out[j] = static_cast<float>(static_cast<T>(n * static_cast<float>(weight[j])));
  }
}

// Rotates `heads` heads of one token from `src` into `dst`, each normed first as `norm` says
// (`weight`: its q or k weight; scratch: D floats).
template <typename T, typename O>
void norm_rotate_heads(const T* src, O* dst, int64_t heads, int64_t d, int64_t r, const float* cos, const float* sin,
                       const T* weight, const QkNorm<T>& norm, float* scratch) {
  const int64_t span = norm.span;
  if (span == 0) return rotate_heads(src, dst, heads, d, r, cos, sin);
  const float row_scale = span == 2 ? inv_rms(src, heads * d, norm.eps) : 0.f;
  for (int64_t h = 0; h < heads; ++h) {
    const float scale = span == 2 ? row_scale : inv_rms(src + h * d, d, norm.eps);
    norm_head(src + h * d, weight + (span == 2 ? h * d : 0), scale, d, norm.product, scratch);
    rotate_heads(static_cast<const float*>(scratch), dst + h * d, 1, d, r, cos, sin);
  }
}

// Writes one token's K and V rows of every KV head at `at` (the head-0 row of its slot), k normed
// first as `norm` says. `row` is 2 * D floats of scratch.
template <typename T, typename C>
void write_kv(const T* k, const T* v, C* k_cache, C* v_cache, int64_t at, const KvLayout& s, const float* cos,
              const float* sin, const QkNorm<T>& norm, float* row) {
  const int64_t d = s.head_dim, head_stride = s.block_size * llmc_cpu::row_elems<C>(d);
  const float row_scale = norm.span == 2 ? inv_rms(k, s.kv_heads * d, norm.eps) : 0.f;
  float* normed = row + d;
  for (int64_t h = 0; h < s.kv_heads; ++h, at += head_stride) {
    if (norm.span)
      norm_head(k + h * d, norm.k_weight + (norm.span == 2 ? h * d : 0),
                norm.span == 2 ? row_scale : inv_rms(k + h * d, d, norm.eps), d, norm.product, normed);
    const auto rotate_k = [&](auto* dst) {
      if (norm.span)
        rotate_heads(static_cast<const float*>(normed), dst, 1, d, s.rotary_dim, cos, sin);
      else
        rotate_heads(k + h * d, dst, 1, d, s.rotary_dim, cos, sin);
    };
    if constexpr (std::is_same_v<C, int8_t>) {
      rotate_k(row);  // quantized from the fp32 rotation
      llmc_cpu::store_row(row, d, k_cache + at);
      llmc_cpu::widen_row(v + h * d, d, row);
      llmc_cpu::store_row(row, d, v_cache + at);
    } else {
      rotate_k(k_cache + at);
      for (int64_t j = 0; j < d; ++j) v_cache[at + j] = v[h * d + j];
    }
  }
}

// One token: q normed (as `norm` says) and rotated into q_out; k normed and rotated and v stored
// at `slot` of the layer's K and V caches (a negative slot, padding, stores nothing). cos and sin
// are the token's [D/2] angles; `row` is 2 * D floats of scratch.
template <typename T, typename C>
void rope_token(const T* q, const T* k, const T* v, const float* cos, const float* sin, int64_t slot, C* k_cache,
                C* v_cache, T* q_out, const KvLayout& s, const QkNorm<T>& norm, float* row) {
  norm_rotate_heads(q, q_out, s.heads, s.head_dim, s.rotary_dim, cos, sin, norm.q_weight, norm, row);
  if (slot < 0) return;
  const int64_t block = slot / s.block_size, offset = slot % s.block_size;
  write_kv(k, v, k_cache, v_cache, (block * s.kv_heads * s.block_size + offset) * llmc_cpu::row_elems<C>(s.head_dim),
           s, cos, sin, norm, row);
}

}  // namespace llmc_rows
