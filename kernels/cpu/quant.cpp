// Weights kept in GGUF blocks (issue #27): dequantization and the exact-mode linear layer.
//
// A block holds 32 consecutive weights of a row and its scale(s), as ggml lays them out
// (type codes are ggml's):
//   Q4_0 (2):  fp16 d, 16 bytes of 4-bit q (weights 0-15 in the low nibbles, 16-31 in the
//              high ones); w = d * (q - 8). 18 bytes.
//   Q4_1 (3):  fp16 d, fp16 m, the same 16 bytes; w = d * q + m. 20 bytes.
//   Q8_0 (8):  fp16 d, 32 int8 q; w = q * d. 34 bytes.
// Each weight is computed with the same float32 operations, in the same order, as the gguf
// package's numpy dequantization (which is what transformers loads), so a dequantized weight
// is bit-identical to HF's. This file is built with -ffp-contract=off for that: a fused
// d * q + m would round once instead of twice.
//
// Exact mode: a row of the weight is dequantized into a float32 buffer on the stack (L1) and
// dotted with every activation row, so the output equals HF's dequantized float32 matmul up
// to summation order. (Fast mode, 8-bit activations and integer dot products, comes later.)

#include <cstdint>
#include <cstring>

#include "pool.h"
#include "vec.h"

namespace llmserve {
namespace {

constexpr int kBlock = 32;
constexpr int kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8;
// Longest row this file dequantizes on the stack (floats): 64 KiB.
constexpr int64_t kMaxRow = 16384;

int64_t block_bytes(int type) {
  switch (type) {
    case kQ4_0: return 18;
    case kQ4_1: return 20;
    case kQ8_0: return 34;
    default: return 0;
  }
}

// IEEE half to float, exact (every half is a float).
inline float half_to_float(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, sizeof h);
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
}

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

template <int Type>
void dequantize_row(const uint8_t* row, int64_t cols, float* out) {
  const int64_t bytes = block_bytes(Type);
  for (int64_t b = 0; b < cols / kBlock; ++b) dequantize_block<Type>(row + b * bytes, out + b * kBlock);
}

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

// sum_k a[k] * b[k], k < n (a multiple of 32), in 4 accumulators of kLanes.
inline float dot(const float* a, const float* b, int64_t n) {
  vfloat acc[4] = {};
  for (int64_t k = 0; k < n; k += 4 * kLanes) {
    for (int u = 0; u < 4 && k + u * kLanes < n; ++u) {
      vfloat x, y;
      std::memcpy(&x, a + k + u * kLanes, sizeof x);
      std::memcpy(&y, b + k + u * kLanes, sizeof y);
      acc[u] = fmadd(x, y, acc[u]);
    }
  }
  const vfloat sum = (acc[0] + acc[1]) + (acc[2] + acc[3]);
  float total = 0.0f;
  for (int i = 0; i < kLanes; ++i) total += sum[i];
  return total;
}

template <int Type>
void linear(const float* x, int64_t n, int64_t in, const uint8_t* w, int64_t out_features,
            float* out) {
  const int64_t row_bytes = in / kBlock * block_bytes(Type);
  parallel_for(out_features, out_features * n * in > (1 << 16), [&](int64_t begin, int64_t end) {
    alignas(64) float row[kMaxRow];
    for (int64_t o = begin; o < end; ++o) {
      dequantize_row<Type>(w + o * row_bytes, in, row);
      for (int64_t i = 0; i < n; ++i) out[i * out_features + o] = dot(x + i * in, row, in);
    }
  });
}

template <typename Fn>
int dispatch(int type, Fn&& fn) {
  switch (type) {
    case kQ4_0: fn.template operator()<kQ4_0>(); return 0;
    case kQ4_1: fn.template operator()<kQ4_1>(); return 0;
    case kQ8_0: fn.template operator()<kQ8_0>(); return 0;
    default: return -1;
  }
}

}  // namespace
}  // namespace llmserve

using namespace llmserve;

extern "C" {

// Bytes of one 32-weight block of ggml type `type`; 0 for a type without a kernel here.
int llmserve_quant_block_bytes(int type) { return int(block_bytes(type)); }

// weights [rows, cols / 32 blocks] -> out [rows, cols] float32. Returns -1 for an unknown type.
int llmserve_quant_dequantize(int type, const uint8_t* weights, int64_t rows, int64_t cols,
                              float* out) {
  return dispatch(type, [&]<int Type>() {
    const int64_t row_bytes = cols / kBlock * block_bytes(Type);
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
  if (in % kBlock != 0 || in > kMaxRow) return -1;
  return dispatch(type, [&]<int Type>() { linear<Type>(x, n, in, weights, out_features, out); });
}

}  // extern "C"
