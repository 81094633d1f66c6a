// Weights kept in GGUF blocks (issue #27): what fast mode's kernels share (quant_fast.cpp, the
// 32-weight types; quant_chunked.h, Q5_0 and the k-quants): the 8-bit activation block and
// the integer dot product of a block of weight quants with it.

#pragma once

#include <cstdint>

#include <immintrin.h>

#include "quant.h"

namespace llmserve::quant {

struct ActBlock {  // d and s adjacent: block_scales reads them as a pair
  float d;  // scale: x ~ d * q
  float s;  // d * sum(q)
  int8_t q[kBlock];
};

#if defined(__AVX2__) && defined(__F16C__)
// sum_j w[j] * a[j] over a block, in 8 int32 lanes.
template <int Type>
inline __m256i block_dot(__m256i w, const int8_t* a) {
  __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a));
  if constexpr (Type == kQ8_0) {  // signed x signed: |w| times x with w's sign
    x = _mm256_sign_epi8(x, w);
    w = _mm256_sign_epi8(w, w);
  }
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  // Each lane's four byte products and their sum in one instruction: the same integers as
  // the two below, which cannot saturate here.
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), w, x);
#else
  const __m256i pairs = _mm256_maddubs_epi16(w, x);  // |products| <= 2 * 128 * 127: no saturation
  return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
#endif
}

inline float hsum(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}
#endif

}  // namespace llmserve::quant
