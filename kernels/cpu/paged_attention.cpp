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
//   llmserve_paged_decode   (here) one query token per sequence, attending to its whole
//                           context.
//   llmserve_paged_prefill  (paged_prefill.cpp) a chunk of query tokens per sequence at
//                           positions context_len .. seq_len - 1, causal over the cached
//                           context. Both score keys with attention.h.
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

#include "attention.h"
#include "pool.h"
#include "vec.h"

namespace {

using namespace llmserve;
using namespace llmserve::attention;

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

template <typename T, int NV>
struct DecodeOp {
  static void run(const DecodeArgs& a) { decode<T, NV>(a); }
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

}  // extern "C"
