// Prefill of a Gated DeltaNet layer's states (Qwen3.5, Qwen3-Next) for CPUs: sequences of
// several tokens packed one after another (query_start_loc), each continuing from the state
// in its pool slot (or from zeros) and leaving its last state there. The torch references and
// the layouts are in llmserve_kernels/causal_conv1d.py (`causal_conv1d`) and
// llmserve_kernels/gated_delta_rule.py (`gated_delta_rule_chunked`).
//
// Entry points (extern "C", called through ctypes; dtype 0 = float32, 1 = bfloat16):
//   llmserve_causal_conv1d        causal depthwise conv of each sequence after the inputs its
//                                 slot keeps, SiLU optional; the slot then keeps its last inputs
//   llmserve_gated_delta_prefill  the gated delta rule over each sequence, the float32 state
//                                 read from and written back to its slot
//
// The delta rule runs in its recurrent form, token by token. The state's columns are
// independent (column c of S [k_dim, v_dim] moves by its own step beta (v_c - e^g S[:, c] . k)),
// so a work item is one sequence's value head's block of kColumns columns: that k_dim x
// kColumns slice of the state is copied to the stack once and stays in L1 for the whole
// sequence. Each token is then one pass over it: row by row S = e^g S + k step^T, and from the
// rows just written both the token's output S^T q and the next token's read S^T k'.
//
// The chunked form (gated_delta_rule.py's `_chunk`) does no fewer flops per token (three
// k_dim x v_dim products, plus C (2 k_dim + v_dim) within a chunk of C tokens), but as matrix
// products, which a BLAS runs nearer the CPU's peak than this loop of rank-one updates: at
// small heads this kernel is far ahead of the torch reference, at 128 x 128 heads (Qwen3.5,
// Qwen3-Next) only a little (bench/RESULTS.md, "Linear-attention state: one layer of each
// kind"). A chunked form with its own matrix micro-kernels is what would gain there.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "linear_attention.h"
#include "pool.h"
#include "vec.h"

