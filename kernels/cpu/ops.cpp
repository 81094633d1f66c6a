// Fused elementwise ops of the Llama decoder for CPUs, and the sampler's row reductions.
//
// Each op replaces a chain of torch calls that costs more in dispatch and in passes over
// memory than in arithmetic at decode batch sizes (tens of tokens). They keep torch's
// rounding: every intermediate result that torch would store in the model dtype is rounded
// to it here too (round_to), and products are not contracted into fused multiply-adds
// (the library is built with -ffp-contract=off), so float32 results match torch's up to the
// order of summation in the RMSNorm mean and the exp in SiLU (last-bit differences).
//
// Entry points (extern "C", called through ctypes; dtype 0 = float32, 1 = bfloat16):
//   llmserve_rms_norm         out = weight * normalize(x)
//   llmserve_add_rms_norm     residual += x, then out = weight * normalize(residual)
//   llmserve_rotary           rotary embedding in place on the first heads of each row
//   llmserve_silu_mul         out = silu(gate) * up, gate and up side by side in one row
//   llmserve_write_kv         store the step's keys and values in their cache slots
//   llmserve_argmax_logsumexp per row of logits: maximum, first argmax, log-sum-exp (float32)

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "pool.h"
#include "vec.h"

namespace {

using namespace llmserve;

constexpr int64_t kParallelElements = 1 << 15;  // smaller ops run on the calling thread

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

// x32 = x * rsqrt(mean(x^2) + eps) in float32, rounded to T, then weight * that rounded to T:
// the reference order (normalize in float32, scale in the model dtype).
template <typename T>
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
  for (i = 0; i + kLanes <= hidden; i += kLanes) {
    const vfloat normed = round_to(load(x + i) * inv, out);
    store(out + i, load(weight + i) * normed);
  }
  for (; i < hidden; ++i) {
    float normed = to_float(x[i]) * inv;
    if constexpr (sizeof(T) == 2) normed = round_to(splat(normed), out)[0];
    store_scalar(out + i, to_float(weight[i]) * normed);
  }
}

template <typename T>
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
      rms_norm_row(src, weight, out + r * hidden, hidden, eps);
    }
  });
}

// out_i = x_i cos_i + rot(x)_i sin_i with rot(x) = (-x[half:], x[:half]); each product and
// the sum rounded to T, as torch computes `x * cos + rotated * sin`.
template <typename T>
void rotary(T* qkv, int64_t row_stride, const int64_t* positions, const T* cos, const T* sin,
            int64_t n, int64_t num_heads, int64_t head_dim) {
  const int64_t half = head_dim / 2;
  parallel_for(n, n * num_heads * head_dim >= kParallelElements, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* c = cos + positions[r] * head_dim;
      const T* s = sin + positions[r] * head_dim;
      for (int64_t h = 0; h < num_heads; ++h) {
        T* x = qkv + r * row_stride + h * head_dim;
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

// Copies each token's key and value rows (row_elems values, rows row_stride apart, e.g. views
// into the QKV projection) to its flat cache slot; a negative slot means padding: skipped.
template <typename T>
void write_kv(const T* key, const T* value, int64_t row_stride, const int64_t* slots, int64_t n,
              int64_t row_elems, T* key_cache, T* value_cache) {
  parallel_for(n, n * row_elems >= kParallelElements, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t slot = slots[i];
      if (slot < 0) continue;
      std::memcpy(key_cache + slot * row_elems, key + i * row_stride, row_elems * sizeof(T));
      std::memcpy(value_cache + slot * row_elems, value + i * row_stride, row_elems * sizeof(T));
    }
  });
}

// Per row: its maximum, the first index holding it (NaN never wins), and log(sum(exp(row))),
// in float32 whatever the storage type (bfloat16 logits are read as they are, never copied
// to float32). Two passes: the maximum, then the index and the sum of exponentials together.
template <typename T>
void argmax_logsumexp(const T* logits, int64_t n, int64_t vocab, int64_t* argmax, float* lse,
                      float* max) {
  // One row per thread: a single row (batch 1) stays on the calling thread.
  parallel_for(n, n > 1 && n * vocab >= kParallelElements, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* row = logits + r * vocab;
      vfloat best = splat(-std::numeric_limits<float>::infinity());
      int64_t i = 0;
      for (; i + kLanes <= vocab; i += kLanes) {
        const vfloat v = load(row + i);
        best = v > best ? v : best;
      }
      float top = hmax(best);
      for (; i < vocab; ++i) top = std::max(top, to_float(row[i]));
      // All -inf, or +inf present: no finite normalizer, and log-sum-exp is the maximum.
      const bool finite = !std::isinf(top);
      const vfloat vtop = splat(top);
      const vint none = vint{} + int32_t(vocab);
      vint first = none;  // per lane: the first index holding the maximum
      vint index = lane_indices();
      vfloat total = vfloat{};
      for (i = 0; i + kLanes <= vocab; i += kLanes, index += kLanes) {
        const vfloat v = load(row + i);
        first = ((v == vtop) & (first == none)) ? index : first;
        if (finite) total += exp_nonpositive(v - vtop);
      }
      int64_t found = vocab;
      for (int lane = 0; lane < kLanes; ++lane) found = std::min<int64_t>(found, first[lane]);
      float tail = 0.0f;
      for (; i < vocab; ++i) {
        const float v = to_float(row[i]);
        if (v == top) found = std::min(found, i);
        if (finite) tail += exp_nonpositive(v - top);
      }
      argmax[r] = found < vocab ? found : 0;
      lse[r] = finite ? top + std::log(hsum(total) + tail) : top;
      max[r] = top;
    }
  });
}

}  // namespace

