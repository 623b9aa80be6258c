// CPU paged attention: decode (one query token per sequence) over a block-paged KV cache.
//
// Work unit: one (sequence, run of up to 4 adjacent KV heads[, partition]). A unit reads each KV
// head's key and value tiles once and serves the whole group of query heads that share that KV
// head (GQA/MQA). Two passes per unit: keys -> logits of every attended token (kept in a
// per-thread buffer), then a max-subtracted softmax and the probability-weighted sum of the
// values, all in fp32. The KV heads of a unit are visited block by block, so the unit reads each
// block's tiles of those heads, which are adjacent in the cache, one after another: longer runs
// of contiguous memory than one head's 4-8 KiB tile, which the memory system serves faster.
//
// Vector code uses GCC/Clang vector extensions (16 float lanes) rather than intrinsics, and the
// kernel is compiled three times with different target attributes (AVX-512, AVX2+FMA, baseline);
// the variant is chosen at run time from torch's CPU capability, so the build stays portable and
// ATEN_CPU_CAPABILITY=avx2|default forces a narrower variant. A 16-lane vector is one AVX-512
// register; with 256-bit registers GCC keeps it on the stack, so the AVX2 variant runs its
// multiply-add loops and the softmax on 8-lane halves instead (kSplit).
//
// Tile layouts (DESIGN.md), per block and KV head, both contiguous:
//   keys   [head_size / x][block_size][x]   x = 16 bytes / element size
//   values [head_size][block_size]
// Tiles are read in 64-byte chunks, in storage order, each converted to fp32 vectors in a
// de-interleaved lane order (see load_chunk). The query and the probabilities are laid out once
// per unit/block in the matching order ("patterns"), the multiply-adds accumulate lane-wise, and
// a shuffle tree sums groups of lanes at the end: a key chunk always holds 4 tokens x 4 lanes, a
// value chunk holds whole head-dim rows (or half a row for fp32 with block size 32).
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/Version.h>

#include <algorithm>
#include <atomic>
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

// 64-byte vectors are passed only between inlined helpers, so their ABI never matters (the
// warning would otherwise be issued for the baseline variant, at the end of the file).
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
  float logits_soft_cap;   // 0: none
  int64_t sliding_window;  // 0: none
  int64_t num_seqs;
  int64_t num_heads;
  int64_t num_kv_heads;
  int64_t head_size;
  int64_t block_size;
  float key_scale;  // fp8 caches: dequantisation scales (1 otherwise)
  float value_scale;
  // v1: out [num_seqs, num_heads, head_size]. v2: tmp_out [num_seqs, num_heads, partitions,
  // head_size] plus max_logits/exp_sums [num_seqs, num_heads, partitions].
  void* out;
  float* max_logits;
  float* exp_sums;
  int64_t num_partitions;  // 1 for v1
  int64_t partition_size;  // tokens per unit; v1: unlimited
  int64_t max_unit_tokens;  // the most tokens any unit attends to
  int64_t unit_kv_heads;    // KV heads per unit (the last unit of a sequence may have fewer)
};

// A float buffer whose data starts on a 64-byte boundary (vectors are loaded and stored through
// memcpy, which needs no alignment, but aligned vectors never split a cache line), followed by at
// least 16 readable floats, so a vector load that starts inside the buffer never leaves it.
class AlignedFloats {
 public:
  void resize(int64_t n) {
    storage_.assign(n + 2 * kLanes, 0.0f);  // alignment, then >= 16 floats of readable slack
    const auto address = reinterpret_cast<uintptr_t>(storage_.data());
    data_ = storage_.data() + ((64 - address % 64) % 64) / sizeof(float);
  }
  float* data() { return data_; }

 private:
  std::vector<float> storage_;
  float* data_ = nullptr;
};

// Query heads whose multiply-adds share a loaded cache vector (the AVX2 variant uses half as
// many: see kHeads in attend_tokens); buffers are sized for this many.
constexpr int kHeadTile = 4;
constexpr int kValueBlocks = 8;  // blocks whose value sums stay in registers together
// Probability patterns per block and head: at most 4 vectors per chunk times 2 chunks per value
// row (fp32, block size 32). A fixed stride keeps the pattern offsets compile-time constants in
// the value loop, which would otherwise run short of general-purpose registers.
constexpr int kMaxPatterns = 8;

inline int64_t round_up(int64_t v, int64_t m) { return (v + m - 1) / m * m; }

