// A whole decode step of a dense decoder-only model in one native call, for CPUs.
//
// At decode batch sizes (a few tokens) a forward pass is mostly overhead when each operation
// is its own call: per layer ten or so torch or ctypes calls, each with Python dispatch,
// argument checks, an allocation and a fork/join of threads, against a few hundred microseconds
// of actual work. Here one call runs every layer: embedding lookup (and scale), the norms
// with the residual add, the q/k/v, output, gate/up and down projections (linear.h), q/k
// norms, rotary embedding (per layer: its table, or none), the K/V cache write, paged
// attention (per layer: its window and soft-cap), SiLU- or GELU-and-multiply, block output
// norms and multipliers, the final norm, the LM head and the logits' divisor and soft-cap,
// with activations in thread-local buffers that are reused from step to step.
//
// The features are those of worker_service/models/arch.py's ModelArchConfig (Llama, Qwen3,
// Gemma 2 and 3, Granite, OLMo 2, SmolLM3, Phi-3); each elementwise step is the ops.cpp
// kernel of the per-layer path, with its rounding points, so the results are that path's up
// to the order of summation in the projections (float32 logits differ by ~1e-6).
//
// Weights are dense in the model dtype, or (float32 models) GGUF blocks: each projection, the
// embedding and the LM head has a ggml type code in `weight_types` (0: dense; fast mode's
// projections and LM head may be interleaved, quant_interleaved.cpp), and quant.cpp multiplies
// with blocks in the step's mode (kQuantMode: exact or fast) and dequantizes the embedding rows
// of the step's tokens.
//
// The K/V caches are in the model dtype, or bfloat16 in a float32 model (kCacheDtype: the
// worker's kv_cache_dtype): the step's q, k and v rows are then rounded to bfloat16 (nearest
// even) before the cache write and the attention, which runs on bfloat16 rows as in a
// bfloat16 model, and its output is widened back to float32.
//
// Entry point (extern "C", called through ctypes; dtype 0 = float32, 1 = bfloat16):
//   llmserve_decode_step   every layer and the LM head for n tokens, one per sequence, and
//                          optionally each row's argmax and its logprob

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "linear.h"
#include "quant.h"
#include "vec.h"

extern "C" {
int llmserve_norm(int dtype, int kind, const void* x, void* residual, const void* weight,
                  void* out, int64_t n, int64_t hidden, float eps);
int llmserve_head_norm(int dtype, int kind, void* x, int64_t row_stride, int64_t n,
                       int64_t heads, int64_t head_dim, const void* weight, float eps);
int llmserve_rotary(int dtype, void* qkv, int64_t row_stride, const int64_t* positions,
                    const void* cos, const void* sin, int64_t n, int64_t num_heads,
                    int64_t head_stride, int64_t rotary_dim);
int llmserve_silu_mul(int dtype, const void* gate_up, void* out, int64_t n, int64_t inter);
int llmserve_gelu_tanh_mul(int dtype, const void* gate_up, void* out, int64_t n, int64_t inter);
int llmserve_softcap(int dtype, void* x, int64_t count, float cap);
int llmserve_argmax_logsumexp(int dtype, const void* logits, int64_t n, int64_t vocab,
                              int64_t* argmax, float* lse, float* max);
int llmserve_paged_decode(int dtype, int64_t head_dim, const void* query, const void* key_cache,
                          const void* value_cache, const int32_t* block_tables,
                          int64_t table_stride, const int32_t* seq_lens, void* out,
                          int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                          int64_t block_size, int64_t block_stride, float scale,
                          int64_t kv_heads_per_item, int64_t query_stride, int64_t window,
                          float softcap, const float* sinks);
int llmserve_write_kv(int dtype, const void* key, const void* value, int64_t row_stride,
                      const int64_t* slots, int64_t n, int64_t row_elems, void* key_cache,
                      void* value_cache, int64_t block_size, int64_t block_stride);
int llmserve_convert_rows(int src_dtype, int dst_dtype, const void* src, int64_t src_stride,
                          int64_t rows, int64_t cols, void* dst);
}

