// The matrix engine (AMX) as the kernels share it: whether this build has it, whether the
// kernel grants this process its tiles' register state, the switch that turns it off, and the
// tile configuration. Its users: fast mode's linear layers (quant_amx.cpp, 8-bit tiles) and
// fast mode's prompt attention (prefill_amx.h, bfloat16 tiles).
//
// A test build (LLMSERVE_KERNEL_FLAGS=-DLLMSERVE_AMX_EMULATE, tests/kernels/test_amx_emulated.py)
// runs the tile paths on CPUs without AMX: the tile intrinsics the kernels use become calls to
// a plain C++ model of the tiles (amx.cpp) that follows the instructions' definitions, so the
// paths' indexing, padding and scaling are tested wherever AVX-512 runs. It is slow, and its
// bfloat16 sums round in the order the definition gives, which the hardware need not follow.

#pragma once

#include <cstdint>

#include <immintrin.h>

#if defined(__AVX512F__) && defined(__AVX512VL__) && defined(__AVX512BF16__) && \
    defined(__F16C__) &&                                                          \
    (defined(LLMSERVE_AMX_EMULATE) ||                                             \
     (defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AMX_BF16__)))
#define LLMSERVE_AMX 1
#else
#define LLMSERVE_AMX 0
#endif

namespace llmserve::amx {

// Whether this build has the tiles and the kernel grants them to this process (asked once;
// the grant covers every thread).
bool granted();

// Whether the kernels use the tiles: granted, and the switch (llmserve_set_matrix_engine) on.
bool enabled();

// What a path counts when it takes a call (llmserve_matrix_engine_calls).
enum class Path : int { kLinear = 0, kPrefill = 1, kCount = 2 };
void count(Path path);

struct TileConfig {  // palette 1's layout, as LDTILECFG reads it
  uint8_t palette;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t bytes_per_row[16];
  uint8_t rows[16];
};

#if defined(LLMSERVE_AMX_EMULATE)
namespace emulated {  // the model of the tiles (amx.cpp), one set per thread
enum class Dot { kSignedSigned, kSignedUnsigned, kBf16 };
void load_config(const TileConfig& config);
void load(int tile, const void* base, int64_t stride);
void store(int tile, void* base, int64_t stride);
void zero(int tile);
void release();
void multiply(Dot dot, int c, int a, int b);  // C tile c += A tile a times B tile b
}  // namespace emulated

inline void load_config(const TileConfig& config) { emulated::load_config(config); }
#elif LLMSERVE_AMX
// Loads `config` into this thread's tiles. Not _tile_loadconfig: GCC 12's says it reads 8
// bytes of the config, so the stores to the rest may be dropped and LDTILECFG then faults on
// what it finds (seen here, at -O3).
inline void load_config(const TileConfig& config) {
  __asm__ volatile("ldtilecfg %0" : : "m"(config));
}
#endif

}  // namespace llmserve::amx

#if defined(LLMSERVE_AMX_EMULATE)
#undef _tile_loadd
#undef _tile_stored
#undef _tile_zero
#undef _tile_dpbssd
#undef _tile_dpbsud
#undef _tile_dpbf16ps
#define LLMSERVE_TILE_DOT(kind, c, a, b) \
  ::llmserve::amx::emulated::multiply(::llmserve::amx::emulated::Dot::kind, c, a, b)
#define _tile_loadd(t, base, stride) ::llmserve::amx::emulated::load(t, base, stride)
#define _tile_stored(t, base, stride) ::llmserve::amx::emulated::store(t, base, stride)
#define _tile_zero(t) ::llmserve::amx::emulated::zero(t)
#define _tile_release() ::llmserve::amx::emulated::release()
#define _tile_dpbssd(c, a, b) LLMSERVE_TILE_DOT(kSignedSigned, c, a, b)
#define _tile_dpbsud(c, a, b) LLMSERVE_TILE_DOT(kSignedUnsigned, c, a, b)
#define _tile_dpbf16ps(c, a, b) LLMSERVE_TILE_DOT(kBf16, c, a, b)
#endif
