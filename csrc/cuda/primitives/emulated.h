// The host emulation of primitives.h, for testing the kernel bodies on a machine without a GPU.
//
// emulator::launch() runs a kernel body on every thread of every CTA of a grid. The threads of
// one CTA are fibers of one host thread, switched cooperatively: a thread runs until it reaches
// a collective operation (a barrier, a shuffle, a vote, ldmatrix, mma), which completes when
// every thread it involves has arrived (all 32 lanes of the warp; all threads of the CTA for
// syncthreads). Collectives are checked: lanes of one warp must reach the same operation, and a
// barrier no thread can complete (divergence, a thread that exited) is reported as a deadlock.
//
// What the emulation makes visible:
//   * mma_16816 and ldmatrix_x4 move elements between lanes exactly as the PTX ISA's fragment
//     layouts say; mma accumulates in double and rounds to float once;
//   * cp.async writes NaN bytes (0xff, NaN in every float format used here) to its destination
//     when issued and the data only when the issuing thread waits for its group, so a missing
//     or too-weak wait gives NaN in the result; a thread that exits with copies never waited for
//     is an error;
//   * every global access through load/store/cp_async is checked against the memory regions
//     registered for the launch, and every shared access through ldmatrix/cp_async against the
//     CTA's shared memory size (out of bounds is an error);
//   * dynamic shared memory starts as NaN bytes in every CTA;
//   * ldmatrix bank conflicts are counted (the largest number of distinct 16-byte rows of one
//     8x8 matrix that share a bank group).
// Lanes of a warp run between collectives one after the other, in alternating order, so a lane
// reading shared memory another lane has not written yet sees what is there (NaN if it came
// from a pending cp.async): a missing syncwarp between one lane's wait and another lane's plain
// read shows. Memory ordering beyond that (the weak memory model) is not emulated.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <string>

#define PA_DEVICE inline

namespace paged_attention::emulator {

struct LaunchConfig {
  prim::Index3 grid;
  int threads;  // per CTA, a multiple of 32
  uint32_t shared_bytes;
};

// Runs body() on every thread of every CTA (CTAs in parallel on `workers` host threads).
// Returns an empty string, or the first error found.
std::string launch(const LaunchConfig& config, const std::function<void()>& body,
                   int workers = 1);

// Global memory the emulated kernels may access; anything else is an error.
void register_global(const void* data, size_t bytes, bool writable);
void clear_globals();

struct Stats {
  uint64_t ctas = 0;
  uint64_t ldmatrix = 0;              // warp-wide ldmatrix_x4 executed
  uint64_t ldmatrix_conflicted = 0;   // of which with a bank conflict
  int ldmatrix_max_ways = 0;          // worst conflict degree seen (1 = none)
  uint64_t mma = 0;
  uint64_t cp_async_bytes = 0;
};
Stats stats();
void reset_stats();

namespace detail {

// Implemented in csrc/cuda/emulator/runtime.cpp.
int thread_index();
prim::Index3 block_index();
prim::Index3 grid_size();
unsigned char* shared_base();
uint32_t shared_size();
[[noreturn]] void fail(const std::string& message);
void check_global(const void* p, size_t bytes, bool write);
void syncthreads();
void syncwarp();
uint32_t shfl_xor(uint32_t v, int mask);
uint32_t shfl(uint32_t v, int src_lane);
bool any(bool p);
void cp_async(uint32_t dst, const void* src, int bytes);
void cp_async_commit();
void cp_async_wait(int n);
void ldmatrix_x4(uint32_t (&r)[4], uint32_t row_offset);
void mma_16816(bool bf16, float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1);

}  // namespace detail
}  // namespace paged_attention::emulator

namespace paged_attention::prim {

PA_DEVICE int thread_index() { return emulator::detail::thread_index(); }
PA_DEVICE Index3 block_index() { return emulator::detail::block_index(); }
PA_DEVICE Index3 grid_size() { return emulator::detail::grid_size(); }

template <typename T>
PA_DEVICE T* shared(uint32_t offset) {
  if (offset + sizeof(T) > emulator::detail::shared_size()) {
    emulator::detail::fail("shared memory access at byte " + std::to_string(offset) +
                           " past the CTA's " + std::to_string(emulator::detail::shared_size()) +
                           " bytes");
  }
  return reinterpret_cast<T*>(emulator::detail::shared_base() + offset);
}

PA_DEVICE void syncthreads() { emulator::detail::syncthreads(); }
PA_DEVICE void syncwarp() { emulator::detail::syncwarp(); }

PA_DEVICE float bits_to_float(uint32_t bits) {
  float v;
  std::memcpy(&v, &bits, 4);
  return v;
}
PA_DEVICE uint32_t float_to_bits(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, 4);
  return bits;
}

PA_DEVICE float shfl_xor(float v, int mask) {
  return bits_to_float(emulator::detail::shfl_xor(float_to_bits(v), mask));
}
PA_DEVICE uint32_t shfl_xor(uint32_t v, int mask) { return emulator::detail::shfl_xor(v, mask); }
PA_DEVICE float shfl(float v, int src_lane) {
  return bits_to_float(emulator::detail::shfl(float_to_bits(v), src_lane));
}
PA_DEVICE bool any(bool p) { return emulator::detail::any(p); }

PA_DEVICE void cp_async_16(uint32_t dst, const void* src) { emulator::detail::cp_async(dst, src, 16); }
PA_DEVICE void cp_async_8(uint32_t dst, const void* src) { emulator::detail::cp_async(dst, src, 8); }
PA_DEVICE void cp_async_commit() { emulator::detail::cp_async_commit(); }
template <int N>
PA_DEVICE void cp_async_wait() {
  emulator::detail::cp_async_wait(N);
}

