// A GGUF block's weights as float32, each computed with the float32 operations the gguf
// package's numpy dequantization takes, in its order (the formats: quant.cpp's header), for
// exact mode's kernels. Include it only from sources built with -ffp-contract=off (quant.cpp):
// a contracted d * q + m would round once instead of twice.

#pragma once

#include <cstdint>
#include <cstring>

#include "quant.h"
#include "vec.h"

namespace llmserve::quant {

// One block's 32 weights into out[0..32).
template <int Type>
inline void dequantize_block(const uint8_t* block, float* out) {
  const float d = half_to_float(block);
  if constexpr (Type == kQ8_0) {
    const int8_t* q = reinterpret_cast<const int8_t*>(block + 2);
    for (int j = 0; j < kBlock; ++j) out[j] = float(q[j]) * d;
  } else {
    const uint8_t* q = block + (Type == kQ4_1 ? 4 : 2);
    if constexpr (Type == kQ4_1) {
      const float m = half_to_float(block + 2);
      for (int j = 0; j < kBlock / 2; ++j) {
        out[j] = d * float(q[j] & 0x0f) + m;
        out[j + kBlock / 2] = d * float(q[j] >> 4) + m;
      }
    } else {
      for (int j = 0; j < kBlock / 2; ++j) {
        out[j] = d * float(int(q[j] & 0x0f) - 8);
        out[j + kBlock / 2] = d * float(int(q[j] >> 4) - 8);
      }
    }
  }
}

// Q5_0's block: as the gguf package computes it, d * float(q - 16).
inline void dequantize_q5_0(const uint8_t* block, float* out) {
  const float d = half_to_float(block);
  uint32_t high;
  std::memcpy(&high, block + 2, sizeof high);
  const uint8_t* q = block + 6;
  for (int j = 0; j < kBlock; ++j) {
    const int low = j < kBlock / 2 ? q[j] & 0x0f : q[j - kBlock / 2] >> 4;
    out[j] = d * float((low | int((high >> j) & 1u) << 4) - 16);
  }
}

// kLanes bytes, and as ints.
typedef uint8_t vbytes __attribute__((vector_size(kLanes)));
inline vbytes bytes_at(const uint8_t* p) {
  vbytes v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline vint widen(vbytes v) { return __builtin_convertvector(v, vint); }

// A k-quant super-block's float scales, by the package's operations: Q4_K's and Q5_K's
// d * sc (`mul`) and dmin * m (`sub`) per sub-block of 32 weights, Q6_K's d * scale per 16.
struct KScales {
  float mul[16];
  float sub[8];
};

template <int Type>
inline KScales k_scales(const uint8_t* block) {
  KScales sc;
  if constexpr (Type == kQ6_K) {
    const int8_t* scales = reinterpret_cast<const int8_t*>(block + 192);
    const float d = half_to_float(block + 208);
    for (int i = 0; i < 16; ++i) sc.mul[i] = d * float(scales[i]);
  } else {
    const float d = half_to_float(block), dmin = half_to_float(block + 2);
    for (int j = 0; j < 8; ++j) {
      int scale, min;
      k_scale_min(block + 4, j, scale, min);
      sc.mul[j] = d * float(scale);
      sc.sub[j] = dmin * float(min);
    }
  }
  return sc;
}

// Weights at .. at + kLanes - 1 of a k-quant super-block (`at` a multiple of kLanes) with its
// k_scales: Q4_K and Q5_K (d * sc) * q - dmin * m, Q6_K (d * scale) * (q - 32).
template <int Type>
inline vfloat k_lanes(const uint8_t* block, int at, const KScales& sc) {
  if constexpr (Type == kQ6_K) {
    const int half = at / 128, s = at % 128 / 32, t = at % 32;  // 32 weights per s
    const uint8_t* low = block + 64 * half;  // the low nibbles of 32 bytes, then the high ones
    const uint8_t* high = block + 128 + 32 * half;
    const vint l = widen(bytes_at(low + 32 * (s % 2) + t) >> (4 * (s / 2))) & 0x0f;
    const vint h = widen(bytes_at(high + t) >> (2 * s)) & 0x03;
    return sc.mul[at / 16] * __builtin_convertvector((l | h << 4) - 32, vfloat);
  } else {
    const int j = at / 32, t = at % 32;  // sub-block j of 32 weights
    const uint8_t* pair = block + (Type == kQ5_K ? 48 : 16) + 32 * (j / 2);
    vint value = widen(bytes_at(pair + t) >> (4 * (j % 2))) & 0x0f;
    if constexpr (Type == kQ5_K) value |= (widen(bytes_at(block + 16 + t) >> j) & 1) << 4;
    return sc.mul[j] * __builtin_convertvector(value, vfloat) - sc.sub[j];
  }
}

template <int Type>
void dequantize_row(const uint8_t* row, int64_t cols, float* out) {
  const int64_t bytes = block_bytes(Type), weights = block_weights(Type);
  for (int64_t b = 0; b < cols / weights; ++b) {
    const uint8_t* block = row + b * bytes;
    float* dst = out + b * weights;
    if constexpr (is_k_quant(Type)) {
      const KScales sc = k_scales<Type>(block);
      for (int at = 0; at < kSuperBlock; at += kLanes) store(dst + at, k_lanes<Type>(block, at, sc));
    } else if constexpr (Type == kQ5_0) {
      dequantize_q5_0(block, dst);
    } else {
      dequantize_block<Type>(block, dst);
    }
  }
}

}  // namespace llmserve::quant
