// A whole decode step of a Llama-family model in one native call, for CPUs.
//
// At decode batch sizes (a few tokens) a forward pass is mostly overhead when each operation
// is its own call: per layer ten or so torch or ctypes calls, each with Python dispatch,
// argument checks, an allocation and a fork/join of threads, against a few hundred microseconds
// of actual work. Here one call runs every layer: embedding lookup, RMSNorm with the
// residual add, the q/k/v, output, gate/up and down projections, rotary embedding, the K/V
// cache write, paged attention, SiLU-and-multiply, the final norm and the LM head, with
// activations in thread-local buffers that are reused from step to step.
//
// The projections at these sizes are matrix-vector products bound by the time it takes to
// stream the weights from memory once: `linear_rows` reads each weight row once per step (a
// tile of output rows stays in L1 while every token's row of activations passes over it) and
// accumulates in float32, 8 lanes at a time with fused multiply-adds. bfloat16 weights are
// widened in registers (a shift), so they cost half the memory traffic of float32 ones.
// Attention is paged_attention.cpp's decode kernel and the elementwise steps are ops.cpp's,
// the kernels of the per-operation path: the results are that path's up to the order of
// summation in the projections (float32 logits differ by ~1e-6).
//
// Entry point (extern "C", called through ctypes; dtype 0 = float32, 1 = bfloat16):
//   llmserve_decode_step   every layer and the LM head for n tokens, one per sequence, and
//                          optionally each row's argmax and its logprob

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include <immintrin.h>
#include "pool.h"
#include "vec.h"

extern "C" {
int llmserve_rms_norm(int dtype, const void* x, void* residual, const void* weight, void* out,
                      int64_t n, int64_t hidden, float eps);
int llmserve_rotary(int dtype, void* qkv, int64_t row_stride, const int64_t* positions,
                    const void* cos, const void* sin, int64_t n, int64_t num_heads,
                    int64_t head_dim);
int llmserve_silu_mul(int dtype, const void* gate_up, void* out, int64_t n, int64_t inter);
int llmserve_argmax_logsumexp(int dtype, const void* logits, int64_t n, int64_t vocab,
                              int64_t* argmax, float* lse, float* max);
int llmserve_paged_decode(int dtype, int64_t head_dim, const void* query, const void* key_cache,
                          const void* value_cache, const int32_t* block_tables,
                          int64_t table_stride, const int32_t* seq_lens, void* out,
                          int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                          int64_t block_size, float scale, int64_t kv_heads_per_item,
                          int64_t query_stride, int64_t window, float softcap);
int llmserve_write_kv(int dtype, const void* key, const void* value, int64_t row_stride,
                      const int64_t* slots, int64_t n, int64_t row_elems, void* key_cache,
                      void* value_cache);
}

