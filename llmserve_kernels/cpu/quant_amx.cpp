// Fast mode on the matrix engine (AMX, issue #52): interleaved weights (quant_interleaved.cpp)
// times many activation rows at once in tiles, where the CPU has AMX and the kernel grants this
// process the tiles' register state (arch_prctl). Types: the 32-weight ones, Q4_K and Q5_K
// (their 32-weight sub-blocks are the blocks here); Q6_K, whose halves of 16 have a scale
// each, stays on the vector kernel.
//
// One tile multiply takes 16 activation rows and 16 weight rows (two interleaved groups) over
// 32 weights: A is the rows' 8-bit activation quants as they lie in their ActBlocks (16 rows x
// 32 bytes, a row's blocks apart), B the two groups' quants as block_registers or k_register
// unpack them (register j, weights 4j .. 4j + 3, is B's row j: the VNNI layout), and C the
// 16 x 16 dots, the same integers as `vpdpbusd` makes. Each is then scaled and accumulated by
// the same float operations in the same order as group_dots and k_group_dots do (the dot
// times the row's scale times d, then the row's offset times s), so every output is bit for
// bit the interleaved kernel's, and so the file layout's: the engine changes the speed, never
// a token.
//
// Per pair of groups, every block is unpacked once into this thread's buffer (B, and the
// rows' scales and offsets as floats), then the tiles of 16 activation rows run over it; rows
// past the last full tile are padded with zero quants and not stored.

#include "quant_amx.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include <immintrin.h>

#include "amx.h"
#include "pool.h"
#include "quant.h"
#include "quant_fast.h"
#include "quant_interleaved.h"

namespace llmserve::quant {
namespace {

#if LLMSERVE_AMX
constexpr int kTile = 16;  // activation rows of a tile, and weight rows (two groups)
constexpr int64_t kGroupsPerTile = kTile / kInterleaveRows;

// Two sets of tiles, so that one block's multiply runs while the last one's dots are scaled:
// set k has C in tile k, A in 2 + k and B in 4 + k (the intrinsics take tile numbers as
// literals, hence the branches on k below).
void configure_tiles() {
  alignas(64) amx::TileConfig config{};
  config.palette = 1;
  for (int k = 0; k < 2; ++k) {
    config.rows[k] = kTile, config.bytes_per_row[k] = kTile * 4;  // C: int32 dots
    config.rows[2 + k] = kTile, config.bytes_per_row[2 + k] = kBlock;  // A: a block a row
    config.rows[4 + k] = kBlock / 4, config.bytes_per_row[4 + k] = kTile * 4;  // B
  }
  amx::load_config(config);
}

struct alignas(64) PairBlock {  // 32 weights of a pair of groups' rows, unpacked
  uint8_t b[kBlock / 4][kTile * 4];  // B: row j holds each weight row's quants 4j .. 4j + 3
  float d[kTile];  // what multiplies the dots, before the activations' d: the rows' scales
  float o[kTile];  // what multiplies the activations' s (group_dots' o_w, k_group_dots' offset)
};

// The types the engine takes: the 32-weight ones, and the k-quants whose 32-weight sub-blocks
// have one scale each (Q6_K's halves have two).
constexpr bool engine_type(int type) { return type != kQ6_K; }

// Group h's (0, 1) part of a pair's 32 weights: its quant registers (block_registers,
// k_register) and its rows' d and o, as group_dots and k_group_dots compute them.
inline void put_half(PairBlock& out, int64_t h, const __m256i (&w)[8], __m256 d, __m256 o) {
  for (int j = 0; j < 8; ++j)
    _mm256_store_si256(reinterpret_cast<__m256i*>(out.b[j] + 32 * h), w[j]);
  _mm256_store_ps(out.d + 8 * h, d);
  _mm256_store_ps(out.o + 8 * h, o);
}

inline __m256 fp16s(const uint8_t* at) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(at)));
}

// A pair of groups' `blocks` blocks (of block_weights(Type)) -> out[in / 32].
template <int Type>
void unpack_pair(const uint8_t* pair, int64_t blocks, PairBlock* out) {
  const int64_t bytes = kInterleaveRows * block_bytes(Type), group_bytes = blocks * bytes;
  for (int64_t b = 0; b < blocks; ++b)
    for (int64_t h = 0; h < kGroupsPerTile; ++h) {
      const uint8_t* block = pair + h * group_bytes + b * bytes;
      __m256i w[8];
      const __m256 d_w = fp16s(block);
      if constexpr (is_k_quant(Type)) {
        const __m256 neg_dmin = _mm256_sub_ps(_mm256_setzero_ps(), fp16s(block + 16));
        alignas(32) uint8_t sc[64], mins[64];
        k_scales_mins(block, sc, mins);
        for (int c = 0; c < kSubBlocks; ++c) {
          for (int k = 0; k < 8; ++k) w[k] = k_register<Type>(block + lanes_at(Type), c, k);
          put_half(out[b * kSubBlocks + c], h, w,
                   _mm256_mul_ps(d_w, bytes_as_floats(sc + 8 * c, false)),
                   _mm256_mul_ps(neg_dmin, bytes_as_floats(mins + 8 * c, false)));
        }
      } else {
        block_registers<Type>(block, w);
        __m256 o_w = _mm256_setzero_ps();
        if constexpr (Type == kQ4_1) o_w = fp16s(block + 16);
        if constexpr (zero_point(Type) != 0.0f)
          o_w = _mm256_mul_ps(d_w, _mm256_set1_ps(-zero_point(Type)));
        put_half(out[b], h, w, d_w, o_w);
      }
    }
}

