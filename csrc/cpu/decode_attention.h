// CPU paged attention: decode (one query token per sequence) over a block-paged KV cache. Free of
// torch headers: csrc/cpu/attention.cpp fills AttentionParams and runs the units.
//
// Work unit: one (sequence, run of up to 4 adjacent KV heads[, partition]). A unit reads each KV
// head's key and value tiles once and serves the whole group of query heads that share that KV
// head (GQA/MQA). Two passes per unit: keys -> logits of every attended token (kept in a
// per-thread buffer), then a max-subtracted softmax and the probability-weighted sum of the
// values, all in fp32. The KV heads of a unit are visited block by block, so the unit reads each
// block's tiles of those heads, which are adjacent in the cache, one after another: longer runs
// of contiguous memory than one head's 4-8 KiB tile, which the memory system serves faster.
// For the varlen op a unit may also serve several query rows of its sequence: q_len x
// queries_per_kv rows per KV head, each with its own causal end (window, chunk), the tiles still
// read once for all.
//
// The kernel is compiled three times with different target attributes (AVX-512, AVX2+FMA,
// baseline); attention.cpp picks the variant at run time from torch's CPU capability, so the build
// stays portable and ATEN_CPU_CAPABILITY=avx2|default forces a narrower variant.
//
// Tile layouts (docs/design.md), per block and KV head, both contiguous:
//   keys   [head_size / x][block_size][x]   x = 16 bytes / element size
//   values [head_size][block_size]
// Tiles are read in 64-byte chunks, in storage order, each converted to fp32 vectors in a
// de-interleaved lane order (see load_chunk). The query and the probabilities are laid out once
// per unit/block in the matching order ("patterns"), the multiply-adds accumulate lane-wise, and
// a shuffle tree sums groups of lanes at the end: a key chunk always holds 4 tokens x 4 lanes, a
// value chunk holds whole head-dim rows (or half a row for fp32 with block size 32).
#pragma once

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "cpu/simd.h"

