// Fast mode on weights interleaved at load (issue #52): weight rows regrouped so that one 8-lane
// integer multiply-add advances the dots of eight rows at once. This file has the 32-weight
// types (Q4_0, Q4_1, Q5_0, Q8_0), the layer and the conversions; quant_interleaved.h the
// k-quants' layout and dots.
//
// quant_fast.cpp's four_row_dots takes each weight row's block as it lies in the file: its 32
// products fill eight int32 lanes, which three horizontal adds then fold into one sum per row.
// Here the rows are interleaved once, when the worker loads them, so that no folding is left:
// weight rows 8g .. 8g + 7 (a group; it occupies the bytes those rows did) hold, for each
// block b in turn, 8 * block_bytes bytes:
//   d[8]        the rows' fp16 scales, row r's at 2r;
//   m[8]        Q4_1 only: the rows' fp16 minimums;
//   fifth bits  Q5_0 only, 32 bytes: bit j of byte 4r + i is the fifth bit of row r's weight
//               at(j) + i, where at(j) = 4j for j < 4 and 16 + 4(j - 4) after: the weights
//               that quant register j below covers;
//   chunks      of 32 bytes: lane r (bytes 4r .. 4r + 3) of chunk k holds row r's quant bytes
//               4k .. 4k + 3 of the block. Q4_0/Q4_1/Q5_0 have 4 chunks (16 bytes a row: the
//               low nibbles are weights 4k .. 4k + 3, the high ones 16 + 4k .. 16 + 4k + 3),
//               Q8_0 has 8 (weights 4k .. 4k + 3).
// A block is read into 8 quant registers (the 4 chunks' low nibbles, then their high ones, with
// Q5_0's fifth bits shifted into bit 4 of each byte; or Q8_0's 8 chunks). A register times
// four activation quants broadcast to every lane is one `vpdpbusd` (AVX2: `vpmaddubsw` +
// `vpmaddwd`, the same integers), which leaves row r's partial sum in lane r. Each row's block
// sum is thus the same integer as four_row_dots', and it is scaled and accumulated by the same
// float operations in the same order, so every output is bit for bit quant_fast.cpp's:
// interleaving changes the speed, never a token.
//
// Weights with a row count that is not a multiple of 8, and builds without AVX2, keep the
// file's layout (`llmserve_quant_interleaves` says whether this build interleaves a type).
// Dequantizing an interleaved weight (the prompts' dequantizing path) puts each group back
// first (llmserve_quant_deinterleave).
//
// A call of many activation rows goes to the matrix engine first where the CPU has one
// (quant_amx.cpp: AMX tiles, the same outputs bit for bit).

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include <immintrin.h>

#include "pool.h"
#include "quant.h"
#include "quant_amx.h"
#include "quant_fast.h"
#include "quant_interleaved.h"
#include "quant_wide.h"