// Blocks are scattered in memory, so the hardware prefetchers cannot run ahead across them; the
// kernel requests the tiles it will read next itself, a few lines at a time between its
// multiply-adds (a burst of requests would stall once the line-fill buffers are full). Key tiles
// are requested into L2 only (`prefetcht2`): on the machine this was tuned on that made the key
// pass 7-10% faster than requests into L1. While the key pass reads one group of kPrefetchGroup
// tiles (in the order the unit reads its tiles), it requests the next group's lines one line of
// each tile in turn, not tile after tile. There the order mattered, not the distance: about 16
// tiles ahead, v1 bf16 at 32 x 4096 took 25.0-25.5 ms one tile after another and 23.0-24.1 ms
// round-robin over 4 tiles; groups of 4 or 16 were within noise of 8. Value tiles go to L1 one
// KV head's group of kValueBlocks tiles ahead, one tile per block in turn (the AVX2 variant
// requests them all at once; into L2 instead: no measurable difference); a group of every KV
// head of the unit ahead (4 times as far) was 2-5% slower.
constexpr int64_t kPrefetchGroup = 8;
constexpr int kToL1 = 3;  // __builtin_prefetch locality: 3 = prefetcht0, 1 = prefetcht2
constexpr int kToL2 = 1;

template <int kLocality>
inline void prefetch_lines(const void* start, int64_t bytes) {
  const char* p = static_cast<const char*>(start);
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(p + off, 0, kLocality);
}

// The most KV heads per unit (see the top of the file). With head size 128 and block size 16, 4
// heads' key tiles of a block are one 16 KiB (bf16) or 32 KiB (fp32) run of memory.
constexpr int64_t kMaxUnitKvHeads = 4;

// Per-thread buffers, sized once per parallel chunk. A "vector" is a run of 16 floats; "heads"
// is the number of KV heads of a unit.
struct Scratch {
  AlignedFloats query_patterns;  // [heads][group_pad][head_size / 4][4]
  AlignedFloats logits;          // [heads * group][logit_stride]: logits, then exp(logit - max)
  AlignedFloats block_logits;    // [group_pad][block_size]
  AlignedFloats prob_patterns;   // [kValueBlocks][group_pad][kMaxPatterns] vectors
  AlignedFloats accumulators;    // [heads][group_pad][value chunks per tile] vectors
  int64_t logit_stride;

  void resize(int64_t heads, int64_t group, int64_t head_size, int64_t block_size,
              int64_t max_tokens) {
    const int64_t group_pad = round_up(group, kHeadTile);
    logit_stride = round_up(std::max<int64_t>(max_tokens, 1), kLanes);
    query_patterns.resize(heads * group_pad * head_size);
    logits.resize(heads * group * logit_stride);
    block_logits.resize(group_pad * block_size);
    prob_patterns.resize(kValueBlocks * group_pad * kMaxPatterns * kLanes);
    // A value tile of 4-byte elements has head_size * block_size / 16 chunks (the most).
    accumulators.resize(heads * group_pad * head_size * block_size);
  }
};

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

