// Weights kept in GGUF blocks (issue #27): the linear layer's fast mode (exact mode and the
// layouts: quant.cpp; what both share: quant.h).
//
// Fast mode: each activation row is first quantized per block of 32 to 8 bits, as
//   ActBlock: float d = max|x| / 127, q = round_half_even(x * (1 / d)), float s = d * sum(q),
// and a weight block's dot with it is an integer dot product of the 32 pairs of quants
// (AVX2: `vpmaddubsw` multiplies unsigned by signed bytes and adds pairs to 16 bits, then
// `vpmaddwd` adds pairs to 32 bits; with AVX512-VNNI one `vpdpbusd` does both, to the same
// integers: quant_fast.h's block_dot) and one float multiply-add per block:
//   Q4_0: d_w * d * sum(q_w q) - 8 * d_w * s     (w = d_w * (q_w - 8))
//   Q4_1: d_w * d * sum(q_w q) + m_w * s         (w = d_w * q_w + m_w)
//   Q5_0: d_w * d * sum(q_w q) - 16 * d_w * s    (w = d_w * (q_w - 16), q_w 5 bits)
//   Q8_0: d_w * d * sum(q_w q)
// The k-quants are read in chunks of 32 weights the same way (chunked_dots). So
// fast mode's error against exact mode is the activations' rounding to 8 bits (about 0.4% of
// a block's largest value per element). The 32-weight types are multiplied four weight rows at
// a time (four_row_dots), and an unpacked weight block serves four activation rows.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include <immintrin.h>

#include "pool.h"
#include "quant.h"
#include "quant_chunked.h"
#include "quant_fast.h"

namespace llmserve {
namespace {

using namespace llmserve::quant;

#if defined(__AVX2__) && defined(__F16C__)
// 32 weight quants of a block in weight order, as bytes: unsigned 0..15 for the 4-bit types
// (0..31 for Q5_0), signed for Q8_0.
template <int Type>
inline __m256i weight_quants(const uint8_t* block) {
  if constexpr (Type == kQ8_0) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 2));
  } else {
    // The 16 packed bytes in both halves; the high half shifted right by 4: low nibbles
    // (weights 0-15) below, high nibbles (16-31) above.
    const __m256i packed = _mm256_broadcastsi128_si256(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + quant_offset(Type))));
    const __m256i shifted = _mm256_srlv_epi32(packed, _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4));
    const __m256i low = _mm256_and_si256(shifted, _mm256_set1_epi8(0x0f));
    if constexpr (Type != kQ5_0) return low;
    // Q5_0's fifth bits: byte j of the 32 gets mask byte j / 8, and bit j % 8 of it is tested.
    uint32_t high;
    std::memcpy(&high, block + 2, sizeof high);
    const __m256i spread = _mm256_shuffle_epi8(
        _mm256_set1_epi32(int(high)),
        _mm256_setr_epi64x(0, 0x0101010101010101, 0x0202020202020202, 0x0303030303030303));
    const __m256i bit = _mm256_set1_epi64x(int64_t(0x8040201008040201));
    const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
    return _mm256_or_si256(low, _mm256_and_si256(set, _mm256_set1_epi8(0x10)));
  }
}

// A block's scale and offset times an activation block's, in two lanes of one multiply:
// [d_w * d, o_w * s] with o_w Q4_1's m_w, Q4_0's -8 * d_w, Q5_0's -16 * d_w, Q8_0's 0 (its
// lane unused).
template <int Type>
inline __m128 block_scales(const uint8_t* block, const float* d_and_s) {
  __m128 w;
  if constexpr (Type == kQ4_1) {  // fp16 d, m: both converted at once
    int32_t dm;
    std::memcpy(&dm, block, sizeof dm);
    w = _mm_cvtph_ps(_mm_cvtsi32_si128(dm));
  } else {
    uint16_t h;
    std::memcpy(&h, block, sizeof h);
    w = _mm_cvtph_ps(_mm_cvtsi32_si128(h));  // [d_w, 0, 0, 0]
    if constexpr (zero_point(Type) != 0.0f)  // [d_w, -z * d_w, 0, 0]
      w = _mm_mul_ps(_mm_shuffle_ps(w, w, 0), _mm_setr_ps(1.0f, -zero_point(Type), 0.0f, 0.0f));
  }
  double pair;
  std::memcpy(&pair, d_and_s, sizeof pair);
  return _mm_mul_ps(w, _mm_castpd_ps(_mm_set_sd(pair)));
}

#endif