namespace {

using namespace llmserve;
using projection::linear_rows;

// Indices into `dims` (int64), `params` (float32) and each layer's pointers. Every layer's
// caches have the block size and the block stride (elements from one block to the next,
// paged_attention.cpp) of kBlockSize and kBlockStride.
enum Dim {
  kLayers, kHidden, kInter, kHeads, kKvHeads, kHeadDim, kVocab, kBlockSize, kBlockStride,
  kRotaryDim,
  kNormKind,   // ops.cpp's NormKind, for every norm of the model
  kQkNorm,     // QkNorm
  kActivation, // Activation
  kQuantMode,  // QuantMode, for weights in blocks
  kCacheDtype, // the K/V caches' dtype code: the model's, or 1 (bfloat16) in a float32 model
  kNumDims
};
// A multiplier, divisor or cap of 0 is absent.
enum Param { kEps, kScale, kEmbedScale, kResidualScale, kAttnSoftcap, kFinalSoftcap,
             kLogitsDivisor, kNumParams };
// Null where the layer has no such weight (no cos/sin: a NoPE layer).
enum LayerField {
  kInNorm, kQkv, kQkvBias, kQNorm, kKNorm, kO, kOBias, kAttnOutNorm, kPostNorm, kGateUp,
  kGateUpBias, kDown, kDownBias, kMlpOutNorm, kCos, kSin, kKeyCache, kValueCache,
  kNumLayerFields
};
enum QkNorm { kNoQkNorm, kPerHead, kFullWidth };
enum Activation { kSilu, kGeluTanh };
enum QuantMode { kExact, kFast };
// Indices into `weight_types`: per layer these four, then the model's two.
enum WeightType { kQkvType, kOType, kGateUpType, kDownType, kTypesPerLayer };
enum ModelWeightType { kEmbedType, kLmHeadType };

// Activations of one step, reused from call to call on the calling thread.
struct Buffers {
  std::vector<float> x32;  // the current matmul input, widened to float32
  std::vector<uint8_t> residual, normed, qkv, attn, proj, gate_up, act;
  std::vector<bf16> qkv16, attn16;  // a bfloat16 cache's q/k/v rows and attention output

  template <typename T>
  static T* sized(std::vector<uint8_t>& buffer, int64_t elements) {
    buffer.resize(size_t(elements) * sizeof(T));
    return reinterpret_cast<T*>(buffer.data());
  }
};

thread_local Buffers buffers;

template <typename T>
void linear(const T* x, int64_t n, int64_t in, const T* weight, const T* bias, T* out,
            int64_t out_features) {
  std::vector<float>& x32 = buffers.x32;
  x32.resize(size_t(n * in));
  for (int64_t i = 0; i < n * in; ++i) x32[i] = to_float(x[i]);
  linear_rows(x32.data(), n, in, weight, bias, out, out_features);
}

// x = x * s (or x / s) rounded to T, as torch multiplies a tensor by a Python float.
template <typename T>
void scale(T* x, int64_t count, float s, bool divide) {
  for (int64_t i = 0; i < count; ++i)
    store_scalar(x + i, divide ? to_float(x[i]) / s : to_float(x[i]) * s);
}

struct StepArgs {
  const int64_t* dims;
  const float* params;
  const void* const* layers;  // [layers * kNumLayerFields]
  const int64_t* weight_types;  // [layers * kTypesPerLayer + 2]: ggml types, 0 = dense
  const int64_t* windows;     // [layers]: each layer's sliding window, 0 = none
  const int64_t* layer_groups;  // [layers]: the KV group whose slots and tables a layer uses
  const void *embed, *final_norm, *lm_head;
  const int64_t *input_ids, *positions;
  const int64_t* slots;  // [groups, n]: each group's flat cache slots of the new tokens
  const int32_t* block_tables;  // [groups, n, table_stride]
  int64_t table_stride;
  int64_t group_stride;  // elements from one group's tables to the next's
  const int32_t* seq_lens;
  int64_t n;
  void* logits;
  int64_t* argmax;        // [n] or null: each row's first argmax
  float* argmax_logprob;  // [n]: its logprob, max - log-sum-exp in float32
};

// One step over n tokens; `residual` is the residual stream, `proj` the last block's output
// not yet added to it.
template <typename T>
struct Step {
  const StepArgs& a;
  const int dtype;
  const int64_t* d = a.dims;
  const int64_t n = a.n, hidden = d[kHidden], inter = d[kInter], head_dim = d[kHeadDim];
  const int64_t q_size = d[kHeads] * head_dim, kv_size = d[kKvHeads] * head_dim;
  const int64_t qkv_size = q_size + 2 * kv_size;
  const int kind = int(d[kNormKind]);
  const float eps = a.params[kEps];
  T* residual = Buffers::sized<T>(buffers.residual, n * hidden);
  T* normed = Buffers::sized<T>(buffers.normed, n * hidden);
  T* qkv = Buffers::sized<T>(buffers.qkv, n * qkv_size);
  T* attn = Buffers::sized<T>(buffers.attn, n * q_size);
  T* proj = Buffers::sized<T>(buffers.proj, n * hidden);  // o, then down, projections
  T* gate_up = Buffers::sized<T>(buffers.gate_up, n * 2 * inter);
  T* act = Buffers::sized<T>(buffers.act, n * inter);

