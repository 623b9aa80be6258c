// CPU paged attention for long runs of query rows (prompts, prompt chunks): the varlen op's
// kernel for sequences with more query rows than the decode kernel serves. Free of torch headers:
// the float32 matrix product comes in as a function pointer (attention.cpp passes torch's), and
// so do the bf16 ones (bf16_dot.h, amx.h; chosen in variants.h).
//
// Work unit: one (sequence, KV head, tile of up to kPrefillRows query rows), the rows being
// (query position, query head of the KV head) pairs, so a KV head's keys and values serve its
// whole GQA group at once. A unit walks the keys its rows attend in tiles of kPrefillTokens
// tokens, FlashAttention's way, in named steps (attend_prefill_unit): stage the rows and the
// query; per tile, gather its keys and values from their blocks into contiguous scratch, the
// scores (one matrix product), mask / soft-cap / ALiBi and the online-softmax update (running max
// and sum per row, fp32, rescaling what the earlier tiles accumulated), the value product (a
// second matrix product adds the tile's probability-weighted values); then store the rows. Only
// positions the rows attend are gathered, so no empty cache slot is ever read.
//
// Layouts in scratch (row-major), with rows_pad = rows rounded up to 16. float32 products (any
// dtype; fp8 dequantised as it is gathered):
//   query_t  [head_size][rows_pad]  query rows times scale, transposed (padding rows zero)
//   keys     [tokens][head_size]    so that logits_t = keys x query_t is [tokens][rows_pad]
//   values_t [v_head_size][tokens]  so that out_t += values_t x probs_t is [v_head_size][rows_pad]
// bf16 products (bf16 query and cache; bf16_dot.h's operand form, sums in float32): keys and
// values_t hold the cache's bf16 values as they are, the query rows and the probabilities are
// packed into pairs along the products' depth (query_pairs, prob_pairs), and the scale multiplies
// the float32 logits. The probabilities enter the value product as two bf16 parts (high and
// what it leaves), so they keep about 16 significant bits where one bf16 rounding (as
// FlashAttention does with 16-bit inputs) kept 8.
// Every per-row quantity (running max and sum, ALiBi slope, position) is a vector across rows.
#pragma once

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "cpu/bf16_dot.h"
#include "cpu/decode_attention.h"
#include "cpu/simd.h"

