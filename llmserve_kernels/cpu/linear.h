// The projections of the native decode step: out = x @ weight^T (+ bias) at decode batch
// sizes, for CPUs.
//
// At these sizes a projection is a matrix-vector product bound by the time it takes to
// stream the weights from memory once: `linear_rows` reads each weight row once per call (a
// tile of output rows stays in L1 while every token's row of activations passes over it) and
// accumulates in float32, 8 lanes at a time with fused multiply-adds. bfloat16 weights are
// widened in registers (a shift), so they cost half the memory traffic of float32 ones.

#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include <immintrin.h>
#include "pool.h"
#include "vec.h"

namespace llmserve::projection {

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
// for the hardware prefetcher to ramp up on: without this a core streams bfloat16 weights
// more slowly than with it (bench/RESULTS.md, "Figures moved out of code comments").
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
// with many tokens (prefill) the widening, not memory, bounds the loop (bench/RESULTS.md,
// "Figures moved out of code comments").
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

}  // namespace llmserve::projection
