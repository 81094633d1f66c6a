// Paged attention for CPUs: decode and (chunked, prefix-cached) prefill over the paged KV cache.
//
// Cache layout per layer, as everywhere in llmserve: key and value caches are
// [num_blocks, block_size, num_kv_heads, head_dim]; token t of a sequence lives in block
// block_table[t / block_size] at offset t % block_size. A block's rows are back to back;
// blocks lie `block_stride` elements apart, which may be more than a block when a layer's
// caches are views into one block-major pool that all layers share (the key and value caches
// share one block stride). The kernels read K/V straight from the blocks: no gathered copy of
// a sequence's context is ever made, so each cached byte is read once per layer (decode
// attention is bound by that traffic).
//
// Arithmetic is fp32 whatever the storage type (float or bfloat16), with the vectors of
// vec.h; only the prefill's `bf16_dots` (fast mode, prefill_chunk.h) rounds its operands.
// The library is built by llmserve_kernels/cpu/build.py with -march=native. Work items run on the
// library's ChunkPool (pool.h), the threads of every other loop here: one pool, whose loops
// never wait for a thread that another process keeps off its core.
//
// Entry points (extern "C", called through ctypes):
//   llmserve_paged_decode   (here) one query token per row, attending to its whole
//                           context (a long one in partitions, merged); consecutive rows that
//                           read the same blocks (a sequence's last token and its drafts)
//                           share one pass over them.
//   llmserve_paged_prefill  (paged_prefill.cpp) a chunk of query tokens per sequence at
//                           positions context_len .. seq_len - 1, causal over the cached
//                           context. Both score keys with attention.h.
//
// Both take a sliding window (0 = none: a query at position p sees keys p - window < k <= p),
// a soft-cap (0 = none: a scaled score s becomes softcap * tanh(s / softcap) before the
// softmax) and attention sinks (nullptr = none: float32 [num_heads], head h's softmax
// denominator also holds exp(sinks[h]), a logit with no value), per call, so each layer
// passes its own.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
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
  int64_t block_stride;  // elements from one block to the next, in both caches
  float scale;
  // Work split: a piece's kv heads in chunks of this many (a piece: a row, or rows that read
  // the same blocks; decode()); 0 picks all of them (each block one contiguous run) when
  // there are pieces, or pieces' partitions, enough to keep every thread busy, else one, and
  // splits a kv head's query heads too where the items would leave a thread idle.
  int64_t kv_heads_per_item;
  int64_t query_stride;       // elements between query rows (heads are contiguous in a row)
  int64_t window;             // sliding window, 0 = none
  float softcap;              // 0 = none
  const float* sinks;         // [num_heads] sink logits, nullptr = none
};

struct DecodeScratch {
  std::vector<vfloat> acc;     // [rows, heads, NV]
  std::vector<float> scores;   // per row [heads, its len], back to back
  std::vector<float> max;      // [rows, heads], running maximum of the scores
  std::vector<float> inv_sum;  // [rows, heads], 1 / sum of the softmax numerators
};

// Rows that read the same cache blocks, at most this many to a work item (decode's split).
constexpr int64_t kMaxRows = 32;

// One block's value rows for one kv head and one query row: rows [begin, end) at `rows`
// (`token_stride` apart), the next block's same rows prefetched (nullptr: none), and the
// softmax numerators of the group's heads for them (head g's at scores[g * score_stride + o]).
template <typename T>
struct ValueRun {
  const T* rows;
  const T* next;
  int64_t token_stride;
  int64_t begin;
  int64_t end;
  const float* scores;
  int64_t score_stride;
};

// acc[g * NV + c] += sum over the run's rows o of p_g,o v_o (lanes c), in row order. G: the
// group size when known at compile time (its accumulators then stay in registers), 0: any.
template <typename T, int NV, int G>
inline void sum_values(const ValueRun<T>& run, vfloat* acc_out, int64_t group) {
  constexpr int kSlots = G > 0 ? G : kMaxGroup;
  const int64_t heads = G > 0 ? G : group;
  vfloat acc[kSlots][NV];
  for (int64_t g = 0; g < heads; ++g)
    for (int c = 0; c < NV; ++c) acc[g][c] = acc_out[g * NV + c];
  for (int64_t o = run.begin; o < run.end; ++o) {
    const int64_t row = o * run.token_stride;
    if (run.next != nullptr) prefetch_row<T, NV>(run.next + row);
    vfloat v[NV];
    for (int c = 0; c < NV; ++c) v[c] = load(run.rows + row + c * kLanes);
    for (int64_t g = 0; g < heads; ++g) {
      const vfloat p = splat(run.scores[g * run.score_stride + o]);
      for (int c = 0; c < NV; ++c) acc[g][c] += p * v[c];
    }
  }
  for (int64_t g = 0; g < heads; ++g)
    for (int c = 0; c < NV; ++c) acc_out[g * NV + c] = acc[g][c];
}