extern "C" {

int llmserve_rms_norm(int dtype, const void* x, void* residual, const void* weight, void* out,
                      int64_t n, int64_t hidden, float eps) {
  if (dtype == 0) {
    rms_norm(static_cast<const float*>(x), static_cast<float*>(residual),
             static_cast<const float*>(weight), static_cast<float*>(out), n, hidden, eps);
  } else if (dtype == 1) {
    rms_norm(static_cast<const bf16*>(x), static_cast<bf16*>(residual),
             static_cast<const bf16*>(weight), static_cast<bf16*>(out), n, hidden, eps);
  } else {
    return -1;
  }
  return 0;
}

int llmserve_rotary(int dtype, void* qkv, int64_t row_stride, const int64_t* positions,
                    const void* cos, const void* sin, int64_t n, int64_t num_heads,
                    int64_t head_dim) {
  if (head_dim % 2) return -1;
  if (dtype == 0) {
    rotary(static_cast<float*>(qkv), row_stride, positions, static_cast<const float*>(cos),
           static_cast<const float*>(sin), n, num_heads, head_dim);
  } else if (dtype == 1) {
    rotary(static_cast<bf16*>(qkv), row_stride, positions, static_cast<const bf16*>(cos),
           static_cast<const bf16*>(sin), n, num_heads, head_dim);
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

int llmserve_write_kv(int dtype, const void* key, const void* value, int64_t row_stride,
                      const int64_t* slots, int64_t n, int64_t row_elems, void* key_cache,
                      void* value_cache) {
  if (dtype == 0) {
    write_kv(static_cast<const float*>(key), static_cast<const float*>(value), row_stride, slots,
             n, row_elems, static_cast<float*>(key_cache), static_cast<float*>(value_cache));
  } else if (dtype == 1) {
    write_kv(static_cast<const bf16*>(key), static_cast<const bf16*>(value), row_stride, slots, n,
             row_elems, static_cast<bf16*>(key_cache), static_cast<bf16*>(value_cache));
  } else {
    return -1;
  }
  return 0;
}

int llmserve_argmax_logsumexp(int dtype, const void* logits, int64_t n, int64_t vocab,
                              int64_t* argmax, float* lse, float* max) {
  if (dtype == 0) {
    argmax_logsumexp(static_cast<const float*>(logits), n, vocab, argmax, lse, max);
  } else if (dtype == 1) {
    argmax_logsumexp(static_cast<const bf16*>(logits), n, vocab, argmax, lse, max);
  } else {
    return -1;
  }
  return 0;
}

}  // extern "C"