namespace {

using namespace llmserve;

typedef float v8 __attribute__((vector_size(8 * sizeof(float))));
typedef uint16_t v8h __attribute__((vector_size(8 * sizeof(uint16_t))));
typedef uint32_t v8u __attribute__((vector_size(8 * sizeof(uint32_t))));

inline v8 load8(const float* src) {
  v8 v;
  std::memcpy(&v, src, sizeof v);
  return v;
}

inline v8 load8(const bf16* src) {  // bfloat16 -> float32 is a 16-bit shift
  v8h h;
  std::memcpy(&h, src, sizeof h);
  const v8u bits = __builtin_convertvector(h, v8u) << 16;
  v8 v;
  std::memcpy(&v, &bits, sizeof v);
  return v;
}

inline v8 fma8(v8 a, v8 b, v8 c) {
#if defined(__FMA__)
  return v8(_mm256_fmadd_ps(__m256(a), __m256(b), __m256(c)));
#else
  return a * b + c;
#endif
}

inline float hsum8(v8 v) {
  const float a = (v[0] + v[4]) + (v[2] + v[6]);
  const float b = (v[1] + v[5]) + (v[3] + v[7]);
  return a + b;
}

constexpr int kTileRows = 4;  // weight rows per tile: 4 independent loads per step of k
// Tiles ahead that the projections prefetch. A tile's rows are a few kilobytes, too short
// for the hardware prefetcher to ramp up on: without this a core streams bfloat16 weights at
// about half the rate it reaches with it (measured on the 2-core AMD EPYC: 5.6 -> 10 GB/s).
constexpr int kPrefetchTiles = 2;

// out[m][r] = dot(x[m], w[r]) for M tokens and R weight rows; k runs over all of `in`. Each
// step of k also prefetches the next bytes of `ahead` (the weights a later tile reads), as
// many as it consumes, unless `ahead` is null.
template <int R, int M, typename W>
inline void dot_tile(const float* x, int64_t in, const W* w, const char* ahead, const char* end,
                     float out[M][R]) {
  constexpr int64_t kStepBytes = R * 8 * sizeof(W);
  v8 acc[M][R] = {};
  for (int64_t k = 0; k < in; k += 8) {
    if (ahead != nullptr) {
      for (int64_t b = 0; b < kStepBytes; b += 64)
        if (ahead + b < end) _mm_prefetch(ahead + b, _MM_HINT_T0);
      ahead += kStepBytes;
    }
    v8 wv[R];
    for (int r = 0; r < R; ++r) wv[r] = load8(w + r * in + k);
    for (int m = 0; m < M; ++m) {
      const v8 xv = load8(x + m * in + k);
      for (int r = 0; r < R; ++r) acc[m][r] = fma8(wv[r], xv, acc[m][r]);
    }
  }
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) out[m][r] = hsum8(acc[m][r]);
}

// Weight rows [row, row + R) against every token: pairs of tokens, then the odd one. The
// first pass over the tile prefetches the tile kPrefetchTiles ahead. `w` is the tile's rows,
// of the weights' type or already widened to float32.
template <int R, typename W, typename T>
inline void tile_times_rows(const float* x, int64_t n, int64_t in, const W* w, const char* ahead,
                            const char* end, const T* bias, T* out, int64_t out_features,
                            int64_t row) {
  float sums[2][R];
  auto emit = [&](int64_t m, int count) {
    for (int t = 0; t < count; ++t)
      for (int r = 0; r < R; ++r) {
        const float b = bias == nullptr ? 0.0f : to_float(bias[row + r]);
        store_scalar(out + (m + t) * out_features + row + r, sums[t][r] + b);
      }
  };
  int64_t m = 0;
  for (; m + 2 <= n; m += 2) {
    dot_tile<R, 2>(x + m * in, in, w, m == 0 ? ahead : nullptr, end, sums);
    emit(m, 2);
  }
  if (m < n) {
    dot_tile<R, 1>(x + m * in, in, w, m == 0 ? ahead : nullptr, end, sums);
    emit(m, 1);
  }
}

// Tokens above which a bfloat16 tile is widened to float32 once, rather than in every pass:
// with many tokens (prefill) the widening, not memory, bounds the loop (measured: 128 tokens
// of a 3072 x 576 projection take 15 ms widening per pass, 8 ms widening once).
constexpr int64_t kWidenOnceAbove = 2;

template <int R, typename T>
inline void rows_tile(const float* x, int64_t n, int64_t in, const T* weight, const T* bias,
                      T* out, int64_t out_features, int64_t row) {
  const T* w = weight + row * in;
  const char* end = reinterpret_cast<const char*>(weight + out_features * in);
  const char* ahead = reinterpret_cast<const char*>(w + kPrefetchTiles * R * in);
  if constexpr (sizeof(T) == 2) {
    if (n > kWidenOnceAbove) {
      thread_local std::vector<float> wide;
      wide.resize(size_t(R * in));
      for (int64_t i = 0; i < R * in; i += 8) {
        const v8 v = load8(w + i);
        std::memcpy(wide.data() + i, &v, sizeof v);
      }
      tile_times_rows<R>(x, n, in, wide.data(), ahead, end, bias, out, out_features, row);
      return;
    }
  }
  tile_times_rows<R>(x, n, in, w, ahead, end, bias, out, out_features, row);
}

