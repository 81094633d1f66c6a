// One key chunk of paged prefill attention (paged_prefill.cpp, which tiles the queries and
// stages the keys): the online-softmax update of a block of query vectors, in fp32 or with
// bfloat16 pair dots. The arguments of a prefill call live here too, as the update reads them.

#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "attention.h"
#include "vec.h"

namespace llmserve::prefill {

using namespace llmserve::attention;

struct PrefillArgs {
  const void* query;  // [num_tokens, num_heads, head_dim], sequences back to back
  const void* key_cache;
  const void* value_cache;
  const int32_t* block_tables;  // [num_seqs, table_stride]
  int64_t table_stride;
  const int32_t* query_start_loc;  // [num_seqs + 1]
  const int32_t* seq_lens;         // [num_seqs], cached context + this chunk
  void* out;                       // [num_tokens, num_heads, head_dim]
  int64_t num_seqs;
  int64_t num_heads;
  int64_t num_kv_heads;
  int64_t block_size;
  int64_t block_stride;  // elements from one block to the next, in both caches
  float scale;
  int64_t query_stride;  // elements between query rows (heads are contiguous in a row)
  int64_t window;        // sliding window, 0 = none
  float softcap;         // 0 = none
  const float* sinks;    // [num_heads] sink logits, nullptr = none
  bool bf16_dots;        // queries, keys, weights and values rounded to bfloat16 (see below)
};

// With `bf16_dots` (fast mode) and AVX512-BF16, the scores and the weighted sums of values
// take the AVX512-BF16 dot product: the pre-scaled queries, the keys, the softmax weights and
// the values are rounded to bfloat16 (nearest even), two products at a time are exact in fp32
// and accumulate there, at twice the multiply-adds of fp32 vectors. The softmax itself (maxima,
// exponentials, sums) stays fp32. Elsewhere the flag is ignored: fp32 throughout.
#if defined(__AVX512BF16__) && LLMSERVE_LANES == 16
#define LLMSERVE_BF16_DOTS 1
#else
#define LLMSERVE_BF16_DOTS 0
#endif
constexpr bool kBf16Dots = LLMSERVE_BF16_DOTS;

constexpr int kKeyChunk = 64;  // keys per softmax update
constexpr int kKeyVectors = kKeyChunk / kLanes;  // independent score accumulators

#if LLMSERVE_BF16_DOTS
// acc + the pairs' products, lane by lane: a[2l] * b[2l] + a[2l + 1] * b[2l + 1] in lane l.
inline vfloat dot_pairs(vfloat acc, __m512i a, const bf16* b) {
  __m512i pairs;
  std::memcpy(&pairs, b, sizeof pairs);
  return vfloat(_mm512_dpbf16_ps(__m512(acc), __m512bh(a), __m512bh(pairs)));
}

// The pair of bfloat16 at `at` in every lane.
inline __m512i splat_pair(const bf16* at) {
  int32_t pair;
  std::memcpy(&pair, at, sizeof pair);
  return _mm512_set1_epi32(pair);
}
#endif

// Query vectors scored together against a key chunk: each key (or value) vector loaded is
// used by all of them, and their score and output accumulators (kQueryBlock x kKeyVectors,
// kQueryBlock x output_slice) make independent multiply-add chains. Sixteen accumulators fill
// half of AVX-512's registers; AVX2's sixteen take one query at a time.
constexpr int kQueryBlock = kLanes >= 16 ? 4 : 1;
constexpr int kAccumulators = 16;

// The largest divisor of nv (output vectors) that keeps qb x it accumulators within
// kAccumulators.
constexpr int output_slice(int nv, int qb) {
  int cb = std::min(nv, std::max(1, kAccumulators / qb));
  while (nv % cb != 0) --cb;
  return cb;
}

// A tile's queries and the current key chunk as chunk_update reads them: fp32 (q, kt, vt), or
// bfloat16 pairs with bf16_dots (q16, kt16, vt16).
struct Staged {
  const float* q;
  const float* kt;
  const float* vt;
  const bf16* q16;
  const bf16* kt16;
  const bf16* vt16;
};

// Key vectors of the chunk at k0 (n keys) a query at q_pos sees at all (0: the chunk is wholly
// in its future, or wholly older than its window).
inline int live_vectors(const PrefillArgs& a, int64_t q_pos, int64_t k0, int64_t n) {
  if (k0 > q_pos) return 0;
  if (a.window > 0 && k0 + n - 1 <= q_pos - a.window) return 0;
  return int(std::min<int64_t>(kKeyVectors, (q_pos - k0) / kLanes + 1));
}

// One query's softmax step over a key chunk: its scores s (the first `live` vectors scored,
// the rest ignored) soft-capped, masked to the keys at or before q_pos (and within the window),
// the running maximum and sum updated; the weights go to p (Dots: rounded, to p16 as well).
// Returns the factor the query's accumulated output takes for the new maximum.
template <bool Dots>
inline float chunk_weights(const PrefillArgs& a, vfloat (&s)[kKeyVectors], int live,
                           int64_t q_pos, int64_t k0, float& run_max, float& run_sum, float* p,
                           bf16* p16) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  if (a.softcap > 0.0f) {
    for (int v = 0; v < live; ++v) {
      alignas(64) float lanes[kLanes];
      store(lanes, s[v]);
      for (int l = 0; l < kLanes; ++l) lanes[l] = std::tanh(lanes[l] / a.softcap) * a.softcap;
      s[v] = load(lanes);
    }
  }
  const vint lane = lane_indices();
  const int32_t oldest = a.window > 0 ? int32_t(q_pos - a.window) : -1;
  vfloat chunk_max = splat(neg_inf);
  for (int v = 0; v < kKeyVectors; ++v) {
    const vint key = lane + int32_t(k0 + v * kLanes);
    const vint visible = (key <= int32_t(q_pos)) & (key > oldest);
    s[v] = v < live ? (visible ? s[v] : splat(neg_inf)) : splat(neg_inf);
    chunk_max = s[v] > chunk_max ? s[v] : chunk_max;
  }
  const float new_max = std::max(run_max, hmax(chunk_max));
  const float correction = exp_nonpositive(run_max - new_max);
  vfloat total = vfloat{};
  for (int v = 0; v < kKeyVectors; ++v) {
    const vfloat e = exp_nonpositive(s[v] - new_max);
    store(p + v * kLanes, e);
    if constexpr (Dots) store(p16 + v * kLanes, e);
    total += e;
  }
  run_sum = run_sum * correction + hsum(total);
  run_max = new_max;
  return correction;
}

