// Weights kept in GGUF blocks (issue #27): dequantization and the exact-mode linear layer
// (fast mode: quant_fast.cpp; what both share: quant.h).
//
// A block holds 32 consecutive weights of a row and its scale(s), as ggml lays them out
// (type codes are ggml's):
//   Q4_0 (2):  fp16 d, 16 bytes of 4-bit q (weights 0-15 in the low nibbles, 16-31 in the
//              high ones); w = d * (q - 8). 18 bytes.
//   Q4_1 (3):  fp16 d, fp16 m, the same 16 bytes; w = d * q + m. 20 bytes.
//   Q8_0 (8):  fp16 d, 32 int8 q; w = q * d. 34 bytes.
//   Q5_0 (6):  fp16 d, 4 bytes of fifth bits (bit j for weight j), 16 bytes of 4-bit q as
//              Q4_0's; w = d * (q - 16). 22 bytes.
// and the k-quants, super-blocks of 256 weights in sub-blocks with their own scales:
//   Q4_K (12): fp16 d, fp16 dmin, 12 bytes of 6-bit scales sc and mins m for 8 sub-blocks of
//              32, 128 bytes of 4-bit q (32 bytes per pair of sub-blocks: the first in the low
//              nibbles); w = (d * sc) * q - dmin * m. 144 bytes.
//   Q5_K (13): Q4_K's with 32 bytes of fifth bits before the q (bit j of byte t: sub-block
//              j, weight t). 176 bytes.
//   Q6_K (14): 128 bytes of low 4 bits, 64 of high 2 bits, 16 int8 scales of sub-blocks of
//              16, fp16 d; w = (d * scale) * (q - 32). 210 bytes.
// Each weight is computed with the same float32 operations, in the same order, as the gguf
// package's numpy dequantization (which is what transformers loads), so a dequantized weight
// is bit-identical to HF's. This file is built with -ffp-contract=off for that: a fused
// d * q + m would round once instead of twice.
//
// Exact mode: four rows of the weight at a time are dequantized into a float32 buffer on the
// stack (in L1 for rows of up to about a thousand weights) and dotted with every activation
// row, two or four activation rows at a time, so the output equals HF's dequantized float32
// matmul up to summation order (which is the same for every row of a batch: `dot_tile`).
// Steps of one or two tokens on AVX-512 dequantize the blocks in registers instead
// (`fused_tile`, `fused_k_tile`): the same weights and the same multiply-adds in the same order.
//

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include <immintrin.h>

#include "pool.h"
#include "quant.h"
#include "quant_dequant.h"
#include "vec.h"