namespace paged_attention::cpu {

// c = a x b (+ c if accumulate) for row-major float32 a [m][k], b [k][n], c [m][n] with leading
// dimensions lda, ldb, ldc.
using GemmF32 = void (*)(int64_t m, int64_t n, int64_t k, int64_t lda, int64_t ldb, int64_t ldc,
                         bool accumulate, const float* a, const float* b, float* c);

constexpr int64_t kPrefillRows = 256;  // query rows per unit, at most (or one position's group)
constexpr int64_t kPrefillTokens = 256;  // key/value tokens per tile

// Query rows [first, first + count) of sequence `seq` (indices among its q_len rows), for the
// query heads of one KV head.
struct PrefillUnit {
  int64_t seq;
  int64_t kv_head;
  int64_t first;
  int64_t count;
  int64_t work;  // (query rows) x (tokens they span): units run heaviest first
};

// The units of every sequence with more than p.max_query_len query rows (the decode kernel takes
// the others), heaviest first, so that the last units to start are short ones.
inline std::vector<PrefillUnit> plan_prefill_units(const AttentionParams& p) {
  const int64_t queries_per_kv = p.num_heads / p.num_kv_heads;
  const int64_t positions_per_unit = std::max<int64_t>(1, kPrefillRows / queries_per_kv);
  std::vector<PrefillUnit> units;
  for (int64_t seq = 0; seq < p.num_seqs; ++seq) {
    const int64_t q_len = query_len(p, seq);
    if (q_len <= p.max_query_len) continue;
    const int64_t seq_len = p.seq_lens[seq];
    for (int64_t first = 0; first < q_len; first += positions_per_unit) {
      const int64_t count = std::min(positions_per_unit, q_len - first);
      const int64_t first_position = seq_len - q_len + first;
      // From the first row's window and chunk start to the last row.
      const int64_t span = first_position + count - first_attended(p, first_position);
      for (int64_t kv_head = 0; kv_head < p.num_kv_heads; ++kv_head) {
        units.push_back({seq, kv_head, first, count, count * span});
      }
    }
  }
  std::stable_sort(units.begin(), units.end(),
                   [](const PrefillUnit& a, const PrefillUnit& b) { return a.work > b.work; });
  return units;
}

// The matrix products of a unit: float32 products from torch (always), and bf16 products with
// float32 sums (bf16_dot.h, amx.h) when the query and cache are bf16 and a bf16 variant is chosen
// (variants.h); null bf16 means float32 products throughout. release_bf16 (nullable) ends a
// thread's run of bf16 products (AMX: releases the tile state).
struct PrefillProducts {
  GemmF32 f32;
  Bf16MatmulFn bf16;
  void (*release_bf16)();
};

// bf16 products apply to these element types: the query and cache rows are copied into the
// products' operands unconverted.
template <typename scalar_t, typename cache_t>
constexpr bool kBf16Operands =
    std::is_same_v<scalar_t, c10::BFloat16> && std::is_same_v<cache_t, c10::BFloat16>;

// Per-thread buffers for units of up to max_rows rows. The float32 products use query_t, keys and
// values_t; the bf16 ones the *_bf16 buffers, whose head dimension is padded to head_pad (a
// multiple of the products' depth, 32; zeros past head_size) and whose values rows (v_head_size)
// to a multiple of 16 (value_rows).
struct PrefillScratch {
  AlignedFloats query_t;
  AlignedFloats keys;
  AlignedFloats values_t;
  AlignedArray<uint16_t> query_pairs;  // [head_pad / 2][rows_pad][2]: query rows, unscaled
  AlignedArray<uint16_t> keys_bf16;    // [kPrefillTokens][head_pad]
  AlignedArray<uint16_t> values_t_bf16;  // [value_rows][kPrefillTokens]
  AlignedArray<uint16_t> prob_pairs;   // [kPrefillTokens / 2][rows_pad][2]: bf16 high parts
  AlignedArray<uint16_t> prob_pairs_low;  // and what they leave, also bf16
  AlignedFloats logits_t;  // logits, then probabilities
  AlignedFloats out_t;     // [value_rows][rows_pad]
  AlignedArray<uint16_t> out_bits;  // bf16 outputs: [v_head_size][rows_pad], rounded
  AlignedFloats row_max;
  AlignedFloats row_sum;
  AlignedFloats row_slope;
  AlignedFloats row_position;  // float: positions fit exactly below 2^24
  AlignedFloats row_chunk_start;  // the first position of the row's chunk (with chunks)
  AlignedFloats row_rescale;
  int64_t head_pad = 0;
  int64_t value_rows = 0;

