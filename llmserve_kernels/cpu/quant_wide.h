// Fast mode's interleaved dots on 512-bit registers (issue #52): two groups of eight rows side
// by side, so that one `vpdpbusd` advances sixteen rows' dots and one multiply-add scales them.
// Each group's quant registers are block_registers' (quant_interleaved.h), its in the low
// half of the register and the next group's in the high half; every lane's integers and its
// float operations, in order, are group_dots' (quant_interleaved.cpp), so the outputs are the
// 256-bit kernel's bit for bit. For the 32-weight types on CPUs with AVX-512 VNNI.

#pragma once

#include <cstdint>
#include <cstring>

#include <immintrin.h>

#include "quant.h"
#include "quant_fast.h"
#include "quant_interleaved.h"

namespace llmserve::quant {

// Activation rows from which a call takes the wide kernel. Under them the call is bound by its
// weights' bytes, and the down projection's few long rows measured slower in pairs. Q8_0, whose
// quants need no unpacking, saves only scaling and measured faster in pairs from 32 rows
// (bench/RESULTS.md, "Q8_0 in pairs from 32 rows").
constexpr int64_t wide_rows(int type) { return type == kQ8_0 ? 32 : 8; }

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && \
    defined(__AVX512VL__) && defined(__F16C__)
#define LLMSERVE_WIDE_GROUPS 1

// Whether a type's dots take the wide kernel: the 32-weight types, whose unpacking (Q8_0:
// none) and scaling it halves; the k-quants keep theirs (bench/RESULTS.md, "Two groups on
// 512-bit registers").
constexpr bool wide_type(int type) {
  return type == kQ4_0 || type == kQ4_1 || type == kQ5_0 || type == kQ8_0;
}

inline __m512i join(__m256i low, __m256i high) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(low), high, 1);
}

inline __m512 join(__m256 low, __m256 high) {
  return _mm512_insertf32x8(_mm512_castps256_ps512(low), high, 1);
}

inline __m256 scales8(const uint8_t* at) {  // eight fp16 at `at`
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(at)));
}

// out[m * stride + r] = the fast-mode dot of row r of the groups at `group` and at
// `group + group_bytes` (rows 8 .. 15) with activation rows a[m * blocks ...], for r < 16 and
// m < M. Q8_0: the activation quants biased to unsigned (bias_to_unsigned), as group_dots takes
// them with VNNI.
template <int Type, int M>
inline void pair_dots(const uint8_t* group, int64_t group_bytes, int64_t blocks,
                      const ActBlock* a, float* out, int64_t stride, const uint8_t* end) {
  constexpr int kChunks = 8;
  const int64_t bytes = kInterleaveRows * block_bytes(Type);
  __m512 acc[M];
  for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* low = group + b * bytes;
    const uint8_t* high = low + group_bytes;
    prefetch_ahead_of(low, bytes, end);  // end: nullptr where another call prefetched
    prefetch_ahead_of(high, bytes, end);
    const __m512 d_w = join(scales8(low), scales8(high));
    __m512 o_w = _mm512_setzero_ps();  // as group_dots' o_w
    if constexpr (Type == kQ4_1) o_w = join(scales8(low + 16), scales8(high + 16));
    if constexpr (zero_point(Type) != 0.0f)
      o_w = _mm512_mul_ps(d_w, _mm512_set1_ps(-zero_point(Type)));
    __m512i w[kChunks];
    {
      __m256i w_low[kChunks], w_high[kChunks];
      block_registers<Type>(low, w_low);
      block_registers<Type>(high, w_high);
      for (int j = 0; j < kChunks; ++j) w[j] = join(w_low[j], w_high[j]);
    }
    __m512i bias = _mm512_setzero_si512();  // Q8_0: 128 times each row's weight sum
    if constexpr (Type == kQ8_0) {
      __m512i half = _mm512_setzero_si512();
      for (int j = 0; j < kChunks; j += 2) {
        bias = _mm512_dpbusd_epi32(bias, _mm512_set1_epi8(char(0x80)), w[j]);
        half = _mm512_dpbusd_epi32(half, _mm512_set1_epi8(char(0x80)), w[j + 1]);
      }
      bias = _mm512_add_epi32(bias, half);
    }
    __m512i sum[M];
    for (int m = 0; m < M; ++m) sum[m] = _mm512_setzero_si512();
    for (int j = 0; j < kChunks; ++j)
      for (int m = 0; m < M; ++m) {
        int32_t four;  // row m's activation quants 4j .. 4j + 3, in every lane
        std::memcpy(&four, a[m * blocks + b].q + 4 * j, sizeof four);
        const __m512i x = _mm512_set1_epi32(four);
        if constexpr (Type == kQ8_0)  // (x + 128) times w: less the bias below
          sum[m] = _mm512_dpbusd_epi32(sum[m], x, w[j]);
        else
          sum[m] = _mm512_dpbusd_epi32(sum[m], w[j], x);
      }
    for (int m = 0; m < M; ++m) {
      const ActBlock& x = a[m * blocks + b];
      if constexpr (Type == kQ8_0) sum[m] = _mm512_sub_epi32(sum[m], bias);
      acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[m]),
                               _mm512_mul_ps(d_w, _mm512_set1_ps(x.d)), acc[m]);
      if constexpr (Type != kQ8_0) acc[m] = _mm512_fmadd_ps(o_w, _mm512_set1_ps(x.s), acc[m]);
    }
  }
  for (int m = 0; m < M; ++m) _mm512_storeu_ps(out + m * stride, acc[m]);
}
#else
#define LLMSERVE_WIDE_GROUPS 0
constexpr bool wide_type(int) { return false; }
#endif

}  // namespace llmserve::quant
