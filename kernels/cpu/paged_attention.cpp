// Paged attention for CPUs: decode and (chunked, prefix-cached) prefill over the paged KV cache.
//
// Cache layout per layer, as everywhere in llmserve: key and value caches are
// [num_blocks, block_size, num_kv_heads, head_dim]; token t of a sequence lives in block
// block_table[t / block_size] at offset t % block_size. The kernels read K/V straight from the
// blocks: no gathered copy of a sequence's context is ever made, so each cached byte is read
// once per layer (decode attention is bound by that traffic).
//
// Arithmetic is fp32 whatever the storage type (float or bfloat16), with the vectors of
// vec.h. The library is built by kernels/cpu/build.py with -march=native. Work items run on
// the library's ChunkPool (pool.h), the threads of every other loop here: one pool, whose
// loops never wait for a thread that another process keeps off its core.
//
// Entry points (extern "C", called through ctypes):
//   llmserve_paged_decode   one query token per sequence, attending to its whole context.
//   llmserve_paged_prefill  a chunk of query tokens per sequence at positions
//                           context_len .. seq_len - 1, causal over the cached context.
//
// Both take a sliding window (0 = none: a query at position p sees keys p - window < k <= p)
// and a soft-cap (0 = none: a scaled score s becomes softcap * tanh(s / softcap) before the
// softmax), per call, so each layer passes its own window.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include <immintrin.h>

#include "pool.h"
#include "vec.h"