// Tiles per chunk of work: 64 rows, a few tens of kilobytes of weights per claim.
constexpr int64_t kTilesPerChunk = 16;

// out[n, out_features] = x[n, in] @ weight[out_features, in]^T (+ bias), x already float32.
// Threads claim chunks of consecutive weight rows, so every weight byte is read once.
template <typename T>
void linear_rows(const float* x, int64_t n, int64_t in, const T* weight, const T* bias, T* out,
                 int64_t out_features) {
  const int64_t tiles = out_features / kTileRows;
  auto chunk = [&](int64_t c) {
    const int64_t end = std::min(tiles, (c + 1) * kTilesPerChunk);
    for (int64_t tile = c * kTilesPerChunk; tile < end; ++tile)
      rows_tile<kTileRows>(x, n, in, weight, bias, out, out_features, tile * kTileRows);
  };
  ChunkPool::instance().run((tiles + kTilesPerChunk - 1) / kTilesPerChunk, pool_threads, chunk);
  for (int64_t row = tiles * kTileRows; row < out_features; ++row)
    rows_tile<1>(x, n, in, weight, bias, out, out_features, row);
}

// Indices into `dims` (int64) and into each layer's pointers.
enum Dim { kLayers, kHidden, kInter, kHeads, kKvHeads, kHeadDim, kVocab, kBlockSize, kNumDims };
enum LayerField { kInNorm, kQkv, kQkvBias, kO, kPostNorm, kGateUp, kDown, kKeyCache, kValueCache,
                  kNumLayerFields };

