// Paged prefill attention for CPUs: a chunk of query tokens per sequence at positions
// context_len .. seq_len - 1, causal over its cached context (chunked prefill, prefix-cache
// hits), read straight from the KV blocks. Layout (blocks `block_stride` apart), arithmetic,
// windows, soft-caps and sinks as in paged_attention.cpp (decode), whose key scoring it
// shares (attention.h). This file tiles the queries and stages each key chunk; the chunk's
// online-softmax update, in fp32 or (bf16_dots, fast mode) in bfloat16 pair dots, is
// prefill_chunk.h's, or with bf16_dots on the matrix engine where it is on, prefill_amx.h's.
//
// Entry point (extern "C", called through ctypes): llmserve_paged_prefill.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "amx.h"
#include "attention.h"
#include "pool.h"
#include "prefill_amx.h"
#include "prefill_chunk.h"
#include "vec.h"

namespace {

using namespace llmserve;
using namespace llmserve::attention;
using namespace llmserve::prefill;

// ---- prefill -------------------------------------------------------------------------------

constexpr int kQueryTile = 32;  // query tokens per work item (times the group's heads)

// Per-thread scratch for prefill tiles; grows to the largest tile once.
struct PrefillScratch {
  std::vector<float> query;  // [vectors, head_dim], pre-scaled
  std::vector<vfloat> acc;   // [vectors, NV]
  std::vector<float> run_max;
  std::vector<float> run_sum;
  std::vector<float> keys;    // [head_dim, kKeyChunk]: the key chunk, transposed
  std::vector<float> values;  // [kKeyChunk, head_dim]
  // bf16_dots: the same, in pairs of bfloat16 along the dot products' sums
  std::vector<bf16> query16;   // [vectors, head_dim], pre-scaled
  std::vector<bf16> keys16;    // [head_dim / 2, kKeyChunk, 2]: dims 2p, 2p + 1 of key j at p, j
  std::vector<bf16> values16;  // [kKeyChunk / 2, head_dim, 2]: keys 2i, 2i + 1 of dim d at i, d
};

// bf16_dots: keys k0 .. k0 + n - 1 (row(j): key k0 + j's offset in either cache) rounded to
// bfloat16 into the pair layouts of PrefillScratch::keys16 and ::values16; the chunk's other
// keys are zero.
template <typename T, int kHeadDim, typename Row>
void stage_pairs(const T* keys, const T* values, const Row& row, int64_t n, bf16* kt16,
                 bf16* vt16) {
  constexpr int NV = kHeadDim / kLanes;
  if (n < kKeyChunk) {
    std::memset(kt16, 0, sizeof(bf16) * kHeadDim * kKeyChunk);
    std::memset(vt16, 0, sizeof(bf16) * kHeadDim * kKeyChunk);
  }
  alignas(64) bf16 k16[kHeadDim];
  for (int64_t j = 0; j < n; ++j) {
    for (int c = 0; c < NV; ++c) store(k16 + c * kLanes, load(keys + row(j) + c * kLanes));
    for (int d = 0; d < kHeadDim / 2; ++d)  // dims 2d, 2d + 1 side by side
      std::memcpy(kt16 + 2 * (d * kKeyChunk + j), k16 + 2 * d, 2 * sizeof(bf16));
  }
#if LLMSERVE_BF16_DOTS
  // Keys 2i and 2i + 1 side by side, 16 dims at a time: one permute of the two rounded rows.
  alignas(64) static constexpr int16_t kPairs[32] = {0, 32, 1, 33, 2,  34, 3,  35, 4,  36, 5,
                                                     37, 6, 38, 7, 39, 8,  40, 9,  41, 10, 42,
                                                     11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  const __m512i pairs = _mm512_load_si512(kPairs);
  for (int64_t j = 0; j < n; j += 2) {
    for (int c = 0; c < NV; ++c) {
      __m256i even, odd = _mm256_setzero_si256();
      const vhalf a = to_bf16(load(values + row(j) + c * kLanes));
      std::memcpy(&even, &a, sizeof even);
      if (j + 1 < n) {
        const vhalf b = to_bf16(load(values + row(j + 1) + c * kLanes));
        std::memcpy(&odd, &b, sizeof odd);
      }
      const __m512i mixed = _mm512_permutex2var_epi16(_mm512_castsi256_si512(even), pairs,
                                                      _mm512_castsi256_si512(odd));
      std::memcpy(vt16 + j * kHeadDim + 2 * c * kLanes, &mixed, sizeof mixed);
    }
  }
#endif
}

// Flash-style: for a tile of query tokens and one kv head, walk chunks of kKeyChunk keys with
// an online softmax. Each chunk is loaded once (transposed for the scores, row-major for the
// values) and used by every query vector of the tile, kQueryBlock of them at a time
// (chunk_update), so the inner loops are broadcast multiply-adds with no horizontal sums and
// one max / rescale per query and chunk. Tiles (with Dots): each chunk's update on the matrix
// engine instead, 16 query vectors at a time (prefill_amx.h).
template <typename T, int NV, bool Dots, bool Tiles>
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
  if constexpr (Dots) {
    // Tiles: A tiles of 16 query vectors, the last one's missing rows zero.
    const int64_t padded = Tiles ? (vectors + kTileRows - 1) / kTileRows * kTileRows : vectors;
    scratch.query16.assign(size_t(padded * kHeadDim), bf16(0));
    scratch.keys16.resize(size_t(kHeadDim * kKeyChunk));
    scratch.values16.resize(size_t(kKeyChunk * kHeadDim));
    for (int64_t i = 0; i < vectors * kHeadDim; i += kLanes)
      store(scratch.query16.data() + i, load(q + i));
  }
  const Staged in{q, kt, vt, scratch.query16.data(), scratch.keys16.data(),
                  scratch.values16.data()};
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
    const auto row = [&](int64_t j) {  // offset of key k0 + j's row in either cache
      const int64_t pos = k0 + j;
      return int64_t(table[pos / a.block_size]) * block_stride + (pos % a.block_size) * token_stride;
    };
    if constexpr (Dots) {
      stage_pairs<T, kHeadDim>(keys, values, row, n, scratch.keys16.data(),
                               scratch.values16.data());
#if LLMSERVE_PREFILL_TILES
      if constexpr (Tiles) {
        chunk_update_tiles<kHeadDim>(a, in, acc, run_max, run_sum, vectors, group,
                                     context + first, k0, n);
        continue;
      }
#endif
    } else {
      for (int64_t j = 0; j < n; ++j) {
        const T* krow = keys + row(j);
        const T* vrow = values + row(j);
        for (int c = 0; c < NV; ++c) store(vt + j * kHeadDim + c * kLanes, load(vrow + c * kLanes));
        for (int d = 0; d < kHeadDim; ++d) kt[d * kKeyChunk + j] = to_float(krow[d]);
      }
      for (int64_t j = n; j < kKeyChunk; ++j) {
        for (int d = 0; d < kHeadDim; ++d) kt[d * kKeyChunk + j] = 0.0f;
        for (int d = 0; d < kHeadDim; ++d) vt[j * kHeadDim + d] = 0.0f;
      }
    }
    for (int64_t qb = 0; qb < vectors; qb += kQueryBlock) {
      const int nq = int(std::min<int64_t>(kQueryBlock, vectors - qb));
      int live[kQueryBlock] = {};
      int live_max = 0;
      for (int i = 0; i < nq; ++i) {
        live[i] = live_vectors(a, context + first + (qb + i) / group, k0, n);
        live_max = std::max(live_max, live[i]);
      }
      if (live_max == 0) continue;  // no query of the block sees the chunk
      bool whole = nq == kQueryBlock;
      for (int i = 0; i < nq; ++i) whole = whole && live[i] > 0;
      if (whole) {
        chunk_update<kQueryBlock, kHeadDim, Dots>(a, in, acc, run_max, run_sum, qb, group,
                                                  context + first, k0, n, live, live_max);
      } else {
        for (int i = 0; i < nq; ++i) {
          if (live[i] == 0) continue;
          chunk_update<1, kHeadDim, Dots>(a, in, acc, run_max, run_sum, qb + i, group,
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
  // Fast mode's bfloat16 dots on the matrix engine where it is on and takes the head dim.
  bool tiles = false;
#if LLMSERVE_PREFILL_TILES
  tiles = tiles_take(NV * kLanes) && a.bf16_dots && amx::enabled();
  if (tiles) amx::count(amx::Path::kPrefill);
#endif
  // Claimed in order, so the largest items go first.
  auto item_at = [&](int64_t claim) {
    thread_local PrefillScratch scratch;
    const int64_t item = items - 1 - claim;
    const int64_t flat_tile = item / a.num_kv_heads;
    const int64_t kv_head = item % a.num_kv_heads;
    const int64_t seq = int64_t(std::upper_bound(tile_start.begin(), tile_start.end(),
                                                 flat_tile) -
                                tile_start.begin() - 1);
    const int64_t t = flat_tile - tile_start[size_t(seq)];
#if LLMSERVE_PREFILL_TILES
    if constexpr (tiles_take(NV * kLanes)) {
      if (tiles) {
        configure_tiles();
        prefill_tile<T, NV, true, true>(a, seq, kv_head, t, scratch);
        _tile_release();
        return;
      }
    }
#endif
    if (kBf16Dots && a.bf16_dots)
      prefill_tile<T, NV, kBf16Dots, false>(a, seq, kv_head, t, scratch);
    else
      prefill_tile<T, NV, false, false>(a, seq, kv_head, t, scratch);
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
                           int64_t window, float softcap, const float* sinks, int bf16_dots) {
  const PrefillArgs args{query,        key_cache,       value_cache,  block_tables,
                         table_stride, query_start_loc, seq_lens,     out,
                         num_seqs,     num_heads,       num_kv_heads, block_size,
                         block_stride, scale,           query_stride, window,
                         softcap,      sinks,           bf16_dots != 0};
  return dispatch<PrefillOp>(dtype, head_dim, args);
}

}  // extern "C"