namespace llmserve {
namespace {

using namespace llmserve::quant;

constexpr int64_t kLanes = kInterleaveRows;

// Rows src[0 .. 8) (`row_bytes` apart, `blocks` blocks each, in the file's layout) into one
// group at dst; to_file: the other way.
template <int Type>
void regroup(const uint8_t* src, uint8_t* dst, int64_t row_bytes, int64_t blocks, bool to_file) {
  const int64_t bytes = block_bytes(Type);
  for (int64_t b = 0; b < blocks; ++b) {
    uint8_t* group = (to_file ? const_cast<uint8_t*>(src) : dst) + b * kLanes * bytes;
    for (int64_t r = 0; r < kLanes; ++r) {
      uint8_t* block = (to_file ? dst : const_cast<uint8_t*>(src)) + r * row_bytes + b * bytes;
      auto move = [&](int64_t in_block, int64_t in_group, int64_t count) {
        if (to_file)
          std::memcpy(block + in_block, group + in_group, count);
        else
          std::memcpy(group + in_group, block + in_block, count);
      };
      if constexpr (is_k_quant(Type)) {
        if (!to_file && r == 0) std::memset(group, 0, size_t(lanes_at(Type)));
        regroup_k_header<Type>(block, group, int(r), to_file);
      } else {
        move(0, 2 * r, 2);  // d
      }
      if constexpr (Type == kQ4_1) move(2, 2 * kLanes + 2 * r, 2);  // m
      if constexpr (Type == kQ5_0) {  // row r's fifth bits <-> bytes 4r .. 4r + 3 of the plane
        uint8_t* plane = group + 2 * kLanes + 4 * r;
        uint32_t high = 0;
        if (!to_file) std::memcpy(&high, block + 2, sizeof high);
        for (int i = 0; i < 4; ++i) {
          if (!to_file) plane[i] = 0;
          for (int j = 0; j < 8; ++j) {
            const int bit = 4 * j + i;  // quant register j holds weights 4j .. 4j + 3
            if (to_file)
              high |= uint32_t((plane[i] >> j) & 1) << bit;
            else
              plane[i] |= uint8_t(((high >> bit) & 1) << j);
          }
        }
        if (to_file) std::memcpy(block + 2, &high, sizeof high);
      }
      for (int64_t k = 0; k < lane_chunks(Type); ++k)  // the lane run
        move(lane_begin(Type) + 4 * k, lanes_at(Type) + 32 * k + 4 * r, 4);
    }
  }
}

template <int Type>
void regroup_all(const uint8_t* src, int64_t rows, int64_t in, uint8_t* dst, bool to_file) {
  const int64_t row_bytes = in / block_weights(Type) * block_bytes(Type);
  parallel_for(rows / kLanes, rows * row_bytes > (1 << 20), [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g)
      regroup<Type>(src + g * kLanes * row_bytes, dst + g * kLanes * row_bytes, row_bytes,
                    in / block_weights(Type), to_file);
  });
}

#if defined(__AVX2__) && defined(__F16C__)
// With VNNI, Q8_0's dots take the activation quants biased to unsigned (x + 128, one xor per
// row when they are quantized) and the signed weights as they are: one `vpdpbusd` per four
// weights, with 128 times the block's weight sums taken off afterwards, the same integer as
// the sign trick (|w| times x with w's sign), which costs a `vpsignb` per four weights and row.
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
constexpr bool kBiasedQ8 = true;
#else
constexpr bool kBiasedQ8 = false;
#endif

// Activation quants x -> x + 128 as unsigned bytes (the sign bit flipped), for kBiasedQ8.
inline void bias_to_unsigned(ActBlock* a, int64_t count) {
  const __m256i flip = _mm256_set1_epi8(char(0x80));
  for (int64_t k = 0; k < count; ++k) {
    __m256i* q = reinterpret_cast<__m256i*>(a[k].q);
    _mm256_storeu_si256(q, _mm256_xor_si256(_mm256_loadu_si256(q), flip));
  }
}

// out[m * stride + r] = the fast-mode dot of the group's row r with activation rows
// a[m * blocks ...], for r < 8 and m < M.
template <int Type, int M>
inline void group_dots(const uint8_t* group, int64_t blocks, const ActBlock* a, float* out,
                       int64_t stride, const uint8_t* end) {
  constexpr int kChunks = 8;  // weight registers per block: 4 chunks x 2 nibbles, or 8 chunks
  const int64_t bytes = kLanes * block_bytes(Type);
  __m256 acc[M];
  for (int m = 0; m < M; ++m) acc[m] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* block = group + b * bytes;
    prefetch_ahead_of(block, bytes, end);  // end: nullptr where another call prefetched
    const __m256 d_w = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block)));
    __m256 o_w = _mm256_setzero_ps();  // what multiplies s: Q4_1's m_w, Q4_0's and Q5_0's -z * d_w
    if constexpr (Type == kQ4_1)
      o_w = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 16)));
    if constexpr (zero_point(Type) != 0.0f)
      o_w = _mm256_mul_ps(d_w, _mm256_set1_ps(-zero_point(Type)));
    __m256i w[kChunks];  // register j: each row's weights 4j .. 4j + 3
    block_registers<Type>(block, w);
    __m256i sign[kChunks];  // Q8_0 without the bias: the signed weights (w their magnitudes)
    if constexpr (Type == kQ8_0 && !kBiasedQ8)
      for (int k = 0; k < kChunks; ++k) {
        sign[k] = w[k];
        w[k] = _mm256_sign_epi8(w[k], w[k]);
      }
    __m256i bias = _mm256_setzero_si256();  // kBiasedQ8: 128 times each row's weight sum
    if constexpr (Type == kQ8_0 && kBiasedQ8) {
      __m256i half = _mm256_setzero_si256();  // two chains, as the rows' sums below do not wait
      for (int j = 0; j < kChunks; j += 2) {
        bias = _mm256_dpbusd_epi32(bias, _mm256_set1_epi8(char(0x80)), w[j]);
        half = _mm256_dpbusd_epi32(half, _mm256_set1_epi8(char(0x80)), w[j + 1]);
      }
      bias = _mm256_add_epi32(bias, half);
    }
    // The rows' sums side by side, so that their multiply-add chains overlap (one row's eight
    // after another's ran at the chain's latency: bench/RESULTS.md, "Prompts' integer dots").
    __m256i sum[M];
    for (int m = 0; m < M; ++m) sum[m] = _mm256_setzero_si256();
    const auto x = [&](int m, int j) {  // row m's activation quants 4j .. 4j + 3, in every lane
      int32_t four;
      std::memcpy(&four, a[m * blocks + b].q + 4 * j, sizeof four);
      const __m256i xs = _mm256_set1_epi32(four);
      if constexpr (Type == kQ8_0 && !kBiasedQ8)  // signed x signed: |w| times x with w's sign
        return _mm256_sign_epi8(xs, sign[j]);
      return xs;
    };
    if constexpr (Type == kQ8_0 && kBiasedQ8) {  // (x + 128) times w: less the bias below
      for (int j = 0; j < kChunks; ++j)
        for (int m = 0; m < M; ++m) sum[m] = _mm256_dpbusd_epi32(sum[m], x(m, j), w[j]);
    } else {
      row_dots<M, kChunks, max_quant(Type)>(sum, w, x);
    }
    for (int m = 0; m < M; ++m) {
      const ActBlock& x = a[m * blocks + b];
      if constexpr (Type == kQ8_0 && kBiasedQ8) sum[m] = _mm256_sub_epi32(sum[m], bias);
      // As four_row_dots: the block's dot times d_w * d, then o_w * s.
      acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[m]),
                               _mm256_mul_ps(d_w, _mm256_set1_ps(x.d)), acc[m]);
      if constexpr (Type != kQ8_0) acc[m] = _mm256_fmadd_ps(o_w, _mm256_set1_ps(x.s), acc[m]);
    }
  }
  for (int m = 0; m < M; ++m) _mm256_storeu_ps(out + m * stride, acc[m]);
}

