// Vector helpers shared by the CPU kernels (paged_attention.cpp, ops.cpp).
//
// Vectors are GCC vector extensions as wide as the CPU's registers: 16 floats with AVX-512, 8
// otherwise. (Wider than a register, GCC 12 keeps them in memory and lowers comparisons,
// `?:` and shuffles lane by lane, many times slower: bench/RESULTS.md, "Figures moved out of
// code comments".) Code is written for any kLanes. Storage is float32 or bfloat16 (as
// uint16_t bits).

#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include <immintrin.h>

namespace llmserve {

#if defined(__AVX512F__)
#define LLMSERVE_LANES 16
#else
#define LLMSERVE_LANES 8
#endif
constexpr int kLanes = LLMSERVE_LANES;
constexpr int kMaxGroup = 16;  // query heads per kv head
typedef float vfloat __attribute__((vector_size(kLanes * sizeof(float))));
typedef float vfloat8 __attribute__((vector_size(8 * sizeof(float))));
typedef float vfloat4 __attribute__((vector_size(4 * sizeof(float))));
typedef uint16_t vhalf __attribute__((vector_size(kLanes * sizeof(uint16_t))));
typedef uint32_t vuint __attribute__((vector_size(kLanes * sizeof(uint32_t))));
typedef int32_t vint __attribute__((vector_size(kLanes * sizeof(int32_t))));

using bf16 = uint16_t;

// ---- scalar and vector conversions -------------------------------------------------------

inline float to_float(float x) { return x; }

inline float to_float(bf16 x) {
  uint32_t bits = uint32_t(x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline void store_scalar(float* dst, float x) { *dst = x; }

inline void store_scalar(bf16* dst, float x) {
  // Round to nearest even, as torch does when casting float32 to bfloat16.
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  if ((bits & 0x7fffffffu) > 0x7f800000u) {
    *dst = bf16((bits >> 16) | 0x40u);  // quiet NaN
    return;
  }
  bits += 0x7fffu + ((bits >> 16) & 1u);
  *dst = bf16(bits >> 16);
}

inline vfloat load(const float* src) {
  vfloat v;
  std::memcpy(&v, src, sizeof v);
  return v;
}

inline vfloat load(const bf16* src) {
  vhalf h;
  std::memcpy(&h, src, sizeof h);
  vuint bits = __builtin_convertvector(h, vuint) << 16;
  vfloat v;
  std::memcpy(&v, &bits, sizeof v);
  return v;
}

inline void store(float* dst, vfloat v) { std::memcpy(dst, &v, sizeof v); }

inline vfloat splat(float x) { return vfloat{} + x; }

inline float hsum(vfloat v) {
#if LLMSERVE_LANES == 16
  const vfloat8 s8 = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                     __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
#else
  const vfloat8 s8 = v;
#endif
  vfloat4 s4 = __builtin_shufflevector(s8, s8, 0, 1, 2, 3) + __builtin_shufflevector(s8, s8, 4, 5, 6, 7);
  return (s4[0] + s4[2]) + (s4[1] + s4[3]);
}

// r[t] = sum of the lanes of v[t], for kLanes vectors at once: a transpose-and-add tree
// (log2(kLanes) rounds of shuffles and adds instead of kLanes separate horizontal sums).
// Modifies v.
inline vfloat reduce_lanes(vfloat* v) {
#if LLMSERVE_LANES == 16
  // 16 vectors -> 8: lanes 0-7 hold partial sums of v[2i], lanes 8-15 of v[2i + 1].
  for (int i = 0; i < 8; ++i) {
    v[i] = __builtin_shufflevector(v[2 * i], v[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19,
                                   20, 21, 22, 23) +
           __builtin_shufflevector(v[2 * i], v[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25,
                                   26, 27, 28, 29, 30, 31);
  }
  // 8 -> 4: four lanes per vector.
  for (int i = 0; i < 4; ++i) {
    v[i] = __builtin_shufflevector(v[2 * i], v[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18,
                                   19, 24, 25, 26, 27) +
           __builtin_shufflevector(v[2 * i], v[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22,
                                   23, 28, 29, 30, 31);
  }
  // 4 -> 2: two lanes per vector.
  for (int i = 0; i < 2; ++i) {
    v[i] = __builtin_shufflevector(v[2 * i], v[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20,
                                   21, 24, 25, 28, 29) +
           __builtin_shufflevector(v[2 * i], v[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22,
                                   23, 26, 27, 30, 31);
  }
  // 2 -> 1: lane t is vector t's sum.
  return __builtin_shufflevector(v[0], v[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26,
                                 28, 30) +
         __builtin_shufflevector(v[0], v[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27,
                                 29, 31);
#else
  // 8 vectors -> 4: lanes 0-3 hold partial sums of v[2i], lanes 4-7 of v[2i + 1].
  for (int i = 0; i < 4; ++i) {
    v[i] = __builtin_shufflevector(v[2 * i], v[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11) +
           __builtin_shufflevector(v[2 * i], v[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15);
  }
  // 4 -> 2: two lanes per vector.
  for (int i = 0; i < 2; ++i) {
    v[i] = __builtin_shufflevector(v[2 * i], v[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13) +
           __builtin_shufflevector(v[2 * i], v[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15);
  }
  // 2 -> 1: lane t is vector t's sum.
  return __builtin_shufflevector(v[0], v[1], 0, 2, 4, 6, 8, 10, 12, 14) +
         __builtin_shufflevector(v[0], v[1], 1, 3, 5, 7, 9, 11, 13, 15);
#endif
}

// 0, 1, ..., kLanes - 1.
inline vint lane_indices() {
  vint lanes;
  for (int i = 0; i < kLanes; ++i) lanes[i] = i;
  return lanes;
}

// The largest lane, by halving (a maximum is exact, so the order does not matter; a chain of
// kLanes scalar maxima was the longest dependency of a decode step's scoring loop).
inline float hmax(vfloat v) {
#if LLMSERVE_LANES == 16
  const vfloat8 lo = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7);
  const vfloat8 hi = __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const vfloat8 m8 = lo > hi ? lo : hi;
#else
  const vfloat8 m8 = v;
#endif
  const vfloat4 lo4 = __builtin_shufflevector(m8, m8, 0, 1, 2, 3);
  const vfloat4 hi4 = __builtin_shufflevector(m8, m8, 4, 5, 6, 7);
  const vfloat4 m4 = lo4 > hi4 ? lo4 : hi4;
  return std::max(std::max(m4[0], m4[1]), std::max(m4[2], m4[3]));
}

// a * b + c, fused (one rounding) where the CPU has FMA, whatever the file's -ffp-contract.
inline vfloat fmadd(vfloat a, vfloat b, vfloat c) {
#if defined(__AVX512F__)
  return vfloat(_mm512_fmadd_ps(__m512(a), __m512(b), __m512(c)));
#else
  return a * b + c;
#endif
}

// exp(x) for x <= 0 (softmax arguments after subtracting the maximum), vectorized.
// 2^(x log2 e) split into 2^n * 2^f with |f| <= 1/2; 2^f by a degree-7 polynomial in f ln 2
// (relative error below 2e-7, i.e. about one float ulp). Arguments below -87 give 0.
inline vfloat exp_nonpositive(vfloat x) {
  const vfloat lo = splat(-87.0f);
  x = x < lo ? lo : x;
  vfloat n = x * 1.44269504088896341f;
  // Round to nearest: adding and subtracting 1.5 * 2^23 (valid for |n| < 2^22).
  n = (n + 12582912.0f) - 12582912.0f;
  vfloat r = fmadd(n, splat(-0.693145751953125f), x);  // ln 2 split in two parts for precision
  r = fmadd(n, splat(-1.428606765330187e-06f), r);
  vfloat p = splat(1.0f / 5040.0f);
  p = fmadd(p, r, splat(1.0f / 720.0f));
  p = fmadd(p, r, splat(1.0f / 120.0f));
  p = fmadd(p, r, splat(1.0f / 24.0f));
  p = fmadd(p, r, splat(1.0f / 6.0f));
  p = fmadd(p, r, splat(0.5f));
  p = fmadd(p, r, splat(1.0f));
  p = fmadd(p, r, splat(1.0f));
  vint e = (__builtin_convertvector(n, vint) + 127) << 23;
  vfloat scale;
  std::memcpy(&scale, &e, sizeof scale);
  vfloat result = p * scale;
  return x <= lo ? vfloat{} : result;
}

inline float exp_nonpositive(float x) {
  vfloat v = splat(x);
  return exp_nonpositive(v)[0];
}

// exp(x) for any x: exp_nonpositive(-|x|), inverted for positive arguments (1 / exp(-x),
// one more rounding). Overflows to +inf above 88.7, like expf.
inline vfloat exp_any(vfloat x) {
  const vfloat magnitude = x < 0.0f ? -x : x;
  const vfloat small = exp_nonpositive(-magnitude);
  return x <= 0.0f ? small : 1.0f / small;
}

// tanh(x), vectorized: an odd polynomial (to x^7) below |x| = 1/16, where it is exact to
// float precision, else sign(x) (1 - e) / (1 + e) with e = exp(-2|x|) (a few float ulps).
inline vfloat tanh_any(vfloat x) {
  const vfloat magnitude = x < 0.0f ? -x : x;
  const vfloat e = exp_nonpositive(-2.0f * magnitude);
  const vfloat wide = (1.0f - e) / (1.0f + e);
  const vfloat x2 = x * x;
  const vfloat odd = x * (1.0f + x2 * (-1.0f / 3 + x2 * (2.0f / 15 + x2 * (-17.0f / 315))));
  return magnitude < 0.0625f ? odd : (x < 0.0f ? -wide : wide);
}

// bfloat16 rounding (nearest even) of 16 floats at once; NaN stays NaN. With AVX512-BF16 one
// instruction does it, but that instruction flushes float32 subnormals (|x| < 2^-126) to
// zero where torch keeps them; they do not occur in activations.
inline vhalf to_bf16(vfloat v) {
#if defined(__AVX512BF16__)
  __m512 x;
  std::memcpy(&x, &v, sizeof x);
  const __m256bh packed = _mm512_cvtneps_pbh(x);
  vhalf h;
  std::memcpy(&h, &packed, sizeof h);
  return h;
#else
  vuint bits;
  std::memcpy(&bits, &v, sizeof bits);
  const vuint rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  const vuint nan = (bits >> 16) | 0x40u;
  const vuint chosen = (bits & 0x7fffffffu) > 0x7f800000u ? nan : rounded;
  return __builtin_convertvector(chosen, vhalf);
#endif
}

inline void store(bf16* dst, vfloat v) {
  const vhalf h = to_bf16(v);
  std::memcpy(dst, &h, sizeof h);
}

// Rounds to the storage type and back: torch rounds every elementwise result to the tensor's
// dtype, so kernels that fuse several of its ops round between them the same way.
inline vfloat round_to(vfloat v, const float*) { return v; }

inline vfloat round_to(vfloat v, const bf16*) {
  const vuint bits = __builtin_convertvector(to_bf16(v), vuint) << 16;
  vfloat out;
  std::memcpy(&out, &bits, sizeof out);
  return out;
}

}  // namespace llmserve