namespace {

using namespace llmserve;

// Asks for one K or V row (head_dim values) to be brought into the caches.
template <typename T, int NV>
inline void prefetch_row(const T* row) {
  constexpr int kBytes = NV * kLanes * int(sizeof(T));
  for (int offset = 0; offset < kBytes; offset += 64) {
    __builtin_prefetch(reinterpret_cast<const char*>(row) + offset, 0, 1);
  }
}

// Scores one query head against key rows: `partial(row)` is a vector whose lanes sum to
// q . k (scaled by `post`), so kLanes rows reduce to kLanes scores with one reduce_lanes.
template <typename T, int NV>
struct KeyDot {
  vfloat q[NV];
  float post = 1.0f;
  KeyDot(const T* query, float scale) {
    for (int c = 0; c < NV; ++c) q[c] = load(query + c * kLanes) * scale;
  }
  vfloat partial(const T* row) const {
    vfloat acc = q[0] * load(row);
    for (int c = 1; c < NV; ++c) acc += q[c] * load(row + c * kLanes);
    return acc;
  }
};

#if defined(__AVX512BF16__)
// bfloat16 rows with the AVX512-BF16 dot-product instruction: no conversion of the keys,
// products exact in fp32 (the query stays unscaled bf16; the scale applies to the sums).
template <int NV>
  requires(NV % 2 == 0)
struct KeyDot<bf16, NV> {
  __m512bh q[NV / 2];
  float post;
  KeyDot(const bf16* query, float scale) : post(scale) {
    for (int c = 0; c < NV / 2; ++c) std::memcpy(&q[c], query + c * 2 * kLanes, sizeof q[c]);
  }
  vfloat partial(const bf16* row) const {
    __m512 acc = _mm512_setzero_ps();
    for (int c = 0; c < NV / 2; ++c) {
      __m512bh k;
      std::memcpy(&k, row + c * 2 * kLanes, sizeof k);
      acc = _mm512_dpbf16_ps(acc, q[c], k);
    }
    vfloat out;
    std::memcpy(&out, &acc, sizeof out);
    return out;
  }
};
#endif

// scores[o] = q . row_o for n rows `stride` apart; raises running_max to their maximum.
template <typename T, int NV>
inline void score_rows(const KeyDot<T, NV>& dot, const T* rows, int64_t stride, int64_t n,
                       float* scores, float& running_max) {
  for (int64_t o0 = 0; o0 < n; o0 += kLanes) {
    const int m = int(std::min<int64_t>(kLanes, n - o0));
    vfloat parts[kLanes];
    for (int t = 0; t < kLanes; ++t) parts[t] = t < m ? dot.partial(rows + (o0 + t) * stride) : vfloat{};
    const vfloat s = reduce_lanes(parts) * dot.post;
    if (m == kLanes) {
      store(scores + o0, s);
      running_max = std::max(running_max, hmax(s));
    } else {
      for (int t = 0; t < m; ++t) {
        scores[o0 + t] = s[t];
        running_max = std::max(running_max, s[t]);
      }
    }
  }
}

// ---- decode --------------------------------------------------------------------------------

struct DecodeArgs {
  const void* query;        // [num_seqs, num_heads, head_dim], rows query_stride apart
  const void* key_cache;    // [num_blocks, block_size, num_kv_heads, head_dim]
  const void* value_cache;  // same
  const int32_t* block_tables;  // [num_seqs, table_stride]
  int64_t table_stride;
  const int32_t* seq_lens;  // [num_seqs]
  void* out;                // [num_seqs, num_heads, head_dim]
  int64_t num_seqs;
  int64_t num_heads;
  int64_t num_kv_heads;
  int64_t block_size;
  float scale;
  // Work split: a sequence's kv heads in chunks of this many; 0 picks all of them (each
  // block one contiguous run) when there are sequences enough to keep every thread busy,
  // else one.
  int64_t kv_heads_per_item;
  int64_t query_stride;       // elements between query rows (heads are contiguous in a row)
  int64_t window;             // sliding window, 0 = none
  float softcap;              // 0 = none
};

struct DecodeScratch {
  std::vector<vfloat> acc;    // [heads, NV]
  std::vector<float> scores;  // [heads, len]
  std::vector<float> max;     // [heads], running maximum of the scores
  std::vector<float> inv_sum; // [heads], 1 / sum of the softmax numerators
};

// One sequence and its kv heads [h_begin, h_end). The rows of those heads for one token are
// adjacent in the cache, and a block holds block_size tokens back to back, so with all heads
// in one item a block is one contiguous run of memory. Pass 1 scores every key (kept, heads x
// len floats), then softmax, then pass 2 sums the value rows. Within a block the loops go
// head by head so that a head's query (or accumulator) stays in registers; the same rows of
// the next block are prefetched meanwhile, since blocks sit anywhere in the cache and the
// hardware prefetcher stalls at every block boundary. Across pass boundaries too: the last
// key block prefetches the first value block, and the last value block the first key block
// of `next_item` (seq, kv head range; nullptr if none), the item this thread takes next.
template <typename T, int NV>
void decode_range(const DecodeArgs& a, int64_t seq, int64_t h_begin, int64_t h_end,
                  const int64_t* next_item, DecodeScratch& scratch) {
  constexpr int kHeadDim = NV * kLanes;
  const int64_t group = a.num_heads / a.num_kv_heads;
  const int64_t len = a.seq_lens[seq];
  const int64_t heads = (h_end - h_begin) * group;  // query heads of this item
  const int64_t token_stride = a.num_kv_heads * kHeadDim;
  const int64_t block_stride = a.block_size * token_stride;
  const int32_t* table = a.block_tables + seq * a.table_stride;
  const T* keys = static_cast<const T*>(a.key_cache) + h_begin * kHeadDim;
  const T* values = static_cast<const T*>(a.value_cache) + h_begin * kHeadDim;
  const int64_t first_head = seq * a.num_heads + h_begin * group;  // in the output
  const T* query = static_cast<const T*>(a.query) + seq * a.query_stride + h_begin * group * kHeadDim;
  T* out = static_cast<T*>(a.out) + first_head * kHeadDim;

  if (len <= 0) {
    for (int64_t i = 0; i < heads * kHeadDim; ++i) store_scalar(out + i, 0.0f);
    return;
  }
  // Keys before `lo` are outside the window: their blocks are neither scored nor summed.
  const int64_t lo = a.window > 0 ? std::max<int64_t>(0, len - a.window) : 0;
  const int64_t first_block = lo / a.block_size;
  scratch.acc.assign(size_t(heads * NV), vfloat{});
  scratch.scores.resize(size_t(heads * len));
  scratch.max.assign(size_t(heads), -std::numeric_limits<float>::infinity());
  scratch.inv_sum.resize(size_t(heads));
  vfloat* acc_all = scratch.acc.data();
  float* scores = scratch.scores.data();

  // Pass 1: scores[head * len + t] = q_head . k_t, kLanes keys at a time per query head (the
  // head's rows of a block stay in L1 across the group's query heads).
  for (int64_t b = first_block, start = b * a.block_size; start < len; start += a.block_size, ++b) {
    const int64_t n = std::min(a.block_size, len - start);
    const int64_t block = int64_t(table[b]) * block_stride;
    const int64_t next = start + a.block_size < len ? int64_t(table[b + 1]) * block_stride : -1;
    for (int64_t h = 0; h < h_end - h_begin; ++h) {
      if (next >= 0) {
        for (int64_t o = 0; o < n; ++o) prefetch_row<T, NV>(keys + next + o * token_stride + h * kHeadDim);
      } else {  // last key block: bring in the first value block for pass 2
        const T* first = values + int64_t(table[0]) * block_stride + h * kHeadDim;
        for (int64_t o = 0; o < std::min(a.block_size, len); ++o) prefetch_row<T, NV>(first + o * token_stride);
      }
      for (int64_t g = 0; g < group; ++g) {
        const int64_t head = h * group + g;
        const KeyDot<T, NV> dot(query + head * kHeadDim, a.scale);
        score_rows(dot, keys + block + h * kHeadDim, token_stride, n, scores + head * len + start,
                   scratch.max[size_t(head)]);
      }
    }
  }

  // With a window or a soft-cap, the maximum is retaken over the window's capped scores
  // (pass 1's counts the whole first block, uncapped).
  if (a.window > 0 || a.softcap > 0.0f) {
    for (int64_t i = 0; i < heads; ++i) {
      float* row = scores + i * len;
      float m = -std::numeric_limits<float>::infinity();
      for (int64_t t = lo; t < len; ++t) {
        if (a.softcap > 0.0f) row[t] = std::tanh(row[t] / a.softcap) * a.softcap;
        m = std::max(m, row[t]);
      }
      scratch.max[size_t(i)] = m;
    }
  }

  // Softmax numerators in place; keep 1 / their sum.
  for (int64_t i = 0; i < heads; ++i) {
    float* row = scores + i * len;
    const float m = scratch.max[size_t(i)];
    vfloat total = vfloat{};
    int64_t t = lo;
    for (; t + kLanes <= len; t += kLanes) {
      const vfloat e = exp_nonpositive(load(row + t) - m);
      store(row + t, e);
      total += e;
    }
    float tail = 0.0f;
    for (; t < len; ++t) {
      row[t] = exp_nonpositive(row[t] - m);
      tail += row[t];
    }
    scratch.inv_sum[size_t(i)] = 1.0f / (hsum(total) + tail);
  }

  // Pass 2: out_head = sum_t p_head,t v_t / sum_t p_head,t
  for (int64_t b = first_block, start = b * a.block_size; start < len; start += a.block_size, ++b) {
    const int64_t n = std::min(a.block_size, len - start);
    const int64_t block = int64_t(table[b]) * block_stride;
    const int64_t next = start + a.block_size < len ? int64_t(table[b + 1]) * block_stride : -1;
    if (next < 0 && next_item != nullptr) {
      // Last value block: bring in the first key block of this thread's next item.
      const int64_t next_seq = next_item[0], next_len = a.seq_lens[next_seq];
      const T* first = static_cast<const T*>(a.key_cache) +
                       int64_t(a.block_tables[next_seq * a.table_stride]) * block_stride;
      for (int64_t o = 0; o < std::min(a.block_size, next_len); ++o)
        for (int64_t h = next_item[1]; h < next_item[2]; ++h)
          prefetch_row<T, NV>(first + o * token_stride + h * kHeadDim);
    }
    for (int64_t h = 0; h < h_end - h_begin; ++h) {
      vfloat acc[kMaxGroup][NV];
      for (int64_t g = 0; g < group; ++g)
        for (int c = 0; c < NV; ++c) acc[g][c] = acc_all[(h * group + g) * NV + c];
      for (int64_t o = std::max<int64_t>(0, lo - start); o < n; ++o) {
        const int64_t row = o * token_stride + h * kHeadDim;
        if (next >= 0) prefetch_row<T, NV>(values + next + row);
        vfloat v[NV];
        for (int c = 0; c < NV; ++c) v[c] = load(values + block + row + c * kLanes);
        for (int64_t g = 0; g < group; ++g) {
          const vfloat p = splat(scores[(h * group + g) * len + start + o]);
          for (int c = 0; c < NV; ++c) acc[g][c] += p * v[c];
        }
      }
      for (int64_t g = 0; g < group; ++g)
        for (int c = 0; c < NV; ++c) acc_all[(h * group + g) * NV + c] = acc[g][c];
    }
  }
  for (int64_t i = 0; i < heads; ++i) {
    const float inv = scratch.inv_sum[size_t(i)];
    for (int c = 0; c < NV; ++c) {
      const vfloat r = acc_all[i * NV + c] * inv;
      store(out + i * kHeadDim + c * kLanes, r);
    }
  }
}

template <typename T, int NV>
void decode(const DecodeArgs& a) {
  const int64_t chosen = a.kv_heads_per_item > 0                        ? a.kv_heads_per_item
                         : a.num_seqs >= 4 * int64_t(pool_threads) ? a.num_kv_heads
                                                                   : 1;
  const int64_t per_item = std::min(chosen, a.num_kv_heads);
  const int64_t chunks = (a.num_kv_heads + per_item - 1) / per_item;
  const int64_t items = a.num_seqs * chunks;
  auto describe = [&](int64_t item, int64_t* out) {  // seq, first and end kv head
    out[0] = item / chunks;
    out[1] = (item % chunks) * per_item;
    out[2] = std::min(out[1] + per_item, a.num_kv_heads);
  };
  // Items go round-robin, one lane of every threads-th item per thread, so that each lane
  // knows which item it takes next and can start loading that item's first key block before
  // it gets there. (Lanes are the pool's chunks: a thread that is late runs none.)
  const int64_t threads = std::min<int64_t>(pool_threads, items);
  auto lane = [&](int64_t first) {
    thread_local DecodeScratch scratch;
    int64_t current[3], next[3];
    for (int64_t item = first; item < items; item += threads) {
      describe(item, current);
      const bool has_next = item + threads < items && a.seq_lens[(item + threads) / chunks] > 0;
      if (has_next) describe(item + threads, next);
      decode_range<T, NV>(a, current[0], current[1], current[2], has_next ? next : nullptr,
                          scratch);
    }
  };
  ChunkPool::instance().run(threads, int(threads), lane);
}

// ---- prefill -------------------------------------------------------------------------------

struct PrefillArgs {
  const void* query;  // [num_tokens, num_heads, head_dim], sequences back to back
  const void* key_cache;
  const void* value_cache;
  const int32_t* block_tables;  // [num_seqs, table_stride]
  int64_t table_stride;
  const int32_t* query_start_loc;  // [num_seqs + 1]
  const int32_t* seq_lens;         // [num_seqs], cached context + this chunk
  void* out;                       // [num_tokens, num_heads, head_dim]
  int64_t num_seqs;
  int64_t num_heads;
  int64_t num_kv_heads;
  int64_t block_size;
  float scale;
  int64_t query_stride;  // elements between query rows (heads are contiguous in a row)
  int64_t window;        // sliding window, 0 = none
  float softcap;         // 0 = none
};

constexpr int kQueryTile = 32;  // query tokens per work item (times the group's heads)
constexpr int kKeyChunk = 64;  // keys per softmax update
constexpr int kKeyVectors = kKeyChunk / kLanes;  // independent score accumulators

// Per-thread scratch for prefill tiles; grows to the largest tile once.
struct PrefillScratch {
  std::vector<float> query;  // [vectors, head_dim], pre-scaled
  std::vector<vfloat> acc;   // [vectors, NV]
  std::vector<float> run_max;
  std::vector<float> run_sum;
  std::vector<float> keys;    // [head_dim, kKeyChunk]: the key chunk, transposed
  std::vector<float> values;  // [kKeyChunk, head_dim]
};

// Flash-style: for a tile of query tokens and one kv head, walk chunks of kKeyChunk keys with
// an online softmax. Each chunk is loaded once (transposed for the scores, row-major for the
// values) and used by every query vector of the tile, so the inner loops are broadcast
// multiply-adds with no horizontal sums, kKeyVectors independent accumulators for the scores,
// and one max / rescale per chunk.
template <typename T, int NV>
void prefill_tile(const PrefillArgs& a, int64_t seq, int64_t kv_head, int64_t tile,
                  PrefillScratch& scratch) {
  constexpr int kHeadDim = NV * kLanes;
  const int64_t group = a.num_heads / a.num_kv_heads;
  const int64_t q_begin = a.query_start_loc[seq];
  const int64_t q_len = a.query_start_loc[seq + 1] - q_begin;
  const int64_t seq_len = a.seq_lens[seq];
  const int64_t context = seq_len - q_len;
  const int64_t first = tile * kQueryTile;  // within the chunk
  const int64_t rows = std::min<int64_t>(kQueryTile, q_len - first);
  const int64_t token_stride = a.num_kv_heads * kHeadDim;
  const int64_t block_stride = a.block_size * token_stride;
  const int32_t* table = a.block_tables + seq * a.table_stride;
  const T* keys = static_cast<const T*>(a.key_cache) + kv_head * kHeadDim;
  const T* values = static_cast<const T*>(a.value_cache) + kv_head * kHeadDim;

  const int64_t vectors = rows * group;  // query vector r * group + g
  scratch.query.resize(size_t(vectors * kHeadDim));
  scratch.acc.resize(size_t(vectors * NV));
  scratch.run_max.resize(size_t(vectors));
  scratch.run_sum.resize(size_t(vectors));
  scratch.keys.resize(size_t(kHeadDim * kKeyChunk));
  scratch.values.resize(size_t(kKeyChunk * kHeadDim));
  float* q = scratch.query.data();
  vfloat* acc = scratch.acc.data();
  float* run_max = scratch.run_max.data();
  float* run_sum = scratch.run_sum.data();
  float* kt = scratch.keys.data();    // kt[d * kKeyChunk + j]
  float* vt = scratch.values.data();  // vt[j * kHeadDim + d]
  for (int64_t r = 0; r < rows; ++r) {
    const T* src = static_cast<const T*>(a.query) + (q_begin + first + r) * a.query_stride +
                   kv_head * group * kHeadDim;
    for (int64_t i = 0; i < group * kHeadDim; ++i) {
      q[r * group * kHeadDim + i] = to_float(src[i]) * a.scale;
    }
  }
  for (int64_t qv = 0; qv < vectors; ++qv) {
    for (int c = 0; c < NV; ++c) acc[qv * NV + c] = vfloat{};
    run_max[qv] = -std::numeric_limits<float>::infinity();
    run_sum[qv] = 0.0f;
  }

  // Keys visible to the tile's last query token: positions 0 .. context + first + rows - 1;
  // with a window, from the first query's oldest key in the window on.
  const int64_t key_end = context + first + rows;
  const int64_t key_begin =
      a.window > 0 ? std::max<int64_t>(0, context + first - a.window + 1) : 0;
  const float neg_inf = -std::numeric_limits<float>::infinity();
  alignas(64) float p[kKeyChunk];
  for (int64_t k0 = key_begin; k0 < key_end; k0 += kKeyChunk) {
    const int64_t n = std::min<int64_t>(kKeyChunk, key_end - k0);
    for (int64_t j = 0; j < n; ++j) {
      const int64_t pos = k0 + j;
      const int64_t offset = int64_t(table[pos / a.block_size]) * block_stride +
                             (pos % a.block_size) * token_stride;
      const T* krow = keys + offset;
      const T* vrow = values + offset;
      for (int c = 0; c < NV; ++c) store(vt + j * kHeadDim + c * kLanes, load(vrow + c * kLanes));
      for (int d = 0; d < kHeadDim; ++d) kt[d * kKeyChunk + j] = to_float(krow[d]);
    }
    for (int64_t j = n; j < kKeyChunk; ++j) {
      for (int d = 0; d < kHeadDim; ++d) kt[d * kKeyChunk + j] = 0.0f;
      for (int d = 0; d < kHeadDim; ++d) vt[j * kHeadDim + d] = 0.0f;
    }
    const vint lane = lane_indices();
    for (int64_t qv = 0; qv < vectors; ++qv) {
      const int64_t q_pos = context + first + qv / group;
      if (k0 > q_pos) continue;  // the whole chunk is in this query's future
      // The whole chunk is older than this query's window.
      if (a.window > 0 && k0 + n - 1 <= q_pos - a.window) continue;
      // Key vectors of the chunk this query sees at all (the rest are wholly in its future).
      const int live = int(std::min<int64_t>(kKeyVectors, (q_pos - k0) / kLanes + 1));
      const float* qrow = q + qv * kHeadDim;
      vfloat s[kKeyVectors] = {};
      for (int d = 0; d < kHeadDim; ++d) {
        const vfloat qd = splat(qrow[d]);
        for (int v = 0; v < kKeyVectors; ++v) {
          if (v < live) s[v] += qd * load(kt + d * kKeyChunk + v * kLanes);
        }
      }
      if (a.softcap > 0.0f) {
        for (int v = 0; v < live; ++v) {
          alignas(64) float lanes[kLanes];
          store(lanes, s[v]);
          for (int l = 0; l < kLanes; ++l) lanes[l] = std::tanh(lanes[l] / a.softcap) * a.softcap;
          s[v] = load(lanes);
        }
      }
      const int32_t oldest = a.window > 0 ? int32_t(q_pos - a.window) : -1;
      vfloat chunk_max = splat(neg_inf);
      for (int v = 0; v < kKeyVectors; ++v) {
        const vint key = lane + int32_t(k0 + v * kLanes);
        const vint visible = (key <= int32_t(q_pos)) & (key > oldest);
        s[v] = v < live ? (visible ? s[v] : splat(neg_inf)) : splat(neg_inf);
        chunk_max = s[v] > chunk_max ? s[v] : chunk_max;
      }
      const float new_max = std::max(run_max[qv], hmax(chunk_max));
      const float correction = exp_nonpositive(run_max[qv] - new_max);
      vfloat total = vfloat{};
      for (int v = 0; v < kKeyVectors; ++v) {
        const vfloat e = exp_nonpositive(s[v] - new_max);
        store(p + v * kLanes, e);
        total += e;
      }
      run_sum[qv] = run_sum[qv] * correction + hsum(total);
      run_max[qv] = new_max;
      vfloat o[NV];
      for (int c = 0; c < NV; ++c) o[c] = acc[qv * NV + c] * correction;
      const int64_t keys_seen = std::min<int64_t>(n, int64_t(live) * kLanes);
      for (int64_t j = 0; j < keys_seen; ++j) {
        const vfloat pj = splat(p[j]);
        for (int c = 0; c < NV; ++c) o[c] += pj * load(vt + j * kHeadDim + c * kLanes);
      }
      for (int c = 0; c < NV; ++c) acc[qv * NV + c] = o[c];
    }
  }

  for (int64_t r = 0; r < rows; ++r) {
    T* dst = static_cast<T*>(a.out) +
             ((q_begin + first + r) * a.num_heads + kv_head * group) * kHeadDim;
    for (int64_t g = 0; g < group; ++g) {
      const int64_t qv = r * group + g;
      const float inv = 1.0f / run_sum[qv];
      for (int c = 0; c < NV; ++c) {
        const vfloat v = acc[qv * NV + c] * inv;
        store(dst + g * kHeadDim + c * kLanes, v);
      }
    }
  }
}

template <typename T, int NV>
void prefill(const PrefillArgs& a) {
  // Work items are (query tile, kv head); tiles of later queries see more keys, so they are
  // handed out dynamically, last (largest) first.
  std::vector<int64_t> tile_start(size_t(a.num_seqs + 1), 0);
  for (int64_t s = 0; s < a.num_seqs; ++s) {
    const int64_t q_len = a.query_start_loc[s + 1] - a.query_start_loc[s];
    tile_start[size_t(s + 1)] = tile_start[size_t(s)] + (q_len + kQueryTile - 1) / kQueryTile;
  }
  const int64_t items = tile_start[size_t(a.num_seqs)] * a.num_kv_heads;
  // Claimed in order, so the largest items go first.
  auto item_at = [&](int64_t claim) {
    thread_local PrefillScratch scratch;
    const int64_t item = items - 1 - claim;
    const int64_t flat_tile = item / a.num_kv_heads;
    const int64_t kv_head = item % a.num_kv_heads;
    const int64_t seq = int64_t(std::upper_bound(tile_start.begin(), tile_start.end(),
                                                 flat_tile) -
                                tile_start.begin() - 1);
    prefill_tile<T, NV>(a, seq, kv_head, flat_tile - tile_start[size_t(seq)], scratch);
  };
  ChunkPool::instance().run(items, pool_threads, item_at);
}

// ---- dispatch ------------------------------------------------------------------------------

template <template <typename, int> class F, typename Args>
int dispatch(int dtype, int64_t head_dim, const Args& args) {
  // dtype: 0 = float32, 1 = bfloat16. Returns 0 on success, -1 for an unsupported shape.
#define LLMSERVE_CASE(T, HEAD_DIM)        \
  if (head_dim == HEAD_DIM) {             \
    F<T, HEAD_DIM / kLanes>::run(args);   \
    return 0;                             \
  }
#define LLMSERVE_CASES(T) \
  LLMSERVE_CASE(T, 16)    \
  LLMSERVE_CASE(T, 32)    \
  LLMSERVE_CASE(T, 64)    \
  LLMSERVE_CASE(T, 96)    \
  LLMSERVE_CASE(T, 128)   \
  LLMSERVE_CASE(T, 256)
  // The head dims of kernels/cpu/attention.py's SUPPORTED_HEAD_DIMS (multiples of kLanes).
  if (dtype == 0) {
    LLMSERVE_CASES(float)
  } else if (dtype == 1) {
    LLMSERVE_CASES(bf16)
  }
#undef LLMSERVE_CASES
#undef LLMSERVE_CASE
  return -1;
}

template <typename T, int NV>
struct DecodeOp {
  static void run(const DecodeArgs& a) { decode<T, NV>(a); }
};

template <typename T, int NV>
struct PrefillOp {
  static void run(const PrefillArgs& a) { prefill<T, NV>(a); }
};

}  // namespace

