// Rotary embedding of Q and K fused with writing K and V into the paged KV cache, on the CPU.
//
// Contract (the meaning of kernels/rope_kv_write.py's rope_kv_write_ref):
//   q [T, H*D], k and v [T, KVH*D]  f32 or bf16, rows contiguous (any row stride: the q/k/v
//                                   column ranges of a merged QKV GEMM's output are views)
//   cos, sin      [T, R/2] f32, contiguous: the rotation angles of each token's position; R, the
//                 rotary dim, is D but for a partial rotary (only each head's first R values
//                 turn, the rest are copied), any even R
//   kv_cache      [L, 2, NB, KVH, BS, D] of q's dtype, or int8 [L, 2, NB, KVH, BS, D + 4]
//                 (each row D codes and its fp32 scale, kernels/quant.py), contiguous
//   slot_mapping  [T] int64: block * BS + offset of each token; negative = padding, skipped
//   q_norm, k_norm  optional norm weights of q's dtype, contiguous, used when norm_span is not 0:
//                 1 per head, each [D] (q and k normed head by head), 2 the whole row, [H*D] and
//                 [KVH*D]; norm_eps inside the rsqrt (compiler/ops/rope.py's qk_norm)
//   norm_product  the norms' rounding: false "normed", true "product" (compiler/ops/norms.py)
//   returns the rotated q [T, H*D] (contiguous); rotated k and v are stored at their slots of
//   `layer` in place. q and k are first normed where norm_span says, as rmsnorm_ref (fp32 mean
//   and rsqrt; the normed value rounded to q's dtype, then the weight's product rounded, or with
//   norm_product the fp32 product with the weight rounded once).
//   Rotate-half layout (Hugging Face's): each head's first half turns against its second half.
//   The rotation is computed in fp32 and rounded once: q and a float cache's k to q's dtype; an
//   int8 cache's k is quantized from the fp32 rotation (v from its input values), by
//   quantize_kv_rows's rule. D must be a multiple of 32.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <optional>
#include <type_traits>
#include <utility>
#include <vector>

#include "token_rows.h"

namespace {

using llmc_rows::KvLayout;

struct NormArgs {
  const at::Tensor *q_weight, *k_weight;
  int64_t span;
  double eps;
  bool product;
};

template <typename T, typename C>
void rope_tokens(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cos,
                 const at::Tensor& sin, at::Tensor& cache, const at::Tensor& slots, int64_t layer,
                 at::Tensor& q_out, const KvLayout& s, const NormArgs& n) {
  const int64_t half = s.rotary_dim / 2, d = s.head_dim;
  C* k_cache = cache.data_ptr<C>() + layer * cache.stride(0);
  C* v_cache = k_cache + cache.stride(1);
  llmc_rows::QkNorm<T> norm;
  if (n.span)
    norm = {n.q_weight->const_data_ptr<T>(), n.k_weight->const_data_ptr<T>(), n.span, static_cast<float>(n.eps),
            n.product};
  at::parallel_for(0, q.size(0), 16, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(2 * d);
    for (int64_t t = begin; t < end; ++t)
      llmc_rows::rope_token(q.const_data_ptr<T>() + t * q.stride(0), k.const_data_ptr<T>() + t * k.stride(0),
                            v.const_data_ptr<T>() + t * v.stride(0), cos.const_data_ptr<float>() + t * half,
                            sin.const_data_ptr<float>() + t * half, slots.const_data_ptr<int64_t>()[t], k_cache,
                            v_cache, q_out.data_ptr<T>() + t * s.heads * d, s, norm, scratch.data());
  });
}