  static const T* w(const void* p) { return static_cast<const T*>(p); }

  // out = x @ weight^T (+ bias), the weight dense or in blocks of ggml type `type`.
  void project(const T* x, int64_t rows, int64_t in, const void* weight, int64_t type,
               const void* bias, T* out, int64_t out_features) {
    if (type == 0) {
      linear(x, rows, in, w(weight), w(bias), out, out_features);
      return;
    }
    if constexpr (std::is_same_v<T, float>) {  // blocks: float32 models only (checked)
      const auto* blocks = static_cast<const uint8_t*>(weight);
      if (d[kQuantMode] == kFast)
        llmserve_quant_linear_fast(int(type), x, rows, in, blocks, out_features, out);
      else
        llmserve_quant_linear(int(type), x, rows, in, blocks, out_features, out);
      if (bias != nullptr)
        for (int64_t i = 0; i < rows; ++i)
          for (int64_t o = 0; o < out_features; ++o) out[i * out_features + o] += w(bias)[o];
    }
  }

  // Row `token` of the embedding, dense or in blocks, into out[0..hidden).
  void embed_row(int64_t token, T* out) {
    const int64_t type = a.weight_types[d[kLayers] * kTypesPerLayer + kEmbedType];
    if (type == 0) {
      std::memcpy(out, w(a.embed) + token * hidden, hidden * sizeof(T));
      return;
    }
    if constexpr (std::is_same_v<T, float>) {
      const int64_t row_bytes =
          hidden / llmserve_quant_block_weights(int(type)) * llmserve_quant_block_bytes(int(type));
      llmserve_quant_dequantize(int(type), static_cast<const uint8_t*>(a.embed) + token * row_bytes,
                                1, hidden, out);
    }
  }

  void norm(const T* x, T* add_to, const void* weight, T* out, int64_t rows, int64_t width) {
    llmserve_norm(dtype, kind, x, add_to, weight, out, rows, width, eps);
  }

  // The next block's input: norm(residual + delta) with `weight`, or without a weight
  // (OLMo 2) the sum itself. No delta before the first layer.
  const T* add_norm(const T* delta, const void* weight) {
    if (weight != nullptr) {
      norm(delta != nullptr ? delta : residual, delta != nullptr ? residual : nullptr, weight,
           normed, n, hidden);
      return normed;
    }
    if (delta != nullptr)
      for (int64_t i = 0; i < n * hidden; ++i)
        store_scalar(residual + i, to_float(residual[i]) + to_float(delta[i]));
    return residual;
  }

  // A block's output before the residual add: its norm (Gemma, OLMo 2), its multiplier.
  void block_output(T* out, const void* out_norm) {
    if (out_norm != nullptr) norm(out, nullptr, out_norm, out, n, hidden);
    if (a.params[kResidualScale] != 0.0f) scale(out, n * hidden, a.params[kResidualScale], false);
  }

  void qk_norms(const void* const* p) {
    if (d[kQkNorm] == kNoQkNorm) return;
    const bool per_head = d[kQkNorm] == kPerHead;
    llmserve_head_norm(dtype, kind, qkv, qkv_size, n, per_head ? d[kHeads] : 1,
                       per_head ? head_dim : q_size, p[kQNorm], eps);
    llmserve_head_norm(dtype, kind, qkv + q_size, qkv_size, n, per_head ? d[kKvHeads] : 1,
                       per_head ? head_dim : kv_size, p[kKNorm], eps);
  }