PA_DEVICE void ldmatrix_x4(uint32_t (&r)[4], uint32_t row_offset) {
  emulator::detail::ldmatrix_x4(r, row_offset);
}

template <MmaType kType>
PA_DEVICE void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  emulator::detail::mma_16816(kType == MmaType::kBF16, d, a, b0, b1);
}

template <typename T>
PA_DEVICE T load(const T* p) {
  emulator::detail::check_global(p, sizeof(T), false);
  return *p;
}
template <typename T>
PA_DEVICE void store(T* p, T v) {
  emulator::detail::check_global(p, sizeof(T), true);
  *p = v;
}

// ---- element conversions (round to nearest even), bit-exact with the device's ----

PA_DEVICE float half_to_float(uint16_t h) {
  const uint32_t sign = uint32_t{h & 0x8000u} << 16;
  const uint32_t exponent = (h >> 10) & 0x1fu;
  const uint32_t mantissa = h & 0x3ffu;
  if (exponent == 0x1f) return bits_to_float(sign | 0x7f800000u | (mantissa << 13));
  if (exponent != 0) return bits_to_float(sign | ((exponent + 112) << 23) | (mantissa << 13));
  const float magnitude = std::ldexp(static_cast<float>(mantissa), -24);  // subnormal or zero
  return sign ? -magnitude : magnitude;
}

PA_DEVICE float bf16_to_float(uint16_t bits) { return bits_to_float(uint32_t{bits} << 16); }

PA_DEVICE uint16_t float_to_bf16(float v) {
  const uint32_t bits = float_to_bits(v);
  if (std::isnan(v)) return static_cast<uint16_t>((bits >> 16) | 0x40u);
  return static_cast<uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

PA_DEVICE uint16_t float_to_half(float v) {
  const uint32_t bits = float_to_bits(v);
  const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  if (std::isnan(v)) return static_cast<uint16_t>(sign | 0x7e00u);
  const float magnitude = std::fabs(v);
  if (magnitude >= 65520.0f) return static_cast<uint16_t>(sign | 0x7c00u);  // rounds to inf
  if (magnitude < 6.103515625e-05f) {  // below the smallest normal: a multiple of 2^-24
    const float units = std::nearbyint(magnitude * 16777216.0f);  // ties to even
    return static_cast<uint16_t>(sign | static_cast<uint16_t>(units));
  }
  const uint32_t exponent = ((bits >> 23) & 0xffu) - 112;
  uint32_t mantissa = bits & 0x7fffffu;
  uint32_t rounded = (exponent << 10) | (mantissa >> 13);
  const uint32_t rest = mantissa & 0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (rounded & 1u))) ++rounded;
  return static_cast<uint16_t>(sign | rounded);
}

template <MmaType kType>
PA_DEVICE uint32_t pack2(float lo, float hi) {
  if constexpr (kType == MmaType::kBF16) {
    return uint32_t{float_to_bf16(lo)} | (uint32_t{float_to_bf16(hi)} << 16);
  } else {
    return uint32_t{float_to_half(lo)} | (uint32_t{float_to_half(hi)} << 16);
  }
}

PA_DEVICE void half2_to_float2(uint32_t h2, float& lo, float& hi) {
  lo = half_to_float(static_cast<uint16_t>(h2 & 0xffffu));
  hi = half_to_float(static_cast<uint16_t>(h2 >> 16));
}

PA_DEVICE uint16_t e4m3_to_half(uint32_t b) {
  const uint16_t sign = static_cast<uint16_t>((b & 0x80u) << 8);
  const uint32_t exponent = (b >> 3) & 0xfu;
  const uint32_t mantissa = b & 0x7u;
  if (exponent == 0xf && mantissa == 0x7) return static_cast<uint16_t>(sign | 0x7e00u);  // NaN
  if (exponent != 0) return static_cast<uint16_t>(sign | ((exponent + 8) << 10) | (mantissa << 7));
  if (mantissa == 0) return sign;
  // Subnormal e4m3 (mantissa / 8 * 2^-6) is a normal half.
  int shift = 0;
  uint32_t m = mantissa;
  while (!(m & 0x4u)) {
    m <<= 1;
    ++shift;
  }
  return static_cast<uint16_t>(sign | ((8 - shift) << 10) | ((m & 0x3u) << 8));
}

PA_DEVICE uint32_t e4m3x2_to_half2(uint16_t pair) {
  return uint32_t{e4m3_to_half(pair & 0xffu)} | (uint32_t{e4m3_to_half(pair >> 8)} << 16);
}
PA_DEVICE uint32_t e5m2x2_to_half2(uint16_t pair) {
  return ((uint32_t{pair} & 0xffu) << 8) | ((uint32_t{pair} & 0xff00u) << 16);
}
PA_DEVICE void e4m3x4_to_half2x2(uint32_t four, uint32_t& lo, uint32_t& hi) {
  lo = e4m3x2_to_half2(static_cast<uint16_t>(four & 0xffffu));
  hi = e4m3x2_to_half2(static_cast<uint16_t>(four >> 16));
}
PA_DEVICE void e5m2x4_to_half2x2(uint32_t four, uint32_t& lo, uint32_t& hi) {
  lo = e5m2x2_to_half2(static_cast<uint16_t>(four & 0xffffu));
  hi = e5m2x2_to_half2(static_cast<uint16_t>(four >> 16));
}

PA_DEVICE float exp2(float x) { return std::exp2(x); }
PA_DEVICE float tanh(float x) { return std::tanh(x); }
PA_DEVICE float max(float a, float b) { return std::fmax(a, b); }
PA_DEVICE float divide(float a, float b) { return a / b; }
PA_DEVICE float select(bool p, float a, float b) { return p ? a : b; }

}  // namespace paged_attention::prim
