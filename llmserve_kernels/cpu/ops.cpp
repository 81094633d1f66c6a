// Fused elementwise ops of the decoder for CPUs (the norms of every family, rotary, SiLU- and
// GELU-and-multiply, soft-capping) and the K/V cache writes (the sampler's row reductions:
// sampling_rows.cpp).
//
// Each op replaces a chain of torch calls that costs more in dispatch and in passes over
// memory than in arithmetic at decode batch sizes (tens of tokens). They keep torch's
// rounding: every intermediate result that torch would store in the model dtype is rounded
// to it here too (round_to), and products are not contracted into fused multiply-adds
// (the library is built with -ffp-contract=off), so float32 results match torch's up to the
// order of summation in the RMSNorm mean and the exp in SiLU (last-bit differences).
//
// Entry points (extern "C", called through ctypes; dtype 0 = float32, 1 = bfloat16):
//   llmserve_norm             (residual += x, then) out = normalize(x or residual), the weight
//                             applied as Llama, OLMo 2 or Gemma do
//   llmserve_head_norm        the same in place on the first heads of each row (q/k norms)
//   llmserve_rotary           rotary embedding in place on the first heads of each row
//   llmserve_silu_mul         out = silu(gate) * up, gate and up side by side in one row
//   llmserve_gelu_tanh_mul    out = gelu_tanh(gate) * up, likewise (GeGLU)
//   llmserve_softcap          x = tanh(x / cap) * cap in place
//   llmserve_write_kv         store the step's keys and values in their cache slots
//   llmserve_convert_rows     rows of float32 to bfloat16 (nearest even, as torch casts) or back

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#include "pool.h"
#include "vec.h"

namespace {

using namespace llmserve;


// Loads n <= kLanes values (a whole vector, or the tail of a row padded with `fill`).
template <typename T>
inline vfloat load_partial(const T* src, int64_t n, float fill) {
  if (n == kLanes) return load(src);
  alignas(64) float tmp[kLanes];
  for (int i = 0; i < kLanes; ++i) tmp[i] = i < n ? to_float(src[i]) : fill;
  return load(tmp);
}

template <typename T>
inline void store_partial(T* dst, vfloat v, int64_t n) {
  if (n == kLanes) {
    store(dst, v);
    return;
  }
  for (int64_t i = 0; i < n; ++i) store_scalar(dst + i, v[i]);
}

// How a norm applies its weight to x32 = x * rsqrt(mean(x^2) + eps) (float32), each in its
// reference's order: kRms: weight * x32 rounded to T (Llama); kRmsF32: weight * x32 in
// float32 (OLMo 2); kGemma: x32 * (1 + weight) in float32 (Gemma). The result is rounded to T.
enum NormKind { kRms = 0, kRmsF32 = 1, kGemma = 2 };

template <int Kind, typename T>
void rms_norm_row(const T* x, const T* weight, T* out, int64_t hidden, float eps) {
  vfloat squares = vfloat{};
  int64_t i = 0;
  for (; i + kLanes <= hidden; i += kLanes) {
    const vfloat v = load(x + i);
    squares += v * v;
  }
  float tail = 0.0f;
  for (; i < hidden; ++i) tail += to_float(x[i]) * to_float(x[i]);
  const float mean = (hsum(squares) + tail) / float(hidden);
  const float inv = 1.0f / std::sqrt(mean + eps);
  for (i = 0; i < hidden; i += kLanes) {
    const int64_t m = std::min<int64_t>(kLanes, hidden - i);
    const vfloat normed = load_partial(x + i, m, 0.0f) * inv;
    const vfloat w = load_partial(weight + i, m, 0.0f);
    if constexpr (Kind == kRms)
      store_partial(out + i, w * round_to(normed, out), m);
    else if constexpr (Kind == kRmsF32)
      store_partial(out + i, w * normed, m);
    else
      store_partial(out + i, normed * (1.0f + w), m);
  }
}

template <int Kind, typename T>
void rms_norm(const T* x, T* residual, const T* weight, T* out, int64_t n, int64_t hidden,
              float eps) {
  parallel_for(n, n * hidden >= kParallelElements, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* src = x + r * hidden;
      if (residual != nullptr) {  // residual += x first; the norm reads the sum
        T* res = residual + r * hidden;
        int64_t i = 0;
        for (; i + kLanes <= hidden; i += kLanes) store(res + i, load(res + i) + load(src + i));
        for (; i < hidden; ++i) store_scalar(res + i, to_float(res[i]) + to_float(src[i]));
        src = res;
      }
      rms_norm_row<Kind>(src, weight, out + r * hidden, hidden, eps);
    }
  });
}