namespace paged_attention::cpu {

// Everything a kernel needs, as raw pointers and element strides (no tensors past this point).
struct AttentionParams {
  const void* query;
  int64_t query_row_stride;  // between query rows: sequences (v1/v2), tokens (varlen)
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
  // varlen: the query rows of sequence s are query_start_loc[s] .. query_start_loc[s + 1] - 1;
  // null for v1/v2, where sequence s has one query row, row s.
  const int32_t* query_start_loc;
  const float* alibi_slopes;  // null without ALiBi
  const float* sinks;         // varlen: one extra logit per query head; null without
  float scale;
  float logits_soft_cap;   // 0: none
  int64_t sliding_window;  // 0: none
  int64_t attention_chunk_size;  // 0: none; else a query at p attends [p - p % C, p] only
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
  int64_t max_query_len;    // sequences with more query rows are left to another kernel
};

// Query rows of sequence `seq`, and the first of them (a row index of query and out).
inline int64_t query_len(const AttentionParams& p, int64_t seq) {
  return p.query_start_loc == nullptr ? 1 : p.query_start_loc[seq + 1] - p.query_start_loc[seq];
}
inline int64_t first_query_row(const AttentionParams& p, int64_t seq) {
  return p.query_start_loc == nullptr ? seq : p.query_start_loc[seq];
}

// Query rows whose multiply-adds share a loaded cache vector (the AVX2 variant uses half as
// many: see kRowsPerVector in attend_tokens); buffers are sized for this many.
constexpr int kHeadTile = 4;
constexpr int kValueBlocks = 8;  // blocks whose value sums stay in registers together
// Probability patterns per block and head: at most 4 vectors per chunk times 2 chunks per value
// row (fp32, block size 32). A fixed stride keeps the pattern offsets compile-time constants in
// the value loop, which would otherwise run short of general-purpose registers.
constexpr int kMaxPatterns = 8;

// Blocks are scattered in memory, so the hardware prefetchers cannot run ahead across them; the
// kernel requests the tiles it will read next itself, a few lines at a time between its
// multiply-adds (a burst of requests would stall once the line-fill buffers are full). Key tiles
// are requested into L2 only (`prefetcht2`), which measured faster than L1. While the key pass
// reads one set of kPrefetchTiles tiles (in the order the unit reads its tiles), it requests the
// next set's lines one line of each tile in turn, not tile after tile: a core keeps more
// requests in flight when they are spread over several pages (the order mattered, not the
// distance). Value tiles go to L1 one KV head's span of kValueBlocks tiles ahead, one tile per
// block in turn (the AVX2 variant requests them all at once). The measurements behind each
// choice: README, "Decode attention on the CPU", and docs/results.md.
constexpr int64_t kPrefetchTiles = 8;

// The most KV heads per unit (see the top of the file). With head size 128 and block size 16, 4
// heads' key tiles of a block are one 16 KiB (bf16) or 32 KiB (fp32) run of memory.
constexpr int64_t kMaxUnitKvHeads = 4;
// Varlen sequences whose query rows times query heads per KV head stay within this many are
// attended here (each K/V tile read once for all of them), as is any single query row; the
// others by prefill_attention.h, whose matrix products were as fast at 32 such rows and faster
// beyond.
constexpr int64_t kDecodeMaxRows = 32;
// With several query rows per sequence, a unit holds at most this many rows (KV heads x rows
// per KV head), unless one KV head alone has more: their logits stay in the per-thread buffer.
constexpr int64_t kMaxUnitRows = 32;

// Per-thread buffers, sized once per parallel chunk. A "vector" is a run of 16 floats;
// "kv_heads" is the number of KV heads of a unit, "rows" the query rows per KV head (q_len x
// queries_per_kv), padded to a multiple of kHeadTile in rows_pad.
struct Scratch {
  AlignedFloats query_patterns;  // [kv_heads][rows_pad][head_size / 4][4]
  AlignedFloats logits;          // [kv_heads * rows][logit_stride]: logits, then exp(logit - max)
  AlignedFloats block_logits;    // [rows_pad][block_size]
  AlignedFloats prob_patterns;   // [kValueBlocks][rows_pad][kMaxPatterns] vectors
  AlignedFloats accumulators;    // [kv_heads][rows_pad][value chunks per tile] vectors
  int64_t logit_stride;