// One key chunk's online-softmax update for QB query vectors qv0 .. qv0 + QB - 1 of a tile,
// each of which sees live[i] > 0 of the chunk's key vectors. A query's arithmetic (its
// multiply-add order over head dims and keys) is the same whatever QB, so blocking changes no
// bit of the output. Dots: the products in bfloat16 pairs (bf16_dots).
template <int QB, int kHeadDim, bool Dots>
inline void chunk_update(const PrefillArgs& a, const Staged& in, vfloat* acc, float* run_max,
                         float* run_sum, int64_t qv0, int64_t group, int64_t first_pos,
                         int64_t k0, int64_t n, const int* live, int live_max) {
  constexpr int NV = kHeadDim / kLanes;
  vfloat s[QB][kKeyVectors] = {};
  if constexpr (Dots) {
#if LLMSERVE_BF16_DOTS
    for (int d = 0; d < kHeadDim / 2; ++d) {  // dims 2d, 2d + 1
      for (int i = 0; i < QB; ++i) {
        const __m512i qd = splat_pair(in.q16 + (qv0 + i) * kHeadDim + 2 * d);
        for (int v = 0; v < kKeyVectors; ++v) {
          if (v < live_max)
            s[i][v] = dot_pairs(s[i][v], qd, in.kt16 + 2 * (d * kKeyChunk + v * kLanes));
        }
      }
    }
#endif
  } else if (live_max == kKeyVectors) {
    for (int d = 0; d < kHeadDim; ++d) {
      vfloat k[kKeyVectors];
      for (int v = 0; v < kKeyVectors; ++v) k[v] = load(in.kt + d * kKeyChunk + v * kLanes);
      for (int i = 0; i < QB; ++i) {
        const vfloat qd = splat(in.q[(qv0 + i) * kHeadDim + d]);
        for (int v = 0; v < kKeyVectors; ++v) s[i][v] += qd * k[v];
      }
    }
  } else {
    for (int d = 0; d < kHeadDim; ++d) {
      for (int i = 0; i < QB; ++i) {
        const vfloat qd = splat(in.q[(qv0 + i) * kHeadDim + d]);
        for (int v = 0; v < kKeyVectors; ++v) {
          if (v < live_max) s[i][v] += qd * load(in.kt + d * kKeyChunk + v * kLanes);
        }
      }
    }
  }

  alignas(64) float p[QB][kKeyChunk];
  alignas(64) bf16 p16[QB][kKeyChunk];  // Dots: p rounded, the keys nobody sees 0
  float correction[QB];
  int64_t seen_min = n, seen_max = 0;
  int64_t seen[QB];
  for (int i = 0; i < QB; ++i) {
    const int64_t qv = qv0 + i;
    correction[i] = chunk_weights<Dots>(a, s[i], live[i], first_pos + qv / group, k0,
                                        run_max[qv], run_sum[qv], p[i], p16[i]);
    seen[i] = std::min<int64_t>(n, int64_t(live[i]) * kLanes);
    seen_min = std::min(seen_min, seen[i]);
    seen_max = std::max(seen_max, seen[i]);
  }

  // Outputs in slices of CB vectors: the keys all queries see together, then each query's
  // own last keys (the causal diagonal), in key order either way. Dots: every query over the
  // pairs of keys any of them sees (a key a query does not see has weight 0 for it).
  constexpr int CB = output_slice(NV, QB);
  for (int c0 = 0; c0 < NV; c0 += CB) {
    vfloat o[QB][CB];
    for (int i = 0; i < QB; ++i) {
      for (int c = 0; c < CB; ++c) o[i][c] = acc[(qv0 + i) * NV + c0 + c] * correction[i];
    }
    if constexpr (Dots) {
#if LLMSERVE_BF16_DOTS
      for (int64_t j = 0; j < seen_max; j += 2) {
        for (int i = 0; i < QB; ++i) {
          const __m512i pj = splat_pair(p16[i] + j);
          for (int c = 0; c < CB; ++c)
            o[i][c] = dot_pairs(o[i][c], pj, in.vt16 + j * kHeadDim + 2 * (c0 + c) * kLanes);
        }
      }
#endif
    } else {
      for (int64_t j = 0; j < seen_min; ++j) {
        vfloat v[CB];
        for (int c = 0; c < CB; ++c) v[c] = load(in.vt + j * kHeadDim + (c0 + c) * kLanes);
        for (int i = 0; i < QB; ++i) {
          const vfloat pj = splat(p[i][j]);
          for (int c = 0; c < CB; ++c) o[i][c] += pj * v[c];
        }
      }
      for (int i = 0; i < QB; ++i) {
        for (int64_t j = seen_min; j < seen[i]; ++j) {
          const vfloat pj = splat(p[i][j]);
          for (int c = 0; c < CB; ++c) o[i][c] += pj * load(in.vt + j * kHeadDim + (c0 + c) * kLanes);
        }
      }
    }
    for (int i = 0; i < QB; ++i) {
      for (int c = 0; c < CB; ++c) acc[(qv0 + i) * NV + c0 + c] = o[i][c];
    }
  }
}

}  // namespace llmserve::prefill
