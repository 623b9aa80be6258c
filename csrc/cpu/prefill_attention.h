// CPU paged attention for long runs of query rows (prompts, prompt chunks): the varlen op's
// kernel for sequences with more query rows than the decode kernel serves. Free of torch headers:
// the float32 matrix product comes in as a function pointer (attention.cpp passes torch's).
//
// Work unit: one (sequence, KV head, tile of up to kPrefillRows query rows), the rows being
// (query position, query head of the KV head) pairs, so a KV head's keys and values serve its
// whole GQA group at once. A unit walks the keys its rows attend in tiles of kPrefillTokens
// tokens, FlashAttention's way: each tile's keys and values are gathered from their blocks into
// contiguous float32 scratch (dequantised if fp8), the logits of the tile come from one matrix
// product, then an online softmax (running max and sum per row, fp32) rescales what the earlier
// tiles accumulated and a second product adds the tile's probability-weighted values. Only
// positions the rows attend are gathered, so no empty cache slot is ever read.
//
// Layouts in scratch (float32, row-major), with rows_pad = rows rounded up to 16:
//   query_t  [head_size][rows_pad]  query rows times scale, transposed (padding rows zero)
//   keys     [tokens][head_size]    so that logits_t = keys x query_t is [tokens][rows_pad]
//   values_t [head_size][tokens]    so that out_t += values_t x probs_t is [head_size][rows_pad]
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

// Per-thread buffers for units of up to max_rows rows.
struct PrefillScratch {
  AlignedFloats query_t;
  AlignedFloats keys;
  AlignedFloats values_t;
  AlignedFloats logits_t;  // logits, then probabilities
  AlignedFloats out_t;
  AlignedFloats row_max;
  AlignedFloats row_sum;
  AlignedFloats row_slope;
  AlignedFloats row_position;  // float: positions fit exactly below 2^24
  AlignedFloats row_chunk_start;  // the first position of the row's chunk (with chunks)
  AlignedFloats row_rescale;

  void resize(int64_t head_size, int64_t max_rows) {
    const int64_t rows_pad = round_up(max_rows, kLanes);
    query_t.resize(head_size * rows_pad);
    keys.resize(kPrefillTokens * head_size);
    values_t.resize(head_size * kPrefillTokens);
    logits_t.resize(kPrefillTokens * rows_pad);
    out_t.resize(head_size * rows_pad);
    for (AlignedFloats* row :
         {&row_max, &row_sum, &row_slope, &row_position, &row_chunk_start, &row_rescale}) {
      row->resize(rows_pad);
    }
  }
};

// Gathers tokens [t0, t1) of one KV head into keys [t1 - t0][head_size] and values_t
// [head_size][kPrefillTokens], as float32. The blocks are scattered, so the hardware prefetchers
// cannot run ahead across them: while it converts the k-th block of this tile, it requests the
// k-th block's key and value tiles of the next one, [t1, next_end), into L2.
template <typename cache_t>
inline void gather_tile(const AttentionParams& p, const int32_t* block_table,
                        const cache_t* key_base, const cache_t* value_base, int64_t t0,
                        int64_t t1, int64_t next_end, float* keys, float* values_t) {
  constexpr int64_t x = 16 / sizeof(cache_t);
  const int64_t head_size = p.head_size;
  const int64_t block_size = p.block_size;
  const int64_t tile_bytes = head_size * block_size * static_cast<int64_t>(sizeof(cache_t));
  const int64_t next_first_block = t1 / block_size;
  const int64_t next_end_block = (next_end + block_size - 1) / block_size;
  for (int64_t j = t0, k = 0; j < t1; ++k) {
    if (next_first_block + k < next_end_block) {
      const int64_t ahead = block_table[next_first_block + k];
      prefetch_lines<kToL2>(key_base + ahead * p.key_block_stride, tile_bytes);
      prefetch_lines<kToL2>(value_base + ahead * p.value_block_stride, tile_bytes);
    }
    const int64_t block = block_table[j / block_size];
    const int64_t offset = j % block_size;
    const int64_t run = std::min(block_size - offset, t1 - j);  // tokens of this block
    const cache_t* key_tile = key_base + block * p.key_block_stride;
    for (int64_t c = 0; c < head_size / x; ++c) {  // in storage order: one dim-row at a time
      for (int64_t t = 0; t < run; ++t) {
        convert_row(key_tile + (c * block_size + offset + t) * x, x, p.key_scale,
                    keys + (j - t0 + t) * head_size + c * x);
      }
    }
    const cache_t* value_tile = value_base + block * p.value_block_stride;
    for (int64_t d = 0; d < head_size; ++d) {
      convert_row(value_tile + d * block_size + offset, run, p.value_scale,
                  values_t + d * kPrefillTokens + (j - t0));
    }
    j += run;
  }
}