  void resize(int64_t kv_heads, int64_t rows, int64_t head_size, int64_t block_size,
              int64_t max_tokens) {
    const int64_t rows_pad = round_up(rows, kHeadTile);
    logit_stride = round_up(std::max<int64_t>(max_tokens, 1), kLanes);
    query_patterns.resize(kv_heads * rows_pad * head_size);
    logits.resize(kv_heads * rows * logit_stride);
    block_logits.resize(rows_pad * block_size);
    prob_patterns.resize(kValueBlocks * rows_pad * kMaxPatterns * kLanes);
    // A value tile of 4-byte elements has head_size * block_size / 16 chunks (the most).
    accumulators.resize(kv_heads * rows_pad * head_size * block_size);
  }
};

// The first position a query at `position` attends: the start of its sliding window and of its
// chunk, whichever is later (0 without either).
inline int64_t first_attended(const AttentionParams& p, int64_t position) {
  int64_t first = 0;
  if (p.sliding_window > 0) first = std::max<int64_t>(first, position - p.sliding_window + 1);
  if (p.attention_chunk_size > 0 && position > 0) {
    first = std::max(first, position - position % p.attention_chunk_size);
  }
  return first;
}

// Attends the query rows of KV heads [kv_head, kv_head + heads) to tokens [begin, end) of one
// sequence (end > begin). A KV head serves q_len x queries_per_kv rows: row
// hh * head_rows + i * queries_per_kv + g
// is query row i of the sequence (at position seq_len - q_len + i) and query head g of KV head
// kv_head + hh. Row i attends [begin, end) clipped to its causal end, window and chunk. Writes, per
// row, the normalised output (float), the max logit and the exp sum (a sink included).
// kSplit (the AVX2 variant): 16-lane vectors have no register of their own there, and GCC keeps
// them on the stack; the multiply-add loops then hold every vector as two 8-lane halves, in
// registers, with 2 heads per loaded cache vector instead of 4 (16 registers, not 32).
template <typename scalar_t, typename cache_t, bool kSplit>
inline void attend_tokens(const AttentionParams& p, Scratch& s, int64_t seq, int64_t kv_head,
                          int64_t kv_heads, int64_t begin, int64_t end, float* out,
                          float* max_logit, float* exp_sum) {
  constexpr int k = kVectorsPerChunk<cache_t>;
  constexpr int64_t chunk_elems = kElementsPerChunk<cache_t>;
  constexpr int64_t x = 16 / sizeof(cache_t);  // key layout: elements per 16 bytes
  // Chunks whose multiply-adds share one loaded query/probability pattern: 4 when the
  // accumulators and converted chunks still fit in 32 vector registers, else 2.
  constexpr bool kWideTile = !kSplit && k <= 2;
  constexpr int kRowsPerVector = kSplit ? kHeadTile / 2 : kHeadTile;  // rows sharing a vector
  // The multiply-add loops hold each 16-lane vector as kParts pieces of type V: one 16-lane
  // vector, or (kSplit) two 8-lane halves, lanes 8h..8h+7 in half h.
  using V = std::conditional_t<kSplit, f32x8, f32x16>;
  constexpr int kParts = kSplit ? 2 : 1;
  constexpr int kPartLanes = kLanes / kParts;
  constexpr int64_t kPartElems = kElementsPerChunk<cache_t> / kParts;
  const int64_t head_size = p.head_size;
  const int64_t block_size = p.block_size;
  const int64_t queries_per_kv = p.num_heads / p.num_kv_heads;
  const int64_t q_len = query_len(p, seq);
  const int64_t head_rows = q_len * queries_per_kv;
  const int64_t rows_pad = round_up(head_rows, kRowsPerVector);
  const int64_t rows = kv_heads * head_rows;
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
  const int64_t head_patterns = rows_pad * patterns_per_head * 4;  // floats per KV head
  float* query_patterns = s.query_patterns.data();
  for (int64_t hh = 0; hh < kv_heads; ++hh) {
    float* head_qp = query_patterns + hh * head_patterns;
    std::fill(head_qp + head_rows * patterns_per_head * 4, head_qp + head_patterns,
              0.0f);  // padding rows
    for (int64_t g = 0; g < head_rows; ++g) {
      const scalar_t* q = static_cast<const scalar_t*>(p.query) +
                          (first_query_row(p, seq) + g / queries_per_kv) * p.query_row_stride +
                          ((kv_head + hh) * queries_per_kv + g % queries_per_kv) *
                              p.query_head_stride;
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
  // (per span of kValueBlocks blocks, head by head); null past the end.
  const int64_t blocks = end_block - first_block;
  const int64_t key_tiles = blocks * kv_heads;
  auto tile_in_reading_order = [&](int64_t t) -> const char* {
    const cache_t* tile = nullptr;
    if (t < key_tiles) {
      tile = key_base + block_table[first_block + t / kv_heads] * p.key_block_stride +
             t % kv_heads * p.key_head_stride;
    } else if (t < 2 * key_tiles) {
      t -= key_tiles;
      const int64_t span_first = t / (kv_heads * kValueBlocks) * kValueBlocks;
      const int64_t span_blocks = std::min<int64_t>(kValueBlocks, blocks - span_first);
      const int64_t in_span = t - span_first * kv_heads;
      tile = value_base +
             block_table[first_block + span_first + in_span % span_blocks] *
                 p.value_block_stride +
             in_span / span_blocks * p.value_head_stride;
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
    for (int64_t hh = 0; hh < kv_heads; ++hh) {
      const cache_t* tile = block_tiles + hh * p.key_head_stride;
      // The next set of kPrefetchTiles tiles, whose lines this tile's key pass requests:
      // requests [first_request, first_request + tile_lines) of the set's interleaved order.
      const int64_t tile_index = (b - first_block) * kv_heads + hh;
      const char* ahead[kPrefetchTiles];
      for (int i = 0; i < kPrefetchTiles; ++i) {
        ahead[i] = tile_in_reading_order((tile_index / kPrefetchTiles + 1) * kPrefetchTiles + i);
      }
      const int64_t first_request = tile_index % kPrefetchTiles * tile_lines;
      for (int64_t g0 = 0; g0 < rows_pad; g0 += kRowsPerVector) {
        const float* qp = query_patterns + hh * head_patterns + g0 * patterns_per_head * 4;
        // Logits of the 4 * kTile tokens in chunks [m0, m0 + kTile) of every dim-row.
        auto chunk_logits = [&]<int kTile>(int64_t m0) {
          V acc[kRowsPerVector][kTile][kParts] = {};
          for (int64_t c = 0; c < dim_rows; ++c) {
            if (g0 == 0 && m0 == 0) {  // dim-row c's share of the requests
              for (int64_t l = 0; l < row_lines; ++l) {
                // unsigned (requests are never negative): % and / by a power of two stay a mask
                // and a shift, with no sign fix-up, in the one loop that runs per dim-row
                const auto request = static_cast<uint64_t>(first_request + c * row_lines + l);
                const char* ahead_tile = ahead[request % kPrefetchTiles];
                if (ahead_tile != nullptr) {
                  __builtin_prefetch(ahead_tile + request / kPrefetchTiles * 64, 0, kToL2);
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
              for (int g = 0; g < kRowsPerVector; ++g) {
                const V q = repeat_quad<V>(qp + (g * patterns_per_head + c * k + v) * 4);
                for (int part = 0; part < kParts; ++part) {
                  for (int m = 0; m < kTile; ++m) acc[g][m][part] += q * keys[m][part][v];
                }
              }
            }
          }
          for (int g = 0; g < kRowsPerVector; ++g) {
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
      for (int64_t g = 0; g < head_rows; ++g) {
        std::memcpy(logits + (hh * head_rows + g) * s.logit_stride + (lo - begin),
                    block_logits + g * block_size + (lo - b * block_size),
                    (hi - lo) * sizeof(float));
      }
    }
  }

  // ---- Soft-cap, ALiBi, then the max-subtracted exponentials, a vector V of tokens at a time
  // (the logits rows are padded to a multiple of 16). Row r attends the offsets [lo, hi) of the
  // unit's tokens: all of them for a single query row, up to its own position for the others.
  using I = IntsOf<V>;
  constexpr int kRowLanes = kPartLanes;
  constexpr float kInf = std::numeric_limits<float>::infinity();
  for (int64_t r = 0; r < rows; ++r) {
    float* row = logits + r * s.logit_stride;
    const int64_t i = r % head_rows / queries_per_kv;  // query row within the sequence
    const int64_t head = (kv_head + r / head_rows) * queries_per_kv + r % queries_per_kv;
    const int64_t position = seq_len - q_len + i;
    const int32_t lo =
        static_cast<int32_t>(std::max<int64_t>(0, first_attended(p, position) - begin));
    const int32_t hi = static_cast<int32_t>(std::min(end, position + 1) - begin);
    const float slope = p.alibi_slopes != nullptr ? p.alibi_slopes[head] : 0.0f;
    // A lane is valid when its offset minus lo, as unsigned, is below hi - lo: one compare of a
    // loop-carried vector (two compares and an and, or a constant lane vector, GCC computed one
    // lane at a time in scalar code).
    using U = typename WordsOf<V>::type;
    const U span = U{} + static_cast<uint32_t>(hi - lo);
    const U first = bit_cast<U>(lane_index<I>() - lo);
    V row_max = splat<V>(-kInf);
    U from_lo = first;
    for (int64_t t = 0; t < n; t += kRowLanes, from_lo += kRowLanes) {
      const I valid = from_lo < span;
      V v = load_vector<V>(row + t);
      if (p.logits_soft_cap > 0) v = p.logits_soft_cap * vtanh(v / p.logits_soft_cap);
      if (p.alibi_slopes != nullptr) {
        // key position - query position, for key positions begin + t + lane
        const V rel = __builtin_convertvector(lane_index<I>(), V) +
                      static_cast<float>(begin + t - position);
        v += slope * rel;
      }
      v = valid ? v : splat<V>(-kInf);
      std::memcpy(row + t, &v, sizeof(v));
      row_max = v > row_max ? v : row_max;
    }
    float m = row_max[0];
    for (int j = 1; j < kRowLanes; ++j) m = std::max(m, row_max[j]);
    // A sink joins the softmax's denominator only: exp(sink - m), with m covering it.
    const float sink = p.sinks != nullptr ? p.sinks[head] : -kInf;
    m = std::max(m, sink);
    V row_sum{};
    from_lo = first;
    for (int64_t t = 0; t < n; t += kRowLanes, from_lo += kRowLanes) {
      const I valid = from_lo < span;
      const V e = zero_where_not(vexp(load_vector<V>(row + t) - m), valid);
      std::memcpy(row + t, &e, sizeof(e));
      row_sum += e;
    }
    float sum = p.sinks != nullptr ? std::exp(sink - m) : 0.0f;
    for (int j = 0; j < kRowLanes; ++j) sum += row_sum[j];
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
  const int64_t head_acc_floats = rows_pad * value_chunks * kLanes;  // per KV head
  std::fill(acc_mem, acc_mem + kv_heads * head_acc_floats, 0.0f);
  float* prob_patterns = s.prob_patterns.data();
  const int64_t pattern_block_stride = rows_pad * kMaxPatterns * kLanes;
  i32x16 pattern_tokens[kMaxPatterns];  // token of each lane of each pattern, within a block
  for (int64_t pat = 0; pat < patterns; ++pat) {
    for (int l = 0; l < kLanes; ++l) {
      pattern_tokens[pat][l] = static_cast<int32_t>(((pat / k) * chunk_elems + pat % k + l * k) %
                                                    block_size);
    }
  }
  i32x16 keep[kValueBlocks][kMaxPatterns];  // lanes of valid tokens, per block and pattern
  bool partial[kValueBlocks];
  const cache_t* block_tiles[kValueBlocks];  // first KV head's tiles of this span of blocks
  const cache_t* next_block_tiles[kValueBlocks];  // and of the next span
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
    for (int64_t hh = 0; hh < kv_heads; ++hh) {
      // The tiles read next: the next KV head's of this span, or the first head's of the next.
      const int64_t prefetch_nb = hh + 1 < kv_heads ? nb : next_nb;
      for (int64_t i = 0; i < prefetch_nb; ++i) {
        next_tiles[i] = hh + 1 < kv_heads ? block_tiles[i] + (hh + 1) * p.value_head_stride
                                       : next_block_tiles[i];
      }
      for (int64_t i = 0; i < nb; ++i) {
        const int64_t block_start = (b0 + i) * block_size;
        tiles[i] = block_tiles[i] + hh * p.value_head_stride;
        float* patterns_out = prob_patterns + i * pattern_block_stride;
        for (int64_t pat = 0; pat < patterns; ++pat) {
          const i32x16 token = pattern_tokens[pat];
          for (int64_t g = 0; g < rows_pad; ++g) {
            float* dst = patterns_out + (g * kMaxPatterns + pat) * kLanes;
            const float* row =
                logits + (hh * head_rows + std::min(g, head_rows - 1)) * s.logit_stride;
            if (g >= head_rows) {
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
      for (int64_t g0 = 0; g0 < rows_pad; g0 += kRowsPerVector) {
        // Value chunks [m0, m0 + kTile) of every block of the span, summed in registers. m0 is
        // a multiple of kTile, so chunk m0 + m uses the patterns of row chunk m % chunks_per_row.
        auto chunk_values = [&]<int kTile>(int64_t m0) {
          f32x16 acc[kRowsPerVector][kTile];
          for (int g = 0; g < kRowsPerVector; ++g) {
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
              for (int g = 0; g < kRowsPerVector; ++g) {
                const float* pattern = pp + (g * kMaxPatterns + v) * kLanes;
                const f32x16 even = load_vector<f32x16>(pattern);
                const f32x16 odd =
                    chunks_per_row > 1 ? load_vector<f32x16>(pattern + k * kLanes) : even;
                for (int m = 0; m < kTile; ++m) acc[g][m] += (m % 2 ? odd : even) * values[m][v];
              }
            }
          }
          for (int g = 0; g < kRowsPerVector; ++g) {
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
          f32x8 acc[kRowsPerVector][kTile][2];
          for (int g = 0; g < kRowsPerVector; ++g) {
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
              for (int g = 0; g < kRowsPerVector; ++g) {
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
          for (int g = 0; g < kRowsPerVector; ++g) {
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
  for (int64_t hh = 0; hh < kv_heads; ++hh) {
    for (int64_t g = 0; g < head_rows; ++g) {
      const float* lanes = acc_mem + hh * head_acc_floats + g * value_chunks * kLanes;
      float* row_out = out + (hh * head_rows + g) * head_size;
      for (int64_t m = 0; m < value_chunks; ++m) {
        const f32x16 sums = group_sum(load_vector<f32x16>(lanes + m * kLanes), lanes_per_row);
        const int64_t first_row = m / chunks_per_row * rows_per_chunk;
        for (int64_t r = 0; r < rows_per_chunk; ++r) {
          row_out[first_row + r] += sums[r * lanes_per_row];
        }
      }
      const float inv_sum = 1.0f / exp_sum[hh * head_rows + g];
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
// Sequences without query rows, or with more than p.max_query_len, are skipped.
template <typename scalar_t, typename cache_t, bool kSplit>
inline void run_units(const AttentionParams& p, std::atomic<int64_t>& next_unit) {
  const int64_t queries_per_kv = p.num_heads / p.num_kv_heads;
  const int64_t runs = kv_head_runs(p);
  const int64_t units = unit_count(p);
  const int64_t max_head_rows = p.max_query_len * queries_per_kv;
  Scratch s;
  s.resize(p.unit_kv_heads, max_head_rows, p.head_size, p.block_size, p.max_unit_tokens);
  std::vector<float> result(p.unit_kv_heads * max_head_rows * p.head_size);
  std::vector<float> max_logit(p.unit_kv_heads * max_head_rows);
  std::vector<float> exp_sum(p.unit_kv_heads * max_head_rows);

  for (int64_t u = next_unit.fetch_add(1, std::memory_order_relaxed); u < units;
       u = next_unit.fetch_add(1, std::memory_order_relaxed)) {
    const int64_t partition = u % p.num_partitions;
    const int64_t kv_head = (u / p.num_partitions) % runs * p.unit_kv_heads;
    const int64_t kv_heads = std::min(p.unit_kv_heads, p.num_kv_heads - kv_head);
    const int64_t seq = u / (p.num_partitions * runs);
    const int64_t q_len = query_len(p, seq);
    if (q_len == 0 || q_len > p.max_query_len) continue;
    const int64_t head_rows = q_len * queries_per_kv;
    const int64_t rows = kv_heads * head_rows;
    const int64_t seq_len = p.seq_lens[seq];
    // Where the first query row's window and chunk start: later rows attend no further back.
    int64_t begin = first_attended(p, seq_len - q_len);
    int64_t end = seq_len;
    begin = std::max(begin, partition * p.partition_size);
    end = std::min(end, (partition + 1) * p.partition_size);
    if (begin >= end) {
      std::fill(result.begin(), result.end(), 0.0f);
      std::fill(max_logit.begin(), max_logit.end(), -std::numeric_limits<float>::infinity());
      std::fill(exp_sum.begin(), exp_sum.end(), 0.0f);
    } else {
      attend_tokens<scalar_t, cache_t, kSplit>(p, s, seq, kv_head, kv_heads, begin, end,
                                               result.data(), max_logit.data(), exp_sum.data());
    }
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t token = first_query_row(p, seq) + r % head_rows / queries_per_kv;
      const int64_t head = (kv_head + r / head_rows) * queries_per_kv + r % queries_per_kv;
      const int64_t row = (token * p.num_heads + head) * p.num_partitions + partition;
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

}  // namespace paged_attention::cpu