  // The first rotary_dim dims of every q and k head, unless a NoPE layer.
  void rotary(const void* const* p) {
    if (p[kCos] == nullptr) return;
    llmserve_rotary(dtype, qkv, qkv_size, a.positions, p[kCos], p[kSin], n,
                    d[kHeads] + d[kKvHeads], head_dim, d[kRotaryDim]);
  }

  int attention(const T* x, const void* const* p, const int64_t* types, int64_t layer) {
    project(x, n, hidden, p[kQkv], types[kQkvType], p[kQkvBias], qkv, qkv_size);
    qk_norms(p);
    rotary(p);
    const int64_t group = a.layer_groups[layer];
    const int64_t* slots = a.slots + group * n;
    const int32_t* tables = a.block_tables + group * a.group_stride;
    const int cache_dtype = int(d[kCacheDtype]);
    const void* rows = qkv;
    void* out = attn;
    if (cache_dtype != dtype) {  // a bfloat16 cache in a float32 model (checked)
      buffers.qkv16.resize(size_t(n * qkv_size));
      buffers.attn16.resize(size_t(n * q_size));
      llmserve_convert_rows(dtype, cache_dtype, qkv, qkv_size, n, qkv_size, buffers.qkv16.data());
      rows = buffers.qkv16.data();
      out = buffers.attn16.data();
    }
    const int64_t element = cache_dtype == 0 ? sizeof(float) : sizeof(bf16);
    const auto* row_bytes = static_cast<const uint8_t*>(rows);
    llmserve_write_kv(cache_dtype, row_bytes + q_size * element,
                      row_bytes + (q_size + kv_size) * element, qkv_size, slots, n, kv_size,
                      const_cast<void*>(p[kKeyCache]), const_cast<void*>(p[kValueCache]),
                      d[kBlockSize], d[kBlockStride]);
    // The queries are read in place from the qkv rows (query stride qkv_size).
    const int status = llmserve_paged_decode(
        cache_dtype, head_dim, rows, p[kKeyCache], p[kValueCache], tables, a.table_stride,
        a.seq_lens, out, n, d[kHeads], d[kKvHeads], d[kBlockSize], d[kBlockStride],
        a.params[kScale], 0, qkv_size, a.windows[layer], a.params[kAttnSoftcap], nullptr);
    if (out != attn) llmserve_convert_rows(cache_dtype, dtype, out, q_size, n, q_size, attn);
    return status;
  }

  void mlp(const T* x, const void* const* p, const int64_t* types) {
    project(x, n, hidden, p[kGateUp], types[kGateUpType], p[kGateUpBias], gate_up, 2 * inter);
    if (d[kActivation] == kGeluTanh)
      llmserve_gelu_tanh_mul(dtype, gate_up, act, n, inter);
    else
      llmserve_silu_mul(dtype, gate_up, act, n, inter);
    project(act, n, inter, p[kDown], types[kDownType], p[kDownBias], proj, hidden);
  }

  int run() {
    for (int64_t i = 0; i < n; ++i) embed_row(a.input_ids[i], residual + i * hidden);
    if (a.params[kEmbedScale] != 0.0f) scale(residual, n * hidden, a.params[kEmbedScale], false);
    for (int64_t l = 0; l < d[kLayers]; ++l) {
      const void* const* p = a.layers + l * kNumLayerFields;
      const int64_t* types = a.weight_types + l * kTypesPerLayer;
      const int status = attention(add_norm(l == 0 ? nullptr : proj, p[kInNorm]), p, types, l);
      if (status != 0) return status;
      project(attn, n, q_size, p[kO], types[kOType], p[kOBias], proj, hidden);
      block_output(proj, p[kAttnOutNorm]);
      mlp(add_norm(proj, p[kPostNorm]), p, types);
      block_output(proj, p[kMlpOutNorm]);
    }
    T* logits = static_cast<T*>(a.logits);
    const int64_t vocab = d[kVocab];
    project(add_norm(proj, a.final_norm), n, hidden, a.lm_head,
            a.weight_types[d[kLayers] * kTypesPerLayer + kLmHeadType], nullptr, logits, vocab);
    if (a.params[kLogitsDivisor] != 0.0f) scale(logits, n * vocab, a.params[kLogitsDivisor], true);
    if (a.params[kFinalSoftcap] != 0.0f)
      llmserve_softcap(dtype, logits, n * vocab, a.params[kFinalSoftcap]);
    if (a.argmax != nullptr) {
      // The sampler's row reductions, while the logits are still in cache: a greedy step
      // needs nothing else of them.
      thread_local std::vector<float> lse, top;
      lse.resize(size_t(n));
      top.resize(size_t(n));
      llmserve_argmax_logsumexp(dtype, logits, n, vocab, a.argmax, lse.data(), top.data());
      for (int64_t i = 0; i < n; ++i) a.argmax_logprob[i] = top[size_t(i)] - lse[size_t(i)];
    }
    return 0;
  }
};

}  // namespace

