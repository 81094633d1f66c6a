// Weights kept in GGUF blocks (issue #27): dequantization and the exact-mode linear layer.
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
// Exact mode: a row of the weight is dequantized into a float32 buffer on the stack (L1) and
// dotted with every activation row, so the output equals HF's dequantized float32 matmul up
// to summation order.
//
// Fast mode: each activation row is first quantized per block of 32 to 8 bits, as
//   ActBlock: float d = max|x| / 127, q = round_half_even(x * (1 / d)), float s = d * sum(q),
// and a weight block's dot with it is an integer dot product of the 32 pairs of quants
// (AVX2: `vpmaddubsw` multiplies unsigned by signed bytes and adds pairs to 16 bits, then
// `vpmaddwd` adds pairs to 32 bits) and one float multiply-add per block:
//   Q4_0: d_w * d * sum(q_w q) - 8 * d_w * s     (w = d_w * (q_w - 8))
//   Q4_1: d_w * d * sum(q_w q) + m_w * s         (w = d_w * q_w + m_w)
//   Q8_0: d_w * d * sum(q_w q)
// so its error against exact mode is the activations' rounding to 8 bits (about 0.4% of a
// block's largest value per element). An unpacked weight block serves four activation rows.

#include <cmath>
#include <cstdint>
#include <algorithm>
#include <cstring>
#include <vector>

#include <immintrin.h>

#include "pool.h"
#include "vec.h"