// out[m * stride] = the fast-mode dot of weight row `row` (`blocks` blocks) with activation
// rows a[m * blocks ...], for m < M.
template <int Type, int M>
inline void fast_dots(const uint8_t* row, int64_t blocks, const ActBlock* a, float* out,
                      int64_t stride) {
  const int64_t bytes = block_bytes(Type);
#if defined(__AVX2__) && defined(__F16C__)
  // kChains independent sums per row (blocks taken in turn): one chain of dependent
  // multiply-adds per row would wait on its own latency. The same for every M, so a token's
  // dot does not depend on how many tokens share the call.
  constexpr int kChains = 2;
  __m256 acc[kChains][M];
  __m128 offset[kChains][M];  // lane 1: the sum of the per-block terms in s (block_scales)
  for (int c = 0; c < kChains; ++c)
    for (int m = 0; m < M; ++m) {
      acc[c][m] = _mm256_setzero_ps();
      offset[c][m] = _mm_setzero_ps();
    }
  auto step = [&](int64_t b, int c) {
    const uint8_t* block = row + b * bytes;
    const __m256i w = weight_quants<Type>(block);
    for (int m = 0; m < M; ++m) {
      const ActBlock& x = a[m * blocks + b];
      const __m128 scales = block_scales<Type>(block, &x.d);  // [d_w * d, o_w * s]
      const __m256 sum = _mm256_cvtepi32_ps(block_dot<Type>(w, x.q));
      acc[c][m] = _mm256_fmadd_ps(sum, _mm256_broadcastss_ps(scales), acc[c][m]);
      if constexpr (Type != kQ8_0) offset[c][m] = _mm_add_ps(offset[c][m], scales);
    }
  };
  int64_t b = 0;
  for (; b + kChains <= blocks; b += kChains)
    for (int c = 0; c < kChains; ++c) step(b + c, c);
  for (; b < blocks; ++b) step(b, 0);
  for (int m = 0; m < M; ++m) {
    __m256 total = acc[0][m];
    __m128 off = offset[0][m];
    for (int c = 1; c < kChains; ++c) {
      total = _mm256_add_ps(total, acc[c][m]);
      off = _mm_add_ps(off, offset[c][m]);
    }
    out[m * stride] = hsum(total) + (Type == kQ8_0 ? 0.0f : _mm_cvtss_f32(_mm_movehdup_ps(off)));
  }
#else
  float acc[M] = {}, offset[M] = {};
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* block = row + b * bytes;
    const float d = half_to_float(block);
    const float m_w = Type == kQ4_1 ? half_to_float(block + 2) : -zero_point(Type) * d;
    int w[kBlock];
    if constexpr (Type == kQ8_0) {
      for (int j = 0; j < kBlock; ++j) w[j] = reinterpret_cast<const int8_t*>(block + 2)[j];
    } else {
      const uint8_t* q = block + quant_offset(Type);
      for (int j = 0; j < kBlock / 2; ++j) {
        w[j] = q[j] & 0x0f;
        w[j + kBlock / 2] = q[j] >> 4;
      }
      if constexpr (Type == kQ5_0) {
        uint32_t high;
        std::memcpy(&high, block + 2, sizeof high);
        for (int j = 0; j < kBlock; ++j) w[j] |= int((high >> j) & 1u) << 4;
      }
    }
    for (int m = 0; m < M; ++m) {
      const ActBlock& x = a[m * blocks + b];
      int sum = 0;
      for (int j = 0; j < kBlock; ++j) sum += w[j] * x.q[j];
      acc[m] += float(sum) * (d * x.d);
      if constexpr (Type != kQ8_0) offset[m] += m_w * x.s;
    }
  }
  for (int m = 0; m < M; ++m) out[m * stride] = acc[m] + offset[m];
#endif
}


#if defined(__AVX2__) && defined(__F16C__)
// The fp16 at byte offset `at` of four rows `stride` bytes apart, as floats.
inline __m128 four_halves(const uint8_t* row, int64_t stride, int64_t at) {
  uint16_t h[4];
  for (int r = 0; r < 4; ++r) std::memcpy(&h[r], row + r * stride + at, sizeof h[r]);
  return _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(h)));
}

// fast_dots of four consecutive weight rows at once (32-weight types): per block and activation
// row, the four rows' integer dots are summed across their lanes together (three `vphaddd`)
// and scaled by one multiply-add of four lanes, where fast_dots spends a conversion, a scale
// and a multiply-add on each row. out[m * stride + r] for weight row r < 4, m < M.
template <int Type, int M>
inline void four_row_dots(const uint8_t* row, int64_t row_bytes, int64_t blocks,
                          const ActBlock* a, float* out, int64_t stride) {
  const int64_t bytes = block_bytes(Type);
  __m128 acc[M];
  for (int m = 0; m < M; ++m) acc[m] = _mm_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* block = row + b * bytes;
    __m256i w[4];
    for (int r = 0; r < 4; ++r) w[r] = weight_quants<Type>(block + r * row_bytes);
    const __m128 d_w = four_halves(block, row_bytes, 0);
    __m128 o_w = _mm_setzero_ps();  // what multiplies s: Q4_1's m_w, Q4_0's and Q5_0's -z * d_w
    if constexpr (Type == kQ4_1) o_w = four_halves(block, row_bytes, 2);
    if constexpr (zero_point(Type) != 0.0f) o_w = _mm_mul_ps(d_w, _mm_set1_ps(-zero_point(Type)));
    for (int m = 0; m < M; ++m) {
      const ActBlock& x = a[m * blocks + b];
      __m256i p[4];
      for (int r = 0; r < 4; ++r) p[r] = block_dot<Type>(w[r], x.q);
      const __m256i sums = _mm256_hadd_epi32(_mm256_hadd_epi32(p[0], p[1]),
                                             _mm256_hadd_epi32(p[2], p[3]));
      const __m128i total =  // row r's dot in lane r
          _mm_add_epi32(_mm256_castsi256_si128(sums), _mm256_extracti128_si256(sums, 1));
      acc[m] = _mm_fmadd_ps(_mm_cvtepi32_ps(total), _mm_mul_ps(d_w, _mm_set1_ps(x.d)), acc[m]);
      if constexpr (Type != kQ8_0) acc[m] = _mm_fmadd_ps(o_w, _mm_set1_ps(x.s), acc[m]);
    }
  }
  for (int m = 0; m < M; ++m) _mm_storeu_ps(out + m * stride, acc[m]);
}
#endif

