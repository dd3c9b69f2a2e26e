// Paged causal attention on the CPU: every query row reads its keys and values straight from
// the paged KV cache with an online softmax (no gathered copy of the context, no score matrix
// beyond one tile in memory).
//
// Contract (the meaning of kernels/attention.py's paged_attention_ref):
//   q               [T, H*D]  f32 or bf16, contiguous; tokens of all sequences flattened
//   kv_cache        [L, 2, NB, KVH, 16, D]  q's dtype, contiguous (block size 16), or int8
//                   [L, 2, NB, KVH, 16, D + 4]: each row D codes and its fp32 scale
//                   (kernels/quant.py), dequantized as code * scale in fp32 as it is read
//   block_tables    [S, MB]  int32: the blocks of each sequence, in order
//   seq_lens        [S]      int32: tokens of each sequence in the cache after this step
//   query_start_loc [S+1]    int32: sequence s owns query rows qsl[s] .. qsl[s+1]-1, its newest
//                            tokens, so query i of a chunk of n sits at position seq_len - n + i
//   layer, scale    the cache layer to read; the factor applied to q.k
//   window          0, or > 0: a query at position p sees only keys p - window < j <= p (the
//                   blocks wholly before that are not read)
//   softcap         0, or > 0: scaled scores become softcap * tanh(score / softcap) before the
//                   mask and the softmax
//   returns         [T, H*D] in q's dtype; a query sees keys at positions <= its own.
// D must be a multiple of 16 (any size: 256 included) and H a multiple of KVH. Scores, softmax
// and the weighted sum are computed in fp32.
//
// Work items are (sequence, KV head, up to kQueries queries of its chunk), except that a decode
// (one query) is one item over all KV heads where there are kDecodesPerThread decodes per
// thread, or where every decode of a decode step is long enough to be cut into parts for the
// threads (plan_items); a step of fewer decode items than that has each decode's keys cut into
// parts, items of their own whose results the last to finish merges (split_decodes,
// decode_splits.h: one sequence on 2 threads is 2 even items, not 1, or 3 per-head ones). Decodes run
// attention_decode.h's run_decode (K/V read in
// place, a block's 16 scores reduced at once, 64 keys per softmax step, each run of blocks read
// ahead of its arithmetic; tools/bench_attention.py --decode: 2-2.9x run_rows, 55-70% of the
// read bandwidth for f32 and bf16 caches on a 2-core Zen 5). A longer chunk runs in tiles of
// queries x keys as small GEMMs (run_tiles; from 2 queries on faster than run_rows, 3.5-5x
// from 8). Items differ in cost (causal: later queries see more keys), so the threads take them
// one at a time, largest first. `paged_attention_rows` runs every item per KV head, block by
// block (attention_items.h's run_rows: a block widened into scratch, a horizontal sum per key):
// the one-query-at-a-time kernel, kept as the benchmarks' baseline.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "attention_decode.h"
#include "attention_items.h"
#include "attention_work.h"

namespace {

using llmc_cpu::Geometry;
using llmc_cpu::Item;
using llmc_cpu::kBlock;

// Runs fn(item, scratch) for every item on the intra-op threads, each taking the next item
// left, in order of decreasing cost.
template <typename T, typename C, typename Fn>
void run_items(const std::vector<Item>& items, const llmc_cpu::Inputs<T, C>& in, Fn fn) {
  const std::vector<int64_t> order = llmc_cpu::by_cost(items, in.lens, in.qsl);
  std::atomic<int64_t> next{0};
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), static_cast<int64_t>(items.size()));
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    llmc_cpu::Scratch scratch;
    for (int64_t i = next++; i < static_cast<int64_t>(items.size()); i = next++) fn(items[order[i]], scratch);
  });
}

int64_t head_dim(const at::Tensor& cache) {
  return cache.size(5) - (cache.scalar_type() == at::kChar ? llmc_cpu::kScaleBytes : 0);
}

void check_inputs(const at::Tensor& q, const at::Tensor& cache, const at::Tensor& tables,
                  const at::Tensor& lens, const at::Tensor& qsl, int64_t layer, int64_t window, double softcap) {
  TORCH_CHECK(q.dim() == 2 && q.is_contiguous(), "q must be a contiguous [T, H*D] tensor");
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16, "q must be f32 or bf16, not ",
              q.scalar_type());
  TORCH_CHECK(cache.dim() == 6 && cache.is_contiguous(), "kv_cache must be a contiguous [L,2,NB,KVH,BS,D] tensor");
  TORCH_CHECK(cache.scalar_type() == q.scalar_type() || cache.scalar_type() == at::kChar, "kv_cache dtype ",
              cache.scalar_type(), " is neither int8 nor q's dtype ", q.scalar_type());
  TORCH_CHECK(cache.size(4) == kBlock, "block size ", cache.size(4), " is not ", kBlock);
  TORCH_CHECK(head_dim(cache) > 0 && head_dim(cache) % 16 == 0, "head_dim ", head_dim(cache),
              " is not a positive multiple of 16");
  TORCH_CHECK(layer >= 0 && layer < cache.size(0), "layer ", layer, " is outside the cache's ", cache.size(0),
              " layers");
  TORCH_CHECK(window >= 0 && window <= INT32_MAX, "window ", window, " is not 0 (off) or a positive int32");
  TORCH_CHECK(softcap >= 0 && std::isfinite(softcap), "softcap ", softcap, " is not 0 (off) or a positive number");
  for (const at::Tensor* t : {&tables, &lens, &qsl})
    TORCH_CHECK(t->scalar_type() == at::kInt && t->is_contiguous(), "block tables and lengths must be contiguous int32");
  TORCH_CHECK(qsl.numel() == lens.numel() + 1 && tables.size(0) == lens.numel(),
              "query_start_loc needs S+1 entries and block_tables S rows");
  TORCH_CHECK(q.size(1) % (cache.size(3) * head_dim(cache)) == 0, "q width ", q.size(1),
              " is not a multiple of kv_heads * head_dim");
}