  void resize(int64_t head_size, int64_t v_head_size, int64_t max_rows, bool bf16) {
    const int64_t rows_pad = round_up(max_rows, kLanes);
    head_pad = round_up(head_size, kBf16MatmulDepth);
    value_rows = round_up(v_head_size, kBf16MatmulRows);
    if (bf16) {
      query_pairs.resize(head_pad * rows_pad);
      keys_bf16.resize(kPrefillTokens * head_pad);
      values_t_bf16.resize(value_rows * kPrefillTokens);
      prob_pairs.resize(kPrefillTokens * rows_pad);
      prob_pairs_low.resize(kPrefillTokens * rows_pad);
    } else {
      query_t.resize(head_size * rows_pad);
      keys.resize(kPrefillTokens * head_size);
      values_t.resize(v_head_size * kPrefillTokens);
    }
    logits_t.resize(kPrefillTokens * rows_pad);
    out_t.resize(value_rows * rows_pad);
    out_bits.resize(v_head_size * rows_pad);
    for (AlignedFloats* row :
         {&row_max, &row_sum, &row_slope, &row_position, &row_chunk_start, &row_rescale}) {
      row->resize(rows_pad);
    }
  }
};

// n cache elements -> the products' operand type: float32 (converted, fp8 times its scale), or
// bf16 bits copied from a bf16 cache (below).
template <typename cache_t>
inline void load_operand_row(const cache_t* src, int64_t n, float scale, float* dst) {
  convert_row(src, n, scale, dst);
}

// n bf16 cache elements -> bf16 operand bits, with a fixed-size copy for a whole row of a block
// (8, 16 or 32 tokens) so that the common case is one or two vector moves, not a call.
inline void load_operand_row(const c10::BFloat16* src, int64_t n, float, uint16_t* dst) {
  switch (n) {
    case 8:
      std::memcpy(dst, src, 16);
      return;
    case 16:
      std::memcpy(dst, src, 32);
      return;
    case 32:
      std::memcpy(dst, src, 64);
      return;
    default:
      std::memcpy(dst, src, n * sizeof(uint16_t));
  }
}

// 4 dim-rows x 4 tokens of a bf16 key tile (16 bytes each; dim-row r of token t at
// src + r * row_stride + 8 * t) -> the 4 tokens' 64-byte runs of head dims (token t's at
// dst + t * ldk): four line loads, a 4 x 4 transpose of 16-byte lanes, four line stores.
inline void copy_key_square(const c10::BFloat16* src, int64_t row_stride, uint16_t* dst,
                            int64_t ldk) {
  using u64x8 = uint64_t __attribute__((vector_size(64)));
  const u64x8 a = load_vector<u64x8>(src);
  const u64x8 b = load_vector<u64x8>(src + row_stride);
  const u64x8 c = load_vector<u64x8>(src + 2 * row_stride);
  const u64x8 d = load_vector<u64x8>(src + 3 * row_stride);
  const u64x8 ab_low = __builtin_shufflevector(a, b, 0, 1, 8, 9, 2, 3, 10, 11);
  const u64x8 ab_high = __builtin_shufflevector(a, b, 4, 5, 12, 13, 6, 7, 14, 15);
  const u64x8 cd_low = __builtin_shufflevector(c, d, 0, 1, 8, 9, 2, 3, 10, 11);
  const u64x8 cd_high = __builtin_shufflevector(c, d, 4, 5, 12, 13, 6, 7, 14, 15);
  store_vector(dst, __builtin_shufflevector(ab_low, cd_low, 0, 1, 2, 3, 8, 9, 10, 11));
  store_vector(dst + ldk, __builtin_shufflevector(ab_low, cd_low, 4, 5, 6, 7, 12, 13, 14, 15));
  store_vector(dst + 2 * ldk, __builtin_shufflevector(ab_high, cd_high, 0, 1, 2, 3, 8, 9, 10, 11));
  store_vector(dst + 3 * ldk,
               __builtin_shufflevector(ab_high, cd_high, 4, 5, 6, 7, 12, 13, 14, 15));
}

// Blocks ahead of the one being gathered whose key and value tiles the gather requests (into L2).
constexpr int64_t kGatherAheadBlocks = 8;

// Gathers tokens [t0, t1) of one KV head into keys [t1 - t0][ldk] and values_t
// [v_head_size][kPrefillTokens], as the products' operand type. The blocks are scattered, so the
// hardware prefetchers cannot run ahead across them: while it gathers a block, it requests the
// tiles of the block kGatherAheadBlocks further on (up to the unit's last token, kv_end), a few
// lines per dim-row of keys copied rather than all at once (a burst of requests stalls once the
// line-fill buffers are full).
template <typename cache_t, typename operand_t>
inline void gather_tile(const AttentionParams& p, const int32_t* block_table,
                        const cache_t* key_base, const cache_t* value_base, int64_t t0,
                        int64_t t1, int64_t kv_end, int64_t ldk, operand_t* keys,
                        operand_t* values_t) {
  constexpr int64_t x = 16 / sizeof(cache_t);
  // bf16 cache values copied as they are (bf16 products), not converted
  constexpr bool kCopied =
      std::is_same_v<cache_t, c10::BFloat16> && std::is_same_v<operand_t, uint16_t>;
  const int64_t head_size = p.head_size;
  const int64_t block_size = p.block_size;
  const int64_t dim_rows = head_size / x;
  const int64_t tile_lines = head_size * block_size * static_cast<int64_t>(sizeof(cache_t)) / 64;
  const int64_t value_tile_lines =
      p.v_head_size * block_size * static_cast<int64_t>(sizeof(cache_t)) / 64;
  const int64_t last_block = (kv_end - 1) / block_size;
  for (int64_t j = t0; j < t1;) {
    const int64_t b = j / block_size;
    const int64_t block = block_table[b];
    const int64_t offset = j % block_size;
    const int64_t run = std::min(block_size - offset, t1 - j);  // tokens of this block
    const char* ahead_keys = nullptr;
    const char* ahead_values = nullptr;
    if (b + kGatherAheadBlocks <= last_block) {
      const int64_t ahead = block_table[b + kGatherAheadBlocks];
      ahead_keys = reinterpret_cast<const char*>(key_base + ahead * p.key_block_stride);
      ahead_values = reinterpret_cast<const char*>(value_base + ahead * p.value_block_stride);
    }
    const cache_t* key_tile = key_base + block * p.key_block_stride;
    operand_t* block_keys = keys + (j - t0) * ldk;
    for (int64_t c = 0, line = 0; c < dim_rows;) {  // in storage order, dim-rows c..c + rows - 1
      const int64_t rows = kCopied && c + 4 <= dim_rows ? 4 : 1;
      if (ahead_keys != nullptr) {  // those dim-rows' share of the next requests
        for (const int64_t end = (c + rows) * tile_lines / dim_rows; line < end; ++line) {
          __builtin_prefetch(ahead_keys + 64 * line, 0, kToL2);
          if (line < value_tile_lines) __builtin_prefetch(ahead_values + 64 * line, 0, kToL2);
        }
      }
      int64_t t = 0;
      if constexpr (kCopied) {
        if (rows == 4) {  // 4 tokens x 4 dim-rows at a time: one line read and written per token
          for (; t + 4 <= run; t += 4) {
            copy_key_square(key_tile + (c * block_size + offset + t) * x, block_size * x,
                            block_keys + t * ldk + c * x, ldk);
          }
        }
      }
      for (; t < run; ++t) {
        for (int64_t r = c; r < c + rows; ++r) {
          load_operand_row(key_tile + (r * block_size + offset + t) * x, x, p.key_scale,
                           block_keys + t * ldk + r * x);
        }
      }
      c += rows;
    }
    // The value tile's lines past the key tile's (values of a larger head size than the keys').
    for (int64_t line = tile_lines; ahead_values != nullptr && line < value_tile_lines; ++line) {
      __builtin_prefetch(ahead_values + 64 * line, 0, kToL2);
    }
    const cache_t* value_tile = value_base + block * p.value_block_stride;
    for (int64_t d = 0; d < p.v_head_size; ++d) {
      load_operand_row(value_tile + d * block_size + offset, run, p.value_scale,
                       values_t + d * kPrefillTokens + (j - t0));
    }
    j += run;
  }
}

// Everything attend_prefill_unit's steps share about one unit.
struct PrefillRows {
  int64_t seq;
  int64_t kv_head;
  int64_t queries_per_kv;
  int64_t rows;      // unit.count x queries_per_kv
  int64_t rows_pad;  // rows rounded up to 16
  int64_t first_position;
  int64_t last_position;