// Tile set K's C = the dots of B (weights) and A (activations) of one block.
template <int Type, int K>
[[gnu::always_inline]] inline void multiply(const uint8_t* b, const int8_t* a, int64_t a_stride) {
  if constexpr (K == 0) {
    _tile_loadd(4, b, kTile * 4);
    _tile_loadd(2, a, a_stride);
    _tile_zero(0);
    if constexpr (Type == kQ8_0)
      _tile_dpbssd(0, 2, 4);  // signed activations, signed weights
    else
      _tile_dpbsud(0, 2, 4);  // signed activations, unsigned quants
  } else {
    _tile_loadd(5, b, kTile * 4);
    _tile_loadd(3, a, a_stride);
    _tile_zero(1);
    if constexpr (Type == kQ8_0)
      _tile_dpbssd(1, 3, 5);
    else
      _tile_dpbsud(1, 3, 5);
  }
}

template <int K>
[[gnu::always_inline]] inline void store_dots(int32_t* dots) {
  if constexpr (K == 0)
    _tile_stored(0, dots, kTile * 4);
  else
    _tile_stored(1, dots, kTile * 4);
}

// out[m * stride + r] for the pair's 16 rows r and activation rows m < rows of the tile at a.
template <int Type>
void tile_dots(const PairBlock* pair, int64_t blocks, const ActBlock* a, int64_t rows, float* out,
               int64_t stride) {
  const int64_t a_stride = blocks * int64_t(sizeof(ActBlock));
  alignas(64) int32_t dots[2][kTile * kTile];  // set k's C, stored
  __m512 acc[kTile];
  for (int m = 0; m < kTile; ++m) acc[m] = _mm512_setzero_ps();
  const auto scale = [&](int64_t b) {  // acc += block b's dots, scaled
    const __m512 d_w = _mm512_load_ps(pair[b].d), o_w = _mm512_load_ps(pair[b].o);
    const int32_t* dot_rows = dots[b % 2];
    for (int m = 0; m < kTile; ++m) {
      const ActBlock& x = a[m * blocks + b];
      const __m512 dot = _mm512_cvtepi32_ps(_mm512_load_si512(dot_rows + kTile * m));
      acc[m] = _mm512_fmadd_ps(dot, _mm512_mul_ps(d_w, _mm512_set1_ps(x.d)), acc[m]);
      if constexpr (Type != kQ8_0) acc[m] = _mm512_fmadd_ps(o_w, _mm512_set1_ps(x.s), acc[m]);
    }
  };
  // Three blocks in flight: b + 1 multiplied (set (b + 1) % 2) while b's dots are stored and
  // b - 1's, stored a step earlier, are scaled; the blocks are scaled in order.
  multiply<Type, 0>(pair[0].b[0], a[0].q, a_stride);
  for (int64_t b = 0; b < blocks; b += 2) {
    if (b + 1 < blocks) multiply<Type, 1>(pair[b + 1].b[0], a[b + 1].q, a_stride);
    store_dots<0>(dots[0]);
    if (b > 0) scale(b - 1);
    if (b + 1 == blocks) {
      scale(b);
      break;
    }
    if (b + 2 < blocks) multiply<Type, 0>(pair[b + 2].b[0], a[b + 2].q, a_stride);
    store_dots<1>(dots[1]);
    scale(b);
    if (b + 2 == blocks) scale(b + 1);
  }
  for (int64_t m = 0; m < rows; ++m) _mm512_storeu_ps(out + m * stride, acc[m]);
}

template <int Type>
void linear_tiles(const ActBlock* a, int64_t n, int64_t in, const uint8_t* w,
                  int64_t out_features, float* out) {
  const int64_t blocks = in / kBlock, tiles = (n + kTile - 1) / kTile,
                pair_bytes = kGroupsPerTile * kInterleaveRows * in / block_weights(Type) *
                             block_bytes(Type);
  if (n % kTile) {  // the last tile's missing rows: zero quants, scales 0
    thread_local std::vector<ActBlock> padded;
    padded.assign(size_t(tiles * kTile * blocks), ActBlock{});
    std::memcpy(padded.data(), a, size_t(n * blocks) * sizeof(ActBlock));
    a = padded.data();
  }
  parallel_for(out_features / kTile, true, [&](int64_t begin, int64_t end) {
    configure_tiles();
    thread_local std::vector<PairBlock> unpacked;
    unpacked.resize(size_t(blocks));
    for (int64_t p = begin; p < end; ++p) {
      unpack_pair<Type>(w + p * pair_bytes, in / block_weights(Type), unpacked.data());
      for (int64_t t = 0; t < tiles; ++t)
        tile_dots<Type>(unpacked.data(), blocks, a + t * kTile * blocks,
                        std::min<int64_t>(kTile, n - t * kTile),
                        out + t * kTile * out_features + p * kTile, out_features);
    }
    _tile_release();
  });
}
#endif

}  // namespace

bool matrix_engine_linear(int type, const ActBlock* a, int64_t n, int64_t in, const uint8_t* w,
                          int64_t out_features, float* out) {
#if LLMSERVE_AMX
  if (n < kMatrixEngineRows || out_features % kTile || !engine_type(type) || !amx::enabled())
    return false;
  amx::count(amx::Path::kLinear);
  return dispatch(type, [&]<int Type>() {
           if constexpr (engine_type(Type)) linear_tiles<Type>(a, n, in, w, out_features, out);
         }) == 0;
#else
  (void)type, (void)a, (void)n, (void)in, (void)w, (void)out_features, (void)out;
  return false;
#endif
}

}  // namespace llmserve::quant

extern "C" {

// The fewest activation rows a call needs to go to the matrix engine.
int64_t llmserve_quant_matrix_engine_rows() { return llmserve::quant::kMatrixEngineRows; }

}  // extern "C"
