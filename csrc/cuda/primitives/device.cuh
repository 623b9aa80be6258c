// The device implementation of primitives.h: inline PTX (sm_80 and newer; the e4m3 conversion
// instruction needs sm_89).
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#define PA_DEVICE __device__ __forceinline__

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
#error "paged_attention's CUDA attention kernels need sm_80 or newer (mma.sync bf16, cp.async)"
#endif

namespace paged_attention::prim {

extern __shared__ __align__(128) char dynamic_shared_memory[];

PA_DEVICE int thread_index() { return static_cast<int>(threadIdx.x); }
PA_DEVICE Index3 block_index() {
  return {static_cast<int>(blockIdx.x), static_cast<int>(blockIdx.y),
          static_cast<int>(blockIdx.z)};
}
PA_DEVICE Index3 grid_size() {
  return {static_cast<int>(gridDim.x), static_cast<int>(gridDim.y), static_cast<int>(gridDim.z)};
}

template <typename T>
PA_DEVICE T* shared(uint32_t offset) {
  return reinterpret_cast<T*>(dynamic_shared_memory + offset);
}

// The shared-state-space address of a byte offset into dynamic shared memory.
PA_DEVICE uint32_t shared_address(uint32_t offset) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(dynamic_shared_memory)) + offset;
}

PA_DEVICE void syncthreads() { __syncthreads(); }
PA_DEVICE void syncwarp() { __syncwarp(); }

PA_DEVICE float shfl_xor(float v, int mask) { return __shfl_xor_sync(0xffffffffu, v, mask); }
PA_DEVICE uint32_t shfl_xor(uint32_t v, int mask) {
  return __shfl_xor_sync(0xffffffffu, v, mask);
}
PA_DEVICE float shfl(float v, int src_lane) { return __shfl_sync(0xffffffffu, v, src_lane); }
PA_DEVICE bool any(bool p) { return __any_sync(0xffffffffu, p); }

PA_DEVICE void cp_async_16(uint32_t dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(shared_address(dst)),
               "l"(src)
               : "memory");
}
PA_DEVICE void cp_async_8(uint32_t dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\n" ::"r"(shared_address(dst)), "l"(src)
               : "memory");
}
PA_DEVICE void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
PA_DEVICE void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

PA_DEVICE void ldmatrix_x4(uint32_t (&r)[4], uint32_t row_offset) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(shared_address(row_offset))
               : "memory");
}

template <MmaType kType>
PA_DEVICE void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  if constexpr (kType == MmaType::kBF16) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

template <typename T>
PA_DEVICE T load(const T* p) {
  return __ldg(p);
}
template <typename T>
PA_DEVICE void store(T* p, T v) {
  *p = v;
}

// ---- element conversions (round to nearest even) ----

PA_DEVICE float bits_to_float(uint32_t bits) { return __uint_as_float(bits); }
PA_DEVICE uint32_t float_to_bits(float v) { return __float_as_uint(v); }

PA_DEVICE float half_to_float(uint16_t bits) {
  float v;
  asm("cvt.f32.f16 %0, %1;\n" : "=f"(v) : "h"(bits));
  return v;
}
PA_DEVICE float bf16_to_float(uint16_t bits) { return __uint_as_float(uint32_t{bits} << 16); }
PA_DEVICE uint16_t float_to_half(float v) {
  uint16_t bits;
  asm("cvt.rn.f16.f32 %0, %1;\n" : "=h"(bits) : "f"(v));
  return bits;
}
PA_DEVICE uint16_t float_to_bf16(float v) {
  uint16_t bits;
  asm("cvt.rn.bf16.f32 %0, %1;\n" : "=h"(bits) : "f"(v));
  return bits;
}

// Two floats -> one 32-bit register of two 16-bit elements, lo in the low half.
template <MmaType kType>
PA_DEVICE uint32_t pack2(float lo, float hi) {
  uint32_t packed;
  if constexpr (kType == MmaType::kBF16) {
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(packed) : "f"(hi), "f"(lo));
  } else {
    asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(packed) : "f"(hi), "f"(lo));
  }
  return packed;
}

PA_DEVICE void half2_to_float2(uint32_t h2, float& lo, float& hi) {
  lo = half_to_float(static_cast<uint16_t>(h2 & 0xffffu));
  hi = half_to_float(static_cast<uint16_t>(h2 >> 16));
}

// Two fp8 values (byte 0 -> low half) -> two halves, exactly (NaN stays NaN).
PA_DEVICE uint32_t e4m3x2_to_half2(uint16_t pair) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  uint32_t h2;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;\n" : "=r"(h2) : "h"(pair));
  return h2;
#else
  // e4m3 (bias 7) -> half (bias 15): the bits shifted into place, then scaled by 2^8 in half
  // arithmetic (exact, subnormals included); 0x7f/0xff (NaN) are mapped to half NaN.
  uint32_t out = 0;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const uint32_t b = (pair >> (8 * i)) & 0xffu;
    uint32_t h;
    if ((b & 0x7fu) == 0x7fu) {
      h = 0x7e00u | ((b & 0x80u) << 8);
    } else {
      const __half shifted = __ushort_as_half(static_cast<uint16_t>(((b & 0x80u) << 8) |
                                                                    ((b & 0x7fu) << 7)));
      h = __half_as_ushort(__hmul(shifted, __ushort_as_half(0x5c00u)));  // * 2^8
    }
    out |= h << (16 * i);
  }
  return out;
#endif
}
// e5m2 is the upper byte of a half: a byte permute.
PA_DEVICE uint32_t e5m2x2_to_half2(uint16_t pair) {
  return __byte_perm(uint32_t{pair}, 0u, 0x1404);
}

// Four fp8 values (bytes 0-3) -> halves (0, 1) in lo and (2, 3) in hi, reading the register's
// 16-bit halves directly (no shift to extract the upper pair).
PA_DEVICE void e4m3x4_to_half2x2(uint32_t four, uint32_t& lo, uint32_t& hi) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  asm("{\n .reg .b16 l, h;\n mov.b32 {l, h}, %2;\n cvt.rn.f16x2.e4m3x2 %0, l;\n"
      " cvt.rn.f16x2.e4m3x2 %1, h;\n}\n"
      : "=r"(lo), "=r"(hi)
      : "r"(four));
#else
  lo = e4m3x2_to_half2(static_cast<uint16_t>(four & 0xffffu));
  hi = e4m3x2_to_half2(static_cast<uint16_t>(four >> 16));
#endif
}
PA_DEVICE void e5m2x4_to_half2x2(uint32_t four, uint32_t& lo, uint32_t& hi) {
  lo = __byte_perm(four, 0u, 0x1404);
  hi = __byte_perm(four, 0u, 0x3424);
}

PA_DEVICE float exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}
PA_DEVICE float tanh(float x) { return tanhf(x); }
PA_DEVICE float max(float a, float b) { return fmaxf(a, b); }
// a / b to 2 ulp for |b| in [2^-126, 2^126] (no slow-path call).
PA_DEVICE float divide(float a, float b) { return __fdividef(a, b); }
// p ? a : b as one selp, which the compiler cannot turn into an indexed (local-memory) access
// of the array a and b come from.
PA_DEVICE float select(bool p, float a, float b) {
  float r;
  asm("{\n .reg .pred q;\n setp.ne.b32 q, %1, 0;\n selp.f32 %0, %2, %3, q;\n}\n"
      : "=f"(r)
      : "r"(static_cast<int>(p)), "f"(a), "f"(b));
  return r;
}

}  // namespace paged_attention::prim
