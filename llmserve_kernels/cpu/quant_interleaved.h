// Fast mode on interleaved weights (issue #52): what quant_interleaved.cpp's kernels share, and
// the k-quants' layout and eight-row dots. Q4_K, Q5_K and Q6_K weights are regrouped by eight
// rows as the 32-weight types are (quant_interleaved.cpp's file comment has the idea and the
// 32-weight layouts).
//
// A group of rows 8g .. 8g + 7 holds, per super-block of 256 weights, 8 * block_bytes bytes:
//   Q4_K, Q5_K:
//     d[8], dmin[8]   the rows' fp16 scales and minimum scales (row r's at 2r);
//     scales          96 bytes: the 6-bit scale sc and min m of row r's sub-block c, at index
//                     v = 8c + r, as planes: 32 bytes of low nibbles of sc (v < 32 in the low
//                     nibble of byte v, v >= 32 in the high nibble of byte v - 32), 32 of m's,
//                     then 32 bytes whose byte t holds the top two bits of sc[t] (bits 0-1),
//                     sc[t + 32] (2-3), m[t] (4-5) and m[t + 32] (6-7);
//     lanes           the rows' remaining bytes (Q5_K's 32 bytes of fifth bits, then the 128
//                     of 4-bit q), in chunks of 32 bytes whose lane r (bytes 4r .. 4r + 3)
//                     holds row r's bytes 4k .. 4k + 3 of them.
//   Q6_K:
//     d[8]            the rows' fp16 scales;
//     scales          128 bytes: row r's int8 scale of sixteen weights s at 8s + r;
//     lanes           the rows' 128 bytes of low 4 bits, then 64 of high 2 bits, as above.
// So register k of a lane run holds, for each row, the bytes that carry weights 4k .. 4k + 3
// of a sub-block: unpacked (nibble, fifth or high bits) to 0..15, 0..31 or 0..63, one
// `vpdpbusd` with four activation quants broadcast advances eight rows' dots.
//
// Each row's chain of fused multiply-adds is quant_chunked.h's chunked_dots' (per sub-block in
// order: the integer dot, or Q6_K's two half dots, times the scale times the activation scale;
// then the min term), in lane r, so every output is the file layout's bit for bit. Q6_K's
// quants are unsigned here (q, not q - 32): its half dots subtract 32 times the activation
// quants' sums over the half, which `half_sums` takes once per call.

#pragma once

#include <cstdint>
#include <cstring>
#include <vector>

#include <immintrin.h>

#include "quant.h"
#include "quant_fast.h"