// One unit: see the top of the file. V is the vector type of the row loops (16 lanes, or 8 in
// the AVX2 variant).
template <typename scalar_t, typename cache_t, typename V>
inline void attend_prefill_unit(const AttentionParams& p, GemmF32 gemm, PrefillScratch& s,
                                const PrefillUnit& unit) {
  using I = IntsOf<V>;
  constexpr int64_t kVectorLanes = sizeof(V) / sizeof(float);
  constexpr float kInf = std::numeric_limits<float>::infinity();
  const int64_t queries_per_kv = p.num_heads / p.num_kv_heads;
  const int64_t head_size = p.head_size;
  const int64_t seq = unit.seq;
  const int64_t q_len = query_len(p, seq);
  const int64_t seq_len = p.seq_lens[seq];
  const int64_t rows = unit.count * queries_per_kv;
  const int64_t rows_pad = round_up(rows, kLanes);
  const int64_t first_position = seq_len - q_len + unit.first;
  const int64_t last_position = first_position + unit.count - 1;

  // Row m is query row unit.first + m / queries_per_kv and query head
  // kv_head * queries_per_kv + m % queries_per_kv.
  float* query_t = s.query_t.data();
  float* row_slope = s.row_slope.data();
  float* row_position = s.row_position.data();
  float* row_chunk_start = s.row_chunk_start.data();
  const int64_t chunk = p.attention_chunk_size;
  for (int64_t m = 0; m < rows_pad; ++m) {
    const int64_t real = std::min(m, rows - 1);  // padding rows repeat the last row's metadata
    const int64_t head = unit.kv_head * queries_per_kv + real % queries_per_kv;
    const int64_t position = first_position + real / queries_per_kv;
    row_position[m] = static_cast<float>(position);
    if (chunk > 0) row_chunk_start[m] = static_cast<float>(position - position % chunk);
    row_slope[m] = p.alibi_slopes != nullptr ? p.alibi_slopes[head] : 0.0f;
    const scalar_t* q = static_cast<const scalar_t*>(p.query) +
                        (first_query_row(p, seq) + unit.first + real / queries_per_kv) *
                            p.query_row_stride +
                        head * p.query_head_stride;
    for (int64_t d = 0; d < head_size; ++d) {
      query_t[d * rows_pad + m] = m < rows ? static_cast<float>(q[d]) * p.scale : 0.0f;
    }
  }
  float* row_max = s.row_max.data();
  float* row_sum = s.row_sum.data();
  float* row_rescale = s.row_rescale.data();
  float* out_t = s.out_t.data();
  std::fill(row_max, row_max + rows_pad, -kInf);
  std::fill(row_sum, row_sum + rows_pad, 0.0f);
  std::fill(out_t, out_t + head_size * rows_pad, 0.0f);

  const int32_t* block_table = p.block_tables + seq * p.block_table_stride;
  const cache_t* key_base = static_cast<const cache_t*>(p.key_cache) +
                            unit.kv_head * p.key_head_stride;
  const cache_t* value_base = static_cast<const cache_t*>(p.value_cache) +
                              unit.kv_head * p.value_head_stride;
  const int64_t window = p.sliding_window;
  const int64_t kv_begin = first_attended(p, first_position);
  // Tiles from here on lie in the chunk of every row (the last row's chunk starts last).
  const int64_t last_chunk_start = chunk > 0 ? last_position - last_position % chunk : 0;
  const int64_t kv_end = last_position + 1;
  float* keys = s.keys.data();
  float* values_t = s.values_t.data();
  float* logits_t = s.logits_t.data();
  for (int64_t t0 = kv_begin; t0 < kv_end; t0 += kPrefillTokens) {
    const int64_t t1 = std::min(t0 + kPrefillTokens, kv_end);
    const int64_t tokens = t1 - t0;
    gather_tile(p, block_table, key_base, value_base, t0, t1,
                std::min(t1 + kPrefillTokens, kv_end), keys, values_t);
    gemm(tokens, rows_pad, head_size, head_size, rows_pad, rows_pad, false, keys, query_t,
         logits_t);
    // Every row attends every token of the tile: no mask to apply.
    const bool whole = t1 - 1 <= first_position && (window == 0 || t0 > last_position - window) &&
                       t0 >= last_chunk_start;
    for (int64_t m0 = 0; m0 < rows_pad; m0 += kVectorLanes) {
      const V position = load_vector<V>(row_position + m0);
      const V chunk_start = chunk > 0 ? load_vector<V>(row_chunk_start + m0) : V{};
      const V slope = load_vector<V>(row_slope + m0);
      V tile_max = splat<V>(-kInf);
      for (int64_t t = 0; t < tokens; ++t) {
        float* row = logits_t + t * rows_pad + m0;
        V v = load_vector<V>(row);
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
      const V old_max = load_vector<V>(row_max + m0);
      const V new_max = tile_max > old_max ? tile_max : old_max;
      V tile_sum{};
      for (int64_t t = 0; t < tokens; ++t) {
        float* row = logits_t + t * rows_pad + m0;
        const V v = load_vector<V>(row);
        const V e = zero_where_not(vexp(v - new_max), v != splat<V>(-kInf));
        store_vector(row, e);
        tile_sum += e;
      }
      // What the earlier tiles accumulated, rescaled to the new max (nothing yet: 0).
      const V rescale =
          zero_where_not(vexp(old_max - new_max), old_max != splat<V>(-kInf));
      store_vector(row_sum + m0, load_vector<V>(row_sum + m0) * rescale + tile_sum);
      store_vector(row_max + m0, new_max);
      store_vector(row_rescale + m0, rescale);
    }
    if (t0 > kv_begin) {
      for (int64_t d = 0; d < head_size; ++d) {
        for (int64_t m0 = 0; m0 < rows_pad; m0 += kVectorLanes) {
          float* acc = out_t + d * rows_pad + m0;
          store_vector(acc, load_vector<V>(acc) * load_vector<V>(row_rescale + m0));
        }
      }
    }
    gemm(head_size, rows_pad, tokens, kPrefillTokens, rows_pad, rows_pad, true, values_t, logits_t,
         out_t);
  }

  // out = out_t / (sum + exp(sink - max)), a sink joining the denominator only.
  for (int64_t m = 0; m < rows; ++m) {
    const int64_t head = unit.kv_head * queries_per_kv + m % queries_per_kv;
    const float sink = p.sinks != nullptr ? p.sinks[head] : -kInf;
    const float top = std::max(row_max[m], sink);
    const float kept = std::exp(row_max[m] - top);
    const float denominator =
        row_sum[m] * kept + (p.sinks != nullptr ? std::exp(sink - top) : 0.0f);
    row_rescale[m] = kept / denominator;
  }
  for (int64_t m = 0; m < rows; ++m) {
    const int64_t head = unit.kv_head * queries_per_kv + m % queries_per_kv;
    const int64_t token = first_query_row(p, seq) + unit.first + m / queries_per_kv;
    scalar_t* dst = static_cast<scalar_t*>(p.out) + (token * p.num_heads + head) * head_size;
    for (int64_t d = 0; d < head_size; ++d) {
      dst[d] = static_cast<scalar_t>(out_t[d * rows_pad + m] * row_rescale[m]);
    }
  }
}

// Takes units from `next_unit` until none is left.
template <typename scalar_t, typename cache_t, typename V>
inline void run_prefill_units(const AttentionParams& p, GemmF32 gemm,
                              const std::vector<PrefillUnit>& units,
                              std::atomic<int64_t>& next_unit) {
  PrefillScratch s;
  // A unit holds up to kPrefillRows rows, or one query position's whole group if that is more.
  s.resize(p.head_size, std::max(kPrefillRows, p.num_heads / p.num_kv_heads));
  const int64_t count = static_cast<int64_t>(units.size());
  for (int64_t u = next_unit.fetch_add(1, std::memory_order_relaxed); u < count;
       u = next_unit.fetch_add(1, std::memory_order_relaxed)) {
    attend_prefill_unit<scalar_t, cache_t, V>(p, gemm, s, units[u]);
  }
}

// One compiled copy per instruction set, as for the decode kernel.
#define PA_DEFINE_PREFILL_VARIANT(name, vector_type, attributes)                             \
  template <typename scalar_t, typename cache_t>                                             \
  attributes void name(const AttentionParams& p, GemmF32 gemm,                               \
                       const std::vector<PrefillUnit>& units,                                \
                       std::atomic<int64_t>& next_unit) {                                    \
    run_prefill_units<scalar_t, cache_t, vector_type>(p, gemm, units, next_unit);            \
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
