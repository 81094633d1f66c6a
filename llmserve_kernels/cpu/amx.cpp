// The matrix engine's grant, switch and call counts (amx.h).

#include "amx.h"

#include <atomic>
#include <cstdlib>
#include <cstring>

#include <sys/syscall.h>
#include <unistd.h>

namespace llmserve::amx {
namespace {

std::atomic<bool> switched_on{true};
std::atomic<int64_t> calls[int(Path::kCount)];

}  // namespace

bool granted() {
#if defined(LLMSERVE_AMX_EMULATE) && LLMSERVE_AMX
  return true;
#elif LLMSERVE_AMX
  static const bool ok = [] {
    constexpr int kRequestPermission = 0x1023;  // ARCH_REQ_XCOMP_PERM
    constexpr int kTileData = 18;               // XFEATURE_XTILEDATA
    return syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
  }();
  return ok;
#else
  return false;
#endif
}

bool enabled() { return switched_on.load(std::memory_order_relaxed) && granted(); }

void count(Path path) { calls[int(path)].fetch_add(1, std::memory_order_relaxed); }

#if defined(LLMSERVE_AMX_EMULATE)
namespace emulated {
namespace {

struct Tiles {
  TileConfig config{};
  bool configured = false;
  alignas(64) uint8_t data[8][16 * 64];
};
thread_local Tiles tiles;

uint8_t* row(int t, int r) { return tiles.data[t] + 64 * r; }

// A tile's shape as the configuration gives it; a tile used unconfigured is a kernel's bug,
// which the instructions would fault on.
void check(int t) {
  if (!tiles.configured || t < 0 || t >= 8 || tiles.config.rows[t] == 0) std::abort();
}

float bf16_to_float(uint16_t x) {
  const uint32_t bits = uint32_t(x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

}  // namespace

void load_config(const TileConfig& config) {
  tiles.config = config;
  tiles.configured = config.palette == 1;
  std::memset(tiles.data, 0, sizeof tiles.data);
}

void load(int t, const void* base, int64_t stride) {
  check(t);
  for (int r = 0; r < tiles.config.rows[t]; ++r)
    std::memcpy(row(t, r), static_cast<const uint8_t*>(base) + r * stride,
                tiles.config.bytes_per_row[t]);
}

void store(int t, void* base, int64_t stride) {
  check(t);
  for (int r = 0; r < tiles.config.rows[t]; ++r)
    std::memcpy(static_cast<uint8_t*>(base) + r * stride, row(t, r),
                tiles.config.bytes_per_row[t]);
}

void zero(int t) {
  check(t);
  std::memset(tiles.data[t], 0, sizeof tiles.data[t]);
}

void release() { tiles.configured = false; }

// TDPBSSD, TDPBSUD, TDPBF16PS as their definitions give them: C[m][n] += the dots of A's row m
// with B's column n, four bytes (two bfloat16) at a time, in order.
void multiply(Dot dot, int c, int a, int b) {
  check(c), check(a), check(b);
  const int rows = tiles.config.rows[c], columns = tiles.config.bytes_per_row[c] / 4,
            depth = tiles.config.bytes_per_row[a] / 4;
  if (tiles.config.rows[a] != rows || tiles.config.rows[b] != depth ||
      tiles.config.bytes_per_row[b] != tiles.config.bytes_per_row[c])
    std::abort();  // shapes the instruction refuses
  for (int m = 0; m < rows; ++m)
    for (int n = 0; n < columns; ++n) {
      uint8_t* out = row(c, m) + 4 * n;
      if (dot == Dot::kBf16) {
        float acc;
        std::memcpy(&acc, out, sizeof acc);
        for (int k = 0; k < depth; ++k)
          for (int i = 0; i < 2; ++i) {
            uint16_t x, y;
            std::memcpy(&x, row(a, m) + 4 * k + 2 * i, 2);
            std::memcpy(&y, row(b, k) + 4 * n + 2 * i, 2);
            acc += bf16_to_float(x) * bf16_to_float(y);
          }
        std::memcpy(out, &acc, sizeof acc);
      } else {
        int32_t acc;
        std::memcpy(&acc, out, sizeof acc);
        for (int k = 0; k < depth; ++k)
          for (int i = 0; i < 4; ++i) {
            const int32_t x = int8_t(row(a, m)[4 * k + i]);
            const int32_t y = dot == Dot::kSignedSigned ? int32_t(int8_t(row(b, k)[4 * n + i]))
                                                        : int32_t(row(b, k)[4 * n + i]);
            acc += x * y;
          }
        std::memcpy(out, &acc, sizeof acc);
      }
    }
}

}  // namespace emulated
#endif

}  // namespace llmserve::amx

extern "C" {

// Turns the matrix-engine paths on (1) or off (0), or leaves them (-1); returns 1 when they are
// on: turned on, and the CPU and this build have the tiles and the kernel granted them.
int llmserve_set_matrix_engine(int on) {
  if (on >= 0) llmserve::amx::switched_on.store(on != 0, std::memory_order_relaxed);
  return llmserve::amx::enabled() ? 1 : 0;
}

// How many calls a matrix-engine path (amx::Path) has taken in this process; -1 for no such path.
int64_t llmserve_matrix_engine_calls(int path) {
  using llmserve::amx::Path;
  if (path < 0 || path >= int(Path::kCount)) return -1;
  return llmserve::amx::calls[path].load(std::memory_order_relaxed);
}

}  // extern "C"