// Attends the query heads of KV heads [kv_head, kv_head + heads) to tokens [begin, end) of one
// sequence (end > begin). Writes, per query head (row hh * group + g for query head g of KV head
// kv_head + hh), the normalised output (float), the max logit and the exp sum.
// kSplit (the AVX2 variant): 16-lane vectors have no register of their own there, and GCC keeps
// them on the stack; the multiply-add loops then hold every vector as two 8-lane halves, in
// registers, with 2 heads per loaded cache vector instead of 4 (16 registers, not 32).
template <typename scalar_t, typename cache_t, bool kSplit>
inline void attend_tokens(const AttentionParams& p, Scratch& s, int64_t seq, int64_t kv_head,
                          int64_t heads, int64_t begin, int64_t end, float* out, float* max_logit,
                          float* exp_sum) {
  constexpr int k = kVectorsPerChunk<cache_t>;
  constexpr int64_t chunk_elems = kElementsPerChunk<cache_t>;
  constexpr int64_t x = 16 / sizeof(cache_t);  // key layout: elements per 16 bytes
  // Chunks whose multiply-adds share one loaded query/probability pattern: 4 when the
  // accumulators and converted chunks still fit in 32 vector registers, else 2.
  constexpr bool kWideTile = !kSplit && k <= 2;
  constexpr int kHeads = kSplit ? kHeadTile / 2 : kHeadTile;  // heads sharing a loaded vector
  // The multiply-add loops hold each 16-lane vector as kParts pieces of type V: one 16-lane
  // vector, or (kSplit) two 8-lane halves, lanes 8h..8h+7 in half h.
  using V = std::conditional_t<kSplit, f32x8, f32x16>;
  constexpr int kParts = kSplit ? 2 : 1;
  constexpr int kPartLanes = kLanes / kParts;
  constexpr int64_t kPartElems = kElementsPerChunk<cache_t> / kParts;
  const int64_t head_size = p.head_size;
  const int64_t block_size = p.block_size;
  const int64_t group = p.num_heads / p.num_kv_heads;
  const int64_t group_pad = round_up(group, kHeads);
  const int64_t rows = heads * group;
  const int64_t seq_len = p.seq_lens[seq];
  const int32_t* block_table = p.block_tables + seq * p.block_table_stride;
  const cache_t* key_base = static_cast<const cache_t*>(p.key_cache) + kv_head * p.key_head_stride;
  const cache_t* value_base =
      static_cast<const cache_t*>(p.value_cache) + kv_head * p.value_head_stride;
  const int64_t first_block = begin / block_size;
  const int64_t end_block = (end + block_size - 1) / block_size;
  const int64_t n = end - begin;

  // ---- Pass 1: logits. A key chunk holds 4 tokens x 16 dims in the order of load_chunk: lane l
  // of vector v is token 4m + l / 4, dim c * x + (l % 4) * k + v (m: chunk within a dim-row c).
  // Lane l of (c, v) needs query element c * x + (l % 4) * k + v, times scale: the query
  // pattern of (c, v) is those 4 floats, repeated across the vector when loaded.
  const int64_t dim_rows = head_size / x;
  const int64_t patterns_per_head = dim_rows * k;  // = head_size / 4
  const int64_t head_patterns = group_pad * patterns_per_head * 4;  // floats per KV head
  float* query_patterns = s.query_patterns.data();
  for (int64_t hh = 0; hh < heads; ++hh) {
    float* head_qp = query_patterns + hh * head_patterns;
    std::fill(head_qp + group * patterns_per_head * 4, head_qp + head_patterns,
              0.0f);  // padding heads
    for (int64_t g = 0; g < group; ++g) {
      const scalar_t* q = static_cast<const scalar_t*>(p.query) + seq * p.query_seq_stride +
                          ((kv_head + hh) * group + g) * p.query_head_stride;
      for (int64_t c = 0; c < dim_rows; ++c) {
        for (int v = 0; v < k; ++v) {
          float* pattern = head_qp + (g * patterns_per_head + c * k + v) * 4;
          for (int l = 0; l < 4; ++l) {
            pattern[l] = static_cast<float>(q[c * x + l * k + v]) * p.scale;
          }
        }
      }
    }
  }
  float* logits = s.logits.data();
  float* block_logits = s.block_logits.data();
  const int64_t key_chunks_per_row = block_size / 4;  // 2, 4 or 8
  // The unit's tiles in the order it reads them, for the requests ahead: the key tiles block by
  // block (the heads of a block together), then the value tiles as the value pass visits them
  // (per group of kValueBlocks blocks, head by head); null past the end.
  const int64_t blocks = end_block - first_block;
  const int64_t key_tiles = blocks * heads;
  auto tile_in_reading_order = [&](int64_t t) -> const char* {
    const cache_t* tile = nullptr;
    if (t < key_tiles) {
      tile = key_base + block_table[first_block + t / heads] * p.key_block_stride +
             t % heads * p.key_head_stride;
    } else if (t < 2 * key_tiles) {
      t -= key_tiles;
      const int64_t group_first = t / (heads * kValueBlocks) * kValueBlocks;
      const int64_t group_blocks = std::min<int64_t>(kValueBlocks, blocks - group_first);
      const int64_t in_group = t - group_first * heads;
      tile = value_base +
             block_table[first_block + group_first + in_group % group_blocks] *
                 p.value_block_stride +
             in_group / group_blocks * p.value_head_stride;
    }
    return reinterpret_cast<const char*>(tile);
  };
  const int64_t row_lines = block_size * 16 / 64;  // 64-byte lines per dim-row of a tile
  const int64_t tile_lines = dim_rows * row_lines;
  for (int64_t b = first_block; b < end_block; ++b) {
    const cache_t* block_tiles = key_base + block_table[b] * p.key_block_stride;
    // Slots outside [begin, end) (the tail of the last block, or before a sliding window)
    // produce logits from whatever the cache holds there; they are not copied out.
    const int64_t lo = std::max(begin, b * block_size);
    const int64_t hi = std::min(end, (b + 1) * block_size);
    for (int64_t hh = 0; hh < heads; ++hh) {
      const cache_t* tile = block_tiles + hh * p.key_head_stride;
      // The next group of kPrefetchGroup tiles, whose lines this tile's key pass requests:
      // requests [first_request, first_request + tile_lines) of the group's interleaved order.
      const int64_t tile_index = (b - first_block) * heads + hh;
      const char* ahead[kPrefetchGroup];
      for (int i = 0; i < kPrefetchGroup; ++i) {
        ahead[i] = tile_in_reading_order((tile_index / kPrefetchGroup + 1) * kPrefetchGroup + i);
      }
      const int64_t first_request = tile_index % kPrefetchGroup * tile_lines;
      for (int64_t g0 = 0; g0 < group_pad; g0 += kHeads) {
        const float* qp = query_patterns + hh * head_patterns + g0 * patterns_per_head * 4;
        // Logits of the 4 * kTile tokens in chunks [m0, m0 + kTile) of every dim-row.
        auto chunk_logits = [&]<int kTile>(int64_t m0) {
          V acc[kHeads][kTile][kParts] = {};
          for (int64_t c = 0; c < dim_rows; ++c) {
            if (g0 == 0 && m0 == 0) {  // dim-row c's share of the requests
              for (int64_t l = 0; l < row_lines; ++l) {
                const int64_t request = first_request + c * row_lines + l;
                const char* ahead_tile = ahead[request % kPrefetchGroup];
                if (ahead_tile != nullptr) {
                  __builtin_prefetch(ahead_tile + request / kPrefetchGroup * 64, 0, kToL2);
                }
              }
            }
            V keys[kTile][kParts][k];
            for (int m = 0; m < kTile; ++m) {
              for (int part = 0; part < kParts; ++part) {
                load_chunk(tile + c * block_size * x + (m0 + m) * chunk_elems + part * kPartElems,
                           p.key_scale, keys[m][part]);
              }
            }
            for (int v = 0; v < k; ++v) {
              for (int g = 0; g < kHeads; ++g) {
                const V q = repeat_quad<V>(qp + (g * patterns_per_head + c * k + v) * 4);
                for (int part = 0; part < kParts; ++part) {
                  for (int m = 0; m < kTile; ++m) acc[g][m][part] += q * keys[m][part][v];
                }
              }
            }
          }
          for (int g = 0; g < kHeads; ++g) {
            float* dst = block_logits + (g0 + g) * block_size + m0 * 4;
            if constexpr (kSplit) {
              for (int m = 0; m < kTile; ++m) {
                float lanes[kLanes];
                for (int part = 0; part < kParts; ++part) {
                  store_vector(lanes + part * kPartLanes, acc[g][m][part]);
                }
                for (int t = 0; t < 4; ++t) {
                  const float* sums = lanes + 4 * t;  // the token's 4 partial sums
                  dst[m * 4 + t] = (sums[0] + sums[1]) + (sums[2] + sums[3]);
                }
              }
            } else if constexpr (kTile == 4) {
              store_vector(dst, sum_token_lanes(acc[g][0][0], acc[g][1][0], acc[g][2][0],
                                                acc[g][3][0]));
            } else {
              for (int m = 0; m < kTile; ++m) {
                const f32x16 sums = group_sum<4>(acc[g][m][0]);
                for (int t = 0; t < 4; ++t) dst[m * 4 + t] = sums[4 * t];
              }
            }
          }
        };
        if (kWideTile && key_chunks_per_row % 4 == 0) {
          for (int64_t m0 = 0; m0 < key_chunks_per_row; m0 += 4) {
            chunk_logits.template operator()<4>(m0);
          }
        } else {
          // kSplit: 1 chunk at a time when a chunk converts to 2 or 4 vectors (16 registers).
          constexpr int kNarrowTile = kSplit && k > 1 ? 1 : 2;
          for (int64_t m0 = 0; m0 < key_chunks_per_row; m0 += kNarrowTile) {
            chunk_logits.template operator()<kNarrowTile>(m0);
          }
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        std::memcpy(logits + (hh * group + g) * s.logit_stride + (lo - begin),
                    block_logits + g * block_size + (lo - b * block_size),
                    (hi - lo) * sizeof(float));
      }
    }
  }

  // ---- Soft-cap, ALiBi, then the max-subtracted exponentials, a vector V of tokens at a time
  // (the logits rows are padded to a multiple of 16).
  using I = IntsOf<V>;
  constexpr int kRowLanes = kPartLanes;
  const int64_t h0 = kv_head * group;
  constexpr float kInf = std::numeric_limits<float>::infinity();
  for (int64_t r = 0; r < rows; ++r) {
    float* row = logits + r * s.logit_stride;
    const float slope = p.alibi_slopes != nullptr ? p.alibi_slopes[h0 + r] : 0.0f;
    V row_max = splat<V>(-kInf);
    for (int64_t t = 0; t < n; t += kRowLanes) {
      const I valid = lane_index<I>() < static_cast<int32_t>(n - t);
      V v = load_vector<V>(row + t);
      if (p.logits_soft_cap > 0) v = p.logits_soft_cap * vtanh(v / p.logits_soft_cap);
      if (p.alibi_slopes != nullptr) {
        // position - seq_len + 1, for positions begin + t + lane
        const V rel = __builtin_convertvector(lane_index<I>(), V) +
                      static_cast<float>(begin + t - seq_len + 1);
        v += slope * rel;
      }
      v = valid ? v : splat<V>(-kInf);
      std::memcpy(row + t, &v, sizeof(v));
      row_max = v > row_max ? v : row_max;
    }
    float m = row_max[0];
    for (int i = 1; i < kRowLanes; ++i) m = std::max(m, row_max[i]);
    V row_sum{};
    for (int64_t t = 0; t < n; t += kRowLanes) {
      const I valid = lane_index<I>() < static_cast<int32_t>(n - t);
      const V e = zero_where_not(vexp(load_vector<V>(row + t) - m), valid);
      std::memcpy(row + t, &e, sizeof(e));
      row_sum += e;
    }
    float sum = 0.0f;
    for (int i = 0; i < kRowLanes; ++i) sum += row_sum[i];
    max_logit[r] = m;
    exp_sum[r] = sum;
  }

  // ---- Pass 2: values. Chunk m of a value tile, vector v, lane l is element e = m * chunk_elems
  // + l * k + v, i.e. head dim e / block_size and token e % block_size. The probability pattern
  // holds each lane's token probability; the pattern repeats every chunk when a chunk spans whole
  // rows, and every 2 chunks when a row spans two chunks (fp32, block size 32).
  const int64_t chunks_per_row = std::max<int64_t>(1, block_size / chunk_elems);
  const int64_t patterns = k * chunks_per_row;
  const int64_t value_chunks = head_size * block_size / chunk_elems;
  float* acc_mem = s.accumulators.data();
  const int64_t head_acc_floats = group_pad * value_chunks * kLanes;  // per KV head
  std::fill(acc_mem, acc_mem + heads * head_acc_floats, 0.0f);
  float* prob_patterns = s.prob_patterns.data();
  const int64_t pattern_block_stride = group_pad * kMaxPatterns * kLanes;
  i32x16 pattern_tokens[kMaxPatterns];  // token of each lane of each pattern, within a block
  for (int64_t pat = 0; pat < patterns; ++pat) {
    for (int l = 0; l < kLanes; ++l) {
      pattern_tokens[pat][l] = static_cast<int32_t>(((pat / k) * chunk_elems + pat % k + l * k) %
                                                    block_size);
    }
  }
  i32x16 keep[kValueBlocks][kMaxPatterns];  // lanes of valid tokens, per block and pattern
  bool partial[kValueBlocks];
  const cache_t* block_tiles[kValueBlocks];  // first KV head's tiles of this group of blocks
  const cache_t* next_block_tiles[kValueBlocks];  // and of the next group
  const cache_t* tiles[kValueBlocks];  // the current KV head's
  const cache_t* next_tiles[kValueBlocks];
  for (int64_t b0 = first_block; b0 < end_block; b0 += kValueBlocks) {
    const int64_t nb = std::min<int64_t>(kValueBlocks, end_block - b0);
    const int64_t next_nb = std::min<int64_t>(kValueBlocks, end_block - b0 - nb);
    for (int64_t i = 0; i < next_nb; ++i) {
      next_block_tiles[i] = value_base + block_table[b0 + nb + i] * p.value_block_stride;
    }
    for (int64_t i = 0; i < nb; ++i) {
      const int64_t block_start = (b0 + i) * block_size;
      block_tiles[i] = value_base + block_table[b0 + i] * p.value_block_stride;
      partial[i] = block_start < begin || block_start + block_size > end;
      if (!partial[i]) continue;
      for (int64_t pat = 0; pat < patterns; ++pat) {
        for (int l = 0; l < kLanes; ++l) {
          const int64_t pos = block_start - begin + pattern_tokens[pat][l];
          keep[i][pat][l] = pos >= 0 && pos < n ? -1 : 0;
        }
      }
    }
    for (int64_t hh = 0; hh < heads; ++hh) {
      // The tiles read next: the next KV head's of this group, or the first head's of the next.
      const int64_t prefetch_nb = hh + 1 < heads ? nb : next_nb;
      for (int64_t i = 0; i < prefetch_nb; ++i) {
        next_tiles[i] = hh + 1 < heads ? block_tiles[i] + (hh + 1) * p.value_head_stride
                                       : next_block_tiles[i];
      }
      for (int64_t i = 0; i < nb; ++i) {
        const int64_t block_start = (b0 + i) * block_size;
        tiles[i] = block_tiles[i] + hh * p.value_head_stride;
        float* patterns_out = prob_patterns + i * pattern_block_stride;
        for (int64_t pat = 0; pat < patterns; ++pat) {
          const i32x16 token = pattern_tokens[pat];
          for (int64_t g = 0; g < group_pad; ++g) {
            float* dst = patterns_out + (g * kMaxPatterns + pat) * kLanes;
            const float* row = logits + (hh * group + std::min(g, group - 1)) * s.logit_stride;
            if (g >= group) {
              std::fill(dst, dst + kLanes, 0.0f);
            } else if (!partial[i]) {
              if constexpr (kSplit) {
                permute_block_split(dst, row + (block_start - begin), token, block_size);
              } else {
                store_vector(dst, permute_block(row + (block_start - begin), token, block_size));
              }
            } else {
              for (int l = 0; l < kLanes; ++l) {
                const int64_t pos = block_start - begin + token[l];
                dst[l] = pos >= 0 && pos < n ? row[pos] : 0.0f;
              }
            }
          }
        }
      }
      float* head_acc = acc_mem + hh * head_acc_floats;
      for (int64_t g0 = 0; g0 < group_pad; g0 += kHeads) {
        // Value chunks [m0, m0 + kTile) of every block of the group, summed in registers. m0 is
        // a multiple of kTile, so chunk m0 + m uses the patterns of row chunk m % chunks_per_row.
        auto chunk_values = [&]<int kTile>(int64_t m0) {
          f32x16 acc[kHeads][kTile];
          for (int g = 0; g < kHeads; ++g) {
            for (int m = 0; m < kTile; ++m) {
              acc[g][m] =
                  load_vector<f32x16>(head_acc + ((g0 + g) * value_chunks + m0 + m) * kLanes);
            }
          }
          for (int64_t i = 0; i < nb; ++i) {
            // The same chunks of the tiles read next, one tile per block so that the requests
            // spread between the multiply-adds (2% faster than all at once, bf16 32 x 4096).
            if (g0 == 0 && i < prefetch_nb) {
              prefetch_lines<kToL1>(next_tiles[i] + m0 * chunk_elems, kTile * 64);
            }
            f32x16 values[kTile][k];
            for (int m = 0; m < kTile; ++m) {
              load_chunk(tiles[i] + (m0 + m) * chunk_elems, p.value_scale, values[m]);
            }
            if (partial[i]) {  // never let 0 * NaN from an unused slot into the sum
              for (int m = 0; m < kTile; ++m) {
                for (int v = 0; v < k; ++v) {
                  values[m][v] =
                      zero_where_not(values[m][v], keep[i][(m % chunks_per_row) * k + v]);
                }
              }
            }
            const float* pp = prob_patterns + i * pattern_block_stride + g0 * kMaxPatterns * kLanes;
            for (int v = 0; v < k; ++v) {
              for (int g = 0; g < kHeads; ++g) {
                const float* pattern = pp + (g * kMaxPatterns + v) * kLanes;
                const f32x16 even = load_vector<f32x16>(pattern);
                const f32x16 odd =
                    chunks_per_row > 1 ? load_vector<f32x16>(pattern + k * kLanes) : even;
                for (int m = 0; m < kTile; ++m) acc[g][m] += (m % 2 ? odd : even) * values[m][v];
              }
            }
          }
          for (int g = 0; g < kHeads; ++g) {
            for (int m = 0; m < kTile; ++m) {
              store_vector(head_acc + ((g0 + g) * value_chunks + m0 + m) * kLanes, acc[g][m]);
            }
          }
        };
        // The same, as 8-lane halves (kSplit), 2 chunks at a time. A separate loop rather than
        // chunk_values over kParts pieces (as chunk_logits is): that form made GCC spill more
        // vectors in the AVX-512 build (45 -> 67-116 zmm spill stores) and measured slower.
        auto chunk_values_split = [&](int64_t m0) {
          constexpr int kTile = 2;
          f32x8 acc[kHeads][kTile][2];
          for (int g = 0; g < kHeads; ++g) {
            for (int m = 0; m < kTile; ++m) {
              for (int h = 0; h < 2; ++h) {
                acc[g][m][h] = load_vector<f32x8>(
                    head_acc + ((g0 + g) * value_chunks + m0 + m) * kLanes + 8 * h);
              }
            }
          }
          // Here all at once: spread over the block loop (as in chunk_values), bf16 at 32 x 4096
          // measured 2-7% slower in this variant.
          if (g0 == 0) {
            for (int64_t i = 0; i < prefetch_nb; ++i) {
              prefetch_lines<kToL1>(next_tiles[i] + m0 * chunk_elems, kTile * 64);
            }
          }
          for (int64_t i = 0; i < nb; ++i) {
            f32x8 values[kTile][2][k];
            for (int m = 0; m < kTile; ++m) {
              for (int h = 0; h < 2; ++h) {
                load_chunk(tiles[i] + (m0 + m) * chunk_elems + h * chunk_elems / 2, p.value_scale,
                           values[m][h]);
              }
            }
            if (partial[i]) {  // never let 0 * NaN from an unused slot into the sum
              for (int m = 0; m < kTile; ++m) {
                for (int h = 0; h < 2; ++h) {
                  for (int v = 0; v < k; ++v) {
                    const auto* mask = reinterpret_cast<const char*>(
                                           &keep[i][(m % chunks_per_row) * k + v]) +
                                       h * sizeof(i32x8);
                    values[m][h][v] = bit_cast<f32x8>(bit_cast<i32x8>(values[m][h][v]) &
                                                      load_vector<i32x8>(mask));
                  }
                }
              }
            }
            const float* pp = prob_patterns + i * pattern_block_stride + g0 * kMaxPatterns * kLanes;
            for (int v = 0; v < k; ++v) {
              for (int g = 0; g < kHeads; ++g) {
                for (int h = 0; h < 2; ++h) {
                  const f32x8 even =
                      load_vector<f32x8>(pp + (g * kMaxPatterns + v) * kLanes + 8 * h);
                  const f32x8 odd =
                      chunks_per_row > 1
                          ? load_vector<f32x8>(pp + (g * kMaxPatterns + k + v) * kLanes + 8 * h)
                          : even;
                  acc[g][0][h] += even * values[0][h][v];
                  acc[g][1][h] += odd * values[1][h][v];
                }
              }
            }
          }
          for (int g = 0; g < kHeads; ++g) {
            for (int m = 0; m < kTile; ++m) {
              for (int h = 0; h < 2; ++h) {
                store_vector(head_acc + ((g0 + g) * value_chunks + m0 + m) * kLanes + 8 * h,
                             acc[g][m][h]);
              }
            }
          }
        };
        int64_t m0 = 0;
        if constexpr (kSplit) {
          for (; m0 < value_chunks; m0 += 2) chunk_values_split(m0);
        } else {
          if (kWideTile) {
            for (; m0 + 4 <= value_chunks; m0 += 4) chunk_values.template operator()<4>(m0);
          }
          for (; m0 < value_chunks; m0 += 2) chunk_values.template operator()<2>(m0);
        }
      }
    }
  }
  // Fold the lane-wise sums into head dims: a chunk covers rows_per_chunk rows of lanes_per_row
  // lanes each, or (chunks_per_row > 1) part of one row.
  const int64_t rows_per_chunk = std::max<int64_t>(1, chunk_elems / block_size);
  const int64_t lanes_per_row = kLanes / rows_per_chunk;
  std::fill(out, out + rows * head_size, 0.0f);
  for (int64_t hh = 0; hh < heads; ++hh) {
    for (int64_t g = 0; g < group; ++g) {
      const float* lanes = acc_mem + hh * head_acc_floats + g * value_chunks * kLanes;
      float* row_out = out + (hh * group + g) * head_size;
      for (int64_t m = 0; m < value_chunks; ++m) {
        const f32x16 sums = group_sum(load_vector<f32x16>(lanes + m * kLanes), lanes_per_row);
        const int64_t first_row = m / chunks_per_row * rows_per_chunk;
        for (int64_t r = 0; r < rows_per_chunk; ++r) {
          row_out[first_row + r] += sums[r * lanes_per_row];
        }
      }
      const float inv_sum = 1.0f / exp_sum[hh * group + g];
      for (int64_t d = 0; d < head_size; ++d) row_out[d] *= inv_sum;
    }
  }
}

inline int64_t kv_head_runs(const AttentionParams& p) {
  return (p.num_kv_heads + p.unit_kv_heads - 1) / p.unit_kv_heads;
}

inline int64_t unit_count(const AttentionParams& p) {
  return p.num_seqs * kv_head_runs(p) * p.num_partitions;
}

// Runs units of (sequence, run of KV heads, partition), numbered in that nesting order, taking
// the next unnumbered one from `next_unit` until none is left. Taking units one at a time
// balances sequences of different lengths (and threads slowed by other work on the machine).
template <typename scalar_t, typename cache_t, bool kSplit>
inline void run_units(const AttentionParams& p, std::atomic<int64_t>& next_unit) {
  const int64_t group = p.num_heads / p.num_kv_heads;
  const int64_t runs = kv_head_runs(p);
  const int64_t units = unit_count(p);
  Scratch s;
  s.resize(p.unit_kv_heads, group, p.head_size, p.block_size, p.max_unit_tokens);
  std::vector<float> result(p.unit_kv_heads * group * p.head_size);
  std::vector<float> max_logit(p.unit_kv_heads * group);
  std::vector<float> exp_sum(p.unit_kv_heads * group);

  for (int64_t u = next_unit.fetch_add(1, std::memory_order_relaxed); u < units;
       u = next_unit.fetch_add(1, std::memory_order_relaxed)) {
    const int64_t partition = u % p.num_partitions;
    const int64_t kv_head = (u / p.num_partitions) % runs * p.unit_kv_heads;
    const int64_t heads = std::min(p.unit_kv_heads, p.num_kv_heads - kv_head);
    const int64_t rows = heads * group;
    const int64_t seq = u / (p.num_partitions * runs);
    const int64_t seq_len = p.seq_lens[seq];
    int64_t begin = p.sliding_window > 0 ? std::max<int64_t>(0, seq_len - p.sliding_window) : 0;
    int64_t end = seq_len;
    begin = std::max(begin, partition * p.partition_size);
    end = std::min(end, (partition + 1) * p.partition_size);
    if (begin >= end) {
      std::fill(result.begin(), result.end(), 0.0f);
      std::fill(max_logit.begin(), max_logit.end(), -std::numeric_limits<float>::infinity());
      std::fill(exp_sum.begin(), exp_sum.end(), 0.0f);
    } else {
      attend_tokens<scalar_t, cache_t, kSplit>(p, s, seq, kv_head, heads, begin, end,
                                               result.data(), max_logit.data(), exp_sum.data());
    }
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t row = (seq * p.num_heads + kv_head * group + r) * p.num_partitions + partition;
      scalar_t* dst = static_cast<scalar_t*>(p.out) + row * p.head_size;
      for (int64_t d = 0; d < p.head_size; ++d) {
        dst[d] = static_cast<scalar_t>(result[r * p.head_size + d]);
      }
      if (p.max_logits != nullptr) {
        p.max_logits[row] = max_logit[r];
        p.exp_sums[row] = exp_sum[r];
      }
    }
  }
}