// The dots of weight row `row` with M activation rows: chunked for the k-quants.
template <int Type, int M>
inline void row_dots(const uint8_t* row, int64_t in, const ActBlock* a, float* out,
                     int64_t stride) {
  if constexpr (!is_k_quant(Type))
    fast_dots<Type, M>(row, in / kBlock, a, out, stride);
  else
    chunked_dots<Type, M>(row, in / block_weights(Type), a, out, stride);
}

constexpr int kFastRows = 4;  // activation rows that share an unpacked weight block

template <int Type>
void linear_fast(const float* x, int64_t n, int64_t in, const uint8_t* w, int64_t out_features,
                 float* out) {
  const int64_t blocks = in / kBlock, row_bytes = in / block_weights(Type) * block_bytes(Type);
  const ActBlock* a = quantize_rows(x, n, in);
  // Threads split the rows at multiples of 4, so which rows four_row_dots takes (and which
  // fast_dots: the last out_features % 4) depends on the weight alone, not on n or on the
  // threads: a token's output is the same whatever it is batched with.
  const int64_t tiles = (out_features + 3) / 4;
  parallel_for(tiles, out_features * n * in > (1 << 16), [&](int64_t tile_begin, int64_t tile_end) {
    const int64_t begin = 4 * tile_begin, end = std::min(out_features, 4 * tile_end);
    int64_t o = begin;
#if defined(__AVX2__) && defined(__F16C__)
    if constexpr (!is_k_quant(Type)) {
      for (; o + 4 <= end; o += 4) {
        const uint8_t* row = w + o * row_bytes;
        for (int r = 0; r < 4; ++r)
          prefetch_ahead(row + r * row_bytes, row_bytes, w + out_features * row_bytes);
        int64_t i = 0;
        for (; i + kFastRows <= n; i += kFastRows)
          four_row_dots<Type, kFastRows>(row, row_bytes, blocks, a + i * blocks,
                                         out + i * out_features + o, out_features);
        for (; i < n; ++i)
          four_row_dots<Type, 1>(row, row_bytes, blocks, a + i * blocks,
                                 out + i * out_features + o, out_features);
      }
    }
#endif
    for (; o < end; ++o) {
      const uint8_t* row = w + o * row_bytes;
      prefetch_ahead(row, row_bytes, w + out_features * row_bytes);
      int64_t i = 0;
      for (; i + kFastRows <= n; i += kFastRows)
        row_dots<Type, kFastRows>(row, in, a + i * blocks, out + i * out_features + o,
                                  out_features);
      for (; i < n; ++i)
        row_dots<Type, 1>(row, in, a + i * blocks, out + i * out_features + o, out_features);
    }
  });
}

}  // namespace
}  // namespace llmserve

using namespace llmserve;
using namespace llmserve::quant;

extern "C" {

// out [n, out_features] = x [n, in] @ dequantize(weights)^T in fast mode: x quantized to 8
// bits per block of 32, integer dot products. `in` is a multiple of the type's block; a type
// with kInterleaved set reads interleaved weights (quant_interleaved.cpp). Returns -1 for an
// unknown type.
int llmserve_quant_linear_fast(int type, const float* x, int64_t n, int64_t in,
                               const uint8_t* weights, int64_t out_features, float* out) {
  if (type & kInterleaved)
    return llmserve_quant_linear_interleaved(type & ~kInterleaved, x, n, in, weights,
                                             out_features, out);
  if (block_bytes(type) == 0 || in % block_weights(type) != 0) return -1;
  return dispatch(type, [&]<int Type>() { linear_fast<Type>(x, n, in, weights, out_features, out); });
}

// x [n, cols] -> [n, cols / 32] blocks of 40 bytes: float d, float d * sum(q), 32 int8 q,
// fast mode's quantized activations (for tests).
int llmserve_quant_activations(const float* x, int64_t n, int64_t cols, uint8_t* out) {
  static_assert(sizeof(ActBlock) == 40);
  if (cols % kBlock != 0) return -1;
  for (int64_t i = 0; i < n; ++i)
    quantize_activations(x + i * cols, cols, reinterpret_cast<ActBlock*>(out) + i * (cols / kBlock));
  return 0;
}

}  // extern "C"
