// Fast mode's prompt attention on the matrix engine (AMX bfloat16 tiles, issue #52): one key
// chunk's online-softmax update (prefill_chunk.h's chunk_update) for all the query vectors of
// a tile, 16 at a time, where the CPU has AMX, the kernel grants its tiles (amx.h) and the head
// dim is a multiple of 32.
//
// The operands are the ones the vector path reads, in the same bfloat16 pair layouts, which
// are the tiles' own: the scores of 16 query vectors against 16 keys are one C tile summed over
// head dims 32 at a time, A the queries' rows (PrefillScratch::query16), B the key chunk's
// [head_dim / 2, keys, 2] pairs (keys16); the weighted sums of values are C tiles of 16 query
// vectors by 16 head dims, summed over keys 32 at a time, A the rounded weights and B the
// chunk's [keys / 2, head_dim, 2] value pairs (values16). The softmax between them is
// chunk_weights, as on the vector path. The tile sums the same bfloat16 products in fp32 but
// not in the same order as `vdpbf16ps` chains, and a chunk's value sums are added to the
// rescaled output at the end instead of on top of it: outputs differ from the vector path's
// in the last bits (tests/kernels/test_prefill_amx.py bounds them against fp32).

#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#include <immintrin.h>

#include "amx.h"
#include "prefill_chunk.h"
#include "vec.h"