// Calls fn with null pointers of q's element type (float, bf16) and the cache's (q's or int8).
template <typename Fn>
void with_types(const at::Tensor& q, const at::Tensor& kv_cache, Fn fn) {
  const bool int8 = kv_cache.scalar_type() == at::kChar;
  if (q.scalar_type() == at::kFloat && int8)
    fn(static_cast<float*>(nullptr), static_cast<int8_t*>(nullptr));
  else if (q.scalar_type() == at::kFloat)
    fn(static_cast<float*>(nullptr), static_cast<float*>(nullptr));
  else if (int8)
    fn(static_cast<c10::BFloat16*>(nullptr), static_cast<int8_t*>(nullptr));
  else
    fn(static_cast<c10::BFloat16*>(nullptr), static_cast<c10::BFloat16*>(nullptr));
}

at::Tensor attend(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& block_tables,
                  const at::Tensor& seq_lens, const at::Tensor& query_start_loc, int64_t layer, double scale,
                  int64_t window, double softcap, bool tiled) {
  check_inputs(q, kv_cache, block_tables, seq_lens, query_start_loc, layer, window, softcap);
  const int64_t kv_heads = kv_cache.size(3), d = head_dim(kv_cache);
  at::Tensor out = at::empty_like(q);
  const int32_t* qsl = query_start_loc.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int64_t width = block_tables.size(1);
  llmc_cpu::check_layout(qsl, lens, tables, seq_lens.numel(), width, q.size(0), kv_cache.size(2));
  const std::vector<Item> items =
      llmc_cpu::plan_items(qsl, lens, seq_lens.numel(), kv_heads, tiled, at::get_num_threads());
  llmc_cpu::DecodeSplits splits;
  splits.reserve(items, q.size(1) / d, d);
  const auto run = [&](auto* typed, auto* cache_typed) {
    using T = std::remove_pointer_t<decltype(typed)>;
    using C = std::remove_pointer_t<decltype(cache_typed)>;
    const C* k_cache = kv_cache.const_data_ptr<C>() + layer * kv_cache.stride(0);
    const Geometry g{q.size(1) / d, kv_heads, d, q.size(1) / (kv_heads * d)};
    const llmc_cpu::Inputs<T, C> in{q.const_data_ptr<T>(), out.data_ptr<T>(), k_cache, k_cache + kv_cache.stride(1),
                                    tables, width, lens, qsl, g, static_cast<float>(scale), window,
                                    static_cast<float>(softcap), &splits};
    run_items(items, in, [&](const Item& it, llmc_cpu::Scratch& w) {
      if (!tiled)
        llmc_cpu::run_rows(in, it, w);
      else if (it.num_queries == 1)
        llmc_cpu::run_decode(in, it, w);
      else
        llmc_cpu::run_chunk(in, it, w);
    });
  };
  with_types(q, kv_cache, run);
  return out;
}

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& block_tables,
                           const at::Tensor& seq_lens, const at::Tensor& query_start_loc, int64_t layer,
                           double scale, int64_t window, double softcap) {
  return attend(q, kv_cache, block_tables, seq_lens, query_start_loc, layer, scale, window, softcap, true);
}

// The decode case: one query per sequence, so query_start_loc is 0, 1, ..., S (made here, not by
// the caller once per layer).
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& block_tables,
                                  const at::Tensor& seq_lens, int64_t layer, double scale, int64_t window,
                                  double softcap) {
  const at::Tensor one_each = at::arange(seq_lens.numel() + 1, seq_lens.options().dtype(at::kInt));
  return attend(q, kv_cache, block_tables, seq_lens, one_each, layer, scale, window, softcap, true);
}

at::Tensor paged_attention_rows(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& block_tables,
                                const at::Tensor& seq_lens, const at::Tensor& query_start_loc, int64_t layer,
                                double scale, int64_t window, double softcap) {
  return attend(q, kv_cache, block_tables, seq_lens, query_start_loc, layer, scale, window, softcap, false);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llmc, m) {
  m.def("paged_attention(Tensor q, Tensor kv_cache, Tensor block_tables, Tensor seq_lens, "
        "Tensor query_start_loc, int layer, float scale, int window=0, float softcap=0.0) -> Tensor");
  m.def("paged_decode_attention(Tensor q, Tensor kv_cache, Tensor block_tables, Tensor seq_lens, int layer, "
        "float scale, int window=0, float softcap=0.0) -> Tensor");
  m.def("paged_attention_rows(Tensor q, Tensor kv_cache, Tensor block_tables, Tensor seq_lens, "
        "Tensor query_start_loc, int layer, float scale, int window=0, float softcap=0.0) -> Tensor");
}

TORCH_LIBRARY_IMPL(llmc, CPU, m) {
  m.impl("paged_attention", &paged_attention);
  m.impl("paged_decode_attention", &paged_decode_attention);
  m.impl("paged_attention_rows", &paged_attention_rows);
}