namespace llmserve {
namespace {

using namespace llmserve::quant;

// a * b + c, fused (an explicit instruction: -ffp-contract=off does not split it).
inline vfloat fmadd(vfloat a, vfloat b, vfloat c) {
#if defined(__AVX512F__)
  return (vfloat)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif defined(__FMA__)
  return (vfloat)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
  return a * b + c;
#endif
}

// Weight rows dequantized together, and activation rows dotted with them together: 4 x 4
// accumulators where 32 vector registers hold them with the weights (AVX-512), 4 x 2 where 16
// do. Two accumulators per FMA unit and cycle of latency keep the units busy; more tokens
// per tile load each weight vector for more of them (on AVX-512, less time than 4 x 2 tiles
// for SmolLM2's Q4_1 and Q8_0 matrices: bench/RESULTS.md, "Speculative decoding, fifth round").
constexpr int kTileRows = 4;
#if defined(__AVX512F__)
constexpr int kTileTokens = 4;
#else
constexpr int kTileTokens = 2;
#endif

// acc[m][r] += x[m][0 .. kLanes) * wk[r] for M activation rows `in` floats apart.
template <int R, int M>
inline void multiply_add(vfloat (&acc)[M][R], const float* x, int64_t in, const vfloat (&wk)[R]) {
  for (int m = 0; m < M; ++m) {
    vfloat xk;
    std::memcpy(&xk, x + m * in, sizeof xk);
    for (int r = 0; r < R; ++r) acc[m][r] = fmadd(xk, wk[r], acc[m][r]);
  }
}

template <int R, int M>
inline void store_sums(const vfloat (&acc)[M][R], float* out, int64_t out_stride) {
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) out[m * out_stride + r] = hsum(acc[m][r]);
}

// out[m * out_stride + r] = sum_k x[m][k] * w[r][k] for R weight rows (stride `in`) and M
// activation rows (stride `in`), k < in (a multiple of kLanes). Each dot is one accumulator of
// kLanes lanes taking k in order, then hsum's fixed tree: the same operations for any R and M,
// so a token's output does not depend on the tokens batched with it (a draft row of a
// speculative step gives what the same token alone would). R * M accumulators keep the FMA
// units busy and load each weight vector once for M tokens (the earlier kernel took one
// token and one weight row at a time and summed the lanes one by one: on AVX-512 the
// reduction cost more than the multiply-adds).
template <int R, int M>
inline void dot_tile(const float* x, int64_t in, const float* w, float* out, int64_t out_stride) {
  vfloat acc[M][R] = {};
  for (int64_t k = 0; k < in; k += kLanes) {
    vfloat wk[R];
    for (int r = 0; r < R; ++r) std::memcpy(&wk[r], w + r * in + k, sizeof(vfloat));
    multiply_add(acc, x + k, in, wk);
  }
  store_sums(acc, out, out_stride);
}

// R dequantized weight rows (`w`, stride `in`) against all n tokens.
template <int R>
inline void rows_times_tokens(const float* x, int64_t n, int64_t in, const float* w, float* out,
                              int64_t out_features) {
  int64_t i = 0;
  for (; i + kTileTokens <= n; i += kTileTokens)
    dot_tile<R, kTileTokens>(x + i * in, in, w, out + i * out_features, out_features);
  if constexpr (kTileTokens > 2) {
    for (; i + 2 <= n; i += 2)
      dot_tile<R, 2>(x + i * in, in, w, out + i * out_features, out_features);
  }
  for (; i < n; ++i) dot_tile<R, 1>(x + i * in, in, w, out + i * out_features, out_features);
}

#if defined(__AVX512F__) && defined(__F16C__)
// A 32-weight block's weights in registers, dequantized by dequantize_block's (and
// dequantize_q5_0's) float operations: Q8_0's as float(q) * d; the 4- and 5-bit types' by
// looking their quants up (`vpermps`) in a table of the values they can take, computed with
// those operations (16 values: d * float(q - 8), or d * float(q) + m; Q5_0: 32), which costs
// fewer operations than converting and scaling every weight.
//
// block_table: the table (Q8_0: d in every lane); Q5_0's values for q >= 16 in `upper`.
template <int Type>
inline __m512 block_table(const uint8_t* block, __m512& upper) {
  const __m512 d = _mm512_set1_ps(half_to_float(block));
  const __m512i q = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  if constexpr (Type == kQ8_0) return d;
  if constexpr (Type == kQ4_1)  // d * q + m: two roundings
    return _mm512_add_ps(_mm512_mul_ps(d, _mm512_cvtepi32_ps(q)),
                         _mm512_set1_ps(half_to_float(block + 2)));
  const __m512i z = _mm512_set1_epi32(int(zero_point(Type)));  // d * (q - z)
  if constexpr (Type == kQ5_0)
    upper = _mm512_mul_ps(
        d, _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_add_epi32(q, _mm512_set1_epi32(16)), z)));
  return _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_sub_epi32(q, z)));
}

// Weights 16h .. 16h + 15 of the block, from its block_table.
template <int Type>
inline vfloat block_half(const uint8_t* block, int h, __m512 table, __m512 upper) {
  if constexpr (Type == kQ8_0) {
    const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 2 + 16 * h));
    return vfloat(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)), table));
  } else {
    // Indices: the nibbles, widened; vpermps reads the low 4 bits of each.
    const __m128i packed =
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + quant_offset(Type)));
    const __m512i index = _mm512_cvtepu8_epi32(h == 0 ? packed : _mm_srli_epi16(packed, 4));
    const __m512 low = _mm512_permutexvar_ps(index, table);
    if constexpr (Type != kQ5_0) return vfloat(low);
    // Q5_0: weight t's fifth bit (bit 16h + t) picks the upper table.
    uint32_t high;
    std::memcpy(&high, block + 2, sizeof high);
    return vfloat(_mm512_mask_permutexvar_ps(low, __mmask16(high >> (16 * h)), index, upper));
  }
}

