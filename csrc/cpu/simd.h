// SIMD primitives of the CPU attention kernels, free of torch headers (c10's scalar types name
// the cache element formats).
//
// Vector code uses GCC/Clang vector extensions (16 float lanes) rather than intrinsics, so one
// source compiles for every instruction set a kernel is built for (see the variants in
// decode_attention.h). A 16-lane vector is one AVX-512 register; with 256-bit registers GCC keeps
// it on the stack, so the AVX2 variant runs its multiply-add loops and the softmax on 8-lane
// halves instead (kSplit).
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace paged_attention::cpu {

// 64-byte vectors are passed only between inlined helpers, so their ABI never matters (the
// warning would otherwise be issued for the baseline variant in decode_attention.h).
#pragma GCC diagnostic ignored "-Wpsabi"

constexpr int kLanes = 16;
using f32x16 = float __attribute__((vector_size(64)));
using i32x16 = int32_t __attribute__((vector_size(64)));
using u32x16 = uint32_t __attribute__((vector_size(64)));

template <typename To, typename From>
inline To bit_cast(const From& from) {
  static_assert(sizeof(To) == sizeof(From));
  To to;
  std::memcpy(&to, &from, sizeof(To));
  return to;
}

template <typename F = f32x16>
inline F splat(float v) {
  return F{} + v;
}

template <typename V>
inline V load_vector(const void* p) {
  V v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// Taken by value: copying from an array element's address would keep the array in memory.
template <typename V>
inline void store_vector(void* p, V v) {
  std::memcpy(p, &v, sizeof(v));
}


// A cache tile is read 64 bytes at a time ("a chunk"). A chunk of cache_t becomes
// kVectorsPerChunk<cache_t> 16-lane fp32 vectors, de-interleaved: lane l of vector v holds element
// l * kVectorsPerChunk + v. That order needs only shifts and masks to convert bf16, fp16 and fp8;
// the query and probability patterns are laid out in the same order, so the products line up.
template <typename cache_t>
constexpr int kVectorsPerChunk = sizeof(cache_t) == 4 ? 1 : 4 / static_cast<int>(sizeof(cache_t));
template <typename cache_t>
constexpr int kElementsPerChunk = 64 / static_cast<int>(sizeof(cache_t));

// Half vectors (8 lanes): the AVX2 variant keeps its accumulators in these, one 256-bit register
// each, and handles a 16-lane vector as two halves (see kSplit in attend_tokens).
using f32x8 = float __attribute__((vector_size(32)));
using i32x8 = int32_t __attribute__((vector_size(32)));
using u32x8 = uint32_t __attribute__((vector_size(32)));

// The unsigned and signed integer vectors with the lanes of a float vector.
template <typename F>
struct WordsOf;
template <>
struct WordsOf<f32x16> {
  using type = u32x16;
  using signed_type = i32x16;
};
template <>
struct WordsOf<f32x8> {
  using type = u32x8;
  using signed_type = i32x8;
};
template <typename F>
using IntsOf = typename WordsOf<F>::signed_type;


// fp16 bits (low 16 bits of each lane) -> fp32; exact, including subnormals, inf and NaN.
template <typename F, typename U>
inline F half_bits_to_float(U bits) {
  const U sign = (bits & 0x8000u) << 16;
  // Exponent and mantissa moved into fp32 position, then rescaled by 2^(127 - 15).
  const F magnitude = bit_cast<F>((bits & 0x7fffu) << 13) * 0x1.0p112f;
  const U inf_or_nan = bit_cast<U>((bits & 0x7c00u) == 0x7c00u) & 0x7f800000u;
  return bit_cast<F>(bit_cast<U>(magnitude) | inf_or_nan | sign);
}

// fp8 bits (low 8 bits of each lane) -> fp32, the same way: the exponent-mantissa bits are moved
// to the top of the fp32 exponent field and the bias difference is multiplied in (exact).
template <typename F, typename U>
inline F fp8_bits_to_float(U bits, c10::Float8_e4m3fn) {
  const U sign = (bits & 0x80u) << 24;
  const F magnitude = bit_cast<F>((bits & 0x7fu) << 20) * 0x1.0p120f;
  const U nan = bit_cast<U>((bits & 0x7fu) == 0x7fu) & 0x7fc00000u;  // e4m3fn: no inf
  return bit_cast<F>(bit_cast<U>(magnitude) | nan | sign);
}

template <typename F, typename U>
inline F fp8_bits_to_float(U bits, c10::Float8_e5m2) {
  const U sign = (bits & 0x80u) << 24;
  const F magnitude = bit_cast<F>((bits & 0x7fu) << 21) * 0x1.0p112f;
  const U inf_or_nan = bit_cast<U>((bits & 0x7cu) == 0x7cu) & 0x7f800000u;
  return bit_cast<F>(bit_cast<U>(magnitude) | inf_or_nan | sign);
}

// Converts sizeof(F) bytes of cache elements at p into kVectorsPerChunk float vectors F (16 or 8
// lanes; 8 lanes read the first or second half of a 64-byte chunk, in the same lane order).
template <typename F>
inline void load_chunk(const float* p, float, F* out) {
  out[0] = load_vector<F>(p);
}

template <typename F>
inline void load_chunk(const c10::BFloat16* p, float, F* out) {
  using U = typename WordsOf<F>::type;
  const U w = load_vector<U>(p);
  out[0] = bit_cast<F>(w << 16);
  out[1] = bit_cast<F>(w & 0xffff0000u);
}

template <typename F>
inline void load_chunk(const c10::Half* p, float, F* out) {
  using U = typename WordsOf<F>::type;
  const U w = load_vector<U>(p);
  out[0] = half_bits_to_float<F>(w);
  out[1] = half_bits_to_float<F>(w >> 16);
}

template <typename F, typename Fp8>
inline void load_fp8_chunk(const Fp8* p, float scale, F* out) {
  using U = typename WordsOf<F>::type;
  const U w = load_vector<U>(p);
  for (int v = 0; v < 4; ++v) out[v] = fp8_bits_to_float<F>(w >> (8 * v), Fp8{}) * scale;
}

template <typename F>
inline void load_chunk(const c10::Float8_e4m3fn* p, float scale, F* out) {
  load_fp8_chunk(p, scale, out);
}

template <typename F>
inline void load_chunk(const c10::Float8_e5m2* p, float scale, F* out) {
  load_fp8_chunk(p, scale, out);
}

// n cache elements at src -> float32 at dst, in order (fp8 multiplied by its scale): the
// conversions of load_chunk, 16 elements at a time, without its lane reordering.
inline void convert_row(const float* src, int64_t n, float, float* dst) {
  using f32x4 = float __attribute__((vector_size(16)));
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) store_vector(dst + i, load_vector<f32x16>(src + i));
  if (i + 8 <= n) {
    store_vector(dst + i, load_vector<f32x8>(src + i));
    i += 8;
  }
  if (i + 4 <= n) {  // one 16-byte chunk of the fp32 key layout
    store_vector(dst + i, load_vector<f32x4>(src + i));
    i += 4;
  }
  for (; i < n; ++i) dst[i] = src[i];
}

using u16x16 = uint16_t __attribute__((vector_size(32)));
using u16x8 = uint16_t __attribute__((vector_size(16)));
using u8x16 = uint8_t __attribute__((vector_size(16)));
using u8x8 = uint8_t __attribute__((vector_size(8)));

// 16, then 8 elements at a time, then one by one; `convert` maps the zero-extended bits of a
// vector of elements (u32x16 or u32x8) to floats.
template <typename cache_t, typename Convert>
inline void convert_row_with(const cache_t* src, int64_t n, float* dst, Convert convert) {
  constexpr bool kWide = sizeof(cache_t) == 2;
  using Bits = std::conditional_t<kWide, uint16_t, uint8_t>;
  using B16 = std::conditional_t<kWide, u16x16, u8x16>;
  using B8 = std::conditional_t<kWide, u16x8, u8x8>;
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    store_vector(dst + i, convert(__builtin_convertvector(load_vector<B16>(src + i), u32x16)));
  }
  if (i + 8 <= n) {
    store_vector(dst + i, convert(__builtin_convertvector(load_vector<B8>(src + i), u32x8)));
    i += 8;
  }
  for (; i < n; ++i) {
    Bits one;
    std::memcpy(&one, src + i, sizeof(one));
    u32x8 bits{};
    bits[0] = one;
    dst[i] = convert(bits)[0];
  }
}