extern "C" {

int llmserve_paged_decode(int dtype, int64_t head_dim, const void* query, const void* key_cache,
                          const void* value_cache, const int32_t* block_tables,
                          int64_t table_stride, const int32_t* seq_lens, void* out,
                          int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                          int64_t block_size, float scale, int64_t kv_heads_per_item,
                          int64_t query_stride, int64_t window, float softcap) {
  const DecodeArgs args{query,      key_cache, value_cache,       block_tables, table_stride,
                        seq_lens,   out,       num_seqs,          num_heads,    num_kv_heads,
                        block_size, scale,     kv_heads_per_item, query_stride, window,
                        softcap};
  return dispatch<DecodeOp>(dtype, head_dim, args);
}

int llmserve_paged_prefill(int dtype, int64_t head_dim, const void* query, const void* key_cache,
                           const void* value_cache, const int32_t* block_tables,
                           int64_t table_stride, const int32_t* query_start_loc,
                           const int32_t* seq_lens, void* out, int64_t num_seqs,
                           int64_t num_heads, int64_t num_kv_heads, int64_t block_size,
                           float scale, int64_t query_stride, int64_t window,
                           float softcap) {
  const PrefillArgs args{query,           key_cache,  value_cache, block_tables, table_stride,
                         query_start_loc, seq_lens,   out,         num_seqs,     num_heads,
                         num_kv_heads,    block_size, scale,       query_stride, window,
                         softcap};
  return dispatch<PrefillOp>(dtype, head_dim, args);
}

}  // extern "C"
