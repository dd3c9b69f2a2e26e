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

#include "amx_attention_resident.h"
#include "attention_items.h"

namespace llmc_cpu {

constexpr int64_t kQueries = 32;  // queries of one chunk per work item
// Single-query sequences per thread from which a decode is one item over all KV heads: with
// fewer, and too short to cut into parts (split_decodes), items per KV head keep both threads
// busy (before the parts, one sequence of 4000 tokens: 0.155 ms per head, 0.21 ms whole), with 8
// or more the whole sequences read faster (64 of 100-500 tokens: 0.57 ms whole, 0.61-0.69 ms per
// head).
constexpr int64_t kDecodesPerThread = 4;

// Keys a part of a split decode has at least (was 256: on the AVX2 Zen 3 a batch-1 decode after 400 tokens then
// ran 3 per-head items on 2 threads, one thread idle a third of the attention; a part's merge costs far less).
constexpr int64_t kSplitKeys = 128;

// A step of decodes only, with fewer items than kDecodesPerThread a thread: each decode's keys cut
// into parts, items of their own (decode_splits.h merges them), so that the items share evenly
// among the threads: parts = threads / gcd(items, threads), at most one per kSplitKeys keys (a
// batch-1 decode on 2 threads: 2 parts of its one item; a short sequence beside it keeps per-head
// items, 3 for SmolLM2, which become 6). Windows are not looked at: a part before a layer's window
// reads nothing.
inline void split_decodes(std::vector<Item>& items, const int32_t* lens, int64_t threads) {
  const int64_t count = static_cast<int64_t>(items.size());
  const bool decodes = std::all_of(items.begin(), items.end(), [](const Item& it) { return it.num_queries == 1; });
  if (threads < 2 || count == 0 || count >= kDecodesPerThread * threads || !decodes) return;
  const int64_t wanted = threads / std::gcd(count, threads);
  std::vector<Item> parts;
  int64_t splits = 0;
  for (const Item& it : items) {
    const int64_t keys = lens[it.seq], n = std::min(wanted, keys / kSplitKeys);
    if (n < 2) {
      parts.push_back(it);
      continue;
    }
    for (int64_t p = 0; p < n; ++p) {
      Item part = it;
      part.key_begin = keys * p / n / kBlock * kBlock;   // a part starts a block
      part.key_end = p + 1 == n ? keys : keys * (p + 1) / n / kBlock * kBlock;
      part.split = splits, part.part = p, part.parts = n;
      parts.push_back(part);
    }
    ++splits;
  }
  items = std::move(parts);
}

// `decode_items`: a sequence's single query is one item over all KV heads (run_decode reads
// each block's heads, adjacent in the cache, as one run) where there are kDecodesPerThread
// such sequences per thread, enough to keep the threads busy, or where the step is of decodes
// only, each long enough to be split (split_decodes cuts them into parts for the threads); else
// every item is one KV head's. A whole item reads a block's heads as one contiguous run, and a
// sequence's blocks mostly follow each other in the cache, so one sequence of 4000 tokens and 3
// KV heads on 2 threads took less time as one whole item split in 2 than as 3 per-head items split
// in 6 (README, "Long-context decode").
inline std::vector<Item> plan_items(const int32_t* qsl, const int32_t* lens, int64_t num_seqs, int64_t kv_heads,
                                     bool decode_items, int64_t threads) {
  int64_t decodes = 0;
  bool splittable = true;   // decodes only, each long enough for split_decodes to cut
  for (int64_t s = 0; s < num_seqs; ++s) {
    decodes += qsl[s + 1] - qsl[s] == 1;
    splittable = splittable && qsl[s + 1] - qsl[s] == 1 && lens[s] >= 2 * kSplitKeys;
  }
  const bool whole_decodes = decode_items && (decodes >= kDecodesPerThread * threads || splittable);
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
  if (decode_items) split_decodes(items, lens, threads);
  return items;
}

// The items' indices, most costly first (queries x keys seen by the last one: causal, later
// queries see more keys).
inline std::vector<int64_t> by_cost(const std::vector<Item>& items, const int32_t* lens, const int32_t* qsl) {
  std::vector<int64_t> cost(items.size()), order(items.size());
  for (size_t i = 0; i < items.size(); ++i) {
    const Item& it = items[i];
    const int64_t first_pos = lens[it.seq] - (qsl[it.seq + 1] - qsl[it.seq]) + it.first_query;
    cost[i] = it.split >= 0 ? it.kv_heads * (it.key_end - it.key_begin)
                            : it.kv_heads * it.num_queries * (first_pos + it.num_queries);
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
