// The barrier a step plan's team meets between its kernels: it spins a bounded time, then yields
// its core a bounded time, then sleeps in the kernel until the last thread arrives.
//
// Contract: reset(team) once by one thread while no one waits (then every thread must see it, e.g.
// behind an OpenMP barrier); each wait() returns once all `team` threads have called it for the same
// round, and everything a thread wrote before its wait() is visible to every thread after theirs.
// sleeps() counts the waits that ended asleep in the kernel (a benchmark's and a test's measure).
//
// Why not `#pragma omp barrier`: libgomp spins ~300000 turns before sleeping, but only ~100 once the
// process's OpenMP workers (every thread that opened a parallel region keeps its own pool) outnumber
// the cores. A step plan meets a barrier after each of its few hundred kernels, so it paid a kernel
// wake at nearly every one in the throttled case (a step run from an engine loop's thread took ~2.5x
// the same step in the thread that built the engine), and in the long-spin case a thread whose
// teammate was preempted by another process burnt its whole time slice at each barrier (batch-1
// decode 10-50x slower on a loaded 2-core machine).
//
// So a wait has three phases (WaitPolicy). It spins for `spin` (longer than a quiet machine's
// imbalance between threads after a kernel): as fast as a barrier can be while the cores are the
// team's. Then it calls sched_yield between looks for up to `yield`: where another thread of this
// machine wants the core (a loaded machine) it runs, and where none does the call returns at once
// and the core stays awake. Only then does it sleep on a futex. The middle phase is for virtual
// machines: there a teammate is late mostly because the hypervisor took its vCPU away, and a waiter
// that sleeps lets its own vCPU halt, and waking a halted vCPU goes through the host's scheduler,
// which on a busy host takes up to milliseconds: on the 2-core AMD EPYC VM, at such moments, a
// batch-1 decode step that slept at a few dozen of its barriers took several times its quiet time.
// `python -m llmc.tools.bench_barrier` compares the policies in one run (the README has its figures).

#pragma once

#include <immintrin.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <thread>

#if defined(__linux__)
#include <linux/futex.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace llmc_cpu {

// How long a waiter spins, then yields its core, before it sleeps (see above).
struct WaitPolicy {
  std::chrono::microseconds spin{50}, yield{5000};
};

class TeamBarrier {
 public:
  explicit TeamBarrier(WaitPolicy policy = WaitPolicy{}) : policy_(policy) {}

  void reset(int team) {
    team_ = team;
    arrived_.store(0);
  }

  void wait() {
    const uint32_t round = round_.load(std::memory_order_acquire);
    if (arrived_.fetch_add(1, std::memory_order_acq_rel) + 1 == team_) {
      arrived_.store(0, std::memory_order_relaxed);            // before the round moves: no one is past it
      round_.store(round + 1, std::memory_order_seq_cst);
      if (sleepers_.load(std::memory_order_seq_cst) > 0) wake_all();
      return;
    }
    const auto spun = std::chrono::steady_clock::now() + policy_.spin;
    for (int turn = 1; round_.load(std::memory_order_acquire) == round; ++turn) {
      if (turn % 64 == 0 && std::chrono::steady_clock::now() > spun) return yield_until_moved(round);
      _mm_pause();
    }
  }

  int64_t sleeps() const { return sleeps_.load(std::memory_order_relaxed); }

 private:
  void yield_until_moved(uint32_t round) {
    const auto yielded = std::chrono::steady_clock::now() + policy_.yield;
    while (round_.load(std::memory_order_acquire) == round) {
      if (std::chrono::steady_clock::now() > yielded) return sleep_until_moved(round);
      yield_core();
    }
  }

  // Dekker's handshake with the last arriver: it moves the round then reads sleepers_, a sleeper
  // counts itself then reads the round (both sequentially consistent), so one of them sees the
  // other; the futex itself returns at once if the round moved between the check and the call.
  void sleep_until_moved(uint32_t round) {
    sleeps_.fetch_add(1, std::memory_order_relaxed);
    while (round_.load(std::memory_order_acquire) == round) {
      sleepers_.fetch_add(1, std::memory_order_seq_cst);
      if (round_.load(std::memory_order_seq_cst) == round) sleep_while(round);
      sleepers_.fetch_sub(1, std::memory_order_seq_cst);
    }
  }

#if defined(__linux__)
  void sleep_while(uint32_t round) {
    syscall(SYS_futex, reinterpret_cast<uint32_t*>(&round_), FUTEX_WAIT_PRIVATE, round, nullptr, nullptr, 0);
  }
  void wake_all() {
    syscall(SYS_futex, reinterpret_cast<uint32_t*>(&round_), FUTEX_WAKE_PRIVATE, INT32_MAX, nullptr, nullptr, 0);
  }
  static void yield_core() { sched_yield(); }
#else
  void sleep_while(uint32_t) { std::this_thread::yield(); }
  void wake_all() {}
  static void yield_core() { std::this_thread::yield(); }
#endif

  WaitPolicy policy_;
  int team_ = 1;
  std::atomic<int> arrived_{0};
  std::atomic<uint32_t> round_{0};
  std::atomic<int> sleepers_{0};
  std::atomic<int64_t> sleeps_{0};
  static_assert(sizeof(std::atomic<uint32_t>) == sizeof(uint32_t), "the futex word is the round itself");
};

}  // namespace llmc_cpu
