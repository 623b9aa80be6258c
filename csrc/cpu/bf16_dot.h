// bf16 matrix products with float32 sums for the CPU kernels' score and value products, and the
// operand layouts they share with the AMX products of amx.h. Free of torch headers.
//
// One product: C[M][N] = (accumulate ? C : 0) + A[M][K] x B[K][N], where
//   A  bf16, row-major, lda elements between rows;
//   B  bf16 in pairs ("VNNI") layout, B_pairs[K / 2][N][2]: element (k, n) at
//      (k / 2) * ldb + 2 * n + k % 2, so one 32-bit word holds rows k and k + 1 of a column;
//   C  float32, row-major, ldc floats between rows;
// with M and N multiples of 16 and K a multiple of 32 (the callers pad their scratch with zeros).
// This is the operand form of both bf16 instructions: `vdpbf16ps` adds, per float32 lane, the
// products of one pair of A (broadcast) with the lane's pair of B; AMX's `tdpbf16ps` takes a tile
// of A rows and a tile of B pair rows. In the attention kernels A is the gathered keys (scores:
// logits_t[tokens][rows] = keys[tokens][D] x query_t) or the gathered values transposed (values:
// out_t[D][rows] += values_t[D][tokens] x probs_t), and B the query rows or the probabilities,
// packed into pairs once per unit or tile.
//
// Variants: `matmul_bf16_avx512bf16` (AVX512-BF16), amx.h's `matmul_bf16_amx`, and the portable
// `matmul_bf16_reference` (any CPU: the tests' check of the other two and of the packing).
#pragma once

#include <cpuid.h>

#include <cstdint>
#include <cstring>

#include "cpu/simd.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define PA_HAVE_BF16_DOT 1
#endif

namespace paged_attention::cpu {

using Bf16MatmulFn = void (*)(int64_t m, int64_t n, int64_t k, const uint16_t* a, int64_t lda,
                              const uint16_t* b_pairs, int64_t ldb, float* c, int64_t ldc,
                              bool accumulate);

constexpr int64_t kBf16MatmulRows = 16;   // M and N are multiples of this
constexpr int64_t kBf16MatmulDepth = 32;  // K is a multiple of this

// float32 -> bf16 bits in the upper half of each lane (round to nearest even; NaN stays NaN).
template <typename U>
inline U round_to_bf16_high(U bits) {
  const U rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) & 0xffff0000u;
  const U nan = bit_cast<U>((bits & 0x7fffffffu) > 0x7f800000u);
  return (nan & ((bits | 0x00400000u) & 0xffff0000u)) | (~nan & rounded);
}

// The same for values that are results of arithmetic, whose NaNs are quiet (the top mantissa bit
// set: rounding cannot carry them into infinity), without the NaN check.
template <typename U>
inline U round_computed_to_bf16_high(U bits) {
  return (bits + 0x7fffu + ((bits >> 16) & 1u)) & 0xffff0000u;
}

inline float bf16_bits_to_float(uint16_t v) {
  const uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// Two float32 rows of n values (n a multiple of 16) -> one row of pairs: dst[2i] = first[i],
// dst[2i + 1] = second[i], in bf16. A pair is one 32-bit word (first in its low half), so this
// needs no shuffle: the rounded bits of `second` keep their upper half, those of `first` move down.
inline void pack_pair_row(const float* first, const float* second, int64_t n, uint16_t* dst) {
  for (int64_t i = 0; i < n; i += kLanes) {
    const u32x16 low = round_to_bf16_high(load_vector<u32x16>(first + i)) >> 16;
    const u32x16 high = round_to_bf16_high(load_vector<u32x16>(second + i));
    store_vector(dst + 2 * i, low | high);
  }
}

// The portable product (scalar sums in float32, in order of k).
inline void matmul_bf16_reference(int64_t m, int64_t n, int64_t k, const uint16_t* a,
                                  int64_t lda, const uint16_t* b_pairs, int64_t ldb, float* c,
                                  int64_t ldc, bool accumulate) {
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      float sum = accumulate ? c[i * ldc + j] : 0.0f;
      for (int64_t p = 0; p < k; ++p) {
        sum += bf16_bits_to_float(a[i * lda + p]) *
               bf16_bits_to_float(b_pairs[(p / 2) * ldb + 2 * j + p % 2]);
      }
      c[i * ldc + j] = sum;
    }
  }
}

