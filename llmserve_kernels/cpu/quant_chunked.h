// Weights kept in GGUF blocks (issue #27): fast mode for the k-quants (quant_fast.cpp has the
// 32-weight types and the layer; quant.cpp the layouts).
//
// A k-quant's block of 256 weights is read as chunks of 32 weights, each matched with one
// activation block (quant_fast.h's ActBlock):
//   quants: the chunk's 32 weight quants as bytes, unsigned 0..31 (Q4_K, Q5_K) or signed
//           q - 32 (Q6_K: its integer dot is taken as Q8_0's);
//   scale:  what multiplies the integer dot of weights 0-15 and of 16-31 (the same for all
//           but Q6_K, whose scales cover 16 weights) before the activation scale d;
//   offset: what multiplies the activation block's s: -dmin * m_j (Q6_K: 0).
// So the chunk's dot is  d * sum_h scale[h] * sum(q_w q over half h) + offset * s, the product
// of the dequantized weights with the rounded activations up to summation order.

#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include <immintrin.h>

#include "quant.h"
#include "quant_fast.h"

namespace llmserve::quant {

template <int Type>
constexpr int kChunks = kSuperBlock / kBlock;

template <int Type>
inline void chunk_scales(const uint8_t* block, float (*scale)[2], float* offset) {
  if constexpr (Type == kQ6_K) {
    const int8_t* scales = reinterpret_cast<const int8_t*>(block + 192);
    const float d = half_to_float(block + 208);
    for (int c = 0; c < kChunks<Type>; ++c) {
      scale[c][0] = d * float(scales[2 * c]);
      scale[c][1] = d * float(scales[2 * c + 1]);
      offset[c] = 0.0f;
    }
  } else {  // Q4_K, Q5_K
    const float d = half_to_float(block), dmin = half_to_float(block + 2);
    for (int c = 0; c < kChunks<Type>; ++c) {
      int sc, m;
      k_scale_min(block + 4, c, sc, m);
      scale[c][0] = scale[c][1] = d * float(sc);
      offset[c] = -dmin * float(m);
    }
  }
}

#if defined(__AVX2__) && defined(__F16C__)
inline __m256i shift_right_16(__m256i v, int bits) {
  return _mm256_srl_epi16(v, _mm_cvtsi32_si128(bits));
}

// Chunk c's 32 weight quants (see above), in weight order.
template <int Type>
inline __m256i chunk_quants(const uint8_t* block, int c) {
  const __m256i nibbles = _mm256_set1_epi8(0x0f);
  if constexpr (Type == kQ6_K) {
    const int half = c / 4, s = c % 4;
    const __m256i low = _mm256_and_si256(
        shift_right_16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(
                           block + 64 * half + 32 * (s % 2))),
                       4 * (s / 2)),
        nibbles);
    const __m256i high = _mm256_and_si256(
        shift_right_16(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 128 + 32 * half)), 2 * s),
        _mm256_set1_epi8(0x03));
    return _mm256_sub_epi8(_mm256_or_si256(low, _mm256_slli_epi16(high, 4)),
                           _mm256_set1_epi8(32));
  } else {  // Q4_K, Q5_K: chunks 2p and 2p + 1 in the low and high nibbles of 32 bytes
    const uint8_t* q = block + (Type == kQ5_K ? 48 : 16) + 32 * (c / 2);
    __m256i v = _mm256_and_si256(
        shift_right_16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q)), 4 * (c % 2)),
        nibbles);
    if constexpr (Type == kQ5_K) {  // bit c of byte t: weight t's fifth bit
      const __m256i high = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 16));
      const __m256i bit = _mm256_and_si256(shift_right_16(high, c), _mm256_set1_epi8(1));
      v = _mm256_or_si256(v, _mm256_slli_epi16(bit, 4));
    }
    return v;
  }
}
#else
// Chunk c's 32 weight quants (see above), in weight order, as ints.
template <int Type>
inline void chunk_quants(const uint8_t* block, int c, int* w) {
  for (int t = 0; t < kBlock; ++t) {
    if constexpr (Type == kQ6_K) {
      const int half = c / 4, s = c % 4;
      const int low = (block[64 * half + 32 * (s % 2) + t] >> (4 * (s / 2))) & 0x0f;
      const int high = (block[128 + 32 * half + t] >> (2 * s)) & 0x03;
      w[t] = (low | high << 4) - 32;
    } else {
      const uint8_t* q = block + (Type == kQ5_K ? 48 : 16) + 32 * (c / 2);
      w[t] = (q[t] >> (4 * (c % 2))) & 0x0f;
      if constexpr (Type == kQ5_K) w[t] |= ((block[16 + t] >> c) & 1) << 4;
    }
  }
}
#endif

// The integer dots of a chunk's weight quants with an activation block, over weights 0-15 and
// 16-31.
#if defined(__AVX2__) && defined(__F16C__)
template <int Type>
inline void half_dots(__m256i w, const int8_t* x, int32_t* sums) {
  const __m256i lanes = Type == kQ6_K ? block_dot<kQ8_0>(w, x) : block_dot<kQ4_0>(w, x);
  __m128i low = _mm256_castsi256_si128(lanes), high = _mm256_extracti128_si256(lanes, 1);
  const __m128i pairs = _mm_hadd_epi32(low, high);  // [l0+l1, l2+l3, h0+h1, h2+h3]
  const __m128i both = _mm_hadd_epi32(pairs, pairs);
  sums[0] = _mm_cvtsi128_si32(both);
  sums[1] = _mm_extract_epi32(both, 1);
}
#else
template <int Type>
inline void half_dots(const int* w, const int8_t* x, int32_t* sums) {
  sums[0] = sums[1] = 0;
  for (int t = 0; t < kBlock; ++t) sums[t / 16] += w[t] * x[t];
}
#endif

// fast_dots for a chunked type: `blocks` blocks of the type, a[m * chunks ...] their
// activation blocks (kChunks per block). Each output is one chain of fused multiply-adds, per
// chunk in order: Q6_K's two half dots times scale[h] * d, the others' dot times scale * d,
// then offset * s. quant_interleaved.cpp computes eight rows' chains in the lanes of a vector,
// to the same bits.
template <int Type, int M>
inline void chunked_dots(const uint8_t* row, int64_t blocks, const ActBlock* a, float* out,
                         int64_t stride) {
  constexpr int kPer = kChunks<Type>;
  const int64_t bytes = block_bytes(Type), chunks = blocks * kPer;
  float scale[kPer][2], offset[kPer];
  float acc[M] = {};
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* block = row + b * bytes;
    chunk_scales<Type>(block, scale, offset);
    for (int c = 0; c < kPer; ++c) {
#if defined(__AVX2__) && defined(__F16C__)
      const __m256i w = chunk_quants<Type>(block, c);
#else
      int w[kBlock];
      chunk_quants<Type>(block, c, w);
#endif
      for (int m = 0; m < M; ++m) {
        const ActBlock& x = a[m * chunks + b * kPer + c];
        int32_t sums[2];
        half_dots<Type>(w, x.q, sums);
        if constexpr (Type == kQ6_K) {
          acc[m] = std::fma(float(sums[0]), scale[c][0] * x.d, acc[m]);
          acc[m] = std::fma(float(sums[1]), scale[c][1] * x.d, acc[m]);
        } else {
          acc[m] = std::fma(float(sums[0] + sums[1]), scale[c][0] * x.d, acc[m]);
          acc[m] = std::fma(offset[c], x.s, acc[m]);
        }
      }
    }
  }
  for (int m = 0; m < M; ++m) out[m * stride] = acc[m];
}

}  // namespace llmserve::quant