// Activation rows that share a group's unpacked block: eight where AVX-512 gives 32 vector
// registers, four in AVX2's 16 (bench/RESULTS.md, "Interleaved weights"). A row's output does
// not depend on it.
#if defined(__AVX512VL__)
constexpr int kTileRows = 8;
#else
constexpr int kTileRows = 4;
#endif

// fn.template operator()<M>() with M = rows (1 .. kTileRows): a tile's remainder in one pass.
template <int M = 1, typename Fn>
inline void with_rows(int64_t rows, Fn&& fn) {
  if (rows == M) return fn.template operator()<M>();
  if constexpr (M < kTileRows) with_rows<M + 1>(rows, fn);
}

// The group's dots with activation rows i .. i + M (a: every row's blocks, `chunks` a row).
template <int Type, int M>
inline void tile_dots(const uint8_t* group, int64_t blocks, int64_t chunks, const ActBlock* a,
                      const int32_t* sums, int64_t i, float* out, int64_t stride,
                      const uint8_t* end) {
  if constexpr (is_k_quant(Type))
    k_group_dots<Type, M>(group, blocks, a + i * chunks, sums + 2 * i * chunks, out, stride, end);
  else
    group_dots<Type, M>(group, blocks, a + i * chunks, out, stride, end);
}

template <int Type>
void linear_interleaved(const float* x, int64_t n, int64_t in, const uint8_t* w,
                        int64_t out_features, float* out) {
  const int64_t blocks = in / block_weights(Type), chunks = in / kBlock,
                group_bytes = kLanes * blocks * block_bytes(Type), groups = out_features / kLanes;
  ActBlock* a = quantize_rows(x, n, in);
  if (matrix_engine_linear(Type, a, n, in, w, out_features, out)) return;
  if constexpr (Type == kQ8_0 && kBiasedQ8) bias_to_unsigned(a, n * chunks);
  const int32_t* sums = Type == kQ6_K ? half_sums(a, n * chunks) : nullptr;
  const uint8_t* end = w + groups * group_bytes;
  // A work item: one group, or two side by side on 512-bit registers (quant_wide.h; a last odd
  // group alone).
  const int64_t per = wide_type(Type) && n >= wide_rows(Type) ? 2 : 1;
  parallel_for((groups + per - 1) / per, out_features * n * in > (1 << 16),
               [&](int64_t begin, int64_t stop) {
    for (int64_t g = begin * per; g < std::min(groups, stop * per); g += per) {
      const uint8_t* group = w + g * group_bytes;
      float* o = out + g * kLanes;
      const bool pair = per == 2 && g + 1 < groups;
      for (int64_t i = 0; i < n; i += kTileRows)  // the first tile prefetches the next blocks
        with_rows(std::min<int64_t>(kTileRows, n - i), [&]<int M>() {
          const uint8_t* ahead = i == 0 ? end : nullptr;
#if LLMSERVE_WIDE_GROUPS
          if constexpr (wide_type(Type)) {
            if (pair)
              return pair_dots<Type, M>(group, group_bytes, blocks, a + i * chunks,
                                        o + i * out_features, out_features, ahead);
          }
#endif
          tile_dots<Type, M>(group, blocks, chunks, a, sums, i, o + i * out_features,
                             out_features, ahead);
        });
    }
  });
}
#endif