// A row attends to its keys [lo, len) in partitions: each leaves per head its maximum, its sum
// of softmax numerators and its sum of value rows weighted by them, and merge_rows() combines
// them in partition order. Partition k covers the tokens [k * size, (k + 1) * size), except
// that the first starts at lo and takes in a partial first span, and the last ends at len and
// takes in the rest: every partition of a row longer than `size` holds size to 2 * size - 1
// tokens, and a row of under 2 * size tokens is one partition, attended with no merge. Where
// a row's partitions begin and end follows from its length and the window alone, so its bits
// do not depend on the other rows or on which work items the partitions went to. The size is
// a whole number of blocks, so a block lies in one partition.
constexpr int64_t kPartitionTokens = 256;

inline int64_t partition_size(int64_t block_size) {
  return std::max<int64_t>(1, kPartitionTokens / block_size) * block_size;
}

// One row's partitions: indexes first .. last, and the keys [lo, len) they cover (len > 0).
struct RowPartitions {
  int64_t lo, len, size, first, last;

  RowPartitions(const DecodeArgs& a, int64_t row, int64_t size_) : size(size_) {
    len = std::max<int32_t>(a.seq_lens[row], 0);
    lo = a.window > 0 ? std::max<int64_t>(0, len - a.window) : 0;
    first = lo / size + (lo % size != 0 ? 1 : 0);
    last = std::max(first, len / size - 1);
  }
  int64_t count() const { return last - first + 1; }
  bool has(int64_t k) const { return len > 0 && k >= first && k <= last; }
  int64_t begin(int64_t k) const { return k == first ? lo : k * size; }
  int64_t end(int64_t k) const { return k == last ? len : (k + 1) * size; }
};

// A partition's results for one row and head, as merge_rows() reads them: [0] the maximum
// (a sink included), [1] the sum of numerators (the sink's left out), then head_dim floats of
// the weighted value sum.
inline int64_t partial_floats(int64_t head_dim) { return head_dim + 2; }