inline void convert_row(const c10::BFloat16* src, int64_t n, float, float* dst) {
  convert_row_with(src, n, dst, [](auto bits) {
    return bit_cast<std::conditional_t<sizeof(bits) == 64, f32x16, f32x8>>(bits << 16);
  });
}

inline void convert_row(const c10::Half* src, int64_t n, float, float* dst) {
  convert_row_with(src, n, dst, [](auto bits) {
    return half_bits_to_float<std::conditional_t<sizeof(bits) == 64, f32x16, f32x8>>(bits);
  });
}

template <typename Fp8>
inline void convert_fp8_row(const Fp8* src, int64_t n, float scale, float* dst) {
  convert_row_with(src, n, dst, [scale](auto bits) {
    using F = std::conditional_t<sizeof(bits) == 64, f32x16, f32x8>;
    return fp8_bits_to_float<F>(bits, Fp8{}) * scale;
  });
}

inline void convert_row(const c10::Float8_e4m3fn* src, int64_t n, float scale, float* dst) {
  convert_fp8_row(src, n, scale, dst);
}

inline void convert_row(const c10::Float8_e5m2* src, int64_t n, float scale, float* dst) {
  convert_fp8_row(src, n, scale, dst);
}

template <typename F>
inline F zero_where_not(F v, IntsOf<F> keep) {
  return bit_cast<F>(bit_cast<IntsOf<F>>(v) & keep);
}