namespace {

using namespace llmserve;

// ---- causal conv ----------------------------------------------------------------------------

constexpr int64_t kConvTokens = 64;     // tokens per work item
constexpr int64_t kConvChannels = 512;  // channels per work item

struct ConvArgs {
  int64_t num_seqs, dim, kernel_size, x_stride;  // x_stride: elements between token rows
  bool use_silu;
};

// out[t, c] = act(sum_j taps[j, c] input[t - kernel_size + 1 + j, c] + bias[c]) for tokens
// [t0, t1) of sequence `seq` and channels [c0, c1), where input[i] is x's row i of the
// sequence, or for i < 0 the slot's kept row kept + i (zeros without an initial state).
// Taps are added one at a time into a row of float32 sums, the bias last.
template <typename T>
void conv_block(const ConvArgs& a, const T* x, const T* conv_state, const T* taps, const T* bias,
                const int64_t* starts, const int64_t* slots, const uint8_t* initial, int64_t seq,
                int64_t t0, int64_t t1, int64_t c0, int64_t c1, T* out) {
  alignas(64) float acc[kConvChannels];
  const int64_t kept = a.kernel_size - 1;
  const T* kept_rows = conv_state + slots[seq] * kept * a.dim;  // [kept, dim]
  const bool has_state = initial == nullptr || initial[seq] != 0;
  const int64_t width = c1 - c0;
  for (int64_t t = t0; t < t1; ++t) {
    std::fill(acc, acc + width, 0.0f);
    for (int64_t j = 0; j < a.kernel_size; ++j) {
      const int64_t i = t - kept + j;
      const T* row = i >= 0 ? x + (starts[seq] + i) * a.x_stride
                            : (has_state ? kept_rows + (kept + i) * a.dim : nullptr);
      if (row == nullptr) continue;
      const T* tap = taps + j * a.dim;
      for (int64_t c = 0; c < width; c += kLanes) {
        const int64_t m = std::min<int64_t>(kLanes, width - c);
        const vfloat sum = fmadd(load_lanes(tap + c0 + c, m), load_lanes(row + c0 + c, m),
                                 load(acc + c));
        store(acc + c, sum);
      }
    }
    T* dst = out + (starts[seq] + t) * a.dim + c0;
    for (int64_t c = 0; c < width; c += kLanes) {
      const int64_t m = std::min<int64_t>(kLanes, width - c);
      vfloat value = load(acc + c);
      if (bias != nullptr) value += load_lanes(bias + c0 + c, m);
      if (a.use_silu) value = silu(value);
      store_lanes(dst + c, value, m);
    }
  }
}

// The slot of sequence `seq` keeps the last kept inputs of (its kept rows, its tokens), for
// channels [c0, c1). Row r comes from row r + len of that concatenation: a later row, so
// ascending r never overwrites a row it still has to read. Inputs are copied, never rounded.
template <typename T>
void conv_keep(const ConvArgs& a, const T* x, T* conv_state, const int64_t* starts,
               const int64_t* slots, const uint8_t* initial, int64_t seq, int64_t c0, int64_t c1) {
  const int64_t kept = a.kernel_size - 1;
  const int64_t len = starts[seq + 1] - starts[seq];
  T* rows = conv_state + slots[seq] * kept * a.dim;
  const bool has_state = initial == nullptr || initial[seq] != 0;
  for (int64_t r = 0; r < kept; ++r) {
    const int64_t i = r + len - kept;  // the input's index in the sequence
    T* dst = rows + r * a.dim + c0;
    if (i >= 0) {
      std::memcpy(dst, x + (starts[seq] + i) * a.x_stride + c0, (c1 - c0) * sizeof(T));
    } else if (has_state) {
      std::memcpy(dst, rows + (r + len) * a.dim + c0, (c1 - c0) * sizeof(T));
    } else {
      std::fill(dst, dst + (c1 - c0), T(0));  // zero bits are 0.0 in both dtypes
    }
  }
}

// Outputs first, over (sequence, token block, channel block); then, once every output has
// read the kept rows, the slots, over (sequence, channel block).
template <typename T>
void causal_conv1d(const ConvArgs& a, const T* x, T* conv_state, const T* taps, const T* bias,
                   const int64_t* starts, const int64_t* slots, const uint8_t* initial, T* out) {
  struct TokenBlock {
    int64_t seq, t0, t1;
  };
  std::vector<TokenBlock> blocks;
  std::vector<int64_t> filled;  // sequences with tokens
  for (int64_t s = 0; s < a.num_seqs; ++s) {
    const int64_t len = starts[s + 1] - starts[s];
    if (len > 0) filled.push_back(s);
    for (int64_t t = 0; t < len; t += kConvTokens)
      blocks.push_back({s, t, std::min(len, t + kConvTokens)});
  }
  const int64_t channel_blocks = (a.dim + kConvChannels - 1) / kConvChannels;
  const bool parallel = starts[a.num_seqs] * a.dim * a.kernel_size >= kParallelElements;
  const int64_t items = int64_t(blocks.size()) * channel_blocks;
  parallel_for(items, parallel, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const TokenBlock& b = blocks[item / channel_blocks];
      const int64_t c0 = (item % channel_blocks) * kConvChannels;
      const int64_t c1 = std::min(a.dim, c0 + kConvChannels);
      conv_block(a, x, conv_state, taps, bias, starts, slots, initial, b.seq, b.t0, b.t1, c0, c1,
                 out);
    }
  });
  const int64_t keeps = int64_t(filled.size()) * channel_blocks;
  parallel_for(keeps, parallel, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t c0 = (item % channel_blocks) * kConvChannels;
      conv_keep(a, x, conv_state, starts, slots, initial, filled[item / channel_blocks], c0,
                std::min(a.dim, c0 + kConvChannels));
    }
  });
}

// ---- gated delta rule -----------------------------------------------------------------------

constexpr int kColumnVectors = 2;  // vectors of state columns per work item
constexpr int64_t kColumns = kColumnVectors * kLanes;

struct DeltaArgs {
  int64_t num_seqs, num_k_heads, num_v_heads, k_dim, v_dim;
  int64_t q_stride, k_stride, v_stride;  // elements between consecutive tokens' rows
  float scale;
  bool l2norm;
};