  // Query head and query row (token index of query/out) of unit row m < rows.
  int64_t head(int64_t m) const { return kv_head * queries_per_kv + m % queries_per_kv; }
};

// Step: the rows' positions, chunk starts and ALiBi slopes (padding rows repeat the last row's),
// and the running max, sum and output of the online softmax, empty.
inline void stage_rows(const AttentionParams& p, const PrefillRows& r, PrefillScratch& s) {
  const int64_t chunk = p.attention_chunk_size;
  for (int64_t m = 0; m < r.rows_pad; ++m) {
    const int64_t real = std::min(m, r.rows - 1);
    const int64_t position = r.first_position + real / r.queries_per_kv;
    s.row_position.data()[m] = static_cast<float>(position);
    if (chunk > 0) s.row_chunk_start.data()[m] = static_cast<float>(position - position % chunk);
    s.row_slope.data()[m] = p.alibi_slopes != nullptr ? p.alibi_slopes[r.head(real)] : 0.0f;
  }
  std::fill(s.row_max.data(), s.row_max.data() + r.rows_pad,
            -std::numeric_limits<float>::infinity());
  std::fill(s.row_sum.data(), s.row_sum.data() + r.rows_pad, 0.0f);
  std::fill(s.out_t.data(), s.out_t.data() + s.value_rows * r.rows_pad, 0.0f);
}

// Step: stage the query rows as the B operand of the score product. float32: query_t
// [head_size][rows_pad], times the scale; bf16: pairs of head dims [head_pad / 2][rows_pad][2],
// unscaled (the scale multiplies the float32 logits), zero past head_size and past the rows.
template <typename scalar_t, bool kBf16>
inline void stage_query(const AttentionParams& p, const PrefillRows& r, int64_t first_row,
                        PrefillScratch& s) {
  const int64_t head_size = p.head_size;
  if constexpr (kBf16) {
    // 16 rows at a time, so that each pair row's 16 words are written together (one line).
    uint32_t* pairs = reinterpret_cast<uint32_t*>(s.query_pairs.data());
    std::fill(pairs, pairs + s.head_pad / 2 * r.rows_pad, 0u);
    for (int64_t m0 = 0; m0 < r.rows; m0 += kLanes) {
      const int64_t block_rows = std::min<int64_t>(kLanes, r.rows - m0);
      const scalar_t* q[kLanes];
      for (int64_t i = 0; i < block_rows; ++i) {
        const int64_t m = m0 + i;
        q[i] = static_cast<const scalar_t*>(p.query) +
               (first_row + m / r.queries_per_kv) * p.query_row_stride +
               r.head(m) * p.query_head_stride;
      }
      for (int64_t d = 0; d < head_size; d += 2) {
        uint32_t* dst = pairs + d / 2 * r.rows_pad + m0;
        for (int64_t i = 0; i < block_rows; ++i) std::memcpy(dst + i, q[i] + d, sizeof(uint32_t));
      }
    }
  } else {
    float* query_t = s.query_t.data();
    for (int64_t m = 0; m < r.rows_pad; ++m) {
      const int64_t real = std::min(m, r.rows - 1);
      const scalar_t* q = static_cast<const scalar_t*>(p.query) +
                          (first_row + real / r.queries_per_kv) * p.query_row_stride +
                          r.head(real) * p.query_head_stride;
      for (int64_t d = 0; d < head_size; ++d) {
        query_t[d * r.rows_pad + m] = m < r.rows ? static_cast<float>(q[d]) * p.scale : 0.0f;
      }
    }
  }
}

// Step: mask, soft-cap and ALiBi over one tile's logits_t [tokens][rows_pad] (after
// logit_scale), and each row's max: row_max becomes the larger of the tile's and the earlier
// tiles', and row_rescale = exp(old max - new max) rescales what the earlier tiles accumulated
// (nothing yet: 0). A vector V of rows at a time. Returns whether it rewrote the logits; a tile
// with nothing to apply but the scale is only read (the exponentials apply the scale themselves).
template <typename V>
inline bool mask_and_max(const AttentionParams& p, const PrefillRows& r, int64_t t0,
                         int64_t tokens, float logit_scale, PrefillScratch& s) {
  using I = IntsOf<V>;
  constexpr int64_t kVectorLanes = sizeof(V) / sizeof(float);
  constexpr float kInf = std::numeric_limits<float>::infinity();
  const int64_t window = p.sliding_window;
  const int64_t chunk = p.attention_chunk_size;
  const int64_t t1 = t0 + tokens;
  // Tokens from here on lie in the chunk of every row (the last row's chunk starts last).
  const int64_t last_chunk_start = chunk > 0 ? r.last_position - r.last_position % chunk : 0;
  // Every row attends every token of the tile: no mask to apply.
  const bool whole = t1 - 1 <= r.first_position &&
                     (window == 0 || t0 > r.last_position - window) && t0 >= last_chunk_start;
  const bool rewrite = !whole || p.logits_soft_cap > 0 || p.alibi_slopes != nullptr;
  float* logits_t = s.logits_t.data();
  for (int64_t m0 = 0; m0 < r.rows_pad; m0 += kVectorLanes) {
    V tile_max = splat<V>(-kInf);
    if (rewrite) {
      const V position = load_vector<V>(s.row_position.data() + m0);
      const V chunk_start = chunk > 0 ? load_vector<V>(s.row_chunk_start.data() + m0) : V{};
      const V slope = load_vector<V>(s.row_slope.data() + m0);
      for (int64_t t = 0; t < tokens; ++t) {
        float* row = logits_t + t * r.rows_pad + m0;
        V v = load_vector<V>(row) * logit_scale;
        if (p.logits_soft_cap > 0) v = p.logits_soft_cap * vtanh(v / p.logits_soft_cap);
        const float key_position = static_cast<float>(t0 + t);
        if (p.alibi_slopes != nullptr) v += slope * (key_position - position);
        if (!whole) {
          const V key = splat<V>(key_position);
          I visible = key <= position;
          if (window > 0) visible &= key > position - static_cast<float>(window);
          if (chunk > 0) visible &= key >= chunk_start;
          v = visible ? v : splat<V>(-kInf);
        }
        store_vector(row, v);
        tile_max = v > tile_max ? v : tile_max;
      }
    } else {
      for (int64_t t = 0; t < tokens; ++t) {
        const V v = load_vector<V>(logits_t + t * r.rows_pad + m0) * logit_scale;
        tile_max = v > tile_max ? v : tile_max;
      }
    }
    const V old_max = load_vector<V>(s.row_max.data() + m0);
    const V new_max = tile_max > old_max ? tile_max : old_max;
    store_vector(s.row_max.data() + m0, new_max);
    store_vector(s.row_rescale.data() + m0,
                 zero_where_not(vexp(old_max - new_max), old_max != splat<V>(-kInf)));
  }
  return rewrite;
}

// exp(logit * factor - max) of one row-vector of logits; masked logits (-inf) give 0.
template <typename V>
inline V probability(const float* logit, float factor, V max) {
  constexpr float kInf = std::numeric_limits<float>::infinity();
  const V v = load_vector<V>(logit) * factor;
  return zero_where_not(vexp(v - max), v != splat<V>(-kInf));
}

// Step: the online-softmax update. Each logit of the tile becomes exp(logit x factor - max), the
// row sums are rescaled and the tile's added. float32 products: the probabilities replace the
// logits in logits_t. bf16 products: they go to the value product's operands instead, pairs of
// tokens [tokens_pad / 2][rows_pad][2] (zero past `tokens`), each probability as two bf16 parts
// (high, and the rounding of what it leaves) so that the value product, run once with each, sums
// them to about 16 significant bits (one bf16 rounding moved outputs by up to ~2^-9 of a value,
// as much again as the output's own bf16 rounding).
template <typename V, bool kBf16>
inline void exponentials(const PrefillRows& r, int64_t tokens, int64_t tokens_pad, float factor,
                         PrefillScratch& s) {
  using U = typename WordsOf<V>::type;
  constexpr int64_t kVectorLanes = sizeof(V) / sizeof(float);
  float* logits_t = s.logits_t.data();
  for (int64_t m0 = 0; m0 < r.rows_pad; m0 += kVectorLanes) {
    const V max = load_vector<V>(s.row_max.data() + m0);
    V tile_sum{};
    if constexpr (kBf16) {
      // pair row t / 2 of rows m0.. is 2 * kVectorLanes bf16 values at prob_pairs + t * rows_pad
      const auto pack = [&](V first, V second, int64_t t) {
        const U first_high = round_computed_to_bf16_high(bit_cast<U>(first));
        const U second_high = round_computed_to_bf16_high(bit_cast<U>(second));
        const U first_low =
            round_computed_to_bf16_high(bit_cast<U>(first - bit_cast<V>(first_high)));
        const U second_low =
            round_computed_to_bf16_high(bit_cast<U>(second - bit_cast<V>(second_high)));
        const int64_t at = t * r.rows_pad + 2 * m0;
        store_vector(s.prob_pairs.data() + at, (first_high >> 16) | second_high);
        store_vector(s.prob_pairs_low.data() + at, (first_low >> 16) | second_low);
      };
      int64_t t = 0;
      for (; t + 1 < tokens; t += 2) {
        const V first = probability<V>(logits_t + t * r.rows_pad + m0, factor, max);
        const V second = probability<V>(logits_t + (t + 1) * r.rows_pad + m0, factor, max);
        tile_sum += first + second;
        pack(first, second, t);
      }
      if (t < tokens) {
        const V first = probability<V>(logits_t + t * r.rows_pad + m0, factor, max);
        tile_sum += first;
        pack(first, V{}, t);
        t += 2;
      }
      for (; t < tokens_pad; t += 2) pack(V{}, V{}, t);
    } else {
      for (int64_t t = 0; t < tokens; ++t) {
        float* row = logits_t + t * r.rows_pad + m0;
        const V e = probability<V>(row, factor, max);
        store_vector(row, e);
        tile_sum += e;
      }
    }
    float* sum = s.row_sum.data() + m0;
    store_vector(sum, load_vector<V>(sum) * load_vector<V>(s.row_rescale.data() + m0) + tile_sum);
  }
}

// Step: out_t rows times each row's rescale (after the first tile).
template <typename V>
inline void rescale_output(const PrefillRows& r, int64_t head_rows, PrefillScratch& s) {
  constexpr int64_t kVectorLanes = sizeof(V) / sizeof(float);
  for (int64_t d = 0; d < head_rows; ++d) {
    for (int64_t m0 = 0; m0 < r.rows_pad; m0 += kVectorLanes) {
      float* acc = s.out_t.data() + d * r.rows_pad + m0;
      store_vector(acc, load_vector<V>(acc) * load_vector<V>(s.row_rescale.data() + m0));
    }
  }
}

// Step: out = out_t / (sum + exp(sink - max)), a sink joining the denominator only; written to
// the unit's rows of out.
template <typename scalar_t>
inline void store_rows(const AttentionParams& p, const PrefillRows& r, int64_t first_row,
                       PrefillScratch& s) {
  constexpr float kInf = std::numeric_limits<float>::infinity();
  float* row_max = s.row_max.data();
  float* row_rescale = s.row_rescale.data();
  for (int64_t m = 0; m < r.rows; ++m) {
    const float sink = p.sinks != nullptr ? p.sinks[r.head(m)] : -kInf;
    const float top = std::max(row_max[m], sink);
    const float kept = std::exp(row_max[m] - top);
    const float denominator =
        s.row_sum.data()[m] * kept + (p.sinks != nullptr ? std::exp(sink - top) : 0.0f);
    row_rescale[m] = kept / denominator;
  }
  const auto row_out = [&](int64_t m) {
    const int64_t token = first_row + m / r.queries_per_kv;
    return static_cast<scalar_t*>(p.out) + (token * p.num_heads + r.head(m)) * p.v_head_size;
  };
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
    // Scaled and rounded to bf16 a vector of rows at a time, then moved to the rows as bits.
    uint16_t* bits = s.out_bits.data();
    for (int64_t d = 0; d < p.v_head_size; ++d) {
      for (int64_t m0 = 0; m0 < r.rows_pad; m0 += kLanes) {
        const f32x16 v = load_vector<f32x16>(s.out_t.data() + d * r.rows_pad + m0) *
                         load_vector<f32x16>(row_rescale + m0);
        const u32x16 rounded = round_computed_to_bf16_high(bit_cast<u32x16>(v)) >> 16;
        store_vector(bits + d * r.rows_pad + m0, __builtin_convertvector(rounded, u16x16));
      }
    }
    for (int64_t m = 0; m < r.rows; ++m) {
      uint16_t* dst = reinterpret_cast<uint16_t*>(row_out(m));
      for (int64_t d = 0; d < p.v_head_size; ++d) dst[d] = bits[d * r.rows_pad + m];
    }
  } else {
    for (int64_t m = 0; m < r.rows; ++m) {
      scalar_t* dst = row_out(m);
      for (int64_t d = 0; d < p.v_head_size; ++d) {
        dst[d] = static_cast<scalar_t>(s.out_t.data()[d * r.rows_pad + m] * row_rescale[m]);
      }
    }
  }
}

