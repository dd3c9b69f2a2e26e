// The per-token work of RoPE + KV write, one token's row at a time on the calling thread:
// rope_kv_write.cpp (which holds the contract) splits the tokens among the intra-op threads, a
// step plan (step_plan.cpp) among its team. (The elementwise and row-wise ops are generated C++:
// compiler/codegen/cpp.py.)
//
//   rope_token    q and k of a token rotated (rotate-half), k and v stored at its cache slot
#pragma once

#include <cstdint>
#include <type_traits>

#include "kv_rows.h"
#include "vec16.h"

namespace llmc_rows {

using llmc_cpu::load16;
using llmc_cpu::store16;
using llmc_cpu::Vec16;

// Rotates `heads` heads of one token from `src` into `dst` (T or float).
template <typename T, typename O>
void rotate_heads(const T* src, O* dst, int64_t heads, int64_t d, const float* cos, const float* sin) {
  const int64_t half = d / 2;
  for (int64_t h = 0; h < heads; ++h, src += d, dst += d)
    for (int64_t j = 0; j < half; j += 16) {
      const Vec16 x1 = load16(src + j), x2 = load16(src + half + j), c = load16(cos + j), s = load16(sin + j);
      store16(dst + j, x1 * c - x2 * s);
      store16(dst + half + j, x2 * c + x1 * s);
    }
}

struct KvLayout {
  int64_t heads, kv_heads, head_dim, block_size, num_blocks;
};

// Writes one token's K and V rows of every KV head at `at` (the head-0 row of its slot).
template <typename T, typename C>
void write_kv(const T* k, const T* v, C* k_cache, C* v_cache, int64_t at, const KvLayout& s, const float* cos,
              const float* sin, float* row) {
  const int64_t d = s.head_dim, head_stride = s.block_size * llmc_cpu::row_elems<C>(d);
  for (int64_t h = 0; h < s.kv_heads; ++h, at += head_stride) {
    if constexpr (std::is_same_v<C, int8_t>) {
      rotate_heads(k + h * d, row, 1, d, cos, sin);  // quantized from the fp32 rotation
      llmc_cpu::store_row(row, d, k_cache + at);
      llmc_cpu::widen_row(v + h * d, d, row);
      llmc_cpu::store_row(row, d, v_cache + at);
    } else {
      rotate_heads(k + h * d, k_cache + at, 1, d, cos, sin);
      for (int64_t j = 0; j < d; ++j) v_cache[at + j] = v[h * d + j];
    }
  }
}

// One token: q rotated into q_out; k rotated and v stored at `slot` of the layer's K and V caches
// (a negative slot, padding, stores nothing). cos and sin are the token's [D/2] angles; `row` is
// D floats of scratch.
template <typename T, typename C>
void rope_token(const T* q, const T* k, const T* v, const float* cos, const float* sin, int64_t slot, C* k_cache,
                C* v_cache, T* q_out, const KvLayout& s, float* row) {
  rotate_heads(q, q_out, s.heads, s.head_dim, cos, sin);
  if (slot < 0) return;
  const int64_t block = slot / s.block_size, offset = slot % s.block_size;
  write_kv(k, v, k_cache, v_cache, (block * s.kv_heads * s.block_size + offset) * llmc_cpu::row_elems<C>(s.head_dim),
           s, cos, sin, row);
}

}  // namespace llmc_rows
