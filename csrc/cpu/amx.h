// bf16 matrix products on AMX tiles (`tdpbf16ps`), in the operand layout of bf16_dot.h, and the
// run-time check that the CPU has AMX and the OS lets this process use it. Free of torch headers.
//
// A tile register holds up to 16 rows of 64 bytes; one `tdpbf16ps` adds to a 16 x 16 float32 tile
// of C the product of a 16 x 32 bf16 tile of A and a 16-pair-row x 16-column tile of B (the pairs
// layout of bf16_dot.h, which is AMX's own). The product below keeps a 2 x 2 block of C tiles in
// the tile registers over the whole of K, loading two A tiles and two B tiles per step of 32.
//
// Linux enables AMX's 8 KiB of tile data per process only on request (arch_prctl
// ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA); without it the first tile instruction faults.
// amx_usable() makes that request once, and reports false when the CPU lacks the instructions,
// the OS does not enable their state, or the request is refused, so the caller falls back.
#pragma once

#include <cstdint>

#include "cpu/bf16_dot.h"

#if defined(PA_HAVE_BF16_DOT) && defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#define PA_HAVE_AMX 1
#endif

namespace paged_attention::cpu {

#ifdef PA_HAVE_AMX

namespace amx_detail {

constexpr int kArchGetXcompPerm = 0x1022;
constexpr int kArchReqXcompPerm = 0x1023;
constexpr int kXfeatureXtiledata = 18;
constexpr uint64_t kXtileBits = (1ull << 17) | (1ull << 18);  // XTILECFG, XTILEDATA in XCR0

inline uint64_t read_xcr0() {
  uint32_t eax = 0, edx = 0;
  __asm__ volatile("xgetbv" : "=a"(eax), "=d"(edx) : "c"(0));
  return (static_cast<uint64_t>(edx) << 32) | eax;
}

inline bool cpu_and_os_allow_amx() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (!__get_cpuid(1, &eax, &ebx, &ecx, &edx) || !((ecx >> 27) & 1u)) return false;  // OSXSAVE
  if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
  const bool amx_bf16 = (edx >> 22) & 1u;
  const bool amx_tile = (edx >> 24) & 1u;
  if (!amx_bf16 || !amx_tile || (read_xcr0() & kXtileBits) != kXtileBits) return false;
  if (syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) != 0) return false;
  uint64_t permitted = 0;
  return syscall(SYS_arch_prctl, kArchGetXcompPerm, &permitted) == 0 &&
         ((permitted >> kXfeatureXtiledata) & 1u);
}

// The tile configuration (palette 1): tiles 0-3 hold C, 4-5 A, 6-7 B, each 16 rows of 64 bytes.
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t bytes_per_row[16] = {64, 64, 64, 64, 64, 64, 64, 64};
  uint8_t rows[16] = {16, 16, 16, 16, 16, 16, 16, 16};
};

}  // namespace amx_detail

// True when this process may run the AMX products (checked, and permission asked, once).
inline bool amx_usable() {
  static const bool usable = amx_detail::cpu_and_os_allow_amx();
  return usable;
}

#define PA_AMX_TARGET __attribute__((target("amx-tile,amx-bf16")))

// The tile instructions are inline assembly that tells the compiler nothing about the memory
// they read or write: a barrier before each load of C and after each store of C keeps ordinary
// loads and stores of the same buffers on their side.
#define PA_MEMORY_BARRIER() __asm__ volatile("" ::: "memory")