namespace llmserve::quant {

constexpr int kSubBlocks = kSuperBlock / kBlock;

// The run of a file block's bytes [lane_begin, lane_end) that a group interleaves by lanes
// (its quants), at group offset lanes_at: what precedes it there is the group's header.
constexpr int64_t lane_begin(int type) {
  return type == kQ6_K ? 0 : is_k_quant(type) ? 16 : quant_offset(type);
}
constexpr int64_t lane_end(int type) { return type == kQ6_K ? 192 : block_bytes(type); }
// A group's chunks of 32 bytes per block: the lane run's 4-byte pieces of each row.
constexpr int64_t lane_chunks(int type) { return (lane_end(type) - lane_begin(type)) / 4; }
constexpr int64_t lanes_at(int type) {
  return kInterleaveRows * (block_bytes(type) - (lane_end(type) - lane_begin(type)));
}

// The scale planes (96 bytes at `planes`) <-> a file block's 12 packed bytes of row r.
inline void pack_scale_planes(const uint8_t* packed, int r, uint8_t* planes) {
  for (int c = 0; c < kSubBlocks; ++c) {
    int sc, m;
    k_scale_min(packed, c, sc, m);
    const int v = 8 * c + r, t = v % 32, high = v / 32;  // high: the upper nibble, bits 2-3
    planes[t] |= uint8_t((sc & 0x0f) << (4 * high));
    planes[32 + t] |= uint8_t((m & 0x0f) << (4 * high));
    planes[64 + t] |= uint8_t((sc >> 4) << (2 * high) | (m >> 4) << (4 + 2 * high));
  }
}

inline void unpack_scale_planes(const uint8_t* planes, int r, uint8_t* packed) {
  int sc[kSubBlocks], m[kSubBlocks];
  for (int c = 0; c < kSubBlocks; ++c) {
    const int v = 8 * c + r, t = v % 32, high = v / 32;
    sc[c] = (planes[t] >> (4 * high) & 0x0f) | (planes[64 + t] >> (2 * high) & 0x03) << 4;
    m[c] = (planes[32 + t] >> (4 * high) & 0x0f) | (planes[64 + t] >> (4 + 2 * high) & 0x03) << 4;
  }
  for (int j = 0; j < 4; ++j) {  // k_scale_min's packing, inverted
    packed[j] = uint8_t(sc[j] | (sc[j + 4] >> 4) << 6);
    packed[j + 4] = uint8_t(m[j] | (m[j + 4] >> 4) << 6);
    packed[j + 8] = uint8_t((sc[j + 4] & 0x0f) | (m[j + 4] & 0x0f) << 4);
  }
}

// Row r's k-quant block `file` <-> its place in `group` (the header only: the lane run is
// moved by the caller); the group's scale planes must start zeroed when packing.
template <int Type>
inline void regroup_k_header(uint8_t* file, uint8_t* group, int r, bool to_file) {
  auto move = [&](int64_t in_file, int64_t in_group, int64_t count) {
    if (to_file)
      std::memcpy(file + in_file, group + in_group, count);
    else
      std::memcpy(group + in_group, file + in_file, count);
  };
  if constexpr (Type == kQ6_K) {
    move(208, 2 * r, 2);  // d
    for (int s = 0; s < 16; ++s) move(192 + s, 16 + 8 * s + r, 1);
  } else {
    move(0, 2 * r, 2);       // d
    move(2, 16 + 2 * r, 2);  // dmin
    if (to_file)
      unpack_scale_planes(group + 32, r, file + 4);
    else
      pack_scale_planes(file + 4, r, group + 32);
  }
}

#if defined(__AVX2__) && defined(__F16C__)
// 32 times each activation block's sums of quants over weights 0-15 and 16-31 (Q6_K's
// half_sums), for n rows of `chunks` blocks, in this thread's buffer.
inline const int32_t* half_sums(const ActBlock* a, int64_t count) {
  thread_local std::vector<int32_t> sums;
  sums.resize(size_t(2 * count));
  for (int64_t i = 0; i < count; ++i)
    for (int h = 0; h < 2; ++h) {
      int32_t s = 0;
      for (int j = 0; j < kBlock / 2; ++j) s += a[i].q[16 * h + j];
      sums[2 * i + h] = 32 * s;
    }
  return sums.data();
}

// The eight quant registers of a 32-weight type's block in a group (at `block`): register j
// holds, in lane r, row r's quants of weights 4j .. 4j + 3: unsigned 0..15 (Q4_0, Q4_1) or
// 0..31 (Q5_0, its fifth bits in bit 4), Q8_0's signed bytes as they are.
template <int Type>
inline void block_registers(const uint8_t* block, __m256i (&w)[8]) {
  const uint8_t* quants = block + lanes_at(Type);
#pragma GCC unroll 8  // constant k: the shifts take immediates
  for (int k = 0; k < lane_chunks(Type); ++k) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(quants + 32 * k));
    if constexpr (Type == kQ8_0) {
      w[k] = v;
    } else {  // chunk k: weights 4k .. 4k + 3 in the low nibbles, 16 + 4k .. in the high ones
      const __m256i low = _mm256_set1_epi8(0x0f);
      w[k] = _mm256_and_si256(v, low);
      w[k + 4] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
      if constexpr (Type == kQ5_0) {  // bit j of the plane's bytes -> bit 4 of register j's
        const __m256i plane =
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 2 * kInterleaveRows));
        const __m256i bit4 = _mm256_set1_epi8(0x10);
        w[k] = _mm256_or_si256(w[k], _mm256_and_si256(_mm256_slli_epi16(plane, 4 - k), bit4));
        w[k + 4] = _mm256_or_si256(w[k + 4], _mm256_and_si256(_mm256_srli_epi16(plane, k), bit4));
      }
    }
  }
}

inline __m256i shift16(__m256i v, int bits) {  // bits > 0: left, < 0: right
  return bits >= 0 ? _mm256_sll_epi16(v, _mm_cvtsi32_si128(bits))
                   : _mm256_srl_epi16(v, _mm_cvtsi32_si128(-bits));
}

inline __m256i lane_run(const uint8_t* at) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(at));
}

// Register k (weights 4k .. 4k + 3 of sub-block c, eight rows) of a group's block whose lane
// run starts at `lanes`, unpacked to unsigned bytes.
template <int Type>
inline __m256i k_register(const uint8_t* lanes, int c, int k) {
  const __m256i nibble = _mm256_set1_epi8(0x0f);
  if constexpr (Type == kQ6_K) {  // low bits: run 2h + c % 2 (c = 4h + s); high: 4 + h
    const int h = c / 4, s = c % 4;
    const __m256i low =
        _mm256_and_si256(shift16(lane_run(lanes + 256 * (2 * h + s % 2) + 32 * k), -4 * (s / 2)),
                         nibble);
    const __m256i high = _mm256_and_si256(
        shift16(lane_run(lanes + 1024 + 256 * h + 32 * k), 4 - 2 * s), _mm256_set1_epi8(0x30));
    return _mm256_or_si256(low, high);
  } else {  // pair c / 2 of sub-blocks in the low and high nibbles; Q5_K's fifth bits first
    const int64_t quants = Type == kQ5_K ? 256 : 0;
    __m256i v = _mm256_and_si256(
        shift16(lane_run(lanes + quants + 256 * (c / 2) + 32 * k), -4 * (c % 2)), nibble);
    if constexpr (Type == kQ5_K)  // bit c of each byte -> bit 4
      v = _mm256_or_si256(v, _mm256_and_si256(shift16(lane_run(lanes + 32 * k), 4 - c),
                                              _mm256_set1_epi8(0x10)));
    return v;
  }
}

