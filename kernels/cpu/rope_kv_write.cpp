// Rotary embedding of Q and K fused with writing K and V into the paged KV cache, on the CPU.
//
// Contract (the meaning of kernels/rope_kv_write.py's rope_kv_write_ref):
//   q [T, H*D], k and v [T, KVH*D]  f32 or bf16, rows contiguous (any row stride: the q/k/v
//                                   column ranges of a merged QKV GEMM's output are views)
//   cos, sin      [T, D/2] f32, contiguous: the rotation angles of each token's position
//   kv_cache      [L, 2, NB, KVH, BS, D] of q's dtype, or int8 [L, 2, NB, KVH, BS, D + 4]
//                 (each row D codes and its fp32 scale, kernels/quant.py), contiguous
//   slot_mapping  [T] int64: block * BS + offset of each token; negative = padding, skipped
//   returns the rotated q [T, H*D] (contiguous); rotated k and v are stored at their slots of
//   `layer` in place. Rotate-half layout (Hugging Face's): each head's first half turns against
//   its second half. The rotation is computed in fp32 and rounded once: q and a float cache's k
//   to q's dtype; an int8 cache's k is quantized from the fp32 rotation (v from its input
//   values), by quantize_kv_rows's rule. D must be a multiple of 32.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <type_traits>
#include <vector>

#include "token_rows.h"

namespace {

using llmc_rows::KvLayout;

template <typename T, typename C>
void rope_tokens(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cos,
                 const at::Tensor& sin, at::Tensor& cache, const at::Tensor& slots, int64_t layer,
                 at::Tensor& q_out, const KvLayout& s) {
  const int64_t d = s.head_dim, half = d / 2;
  C* k_cache = cache.data_ptr<C>() + layer * cache.stride(0);
  C* v_cache = k_cache + cache.stride(1);
  at::parallel_for(0, q.size(0), 16, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(d);
    for (int64_t t = begin; t < end; ++t)
      llmc_rows::rope_token(q.const_data_ptr<T>() + t * q.stride(0), k.const_data_ptr<T>() + t * k.stride(0),
                            v.const_data_ptr<T>() + t * v.stride(0), cos.const_data_ptr<float>() + t * half,
                            sin.const_data_ptr<float>() + t * half, slots.const_data_ptr<int64_t>()[t], k_cache,
                            v_cache, q_out.data_ptr<T>() + t * s.heads * d, s, scratch.data());
  });
}

at::Tensor rope_kv_write(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cos,
                         const at::Tensor& sin, at::Tensor kv_cache, const at::Tensor& slot_mapping, int64_t layer) {
  TORCH_CHECK(kv_cache.dim() == 6 && kv_cache.is_contiguous(), "kv_cache must be a contiguous [L,2,NB,KVH,BS,D] tensor");
  const bool int8 = kv_cache.scalar_type() == at::kChar;
  const int64_t d = kv_cache.size(5) - (int8 ? llmc_cpu::kScaleBytes : 0);
  TORCH_CHECK(d > 0 && d % 32 == 0, "head_dim ", d, " is not a positive multiple of 32");
  const KvLayout s{q.size(1) / d, kv_cache.size(3), d, kv_cache.size(4), kv_cache.size(2)};
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16, "q must be f32 or bf16, not ",
              q.scalar_type());
  TORCH_CHECK(int8 || kv_cache.scalar_type() == q.scalar_type(), "the cache must be int8 or q's dtype ",
              q.scalar_type(), ", not ", kv_cache.scalar_type());
  for (const at::Tensor* x : {&q, &k, &v})
    TORCH_CHECK(x->dim() == 2 && x->stride(1) == 1 && x->size(0) == q.size(0) && x->scalar_type() == q.scalar_type(),
                "q, k and v must be [T, width] rows of one dtype");
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
  const bool f32 = q.scalar_type() == at::kFloat;
  if (int8 && f32)
    rope_tokens<float, int8_t>(q, k, v, cos, sin, kv_cache, slot_mapping, layer, q_out, s);
  else if (int8)
    rope_tokens<c10::BFloat16, int8_t>(q, k, v, cos, sin, kv_cache, slot_mapping, layer, q_out, s);
  else if (f32)
    rope_tokens<float, float>(q, k, v, cos, sin, kv_cache, slot_mapping, layer, q_out, s);
  else
    rope_tokens<c10::BFloat16, c10::BFloat16>(q, k, v, cos, sin, kv_cache, slot_mapping, layer, q_out, s);
  return q_out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llmc, m) {
  m.def("rope_kv_write(Tensor q, Tensor k, Tensor v, Tensor cos, Tensor sin, Tensor(a!) kv_cache, "
        "Tensor slot_mapping, int layer) -> Tensor");
}

TORCH_LIBRARY_IMPL(llmc, CPU, m) { m.impl("rope_kv_write", &rope_kv_write); }
