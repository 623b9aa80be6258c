// CPU paged attention: decode (one query token per sequence) over a block-paged KV cache.
//
// Work unit: one (sequence, KV head[, partition]). A unit reads its KV head's key and value tiles
// once and serves the whole group of query heads that share that KV head (GQA/MQA). Two passes
// per unit: keys -> logits of every attended token (kept in a per-thread buffer), then a
// max-subtracted softmax and the probability-weighted sum of the values, all in fp32.
//
// Vector code uses GCC/Clang vector extensions (16 float lanes) rather than intrinsics, and the
// kernel is compiled three times with different target attributes (AVX-512, AVX2+FMA, baseline);
// the variant is chosen at run time from torch's CPU capability, so the build stays portable and
// ATEN_CPU_CAPABILITY=avx2|default forces a narrower variant.
//
// Tile layouts (DESIGN.md), per block and KV head, both contiguous:
//   keys   [head_size / x][block_size][x]   x = 16 bytes / element size
//   values [head_size][block_size]
// A 16-lane vector read from a key tile holds 16/x tokens times x head dims; a vector read from a
// value tile holds one head dim of 16 tokens (two dims of 8 tokens when block_size is 8). The
// multiply-adds accumulate lane-wise and a shuffle tree sums groups of lanes at the end.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/Version.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "checks.h"
#include "cpu/cpu_ops.h"
#include "fp8.h"