// Calls f(std::integral_constant<int, Kind>) for a NormKind code; -1 for any other code.
template <typename F>
int with_norm_kind(int kind, F&& f) {
  if (kind == kRms) f(std::integral_constant<int, kRms>{});
  else if (kind == kRmsF32) f(std::integral_constant<int, kRmsF32>{});
  else if (kind == kGemma) f(std::integral_constant<int, kGemma>{});
  else return -1;
  return 0;
}

template <typename T>
int norm_of_kind(int kind, const void* x, void* residual, const void* weight, void* out,
                 int64_t n, int64_t hidden, float eps) {
  return with_norm_kind(kind, [&](auto tag) {
    rms_norm<decltype(tag)::value>(static_cast<const T*>(x), static_cast<T*>(residual),
                                   static_cast<const T*>(weight), static_cast<T*>(out), n,
                                   hidden, eps);
  });
}

// Heads [0, heads) of each of n rows (rows row_stride apart), each head_dim wide, normalized
// in place with one weight for every head.
template <typename T>
int head_norm_of_kind(int kind, void* x, int64_t row_stride, int64_t n, int64_t heads,
                      int64_t head_dim, const void* weight, float eps) {
  return with_norm_kind(kind, [&](auto tag) {
    T* rows = static_cast<T*>(x);
    const T* w = static_cast<const T*>(weight);
    parallel_for(n, n * heads * head_dim >= kParallelElements, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r)
        for (int64_t h = 0; h < heads; ++h) {
          T* head = rows + r * row_stride + h * head_dim;
          rms_norm_row<decltype(tag)::value>(head, w, head, head_dim, eps);
        }
    });
  });
}

// out_i = x_i cos_i + rot(x)_i sin_i with rot(x) = (-x[half:], x[:half]); each product and
// the sum rounded to T, as torch computes `x * cos + rotated * sin`. The first rotary_dim
// dims of each head rotate (the tables' width); heads lie head_stride apart in a row.
template <typename T>
void rotary(T* qkv, int64_t row_stride, const int64_t* positions, const T* cos, const T* sin,
            int64_t n, int64_t num_heads, int64_t head_stride, int64_t rotary_dim) {
  const int64_t head_dim = rotary_dim, half = rotary_dim / 2;
  parallel_for(n, n * num_heads * head_dim >= kParallelElements, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* c = cos + positions[r] * head_dim;
      const T* s = sin + positions[r] * head_dim;
      for (int64_t h = 0; h < num_heads; ++h) {
        T* x = qkv + r * row_stride + h * head_stride;
        for (int64_t i0 = 0; i0 < half; i0 += kLanes) {
          const int64_t m = std::min<int64_t>(kLanes, half - i0);
          const vfloat lo = load_partial(x + i0, m, 0.0f);
          const vfloat hi = load_partial(x + half + i0, m, 0.0f);
          const T* T_ptr = nullptr;
          const vfloat lo_cos = round_to(lo * load_partial(c + i0, m, 0.0f), T_ptr);
          const vfloat lo_sin = round_to(-hi * load_partial(s + i0, m, 0.0f), T_ptr);
          const vfloat hi_cos = round_to(hi * load_partial(c + half + i0, m, 0.0f), T_ptr);
          const vfloat hi_sin = round_to(lo * load_partial(s + half + i0, m, 0.0f), T_ptr);
          store_partial(x + i0, lo_cos + lo_sin, m);
          store_partial(x + half + i0, hi_cos + hi_sin, m);
        }
      }
    }
  });
}