namespace llmserve {
namespace {

constexpr int kBlock = 32;       // weights per block of the 32-weight types
constexpr int kSuperBlock = 256;  // weights per block of the k-quants
constexpr int kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ8_0 = 8, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14;

constexpr bool is_k_quant(int type) { return type == kQ4_K || type == kQ5_K || type == kQ6_K; }
constexpr int64_t block_weights(int type) { return is_k_quant(type) ? kSuperBlock : kBlock; }
// Types the fast mode multiplies with integer dot products; the others multiply in exact mode.
constexpr bool has_fast_kernel(int type) { return type == kQ4_0 || type == kQ4_1 || type == kQ8_0; }
// Longest row this file dequantizes on the stack (floats): 64 KiB.
constexpr int64_t kMaxRow = 16384;

int64_t block_bytes(int type) {
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

// Q4_K's packed 6-bit scale and min of sub-block j (0..7).
inline void k_scale_min(const uint8_t* packed, int j, int& scale, int& min) {
  if (j < 4) {
    scale = packed[j] & 0x3f;
    min = packed[j + 4] & 0x3f;
  } else {
    scale = (packed[j + 4] & 0x0f) | ((packed[j - 4] >> 2) & 0x30);
    min = (packed[j + 4] >> 4) | ((packed[j] >> 2) & 0x30);
  }
}

// Q4_K's and Q5_K's super-block: w = (d * sc) * q - dmin * m, the package's operations.
template <bool kFifthBit>
inline void dequantize_q45_k(const uint8_t* block, float* out) {
  const float d = half_to_float(block), dmin = half_to_float(block + 2);
  const uint8_t* packed = block + 4;
  const uint8_t* high = block + 16;  // Q5_K only
  const uint8_t* q = block + (kFifthBit ? 48 : 16);
  for (int j = 0; j < 8; ++j) {
    int scale, min;
    k_scale_min(packed, j, scale, min);
    const float dl = d * float(scale), ml = dmin * float(min);
    const uint8_t* pair = q + 32 * (j / 2);
    for (int t = 0; t < 32; ++t) {
      int value = (pair[t] >> (4 * (j % 2))) & 0x0f;
      if constexpr (kFifthBit) value |= ((high[t] >> j) & 1) << 4;
      out[32 * j + t] = dl * float(value) - ml;
    }
  }
}

// Q6_K's super-block: w = (d * scale) * (q - 32).
inline void dequantize_q6_k(const uint8_t* block, float* out) {
  const uint8_t* low = block;
  const uint8_t* high = block + 128;
  const int8_t* scales = reinterpret_cast<const int8_t*>(block + 192);
  const float d = half_to_float(block + 208);
  for (int p = 0; p < kSuperBlock; ++p) {
    const int half = p / 128, k = (p % 128) / 64, s = (p % 128) / 32;
    const int l = (low[64 * half + p % 64] >> (4 * k)) & 0x0f;
    const int h = (high[32 * half + p % 32] >> (2 * s)) & 0x03;
    out[p] = (d * float(scales[p / 16])) * float((l | h << 4) - 32);
  }
}

template <int Type>
void dequantize_row(const uint8_t* row, int64_t cols, float* out) {
  const int64_t bytes = block_bytes(Type), weights = block_weights(Type);
  for (int64_t b = 0; b < cols / weights; ++b) {
    const uint8_t* block = row + b * bytes;
    float* dst = out + b * weights;
    if constexpr (Type == kQ5_0) dequantize_q5_0(block, dst);
    else if constexpr (Type == kQ4_K) dequantize_q45_k<false>(block, dst);
    else if constexpr (Type == kQ5_K) dequantize_q45_k<true>(block, dst);
    else if constexpr (Type == kQ6_K) dequantize_q6_k(block, dst);
    else dequantize_block<Type>(block, dst);
  }
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

// Weight rows are a few hundred bytes, too short for the hardware prefetcher to ramp up on:
// a kernel reading rows in order prefetches, at each row, the one kPrefetchBytes ahead of it
// (measured on the 2-core EPYC, Q4_1 rows of 576 weights streamed from memory by the fast
// kernel: 12.6 GB/s without, 18 with).
constexpr int64_t kPrefetchBytes = 2048;

inline void prefetch_ahead(const uint8_t* row, int64_t row_bytes, const uint8_t* end) {
  const uint8_t* next = row + std::max<int64_t>(1, kPrefetchBytes / row_bytes) * row_bytes;
  for (int64_t byte = 0; byte < row_bytes && next + byte < end; byte += 64)
    _mm_prefetch(reinterpret_cast<const char*>(next + byte), _MM_HINT_T0);
}

template <int Type>
void linear(const float* x, int64_t n, int64_t in, const uint8_t* w, int64_t out_features,
            float* out) {
  const int64_t row_bytes = in / block_weights(Type) * block_bytes(Type);
  parallel_for(out_features, out_features * n * in > (1 << 16), [&](int64_t begin, int64_t end) {
    alignas(64) float row[kMaxRow];
    for (int64_t o = begin; o < end; ++o) {
      prefetch_ahead(w + o * row_bytes, row_bytes, w + out_features * row_bytes);
      dequantize_row<Type>(w + o * row_bytes, in, row);
      for (int64_t i = 0; i < n; ++i) out[i * out_features + o] = dot(x + i * in, row, in);
    }
  });
}


// ---- fast mode ------------------------------------------------------------------------

struct ActBlock {  // d and s adjacent: block_scales reads them as a pair
  float d;  // scale: x ~ d * q
  float s;  // d * sum(q)
  int8_t q[kBlock];
};

// Row x[0..cols) into cols / 32 ActBlocks (see the file comment).
void quantize_activations(const float* x, int64_t cols, ActBlock* out) {
  for (int64_t b = 0; b < cols / kBlock; ++b) {
    const float* v = x + b * kBlock;
    ActBlock& block = out[b];
    float amax = 0.0f;
    for (int j = 0; j < kBlock; ++j) amax = std::max(amax, std::fabs(v[j]));
    const float d = amax / 127.0f;
    const float inverse = d != 0.0f ? 1.0f / d : 0.0f;
    int sum = 0;
    for (int j = 0; j < kBlock; ++j) {
      const int q = int(std::nearbyint(v[j] * inverse));  // the default mode: half to even
      block.q[j] = int8_t(q);
      sum += q;
    }
    block.d = d;
    block.s = d * float(sum);
  }
}

#if defined(__AVX2__) && defined(__F16C__)
// 32 weight quants of a block in weight order, as bytes: unsigned 0..15 for the 4-bit types,
// signed for Q8_0.
template <int Type>
inline __m256i weight_quants(const uint8_t* block) {
  if constexpr (Type == kQ8_0) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 2));
  } else {
    // The 16 packed bytes in both halves; the high half shifted right by 4: low nibbles
    // (weights 0-15) below, high nibbles (16-31) above.
    const __m256i packed = _mm256_broadcastsi128_si256(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + (Type == kQ4_1 ? 4 : 2))));
    const __m256i shifted = _mm256_srlv_epi32(packed, _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4));
    return _mm256_and_si256(shifted, _mm256_set1_epi8(0x0f));
  }
}