namespace paged_attention::cpu {

namespace {

#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wpsabi"  // 64-byte vectors only cross inlined helpers

constexpr int kLanes = 16;
using f32x16 = float __attribute__((vector_size(64)));
using i32x16 = int32_t __attribute__((vector_size(64)));
using u32x16 = uint32_t __attribute__((vector_size(64)));
using u16x16 = uint16_t __attribute__((vector_size(32)));

template <typename To, typename From>
inline To bit_cast(const From& from) {
  static_assert(sizeof(To) == sizeof(From));
  To to;
  std::memcpy(&to, &from, sizeof(To));
  return to;
}

inline f32x16 splat(float v) { return f32x16{} + v; }

inline f32x16 load_floats(const float* p) {
  f32x16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline void store_floats(float* p, f32x16 v) { std::memcpy(p, &v, sizeof(v)); }

// Sixteen consecutive cache elements as fp32. `lut` maps an fp8 byte to its scaled value.
inline f32x16 load16(const float* p, const float*) { return load_floats(p); }

inline f32x16 load16(const c10::BFloat16* p, const float*) {
  u16x16 bits;
  std::memcpy(&bits, p, sizeof(bits));
  return bit_cast<f32x16>(__builtin_convertvector(bits, u32x16) << 16);
}

// fp16 -> fp32 by bit manipulation: exact for normals, subnormals, infinities and NaN.
inline f32x16 load16(const c10::Half* p, const float*) {
  u16x16 bits16;
  std::memcpy(&bits16, p, sizeof(bits16));
  const u32x16 bits = __builtin_convertvector(bits16, u32x16);
  const u32x16 sign = (bits & 0x8000u) << 16;
  // Exponent and mantissa moved into fp32 position, then rescaled by 2^(127 - 15).
  f32x16 magnitude = bit_cast<f32x16>((bits & 0x7fffu) << 13) * splat(0x1.0p112f);
  const i32x16 inf_or_nan = (bits & 0x7c00u) == 0x7c00u;
  const u32x16 mag_bits = bit_cast<u32x16>(magnitude) | (bit_cast<u32x16>(inf_or_nan) & 0x7f800000u);
  return bit_cast<f32x16>(mag_bits | sign);
}

inline f32x16 load16(const uint8_t* p, const float* lut) {
  f32x16 v;
  for (int i = 0; i < kLanes; ++i) v[i] = lut[p[i]];
  return v;
}

inline f32x16 zero_where_not(f32x16 v, i32x16 keep) {
  return bit_cast<f32x16>(bit_cast<i32x16>(v) & keep);
}

// After group_sum<W>, lane k * W holds the sum of lanes [k * W, (k + 1) * W).
template <int W>
inline f32x16 group_sum(f32x16 v) {
  if constexpr (W >= 16) v += __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
  if constexpr (W >= 8) v += __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
  if constexpr (W >= 4) v += __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
  if constexpr (W >= 2) v += __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
  return v;
}

// exp(x) to about 1 ulp: 2^n * e^r with |r| <= ln2 / 2 and a degree-6 Taylor polynomial.
// Inputs are clamped to the normal range; NaN propagates.
inline f32x16 vexp(f32x16 x) {
  x = x < -87.0f ? splat(-87.0f) : x;
  x = x > 88.0f ? splat(88.0f) : x;
  constexpr float kRound = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  const f32x16 n = (x * 1.44269504f + kRound) - kRound;
  const f32x16 r = (x - n * 0.693145752f) - n * 1.42860677e-6f;
  f32x16 poly = splat(1.0f / 720.0f);
  poly = poly * r + 1.0f / 120.0f;
  poly = poly * r + 1.0f / 24.0f;
  poly = poly * r + 1.0f / 6.0f;
  poly = poly * r + 0.5f;
  poly = poly * r + 1.0f;
  poly = poly * r + 1.0f;
  const i32x16 exponent = (__builtin_convertvector(n, i32x16) + 127) << 23;
  return poly * bit_cast<f32x16>(exponent);
}

// tanh(y) = 1 - 2 / (e^2y + 1), with an odd Taylor series near 0 where that form cancels.
inline f32x16 vtanh(f32x16 y) {
  const f32x16 y2 = y * y;
  const f32x16 series = y * (1.0f + y2 * (-1.0f / 3.0f + y2 * (2.0f / 15.0f + y2 * (-17.0f / 315.0f))));
  const f32x16 general = 1.0f - 2.0f / (vexp(2.0f * y) + 1.0f);
  return y2 < 0.0625f * 0.0625f ? series : general;
}

inline i32x16 lane_index() { return i32x16{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}; }

// Everything a kernel needs, as raw pointers and element strides (no tensors past this point).
struct AttentionParams {
  const void* query;
  int64_t query_seq_stride;
  int64_t query_head_stride;
  const void* key_cache;
  const void* value_cache;
  int64_t key_block_stride;
  int64_t key_head_stride;
  int64_t value_block_stride;
  int64_t value_head_stride;
  const int32_t* block_tables;
  int64_t block_table_stride;
  const int32_t* seq_lens;
  const float* alibi_slopes;  // null without ALiBi
  float scale;
  float logits_soft_cap;  // 0: none
  int64_t sliding_window;  // 0: none
  int64_t num_seqs;
  int64_t num_heads;
  int64_t num_kv_heads;
  int64_t head_size;
  int64_t block_size;
  const float* key_lut;  // fp8 caches: byte -> dequantised value (k_scale applied)
  const float* value_lut;
  // v1: out [num_seqs, num_heads, head_size]. v2: tmp_out [num_seqs, num_heads, partitions,
  // head_size] plus max_logits/exp_sums [num_seqs, num_heads, partitions].
  void* out;
  float* max_logits;
  float* exp_sums;
  int64_t num_partitions;  // 1 for v1
  int64_t partition_size;  // tokens per unit; v1: unlimited
};

// A float buffer whose data starts on a 64-byte boundary (vectors are loaded and stored through
// memcpy, which needs no alignment, but aligned vectors never split a cache line).
class AlignedFloats {
 public:
  void resize(int64_t n) {
    storage_.assign(n + kLanes, 0.0f);
    const auto address = reinterpret_cast<uintptr_t>(storage_.data());
    data_ = storage_.data() + ((64 - address % 64) % 64) / sizeof(float);
  }
  float* data() { return data_; }

 private:
  std::vector<float> storage_;
  float* data_ = nullptr;
};

// Per-thread buffers, sized once per parallel chunk. "Vectors" are runs of 16 floats.
struct Scratch {
  AlignedFloats query_patterns;  // [group_pad][head_size / x] vectors: x-dim chunk tiled 16 / x
  AlignedFloats logits;          // [group][logit_stride]: logits, then probabilities
  AlignedFloats accumulators;    // [group][value slots] vectors
  AlignedFloats block_logits;    // [group_pad][block_size]
  AlignedFloats prob_patterns;   // [group][block_size / 16 or 1] vectors
  int64_t logit_stride;
};

constexpr int kHeadTile = 4;  // query heads whose key dot products share registers

inline int64_t round_up(int64_t v, int64_t m) { return (v + m - 1) / m * m; }

inline void prefetch_tile(const void* tile, int64_t bytes) {
  const char* p = static_cast<const char*>(tile);
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(p + off);
}

// Attends the query heads of one KV head to tokens [begin, end) of one sequence (end > begin).
// Writes, per head of the group, the normalised output (float), the max logit and the exp sum.
template <typename scalar_t, typename cache_t>
inline void attend_tokens(const AttentionParams& p, Scratch& s, int64_t seq, int64_t kv_head,
                          int64_t begin, int64_t end, float* out, float* max_logit,
                          float* exp_sum) {
  constexpr int64_t x = 16 / sizeof(cache_t);
  const int64_t head_size = p.head_size;
  const int64_t block_size = p.block_size;
  const int64_t group = p.num_heads / p.num_kv_heads;
  const int64_t group_pad = round_up(group, kHeadTile);
  const int64_t chunks = head_size / x;
  const int64_t seq_len = p.seq_lens[seq];
  const int32_t* block_table = p.block_tables + seq * p.block_table_stride;
  const cache_t* key_base = static_cast<const cache_t*>(p.key_cache) + kv_head * p.key_head_stride;
  const cache_t* value_base =
      static_cast<const cache_t*>(p.value_cache) + kv_head * p.value_head_stride;
  const int64_t tile_bytes = head_size * block_size * static_cast<int64_t>(sizeof(cache_t));
  const int64_t first_block = begin / block_size;
  const int64_t end_block = (end + block_size - 1) / block_size;
  const int64_t n = end - begin;

  // Query heads of the group, scaled, as one 16-lane pattern per x-dim chunk.
  float* query_patterns = s.query_patterns.data();
  for (int64_t g = 0; g < group_pad; ++g) {
    const scalar_t* q = static_cast<const scalar_t*>(p.query) + seq * p.query_seq_stride +
                        (kv_head * group + g) * p.query_head_stride;
    for (int64_t c = 0; c < chunks; ++c) {
      f32x16 pattern{};
      if (g < group) {
        for (int i = 0; i < kLanes; ++i) {
          pattern[i] = static_cast<float>(q[c * x + i % x]) * p.scale;
        }
      }
      store_floats(query_patterns + (g * chunks + c) * kLanes, pattern);
    }
  }

  // Pass 1: logits. Each block's tile is multiplied in storage order; invalid slots of a partial
  // block produce logits that are simply not copied out.
  float* logits = s.logits.data();
  float* block_logits = s.block_logits.data();
  const int64_t vectors_per_chunk = block_size * x / kLanes;  // even: 2 ... 32
  constexpr int64_t tokens_per_vector = kLanes / x;
  for (int64_t b = first_block; b < end_block; ++b) {
    if (b + 2 < end_block) {
      prefetch_tile(key_base + block_table[b + 2] * p.key_block_stride, tile_bytes);
    }
    const cache_t* tile = key_base + block_table[b] * p.key_block_stride;
    for (int64_t g0 = 0; g0 < group_pad; g0 += kHeadTile) {
      for (int64_t j = 0; j < vectors_per_chunk; j += 2) {
        f32x16 acc[kHeadTile][2] = {};
        for (int64_t c = 0; c < chunks; ++c) {
          const cache_t* k = tile + c * block_size * x + j * kLanes;
          const f32x16 k0 = load16(k, p.key_lut);
          const f32x16 k1 = load16(k + kLanes, p.key_lut);
#pragma GCC unroll 4
          for (int g = 0; g < kHeadTile; ++g) {
            const f32x16 q = load_floats(query_patterns + ((g0 + g) * chunks + c) * kLanes);
            acc[g][0] += q * k0;
            acc[g][1] += q * k1;
          }
        }
#pragma GCC unroll 4
        for (int g = 0; g < kHeadTile; ++g) {
          for (int h = 0; h < 2; ++h) {
            const f32x16 sums = group_sum<x>(acc[g][h]);
            for (int64_t t = 0; t < tokens_per_vector; ++t) {
              block_logits[(g0 + g) * block_size + (j + h) * tokens_per_vector + t] =
                  sums[t * x];
            }
          }
        }
      }
    }
    const int64_t lo = std::max(begin, b * block_size);
    const int64_t hi = std::min(end, (b + 1) * block_size);
    for (int64_t g = 0; g < group; ++g) {
      std::memcpy(logits + g * s.logit_stride + (lo - begin),
                  block_logits + g * block_size + (lo - b * block_size),
                  (hi - lo) * sizeof(float));
    }
  }

  // Soft-cap, ALiBi, then the max-subtracted exponentials, 16 tokens at a time.
  const int64_t h0 = kv_head * group;
  for (int64_t g = 0; g < group; ++g) {
    float* row = logits + g * s.logit_stride;
    const float slope = p.alibi_slopes != nullptr ? p.alibi_slopes[h0 + g] : 0.0f;
    f32x16 row_max = splat(-std::numeric_limits<float>::infinity());
    for (int64_t t = 0; t < n; t += kLanes) {
      const i32x16 valid = lane_index() < static_cast<int32_t>(n - t);
      f32x16 v = load_floats(row + t);
      if (p.logits_soft_cap > 0) v = p.logits_soft_cap * vtanh(v / p.logits_soft_cap);
      if (p.alibi_slopes != nullptr) {
        // position - seq_len + 1, for positions begin + t + lane
        const f32x16 rel = __builtin_convertvector(lane_index(), f32x16) +
                           static_cast<float>(begin + t - seq_len + 1);
        v += slope * rel;
      }
      v = valid ? v : splat(-std::numeric_limits<float>::infinity());
      store_floats(row + t, v);
      row_max = v > row_max ? v : row_max;
    }
    float m = row_max[0];
    for (int i = 1; i < kLanes; ++i) m = std::max(m, row_max[i]);
    f32x16 row_sum{};
    for (int64_t t = 0; t < n; t += kLanes) {
      const i32x16 valid = lane_index() < static_cast<int32_t>(n - t);
      const f32x16 e = zero_where_not(vexp(load_floats(row + t) - m), valid);
      store_floats(row + t, e);
      row_sum += e;
    }
    float sum = 0.0f;
    for (int i = 0; i < kLanes; ++i) sum += row_sum[i];
    max_logit[g] = m;
    exp_sum[g] = sum;
  }

  // Pass 2: values. Slot = one head dim (two for block_size 8) of lane-wise partial sums.
  const int64_t lane_group = std::min<int64_t>(block_size, kLanes);  // tokens per vector
  const int64_t vectors_per_row = block_size / lane_group;           // 1 or 2
  const int64_t slots = head_size * lane_group / kLanes;
  float* acc = s.accumulators.data();
  std::fill(acc, acc + group * slots * kLanes, 0.0f);
  float* prob_patterns = s.prob_patterns.data();
  for (int64_t b = first_block; b < end_block; ++b) {
    if (b + 2 < end_block) {
      prefetch_tile(value_base + block_table[b + 2] * p.value_block_stride, tile_bytes);
    }
    const cache_t* tile = value_base + block_table[b] * p.value_block_stride;
    const int64_t block_start = b * block_size;
    const bool partial = block_start < begin || block_start + block_size > end;
    i32x16 keep[2];
    for (int64_t r = 0; r < vectors_per_row; ++r) {
      const i32x16 pos = (lane_index() % static_cast<int32_t>(lane_group)) +
                         static_cast<int32_t>(block_start - begin + r * lane_group);
      keep[r] = (pos >= 0) & (pos < static_cast<int32_t>(n));
      for (int64_t g = 0; g < group; ++g) {
        f32x16 probs;
        const float* row = logits + g * s.logit_stride;
        for (int i = 0; i < kLanes; ++i) probs[i] = keep[r][i] ? row[pos[i]] : 0.0f;
        store_floats(prob_patterns + (g * vectors_per_row + r) * kLanes, probs);
      }
    }
    for (int64_t slot = 0; slot < slots; ++slot) {
      for (int64_t r = 0; r < vectors_per_row; ++r) {
        f32x16 v = load16(tile + (slot * vectors_per_row + r) * kLanes, p.value_lut);
        if (partial) v = zero_where_not(v, keep[r]);  // never let 0 * NaN into the sum
        for (int64_t g = 0; g < group; ++g) {
          float* a = acc + (g * slots + slot) * kLanes;
          store_floats(a, load_floats(a) +
                              load_floats(prob_patterns + (g * vectors_per_row + r) * kLanes) * v);
        }
      }
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    const float inv_sum = 1.0f / exp_sum[g];
    for (int64_t slot = 0; slot < slots; ++slot) {
      const f32x16 v = load_floats(acc + (g * slots + slot) * kLanes);
      if (lane_group == kLanes) {
        out[g * head_size + slot] = group_sum<16>(v)[0] * inv_sum;
      } else {
        const f32x16 sums = group_sum<8>(v);
        out[g * head_size + 2 * slot] = sums[0] * inv_sum;
        out[g * head_size + 2 * slot + 1] = sums[8] * inv_sum;
      }
    }
  }
}

// Runs units [unit_begin, unit_end) of (sequence, KV head, partition), in that nesting order.
template <typename scalar_t, typename cache_t>
inline void run_units(const AttentionParams& p, int64_t unit_begin, int64_t unit_end) {
  constexpr int64_t x = 16 / sizeof(cache_t);
  const int64_t group = p.num_heads / p.num_kv_heads;
  const int64_t group_pad = round_up(group, kHeadTile);
  int64_t max_tokens = 0;
  for (int64_t u = unit_begin; u < unit_end; ++u) {
    max_tokens = std::max<int64_t>(max_tokens, p.seq_lens[u / (p.num_kv_heads * p.num_partitions)]);
  }
  max_tokens = std::min(max_tokens, p.partition_size);
  if (p.sliding_window > 0) max_tokens = std::min(max_tokens, p.sliding_window);

  Scratch s;
  s.logit_stride = round_up(std::max<int64_t>(max_tokens, 1), kLanes);
  s.query_patterns.resize(group_pad * (p.head_size / x) * kLanes);
  s.logits.resize(group * s.logit_stride);
  s.accumulators.resize(group * p.head_size * kLanes);
  s.block_logits.resize(group_pad * p.block_size);
  s.prob_patterns.resize(group * 2 * kLanes);
  std::vector<float> result(group * p.head_size);
  std::vector<float> max_logit(group);
  std::vector<float> exp_sum(group);

  for (int64_t u = unit_begin; u < unit_end; ++u) {
    const int64_t partition = u % p.num_partitions;
    const int64_t kv_head = (u / p.num_partitions) % p.num_kv_heads;
    const int64_t seq = u / (p.num_partitions * p.num_kv_heads);
    const int64_t seq_len = p.seq_lens[seq];
    int64_t begin = p.sliding_window > 0 ? std::max<int64_t>(0, seq_len - p.sliding_window) : 0;
    int64_t end = seq_len;
    begin = std::max(begin, partition * p.partition_size);
    end = std::min(end, (partition + 1) * p.partition_size);
    const bool empty = begin >= end;
    if (empty) {
      std::fill(result.begin(), result.end(), 0.0f);
      std::fill(max_logit.begin(), max_logit.end(), -std::numeric_limits<float>::infinity());
      std::fill(exp_sum.begin(), exp_sum.end(), 0.0f);
    } else {
      attend_tokens<scalar_t, cache_t>(p, s, seq, kv_head, begin, end, result.data(),
                                       max_logit.data(), exp_sum.data());
    }
    for (int64_t g = 0; g < group; ++g) {
      const int64_t row = (seq * p.num_heads + kv_head * group + g) * p.num_partitions + partition;
      scalar_t* dst = static_cast<scalar_t*>(p.out) + row * p.head_size;
      for (int64_t d = 0; d < p.head_size; ++d) {
        dst[d] = static_cast<scalar_t>(result[g * p.head_size + d]);
      }
      if (p.max_logits != nullptr) {
        p.max_logits[row] = max_logit[g];
        p.exp_sums[row] = exp_sum[g];
      }
    }
  }
}

// One compiled copy of the kernels per instruction set; `flatten` inlines every helper into it,
// so each copy is compiled for its own target.
#define PA_DEFINE_VARIANT(name, attributes)                                                   \
  template <typename scalar_t, typename cache_t>                                              \
  attributes void name(const AttentionParams& p, int64_t unit_begin, int64_t unit_end) {     \
    run_units<scalar_t, cache_t>(p, unit_begin, unit_end);                                    \
  }

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
PA_DEFINE_VARIANT(run_units_avx512,
                  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c,bmi2"),
                                 flatten)))
PA_DEFINE_VARIANT(run_units_avx2, __attribute__((target("avx2,fma,f16c,bmi2"), flatten)))
#define PA_HAVE_X86_VARIANTS 1
#endif
PA_DEFINE_VARIANT(run_units_baseline, __attribute__((flatten)))
#undef PA_DEFINE_VARIANT

enum class Isa { kBaseline, kAvx2, kAvx512 };

// Follows torch's own choice (which honours ATEN_CPU_CAPABILITY) and the CPU's features.
Isa selected_isa() {
  static const Isa isa = [] {
#ifdef PA_HAVE_X86_VARIANTS
    const std::string capability = at::get_cpu_capability();
    if (capability.find("AVX512") != std::string::npos && __builtin_cpu_supports("avx512f") &&
        __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
        __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("fma")) {
      return Isa::kAvx512;
    }
    if (capability.find("AVX2") != std::string::npos && __builtin_cpu_supports("avx2") &&
        __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c")) {
      return Isa::kAvx2;
    }
#endif
    return Isa::kBaseline;
  }();
  return isa;
}

template <typename scalar_t, typename cache_t>
void run_all_units(const AttentionParams& p) {
  const int64_t units = p.num_seqs * p.num_kv_heads * p.num_partitions;
  const Isa isa = selected_isa();
  at::parallel_for(0, units, 1, [&](int64_t begin, int64_t end) {
#ifdef PA_HAVE_X86_VARIANTS
    if (isa == Isa::kAvx512) return run_units_avx512<scalar_t, cache_t>(p, begin, end);
    if (isa == Isa::kAvx2) return run_units_avx2<scalar_t, cache_t>(p, begin, end);
#endif
    run_units_baseline<scalar_t, cache_t>(p, begin, end);
  });
}

#pragma GCC diagnostic pop

// The query dtypes the kernels support (the checks reject others first).
#define PA_DISPATCH_QUERY_TYPES(TYPE, NAME, ...)             \
  AT_DISPATCH_SWITCH(TYPE, NAME,                            \
                     AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__) \
                     AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__)  \
                     AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__))