// One unit: see the top of the file. V is the vector type of the row loops (16 lanes, or 8 in
// the AVX2 variant); kBf16 selects the bf16 products (only for bf16 query and cache).
template <typename scalar_t, typename cache_t, typename V, bool kBf16>
inline void attend_prefill_unit(const AttentionParams& p, const PrefillProducts& products,
                                PrefillScratch& s, const PrefillUnit& unit) {
  const int64_t head_size = p.head_size;
  const int64_t v_head_size = p.v_head_size;
  const int64_t q_len = query_len(p, unit.seq);
  PrefillRows r;
  r.seq = unit.seq;
  r.kv_head = unit.kv_head;
  r.queries_per_kv = p.num_heads / p.num_kv_heads;
  r.rows = unit.count * r.queries_per_kv;
  r.rows_pad = round_up(r.rows, kLanes);
  r.first_position = p.seq_lens[unit.seq] - q_len + unit.first;
  r.last_position = r.first_position + unit.count - 1;
  const int64_t first_row = first_query_row(p, unit.seq) + unit.first;
  stage_rows(p, r, s);
  stage_query<scalar_t, kBf16>(p, r, first_row, s);

  const int32_t* block_table = p.block_tables + unit.seq * p.block_table_stride;
  const cache_t* key_base =
      static_cast<const cache_t*>(p.key_cache) + unit.kv_head * p.key_head_stride;
  const cache_t* value_base =
      static_cast<const cache_t*>(p.value_cache) + unit.kv_head * p.value_head_stride;
  const int64_t kv_begin = first_attended(p, r.first_position);
  const int64_t kv_end = r.last_position + 1;
  for (int64_t t0 = kv_begin; t0 < kv_end; t0 += kPrefillTokens) {
    const int64_t t1 = std::min(t0 + kPrefillTokens, kv_end);
    const int64_t tokens = t1 - t0;
    const int64_t tokens_pad = round_up(tokens, kBf16MatmulDepth);  // the bf16 value product's
    // Steps: load the K/V tile, then the scores (logits_t = keys x query_t).
    if constexpr (kBf16) {
      uint16_t* values_t = s.values_t_bf16.data();
      gather_tile(p, block_table, key_base, value_base, t0, t1, kv_end, s.head_pad,
                  s.keys_bf16.data(), values_t);
      for (int64_t d = 0; d < v_head_size && tokens < tokens_pad; ++d) {
        // padding tokens: finite values, times probability 0
        uint16_t* row = values_t + d * kPrefillTokens;
        std::fill(row + tokens, row + tokens_pad, uint16_t{0});
      }
      products.bf16(round_up(tokens, kBf16MatmulRows), r.rows_pad, s.head_pad,
                    s.keys_bf16.data(), s.head_pad, s.query_pairs.data(), 2 * r.rows_pad,
                    s.logits_t.data(), r.rows_pad, false);
    } else {
      gather_tile(p, block_table, key_base, value_base, t0, t1, kv_end, head_size,
                  s.keys.data(), s.values_t.data());
      products.f32(tokens, r.rows_pad, head_size, head_size, r.rows_pad, r.rows_pad, false,
                   s.keys.data(), s.query_t.data(), s.logits_t.data());
    }
    // Steps: mask / soft-cap / ALiBi, then the online-softmax update.
    const float logit_scale = kBf16 ? p.scale : 1.0f;
    const bool rewritten = mask_and_max<V>(p, r, t0, tokens, logit_scale, s);
    exponentials<V, kBf16>(r, tokens, tokens_pad, rewritten ? 1.0f : logit_scale, s);
    if (t0 > kv_begin) rescale_output<V>(r, v_head_size, s);
    // Step: the value product (out_t += values_t x probabilities).
    if constexpr (kBf16) {
      for (const uint16_t* probs : {s.prob_pairs.data(), s.prob_pairs_low.data()}) {
        products.bf16(s.value_rows, r.rows_pad, tokens_pad, s.values_t_bf16.data(),
                      kPrefillTokens, probs, 2 * r.rows_pad, s.out_t.data(), r.rows_pad, true);
      }
    } else {
      products.f32(v_head_size, r.rows_pad, tokens, kPrefillTokens, r.rows_pad, r.rows_pad, true,
                   s.values_t.data(), s.logits_t.data(), s.out_t.data());
    }
  }
  store_rows<scalar_t>(p, r, first_row, s);
}

