// fp8 KV-cache conversions, usable from host and device code.
//
// Quantisation divides by the scale in fp32, saturates to the format's finite range (NaN stays
// NaN) and rounds to nearest even; dequantisation multiplies by the scale. The same c10 routines
// back torch's own float8 casts, so reference.py reproduces every bit.
#pragma once

#include <c10/macros/Macros.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>

#include <cstdint>

namespace paged_attention {

template <typename Fp8>
struct Fp8Limits;

template <>
struct Fp8Limits<c10::Float8_e4m3fn> {
  static constexpr float kMax = 448.0f;
};

template <>
struct Fp8Limits<c10::Float8_e5m2> {
  static constexpr float kMax = 57344.0f;
};

template <typename Fp8>
C10_HOST_DEVICE inline uint8_t quantize_fp8(float value, float scale) {
  float scaled = value / scale;
  constexpr float kMax = Fp8Limits<Fp8>::kMax;
  if (scaled > kMax) scaled = kMax;  // comparisons are false for NaN, which passes through
  if (scaled < -kMax) scaled = -kMax;
  return Fp8(scaled).x;
}

template <typename Fp8>
C10_HOST_DEVICE inline float dequantize_fp8(uint8_t bits, float scale) {
  return static_cast<float>(Fp8(bits, Fp8::from_bits())) * scale;
}

}  // namespace paged_attention
