// Weights kept in GGUF blocks (issue #27): what fast mode's kernels share (quant_fast.cpp, the
// 32-weight types; quant_chunked.h, Q5_0 and the k-quants): the 8-bit activation block and
// the integer dot product of a block of weight quants with it.

#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include <immintrin.h>

#include "pool.h"
#include "quant.h"

namespace llmserve::quant {

struct ActBlock {  // d and s adjacent: block_scales reads them as a pair
  float d;  // scale: x ~ d * q
  float s;  // d * sum(q)
  int8_t q[kBlock];
};

// max |v[j]| over a block of 32; a NaN is passed over, as std::max(amax, |v|) does.
inline float block_amax(const float* v) {
#if defined(__AVX2__)
  // max_ps returns its second operand when either is NaN: the running maxima stay NaN-free.
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 m = _mm256_setzero_ps();
  for (int j = 0; j < kBlock; j += 8)
    m = _mm256_max_ps(_mm256_and_ps(_mm256_loadu_ps(v + j), magnitude), m);
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
#else
  float amax = 0.0f;
  for (int j = 0; j < kBlock; ++j) amax = std::max(amax, std::fabs(v[j]));
  return amax;
#endif
}

// Row x[0..cols) into cols / 32 ActBlocks (quant_fast.cpp's file comment says how).
inline void quantize_activations(const float* x, int64_t cols, ActBlock* out) {
  for (int64_t b = 0; b < cols / kBlock; ++b) {
    const float* v = x + b * kBlock;
    ActBlock& block = out[b];
    const float amax = block_amax(v);
    const float d = amax / 127.0f;
    const float inverse = d != 0.0f ? 1.0f / d : 0.0f;
    int sum = 0;
    for (int j = 0; j < kBlock; ++j) {
      const int q = int(std::nearbyint(v[j] * inverse));  // the default mode: half to even
      block.q[j] = int8_t(q);
      sum += q;
    }
    block.d = d;
    block.s = d * float(sum);
  }
}

// The n rows of x [n, in] quantized (n * in / 32 blocks), in this thread's buffer: valid until
// its next call on this thread. Many rows (a prompt) are quantized on the pool's threads.
inline ActBlock* quantize_rows(const float* x, int64_t n, int64_t in) {
  thread_local std::vector<ActBlock> activations;
  const int64_t blocks = in / kBlock;
  activations.resize(size_t(n * blocks));
  ActBlock* a = activations.data();
  parallel_for(n, n * in >= kParallelElements, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) quantize_activations(x + i * in, in, a + i * blocks);
  });
  return a;
}

#if defined(__AVX2__) && defined(__F16C__)
// sum + the four-byte dot in each lane of w (unsigned) and x (signed).
inline __m256i dot4(__m256i sum, __m256i w, __m256i x) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  // Each lane's four byte products and their sum in one instruction: the same integers as
  // the two below, which cannot saturate here.
  return _mm256_dpbusd_epi32(sum, w, x);
#else
  const __m256i pairs = _mm256_maddubs_epi16(w, x);  // |products| <= 2 * 128 * 127: no saturation
  return _mm256_add_epi32(sum, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
#endif
}

// How many `vpmaddubsw` results may add up in 16 bits: each lane is a pair of products of an
// unsigned quant (at most max_quant) and an activation quant (magnitude at most 127).
constexpr int pairs_in_int16(int max_quant) { return 32767 / (2 * max_quant * 127); }

// sum[m] += the four-byte dots of w[j] (unsigned, at most MaxQuant) with x(m, j) (signed), over
// j < Count and m < M: the same integers as dot4's. With VNNI the rows' `vpdpbusd` chains go
// side by side (each waits on its sum). Without it the 16-bit pair sums of up to
// pairs_in_int16(MaxQuant) registers add up before one widening `vpmaddwd` (fewer multiplies:
// bench/RESULTS.md, "16-bit pair sums on AVX2").
template <int M, int Count, int MaxQuant, typename X>
inline void row_dots(__m256i (&sum)[M], const __m256i* w, X&& x) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  for (int j = 0; j < Count; ++j)
    for (int m = 0; m < M; ++m) sum[m] = _mm256_dpbusd_epi32(sum[m], w[j], x(m, j));
#else
  constexpr int kRun = std::min(Count, pairs_in_int16(MaxQuant));
  static_assert(kRun >= 1 && Count % kRun == 0);
  if constexpr (kRun == 1) {  // Q8_0: each pair sum widened at once
    for (int j = 0; j < Count; ++j)
      for (int m = 0; m < M; ++m) sum[m] = dot4(sum[m], w[j], x(m, j));
    return;
  }
  // One row after another: the chains are one add deep per register, and the rows' products
  // need not all be live at once.
  for (int m = 0; m < M; ++m) {
    for (int j = 0; j < Count; j += kRun) {
      __m256i pairs = _mm256_maddubs_epi16(w[j], x(m, j));
      for (int t = 1; t < kRun; ++t)
        pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(w[j + t], x(m, j + t)));
      sum[m] = _mm256_add_epi32(sum[m], _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
    }
  }
#endif
}

// sum_j w[j] * a[j] over a block, in 8 int32 lanes.
template <int Type>
inline __m256i block_dot(__m256i w, const int8_t* a) {
  __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a));
  if constexpr (Type == kQ8_0) {  // signed x signed: |w| times x with w's sign
    x = _mm256_sign_epi8(x, w);
    w = _mm256_sign_epi8(w, w);
  }
  return dot4(_mm256_setzero_si256(), w, x);
}

inline float hsum(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}
#endif

}  // namespace llmserve::quant
