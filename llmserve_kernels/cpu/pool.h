// A fork/join for small parallel loops that never waits for a thread that has not started.
//
// An OpenMP parallel-for ends in a barrier that every thread of the team must reach. When
// another process holds a core (the gateway and the scheduler share the machine with the
// worker), a team thread may not run for a scheduler time slice, several milliseconds, and
// the barrier waits for it: a decode step has ~150 such loops, and on the 2-core machine
// under load a step took far longer with two threads than with one (bench/RESULTS.md,
// "Figures moved out of code comments").
//
// Here the calling thread publishes the loop and runs chunks itself; helper threads claim
// chunks too, one at a time, by compare-and-swap on a ticket that holds the loop's
// generation, its chunk count and its next chunk. The caller waits only for chunks a helper
// has claimed (one each at most): a helper that wakes late finds nothing left, or a newer
// generation, and claims nothing. Helpers spin briefly for the next loop, then sleep on a
// condition variable.
//
// The chunk count is in the ticket, not beside it: a helper that read the last loop's ticket
// (every chunk claimed) while the next loop's larger count was already stored, but not its
// ticket, would otherwise claim a chunk past the last loop's end, run the next loop's body
// for it, and count it as done in the next loop, whose caller then returned while a chunk it
// waited for was still running (seen rarely, on a busy machine: bench/RESULTS.md,
// "Speculative decoding, fifth round").

#pragma once

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

#include <immintrin.h>

namespace llmserve {

class ChunkPool {
 public:
  // Chunks of one published loop; run() splits longer loops into loops of this many.
  static constexpr int64_t kMaxChunks = (int64_t(1) << 20) - 1;

  // Runs body(chunk) for chunk in [0, chunks) on up to `threads` threads (the caller and
  // threads - 1 helpers), returning when all have run. One loop at a time: callers serialize.
  template <typename Body>
  void run(int64_t chunks, int threads, Body& body) {
    if (chunks <= 0) return;
    if (threads <= 1 || chunks == 1) {
      for (int64_t c = 0; c < chunks; ++c) body(c);
      return;
    }
    for (int64_t base = 0; base < chunks; base += kMaxChunks) {
      auto part = [&](int64_t c) { body(base + c); };
      run_published(std::min(kMaxChunks, chunks - base), threads, part);
    }
  }

  static ChunkPool& instance() {
    static ChunkPool* pool = new ChunkPool();  // never destroyed: helpers outlive statics
    return *pool;
  }

 private:
  // The ticket: generation (24 bits, wrapping) | chunk count (20) | next chunk index (20).
  static constexpr int kIndexBits = 20;
  static constexpr uint64_t kIndexMask = (uint64_t(1) << kIndexBits) - 1;
  static constexpr int kGenerationShift = 2 * kIndexBits;
  // Polls before a helper sleeps (how long they take: bench/RESULTS.md, "Figures moved out of
  // code comments").
  static constexpr int kSpins = 20000;

  static uint64_t generation_of(uint64_t ticket) { return ticket >> kGenerationShift; }

  template <typename Body>
  void run_published(int64_t chunks, int threads, Body& body) {
    std::lock_guard<std::mutex> one_loop(loop_mutex_);
    ensure_helpers(threads - 1);
    body_ = &body;
    call_ = [](void* b, int64_t c) { (*static_cast<Body*>(b))(c); };
    done_.store(0, std::memory_order_relaxed);
    const uint64_t generation = ++generation_ & ((uint64_t(1) << (64 - kGenerationShift)) - 1);
    // seq_cst: the ticket's store must not pass the load of sleepers_ (see helper_loop).
    ticket_.store(generation << kGenerationShift | uint64_t(chunks) << kIndexBits);
    if (sleepers_.load() > 0) {
      std::lock_guard<std::mutex> lock(wake_mutex_);
      wake_.notify_all();
    }
    int64_t mine = 0;
    while (claim_and_run(generation)) ++mine;
    while (done_.load(std::memory_order_acquire) + mine < chunks) _mm_pause();
  }

  // Claims the next chunk of `generation`'s loop and runs it; false when none is left (or a
  // newer loop replaced it). A successful claim means the caller of that loop is still
  // waiting for this chunk, so its body is still the one published.
  bool claim_and_run(uint64_t generation) {
    uint64_t ticket = ticket_.load(std::memory_order_acquire);
    for (;;) {
      if (generation_of(ticket) != generation) return false;
      const uint64_t index = ticket & kIndexMask;
      if (index >= ((ticket >> kIndexBits) & kIndexMask)) return false;
      if (ticket_.compare_exchange_weak(ticket, ticket + 1, std::memory_order_acq_rel)) {
        call_(body_, int64_t(index));
        return true;
      }
    }
  }

  void helper_loop() {
    uint64_t seen = 0;
    for (;;) {
      uint64_t generation = generation_of(ticket_.load(std::memory_order_acquire));
      for (int spin = 0; generation == seen && spin < kSpins; ++spin) {
        _mm_pause();
        generation = generation_of(ticket_.load(std::memory_order_acquire));
      }
      if (generation == seen) {
        std::unique_lock<std::mutex> lock(wake_mutex_);
        sleepers_.fetch_add(1);  // then the ticket is read again, under the lock
        wake_.wait(lock, [&] {
          return generation_of(ticket_.load(std::memory_order_acquire)) != seen;
        });
        sleepers_.fetch_sub(1);
        continue;
      }
      seen = generation;
      while (claim_and_run(generation)) done_.fetch_add(1, std::memory_order_acq_rel);
    }
  }

  void ensure_helpers(int count) {
    while (int(helpers_.size()) < count) {
      helpers_.emplace_back([this] { helper_loop(); });
      helpers_.back().detach();
    }
  }

  std::mutex loop_mutex_;
  std::vector<std::thread> helpers_;
  uint64_t generation_ = 0;
  std::atomic<uint64_t> ticket_{0};
  std::atomic<int64_t> done_{0};  // chunks finished by helpers
  void* body_ = nullptr;
  void (*call_)(void*, int64_t) = nullptr;
  std::atomic<int> sleepers_{0};
  std::mutex wake_mutex_;
  std::condition_variable wake_;
};

// Threads of every parallel loop in this library, the caller included (llmserve_set_num_threads).
inline std::atomic<int> pool_threads{int(std::max(1u, std::thread::hardware_concurrency()))};

// Elementwise loops over fewer elements than this run on the calling thread: waking the
// pool would cost more than it saves.
constexpr int64_t kParallelElements = 1 << 15;

// body(begin, end) over [0, n) in chunks of about four per thread, on the pool's threads when
// `parallel`, else on the calling thread alone.
template <typename Body>
void parallel_for(int64_t n, bool parallel, Body&& body) {
  if (n <= 0) return;
  const int threads = parallel ? pool_threads.load(std::memory_order_relaxed) : 1;
  const int64_t grain = std::max<int64_t>(1, n / (4 * int64_t(threads)));
  auto chunk = [&](int64_t c) { body(c * grain, std::min(n, (c + 1) * grain)); };
  ChunkPool::instance().run((n + grain - 1) / grain, threads, chunk);
}

}  // namespace llmserve