// A Q4_K or Q5_K group block's 6-bit scales and mins as bytes, sub-block c's eight rows' at
// 8c of sc and mins (32-byte aligned, 64 bytes each).
inline void k_scales_mins(const uint8_t* block, uint8_t* sc, uint8_t* mins) {
  const __m256i nibble = _mm256_set1_epi8(0x0f), low = lane_run(block + 32),
                low_m = lane_run(block + 64), top = lane_run(block + 96);
  const auto put = [](uint8_t* at, __m256i v) {
    _mm256_store_si256(reinterpret_cast<__m256i*>(at), v);
  };
  put(sc, _mm256_or_si256(_mm256_and_si256(low, nibble),
                          _mm256_slli_epi16(_mm256_and_si256(top, _mm256_set1_epi8(0x03)), 4)));
  put(sc + 32, _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(low, 4), nibble),
                               _mm256_slli_epi16(_mm256_and_si256(top, _mm256_set1_epi8(0x0c)), 2)));
  put(mins, _mm256_or_si256(_mm256_and_si256(low_m, nibble),
                            _mm256_and_si256(top, _mm256_set1_epi8(0x30))));
  put(mins + 32, _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(low_m, 4), nibble),
                                 _mm256_and_si256(_mm256_srli_epi16(top, 2), _mm256_set1_epi8(0x30))));
}

inline __m256 bytes_as_floats(const uint8_t* eight, bool is_signed) {
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(eight));
  return _mm256_cvtepi32_ps(is_signed ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b));
}

// out[m * stride + r] = the fast-mode dot of the group's row r with activation rows
// a[m * chunks ...] (chunks = blocks * 8), for r < 8 and m < M; sums: half_sums of a (Q6_K).
template <int Type, int M>
inline void k_group_dots(const uint8_t* group, int64_t blocks, const ActBlock* a,
                         const int32_t* sums, float* out, int64_t stride, const uint8_t* end) {
  const int64_t bytes = kInterleaveRows * block_bytes(Type), chunks = blocks * kSubBlocks;
  __m256 acc[M];
  for (int m = 0; m < M; ++m) acc[m] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* block = group + b * bytes;
    prefetch_ahead_of(block, bytes, end);  // end: nullptr where another call prefetched
    const __m256 d_w = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block)));
    __m256 neg_dmin = _mm256_setzero_ps();
    alignas(32) uint8_t sc[64], mins[64];  // Q4_K, Q5_K: sub-block c's at 8c
    if constexpr (Type != kQ6_K) {
      neg_dmin = _mm256_sub_ps(_mm256_setzero_ps(), _mm256_cvtph_ps(_mm_loadu_si128(
                                                        reinterpret_cast<const __m128i*>(block + 16))));
      k_scales_mins(block, sc, mins);
    }
    const uint8_t* lanes = block + lanes_at(Type);
    for (int c = 0; c < kSubBlocks; ++c) {
      __m256i w[8];
      for (int k = 0; k < 8; ++k) w[k] = k_register<Type>(lanes, c, k);
      __m256 scale[2], offset = _mm256_setzero_ps();
      if constexpr (Type == kQ6_K) {
        for (int h = 0; h < 2; ++h)
          scale[h] = _mm256_mul_ps(d_w, bytes_as_floats(block + 16 + 8 * (2 * c + h), true));
      } else {
        scale[0] = _mm256_mul_ps(d_w, bytes_as_floats(sc + 8 * c, false));
        offset = _mm256_mul_ps(neg_dmin, bytes_as_floats(mins + 8 * c, false));
      }
      for (int m = 0; m < M; ++m) {
        const int64_t at = m * chunks + b * kSubBlocks + c;
        const ActBlock& x = a[at];
        __m256i dot[2][1] = {{_mm256_setzero_si256()}, {_mm256_setzero_si256()}};  // weights 0-15, 16-31
        for (int h = 0; h < 2; ++h)
          row_dots<1, 4, max_quant(Type)>(dot[h], w + 4 * h, [&](int, int k) {
            int32_t four;
            std::memcpy(&four, x.q + 16 * h + 4 * k, sizeof four);
            return _mm256_set1_epi32(four);
          });
        const __m256 d = _mm256_set1_ps(x.d);
        if constexpr (Type == kQ6_K) {
          for (int h = 0; h < 2; ++h) {
            const __m256i signed_dot = _mm256_sub_epi32(dot[h][0], _mm256_set1_epi32(sums[2 * at + h]));
            acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(signed_dot), _mm256_mul_ps(scale[h], d),
                                     acc[m]);
          }
        } else {
          acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(dot[0][0], dot[1][0])),
                                   _mm256_mul_ps(scale[0], d), acc[m]);
          acc[m] = _mm256_fmadd_ps(offset, _mm256_set1_ps(x.s), acc[m]);
        }
      }
    }
  }
  for (int m = 0; m < M; ++m) _mm256_storeu_ps(out + m * stride, acc[m]);
}
#endif

}  // namespace llmserve::quant