// One block of kRowTiles x kColumnTiles C tiles (kRowTiles, kColumnTiles in {1, 2}).
template <int kRowTiles, int kColumnTiles>
PA_AMX_TARGET inline void amx_block(int64_t k, const uint16_t* a, int64_t lda,
                                    const uint16_t* b_pairs, int64_t ldb, float* c, int64_t ldc,
                                    bool accumulate) {
  const int64_t c_stride = ldc * static_cast<int64_t>(sizeof(float));
  const int64_t a_stride = lda * static_cast<int64_t>(sizeof(uint16_t));
  const int64_t b_stride = ldb * static_cast<int64_t>(sizeof(uint16_t));
  float* c_low = c + 16 * ldc;
  PA_MEMORY_BARRIER();
  if (accumulate) {
    _tile_loadd(0, c, c_stride);
    if constexpr (kColumnTiles > 1) _tile_loadd(1, c + 16, c_stride);
    if constexpr (kRowTiles > 1) _tile_loadd(2, c_low, c_stride);
    if constexpr (kRowTiles > 1 && kColumnTiles > 1) _tile_loadd(3, c_low + 16, c_stride);
  } else {
    _tile_zero(0);
    if constexpr (kColumnTiles > 1) _tile_zero(1);
    if constexpr (kRowTiles > 1) _tile_zero(2);
    if constexpr (kRowTiles > 1 && kColumnTiles > 1) _tile_zero(3);
  }
  for (int64_t k0 = 0; k0 < k; k0 += 32) {
    _tile_loadd(4, a + k0, a_stride);
    if constexpr (kRowTiles > 1) _tile_loadd(5, a + 16 * lda + k0, a_stride);
    const uint16_t* b = b_pairs + (k0 / 2) * ldb;
    _tile_loadd(6, b, b_stride);
    if constexpr (kColumnTiles > 1) _tile_loadd(7, b + 32, b_stride);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (kColumnTiles > 1) _tile_dpbf16ps(1, 4, 7);
    if constexpr (kRowTiles > 1) _tile_dpbf16ps(2, 5, 6);
    if constexpr (kRowTiles > 1 && kColumnTiles > 1) _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, c, c_stride);
  if constexpr (kColumnTiles > 1) _tile_stored(1, c + 16, c_stride);
  if constexpr (kRowTiles > 1) _tile_stored(2, c_low, c_stride);
  if constexpr (kRowTiles > 1 && kColumnTiles > 1) _tile_stored(3, c_low + 16, c_stride);
  PA_MEMORY_BARRIER();
}

// The product of bf16_dot.h's contract on AMX. Loads the tile configuration itself (a thread's
// tile state may have been released or configured by other code since its last call); the caller
// releases the tiles with amx_release() when its run of products is over. Only when amx_usable().
PA_AMX_TARGET inline void matmul_bf16_amx(int64_t m, int64_t n, int64_t k, const uint16_t* a,
                                          int64_t lda, const uint16_t* b_pairs, int64_t ldb,
                                          float* c, int64_t ldc, bool accumulate) {
  static const amx_detail::TileConfig config;
  _tile_loadconfig(&config);
  int64_t i = 0;
  for (; i + 32 <= m; i += 32) {
    int64_t j = 0;
    for (; j + 32 <= n; j += 32) {
      amx_block<2, 2>(k, a + i * lda, lda, b_pairs + 2 * j, ldb, c + i * ldc + j, ldc,
                      accumulate);
    }
    if (j < n) {
      amx_block<2, 1>(k, a + i * lda, lda, b_pairs + 2 * j, ldb, c + i * ldc + j, ldc,
                      accumulate);
    }
  }
  if (i < m) {
    int64_t j = 0;
    for (; j + 32 <= n; j += 32) {
      amx_block<1, 2>(k, a + i * lda, lda, b_pairs + 2 * j, ldb, c + i * ldc + j, ldc,
                      accumulate);
    }
    if (j < n) {
      amx_block<1, 1>(k, a + i * lda, lda, b_pairs + 2 * j, ldb, c + i * ldc + j, ldc,
                      accumulate);
    }
  }
}

// Returns the thread's tile state to its initial, unconfigured form (so that the OS need not
// save 8 KiB of tile data for it at each switch).
PA_AMX_TARGET inline void amx_release() { _tile_release(); }

#undef PA_MEMORY_BARRIER
#undef PA_AMX_TARGET

#else

inline bool amx_usable() { return false; }

#endif  // PA_HAVE_AMX

}  // namespace paged_attention::cpu
