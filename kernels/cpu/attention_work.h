// How paged attention's work is cut into items and ordered (paged_attention.cpp holds the
// contract): plan_items makes the items of one call, by_cost orders them largest first for
// threads that take them one at a time, check_layout proves every read they will make stays
// inside q and the cache. The op and a step plan (step_plan.cpp) share them.
#pragma once

#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <vector>

#include "amx_attention.h"
#include "attention_items.h"

namespace llmc_cpu {

constexpr int64_t kQueries = 32;  // queries of one chunk per work item
// Single-query sequences per thread from which a decode is one item over all KV heads: with
// fewer, items per KV head keep both threads busy (one sequence of 4000 tokens: 0.155 ms per
// head, 0.21 ms whole), with 8 or more the whole sequences read faster (64 of 100-500 tokens:
// 0.57 ms whole, 0.61-0.69 ms per head).
constexpr int64_t kDecodesPerThread = 4;

// `decode_items`: a sequence's single query is one item over all KV heads (run_decode reads
// each block's heads, adjacent in the cache, as one run) where there are kDecodesPerThread
// such sequences per thread, enough to keep the threads busy; else every item is one KV head's.
inline std::vector<Item> plan_items(const int32_t* qsl, int64_t num_seqs, int64_t kv_heads, bool decode_items,
                                     int64_t threads) {
  int64_t decodes = 0;
  for (int64_t s = 0; s < num_seqs; ++s) decodes += qsl[s + 1] - qsl[s] == 1;
  const bool whole_decodes = decode_items && decodes >= kDecodesPerThread * threads;
  std::vector<Item> items;
  for (int64_t s = 0; s < num_seqs; ++s) {
    if (whole_decodes && qsl[s + 1] - qsl[s] == 1) {
      items.push_back({s, 0, 0, 1, kv_heads});
      continue;
    }
    for (int64_t first = 0; first < qsl[s + 1] - qsl[s]; first += kQueries)
      for (int64_t h = 0; h < kv_heads; ++h)
        items.push_back({s, h, first, std::min<int64_t>(kQueries, qsl[s + 1] - qsl[s] - first)});
  }
  return items;
}

// The items' indices, most costly first (queries x keys seen by the last one: causal, later
// queries see more keys).
inline std::vector<int64_t> by_cost(const std::vector<Item>& items, const int32_t* lens, const int32_t* qsl) {
  std::vector<int64_t> cost(items.size()), order(items.size());
  for (size_t i = 0; i < items.size(); ++i) {
    const Item& it = items[i];
    const int64_t first_pos = lens[it.seq] - (qsl[it.seq + 1] - qsl[it.seq]) + it.first_query;
    cost[i] = it.kv_heads * it.num_queries * (first_pos + it.num_queries);
  }
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return cost[a] > cost[b]; });
  return order;
}

// Every read the work items will make stays inside q and the cache.
inline void check_layout(const int32_t* qsl, const int32_t* lens, const int32_t* tables, int64_t num_seqs, int64_t width,
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

}  // namespace llmc_cpu