// Takes units from `next_unit` until none is left.
template <typename scalar_t, typename cache_t, typename V>
inline void run_prefill_units(const AttentionParams& p, const PrefillProducts& products,
                              const std::vector<PrefillUnit>& units,
                              std::atomic<int64_t>& next_unit) {
  const bool bf16 = kBf16Operands<scalar_t, cache_t> && products.bf16 != nullptr;
  PrefillScratch s;
  // A unit holds up to kPrefillRows rows, or one query position's whole group if that is more.
  s.resize(p.head_size, p.v_head_size, std::max(kPrefillRows, p.num_heads / p.num_kv_heads),
           bf16);
  const int64_t count = static_cast<int64_t>(units.size());
  for (int64_t u = next_unit.fetch_add(1, std::memory_order_relaxed); u < count;
       u = next_unit.fetch_add(1, std::memory_order_relaxed)) {
    if constexpr (kBf16Operands<scalar_t, cache_t>) {
      if (bf16) {
        attend_prefill_unit<scalar_t, cache_t, V, true>(p, products, s, units[u]);
        continue;
      }
    }
    attend_prefill_unit<scalar_t, cache_t, V, false>(p, products, s, units[u]);
  }
  if (bf16 && products.release_bf16 != nullptr) products.release_bf16();
}

// One compiled copy per instruction set, as for the decode kernel.
#define PA_DEFINE_PREFILL_VARIANT(name, vector_type, attributes)                             \
  template <typename scalar_t, typename cache_t>                                             \
  attributes void name(const AttentionParams& p, const PrefillProducts& products,            \
                       const std::vector<PrefillUnit>& units,                                \
                       std::atomic<int64_t>& next_unit) {                                    \
    run_prefill_units<scalar_t, cache_t, vector_type>(p, products, units, next_unit);        \
  }

#ifdef PA_HAVE_X86_VARIANTS
PA_DEFINE_PREFILL_VARIANT(run_prefill_units_avx512, f32x16,
                          __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c,"
                                                "bmi2"),
                                         flatten)))
PA_DEFINE_PREFILL_VARIANT(run_prefill_units_avx2, f32x8,
                          __attribute__((target("avx2,fma,f16c,bmi2"), flatten)))
#endif
PA_DEFINE_PREFILL_VARIANT(run_prefill_units_baseline, f32x16, __attribute__((flatten)))
#undef PA_DEFINE_PREFILL_VARIANT

}  // namespace paged_attention::cpu