// Value head h's columns [c0, c0 + kColumns) (those below v_dim) of sequence `seq`, whose
// tokens are rows [begin, end). qn, kn: [num_tokens, num_k_heads, k_dim] float32, normalised
// and (q) scaled; g, beta: [num_tokens, num_v_heads] float32; state: the slot's
// [num_v_heads, k_dim, v_dim].
template <typename T>
void delta_columns(const DeltaArgs& a, const float* qn, const float* kn, const T* v,
                   const float* g, const float* beta, float* state, bool has_state,
                   int64_t begin, int64_t end, int64_t h, int64_t c0, T* out) {
  alignas(64) float tile[kMaxKeyDim * kColumns];  // [k_dim, kColumns], zeros past v_dim
  const int64_t width = std::min(kColumns, a.v_dim - c0);
  const int64_t kh = h / (a.num_v_heads / a.num_k_heads);
  float* slice = state + h * a.k_dim * a.v_dim + c0;  // rows v_dim apart
  for (int64_t i = 0; i < a.k_dim; ++i) {
    float* row = tile + i * kColumns;
    std::fill(row, row + kColumns, 0.0f);
    if (has_state) std::memcpy(row, slice + i * a.v_dim, width * sizeof(float));
  }
  auto key = [&](const float* rows, int64_t t) {
    return rows + (t * a.num_k_heads + kh) * a.k_dim;
  };
  auto lanes = [&](int b) { return std::clamp<int64_t>(width - b * kLanes, 0, kLanes); };

  vfloat read[kColumnVectors] = {};  // S^T k of the next token, before its decay
  const float* k0 = key(kn, begin);
  for (int64_t i = 0; i < a.k_dim; ++i) {
    const vfloat ki = splat(k0[i]);
    for (int b = 0; b < kColumnVectors; ++b)
      read[b] = fmadd(load(tile + i * kColumns + b * kLanes), ki, read[b]);
  }
  for (int64_t t = begin; t < end; ++t) {
    const int64_t gate = t * a.num_v_heads + h;
    const float decay = std::exp(g[gate]);
    const vfloat decays = splat(decay);
    const T* value = v + t * a.v_stride + h * a.v_dim + c0;
    vfloat step[kColumnVectors];
    for (int b = 0; b < kColumnVectors; ++b)
      step[b] = beta[gate] * (load_lanes(value + b * kLanes, lanes(b)) - decays * read[b]);
    const float* qt = key(qn, t);
    const float* kt = key(kn, t);
    const float* next = key(kn, t + 1 < end ? t + 1 : t);  // read unused after the last token
    vfloat result[kColumnVectors] = {};
    for (int b = 0; b < kColumnVectors; ++b) read[b] = vfloat{};
    for (int64_t i = 0; i < a.k_dim; ++i) {
      float* row = tile + i * kColumns;
      const vfloat ki = splat(kt[i]);
      const vfloat qi = splat(qt[i]);
      const vfloat ni = splat(next[i]);
      for (int b = 0; b < kColumnVectors; ++b) {
        const vfloat updated = fmadd(ki, step[b], decays * load(row + b * kLanes));
        store(row + b * kLanes, updated);
        result[b] = fmadd(updated, qi, result[b]);
        read[b] = fmadd(updated, ni, read[b]);
      }
    }
    T* dst = out + gate * a.v_dim + c0;
    for (int b = 0; b < kColumnVectors; ++b)
      if (lanes(b) > 0) store_lanes(dst + b * kLanes, result[b], lanes(b));
  }
  for (int64_t i = 0; i < a.k_dim; ++i)
    std::memcpy(slice + i * a.v_dim, tile + i * kColumns, width * sizeof(float));
}

// Normalises every token's q and k heads into float32 rows once (each feeds num_v_heads /
// num_k_heads value heads' column blocks), then runs the column blocks, longest sequences
// first so that the last items to be claimed are short ones.
template <typename T>
void gated_delta_prefill(const DeltaArgs& a, const T* q, const T* k, const T* v,
                         const float* g, const float* beta, float* state, const int64_t* starts,
                         const int64_t* slots, const uint8_t* initial, T* out) {
  const int64_t num_tokens = starts[a.num_seqs];
  const int64_t rows = num_tokens * a.num_k_heads;
  std::unique_ptr<float[]> normalised(new float[2 * rows * a.k_dim]);
  float* qn = normalised.get();  // [num_tokens, num_k_heads, k_dim]
  float* kn = qn + rows * a.k_dim;
  parallel_for(rows, rows * a.k_dim >= kParallelElements, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t t = r / a.num_k_heads;
      const int64_t head = (r % a.num_k_heads) * a.k_dim;
      load_head(q + t * a.q_stride + head, a.k_dim, a.l2norm, a.scale, qn + r * a.k_dim);
      load_head(k + t * a.k_stride + head, a.k_dim, a.l2norm, 1.0f, kn + r * a.k_dim);
    }
  });
  std::vector<int64_t> order;  // sequences with tokens, longest first
  for (int64_t s = 0; s < a.num_seqs; ++s)
    if (starts[s + 1] > starts[s]) order.push_back(s);
  std::stable_sort(order.begin(), order.end(), [&](int64_t x, int64_t y) {
    return starts[x + 1] - starts[x] > starts[y + 1] - starts[y];
  });
  const int64_t blocks = (a.v_dim + kColumns - 1) / kColumns;
  const int64_t per_seq = a.num_v_heads * blocks;
  const int64_t items = int64_t(order.size()) * per_seq;
  const bool parallel = num_tokens * a.num_v_heads * a.k_dim * a.v_dim >= kParallelElements;
  parallel_for(items, parallel, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t seq = order[item / per_seq];
      const int64_t h = item % per_seq / blocks;
      const int64_t c0 = item % blocks * kColumns;
      float* slot = state + slots[seq] * a.num_v_heads * a.k_dim * a.v_dim;
      const bool has_state = initial == nullptr || initial[seq] != 0;
      delta_columns(a, qn, kn, v, g, beta, slot, has_state, starts[seq], starts[seq + 1], h, c0,
                    out);
    }
  });
}

}  // namespace