// One compiled copy of the kernels per instruction set; `flatten` inlines every helper into it,
// so each copy is compiled for its own target.
#define PA_DEFINE_VARIANT(name, split, attributes)                                            \
  template <typename scalar_t, typename cache_t>                                              \
  attributes void name(const AttentionParams& p, std::atomic<int64_t>& next_unit) {         \
    run_units<scalar_t, cache_t, split>(p, next_unit);                                        \
  }

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
PA_DEFINE_VARIANT(run_units_avx512, false,
                  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c,bmi2"),
                                 flatten)))
PA_DEFINE_VARIANT(run_units_avx2, true, __attribute__((target("avx2,fma,f16c,bmi2"), flatten)))
#define PA_HAVE_X86_VARIANTS 1
#endif
PA_DEFINE_VARIANT(run_units_baseline, false, __attribute__((flatten)))
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
  const int64_t units = unit_count(p);
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), units);
  const Isa isa = selected_isa();
  std::atomic<int64_t> next_unit{0};
  at::parallel_for(0, workers, 1, [&](int64_t begin, int64_t end) {
    for (int64_t worker = begin; worker < end; ++worker) {
#ifdef PA_HAVE_X86_VARIANTS
      if (isa == Isa::kAvx512) {
        run_units_avx512<scalar_t, cache_t>(p, next_unit);
        continue;
      }
      if (isa == Isa::kAvx2) {
        run_units_avx2<scalar_t, cache_t>(p, next_unit);
        continue;
      }
#endif
      run_units_baseline<scalar_t, cache_t>(p, next_unit);
    }
  });
}

