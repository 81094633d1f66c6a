// Helpers shared by a Gated DeltaNet layer's state kernels: linear_attention.cpp (decode
// steps) and linear_prefill.cpp (packed prefill sequences).

#pragma once

#include <cmath>
#include <cstdint>

#include "vec.h"

namespace llmserve {

constexpr int64_t kMaxKeyDim = 512;             // q and k of one head are copied to the stack
constexpr int64_t kMaxValueDim = 512;

// x * sigmoid(x), sigmoid from e = exp(-|x|) <= 1: 1 / (1 + e) for x >= 0, e / (1 + e) below.
inline vfloat silu(vfloat x) {
  const vfloat e = exp_nonpositive(x < 0.0f ? x : -x);
  return x * (x < 0.0f ? e : splat(1.0f)) / (1.0f + e);
}

// Loads n values (a whole vector when n == kLanes; a tail padded with zeros when fewer).
template <typename T>
inline vfloat load_lanes(const T* src, int64_t n) {
  if (n == kLanes) return load(src);
  alignas(64) float tmp[kLanes] = {};
  for (int64_t i = 0; i < n; ++i) tmp[i] = to_float(src[i]);
  return load(tmp);
}

// Stores the first n lanes of v (all of them when n == kLanes).
template <typename T>
inline void store_lanes(T* dst, vfloat v, int64_t n) {
  if (n == kLanes) {
    store(dst, v);
    return;
  }
  alignas(64) float tmp[kLanes];
  store(tmp, v);
  for (int64_t i = 0; i < n; ++i) store_scalar(dst + i, tmp[i]);
}

// Copies one head's row to float32, L2-normalised when asked (x / sqrt(|x|^2 + eps)), times
// `scale`.
template <typename T>
void load_head(const T* src, int64_t dim, bool l2norm, float scale, float* dst) {
  float squares = 0.0f;
  for (int64_t i = 0; i < dim; ++i) {
    dst[i] = to_float(src[i]);
    squares += dst[i] * dst[i];
  }
  const float factor = l2norm ? scale / std::sqrt(squares + 1e-6f) : scale;
  for (int64_t i = 0; i < dim; ++i) dst[i] *= factor;
}

}  // namespace llmserve
