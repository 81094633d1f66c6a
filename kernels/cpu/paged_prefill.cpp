// Paged prefill attention for CPUs: a chunk of query tokens per sequence at positions
// context_len .. seq_len - 1, causal over its cached context (chunked prefill, prefix-cache
// hits), read straight from the KV blocks. Layout (blocks `block_stride` apart), arithmetic,
// windows, soft-caps and sinks as in paged_attention.cpp (decode), whose key scoring it
// shares (attention.h).
//
// Entry point (extern "C", called through ctypes): llmserve_paged_prefill.

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
  int64_t block_stride;  // elements from one block to the next, in both caches
  float scale;
  int64_t query_stride;  // elements between query rows (heads are contiguous in a row)
  int64_t window;        // sliding window, 0 = none
  float softcap;         // 0 = none
  const float* sinks;    // [num_heads] sink logits, nullptr = none
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

// Query vectors scored together against a key chunk: each key (or value) vector loaded is
// used by all of them, and their score and output accumulators (kQueryBlock x kKeyVectors,
// kQueryBlock x output_slice) make independent multiply-add chains. Sixteen accumulators fill
// half of AVX-512's registers; AVX2's sixteen take one query at a time.
constexpr int kQueryBlock = kLanes >= 16 ? 4 : 1;
constexpr int kAccumulators = 16;

// The largest divisor of nv (output vectors) that keeps qb x it accumulators within
// kAccumulators.
constexpr int output_slice(int nv, int qb) {
  int cb = std::min(nv, std::max(1, kAccumulators / qb));
  while (nv % cb != 0) --cb;
  return cb;
}

// One key chunk's online-softmax update for QB query vectors qv0 .. qv0 + QB - 1 of a tile,
// each of which sees live[i] > 0 of the chunk's key vectors. A query's arithmetic (its
// multiply-add order over head dims and keys) is the same whatever QB, so blocking changes no
// bit of the output.
template <int QB, int kHeadDim>
inline void chunk_update(const PrefillArgs& a, const float* q, vfloat* acc, float* run_max,
                         float* run_sum, const float* kt, const float* vt, int64_t qv0,
                         int64_t group, int64_t first_pos, int64_t k0, int64_t n,
                         const int* live, int live_max) {
  constexpr int NV = kHeadDim / kLanes;
  const float neg_inf = -std::numeric_limits<float>::infinity();
  vfloat s[QB][kKeyVectors] = {};
  if (live_max == kKeyVectors) {
    for (int d = 0; d < kHeadDim; ++d) {
      vfloat k[kKeyVectors];
      for (int v = 0; v < kKeyVectors; ++v) k[v] = load(kt + d * kKeyChunk + v * kLanes);
      for (int i = 0; i < QB; ++i) {
        const vfloat qd = splat(q[(qv0 + i) * kHeadDim + d]);
        for (int v = 0; v < kKeyVectors; ++v) s[i][v] += qd * k[v];
      }
    }
  } else {
    for (int d = 0; d < kHeadDim; ++d) {
      for (int i = 0; i < QB; ++i) {
        const vfloat qd = splat(q[(qv0 + i) * kHeadDim + d]);
        for (int v = 0; v < kKeyVectors; ++v) {
          if (v < live_max) s[i][v] += qd * load(kt + d * kKeyChunk + v * kLanes);
        }
      }
    }
  }

  alignas(64) float p[QB][kKeyChunk];
  float correction[QB];
  int64_t seen_min = n;
  int64_t seen[QB];
  const vint lane = lane_indices();
  for (int i = 0; i < QB; ++i) {
    const int64_t qv = qv0 + i;
    const int64_t q_pos = first_pos + qv / group;
    if (a.softcap > 0.0f) {
      for (int v = 0; v < live[i]; ++v) {
        alignas(64) float lanes[kLanes];
        store(lanes, s[i][v]);
        for (int l = 0; l < kLanes; ++l) lanes[l] = std::tanh(lanes[l] / a.softcap) * a.softcap;
        s[i][v] = load(lanes);
      }
    }
    const int32_t oldest = a.window > 0 ? int32_t(q_pos - a.window) : -1;
    vfloat chunk_max = splat(neg_inf);
    for (int v = 0; v < kKeyVectors; ++v) {
      const vint key = lane + int32_t(k0 + v * kLanes);
      const vint visible = (key <= int32_t(q_pos)) & (key > oldest);
      s[i][v] = v < live[i] ? (visible ? s[i][v] : splat(neg_inf)) : splat(neg_inf);
      chunk_max = s[i][v] > chunk_max ? s[i][v] : chunk_max;
    }
    const float new_max = std::max(run_max[qv], hmax(chunk_max));
    correction[i] = exp_nonpositive(run_max[qv] - new_max);
    vfloat total = vfloat{};
    for (int v = 0; v < kKeyVectors; ++v) {
      const vfloat e = exp_nonpositive(s[i][v] - new_max);
      store(p[i] + v * kLanes, e);
      total += e;
    }
    run_sum[qv] = run_sum[qv] * correction[i] + hsum(total);
    run_max[qv] = new_max;
    seen[i] = std::min<int64_t>(n, int64_t(live[i]) * kLanes);
    seen_min = std::min(seen_min, seen[i]);
  }

  // Outputs in slices of CB vectors: the keys all queries see together, then each query's
  // own last keys (the causal diagonal), in key order either way.
  constexpr int CB = output_slice(NV, QB);
  for (int c0 = 0; c0 < NV; c0 += CB) {
    vfloat o[QB][CB];
    for (int i = 0; i < QB; ++i) {
      for (int c = 0; c < CB; ++c) o[i][c] = acc[(qv0 + i) * NV + c0 + c] * correction[i];
    }
    for (int64_t j = 0; j < seen_min; ++j) {
      vfloat v[CB];
      for (int c = 0; c < CB; ++c) v[c] = load(vt + j * kHeadDim + (c0 + c) * kLanes);
      for (int i = 0; i < QB; ++i) {
        const vfloat pj = splat(p[i][j]);
        for (int c = 0; c < CB; ++c) o[i][c] += pj * v[c];
      }
    }
    for (int i = 0; i < QB; ++i) {
      for (int64_t j = seen_min; j < seen[i]; ++j) {
        const vfloat pj = splat(p[i][j]);
        for (int c = 0; c < CB; ++c) o[i][c] += pj * load(vt + j * kHeadDim + (c0 + c) * kLanes);
      }
      for (int c = 0; c < CB; ++c) acc[(qv0 + i) * NV + c0 + c] = o[i][c];
    }
  }
}