// Activations of one step, reused from call to call on the calling thread.
struct Buffers {
  std::vector<float> x32;  // the current matmul input, widened to float32
  std::vector<uint8_t> residual, normed, qkv, attn, proj, gate_up, act;

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

struct StepArgs {
  const int64_t* dims;
  float eps, scale;
  const void* const* layers;  // [layers * kNumLayerFields]
  const void *embed, *final_norm, *lm_head, *cos, *sin;
  const int64_t *input_ids, *positions, *slots;
  const int32_t* block_tables;
  int64_t table_stride;
  const int32_t* seq_lens;
  int64_t n;
  void* logits;
  int64_t* argmax;        // [n] or null: each row's first argmax
  float* argmax_logprob;  // [n]: its logprob, max - log-sum-exp in float32
};

template <typename T>
int decode_step(const StepArgs& a, int dtype) {
  const int64_t* d = a.dims;
  const int64_t n = a.n, hidden = d[kHidden], inter = d[kInter], head_dim = d[kHeadDim];
  const int64_t q_size = d[kHeads] * head_dim, kv_size = d[kKvHeads] * head_dim;
  const int64_t qkv_size = q_size + 2 * kv_size;
  T* residual = Buffers::sized<T>(buffers.residual, n * hidden);
  T* normed = Buffers::sized<T>(buffers.normed, n * hidden);
  T* qkv = Buffers::sized<T>(buffers.qkv, n * qkv_size);
  T* attn = Buffers::sized<T>(buffers.attn, n * q_size);
  T* proj = Buffers::sized<T>(buffers.proj, n * hidden);  // o, then down, projections
  T* gate_up = Buffers::sized<T>(buffers.gate_up, n * 2 * inter);
  T* act = Buffers::sized<T>(buffers.act, n * inter);

  const T* embed = static_cast<const T*>(a.embed);
  for (int64_t i = 0; i < n; ++i)
    std::memcpy(residual + i * hidden, embed + a.input_ids[i] * hidden, hidden * sizeof(T));

  for (int64_t l = 0; l < d[kLayers]; ++l) {
    const void* const* p = a.layers + l * kNumLayerFields;
    // Layer 0 normalizes the embeddings; later layers first add the previous down output.
    if (l == 0)
      llmserve_rms_norm(dtype, residual, nullptr, p[kInNorm], normed, n, hidden, a.eps);
    else
      llmserve_rms_norm(dtype, proj, residual, p[kInNorm], normed, n, hidden, a.eps);
    linear(normed, n, hidden, static_cast<const T*>(p[kQkv]), static_cast<const T*>(p[kQkvBias]),
           qkv, qkv_size);
    llmserve_rotary(dtype, qkv, qkv_size, a.positions, a.cos, a.sin, n, d[kHeads] + d[kKvHeads],
                    head_dim);
    llmserve_write_kv(dtype, qkv + q_size, qkv + q_size + kv_size, qkv_size, a.slots, n, kv_size,
                      const_cast<void*>(p[kKeyCache]), const_cast<void*>(p[kValueCache]));
    // The queries are read in place from the qkv rows (query stride qkv_size).
    const int status = llmserve_paged_decode(
        dtype, head_dim, qkv, p[kKeyCache], p[kValueCache], a.block_tables, a.table_stride,
        a.seq_lens, attn, n, d[kHeads], d[kKvHeads], d[kBlockSize], a.scale, 0, qkv_size,
        /*window=*/0, /*softcap=*/0.0f);
    if (status != 0) return status;
    linear(attn, n, q_size, static_cast<const T*>(p[kO]), static_cast<const T*>(nullptr), proj,
           hidden);
    llmserve_rms_norm(dtype, proj, residual, p[kPostNorm], normed, n, hidden, a.eps);
    linear(normed, n, hidden, static_cast<const T*>(p[kGateUp]), static_cast<const T*>(nullptr),
           gate_up, 2 * inter);
    llmserve_silu_mul(dtype, gate_up, act, n, inter);
    linear(act, n, inter, static_cast<const T*>(p[kDown]), static_cast<const T*>(nullptr), proj,
           hidden);
  }
  llmserve_rms_norm(dtype, proj, residual, a.final_norm, normed, n, hidden, a.eps);
  linear(normed, n, hidden, static_cast<const T*>(a.lm_head), static_cast<const T*>(nullptr),
         static_cast<T*>(a.logits), d[kVocab]);
  if (a.argmax != nullptr) {
    // The sampler's row reductions, while the logits are still in cache: a greedy step needs
    // nothing else of them.
    thread_local std::vector<float> lse, top;
    lse.resize(size_t(n));
    top.resize(size_t(n));
    llmserve_argmax_logsumexp(dtype, a.logits, n, d[kVocab], a.argmax, lse.data(), top.data());
    for (int64_t i = 0; i < n; ++i) a.argmax_logprob[i] = top[size_t(i)] - lse[size_t(i)];
  }
  return 0;
}

}  // namespace

extern "C" {

// Returns 0, or -1 for an unsupported dtype or shape (widths not multiples of 8). With
// `argmax` (else null), also each row's first argmax and its logprob, as
// llmserve_argmax_logsumexp gives them.
int llmserve_decode_step(int dtype, const int64_t* dims, float eps, float scale,
                         const void* const* layers, const void* embed, const void* final_norm,
                         const void* lm_head, const void* cos, const void* sin,
                         const int64_t* input_ids, const int64_t* positions,
                         const int64_t* slots, const int32_t* block_tables, int64_t table_stride,
                         const int32_t* seq_lens, int64_t n, void* logits, int64_t* argmax,
                         float* argmax_logprob) {
  const int64_t q_size = dims[kHeads] * dims[kHeadDim];
  if (dims[kHidden] % 8 || dims[kInter] % 8 || q_size % 8 || dims[kHeadDim] % 8) return -1;
  const StepArgs args{dims,      eps,       scale,        layers,       embed,
                      final_norm, lm_head,  cos,          sin,          input_ids,
                      positions, slots,     block_tables, table_stride, seq_lens,
                      n,         logits,    argmax,       argmax_logprob};
  if (dtype == 0) return decode_step<float>(args, dtype);
  if (dtype == 1) return decode_step<bf16>(args, dtype);
  return -1;
}

// The threads of every parallel loop of this library (the worker's --num-threads).
int llmserve_set_num_threads(int threads) {
  if (threads < 1) return -1;
  pool_threads = threads;
  return 0;
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