extern "C" {

// x: [num_tokens, dim], rows x_stride elements apart; conv_state: [slots, kernel_size - 1,
// dim]; taps: the conv's weight tap by tap, [kernel_size, dim]; bias: [dim] or NULL;
// query_start_loc: [num_seqs + 1]; slots: [num_seqs]; initial: [num_seqs] bytes, or NULL
// (every slot holds a state); out: [num_tokens, dim].
int llmserve_causal_conv1d(int dtype, const void* x, int64_t x_stride, void* conv_state,
                           const void* taps, const void* bias, const int64_t* query_start_loc,
                           const int64_t* slots, const uint8_t* initial, int64_t num_seqs,
                           int64_t dim, int64_t kernel_size, int use_silu, void* out) {
  if (kernel_size < 2) return -1;
  const ConvArgs args{num_seqs, dim, kernel_size, x_stride, use_silu != 0};
  if (dtype == 0) {
    causal_conv1d(args, static_cast<const float*>(x), static_cast<float*>(conv_state),
                  static_cast<const float*>(taps), static_cast<const float*>(bias),
                  query_start_loc, slots, initial, static_cast<float*>(out));
  } else if (dtype == 1) {
    causal_conv1d(args, static_cast<const bf16*>(x), static_cast<bf16*>(conv_state),
                  static_cast<const bf16*>(taps), static_cast<const bf16*>(bias),
                  query_start_loc, slots, initial, static_cast<bf16*>(out));
  } else {
    return -1;
  }
  return 0;
}

// q, k: rows of num_k_heads * k_dim, v: rows of num_v_heads * v_dim, each row `*_stride`
// elements after the last; g, beta: [num_tokens, num_v_heads] float32; state: [slots,
// num_v_heads, k_dim, v_dim] float32; query_start_loc, slots, initial as above; out:
// [num_tokens, num_v_heads, v_dim].
int llmserve_gated_delta_prefill(int dtype, const void* q, const void* k, const void* v,
                                 int64_t q_stride, int64_t k_stride, int64_t v_stride,
                                 const float* g, const float* beta, float* state,
                                 const int64_t* query_start_loc, const int64_t* slots,
                                 const uint8_t* initial, int64_t num_seqs, int64_t num_k_heads,
                                 int64_t num_v_heads, int64_t k_dim, int64_t v_dim, float scale,
                                 int l2norm, void* out) {
  if (k_dim > kMaxKeyDim || num_v_heads % num_k_heads) return -1;
  const DeltaArgs args{num_seqs, num_k_heads, num_v_heads, k_dim,       v_dim,
                       q_stride, k_stride,    v_stride,    scale, l2norm != 0};
  if (dtype == 0) {
    gated_delta_prefill(args, static_cast<const float*>(q), static_cast<const float*>(k),
                        static_cast<const float*>(v), g, beta, state, query_start_loc, slots,
                        initial, static_cast<float*>(out));
  } else if (dtype == 1) {
    gated_delta_prefill(args, static_cast<const bf16*>(q), static_cast<const bf16*>(k),
                        static_cast<const bf16*>(v), g, beta, state, query_start_loc, slots,
                        initial, static_cast<bf16*>(out));
  } else {
    return -1;
  }
  return 0;
}

}  // extern "C"