// silu(g) = g * sigmoid(g), rounded to T, times up, rounded to T.
template <typename T>
void silu_mul(const T* gate_up, T* out, int64_t n, int64_t inter) {
  parallel_for(n, n * inter >= kParallelElements, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* gate = gate_up + r * 2 * inter;
      const T* up = gate + inter;
      T* dst = out + r * inter;
      const T* T_ptr = nullptr;
      for (int64_t i = 0; i < inter; i += kLanes) {
        const int64_t m = std::min<int64_t>(kLanes, inter - i);
        const vfloat g = load_partial(gate + i, m, 0.0f);
        // sigmoid(g) from e = exp(-|g|) <= 1: 1 / (1 + e) for g >= 0, e / (1 + e) below.
        const vfloat e = exp_nonpositive(g < 0.0f ? g : -g);
        const vfloat sigmoid = (g < 0.0f ? e : splat(1.0f)) / (1.0f + e);
        const vfloat silu = round_to(g * sigmoid, T_ptr);
        store_partial(dst + i, silu * load_partial(up + i, m, 0.0f), m);
      }
    }
  });
}

// gelu(g) with the tanh approximation, 0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3))) in
// torch's order, rounded to T, times up, rounded to T.
template <typename T>
void gelu_tanh_mul(const T* gate_up, T* out, int64_t n, int64_t inter) {
  constexpr float kBeta = 0.7978845608028654f;  // sqrt(2 / pi)
  constexpr float kKappa = 0.044715f;
  parallel_for(n, n * inter >= kParallelElements, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* gate = gate_up + r * 2 * inter;
      const T* up = gate + inter;
      const T* T_ptr = nullptr;
      for (int64_t i = 0; i < inter; i += kLanes) {
        const int64_t m = std::min<int64_t>(kLanes, inter - i);
        const vfloat g = load_partial(gate + i, m, 0.0f);
        const vfloat inner = kBeta * (g + kKappa * (g * g * g));
        const vfloat gelu = round_to(0.5f * g * (1.0f + tanh_any(inner)), T_ptr);
        store_partial(out + r * inter + i, gelu * load_partial(up + i, m, 0.0f), m);
      }
    }
  });
}

// x = tanh(x / cap) * cap in place, each step rounded to T (torch's `tanh(x / cap) * cap`).
template <typename T>
void softcap(T* x, int64_t count, float cap) {
  const T* T_ptr = nullptr;
  const int64_t chunks = (count + kParallelElements - 1) / kParallelElements;
  parallel_for(chunks, chunks > 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin * kParallelElements; i < std::min(count, end * kParallelElements);
         i += kLanes) {
      const int64_t m = std::min<int64_t>(kLanes, count - i);
      const vfloat scaled = round_to(load_partial(x + i, m, 0.0f) / cap, T_ptr);
      store_partial(x + i, round_to(tanh_any(scaled), T_ptr) * cap, m);
    }
  });
}

// dst row i (contiguous, `cols` elements) = src row i (rows `src_stride` elements apart) in
// D's type.
template <typename S, typename D>
void convert_rows(const S* src, int64_t src_stride, int64_t rows, int64_t cols, D* dst) {
  parallel_for(rows, rows * cols >= kParallelElements, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const S* from = src + i * src_stride;
      D* to = dst + i * cols;
      int64_t j = 0;
      for (; j + kLanes <= cols; j += kLanes) store(to + j, load(from + j));
      for (; j < cols; ++j) store_scalar(to + j, to_float(from[j]));
    }
  });
}

// Copies each token's key and value rows (row_elems values, rows row_stride apart, e.g. views
// into the QKV projection) to its flat cache slot, block * block_size + offset, at element
// block * block_stride + offset * row_elems of each cache (blocks may lie further apart than
// block_size rows: paged_attention.cpp); a negative slot means padding: skipped.
template <typename T>
void write_kv(const T* key, const T* value, int64_t row_stride, const int64_t* slots, int64_t n,
              int64_t row_elems, T* key_cache, T* value_cache, int64_t block_size,
              int64_t block_stride) {
  parallel_for(n, n * row_elems >= kParallelElements, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t slot = slots[i];
      if (slot < 0) continue;
      const int64_t at = slot / block_size * block_stride + slot % block_size * row_elems;
      std::memcpy(key_cache + at, key + i * row_stride, row_elems * sizeof(T));
      std::memcpy(value_cache + at, value + i * row_stride, row_elems * sizeof(T));
    }
  });
}

}  // namespace