extern "C" {

// Returns 0, or -1 for an unsupported dtype or shape (widths not multiples of 8, an odd or
// too wide rotary; blocks in a bfloat16 model, or a row not a whole number of blocks; caches
// neither in the model dtype nor bfloat16 in a float32 model). With
// `argmax` (else null), also each row's first argmax and its logprob, as
// llmserve_argmax_logsumexp gives them.
int llmserve_decode_step(int dtype, const int64_t* dims, const float* params,
                         const void* const* layers, const int64_t* weight_types,
                         const int64_t* windows, const int64_t* layer_groups,
                         const void* embed, const void* final_norm, const void* lm_head,
                         const int64_t* input_ids, const int64_t* positions,
                         const int64_t* slots, const int32_t* block_tables,
                         int64_t table_stride, int64_t group_stride, const int32_t* seq_lens, int64_t n, void* logits, int64_t* argmax,
                         float* argmax_logprob) {
  const int64_t q_size = dims[kHeads] * dims[kHeadDim];
  if (dims[kHidden] % 8 || dims[kInter] % 8 || q_size % 8 || dims[kHeadDim] % 8) return -1;
  if (dims[kRotaryDim] % 2 || dims[kRotaryDim] > dims[kHeadDim]) return -1;
  if (dims[kCacheDtype] != dtype && !(dtype == 0 && dims[kCacheDtype] == 1)) return -1;
  for (int64_t i = 0; i < dims[kLayers] * kTypesPerLayer + 2; ++i) {
    if (weight_types[i] == 0) continue;
    if (dtype != 0 || llmserve_quant_block_bytes(int(weight_types[i])) == 0) return -1;
    // Interleaved blocks (quant_interleaved.cpp): multiplied in fast mode, never looked up.
    if (weight_types[i] & quant::kInterleaved &&
        (dims[kQuantMode] == kExact || i == dims[kLayers] * kTypesPerLayer + kEmbedType))
      return -1;
    if (dims[kHidden] % 32 || dims[kInter] % 32 || q_size % 32) return -1;
    const int64_t widest = std::max({dims[kHidden], dims[kInter], q_size});
    if (dims[kQuantMode] == kExact && widest > 16384) return -1;  // quant.cpp's kMaxRow
  }
  const StepArgs args{dims,         params,       layers,       weight_types, windows,
                      layer_groups, embed,        final_norm,   lm_head,      input_ids,
                      positions,    slots,        block_tables, table_stride, group_stride,
                      seq_lens,     n,            logits,       argmax,       argmax_logprob};
  if (dtype == 0) return Step<float>{args, dtype}.run();
  if (dtype == 1) return Step<bf16>{args, dtype}.run();
  return -1;
}

// out[n, out_features] = x[n, in] @ weight[out_features, in]^T (+ bias): the projections of
// llmserve_decode_step on their own, for tests and benchmarks.

int llmserve_linear_rows(int dtype, const void* x, int64_t n, int64_t in, const void* weight,
                         const void* bias, void* out, int64_t out_features) {
  if (in % 8) return -1;
  if (dtype == 0) {
    linear(static_cast<const float*>(x), n, in, static_cast<const float*>(weight),
           static_cast<const float*>(bias), static_cast<float*>(out), out_features);
  } else if (dtype == 1) {
    linear(static_cast<const bf16*>(x), n, in, static_cast<const bf16*>(weight),
           static_cast<const bf16*>(bias), static_cast<bf16*>(out), out_features);
  } else {
    return -1;
  }
  return 0;
}

}  // extern "C"
