// Rotary embedding of Q and K fused with writing K and V into the paged KV cache, on the CPU.
//
// Contract (the meaning of kernels/rope_kv_write.py's rope_kv_write_ref):
//   q [T, H*D], k and v [T, KVH*D]  f32 or bf16, rows contiguous (any row stride: the q/k/v
//                                   column ranges of a merged QKV GEMM's output are views)
//   cos, sin      [T, D/2] f32, contiguous: the rotation angles of each token's position
//   kv_cache      [L, 2, NB, KVH, BS, D] of q's dtype, contiguous
//   slot_mapping  [T] int64: block * BS + offset of each token; negative = padding, skipped
//   returns the rotated q [T, H*D] (contiguous); rotated k and v are stored at their slots of
//   `layer` in place. Rotate-half layout (Hugging Face's): each head's first half turns against
//   its second half. The rotation is computed in fp32 and rounded once. D must be a multiple of 32.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "vec16.h"

namespace {

using llmc_cpu::load16;
using llmc_cpu::store16;
using llmc_cpu::Vec16;

// Rotates `heads` heads of one token from `src` into `dst`.
template <typename T>
void rotate_heads(const T* src, T* dst, int64_t heads, int64_t d, const float* cos, const float* sin) {
  const int64_t half = d / 2;
  for (int64_t h = 0; h < heads; ++h, src += d, dst += d)
    for (int64_t j = 0; j < half; j += 16) {
      const Vec16 x1 = load16(src + j), x2 = load16(src + half + j), c = load16(cos + j), s = load16(sin + j);
      store16(dst + j, x1 * c - x2 * s);
      store16(dst + half + j, x2 * c + x1 * s);
    }
}

struct Layout {
  int64_t heads, kv_heads, head_dim, block_size, num_blocks;
};

template <typename T>
void rope_tokens(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cos,
                 const at::Tensor& sin, at::Tensor& cache, const at::Tensor& slots, int64_t layer,
                 at::Tensor& q_out, const Layout& s) {
  const int64_t d = s.head_dim, half = d / 2, block_elems = s.kv_heads * s.block_size * d;
  T* k_cache = cache.data_ptr<T>() + layer * cache.stride(0);
  T* v_cache = k_cache + cache.stride(1);
  at::parallel_for(0, q.size(0), 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cos.const_data_ptr<float>() + t * half;
      const float* sn = sin.const_data_ptr<float>() + t * half;
      rotate_heads(q.const_data_ptr<T>() + t * q.stride(0), q_out.data_ptr<T>() + t * s.heads * d, s.heads, d, c, sn);
      const int64_t slot = slots.const_data_ptr<int64_t>()[t];
      if (slot < 0) continue;
      const int64_t block = slot / s.block_size, offset = slot % s.block_size;
      for (int64_t h = 0; h < s.kv_heads; ++h) {
        const int64_t at = block * block_elems + (h * s.block_size + offset) * d;
        rotate_heads(k.const_data_ptr<T>() + t * k.stride(0) + h * d, k_cache + at, 1, d, c, sn);
        const T* vs = v.const_data_ptr<T>() + t * v.stride(0) + h * d;
        for (int64_t j = 0; j < d; ++j) v_cache[at + j] = vs[j];
      }
    }
  });
}

at::Tensor rope_kv_write(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cos,
                         const at::Tensor& sin, at::Tensor kv_cache, const at::Tensor& slot_mapping, int64_t layer) {
  TORCH_CHECK(kv_cache.dim() == 6 && kv_cache.is_contiguous(), "kv_cache must be a contiguous [L,2,NB,KVH,BS,D] tensor");
  const Layout s{q.size(1) / kv_cache.size(5), kv_cache.size(3), kv_cache.size(5), kv_cache.size(4), kv_cache.size(2)};
  for (const at::Tensor* x : {&q, &k, &v})
    TORCH_CHECK(x->dim() == 2 && x->stride(1) == 1 && x->size(0) == q.size(0) && x->scalar_type() == kv_cache.scalar_type(),
                "q, k and v must be [T, width] rows of the cache's dtype");
  TORCH_CHECK(kv_cache.scalar_type() == at::kFloat || kv_cache.scalar_type() == at::kBFloat16,
              "the cache must be f32 or bf16, not ", kv_cache.scalar_type());
  TORCH_CHECK(s.head_dim % 32 == 0, "head_dim ", s.head_dim, " is not a multiple of 32");
  TORCH_CHECK(k.size(1) == s.kv_heads * s.head_dim && v.size(1) == k.size(1) && q.size(1) % s.head_dim == 0,
              "q, k, v widths do not match the cache's heads");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && cos.is_contiguous() && sin.is_contiguous() &&
                  cos.sizes() == sin.sizes() && cos.size(0) == q.size(0) && cos.size(1) == s.head_dim / 2,
              "cos and sin must be contiguous f32 [T, head_dim/2]");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
                  slot_mapping.numel() == q.size(0), "slot_mapping must be contiguous int64 [T]");
  TORCH_CHECK(layer >= 0 && layer < kv_cache.size(0), "layer ", layer, " is outside the cache");
  const int64_t* slots = slot_mapping.const_data_ptr<int64_t>();
  for (int64_t t = 0; t < q.size(0); ++t)
    TORCH_CHECK(slots[t] < s.num_blocks * s.block_size, "slot ", slots[t], " is outside the cache's ",
                s.num_blocks * s.block_size, " slots");
  at::Tensor q_out = at::empty({q.size(0), q.size(1)}, q.options());
  if (q.scalar_type() == at::kFloat)
    rope_tokens<float>(q, k, v, cos, sin, kv_cache, slot_mapping, layer, q_out, s);
  else
    rope_tokens<c10::BFloat16>(q, k, v, cos, sin, kv_cache, slot_mapping, layer, q_out, s);
  return q_out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llmc, m) {
  m.def("rope_kv_write(Tensor q, Tensor k, Tensor v, Tensor cos, Tensor sin, Tensor(a!) kv_cache, "
        "Tensor slot_mapping, int layer) -> Tensor");
}

TORCH_LIBRARY_IMPL(llmc, CPU, m) { m.impl("rope_kv_write", &rope_kv_write); }
