// Paged causal attention on the CPU: every query row reads its keys and values straight from
// the paged KV cache, one block at a time, with an online softmax (no gathered copy of the
// context, no score matrix in memory).
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
//   returns         [T, H*D] in q's dtype; a query sees keys at positions <= its own.
// D must be a multiple of 16 and H a multiple of KVH. Scores, softmax and the weighted sum are
// computed in fp32.
//
// Work items are (sequence, KV head, tile of up to kTile queries). The G = H/KVH query heads
// sharing a KV head and the queries of the tile are the rows of one item, so each key and value
// is widened to fp32 once per item and used by all its rows. A block's 16 scores of one row
// are one 16-lane vector, so the online-softmax update is a handful of vector ops per block.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "kv_rows.h"
#include "vec16.h"

namespace {

using llmc_cpu::Vec16;

constexpr int64_t kBlock = 16;  // tokens per cache block: one vector of scores
constexpr int64_t kTile = 16;   // queries of one chunk per work item
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

struct Geometry {
  int64_t heads, kv_heads, head_dim, groups;
};

struct Item {
  int64_t seq, kv_head, first_query, num_queries;
};

// One query row: its fp32 query (pre-scaled), position, online-softmax state and accumulator.
struct Row {
  const float* q;
  float* acc;
  int64_t pos;
  float max = kNegInf;
  float sum = 0.f;
};

// Widens the first `visible` rows of one block's keys and values ([16, D] each) to fp32.
template <typename C>
void load_block(const C* k, const C* v, int64_t visible, int64_t d, float* k_f, float* v_f) {
  const int64_t row = llmc_cpu::row_elems<C>(d);
  for (int64_t t = 0; t < visible; ++t) {
    llmc_cpu::widen_row(k + t * row, d, k_f + t * d);
    llmc_cpu::widen_row(v + t * row, d, v_f + t * d);
  }
}

// Scores of one row against the `visible` first keys of a block ([16, D] rows of `k`).
Vec16 block_scores(const Row& row, const float* k, int64_t visible, int64_t d) {
  Vec16 scores = llmc_cpu::splat(kNegInf);
  for (int64_t t = 0; t < visible; ++t) {
    Vec16 dot{};
    for (int64_t j = 0; j < d; j += 16) dot += llmc_cpu::load16(row.q + j) * llmc_cpu::load16(k + t * d + j);
    scores[t] = llmc_cpu::hsum(dot);
  }
  return scores;
}

// Folds one block into a row: rescale the accumulator to the new max, add p * v per key.
void fold_block(Row& row, Vec16 scores, const float* v, int64_t visible, int64_t d) {
  const float new_max = std::max(row.max, llmc_cpu::hmax(scores));
  const float rescale = std::exp(row.max - new_max);  // 0 on the first block
  const Vec16 p = llmc_cpu::exp16(scores - new_max);  // masked lanes: exp(-inf) = 0
  row.sum = row.sum * rescale + llmc_cpu::hsum(p);
  row.max = new_max;
  for (int64_t j = 0; j < d; j += 16) {
    Vec16 acc = llmc_cpu::load16(row.acc + j) * rescale;
    for (int64_t t = 0; t < visible; ++t) acc += p[t] * llmc_cpu::load16(v + t * d + j);
    llmc_cpu::store16(row.acc + j, acc);
  }
}

template <typename T, typename C>
void run_item(const Item& it, const T* q, T* out, const C* k_cache, const C* v_cache, const int32_t* table,
              int64_t seq_len, int64_t chunk_start, int64_t chunk_len, const Geometry& g, float scale,
              std::vector<float>& scratch, std::vector<Row>& rows) {
  const int64_t d = g.head_dim;
  const int64_t num_rows = it.num_queries * g.groups;
  // [rows][D] queries, [rows][D] accumulators, then one block's keys and values [16][D] each
  scratch.assign(2 * num_rows * d + 2 * kBlock * d, 0.f);
  float* k_f = scratch.data() + 2 * num_rows * d;
  float* v_f = k_f + kBlock * d;
  rows.clear();
  for (int64_t i = 0; i < it.num_queries; ++i)
    for (int64_t h = 0; h < g.groups; ++h) {
      const int64_t r = rows.size(), token = chunk_start + it.first_query + i;
      const T* src = q + token * g.heads * d + (it.kv_head * g.groups + h) * d;
      for (int64_t j = 0; j < d; ++j) scratch[r * d + j] = static_cast<float>(src[j]) * scale;
      rows.push_back({scratch.data() + r * d, scratch.data() + (num_rows + r) * d,
                      seq_len - chunk_len + it.first_query + i});
    }
  const int64_t last_pos = rows.back().pos;
  for (int64_t b = 0; b * kBlock <= last_pos; ++b) {
    const int64_t base = (static_cast<int64_t>(table[b]) * g.kv_heads + it.kv_head) * kBlock * llmc_cpu::row_elems<C>(d);
    load_block(k_cache + base, v_cache + base, std::min(kBlock, last_pos + 1 - b * kBlock), d, k_f, v_f);
    for (Row& row : rows) {
      const int64_t visible = std::min(kBlock, row.pos + 1 - b * kBlock);
      if (visible > 0) fold_block(row, block_scores(row, k_f, visible, d), v_f, visible, d);
    }
  }
  for (int64_t r = 0; r < num_rows; ++r) {
    const int64_t i = r / g.groups, h = r % g.groups, token = chunk_start + it.first_query + i;
    T* dst = out + token * g.heads * d + (it.kv_head * g.groups + h) * d;
    const float inv = 1.f / rows[r].sum;
    for (int64_t j = 0; j < d; ++j) dst[j] = static_cast<T>(rows[r].acc[j] * inv);
  }
}

std::vector<Item> plan_items(const int32_t* qsl, int64_t num_seqs, int64_t kv_heads) {
  std::vector<Item> items;
  for (int64_t s = 0; s < num_seqs; ++s)
    for (int64_t first = 0; first < qsl[s + 1] - qsl[s]; first += kTile)
      for (int64_t h = 0; h < kv_heads; ++h)
        items.push_back({s, h, first, std::min<int64_t>(kTile, qsl[s + 1] - qsl[s] - first)});
  return items;
}

int64_t head_dim(const at::Tensor& cache) {
  return cache.size(5) - (cache.scalar_type() == at::kChar ? llmc_cpu::kScaleBytes : 0);
}

void check_inputs(const at::Tensor& q, const at::Tensor& cache, const at::Tensor& tables,
                  const at::Tensor& lens, const at::Tensor& qsl, int64_t layer) {
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
  for (const at::Tensor* t : {&tables, &lens, &qsl})
    TORCH_CHECK(t->scalar_type() == at::kInt && t->is_contiguous(), "block tables and lengths must be contiguous int32");
  TORCH_CHECK(qsl.numel() == lens.numel() + 1 && tables.size(0) == lens.numel(),
              "query_start_loc needs S+1 entries and block_tables S rows");
  TORCH_CHECK(q.size(1) % (cache.size(3) * head_dim(cache)) == 0, "q width ", q.size(1),
              " is not a multiple of kv_heads * head_dim");
}

// Every read the work items will make stays inside q and the cache.
void check_layout(const int32_t* qsl, const int32_t* lens, const int32_t* tables, int64_t num_seqs, int64_t width,
                  int64_t tokens, int64_t num_blocks) {
  TORCH_CHECK(qsl[0] == 0 && qsl[num_seqs] == tokens, "query_start_loc must run from 0 to ", tokens);
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t n = qsl[s + 1] - qsl[s], used = (lens[s] + kBlock - 1) / kBlock;
    TORCH_CHECK(n >= 0 && n <= lens[s] && used <= width, "sequence ", s, " has ", n, " queries, length ", lens[s],
                " and ", width, " block-table entries");
    for (int64_t b = 0; b < used; ++b)
      TORCH_CHECK(tables[s * width + b] >= 0 && tables[s * width + b] < num_blocks, "block ",
                  tables[s * width + b], " of sequence ", s, " is outside the cache's ", num_blocks, " blocks");
  }
}

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& block_tables,
                           const at::Tensor& seq_lens, const at::Tensor& query_start_loc, int64_t layer,
                           double scale) {
  check_inputs(q, kv_cache, block_tables, seq_lens, query_start_loc, layer);
  const int64_t kv_heads = kv_cache.size(3), d = head_dim(kv_cache);
  const Geometry g{q.size(1) / d, kv_heads, d, q.size(1) / (kv_heads * d)};
  at::Tensor out = at::empty_like(q);
  const int32_t* qsl = query_start_loc.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int64_t width = block_tables.size(1);
  check_layout(qsl, lens, tables, seq_lens.numel(), width, q.size(0), kv_cache.size(2));
  const std::vector<Item> items = plan_items(qsl, seq_lens.numel(), kv_heads);
  const int64_t layer_stride = kv_cache.stride(0), half = kv_cache.stride(1);
  const auto run = [&](auto* typed, auto* cache_typed) {
    using T = std::remove_pointer_t<decltype(typed)>;
    using C = std::remove_pointer_t<decltype(cache_typed)>;
    const C* k_cache = kv_cache.const_data_ptr<C>() + layer * layer_stride;
    const C* v_cache = k_cache + half;
    at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t begin, int64_t end) {
      std::vector<float> scratch;
      std::vector<Row> rows;
      for (int64_t i = begin; i < end; ++i) {
        const Item& it = items[i];
        run_item(it, q.const_data_ptr<T>(), out.data_ptr<T>(), k_cache, v_cache, tables + it.seq * width,
                 lens[it.seq], qsl[it.seq], qsl[it.seq + 1] - qsl[it.seq], g, static_cast<float>(scale),
                 scratch, rows);
      }
    });
  };
  const bool int8 = kv_cache.scalar_type() == at::kChar;
  if (q.scalar_type() == at::kFloat && int8)
    run(static_cast<float*>(nullptr), static_cast<int8_t*>(nullptr));
  else if (q.scalar_type() == at::kFloat)
    run(static_cast<float*>(nullptr), static_cast<float*>(nullptr));
  else if (int8)
    run(static_cast<c10::BFloat16*>(nullptr), static_cast<int8_t*>(nullptr));
  else
    run(static_cast<c10::BFloat16*>(nullptr), static_cast<c10::BFloat16*>(nullptr));
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llmc, m) {
  m.def("paged_attention(Tensor q, Tensor kv_cache, Tensor block_tables, Tensor seq_lens, "
        "Tensor query_start_loc, int layer, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(llmc, CPU, m) { m.impl("paged_attention", &paged_attention); }