void check_norms(const at::Tensor& q, const KvLayout& s, const NormArgs& n) {
  TORCH_CHECK(n.span >= 0 && n.span <= 2, "norm_span ", n.span, " is not 0 (none), 1 (per head) or 2 (whole row)");
  if (n.span == 0) return;
  TORCH_CHECK(n.q_weight && n.k_weight, "norm_span ", n.span, " needs q_norm and k_norm");
  const int64_t q_width = n.span == 1 ? s.head_dim : s.heads * s.head_dim;
  const int64_t k_width = n.span == 1 ? s.head_dim : s.kv_heads * s.head_dim;
  for (const auto& [w, width] : {std::pair{n.q_weight, q_width}, std::pair{n.k_weight, k_width}})
    TORCH_CHECK(w->dim() == 1 && w->size(0) == width && w->is_contiguous() && w->scalar_type() == q.scalar_type(),
                "q_norm and k_norm must be contiguous ", q.scalar_type(), " [", q_width, "] and [", k_width,
                "] for norm_span ", n.span);
}

at::Tensor rope_kv_write(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cos,
                         const at::Tensor& sin, at::Tensor kv_cache, const at::Tensor& slot_mapping, int64_t layer,
                         const std::optional<at::Tensor>& q_norm, const std::optional<at::Tensor>& k_norm,
                         int64_t norm_span, double norm_eps, bool norm_product) {
  TORCH_CHECK(kv_cache.dim() == 6 && kv_cache.is_contiguous(), "kv_cache must be a contiguous [L,2,NB,KVH,BS,D] tensor");
  const bool int8 = kv_cache.scalar_type() == at::kChar;
  const int64_t d = kv_cache.size(5) - (int8 ? llmc_cpu::kScaleBytes : 0);
  TORCH_CHECK(d > 0 && d % 32 == 0, "head_dim ", d, " is not a positive multiple of 32");
  const KvLayout s{q.size(1) / d, kv_cache.size(3), d, kv_cache.size(4), kv_cache.size(2), 2 * cos.size(1)};
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
                  cos.sizes() == sin.sizes() && cos.size(0) == q.size(0) && s.rotary_dim <= s.head_dim &&
                  cos.size(1) > 0,
              "cos and sin must be contiguous f32 [T, R/2], R at most head_dim");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
                  slot_mapping.numel() == q.size(0), "slot_mapping must be contiguous int64 [T]");
  TORCH_CHECK(layer >= 0 && layer < kv_cache.size(0), "layer ", layer, " is outside the cache");
  const int64_t* slots = slot_mapping.const_data_ptr<int64_t>();
  for (int64_t t = 0; t < q.size(0); ++t)
    TORCH_CHECK(slots[t] < s.num_blocks * s.block_size, "slot ", slots[t], " is outside the cache's ",
                s.num_blocks * s.block_size, " slots");
  const NormArgs n{q_norm ? &*q_norm : nullptr, k_norm ? &*k_norm : nullptr, norm_span, norm_eps, norm_product};
  check_norms(q, s, n);
  at::Tensor q_out = at::empty({q.size(0), q.size(1)}, q.options());
  const bool f32 = q.scalar_type() == at::kFloat;
  if (int8 && f32)
    rope_tokens<float, int8_t>(q, k, v, cos, sin, kv_cache, slot_mapping, layer, q_out, s, n);
  else if (int8)
    rope_tokens<c10::BFloat16, int8_t>(q, k, v, cos, sin, kv_cache, slot_mapping, layer, q_out, s, n);
  else if (f32)
    rope_tokens<float, float>(q, k, v, cos, sin, kv_cache, slot_mapping, layer, q_out, s, n);
  else
    rope_tokens<c10::BFloat16, c10::BFloat16>(q, k, v, cos, sin, kv_cache, slot_mapping, layer, q_out, s, n);
  return q_out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llmc, m) {
  m.def("rope_kv_write(Tensor q, Tensor k, Tensor v, Tensor cos, Tensor sin, Tensor(a!) kv_cache, "
        "Tensor slot_mapping, int layer, Tensor? q_norm=None, Tensor? k_norm=None, int norm_span=0, "
        "float norm_eps=0.0, bool norm_product=False) -> Tensor");
}

TORCH_LIBRARY_IMPL(llmc, CPU, m) { m.impl("rope_kv_write", &rope_kv_write); }