// Dequantisation table of one fp8 format: entry i is the value of byte i times the scale.
template <typename Fp8>
std::vector<float> fp8_lut(const at::Tensor& scale) {
  const float s = scale.item<float>();
  std::vector<float> lut(256);
  for (int i = 0; i < 256; ++i) lut[i] = dequantize_fp8<Fp8>(static_cast<uint8_t>(i), s);
  return lut;
}

// Fills the parameters shared by v1 and v2 and runs the kernel for the given output target.
void run_attention(AttentionParams& p, const AttentionDims& dims, const at::Tensor& query,
                   const at::Tensor& key_cache, const at::Tensor& value_cache,
                   const at::Tensor& block_tables, const at::Tensor& seq_lens,
                   const std::optional<at::Tensor>& alibi_slopes, const at::Tensor& k_scale,
                   const at::Tensor& v_scale, double scale, int64_t sliding_window,
                   double logits_soft_cap) {
  p.query = query.data_ptr();
  p.query_seq_stride = query.stride(0);
  p.query_head_stride = query.stride(1);
  p.key_cache = key_cache.data_ptr();
  p.value_cache = value_cache.data_ptr();
  p.key_block_stride = key_cache.stride(0);
  p.key_head_stride = key_cache.stride(1);
  p.value_block_stride = value_cache.stride(0);
  p.value_head_stride = value_cache.stride(1);
  p.block_tables = block_tables.data_ptr<int32_t>();
  p.block_table_stride = block_tables.stride(0);
  p.seq_lens = seq_lens.data_ptr<int32_t>();
  p.alibi_slopes = alibi_slopes.has_value() ? alibi_slopes->data_ptr<float>() : nullptr;
  p.scale = static_cast<float>(scale);
  p.logits_soft_cap = static_cast<float>(logits_soft_cap);
  p.sliding_window = sliding_window;
  p.num_seqs = dims.num_seqs;
  p.num_heads = dims.num_heads;
  p.num_kv_heads = dims.num_kv_heads;
  p.head_size = dims.head_size;
  p.block_size = dims.block_size;
  if (dims.num_seqs == 0 || dims.num_heads == 0) return;

  std::vector<float> key_lut;
  std::vector<float> value_lut;
  PA_DISPATCH_QUERY_TYPES(query.scalar_type(),
                                  "paged_attention_cpu", [&] {
    switch (dims.cache_dtype) {
      case CacheDtype::kAuto:
        run_all_units<scalar_t, scalar_t>(p);
        break;
      case CacheDtype::kFp8E4M3:
        key_lut = fp8_lut<c10::Float8_e4m3fn>(k_scale);
        value_lut = fp8_lut<c10::Float8_e4m3fn>(v_scale);
        p.key_lut = key_lut.data();
        p.value_lut = value_lut.data();
        run_all_units<scalar_t, uint8_t>(p);
        break;
      case CacheDtype::kFp8E5M2:
        key_lut = fp8_lut<c10::Float8_e5m2>(k_scale);
        value_lut = fp8_lut<c10::Float8_e5m2>(v_scale);
        p.key_lut = key_lut.data();
        p.value_lut = value_lut.data();
        run_all_units<scalar_t, uint8_t>(p);
        break;
    }
  });
}

