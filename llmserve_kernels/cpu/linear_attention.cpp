// Decode steps of a Gated DeltaNet layer's state (Qwen3.5, Qwen3-Next) for CPUs: one token per
// sequence, each sequence's state in a slot of a pool. The torch references and the layouts
// are in llmserve_kernels/causal_conv1d.py and llmserve_kernels/gated_delta_rule.py.
//
// Entry points (extern "C", called through ctypes; dtype 0 = float32, 1 = bfloat16):
//   llmserve_conv1d_update       causal depthwise conv of each sequence's token after the
//                                inputs its slot keeps, SiLU optional; the slot shifts by one
//   llmserve_gated_delta_decode  one step of the gated delta rule per sequence and value head,
//                                the float32 state updated in place
//
// At decode the rule is bound by memory: each (sequence, value head) reads and writes a
// k_dim x v_dim float32 matrix (64 KiB at 128 x 128) for a few flops per element. The step
// S' = e^g S + k (beta (v - e^g S^T k))^T is done in two passes over S: the first reads
// S^T k, the second writes e^g S + k step^T and accumulates the output S'^T q from the rows
// it has just written, while they are still in L1.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "linear_attention.h"
#include "pool.h"
#include "vec.h"

namespace {

using namespace llmserve;

// out[r, c] = act(bias[c] + sum_j taps[j, c] window_r[j, c]), where window_r is the
// kernel_size - 1 inputs kept in row r's slot followed by x[r]; then the slot keeps the last
// kernel_size - 1 of that window. Weights come tap by tap ([kernel_size, dim]) so that a
// vector of channels loads each tap's weights, like the window's rows, in one load. Channels
// are independent: a work item is one row's block of channels.
template <typename T>
void conv1d_update(const T* x, T* conv_state, const T* taps, const T* bias, const int64_t* slots,
                   int64_t n, int64_t dim, int64_t kernel_size, bool use_silu, T* out) {
  const int64_t kept = kernel_size - 1;
  constexpr int64_t kBlock = 512;  // channels per work item
  const int64_t blocks = (dim + kBlock - 1) / kBlock;
  const bool parallel = n * dim * kernel_size >= kParallelElements;
  parallel_for(n * blocks, parallel, [&](int64_t begin, int64_t end) {
    alignas(64) float result[kLanes];
    for (int64_t item = begin; item < end; ++item) {
      const int64_t r = item / blocks;
      const int64_t c0 = (item % blocks) * kBlock;
      const int64_t c1 = std::min(dim, c0 + kBlock);
      T* state = conv_state + slots[r] * kept * dim;  // [kept, dim]
      const T* token = x + r * dim;
      for (int64_t c = c0; c < c1; c += kLanes) {
        const int64_t m = std::min<int64_t>(kLanes, c1 - c);
        vfloat acc = load_lanes(taps + kept * dim + c, m) * load_lanes(token + c, m);
        for (int64_t j = 0; j < kept; ++j)
          acc = fmadd(load_lanes(taps + j * dim + c, m), load_lanes(state + j * dim + c, m), acc);
        if (bias != nullptr) acc += load_lanes(bias + c, m);
        if (use_silu) acc = silu(acc);
        if (m == kLanes) {
          store(out + r * dim + c, acc);
        } else {
          store(result, acc);
          for (int64_t l = 0; l < m; ++l) store_scalar(out + r * dim + c + l, result[l]);
        }
      }
      // The slot drops its oldest input and keeps the token (copied, never rounded).
      for (int64_t j = 0; j + 1 < kept; ++j)
        std::memmove(state + j * dim + c0, state + (j + 1) * dim + c0, (c1 - c0) * sizeof(T));
      std::memcpy(state + (kept - 1) * dim + c0, token + c0, (c1 - c0) * sizeof(T));
    }
  });
}

struct DeltaDecodeArgs {
  int64_t n, num_k_heads, num_v_heads, k_dim, v_dim;
  int64_t q_stride, k_stride, v_stride;  // elements between consecutive tokens' rows
  float scale;
  bool l2norm;
};

// One value head of one sequence: state [k_dim, v_dim] updated in place, out [v_dim].
template <typename T>
void delta_step(const float* q, const float* k, const T* v, float decay, float beta,
                float* state, int64_t k_dim, int64_t v_dim, T* out) {
  alignas(64) float step[kMaxValueDim];
  alignas(64) float result[kMaxValueDim];
  const int64_t vector_end = v_dim - v_dim % kLanes;
  // Pass 1: step = beta (v - decay S^T k).
  for (int64_t c = 0; c < v_dim; ++c) step[c] = 0.0f;
  for (int64_t i = 0; i < k_dim; ++i) {
    const float* row = state + i * v_dim;
    const vfloat ki = splat(k[i]);
    int64_t c = 0;
    for (; c < vector_end; c += kLanes) store(step + c, fmadd(load(row + c), ki, load(step + c)));
    for (; c < v_dim; ++c) step[c] += row[c] * k[i];
  }
  for (int64_t c = 0; c < v_dim; ++c) step[c] = beta * (to_float(v[c]) - decay * step[c]);
  // Pass 2: S = decay S + k step^T, row by row, and out = S^T q from the new rows.
  for (int64_t c = 0; c < v_dim; ++c) result[c] = 0.0f;
  const vfloat decays = splat(decay);
  for (int64_t i = 0; i < k_dim; ++i) {
    float* row = state + i * v_dim;
    const vfloat ki = splat(k[i]);
    const vfloat qi = splat(q[i]);
    int64_t c = 0;
    for (; c < vector_end; c += kLanes) {
      const vfloat updated = fmadd(ki, load(step + c), decays * load(row + c));
      store(row + c, updated);
      store(result + c, fmadd(updated, qi, load(result + c)));
    }
    for (; c < v_dim; ++c) {
      row[c] = decay * row[c] + k[i] * step[c];
      result[c] += row[c] * q[i];
    }
  }
  for (int64_t c = 0; c < v_dim; ++c) store_scalar(out + c, result[c]);
}

template <typename T>
void gated_delta_decode(const DeltaDecodeArgs& a, const T* q, const T* k, const T* v,
                        const float* g, const float* beta, float* state, const int64_t* slots,
                        T* out) {
  const int64_t group = a.num_v_heads / a.num_k_heads;
  const int64_t items = a.n * a.num_v_heads;
  const bool parallel = items * a.k_dim * a.v_dim >= kParallelElements;
  parallel_for(items, parallel, [&](int64_t begin, int64_t end) {
    alignas(64) float q32[kMaxKeyDim];
    alignas(64) float k32[kMaxKeyDim];
    for (int64_t item = begin; item < end; ++item) {
      const int64_t r = item / a.num_v_heads;
      const int64_t h = item % a.num_v_heads;
      const int64_t kh = h / group;
      // Each value head of a group normalises its key head again: k_dim flops against
      // k_dim * v_dim for the state.
      load_head(q + r * a.q_stride + kh * a.k_dim, a.k_dim, a.l2norm, a.scale, q32);
      load_head(k + r * a.k_stride + kh * a.k_dim, a.k_dim, a.l2norm, 1.0f, k32);
      float* s = state + (slots[r] * a.num_v_heads + h) * a.k_dim * a.v_dim;
      const int64_t gate = r * a.num_v_heads + h;
      delta_step(q32, k32, v + r * a.v_stride + h * a.v_dim, std::exp(g[gate]), beta[gate], s,
                 a.k_dim, a.v_dim, out + gate * a.v_dim);
    }
  });
}

}  // namespace

