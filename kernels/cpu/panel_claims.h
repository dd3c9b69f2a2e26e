// A GEMV's panels claimed by the team rather than assigned: each thread owns an even, contiguous
// share and takes it front to back a chunk at a time; a thread whose share is done takes chunks from
// the back of the others' shares. A decode step meets a barrier after every GEMV, so the GEMV lasts as
// long as its slowest thread, and on a shared machine which thread is slow changes from call to call
// (a neighbour on its core, its memory stream starting late); `llmc profile`'s balance line showed
// the first thread of a 2-thread team waiting at the GEMVs' barriers for a tenth of an fp32 step.
// Each thread still streams its own share in order (the back is taken only at the end).
//
// Contract: every panel of [0, count) goes to exactly one claim, whatever the team's timing; a
// claim is [begin, end), begin < end. Which thread computes a panel changes no output (a panel's
// outputs are computed the same way by any thread).
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <utility>

namespace llmc_plan {

// One share, (front, back) packed in a word: [front, back) is still unclaimed. A cache line each, so
// an owner's claims do not take the line from the teammate claiming its own share.
class alignas(64) ShareClaims {
 public:
  void reset(int64_t begin, int64_t end) { word_.store(pack(begin, end), std::memory_order_relaxed); }

  // The next chunk from the front (the owner's), or from the back (another thread's): a quarter of
  // what is left, at least `min_chunk` panels; an empty range once the share is taken.
  std::pair<int64_t, int64_t> front(int64_t min_chunk) { return claim(min_chunk, true); }
  std::pair<int64_t, int64_t> back(int64_t min_chunk) { return claim(min_chunk, false); }

 private:
  static uint64_t pack(int64_t front, int64_t back) {
    return static_cast<uint64_t>(front) | static_cast<uint64_t>(back) << 32;
  }

  std::pair<int64_t, int64_t> claim(int64_t min_chunk, bool from_front) {
    uint64_t word = word_.load(std::memory_order_relaxed);
    for (;;) {
      const int64_t front = static_cast<int64_t>(word & 0xFFFFFFFFu), back = static_cast<int64_t>(word >> 32);
      if (front >= back) return {0, 0};
      const int64_t n = std::min(back - front, std::max(min_chunk, (back - front) / 4));
      const uint64_t next = from_front ? pack(front + n, back) : pack(front, back - n);
      if (word_.compare_exchange_weak(word, next, std::memory_order_relaxed))
        return from_front ? std::pair{front, front + n} : std::pair{back - n, back};
    }
  }

  std::atomic<uint64_t> word_{0};
};

// Items [first, second) of `count` for thread `tid` of a team of `team`: its even, contiguous share.
inline std::pair<int64_t, int64_t> share(int64_t count, int tid, int team) {
  return {count * tid / team, count * (tid + 1) / team};
}

// Each share of `count` panels, ready to be claimed; `claims` holds `team` of them.
inline void reset_claims(ShareClaims* claims, int64_t count, int team) {
  for (int t = 0; t < team; ++t) {
    const auto [begin, end] = share(count, t, team);
    claims[t].reset(begin, end);
  }
}

// `run(begin, end)` on every chunk thread `tid` claims of `shares` shares (the team it was set for; a
// thread of a smaller team takes the missing threads' shares too): its own from the front, then the
// others' from the back, the next thread's first.
template <typename Run>
void claim_panels(ShareClaims* claims, int tid, int shares, int64_t min_chunk, Run&& run) {
  for (int k = 0; k < shares; ++k) {
    ShareClaims& share = claims[(tid + k) % shares];
    for (;;) {
      const auto [begin, end] = k == 0 ? share.front(min_chunk) : share.back(min_chunk);
      if (begin >= end) break;
      run(begin, end);
    }
  }
}

}  // namespace llmc_plan