extern "C" {

// kind: NormKind (0 Llama, 1 OLMo 2, 2 Gemma).
int llmserve_norm(int dtype, int kind, const void* x, void* residual, const void* weight,
                  void* out, int64_t n, int64_t hidden, float eps) {
  if (dtype == 0) return norm_of_kind<float>(kind, x, residual, weight, out, n, hidden, eps);
  if (dtype == 1) return norm_of_kind<bf16>(kind, x, residual, weight, out, n, hidden, eps);
  return -1;
}

// x: heads [0, heads) of n rows, row_stride elements apart, normalized in place.
int llmserve_head_norm(int dtype, int kind, void* x, int64_t row_stride, int64_t n,
                       int64_t heads, int64_t head_dim, const void* weight, float eps) {
  if (dtype == 0)
    return head_norm_of_kind<float>(kind, x, row_stride, n, heads, head_dim, weight, eps);
  if (dtype == 1)
    return head_norm_of_kind<bf16>(kind, x, row_stride, n, heads, head_dim, weight, eps);
  return -1;
}

int llmserve_rotary(int dtype, void* qkv, int64_t row_stride, const int64_t* positions,
                    const void* cos, const void* sin, int64_t n, int64_t num_heads,
                    int64_t head_stride, int64_t rotary_dim) {
  if (rotary_dim % 2 || rotary_dim > head_stride) return -1;
  if (dtype == 0) {
    rotary(static_cast<float*>(qkv), row_stride, positions, static_cast<const float*>(cos),
           static_cast<const float*>(sin), n, num_heads, head_stride, rotary_dim);
  } else if (dtype == 1) {
    rotary(static_cast<bf16*>(qkv), row_stride, positions, static_cast<const bf16*>(cos),
           static_cast<const bf16*>(sin), n, num_heads, head_stride, rotary_dim);
  } else {
    return -1;
  }
  return 0;
}

int llmserve_silu_mul(int dtype, const void* gate_up, void* out, int64_t n, int64_t inter) {
  if (dtype == 0) {
    silu_mul(static_cast<const float*>(gate_up), static_cast<float*>(out), n, inter);
  } else if (dtype == 1) {
    silu_mul(static_cast<const bf16*>(gate_up), static_cast<bf16*>(out), n, inter);
  } else {
    return -1;
  }
  return 0;
}

int llmserve_gelu_tanh_mul(int dtype, const void* gate_up, void* out, int64_t n,
                           int64_t inter) {
  if (dtype == 0) {
    gelu_tanh_mul(static_cast<const float*>(gate_up), static_cast<float*>(out), n, inter);
  } else if (dtype == 1) {
    gelu_tanh_mul(static_cast<const bf16*>(gate_up), static_cast<bf16*>(out), n, inter);
  } else {
    return -1;
  }
  return 0;
}

int llmserve_softcap(int dtype, void* x, int64_t count, float cap) {
  if (dtype == 0) {
    softcap(static_cast<float*>(x), count, cap);
  } else if (dtype == 1) {
    softcap(static_cast<bf16*>(x), count, cap);
  } else {
    return -1;
  }
  return 0;
}

// src_dtype -> dst_dtype: 0 -> 1 or 1 -> 0 (float32, bfloat16); -1 otherwise.
int llmserve_convert_rows(int src_dtype, int dst_dtype, const void* src, int64_t src_stride,
                          int64_t rows, int64_t cols, void* dst) {
  if (src_dtype == 0 && dst_dtype == 1) {
    convert_rows(static_cast<const float*>(src), src_stride, rows, cols, static_cast<bf16*>(dst));
  } else if (src_dtype == 1 && dst_dtype == 0) {
    convert_rows(static_cast<const bf16*>(src), src_stride, rows, cols, static_cast<float*>(dst));
  } else {
    return -1;
  }
  return 0;
}

int llmserve_write_kv(int dtype, const void* key, const void* value, int64_t row_stride,
                      const int64_t* slots, int64_t n, int64_t row_elems, void* key_cache,
                      void* value_cache, int64_t block_size, int64_t block_stride) {
  if (dtype == 0) {
    write_kv(static_cast<const float*>(key), static_cast<const float*>(value), row_stride, slots,
             n, row_elems, static_cast<float*>(key_cache), static_cast<float*>(value_cache),
             block_size, block_stride);
  } else if (dtype == 1) {
    write_kv(static_cast<const bf16*>(key), static_cast<const bf16*>(value), row_stride, slots, n,
             row_elems, static_cast<bf16*>(key_cache), static_cast<bf16*>(value_cache),
             block_size, block_stride);
  } else {
    return -1;
  }
  return 0;
}

}  // extern "C"