#ifdef PA_HAVE_BF16_DOT

// Whether this CPU and OS run AVX512-BF16 (cpuid leaf 7, subleaf 1, EAX bit 5, on top of the
// AVX-512 foundation the OS must save: __builtin_cpu_supports checks that).
inline bool cpu_has_avx512_bf16() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (!__builtin_cpu_supports("avx512f") || !__builtin_cpu_supports("avx512bw") ||
      !__builtin_cpu_supports("avx512vl")) {
    return false;
  }
  if (!__get_cpuid_count(7, 1, &eax, &ebx, &ecx, &edx)) return false;
  return (eax >> 5) & 1u;
}

#define PA_AVX512_BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

// A block of kRows rows of C by kVectors x 16 columns, held in registers over the whole of K:
// per pair row of B, kVectors loads of B and one broadcast pair of A per row of the block.
// 16 accumulators in every shape, enough independent sums to cover the instruction's latency.
template <int kRows, int kVectors>
PA_AVX512_BF16_TARGET inline void dot_block_avx512bf16(int64_t k, const uint16_t* a, int64_t lda,
                                                       const uint16_t* b_pairs, int64_t ldb,
                                                       float* c, int64_t ldc, bool accumulate) {
  __m512 acc[kRows][kVectors];
  for (int i = 0; i < kRows; ++i) {
    for (int j = 0; j < kVectors; ++j) {
      acc[i][j] = accumulate ? _mm512_loadu_ps(c + i * ldc + 16 * j) : _mm512_setzero_ps();
    }
  }
  for (int64_t p = 0; p < k / 2; ++p) {
    __m512bh b[kVectors];
    for (int j = 0; j < kVectors; ++j) {
      b[j] = (__m512bh)_mm512_loadu_si512(b_pairs + p * ldb + 32 * j);
    }
    for (int i = 0; i < kRows; ++i) {
      int32_t pair;
      std::memcpy(&pair, a + i * lda + 2 * p, sizeof(pair));
      const __m512bh broadcast = (__m512bh)_mm512_set1_epi32(pair);
      for (int j = 0; j < kVectors; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], broadcast, b[j]);
    }
  }
  for (int i = 0; i < kRows; ++i) {
    for (int j = 0; j < kVectors; ++j) _mm512_storeu_ps(c + i * ldc + 16 * j, acc[i][j]);
  }
}

PA_AVX512_BF16_TARGET inline void matmul_bf16_avx512bf16(int64_t m, int64_t n, int64_t k,
                                                         const uint16_t* a, int64_t lda,
                                                         const uint16_t* b_pairs, int64_t ldb,
                                                         float* c, int64_t ldc, bool accumulate) {
  int64_t j = 0;
  for (; j + 64 <= n; j += 64) {
    for (int64_t i = 0; i < m; i += 4) {
      dot_block_avx512bf16<4, 4>(k, a + i * lda, lda, b_pairs + 2 * j, ldb, c + i * ldc + j, ldc,
                                 accumulate);
    }
  }
  for (; j + 32 <= n; j += 32) {
    for (int64_t i = 0; i < m; i += 8) {
      dot_block_avx512bf16<8, 2>(k, a + i * lda, lda, b_pairs + 2 * j, ldb, c + i * ldc + j, ldc,
                                 accumulate);
    }
  }
  for (; j < n; j += 16) {
    for (int64_t i = 0; i < m; i += 16) {
      dot_block_avx512bf16<16, 1>(k, a + i * lda, lda, b_pairs + 2 * j, ldb, c + i * ldc + j,
                                  ldc, accumulate);
    }
  }
}

#undef PA_AVX512_BF16_TARGET

#endif  // PA_HAVE_BF16_DOT

}  // namespace paged_attention::cpu