// A block's scale and offset times an activation block's, in two lanes of one multiply:
// [d_w * d, o_w * s] with o_w Q4_1's m_w, Q4_0's -8 * d_w, Q8_0's 0 (its lane unused).
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
    if constexpr (Type == kQ4_0)  // [d_w, -8 * d_w, 0, 0]
      w = _mm_mul_ps(_mm_shuffle_ps(w, w, 0), _mm_setr_ps(1.0f, -8.0f, 0.0f, 0.0f));
  }
  double pair;
  std::memcpy(&pair, d_and_s, sizeof pair);
  return _mm_mul_ps(w, _mm_castpd_ps(_mm_set_sd(pair)));
}

// sum_j w[j] * a[j] over a block, in 8 int32 lanes.
template <int Type>
inline __m256i block_dot(__m256i w, const int8_t* a) {
  __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a));
  if constexpr (Type == kQ8_0) {  // signed x signed: |w| times x with w's sign
    x = _mm256_sign_epi8(x, w);
    w = _mm256_sign_epi8(w, w);
  }
  const __m256i pairs = _mm256_maddubs_epi16(w, x);  // |products| <= 2 * 128 * 127: no saturation
  return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
}

inline float hsum(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
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
  // multiply-adds per row would wait on its own latency.
  constexpr int kChains = M == 1 ? 4 : 2;
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
    const float m_w = Type == kQ4_1 ? half_to_float(block + 2) : Type == kQ4_0 ? -8.0f * d : 0.0f;
    int w[kBlock];
    if constexpr (Type == kQ8_0) {
      for (int j = 0; j < kBlock; ++j) w[j] = reinterpret_cast<const int8_t*>(block + 2)[j];
    } else {
      const uint8_t* q = block + (Type == kQ4_1 ? 4 : 2);
      for (int j = 0; j < kBlock / 2; ++j) {
        w[j] = q[j] & 0x0f;
        w[j + kBlock / 2] = q[j] >> 4;
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

constexpr int kFastRows = 4;  // activation rows that share an unpacked weight block

template <int Type>
void linear_fast(const float* x, int64_t n, int64_t in, const uint8_t* w, int64_t out_features,
                 float* out) {
  const int64_t blocks = in / kBlock, row_bytes = blocks * block_bytes(Type);
  thread_local std::vector<ActBlock> activations;
  activations.resize(size_t(n * blocks));
  for (int64_t i = 0; i < n; ++i) quantize_activations(x + i * in, in, activations.data() + i * blocks);
  const ActBlock* a = activations.data();
  parallel_for(out_features, out_features * n * in > (1 << 16), [&](int64_t begin, int64_t end) {
    for (int64_t o = begin; o < end; ++o) {
      const uint8_t* row = w + o * row_bytes;
      prefetch_ahead(row, row_bytes, w + out_features * row_bytes);
      int64_t i = 0;
      for (; i + kFastRows <= n; i += kFastRows)
        fast_dots<Type, kFastRows>(row, blocks, a + i * blocks, out + i * out_features + o,
                                   out_features);
      for (; i < n; ++i)
        fast_dots<Type, 1>(row, blocks, a + i * blocks, out + i * out_features + o, out_features);
    }
  });
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

}  // namespace
}  // namespace llmserve

using namespace llmserve;

extern "C" {

// Bytes of one block of ggml type `type`; 0 for a type without a kernel here.
int llmserve_quant_block_bytes(int type) { return int(block_bytes(type)); }

// Weights in one block of `type` (32, or 256 for the k-quants).
int llmserve_quant_block_weights(int type) { return int(block_weights(type)); }

// 1 if fast mode has integer dot products for `type` (else its fast mode is exact mode's).
int llmserve_quant_has_fast_kernel(int type) { return has_fast_kernel(type) ? 1 : 0; }

// weights [rows, cols / 32 blocks] -> out [rows, cols] float32. Returns -1 for an unknown type.
int llmserve_quant_dequantize(int type, const uint8_t* weights, int64_t rows, int64_t cols,
                              float* out) {
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

// The same product in fast mode: x quantized to 8 bits per block of 32, integer dot
// products; for a type without them (has_fast_kernel), exact mode's product. `in` is a
// multiple of the type's block. Returns -1 for an unknown type.
int llmserve_quant_linear_fast(int type, const float* x, int64_t n, int64_t in,
                               const uint8_t* weights, int64_t out_features, float* out) {
  if (!has_fast_kernel(type))
    return llmserve_quant_linear(type, x, n, in, weights, out_features, out);
  if (in % kBlock != 0) return -1;
  return dispatch(type, [&]<int Type>() {
    if constexpr (has_fast_kernel(Type)) linear_fast<Type>(x, n, in, weights, out_features, out);
  });
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