// out[s, h] = sum_j w_j * tmp_out[s, h, j] / sum_j w_j with w_j = exp_sum_j * exp(max_j - max).
template <typename scalar_t>
void combine_partitions(at::Tensor& out, const at::Tensor& exp_sums,
                        const at::Tensor& max_logits, const at::Tensor& tmp_out) {
  const int64_t rows = out.size(0) * out.size(1);
  const int64_t head_size = out.size(2);
  const int64_t partitions = exp_sums.size(2);
  const float* sums = exp_sums.data_ptr<float>();
  const float* maxes = max_logits.data_ptr<float>();
  const scalar_t* parts = tmp_out.data_ptr<scalar_t>();
  scalar_t* dst = out.data_ptr<scalar_t>();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(head_size);
    std::vector<float> weights(partitions);
    for (int64_t row = begin; row < end; ++row) {
      const float* m = maxes + row * partitions;
      float global_max = -std::numeric_limits<float>::infinity();
      for (int64_t j = 0; j < partitions; ++j) global_max = std::max(global_max, m[j]);
      if (!std::isfinite(global_max)) global_max = 0.0f;
      float total = 0.0f;
      for (int64_t j = 0; j < partitions; ++j) {
        weights[j] = sums[row * partitions + j] * std::exp(m[j] - global_max);
        total += weights[j];
      }
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t j = 0; j < partitions; ++j) {
        if (weights[j] == 0.0f) continue;  // empty partition: its zero row adds nothing
        const scalar_t* part = parts + (row * partitions + j) * head_size;
        for (int64_t d = 0; d < head_size; ++d) acc[d] += weights[j] * static_cast<float>(part[d]);
      }
      const float inv_total = total > 0.0f ? 1.0f / std::max(total, 1e-30f) : 0.0f;
      for (int64_t d = 0; d < head_size; ++d) {
        dst[row * head_size + d] = static_cast<scalar_t>(acc[d] * inv_total);
      }
    }
  });
}

}  // namespace

