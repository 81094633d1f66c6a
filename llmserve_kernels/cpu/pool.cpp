// The kernels' thread pool (pool.h) from Python (llmserve_kernels/cpu/pool.py): its thread count,
// and a check of its loops for tests.

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <vector>

#include <immintrin.h>

#include "pool.h"

using namespace llmserve;

extern "C" {

// The threads of every parallel loop of this library (the worker's --num-threads).
int llmserve_set_num_threads(int threads) {
  if (threads < 1) return -1;
  pool_threads = threads;
  return 0;
}

// A check of the thread pool (pool.h), for tests: `loops` parallel loops on `threads`
// threads, loop l of counts[l % num_counts] chunks, each chunk spinning for `spin` pauses and
// then counting itself. Returns how many loops returned with some chunk not run exactly once.
int64_t llmserve_pool_check(const int64_t* counts, int64_t num_counts, int64_t loops,
                            int threads, int64_t spin) {
  const int64_t widest = *std::max_element(counts, counts + num_counts);
  std::vector<std::atomic<int>> runs(size_t(widest + 1));  // one past: no chunk runs there
  int64_t bad = 0;
  for (int64_t l = 0; l < loops; ++l) {
    const int64_t chunks = counts[l % num_counts];
    auto body = [&](int64_t c) {
      for (int64_t i = 0; i < spin; ++i) _mm_pause();
      runs[size_t(c)].fetch_add(1);
    };
    ChunkPool::instance().run(chunks, threads, body);
    bool ok = true;
    for (int64_t c = 0; c <= widest; ++c) ok &= runs[size_t(c)].exchange(0) == (c < chunks);
    bad += !ok;
  }
  return bad;
}

}  // extern "C"