// The query dtypes the kernels support (the checks reject others first).
#define PA_DISPATCH_QUERY_TYPES(TYPE, NAME, ...)             \
  AT_DISPATCH_SWITCH(TYPE, NAME,                            \
                     AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__) \
                     AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__)  \
                     AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__))

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
  p.max_unit_tokens = std::min(dims.max_seq_len, p.partition_size);
  if (sliding_window > 0) p.max_unit_tokens = std::min(p.max_unit_tokens, sliding_window);
  // Up to kMaxUnitKvHeads KV heads per unit (see the top of the file), fewer while that would
  // leave fewer than 4 units per thread to share out.
  p.unit_kv_heads = std::max<int64_t>(1, std::min(kMaxUnitKvHeads, dims.num_kv_heads));
  while (p.unit_kv_heads > 1 && unit_count(p) < 4 * at::get_num_threads()) p.unit_kv_heads /= 2;
  if (dims.num_seqs == 0 || dims.num_heads == 0) return;

  p.key_scale = 1.0f;
  p.value_scale = 1.0f;
  if (dims.cache_dtype != CacheDtype::kAuto) {
    p.key_scale = k_scale.item<float>();
    p.value_scale = v_scale.item<float>();
  }
  PA_DISPATCH_QUERY_TYPES(query.scalar_type(), "paged_attention_cpu", [&] {
    switch (dims.cache_dtype) {
      case CacheDtype::kAuto:
        run_all_units<scalar_t, scalar_t>(p);
        break;
      case CacheDtype::kFp8E4M3:
        run_all_units<scalar_t, c10::Float8_e4m3fn>(p);
        break;
      case CacheDtype::kFp8E5M2:
        run_all_units<scalar_t, c10::Float8_e5m2>(p);
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
  for (const auto& [scratch, name] :
       {std::pair<const at::Tensor&, const char*>{exp_sums, "exp_sums"},
        {max_logits, "max_logits"},
        {tmp_out, "tmp_out"}}) {
    check_no_overlap(scratch, name, out, "out");
    check_no_overlap(scratch, name, key_cache, "key_cache");
    check_no_overlap(scratch, name, value_cache, "value_cache");
    check_no_overlap(scratch, name, block_tables, "block_tables");
    check_no_overlap(scratch, name, seq_lens, "seq_lens");
    if (alibi_slopes.has_value()) check_no_overlap(scratch, name, *alibi_slopes, "alibi_slopes");
  }
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
