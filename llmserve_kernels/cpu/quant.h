// Weights kept in GGUF blocks (issue #27): what quant.cpp (dequantization, exact mode) and
// quant_fast.cpp (fast mode) share: the block types, their sizes, the fp16 scales, the row
// prefetch and the dispatch on a type code. The layouts are described in quant.cpp.

#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#include <immintrin.h>

namespace llmserve::quant {

constexpr int kBlock = 32;       // weights per block of the 32-weight types
constexpr int kSuperBlock = 256;  // weights per block of the k-quants
constexpr int kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ8_0 = 8, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14;

// A type code with this bit set: the type's blocks interleaved by groups of kInterleaveRows
// weight rows for fast mode (quant_interleaved.cpp; every type here).
constexpr int kInterleaved = 256;
constexpr int64_t kInterleaveRows = 8;

constexpr bool is_k_quant(int type) { return type == kQ4_K || type == kQ5_K || type == kQ6_K; }
constexpr int64_t block_weights(int type) { return is_k_quant(type) ? kSuperBlock : kBlock; }
// A 32-weight block's bytes before its quants: fp16 d, Q4_1's fp16 m, Q5_0's fifth bits.
constexpr int64_t quant_offset(int type) { return type == kQ4_1 ? 4 : type == kQ5_0 ? 6 : 2; }
// What Q4_0 and Q5_0 subtract from their unsigned quants: w = d * (q - z) = d * q + (-z * d).
constexpr float zero_point(int type) { return type == kQ4_0 ? 8.0f : type == kQ5_0 ? 16.0f : 0.0f; }
// The largest unsigned quant fast mode's integer dots multiply: the 4-bit types' 15, the 5-bit
// ones' 31, Q6_K's 63, Q8_0's magnitudes 128 (|-128|).
constexpr int max_quant(int type) {
  switch (type) {
    case kQ5_0: case kQ5_K: return 31;
    case kQ6_K: return 63;
    case kQ8_0: return 128;
    default: return 15;
  }
}
// Longest row exact mode (quant.cpp) dequantizes on the stack (floats): 64 KiB a row, and it
// keeps a tile of four (256 KiB at most; a thread's stack is 8 MiB by default).
constexpr int64_t kMaxRow = 16384;

constexpr int64_t block_bytes(int type) {
  switch (type) {
    case kQ4_0: return 18;
    case kQ4_1: return 20;
    case kQ8_0: return 34;
    case kQ5_0: return 22;
    case kQ4_K: return 144;
    case kQ5_K: return 176;
    case kQ6_K: return 210;
    default: return 0;
  }
}

// Q4_K's and Q5_K's 6-bit scale and min of sub-block j (0..7), packed in 12 bytes.
inline void k_scale_min(const uint8_t* packed, int j, int& scale, int& min) {
  if (j < 4) {
    scale = packed[j] & 0x3f;
    min = packed[j + 4] & 0x3f;
  } else {
    scale = (packed[j + 4] & 0x0f) | ((packed[j - 4] >> 2) & 0x30);
    min = (packed[j + 4] >> 4) | ((packed[j] >> 2) & 0x30);
  }
}

// IEEE half to float, exact (every half is a float).
inline float half_to_float(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, sizeof h);
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu, bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (mant << 13);  // inf, NaN
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (mant << 13);
  } else if (mant == 0) {
    bits = sign;
  } else {  // subnormal half: normalize
    exp = 113;
    while (!(mant & 0x400u)) {
      mant <<= 1;
      --exp;
    }
    bits = sign | (exp << 23) | ((mant & 0x3ffu) << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
#endif
}

// Weight rows are a few hundred bytes, too short for the hardware prefetcher to ramp up on:
// a kernel reading rows in order prefetches, at each row, the one kPrefetchBytes ahead of it
// (fast mode's Q4_1 rows streamed from memory, with and without: bench/RESULTS.md, "Weights
// kept in GGUF blocks, second round").
constexpr int64_t kPrefetchBytes = 2048;

inline void prefetch_ahead(const uint8_t* row, int64_t row_bytes, const uint8_t* end) {
  const uint8_t* next = row + std::max<int64_t>(1, kPrefetchBytes / row_bytes) * row_bytes;
  for (int64_t byte = 0; byte < row_bytes && next + byte < end; byte += 64)
    _mm_prefetch(reinterpret_cast<const char*>(next + byte), _MM_HINT_T0);
}

// A kernel that walks its weights' bytes in order, `bytes` at a time (an interleaved group's
// block; a tile of rows' blocks, as far into the tile as the rows are into their blocks),
// prefetches at each step the bytes this far ahead of it, which runs on into the next groups
// or tiles; chosen by timing the decode step (bench/RESULTS.md, "Interleaved weights").
constexpr int64_t kAhead = 4096;

// Always inlined: a call inside a kernel's loop would spill its vector registers.
[[gnu::always_inline]] inline void prefetch_ahead_of(const uint8_t* at, int64_t bytes,
                                                     const uint8_t* end) {
  if (end == nullptr) return;
  for (int64_t line = 0; line < bytes; line += 64)
    if (at + kAhead + line < end)
      _mm_prefetch(reinterpret_cast<const char*>(at + kAhead + line), _MM_HINT_T0);
}

template <typename Fn>
int dispatch(int type, Fn&& fn) {
  switch (type) {
    case kQ4_0: fn.template operator()<kQ4_0>(); return 0;
    case kQ4_1: fn.template operator()<kQ4_1>(); return 0;
    case kQ8_0: fn.template operator()<kQ8_0>(); return 0;
    case kQ5_0: fn.template operator()<kQ5_0>(); return 0;
    case kQ4_K: fn.template operator()<kQ4_K>(); return 0;
    case kQ5_K: fn.template operator()<kQ5_K>(); return 0;
    case kQ6_K: fn.template operator()<kQ6_K>(); return 0;
    default: return -1;
  }
}

}  // namespace llmserve::quant

extern "C" {
// quant.cpp: block sizes, dequantization, exact mode; quant_fast.cpp: fast mode.
int llmserve_quant_block_bytes(int type);
int llmserve_quant_block_weights(int type);
int llmserve_quant_dequantize(int type, const uint8_t* weights, int64_t rows, int64_t cols,
                              float* out);
int llmserve_quant_linear(int type, const float* x, int64_t n, int64_t in, const uint8_t* weights,
                          int64_t out_features, float* out);
int llmserve_quant_linear_fast(int type, const float* x, int64_t n, int64_t in,
                               const uint8_t* weights, int64_t out_features, float* out);
// quant_interleaved.cpp: fast mode on interleaved weights, and the layout's conversions.
int llmserve_quant_linear_interleaved(int type, const float* x, int64_t n, int64_t in,
                                      const uint8_t* weights, int64_t out_features, float* out);
int llmserve_quant_deinterleave(int type, const uint8_t* weights, int64_t rows, int64_t in,
                                uint8_t* dst);
}