extern "C" {

// taps: the conv's weight tap by tap, [kernel_size, dim]; conv_state: [slots, kernel_size - 1,
// dim]; x, out: [n, dim].
int llmserve_conv1d_update(int dtype, const void* x, void* conv_state, const void* taps,
                           const void* bias, const int64_t* slots, int64_t n, int64_t dim,
                           int64_t kernel_size, int use_silu, void* out) {
  if (kernel_size < 2) return -1;
  if (dtype == 0) {
    conv1d_update(static_cast<const float*>(x), static_cast<float*>(conv_state),
                  static_cast<const float*>(taps), static_cast<const float*>(bias), slots, n,
                  dim, kernel_size, use_silu != 0, static_cast<float*>(out));
  } else if (dtype == 1) {
    conv1d_update(static_cast<const bf16*>(x), static_cast<bf16*>(conv_state),
                  static_cast<const bf16*>(taps), static_cast<const bf16*>(bias), slots, n, dim,
                  kernel_size, use_silu != 0, static_cast<bf16*>(out));
  } else {
    return -1;
  }
  return 0;
}

// q, k: rows of num_k_heads * k_dim, v: rows of num_v_heads * v_dim, each row `*_stride`
// elements after the last; g, beta: [n, num_v_heads] float32; state: [slots, num_v_heads,
// k_dim, v_dim] float32; out: [n, num_v_heads, v_dim].
int llmserve_gated_delta_decode(int dtype, const void* q, const void* k, const void* v,
                                int64_t q_stride, int64_t k_stride, int64_t v_stride,
                                const float* g, const float* beta, float* state,
                                const int64_t* slots, int64_t n, int64_t num_k_heads,
                                int64_t num_v_heads, int64_t k_dim, int64_t v_dim, float scale,
                                int l2norm, void* out) {
  if (k_dim > kMaxKeyDim || v_dim > kMaxValueDim || num_v_heads % num_k_heads) return -1;
  const DeltaDecodeArgs args{n,        num_k_heads, num_v_heads, k_dim, v_dim,
                             q_stride, k_stride,    v_stride,    scale, l2norm != 0};
  if (dtype == 0) {
    gated_delta_decode(args, static_cast<const float*>(q), static_cast<const float*>(k),
                       static_cast<const float*>(v), g, beta, state, slots,
                       static_cast<float*>(out));
  } else if (dtype == 1) {
    gated_delta_decode(args, static_cast<const bf16*>(q), static_cast<const bf16*>(k),
                       static_cast<const bf16*>(v), g, beta, state, slots,
                       static_cast<bf16*>(out));
  } else {
    return -1;
  }
  return 0;
}

}  // extern "C"
