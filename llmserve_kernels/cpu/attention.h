// Shared by the paged attention kernels (paged_attention.cpp: decode; paged_prefill.cpp:
// prefill): scoring key rows, prefetching them, and the dispatch on dtype and head_dim.
// paged_attention.cpp describes the cache layout and the arithmetic.

#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include <immintrin.h>

#include "pool.h"
#include "vec.h"

namespace llmserve {
namespace attention {

// Asks for one K or V row (head_dim values) to be brought into the caches.
template <typename T, int NV>
inline void prefetch_row(const T* row) {
  constexpr int kBytes = NV * kLanes * int(sizeof(T));
  for (int offset = 0; offset < kBytes; offset += 64) {
    __builtin_prefetch(reinterpret_cast<const char*>(row) + offset, 0, 1);
  }
}

// Scores one query head against key rows: `partial(row)` is a vector whose lanes sum to
// q . k (scaled by `post`), so kLanes rows reduce to kLanes scores with one reduce_lanes.
template <typename T, int NV>
struct KeyDot {
  vfloat q[NV];
  float post = 1.0f;
  KeyDot(const T* query, float scale) {
    for (int c = 0; c < NV; ++c) q[c] = load(query + c * kLanes) * scale;
  }
  vfloat partial(const T* row) const {
    vfloat acc = q[0] * load(row);
    for (int c = 1; c < NV; ++c) acc += q[c] * load(row + c * kLanes);
    return acc;
  }
};

#if defined(__AVX512BF16__)
// bfloat16 rows with the AVX512-BF16 dot-product instruction: no conversion of the keys,
// products exact in fp32 (the query stays unscaled bf16; the scale applies to the sums).
template <int NV>
  requires(NV % 2 == 0)
struct KeyDot<bf16, NV> {
  __m512bh q[NV / 2];
  float post;
  KeyDot(const bf16* query, float scale) : post(scale) {
    for (int c = 0; c < NV / 2; ++c) std::memcpy(&q[c], query + c * 2 * kLanes, sizeof q[c]);
  }
  vfloat partial(const bf16* row) const {
    __m512 acc = _mm512_setzero_ps();
    for (int c = 0; c < NV / 2; ++c) {
      __m512bh k;
      std::memcpy(&k, row + c * 2 * kLanes, sizeof k);
      acc = _mm512_dpbf16_ps(acc, q[c], k);
    }
    vfloat out;
    std::memcpy(&out, &acc, sizeof out);
    return out;
  }
};
#endif

// scores[o] = q . row_o for n rows `stride` apart; raises running_max to their maximum.
template <typename T, int NV>
inline void score_rows(const KeyDot<T, NV>& dot, const T* rows, int64_t stride, int64_t n,
                       float* scores, float& running_max) {
  for (int64_t o0 = 0; o0 < n; o0 += kLanes) {
    const int m = int(std::min<int64_t>(kLanes, n - o0));
    vfloat parts[kLanes];
    for (int t = 0; t < kLanes; ++t) parts[t] = t < m ? dot.partial(rows + (o0 + t) * stride) : vfloat{};
    const vfloat s = reduce_lanes(parts) * dot.post;
    if (m == kLanes) {
      store(scores + o0, s);
      running_max = std::max(running_max, hmax(s));
    } else {
      for (int t = 0; t < m; ++t) {
        scores[o0 + t] = s[t];
        running_max = std::max(running_max, s[t]);
      }
    }
  }
}

// ---- dispatch ------------------------------------------------------------------------------

template <template <typename, int> class F, typename Args>
int dispatch(int dtype, int64_t head_dim, const Args& args) {
  // dtype: 0 = float32, 1 = bfloat16. Returns 0 on success, -1 for an unsupported shape.
#define LLMSERVE_CASE(T, HEAD_DIM)        \
  if (head_dim == HEAD_DIM) {             \
    F<T, HEAD_DIM / kLanes>::run(args);   \
    return 0;                             \
  }
#define LLMSERVE_CASES(T) \
  LLMSERVE_CASE(T, 16)    \
  LLMSERVE_CASE(T, 32)    \
  LLMSERVE_CASE(T, 64)    \
  LLMSERVE_CASE(T, 96)    \
  LLMSERVE_CASE(T, 128)   \
  LLMSERVE_CASE(T, 256)   \
  LLMSERVE_CASE(T, 512)
  // The head dims of llmserve_kernels/cpu/attention.py's SUPPORTED_HEAD_DIMS (multiples of kLanes).
  if (dtype == 0) {
    LLMSERVE_CASES(float)
  } else if (dtype == 1) {
    LLMSERVE_CASES(bf16)
  }
#undef LLMSERVE_CASES
#undef LLMSERVE_CASE
  return -1;
}

}  // namespace attention
}  // namespace llmserve