// dot_tile for R weight rows still in their blocks (`row_bytes` apart) and M activation rows:
// each block's weights dequantized in registers, then the same multiply-adds in the same
// order into the same accumulators, so the same bits as dequantizing the rows first. For the
// few-token steps (a single stream's decode), where dequantizing into a buffer and reading it
// back cost more than the multiply-adds.
template <int Type, int R, int M>
inline void fused_tile(const float* x, int64_t in, const uint8_t* w, int64_t row_bytes,
                       float* out, int64_t out_stride, const uint8_t* end) {
  static_assert(kLanes == 16 && !is_k_quant(Type));
  vfloat acc[M][R] = {};
  for (int64_t b = 0; b < in / kBlock; ++b) {
    const uint8_t* block = w + b * block_bytes(Type);
    // The tile's rows lie back to back: as a linear walk through them, b blocks into each
    // row is b * R blocks into the tile (one stream to prefetch, not R a row apart).
    prefetch_ahead_of(w + b * R * block_bytes(Type), R * block_bytes(Type), end);
    __m512 table[R], upper[R];
    for (int r = 0; r < R; ++r) table[r] = block_table<Type>(block + r * row_bytes, upper[r]);
    for (int h = 0; h < 2; ++h) {
      vfloat wk[R];
      for (int r = 0; r < R; ++r) wk[r] = block_half<Type>(block + r * row_bytes, h, table[r], upper[r]);
      multiply_add(acc, x + b * kBlock + 16 * h, in, wk);
    }
  }
  store_sums(acc, out, out_stride);
}

// fused_tile for the k-quants: each super-block's weights kLanes at a time by k_lanes, the
// operations dequantize_row takes, then dot_tile's multiply-adds.
template <int Type, int R, int M>
inline void fused_k_tile(const float* x, int64_t in, const uint8_t* w, int64_t row_bytes,
                         float* out, int64_t out_stride, const uint8_t* end) {
  vfloat acc[M][R] = {};
  for (int64_t b = 0; b < in / kSuperBlock; ++b) {
    const uint8_t* block = w + b * block_bytes(Type);
    prefetch_ahead_of(w + b * R * block_bytes(Type), R * block_bytes(Type), end);
    KScales sc[R];
    for (int r = 0; r < R; ++r) sc[r] = k_scales<Type>(block + r * row_bytes);
    for (int at = 0; at < kSuperBlock; at += kLanes) {
      vfloat wk[R];
      for (int r = 0; r < R; ++r) wk[r] = k_lanes<Type>(block + r * row_bytes, at, sc[r]);
      multiply_add(acc, x + b * kSuperBlock + at, in, wk);
    }
  }
  store_sums(acc, out, out_stride);
}

// Steps of at most this many tokens take fused_tile.
constexpr int64_t kFusedTokens = 2;

template <int Type, int R, int M>
inline void fused_rows(const float* x, int64_t in, const uint8_t* w, int64_t row_bytes,
                       float* out, int64_t out_stride, const uint8_t* end) {
  if constexpr (is_k_quant(Type))
    fused_k_tile<Type, R, M>(x, in, w, row_bytes, out, out_stride, end);
  else
    fused_tile<Type, R, M>(x, in, w, row_bytes, out, out_stride, end);
}

template <int Type, int M>
void fused_linear(const float* x, int64_t in, const uint8_t* w, int64_t out_features, float* out) {
  const int64_t row_bytes = in / block_weights(Type) * block_bytes(Type);
  const uint8_t* end = w + out_features * row_bytes;
  parallel_for(out_features, out_features * M * in > (1 << 16), [&](int64_t begin, int64_t stop) {
    int64_t o = begin;
    for (; o + kTileRows <= stop; o += kTileRows)
      fused_rows<Type, kTileRows, M>(x, in, w + o * row_bytes, row_bytes, out + o, out_features, end);
    for (; o < stop; ++o)
      fused_rows<Type, 1, M>(x, in, w + o * row_bytes, row_bytes, out + o, out_features, end);
  });
}
#endif