// Flash-style: for a tile of query tokens and one kv head, walk chunks of kKeyChunk keys with
// an online softmax. Each chunk is loaded once (transposed for the scores, row-major for the
// values) and used by every query vector of the tile, kQueryBlock of them at a time
// (chunk_update), so the inner loops are broadcast multiply-adds with no horizontal sums and
// one max / rescale per query and chunk.
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
  const int64_t block_stride = a.block_stride;
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
  // A head's sink starts its running maximum, and its numerator (exp 0) the running sum.
  const float* sinks = a.sinks == nullptr ? nullptr : a.sinks + kv_head * group;
  for (int64_t qv = 0; qv < vectors; ++qv) {
    for (int c = 0; c < NV; ++c) acc[qv * NV + c] = vfloat{};
    run_max[qv] = sinks != nullptr ? sinks[qv % group] : -std::numeric_limits<float>::infinity();
    run_sum[qv] = sinks != nullptr ? 1.0f : 0.0f;
  }

  // Keys visible to the tile's last query token: positions 0 .. context + first + rows - 1;
  // with a window, from the first query's oldest key in the window on.
  const int64_t key_end = context + first + rows;
  const int64_t key_begin =
      a.window > 0 ? std::max<int64_t>(0, context + first - a.window + 1) : 0;
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
    for (int64_t qb = 0; qb < vectors; qb += kQueryBlock) {
      const int nq = int(std::min<int64_t>(kQueryBlock, vectors - qb));
      // Key vectors of the chunk each query sees at all (0: the chunk is wholly in its
      // future, or wholly older than its window).
      int live[kQueryBlock] = {};
      int live_max = 0;
      for (int i = 0; i < nq; ++i) {
        const int64_t q_pos = context + first + (qb + i) / group;
        if (k0 > q_pos) continue;
        if (a.window > 0 && k0 + n - 1 <= q_pos - a.window) continue;
        live[i] = int(std::min<int64_t>(kKeyVectors, (q_pos - k0) / kLanes + 1));
        live_max = std::max(live_max, live[i]);
      }
      if (live_max == 0) continue;  // no query of the block sees the chunk
      bool whole = nq == kQueryBlock;
      for (int i = 0; i < nq; ++i) whole = whole && live[i] > 0;
      if (whole) {
        chunk_update<kQueryBlock, kHeadDim>(a, q, acc, run_max, run_sum, kt, vt, qb, group,
                                            context + first, k0, n, live, live_max);
      } else {
        for (int i = 0; i < nq; ++i) {
          if (live[i] == 0) continue;
          chunk_update<1, kHeadDim>(a, q, acc, run_max, run_sum, kt, vt, qb + i, group,
                                    context + first, k0, n, live + i, live[i]);
        }
      }
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

template <typename T, int NV>
struct PrefillOp {
  static void run(const PrefillArgs& a) { prefill<T, NV>(a); }
};

}  // namespace

extern "C" {

int llmserve_paged_prefill(int dtype, int64_t head_dim, const void* query, const void* key_cache,
                           const void* value_cache, const int32_t* block_tables,
                           int64_t table_stride, const int32_t* query_start_loc,
                           const int32_t* seq_lens, void* out, int64_t num_seqs,
                           int64_t num_heads, int64_t num_kv_heads, int64_t block_size,
                           int64_t block_stride, float scale, int64_t query_stride,
                           int64_t window, float softcap, const float* sinks) {
  const PrefillArgs args{query,        key_cache,       value_cache,  block_tables,
                         table_stride, query_start_loc, seq_lens,     out,
                         num_seqs,     num_heads,       num_kv_heads, block_size,
                         block_stride, scale,           query_stride, window,
                         softcap,      sinks};
  return dispatch<PrefillOp>(dtype, head_dim, args);
}

}  // extern "C"