namespace llmserve::prefill {

constexpr int kTileRows = 16;  // query vectors of a tile multiply; keys or head dims of B and C

#if LLMSERVE_AMX && LLMSERVE_BF16_DOTS
#define LLMSERVE_PREFILL_TILES 1

constexpr int kTileDepth = 32;  // what one multiply sums over: 32 head dims, or 32 keys
constexpr int kOutTiles = 4;    // C tiles 0 .. 3; A is tile 4, B tile 5

// Whether a head dim runs on tiles.
constexpr bool tiles_take(int head_dim) { return head_dim % kTileDepth == 0; }

// Every tile 16 rows of 64 bytes: 32 bfloat16 (A, B) or 16 fp32 (C).
inline void configure_tiles() {
  alignas(64) amx::TileConfig config{};
  config.palette = 1;
  for (int t = 0; t < kOutTiles + 2; ++t) config.rows[t] = kTileRows, config.bytes_per_row[t] = 64;
  amx::load_config(config);
}

// The intrinsics take tile numbers as literals.
[[gnu::always_inline]] inline void zero_out(int c) {
  switch (c) {
    case 0: _tile_zero(0); break;
    case 1: _tile_zero(1); break;
    case 2: _tile_zero(2); break;
    default: _tile_zero(3); break;
  }
}

[[gnu::always_inline]] inline void multiply_into(int c) {  // C tile c += A (4) x B (5)
  switch (c) {
    case 0: _tile_dpbf16ps(0, 4, 5); break;
    case 1: _tile_dpbf16ps(1, 4, 5); break;
    case 2: _tile_dpbf16ps(2, 4, 5); break;
    default: _tile_dpbf16ps(3, 4, 5); break;
  }
}

[[gnu::always_inline]] inline void store_out(int c, float* to, int64_t stride_bytes) {
  switch (c) {
    case 0: _tile_stored(0, to, stride_bytes); break;
    case 1: _tile_stored(1, to, stride_bytes); break;
    case 2: _tile_stored(2, to, stride_bytes); break;
    default: _tile_stored(3, to, stride_bytes); break;
  }
}

static_assert(kKeyVectors * kLanes == kOutTiles * kTileRows, "a key chunk is four C tiles wide");

// The chunk at k0 (n keys, staged in `in`) for query vectors 0 .. vectors - 1 of the tile
// (in.q16 holds them padded with zeros to a multiple of 16): vector qv is query token
// first_pos + qv / group. acc, run_max and run_sum as chunk_update's.
template <int kHeadDim>
void chunk_update_tiles(const PrefillArgs& a, const Staged& in, vfloat* acc, float* run_max,
                        float* run_sum, int64_t vectors, int64_t group, int64_t first_pos,
                        int64_t k0, int64_t n) {
  constexpr int NV = kHeadDim / kLanes;
  alignas(64) float scores[kTileRows][kKeyChunk];
  alignas(64) bf16 p16[kTileRows][kKeyChunk];
  alignas(64) float sums[kTileRows][kHeadDim];
  alignas(64) float p[kKeyChunk];
  for (int64_t qv0 = 0; qv0 < vectors; qv0 += kTileRows) {
    const int rows = int(std::min<int64_t>(kTileRows, vectors - qv0));
    int live[kTileRows] = {};
    int live_max = 0;
    for (int i = 0; i < rows; ++i) {
      live[i] = live_vectors(a, first_pos + (qv0 + i) / group, k0, n);
      live_max = std::max(live_max, live[i]);
    }
    if (live_max == 0) continue;  // no query of the block sees the chunk

    for (int kb = 0; kb < live_max; ++kb) zero_out(kb);
    for (int d = 0; d < kHeadDim; d += kTileDepth) {  // dims d .. d + 31
      _tile_loadd(4, in.q16 + qv0 * kHeadDim + d, kHeadDim * sizeof(bf16));
      for (int kb = 0; kb < live_max; ++kb) {  // keys 16 kb .. 16 kb + 15
        _tile_loadd(5, in.kt16 + d * kKeyChunk + 2 * kTileRows * kb, 2 * kKeyChunk * sizeof(bf16));
        multiply_into(kb);
      }
    }
    for (int kb = 0; kb < live_max; ++kb)
      store_out(kb, scores[0] + kTileRows * kb, kKeyChunk * sizeof(float));

    float correction[kTileRows];
    int64_t seen_max = 0;
    for (int i = 0; i < kTileRows; ++i) {
      if (i >= rows || live[i] == 0) {  // weights 0, output as it is
        std::memset(p16[i], 0, sizeof p16[i]);
        correction[i] = 1.0f;
        continue;
      }
      vfloat s[kKeyVectors] = {};
      for (int v = 0; v < live[i]; ++v) s[v] = load(scores[i] + v * kLanes);
      const int64_t qv = qv0 + i;
      correction[i] = chunk_weights<true>(a, s, live[i], first_pos + qv / group, k0, run_max[qv],
                                          run_sum[qv], p, p16[i]);
      seen_max = std::max<int64_t>(seen_max, std::min<int64_t>(n, int64_t(live[i]) * kLanes));
    }

    for (int c0 = 0; c0 < kHeadDim; c0 += kOutTiles * kTileRows) {  // output dims c0 ..
      const int tiles = std::min(kOutTiles, (kHeadDim - c0) / kTileRows);
      for (int c = 0; c < tiles; ++c) zero_out(c);
      for (int64_t j = 0; j < seen_max; j += kTileDepth) {  // keys j .. j + 31
        _tile_loadd(4, p16[0] + j, kKeyChunk * sizeof(bf16));
        for (int c = 0; c < tiles; ++c) {
          _tile_loadd(5, in.vt16 + j * kHeadDim + 2 * (c0 + c * kTileRows),
                      2 * kHeadDim * sizeof(bf16));
          multiply_into(c);
        }
      }
      for (int c = 0; c < tiles; ++c)
        store_out(c, sums[0] + c0 + c * kTileRows, kHeadDim * sizeof(float));
    }
    for (int i = 0; i < rows; ++i) {
      if (live[i] == 0) continue;
      vfloat* out = acc + (qv0 + i) * NV;
      for (int c = 0; c < NV; ++c) out[c] = out[c] * correction[i] + load(sums[i] + c * kLanes);
    }
  }
}

#else
#define LLMSERVE_PREFILL_TILES 0
#endif

}  // namespace llmserve::prefill