// Whether this build multiplies `type` interleaved.
bool has_kernel(int type) {
#if defined(__AVX2__) && defined(__F16C__)
  return block_bytes(type) != 0;
#else
  (void)type;
  return false;
#endif
}

int regroup_call(int type, const uint8_t* src, int64_t rows, int64_t in, uint8_t* dst,
                 bool to_file) {
  if (!has_kernel(type) || rows % kLanes != 0 || in % block_weights(type) != 0) return -1;
  return dispatch(type, [&]<int Type>() { regroup_all<Type>(src, rows, in, dst, to_file); });
}

}  // namespace
}  // namespace llmserve

using namespace llmserve;
using namespace llmserve::quant;

extern "C" {

// 1 when this build has the interleaved kernel for ggml type `type`, else 0.
int llmserve_quant_interleaves(int type) { return has_kernel(type) ? 1 : 0; }

// weights [rows, in / block weights * block bytes] of `type` in the file's layout -> dst (as many bytes)
// interleaved (see the file comment). rows: a multiple of 8. Returns -1 for a type this build
// does not interleave or a bad shape.
int llmserve_quant_interleave(int type, const uint8_t* weights, int64_t rows, int64_t in,
                              uint8_t* dst) {
  return regroup_call(type, weights, rows, in, dst, false);
}

// The inverse of llmserve_quant_interleave.
int llmserve_quant_deinterleave(int type, const uint8_t* weights, int64_t rows, int64_t in,
                                uint8_t* dst) {
  return regroup_call(type, weights, rows, in, dst, true);
}

// llmserve_quant_linear_fast on interleaved weights of `type` (out_features a multiple of 8).
int llmserve_quant_linear_interleaved(int type, const float* x, int64_t n, int64_t in,
                                      const uint8_t* weights, int64_t out_features, float* out) {
  if (!has_kernel(type) || in % block_weights(type) != 0 || out_features % kLanes != 0) return -1;
#if defined(__AVX2__) && defined(__F16C__)
  return dispatch(type, [&]<int Type>() {
    linear_interleaved<Type>(x, n, in, weights, out_features, out);
  });
#else
  (void)x, (void)n, (void)weights, (void)out;
  return -1;
#endif
}

}  // extern "C"