void paged_attention_v1(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                        const at::Tensor& value_cache, int64_t num_kv_heads, double scale,
                        const at::Tensor& block_tables, const at::Tensor& seq_lens,
                        int64_t block_size, int64_t max_seq_len,
                        const std::optional<at::Tensor>& alibi_slopes,
                        const std::string& kv_cache_dtype, const at::Tensor& k_scale,
                        const at::Tensor& v_scale, int64_t sliding_window,
                        double logits_soft_cap) {
  const AttentionDims dims = check_attention_args(
      out, query, key_cache, value_cache, num_kv_heads, scale, block_tables, seq_lens,
      block_size, max_seq_len, alibi_slopes, kv_cache_dtype, k_scale, v_scale, sliding_window,
      logits_soft_cap);
  check_attention_indices(block_tables, seq_lens, dims, sliding_window);
  AttentionParams p{};
  p.out = out.data_ptr();
  p.num_partitions = 1;
  p.partition_size = std::numeric_limits<int64_t>::max() / 2;
  run_attention(p, dims, query, key_cache, value_cache, block_tables, seq_lens, alibi_slopes,
                k_scale, v_scale, scale, sliding_window, logits_soft_cap);
}

void paged_attention_v2(at::Tensor& out, at::Tensor& exp_sums, at::Tensor& max_logits,
                        at::Tensor& tmp_out, const at::Tensor& query, const at::Tensor& key_cache,
                        const at::Tensor& value_cache, int64_t num_kv_heads, double scale,
                        const at::Tensor& block_tables, const at::Tensor& seq_lens,
                        int64_t block_size, int64_t max_seq_len,
                        const std::optional<at::Tensor>& alibi_slopes,
                        const std::string& kv_cache_dtype, const at::Tensor& k_scale,
                        const at::Tensor& v_scale, int64_t sliding_window,
                        double logits_soft_cap) {
  const AttentionDims dims = check_attention_args(
      out, query, key_cache, value_cache, num_kv_heads, scale, block_tables, seq_lens,
      block_size, max_seq_len, alibi_slopes, kv_cache_dtype, k_scale, v_scale, sliding_window,
      logits_soft_cap);
  check_v2_scratch(exp_sums, max_logits, tmp_out, dims, query);
  check_attention_indices(block_tables, seq_lens, dims, sliding_window);
  AttentionParams p{};
  p.out = tmp_out.data_ptr();
  p.max_logits = max_logits.data_ptr<float>();
  p.exp_sums = exp_sums.data_ptr<float>();
  p.num_partitions = exp_sums.size(2);
  p.partition_size = kPartitionSize;
  run_attention(p, dims, query, key_cache, value_cache, block_tables, seq_lens, alibi_slopes,
                k_scale, v_scale, scale, sliding_window, logits_soft_cap);
  if (dims.num_seqs == 0 || dims.num_heads == 0) return;
  PA_DISPATCH_QUERY_TYPES(query.scalar_type(),
                                  "paged_attention_v2_combine",
                                  [&] { combine_partitions<scalar_t>(out, exp_sums, max_logits,
                                                                     tmp_out); });
}

}  // namespace paged_attention::cpu
