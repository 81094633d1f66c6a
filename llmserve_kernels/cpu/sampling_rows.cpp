// The sampler's row reductions over a step's logits, for CPUs (dtype 0 = float32, 1 =
// bfloat16; extern "C", called through ctypes and by decode.cpp):
//   llmserve_argmax_logsumexp per row of logits: maximum, first argmax, log-sum-exp (float32)
//   llmserve_masked_argmax    per row: the best token a mask allows, and its rank in the row

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "pool.h"
#include "vec.h"

namespace {

using namespace llmserve;

// Per row: its maximum, the first index holding it (NaN never wins), and log(sum(exp(row))),
// in float32 whatever the storage type (bfloat16 logits are read as they are, never copied
// to float32). Two passes: the maximum, then the index and the sum of exponentials together.
template <typename T>
void argmax_logsumexp(const T* logits, int64_t n, int64_t vocab, int64_t* argmax, float* lse,
                      float* max) {
  // One row per thread: a single row (batch 1) stays on the calling thread.
  parallel_for(n, n > 1 && n * vocab >= kParallelElements, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* row = logits + r * vocab;
      vfloat best = splat(-std::numeric_limits<float>::infinity());
      int64_t i = 0;
      for (; i + kLanes <= vocab; i += kLanes) {
        const vfloat v = load(row + i);
        best = v > best ? v : best;
      }
      float top = hmax(best);
      for (; i < vocab; ++i) top = std::max(top, to_float(row[i]));
      // All -inf, or +inf present: no finite normalizer, and log-sum-exp is the maximum.
      const bool finite = !std::isinf(top);
      const vfloat vtop = splat(top);
      const vint none = vint{} + int32_t(vocab);
      vint first = none;  // per lane: the first index holding the maximum
      vint index = lane_indices();
      vfloat total = vfloat{};
      for (i = 0; i + kLanes <= vocab; i += kLanes, index += kLanes) {
        const vfloat v = load(row + i);
        first = ((v == vtop) & (first == none)) ? index : first;
        if (finite) total += exp_nonpositive(v - vtop);
      }
      int64_t found = vocab;
      for (int lane = 0; lane < kLanes; ++lane) found = std::min<int64_t>(found, first[lane]);
      float tail = 0.0f;
      for (; i < vocab; ++i) {
        const float v = to_float(row[i]);
        if (v == top) found = std::min(found, i);
        if (finite) tail += exp_nonpositive(v - top);
      }
      argmax[r] = found < vocab ? found : 0;
      lse[r] = finite ? top + std::log(hsum(total) + tail) : top;
      max[r] = top;
    }
  });
}

// kLanes refused bytes as lane masks: all bits set where the byte is not 0. (A byte vector
// of kLanes lanes is narrower than a register, and GCC widens it lane by lane, which is
// slower: bench/RESULTS.md, "Figures moved out of code comments".)
inline vint refused_lanes(const uint8_t* src) {
  vint wide;
#if LLMSERVE_LANES == 16
  const __m512i w = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
#else
  const __m256i w = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src)));
#endif
  std::memcpy(&wide, &w, sizeof wide);
  return wide != 0;
}

// Per row: the first index holding the largest value among those whose `refused` byte is 0
// (NaN never wins; a row whose allowed values are all -inf or NaN gives its first allowed
// index, and a row with none allowed gives -1), and that value's rank in the whole row, 1 +
// how many values are larger (float32 comparisons). Masked greedy sampling: one pass for the
// maximum, one for its index and rank, where the general path copies and fills the logits.
template <typename T>
void masked_argmax(const T* logits, const uint8_t* refused, int64_t n, int64_t vocab,
                   int64_t* argmax, int64_t* rank) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  parallel_for(n, n > 1 && n * vocab >= kParallelElements, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* row = logits + r * vocab;
      const uint8_t* no = refused + r * vocab;
      vfloat best = splat(neg_inf);
      int64_t i = 0;
      for (; i + kLanes <= vocab; i += kLanes) {
        const vfloat v = refused_lanes(no + i) ? splat(neg_inf) : load(row + i);
        best = v > best ? v : best;
      }
      float top = hmax(best);
      for (; i < vocab; ++i)
        if (!no[i]) top = std::max(top, to_float(row[i]));
      const vfloat vtop = splat(top);
      const vint none = vint{} + int32_t(vocab);
      vint first = none;  // per lane: the first allowed index holding the maximum
      vint index = lane_indices();
      vint above = vint{};  // per lane: minus the count of values over the maximum
      for (i = 0; i + kLanes <= vocab; i += kLanes, index += kLanes) {
        const vfloat v = load(row + i);
        first = ((v == vtop) & ~refused_lanes(no + i) & (first == none)) ? index : first;
        above += v > vtop;
      }
      int64_t found = vocab;
      int64_t larger = 0;
      for (int lane = 0; lane < kLanes; ++lane) {
        found = std::min<int64_t>(found, first[lane]);
        larger -= above[lane];
      }
      for (; i < vocab; ++i) {
        const float v = to_float(row[i]);
        if (v == top && !no[i]) found = std::min(found, i);
        larger += v > top;
      }
      if (found == vocab) {  // every allowed value is NaN, or nothing is allowed
        found = -1;
        for (i = 0; i < vocab && found < 0; ++i)
          if (!no[i]) found = i;
        larger = 0;
        if (found >= 0)
          for (i = 0; i < vocab; ++i) larger += to_float(row[i]) > to_float(row[found]);
      }
      argmax[r] = found;
      rank[r] = larger + 1;
    }
  });
}

}  // namespace

extern "C" {

int llmserve_argmax_logsumexp(int dtype, const void* logits, int64_t n, int64_t vocab,
                              int64_t* argmax, float* lse, float* max) {
  if (dtype == 0) {
    argmax_logsumexp(static_cast<const float*>(logits), n, vocab, argmax, lse, max);
  } else if (dtype == 1) {
    argmax_logsumexp(static_cast<const bf16*>(logits), n, vocab, argmax, lse, max);
  } else {
    return -1;
  }
  return 0;
}

int llmserve_masked_argmax(int dtype, const void* logits, const uint8_t* refused, int64_t n,
                           int64_t vocab, int64_t* argmax, int64_t* rank) {
  if (dtype == 0) {
    masked_argmax(static_cast<const float*>(logits), refused, n, vocab, argmax, rank);
  } else if (dtype == 1) {
    masked_argmax(static_cast<const bf16*>(logits), refused, n, vocab, argmax, rank);
  } else {
    return -1;
  }
  return 0;
}

}  // extern "C"