// Query rows seq .. seq + rows - 1 (one row each: a sequence, or a sequence's last token and the
// drafted tokens after it, which read the same blocks up to one more token each), their
// partition k (rows without one are skipped), and their kv heads [h_begin, h_end), of each kv
// head the query heads [g_begin, g_begin + g_count) of its group (the whole group unless the
// item has one kv head). The rows of those heads for one token are adjacent in the cache, and a
// block holds block_size tokens back to back, so with all heads in one item a block is one
// contiguous run of memory. Pass 1 scores every key (kept, heads x the partition's tokens a
// row), then softmax, then pass 2 sums the value rows. Within a block the loops go head by
// head, then row by row, so that a head's query (or accumulator) stays in registers and the
// block's rows, brought in for the first query row, are in L1 for the others. Each row's
// arithmetic is the same whatever the other rows, so its bits do not depend on them. The same
// rows of the next block are prefetched meanwhile, since blocks sit anywhere in the cache and
// the hardware prefetcher stalls at every block boundary. Across pass boundaries too: the last
// key block prefetches the first value block, and the last value block the first key block of
// `next_item` (seq, kv head range, block index; nullptr if none), what this thread takes next.
// A row whose context is one partition gets its output; another leaves its partial results
// at partials + part_base[row] for merge_rows().
template <typename T, int NV>
void decode_rows(const DecodeArgs& a, int64_t size, int64_t seq, int64_t rows, int64_t h_begin,
                 int64_t h_end, int64_t g_begin, int64_t g_count, int64_t k,
                 const int64_t* next_item, float* partials, const int64_t* part_base,
                 DecodeScratch& scratch) {
  constexpr int kHeadDim = NV * kLanes;
  const int64_t group = g_count;  // query heads of this item per kv head
  const int64_t heads = (h_end - h_begin) * group;  // query heads of this item, per row
  // The item's first query head; the others follow it in the query and output rows.
  const int64_t first_head = h_begin * (a.num_heads / a.num_kv_heads) + g_begin;
  const int64_t token_stride = a.num_kv_heads * kHeadDim;
  const int64_t block_stride = a.block_stride;
  const int32_t* table = a.block_tables + seq * a.table_stride;  // the rows': the same blocks
  const T* keys = static_cast<const T*>(a.key_cache) + h_begin * kHeadDim;
  const T* values = static_cast<const T*>(a.value_cache) + h_begin * kHeadDim;

  // Per row, in this partition: its keys [lo, len) (keys before `lo` are neither scored nor
  // summed, nor are blocks wholly before it; len 0: the row has no keys here), the block its
  // scores start at, where they start in the scratch and how many a head has (from the
  // first block's start), this partition's index among the row's, and how many it has.
  int64_t len[kMaxRows], lo[kMaxRows], first_block[kMaxRows], score_base[kMaxRows];
  int64_t score_len[kMaxRows], partition_of[kMaxRows], partitions[kMaxRows];
  int64_t scores_size = 0, len_max = 0, block_min = std::numeric_limits<int64_t>::max();
  for (int64_t r = 0; r < rows; ++r) {
    const RowPartitions parts(a, seq + r, size);
    partitions[r] = parts.count();
    partition_of[r] = k - parts.first;
    len[r] = parts.has(k) ? parts.end(k) : 0;
    lo[r] = parts.has(k) ? parts.begin(k) : 0;
    first_block[r] = lo[r] / a.block_size;
    score_base[r] = scores_size;
    score_len[r] = len[r] > 0 ? len[r] - first_block[r] * a.block_size : 0;
    scores_size += heads * score_len[r];
    len_max = std::max(len_max, len[r]);
    if (len[r] > 0) block_min = std::min(block_min, first_block[r]);
    if (parts.len == 0) {
      T* out = static_cast<T*>(a.out) + ((seq + r) * a.num_heads + first_head) * kHeadDim;
      for (int64_t i = 0; i < heads * kHeadDim; ++i) store_scalar(out + i, 0.0f);
    }
  }
  if (len_max == 0) return;
  scratch.acc.assign(size_t(rows * heads * NV), vfloat{});
  scratch.scores.resize(size_t(scores_size));
  scratch.max.assign(size_t(rows * heads), -std::numeric_limits<float>::infinity());
  scratch.inv_sum.resize(size_t(rows * heads));
  // Whether row r reads block b starting at token `start`.
  auto reads = [&](int64_t r, int64_t b, int64_t start) {
    return start < len[r] && b >= first_block[r];
  };
  // Row r's scores of head `head` for the keys from `start` on.
  auto scores_at = [&](int64_t r, int64_t head, int64_t start) {
    return scratch.scores.data() + score_base[r] + head * score_len[r] +
           (start - first_block[r] * a.block_size);
  };

  // Pass 1: scores[head][t] = q_head . k_t, kLanes keys at a time per query head (the head's
  // rows of a block stay in L1 across the group's query heads and the rows).
  for (int64_t b = block_min, start = b * a.block_size; start < len_max;
       start += a.block_size, ++b) {
    const int64_t block = int64_t(table[b]) * block_stride;
    const int64_t next = start + a.block_size < len_max ? int64_t(table[b + 1]) * block_stride : -1;
    const int64_t fetched = std::min(a.block_size, len_max - start - a.block_size);
    for (int64_t h = 0; h < h_end - h_begin; ++h) {
      if (next >= 0) {
        for (int64_t o = 0; o < fetched; ++o) prefetch_row<T, NV>(keys + next + o * token_stride + h * kHeadDim);
      } else {  // last key block: bring in the first value block for pass 2
        const T* first = values + int64_t(table[block_min]) * block_stride + h * kHeadDim;
        for (int64_t o = 0; o < std::min(a.block_size, len_max - block_min * a.block_size); ++o)
          prefetch_row<T, NV>(first + o * token_stride);
      }
      for (int64_t r = 0; r < rows; ++r) {
        if (!reads(r, b, start)) continue;
        const int64_t n = std::min(a.block_size, len[r] - start);
        const T* query =
            static_cast<const T*>(a.query) + (seq + r) * a.query_stride + first_head * kHeadDim;
        for (int64_t g = 0; g < group; ++g) {
          const int64_t head = h * group + g;
          const KeyDot<T, NV> dot(query + head * kHeadDim, a.scale);
          score_rows(dot, keys + block + h * kHeadDim, token_stride, n, scores_at(r, head, start),
                     scratch.max[size_t(r * heads + head)]);
        }
      }
    }
  }

  for (int64_t r = 0; r < rows; ++r) {
    if (len[r] == 0) continue;
    float* max = scratch.max.data() + r * heads;
    // With a window or a soft-cap, the maximum is retaken over the window's capped scores
    // (pass 1's counts the whole first block, uncapped).
    if (a.window > 0 || a.softcap > 0.0f) {
      for (int64_t i = 0; i < heads; ++i) {
        float* row = scores_at(r, i, lo[r]);
        float m = -std::numeric_limits<float>::infinity();
        for (int64_t t = 0; t < len[r] - lo[r]; ++t) {
          if (a.softcap > 0.0f) row[t] = std::tanh(row[t] / a.softcap) * a.softcap;
          m = std::max(m, row[t]);
        }
        max[i] = m;
      }
    }
    // A head's sink joins its maximum, and its numerator (below) the sum, once: in a row of
    // several partitions, at the merge.
    const float* sinks = a.sinks == nullptr ? nullptr : a.sinks + first_head;
    if (sinks != nullptr) {
      for (int64_t i = 0; i < heads; ++i) max[i] = std::max(max[i], sinks[i]);
    }
    // Softmax numerators in place; keep 1 / their sum, or their sum for the merge.
    for (int64_t i = 0; i < heads; ++i) {
      float* row = scores_at(r, i, lo[r]);
      const int64_t n = len[r] - lo[r];
      const float m = max[i];
      vfloat total = vfloat{};
      int64_t t = 0;
      for (; t + kLanes <= n; t += kLanes) {
        const vfloat e = exp_nonpositive(load(row + t) - m);
        store(row + t, e);
        total += e;
      }
      float tail = 0.0f;
      for (; t < n; ++t) {
        row[t] = exp_nonpositive(row[t] - m);
        tail += row[t];
      }
      if (partitions[r] > 1) {
        scratch.inv_sum[size_t(r * heads + i)] = hsum(total) + tail;
        continue;
      }
      if (sinks != nullptr) tail += exp_nonpositive(sinks[i] - m);
      scratch.inv_sum[size_t(r * heads + i)] = 1.0f / (hsum(total) + tail);
    }
  }

  // Pass 2: out_head = sum_t p_head,t v_t / sum_t p_head,t
  for (int64_t b = block_min, start = b * a.block_size; start < len_max;
       start += a.block_size, ++b) {
    const int64_t block = int64_t(table[b]) * block_stride;
    const int64_t next = start + a.block_size < len_max ? int64_t(table[b + 1]) * block_stride : -1;
    if (next < 0 && next_item != nullptr) {
      // Last value block: bring in the first key block of this thread's next item.
      const int64_t next_seq = next_item[0], next_block = next_item[3];
      const int64_t rest = a.seq_lens[next_seq] - next_block * a.block_size;
      const T* first = static_cast<const T*>(a.key_cache) +
                       int64_t(a.block_tables[next_seq * a.table_stride + next_block]) * block_stride;
      for (int64_t o = 0; o < std::min(a.block_size, rest); ++o)
        for (int64_t h = next_item[1]; h < next_item[2]; ++h)
          prefetch_row<T, NV>(first + o * token_stride + h * kHeadDim);
    }
    for (int64_t h = 0; h < h_end - h_begin; ++h) {
      for (int64_t r = 0; r < rows; ++r) {
        if (!reads(r, b, start)) continue;
        const int64_t n = std::min(a.block_size, len[r] - start);
        const ValueRun<T> run{values + block + h * kHeadDim,
                              next >= 0 && r == 0 ? values + next + h * kHeadDim : nullptr,
                              token_stride,
                              std::max<int64_t>(0, lo[r] - start),
                              n,
                              scores_at(r, h * group, start),
                              score_len[r]};
        vfloat* acc = scratch.acc.data() + (r * heads + h * group) * NV;
        switch (group) {  // the group's accumulators in registers for the common sizes
          case 1: sum_values<T, NV, 1>(run, acc, 1); break;
          case 2: sum_values<T, NV, 2>(run, acc, 2); break;
          case 3: sum_values<T, NV, 3>(run, acc, 3); break;
          case 4: sum_values<T, NV, 4>(run, acc, 4); break;
          case 8: sum_values<T, NV, 8>(run, acc, 8); break;
          default: sum_values<T, NV, 0>(run, acc, group);
        }
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    if (len[r] == 0) continue;
    if (partitions[r] > 1) {
      for (int64_t i = 0; i < heads; ++i) {
        float* partial = partials + part_base[seq + r] +
                         ((first_head + i) * partitions[r] + partition_of[r]) * partial_floats(kHeadDim);
        partial[0] = scratch.max[size_t(r * heads + i)];
        partial[1] = scratch.inv_sum[size_t(r * heads + i)];
        const vfloat* acc = scratch.acc.data() + (r * heads + i) * NV;
        for (int c = 0; c < NV; ++c) store(partial + 2 + c * kLanes, acc[c]);
      }
      continue;
    }
    T* out = static_cast<T*>(a.out) + ((seq + r) * a.num_heads + first_head) * kHeadDim;
    for (int64_t i = 0; i < heads; ++i) {
      const float inv = scratch.inv_sum[size_t(r * heads + i)];
      const vfloat* acc = scratch.acc.data() + (r * heads + i) * NV;
      for (int c = 0; c < NV; ++c) store(out + i * kHeadDim + c * kLanes, acc[c] * inv);
    }
  }
}

// The outputs of rows seq .. seq + rows - 1 that have several partitions, for the query heads
// [first_head, first_head + heads), from every partition's results, in partition order: each
// partition's sums rescaled from its maximum to the largest, the sink's numerator added to
// the denominator.
template <typename T, int NV>
void merge_rows(const DecodeArgs& a, int64_t size, int64_t seq, int64_t rows,
                int64_t first_head, int64_t heads, const float* partials,
                const int64_t* part_base) {
  constexpr int kHeadDim = NV * kLanes;
  for (int64_t r = seq; r < seq + rows; ++r) {
    const RowPartitions parts(a, r, size);
    if (parts.len == 0 || parts.count() == 1) continue;
    const int64_t count = parts.count();
    for (int64_t head = first_head; head < first_head + heads; ++head) {
      const float* first = partials + part_base[r] + head * count * partial_floats(kHeadDim);
      float m = -std::numeric_limits<float>::infinity();
      for (int64_t p = 0; p < count; ++p) m = std::max(m, first[p * partial_floats(kHeadDim)]);
      float sum = 0.0f;
      vfloat acc[NV] = {};
      for (int64_t p = 0; p < count; ++p) {
        const float* partial = first + p * partial_floats(kHeadDim);
        const float f = exp_nonpositive(partial[0] - m);
        sum += f * partial[1];
        for (int c = 0; c < NV; ++c) acc[c] += splat(f) * load(partial + 2 + c * kLanes);
      }
      if (a.sinks != nullptr) sum += exp_nonpositive(a.sinks[head] - m);
      const vfloat inv = splat(1.0f / sum);
      T* out = static_cast<T*>(a.out) + (r * a.num_heads + head) * kHeadDim;
      for (int c = 0; c < NV; ++c) store(out + c * kLanes, acc[c] * inv);
    }
  }
}

// Whether query rows i and i + 1 read the same blocks: i + 1 is one token longer and its
// block table agrees over every block it reads (a sequence's token and its next draft).
inline bool same_blocks(const DecodeArgs& a, int64_t i) {
  const int64_t len = a.seq_lens[i];
  if (len <= 0 || a.seq_lens[i + 1] != len + 1) return false;
  const int64_t blocks = (len + 1 + a.block_size - 1) / a.block_size;
  return std::memcmp(a.block_tables + i * a.table_stride, a.block_tables + (i + 1) * a.table_stride,
                     size_t(blocks) * sizeof(int32_t)) == 0;
}

// A decode call's split of its rows into work items, kept by the calling thread from call to
// call so that a step's layers reuse its buffers (lanes on other threads reach them through
// the reference decode() takes, not as their own thread_local).
struct DecodePlan {
  struct Item {
    int64_t piece, k, chunk, part;  // partition k, kv head chunk, query head part
    int64_t cost, lane;             // the keys it scores, the lane that runs it
  };
  std::vector<int64_t> runs;       // first row of each run, then num_seqs
  std::vector<int64_t> pieces;     // first row of each piece, then num_seqs
  std::vector<int64_t> k_first;    // per piece, its first and last partition
  std::vector<int64_t> k_last;
  std::vector<int64_t> part_base;  // per row of several partitions, its partial results' offset
  std::vector<char> merged;        // per piece, whether a row of it has several partitions
  std::vector<float> partials;
  std::vector<Item> items;
  std::vector<int64_t> order;      // items, the largest first
  std::vector<int64_t> load;       // per lane, the keys of its items
  std::unique_ptr<std::atomic<int64_t>[]> pending;  // per group: partitions still to run
  int64_t pending_size = 0;
};

template <typename T, int NV>
void decode(const DecodeArgs& a) {
  constexpr int kHeadDim = NV * kLanes;
  const int64_t threads_max = int64_t(pool_threads);
  const int64_t size = partition_size(a.block_size);
  thread_local DecodePlan caller_plan;
  DecodePlan& plan = caller_plan;
  // Runs of rows that read the same blocks, split into pieces (one per work item's rows): a
  // run into as many pieces as keep the threads busy when runs are fewer than threads, so
  // each piece reads the blocks once for its rows.
  std::vector<int64_t>& runs = plan.runs;
  runs.clear();
  for (int64_t i = 0; i < a.num_seqs; ++i) {
    if (i == 0 || !same_blocks(a, i - 1)) runs.push_back(i);
  }
  const int64_t num_runs = int64_t(runs.size());
  runs.push_back(a.num_seqs);
  std::vector<int64_t>& pieces = plan.pieces;
  pieces.clear();
  const int64_t split = (threads_max + num_runs - 1) / std::max<int64_t>(num_runs, 1);
  for (int64_t k = 0; k < num_runs; ++k) {
    const int64_t count = runs[size_t(k + 1)] - runs[size_t(k)];
    const int64_t parts = std::max((count + kMaxRows - 1) / kMaxRows, std::min(split, count));
    for (int64_t p = 0; p < parts; ++p) pieces.push_back(runs[size_t(k)] + p * count / parts);
  }
  const int64_t num_pieces = int64_t(pieces.size());
  pieces.push_back(a.num_seqs);

  // Each piece's partitions (the union of its rows'; one for a piece of empty rows), and
  // where each row of several partitions keeps its partial results.
  plan.k_first.assign(size_t(num_pieces), 0);
  plan.k_last.assign(size_t(num_pieces), 0);
  plan.merged.assign(size_t(num_pieces), 0);
  plan.part_base.assign(size_t(a.num_seqs), -1);
  int64_t partial_size = 0, units = 0;
  for (int64_t p = 0; p < num_pieces; ++p) {
    int64_t first = std::numeric_limits<int64_t>::max(), last = 0;
    for (int64_t r = pieces[size_t(p)]; r < pieces[size_t(p + 1)]; ++r) {
      const RowPartitions parts(a, r, size);
      if (parts.len == 0) continue;
      first = std::min(first, parts.first);
      last = std::max(last, parts.last);
      if (parts.count() > 1) {
        plan.part_base[size_t(r)] = partial_size;
        partial_size += parts.count() * a.num_heads * partial_floats(kHeadDim);
        plan.merged[size_t(p)] = 1;
      }
    }
    if (first > last) first = last = 0;
    plan.k_first[size_t(p)] = first;
    plan.k_last[size_t(p)] = last;
    units += last - first + 1;
  }
  if (int64_t(plan.partials.size()) < partial_size) plan.partials.resize(size_t(partial_size));
  float* const partials = plan.partials.data();
  const int64_t* const part_base = plan.part_base.data();
  const int64_t* const k_first = plan.k_first.data();
  const int64_t* const k_last = plan.k_last.data();
  const char* const merged = plan.merged.data();

  // The first key block a work item reads: that of the piece's first row in partition k (the
  // shortest row, whose window starts first).
  auto first_block = [&](int64_t piece, int64_t k) {
    const RowPartitions parts(a, pieces[size_t(piece)], size);
    return (k <= parts.first ? parts.lo : k * size) / a.block_size;
  };

  // Pieces enough to keep every thread busy: a work item is a piece, all its kv heads (each
  // block one contiguous run) and all its partitions in order, merged at once. Items go
  // round-robin, one lane of every threads-th item per thread, so that each lane knows which
  // item it takes next and can start loading that item's first key block before it gets
  // there. (Lanes are the pool's chunks: a thread that is late runs none.)
  if (a.kv_heads_per_item == 0 && num_pieces >= 4 * threads_max) {
    const int64_t threads = threads_max;
    auto lane = [&](int64_t first) {
      thread_local DecodeScratch scratch;
      int64_t next[4];
      for (int64_t piece = first; piece < num_pieces; piece += threads) {
        const int64_t seq = pieces[size_t(piece)], rows = pieces[size_t(piece + 1)] - seq;
        for (int64_t k = k_first[piece]; k <= k_last[piece]; ++k) {
          const bool last = k == k_last[piece];
          const int64_t next_piece = last ? piece + threads : piece;
          bool has_next = next_piece < num_pieces;
          if (has_next) {
            next[0] = pieces[size_t(next_piece)];
            next[1] = 0;
            next[2] = a.num_kv_heads;
            next[3] = first_block(next_piece, last ? k_first[next_piece] : k + 1);
            has_next = a.seq_lens[next[0]] > 0;
          }
          decode_rows<T, NV>(a, size, seq, rows, 0, a.num_kv_heads, 0,
                             a.num_heads / a.num_kv_heads, k, has_next ? next : nullptr,
                             partials, part_base, scratch);
        }
        if (merged[piece]) merge_rows<T, NV>(a, size, seq, rows, 0, a.num_heads, partials, part_base);
      }
    };
    ChunkPool::instance().run(threads, int(threads), lane);
    return;
  }

  // Otherwise a work item is one partition of a piece and a chunk of its kv heads: all of
  // them when there are at least two partitions to a thread (a lone long sequence: each block
  // one contiguous run, and the lanes below even out), else one. Items of one kv head, too few
  // for the threads and not a multiple of them (one short sequence of Gemma 3 270M: its one kv
  // head runs on one thread): each kv head's query heads split over `parts` items as well,
  // the fewest parts that make the items a multiple of the threads, if any do. Each item
  // reads its kv head's blocks, so the split pays only where the threads would idle
  // otherwise: SmolLM2's 3 kv heads on 2 threads stay 2 and 1, as one query head to an item
  // (9) took longer (bench/RESULTS.md, "A lone sequence's query heads over the threads"). A
  // query head's arithmetic is the same whichever others share its item.
  const int64_t chosen = a.kv_heads_per_item > 0   ? a.kv_heads_per_item
                         : units >= 2 * threads_max ? a.num_kv_heads
                                                    : 1;
  const int64_t per_item = std::min(chosen, a.num_kv_heads);
  const int64_t chunks = (a.num_kv_heads + per_item - 1) / per_item;
  const int64_t group = a.num_heads / a.num_kv_heads;
  int64_t parts = 1;
  if (a.kv_heads_per_item == 0 && per_item == 1 && units * chunks < 4 * threads_max) {
    for (int64_t d = 2; d <= group && units * chunks % threads_max != 0; ++d) {
      if (group % d == 0 && units * chunks * d % threads_max == 0) {
        parts = d;
        break;
      }
    }
  }
  std::vector<DecodePlan::Item>& items = plan.items;
  items.clear();
  for (int64_t p = 0; p < num_pieces; ++p) {
    for (int64_t k = k_first[p]; k <= k_last[p]; ++k) {
      int64_t keys = 0;
      for (int64_t r = pieces[size_t(p)]; r < pieces[size_t(p + 1)]; ++r) {
        const RowPartitions row(a, r, size);
        if (row.has(k)) keys += row.end(k) - row.begin(k);
      }
      for (int64_t c = 0; c < chunks; ++c) {
        const int64_t kv = std::min(per_item, a.num_kv_heads - c * per_item);
        for (int64_t q = 0; q < parts; ++q)
          items.push_back({p, k, c, q, keys * kv * group / parts, 0});
      }
    }
  }
  const int64_t num_items = int64_t(items.size());
  const int64_t threads = std::min<int64_t>(threads_max, num_items);
  // Lanes: the items, the largest first, each to the lane with the least work so far; a lane
  // runs its items in that order.
  std::vector<int64_t>& order = plan.order;
  order.resize(size_t(num_items));
  for (int64_t i = 0; i < num_items; ++i) order[size_t(i)] = i;
  std::stable_sort(order.begin(), order.end(), [&](int64_t x, int64_t y) {
    return items[size_t(x)].cost > items[size_t(y)].cost;
  });
  plan.load.assign(size_t(threads), 0);
  for (const int64_t i : order) {
    const int64_t to = std::min_element(plan.load.begin(), plan.load.end()) - plan.load.begin();
    plan.load[size_t(to)] += items[size_t(i)].cost;
    items[size_t(i)].lane = to;
  }
  // Partitions of one piece, kv head chunk and query head part still to run: the item that
  // brings it to zero merges their rows.
  const int64_t groups = num_pieces * chunks * parts;
  if (plan.pending_size < groups) {
    plan.pending.reset(new std::atomic<int64_t>[size_t(groups)]);
    plan.pending_size = groups;
  }
  std::atomic<int64_t>* const pending = plan.pending.get();
  for (int64_t p = 0; p < num_pieces; ++p)
    for (int64_t g = 0; g < chunks * parts; ++g)
      pending[p * chunks * parts + g].store(k_last[p] - k_first[p] + 1, std::memory_order_relaxed);
  auto heads_of = [&](const DecodePlan::Item& item, int64_t* out) {  // kv heads [out[0], out[1])
    out[0] = item.chunk * per_item;
    out[1] = std::min(out[0] + per_item, a.num_kv_heads);
  };
  // Lane l's first item at or after position j of `order`, or num_items.
  auto lane_item = [&](int64_t l, int64_t j) {
    while (j < num_items && items[size_t(order[size_t(j)])].lane != l) ++j;
    return j;
  };
  auto lane = [&](int64_t l) {
    thread_local DecodeScratch scratch;
    for (int64_t j = lane_item(l, 0); j < num_items;) {
      const DecodePlan::Item& item = items[size_t(order[size_t(j)])];
      const int64_t seq = pieces[size_t(item.piece)], rows = pieces[size_t(item.piece + 1)] - seq;
      int64_t kv[2], next[4];
      heads_of(item, kv);
      j = lane_item(l, j + 1);
      bool has_next = j < num_items;
      if (has_next) {
        const DecodePlan::Item& after = items[size_t(order[size_t(j)])];
        next[0] = pieces[size_t(after.piece)];
        heads_of(after, next + 1);
        next[3] = first_block(after.piece, after.k);
        has_next = a.seq_lens[next[0]] > 0;
      }
      const int64_t g_count = group / parts, g_begin = item.part * g_count;
      decode_rows<T, NV>(a, size, seq, rows, kv[0], kv[1], g_begin, g_count, item.k,
                         has_next ? next : nullptr, partials, part_base, scratch);
      if (!merged[item.piece]) continue;
      const int64_t id = (item.piece * chunks + item.chunk) * parts + item.part;
      if (pending[id].fetch_sub(1, std::memory_order_acq_rel) == 1) {
        merge_rows<T, NV>(a, size, seq, rows, kv[0] * group + g_begin, (kv[1] - kv[0]) * g_count,
                          partials, part_base);
      }
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
                          int64_t block_size, int64_t block_stride, float scale,
                          int64_t kv_heads_per_item, int64_t query_stride, int64_t window,
                          float softcap, const float* sinks) {
  const DecodeArgs args{query,        key_cache,    value_cache, block_tables,
                        table_stride, seq_lens,     out,         num_seqs,
                        num_heads,    num_kv_heads, block_size,  block_stride,
                        scale,        kv_heads_per_item, query_stride, window,
                        softcap,      sinks};
  return dispatch<DecodeOp>(dtype, head_dim, args);
}

}  // extern "C"
