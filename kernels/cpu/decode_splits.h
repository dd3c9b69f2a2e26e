// A decode whose keys are split among work items (flash-decoding; attention_work.h's split_decodes
// decides where): each part's item runs run_decode over its keys and leaves its rows' output (not
// yet divided by the softmax sum), max and sum in a slot of its own; the part that finishes last
// merges the parts' slots into the output rows. A batch-1 decode is one item (all its KV heads) for
// all the threads, or a few per-head ones (SmolLM2: 3 for 2 threads, one thread waiting a third of
// the attention); cut into parts, the items share evenly.
//
// Contract: the merged rows are the unsplit softmax over all the parts' keys, rescaled to their
// common max; the parts are merged in part order whichever thread merges, so a split's result
// does not depend on the team's timing. A slot is read only after its part counted itself done
// (acquire-release on the split's counter).
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <vector>

#include "attention_items.h"

namespace llmc_cpu {

class DecodeSplits {
 public:
  // Room for the splits of `items` (Item::split numbers them from 0), each part `rows` rows of `d`
  // at most; every split's count of parts done from 0.
  void reserve(const std::vector<Item>& items, int64_t rows, int64_t d) {
    int64_t splits = 0;
    parts_ = 1;
    for (const Item& it : items)
      if (it.split >= 0) splits = std::max(splits, it.split + 1), parts_ = std::max(parts_, it.parts);
    rows_ = rows;
    d_ = d;
    slots_.assign(splits * parts_ * rows * (d + 2), 0.f);
    done_.reset(new std::atomic<int64_t>[std::max<int64_t>(splits, 1)]);
    for (int64_t i = 0; i < splits; ++i) done_[i] = 0;
  }

  // A part's slot: its rows' outputs [rows][d], then their maxima [rows], then their sums [rows].
  float* output(const Item& it) { return slots_.data() + (it.split * parts_ + it.part) * rows_ * (d_ + 2); }
  float* maxima(const Item& it) { return output(it) + rows_ * d_; }
  float* sums(const Item& it) { return maxima(it) + rows_; }

  // Counts `it`'s part done; true for the part that completes its split. The count goes on from
  // call to call (a step plan's layers run the same items), so the last of each call's parts is
  // the one whose count is a multiple of the parts.
  bool last(const Item& it) {
    return done_[it.split].fetch_add(1, std::memory_order_acq_rel) % it.parts == it.parts - 1;
  }

 private:
  std::vector<float> slots_;
  std::unique_ptr<std::atomic<int64_t>[]> done_;
  int64_t parts_ = 1, rows_ = 0, d_ = 0;
};

}  // namespace llmc_cpu