// After group_sum<W>, lane k * W holds the sum of lanes [k * W, (k + 1) * W).
template <int W>
inline f32x16 group_sum(f32x16 v) {
  if constexpr (W >= 16) {
    v += __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
  }
  if constexpr (W >= 8) {
    v += __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
  }
  if constexpr (W >= 4) {
    v += __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
  }
  if constexpr (W >= 2) {
    v += __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
  }
  return v;
}

// a, b, c, d each hold 4 tokens x 4 partial sums (token t in lanes 4t..4t+3); returns the 16
// token sums in order (a's tokens in lanes 0-3, then b's, c's, d's), with 6 two-vector shuffles.
inline f32x16 sum_token_lanes(f32x16 a, f32x16 b, f32x16 c, f32x16 d) {
  // Pairs of lanes: a's token t in lanes 2t, 2t + 1, b's in lanes 8 + 2t, 9 + 2t.
  const f32x16 ab =
      __builtin_shufflevector(a, b, 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
      __builtin_shufflevector(a, b, 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
  const f32x16 cd =
      __builtin_shufflevector(c, d, 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
      __builtin_shufflevector(c, d, 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
  return __builtin_shufflevector(ab, cd, 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28,
                                 30) +
         __builtin_shufflevector(ab, cd, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29,
                                 31);
}

// exp(x) to about 1 ulp: 2^n * e^r with |r| <= ln2 / 2 and a degree-6 Taylor polynomial.
// Inputs are clamped to the normal range; NaN propagates.
template <typename F>
inline F vexp(F x) {
  x = x < -87.0f ? splat<F>(-87.0f) : x;
  x = x > 88.0f ? splat<F>(88.0f) : x;
  constexpr float kRound = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  const F n = (x * 1.44269504f + kRound) - kRound;
  const F r = (x - n * 0.693145752f) - n * 1.42860677e-6f;
  F poly = splat<F>(1.0f / 720.0f);
  poly = poly * r + 1.0f / 120.0f;
  poly = poly * r + 1.0f / 24.0f;
  poly = poly * r + 1.0f / 6.0f;
  poly = poly * r + 0.5f;
  poly = poly * r + 1.0f;
  poly = poly * r + 1.0f;
  const IntsOf<F> exponent = (__builtin_convertvector(n, IntsOf<F>) + 127) << 23;
  return poly * bit_cast<F>(exponent);
}

// tanh(y) = 1 - 2 / (e^2y + 1), with an odd Taylor series near 0 where that form cancels.
template <typename F>
inline F vtanh(F y) {
  const F y2 = y * y;
  const F series =
      y * (1.0f + y2 * (-1.0f / 3.0f + y2 * (2.0f / 15.0f + y2 * (-17.0f / 315.0f))));
  const F general = 1.0f - 2.0f / (vexp(2.0f * y) + 1.0f);
  return y2 < 0.0625f * 0.0625f ? series : general;
}

// probs[token[l]] in lane l, for a block's probabilities probs[0, block_size) (block size 8, 16
// or 32). With block size 8 it loads 8 floats past the block, unused (see AlignedFloats).
inline f32x16 permute_block(const float* probs, i32x16 token, int64_t block_size) {
#if defined(__clang__)  // clang has no variable-index vector shuffle builtin
  f32x16 out;
  for (int l = 0; l < kLanes; ++l) out[l] = probs[token[l]];
  return out;
#else
  if (block_size <= kLanes) return __builtin_shuffle(load_vector<f32x16>(probs), token);
  return __builtin_shuffle(load_vector<f32x16>(probs), load_vector<f32x16>(probs + kLanes), token);
#endif
}

// permute_block, written to dst 8 lanes at a time (kSplit).
inline void permute_block_split(float* dst, const float* probs, const i32x16& token,
                                int64_t block_size) {
#if !defined(__clang__)
  if (block_size <= kLanes) {
    const f32x8 low = load_vector<f32x8>(probs);
    const f32x8 high = load_vector<f32x8>(probs + 8);
    for (int h = 0; h < 2; ++h) {
      const auto index = load_vector<i32x8>(reinterpret_cast<const char*>(&token) + 32 * h);
      const f32x8 out = __builtin_shuffle(low, high, index);
      std::memcpy(dst + 8 * h, &out, sizeof(out));
    }
    return;
  }
#endif
  for (int l = 0; l < kLanes; ++l) dst[l] = probs[token[l]];
}

// p[0], p[1], p[2], p[3], repeated to fill V: a broadcast of one 128-bit element.
template <typename V>
inline V repeat_quad(const float* p) {
  using u128 = unsigned __int128;
  using u128x4 = u128 __attribute__((vector_size(64)));
  using u128x2 = u128 __attribute__((vector_size(32)));
  using U = std::conditional_t<sizeof(V) == 64, u128x4, u128x2>;
  return bit_cast<V>(U{} + load_vector<u128>(p));
}

// 0, 1, ..., lanes - 1.
template <typename I = i32x16>
inline I lane_index() {
  if constexpr (sizeof(I) == 64) {
    return I{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  } else {
    return I{0, 1, 2, 3, 4, 5, 6, 7};
  }
}

// A buffer whose data starts on a 64-byte boundary (vectors are loaded and stored through
// memcpy, which needs no alignment, but aligned vectors never split a cache line), followed by at
// least 64 readable bytes, so a vector load that starts inside the buffer never leaves it.
template <typename T>
class AlignedArray {
 public:
  void resize(int64_t n) {
    constexpr int64_t kSlack = 128 / sizeof(T);  // alignment, then >= 64 bytes of readable slack
    storage_.assign(n + kSlack, T{});
    capacity_ = n;
    const auto address = reinterpret_cast<uintptr_t>(storage_.data());
    data_ = storage_.data() + ((64 - address % 64) % 64) / sizeof(T);
  }
  // At least n elements, keeping the storage (and its contents) when it holds them already: for
  // buffers reused from call to call whose users write every element before reading it. The
  // sanitizer build (PA_POISON_REUSED_SCRATCH, `make test-asan`) fills them with NaN at every
  // call instead, so that a read before a write shows in the tests' outputs.
  void grow(int64_t n) {
    if (n > capacity_) resize(n);
#ifdef PA_POISON_REUSED_SCRATCH
    std::fill(data_, data_ + n, std::numeric_limits<T>::quiet_NaN());
#endif
  }
  T* data() { return data_; }

 private:
  std::vector<T> storage_;
  T* data_ = nullptr;
  int64_t capacity_ = 0;
};

using AlignedFloats = AlignedArray<float>;

inline int64_t round_up(int64_t v, int64_t m) { return (v + m - 1) / m * m; }

constexpr int kToL1 = 3;  // __builtin_prefetch locality: 3 = prefetcht0, 1 = prefetcht2
constexpr int kToL2 = 1;

template <int kLocality>
inline void prefetch_lines(const void* start, int64_t bytes) {
  const char* p = static_cast<const char*>(start);
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(p + off, 0, kLocality);
}

// Sums the lanes of v in groups of `width` (2, 4, 8 or 16); the sums land in lanes k * width.
inline f32x16 group_sum(f32x16 v, int64_t width) {
  switch (width) {
    case 2:
      return group_sum<2>(v);
    case 4:
      return group_sum<4>(v);
    case 8:
      return group_sum<8>(v);
    default:
      return group_sum<16>(v);
  }
}

}  // namespace paged_attention::cpu