template <int Type>
void linear(const float* x, int64_t n, int64_t in, const uint8_t* w, int64_t out_features,
            float* out) {
#if defined(__AVX512F__) && defined(__F16C__)
  if (n == 1) return fused_linear<Type, 1>(x, in, w, out_features, out);
  if (n == kFusedTokens) return fused_linear<Type, kFusedTokens>(x, in, w, out_features, out);
#endif
  const int64_t row_bytes = in / block_weights(Type) * block_bytes(Type);
  parallel_for(out_features, out_features * n * in > (1 << 16), [&](int64_t begin, int64_t end) {
    alignas(64) float rows[kTileRows * kMaxRow];  // the tile's rows, `in` floats apart
    for (int64_t o = begin; o < end; o += kTileRows) {
      const int64_t tile = std::min<int64_t>(kTileRows, end - o);
      for (int64_t r = 0; r < tile; ++r) {
        prefetch_ahead(w + (o + r) * row_bytes, row_bytes, w + out_features * row_bytes);
        dequantize_row<Type>(w + (o + r) * row_bytes, in, rows + r * in);
      }
      if (tile == kTileRows) {
        rows_times_tokens<kTileRows>(x, n, in, rows, out + o, out_features);
      } else {
        for (int64_t r = 0; r < tile; ++r)
          rows_times_tokens<1>(x, n, in, rows + r * in, out + o + r, out_features);
      }
    }
  });
}

}  // namespace
}  // namespace llmserve

using namespace llmserve;
using namespace llmserve::quant;

extern "C" {

// Bytes of one block of ggml type `type` (with kInterleaved: of its base type's, which it
// interleaves); 0 for a type without a kernel here.
int llmserve_quant_block_bytes(int type) { return int(block_bytes(type & ~kInterleaved)); }

// Weights in one block of `type` (32, or 256 for the k-quants).
int llmserve_quant_block_weights(int type) {
  return int(block_weights(type & ~kInterleaved));
}

// weights [rows, cols / 32 blocks] -> out [rows, cols] float32; interleaved weights (type with
// kInterleaved) are put back in the file's layout first. Returns -1 for an unknown type.
int llmserve_quant_dequantize(int type, const uint8_t* weights, int64_t rows, int64_t cols,
                              float* out) {
  if (type & kInterleaved) {
    type &= ~kInterleaved;
    if (block_bytes(type) == 0 || cols % block_weights(type) != 0) return -1;
    std::vector<uint8_t> file(size_t(rows * (cols / block_weights(type)) * block_bytes(type)));
    if (llmserve_quant_deinterleave(type, weights, rows, cols, file.data()) != 0) return -1;
    return llmserve_quant_dequantize(type, file.data(), rows, cols, out);
  }
  if (block_bytes(type) == 0 || cols % block_weights(type) != 0) return -1;
  return dispatch(type, [&]<int Type>() {
    const int64_t row_bytes = cols / block_weights(Type) * block_bytes(Type);
    parallel_for(rows, rows * cols > (1 << 16), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r)
        dequantize_row<Type>(weights + r * row_bytes, cols, out + r * cols);
    });
  });
}

// out [n, out_features] = x [n, in] @ dequantize(weights [out_features, in / 32 blocks])^T,
// float32, exact mode. `in` is a multiple of 32 and at most 16384. Returns -1 for an unknown
// type.
int llmserve_quant_linear(int type, const float* x, int64_t n, int64_t in, const uint8_t* weights,
                          int64_t out_features, float* out) {
  if (block_bytes(type) == 0 || in % block_weights(type) != 0 || in > kMaxRow) return -1;
  return dispatch(type, [&]<int Type>() { linear<Type>(x, n, in, weights, out_features, out); });
}

}  // extern "C"
