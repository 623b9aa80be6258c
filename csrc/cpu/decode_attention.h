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
//   values [v_head_size][block_size]   (v_head_size: the values' own head size, = head_size but
//                                       for multi-head latent attention)
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
  int64_t head_size;    // of the query and keys
  int64_t v_head_size;  // of the values and out
  int64_t block_size;
  float key_scale;  // fp8 caches: dequantisation scales (1 otherwise)
  float value_scale;
  // v1: out [num_seqs, num_heads, v_head_size]. v2: tmp_out [num_seqs, num_heads, partitions,
  // v_head_size] plus max_logits/exp_sums [num_seqs, num_heads, partitions].
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
// With AMX products the tiled kernel is the faster from 16 rows per KV head on (bf16; measured in
// docs/cpu_kernels.md).
constexpr int64_t kDecodeMaxRowsBesideAmx = 8;
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

  void resize(int64_t kv_heads, int64_t rows, int64_t head_size, int64_t v_head_size,
              int64_t block_size, int64_t max_tokens) {
    const int64_t rows_pad = round_up(rows, kHeadTile);
    logit_stride = round_up(std::max<int64_t>(max_tokens, 1), kLanes);
    query_patterns.grow(kv_heads * rows_pad * head_size);
    logits.grow(kv_heads * rows * logit_stride);
    block_logits.grow(rows_pad * block_size);
    prob_patterns.grow(kValueBlocks * rows_pad * kMaxPatterns * kLanes);
    // A value tile of 4-byte elements has v_head_size * block_size / 16 chunks (the most).
    accumulators.grow(kv_heads * rows_pad * v_head_size * block_size);
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

// One unit of the decode kernel: the query rows of KV heads [kv_head, kv_head + kv_heads) over
// tokens [begin, end) of one sequence (end > begin). A KV head serves q_len x queries_per_kv
// rows: row hh * head_rows + i * queries_per_kv + g is query row i of the sequence (at position
// seq_len - q_len + i) and query head g of KV head kv_head + hh. Row i attends [begin, end)
// clipped to its causal end, window and chunk.
//
// The unit runs in named steps (attend_tokens), as FlashInfer's prefill.cuh names its kernel's:
// stage the query (stage_query_patterns); the key pass, per block and KV head: request the tiles
// ahead (request_ahead), load the key tile's chunks and compute the scores (score_chunks); the
// mask, soft-cap and ALiBi with each row's max (mask_and_max); the softmax's exponentials and
// sums (exponentials); the value pass, per span of kValueBlocks blocks and KV head: the
// probabilities in the value chunks' lane order (stage_probabilities), then the value product
// (value_chunks, or value_chunks_split in the AVX2 variant); store (store_rows).
//
// kSplit (the AVX2 variant): 16-lane vectors have no register of their own there, and GCC keeps
// them on the stack; the multiply-add loops then hold every vector as two 8-lane halves, in
// registers, with 2 heads per loaded cache vector instead of 4 (16 registers, not 32).
template <typename cache_t, bool kSplit>
struct DecodeUnit {
  static constexpr int k = kVectorsPerChunk<cache_t>;
  static constexpr int64_t chunk_elems = kElementsPerChunk<cache_t>;
  static constexpr int64_t x = 16 / sizeof(cache_t);  // key layout: elements per 16 bytes
  // Chunks whose multiply-adds share one loaded query/probability pattern: 4 when the
  // accumulators and converted chunks still fit in 32 vector registers, else 2.
  static constexpr bool kWideTile = !kSplit && k <= 2;
  static constexpr int kRowsPerVector = kSplit ? kHeadTile / 2 : kHeadTile;  // rows per vector
  // The multiply-add loops hold each 16-lane vector as kParts pieces of type V: one 16-lane
  // vector, or (kSplit) two 8-lane halves, lanes 8h..8h+7 in half h.
  using V = std::conditional_t<kSplit, f32x8, f32x16>;
  static constexpr int kParts = kSplit ? 2 : 1;
  static constexpr int kPartLanes = kLanes / kParts;
  static constexpr int64_t kPartElems = kElementsPerChunk<cache_t> / kParts;

  const AttentionParams& p;
  int64_t seq;
  int64_t kv_head;
  int64_t kv_heads;
  int64_t begin;
  int64_t end;
  int64_t n;  // end - begin
  int64_t head_size;
  int64_t v_head_size;
  int64_t block_size;
  int64_t queries_per_kv;
  int64_t q_len;
  int64_t head_rows;  // query rows per KV head
  int64_t rows_pad;   // head_rows rounded up to kRowsPerVector
  int64_t rows;       // kv_heads x head_rows
  int64_t seq_len;
  const int32_t* block_table;
  const cache_t* key_base;  // the first KV head's tiles
  const cache_t* value_base;
  int64_t first_block;
  int64_t end_block;
  // Key pass geometry. A key chunk holds 4 tokens x 16 dims in the order of load_chunk: lane l
  // of vector v is token 4m + l / 4, dim c * x + (l % 4) * k + v (m: chunk within a dim-row c).
  int64_t dim_rows;           // head_size / x
  int64_t patterns_per_head;  // query patterns per row: dim_rows x k = head_size / 4
  int64_t head_patterns;      // floats of query patterns per KV head
  int64_t key_chunks_per_row;  // block_size / 4: 2, 4 or 8
  int64_t row_lines;           // 64-byte lines per dim-row of a tile
  int64_t tile_lines;
  // Value pass geometry. Chunk m of a value tile, vector v, lane l is element e = m * chunk_elems
  // + l * k + v, i.e. head dim e / block_size and token e % block_size.
  int64_t chunks_per_row;  // 1, or 2 when a row spans two chunks (fp32, block size 32)
  int64_t patterns;        // probability patterns per block: k x chunks_per_row
  int64_t value_chunks;    // per tile
  int64_t head_acc_floats;  // accumulator floats per KV head

  DecodeUnit(const AttentionParams& params, int64_t seq_, int64_t kv_head_, int64_t kv_heads_,
             int64_t begin_, int64_t end_)
      : p(params), seq(seq_), kv_head(kv_head_), kv_heads(kv_heads_), begin(begin_), end(end_) {
    n = end - begin;
    head_size = p.head_size;
    v_head_size = p.v_head_size;
    block_size = p.block_size;
    queries_per_kv = p.num_heads / p.num_kv_heads;
    q_len = query_len(p, seq);
    head_rows = q_len * queries_per_kv;
    rows_pad = round_up(head_rows, kRowsPerVector);
    rows = kv_heads * head_rows;
    seq_len = p.seq_lens[seq];
    block_table = p.block_tables + seq * p.block_table_stride;
    key_base = static_cast<const cache_t*>(p.key_cache) + kv_head * p.key_head_stride;
    value_base = static_cast<const cache_t*>(p.value_cache) + kv_head * p.value_head_stride;
    first_block = begin / block_size;
    end_block = (end + block_size - 1) / block_size;
    dim_rows = head_size / x;
    patterns_per_head = dim_rows * k;
    head_patterns = rows_pad * patterns_per_head * 4;
    key_chunks_per_row = block_size / 4;
    row_lines = block_size * 16 / 64;
    tile_lines = dim_rows * row_lines;
    chunks_per_row = std::max<int64_t>(1, block_size / chunk_elems);
    patterns = k * chunks_per_row;
    value_chunks = v_head_size * block_size / chunk_elems;
    head_acc_floats = rows_pad * value_chunks * kLanes;
  }

  // The unit's tiles in the order it reads them, for the requests ahead: the key tiles block by
  // block (the heads of a block together), then the value tiles as the value pass visits them
  // (per span of kValueBlocks blocks, head by head); null past the end.
  const char* tile_in_reading_order(int64_t t) const {
    const int64_t blocks = end_block - first_block;
    const int64_t key_tiles = blocks * kv_heads;
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
  }
};

// Step: stage the query. Lane l of key vector (c, v) needs query element c * x + (l % 4) * k + v,
// times scale: the query pattern of (c, v) is those 4 floats, repeated across the vector when
// loaded. Patterns [kv_heads][rows_pad][patterns_per_head][4], padding rows zero.
template <typename scalar_t, typename cache_t, bool kSplit>
inline void stage_query_patterns(const DecodeUnit<cache_t, kSplit>& u, Scratch& s) {
  constexpr int k = DecodeUnit<cache_t, kSplit>::k;
  constexpr int64_t x = DecodeUnit<cache_t, kSplit>::x;
  const AttentionParams& p = u.p;
  float* query_patterns = s.query_patterns.data();
  for (int64_t hh = 0; hh < u.kv_heads; ++hh) {
    float* head_qp = query_patterns + hh * u.head_patterns;
    std::fill(head_qp + u.head_rows * u.patterns_per_head * 4, head_qp + u.head_patterns,
              0.0f);  // padding rows
    for (int64_t g = 0; g < u.head_rows; ++g) {
      const scalar_t* q =
          static_cast<const scalar_t*>(p.query) +
          (first_query_row(p, u.seq) + g / u.queries_per_kv) * p.query_row_stride +
          ((u.kv_head + hh) * u.queries_per_kv + g % u.queries_per_kv) * p.query_head_stride;
      for (int64_t c = 0; c < u.dim_rows; ++c) {
        for (int v = 0; v < k; ++v) {
          float* pattern = head_qp + (g * u.patterns_per_head + c * k + v) * 4;
          for (int l = 0; l < 4; ++l) {
            pattern[l] = static_cast<float>(q[c * x + l * k + v]) * p.scale;
          }
        }
      }
    }
  }
}

// The key pass's requests ahead for one tile: the next set of kPrefetchTiles tiles (in reading
// order), whose lines this tile's pass requests, dim-row by dim-row: requests
// [first_request, first_request + tile_lines) of the set's interleaved order.
struct RequestsAhead {
  const char* tiles[kPrefetchTiles];
  int64_t first_request;
};

template <typename cache_t, bool kSplit>
inline RequestsAhead plan_requests_ahead(const DecodeUnit<cache_t, kSplit>& u,
                                         int64_t tile_index) {
  RequestsAhead ahead;
  for (int i = 0; i < kPrefetchTiles; ++i) {
    const int64_t next_set = (tile_index / kPrefetchTiles + 1) * kPrefetchTiles;
    ahead.tiles[i] = u.tile_in_reading_order(next_set + i);
  }
  ahead.first_request = tile_index % kPrefetchTiles * u.tile_lines;
  return ahead;
}

// Step: dim-row c's share of the requests ahead (one line of each tile of the set in turn).
inline void request_ahead(const RequestsAhead& ahead, int64_t c, int64_t row_lines) {
  for (int64_t l = 0; l < row_lines; ++l) {
    // unsigned (requests are never negative): % and / by a power of two stay a mask and a
    // shift, with no sign fix-up, in the one loop that runs per dim-row
    const auto request = static_cast<uint64_t>(ahead.first_request + c * row_lines + l);
    const char* ahead_tile = ahead.tiles[request % kPrefetchTiles];
    if (ahead_tile != nullptr) {
      __builtin_prefetch(ahead_tile + request / kPrefetchTiles * 64, 0, kToL2);
    }
  }
}

// Steps: load the key tile's chunks [m0, m0 + kTile) of every dim-row and compute the scores of
// their 4 * kTile tokens for rows [g0, g0 + kRowsPerVector); the rows' logits go to
// block_logits [rows_pad][block_size]. The first call of a tile (g0 == 0, m0 == 0) also issues
// the tile's requests ahead, spread over the dim-rows.
template <int kTile, typename cache_t, bool kSplit>
inline void score_chunks(const DecodeUnit<cache_t, kSplit>& u, const cache_t* tile,
                         const float* qp, int64_t g0, int64_t m0, const RequestsAhead& ahead,
                         float* block_logits) {
  using Unit = DecodeUnit<cache_t, kSplit>;
  using V = typename Unit::V;
  constexpr int k = Unit::k;
  constexpr int kParts = Unit::kParts;
  constexpr int kRowsPerVector = Unit::kRowsPerVector;
  V acc[kRowsPerVector][kTile][kParts] = {};
  for (int64_t c = 0; c < u.dim_rows; ++c) {
    if (g0 == 0 && m0 == 0) request_ahead(ahead, c, u.row_lines);
    V keys[kTile][kParts][k];
    for (int m = 0; m < kTile; ++m) {
      for (int part = 0; part < kParts; ++part) {
        load_chunk(tile + c * u.block_size * Unit::x + (m0 + m) * Unit::chunk_elems +
                       part * Unit::kPartElems,
                   u.p.key_scale, keys[m][part]);
      }
    }
    for (int v = 0; v < k; ++v) {
      for (int g = 0; g < kRowsPerVector; ++g) {
        const V q = repeat_quad<V>(qp + (g * u.patterns_per_head + c * k + v) * 4);
        for (int part = 0; part < kParts; ++part) {
          for (int m = 0; m < kTile; ++m) acc[g][m][part] += q * keys[m][part][v];
        }
      }
    }
  }
  for (int g = 0; g < kRowsPerVector; ++g) {
    float* dst = block_logits + (g0 + g) * u.block_size + m0 * 4;
    if constexpr (kSplit) {
      for (int m = 0; m < kTile; ++m) {
        float lanes[kLanes];
        for (int part = 0; part < kParts; ++part) {
          store_vector(lanes + part * Unit::kPartLanes, acc[g][m][part]);
        }
        for (int t = 0; t < 4; ++t) {
          const float* sums = lanes + 4 * t;  // the token's 4 partial sums
          dst[m * 4 + t] = (sums[0] + sums[1]) + (sums[2] + sums[3]);
        }
      }
    } else if constexpr (kTile == 4) {
      store_vector(dst, sum_token_lanes(acc[g][0][0], acc[g][1][0], acc[g][2][0], acc[g][3][0]));
    } else {
      for (int m = 0; m < kTile; ++m) {
        const f32x16 sums = group_sum<4>(acc[g][m][0]);
        for (int t = 0; t < 4; ++t) dst[m * 4 + t] = sums[4 * t];
      }
    }
  }
}

// The key pass: every block's key tiles (the unit's KV heads of a block one after another),
// scored, the logits of [begin, end) copied to the logits rows.
template <typename cache_t, bool kSplit>
inline void key_pass(const DecodeUnit<cache_t, kSplit>& u, Scratch& s) {
  using Unit = DecodeUnit<cache_t, kSplit>;
  constexpr int kRowsPerVector = Unit::kRowsPerVector;
  const AttentionParams& p = u.p;
  float* logits = s.logits.data();
  float* block_logits = s.block_logits.data();
  for (int64_t b = u.first_block; b < u.end_block; ++b) {
    const cache_t* block_tiles = u.key_base + u.block_table[b] * p.key_block_stride;
    // Slots outside [begin, end) (the tail of the last block, or before a sliding window)
    // produce logits from whatever the cache holds there; they are not copied out.
    const int64_t lo = std::max(u.begin, b * u.block_size);
    const int64_t hi = std::min(u.end, (b + 1) * u.block_size);
    for (int64_t hh = 0; hh < u.kv_heads; ++hh) {
      const cache_t* tile = block_tiles + hh * p.key_head_stride;
      const RequestsAhead ahead = plan_requests_ahead(u, (b - u.first_block) * u.kv_heads + hh);
      for (int64_t g0 = 0; g0 < u.rows_pad; g0 += kRowsPerVector) {
        const float* qp = s.query_patterns.data() + hh * u.head_patterns +
                          g0 * u.patterns_per_head * 4;
        if (Unit::kWideTile && u.key_chunks_per_row % 4 == 0) {
          for (int64_t m0 = 0; m0 < u.key_chunks_per_row; m0 += 4) {
            score_chunks<4>(u, tile, qp, g0, m0, ahead, block_logits);
          }
        } else {
          // kSplit: 1 chunk at a time when a chunk converts to 2 or 4 vectors (16 registers).
          constexpr int kNarrowTile = kSplit && Unit::k > 1 ? 1 : 2;
          for (int64_t m0 = 0; m0 < u.key_chunks_per_row; m0 += kNarrowTile) {
            score_chunks<kNarrowTile>(u, tile, qp, g0, m0, ahead, block_logits);
          }
        }
      }
      for (int64_t g = 0; g < u.head_rows; ++g) {
        std::memcpy(logits + (hh * u.head_rows + g) * s.logit_stride + (lo - u.begin),
                    block_logits + g * u.block_size + (lo - b * u.block_size),
                    (hi - lo) * sizeof(float));
      }
    }
  }
}

// The offsets of the unit's tokens that row r attends, [lo, hi): from its window's and chunk's
// start (first_attended) up to its own position.
struct AttendedRange {
  int32_t lo;
  int32_t hi;
  int64_t position;  // the row's query position
  int64_t head;      // its query head
};

template <typename cache_t, bool kSplit>
inline AttendedRange attended_range(const DecodeUnit<cache_t, kSplit>& u, int64_t r) {
  const AttentionParams& p = u.p;
  const int64_t i = r % u.head_rows / u.queries_per_kv;  // query row within the sequence
  AttendedRange range;
  range.head = (u.kv_head + r / u.head_rows) * u.queries_per_kv + r % u.queries_per_kv;
  range.position = u.seq_len - u.q_len + i;
  range.lo =
      static_cast<int32_t>(std::max<int64_t>(0, first_attended(p, range.position) - u.begin));
  range.hi = static_cast<int32_t>(std::min(u.end, range.position + 1) - u.begin);
  return range;
}

// A lane is valid when its offset minus lo, as unsigned, is below hi - lo: one compare of a
// loop-carried vector (two compares and an and, or a constant lane vector, GCC computed one lane
// at a time in scalar code). first: the offsets of the first vector's lanes minus lo.
template <typename V>
struct LaneValidity {
  using U = typename WordsOf<V>::type;
  U span;
  U first;
  explicit LaneValidity(const AttendedRange& range)
      : span(U{} + static_cast<uint32_t>(range.hi - range.lo)),
        first(bit_cast<U>(lane_index<IntsOf<V>>() - range.lo)) {}
};

// Step: soft-cap, ALiBi and the mask over row r's logits (a vector V of tokens at a time; the
// rows are padded to a multiple of 16), which it rewrites; returns the row's max, a sink
// included (-inf when nothing is attended).
template <typename cache_t, bool kSplit>
inline float mask_and_max(const DecodeUnit<cache_t, kSplit>& u, const AttendedRange& range,
                          float* row) {
  using V = typename DecodeUnit<cache_t, kSplit>::V;
  using I = IntsOf<V>;
  constexpr int kRowLanes = DecodeUnit<cache_t, kSplit>::kPartLanes;
  constexpr float kInf = std::numeric_limits<float>::infinity();
  const AttentionParams& p = u.p;
  const float slope = p.alibi_slopes != nullptr ? p.alibi_slopes[range.head] : 0.0f;
  const LaneValidity<V> lanes(range);
  V row_max = splat<V>(-kInf);
  auto from_lo = lanes.first;
  for (int64_t t = 0; t < u.n; t += kRowLanes, from_lo += kRowLanes) {
    const I valid = from_lo < lanes.span;
    V v = load_vector<V>(row + t);
    if (p.logits_soft_cap > 0) v = p.logits_soft_cap * vtanh(v / p.logits_soft_cap);
    if (p.alibi_slopes != nullptr) {
      // key position - query position, for key positions begin + t + lane
      const V rel = __builtin_convertvector(lane_index<I>(), V) +
                    static_cast<float>(u.begin + t - range.position);
      v += slope * rel;
    }
    v = valid ? v : splat<V>(-kInf);
    std::memcpy(row + t, &v, sizeof(v));
    row_max = v > row_max ? v : row_max;
  }
  float m = row_max[0];
  for (int j = 1; j < kRowLanes; ++j) m = std::max(m, row_max[j]);
  // A sink joins the softmax's denominator only: exp(sink - m), with m covering it.
  return p.sinks != nullptr ? std::max(m, p.sinks[range.head]) : m;
}

// Step: the softmax's exponentials, exp(logit - max) in place of row r's logits (0 where not
// attended); returns their sum, a sink's exp(sink - max) included.
template <typename cache_t, bool kSplit>
inline float exponentials(const DecodeUnit<cache_t, kSplit>& u, const AttendedRange& range,
                          float max, float* row) {
  using V = typename DecodeUnit<cache_t, kSplit>::V;
  using I = IntsOf<V>;
  constexpr int kRowLanes = DecodeUnit<cache_t, kSplit>::kPartLanes;
  const LaneValidity<V> lanes(range);
  V row_sum{};
  auto from_lo = lanes.first;
  for (int64_t t = 0; t < u.n; t += kRowLanes, from_lo += kRowLanes) {
    const I valid = from_lo < lanes.span;
    const V e = zero_where_not(vexp(load_vector<V>(row + t) - max), valid);
    std::memcpy(row + t, &e, sizeof(e));
    row_sum += e;
  }
  float sum = u.p.sinks != nullptr ? std::exp(u.p.sinks[range.head] - max) : 0.0f;
  for (int j = 0; j < kRowLanes; ++j) sum += row_sum[j];
  return sum;
}

// The value pass's per-span state: each block's tiles and which lanes hold attended tokens.
template <typename cache_t>
struct ValueSpan {
  int64_t b0;  // first block of the span
  int64_t nb;  // blocks in it
  int64_t prefetch_nb;  // tiles to request for the next KV head (or span)
  i32x16 keep[kValueBlocks][kMaxPatterns];  // lanes of valid tokens, per block and pattern
  bool partial[kValueBlocks];
  const cache_t* tiles[kValueBlocks];       // the current KV head's
  const cache_t* next_tiles[kValueBlocks];  // those read next
};

// Step: the probabilities of KV head hh's rows over the span's blocks, in the lane order of the
// value chunks: pattern pat of a block holds, per lane, the probability of the lane's token
// (pattern_tokens), zero for padding rows and for tokens outside [begin, end).
template <typename cache_t, bool kSplit>
inline void stage_probabilities(const DecodeUnit<cache_t, kSplit>& u, Scratch& s,
                                const ValueSpan<cache_t>& span, int64_t hh,
                                const i32x16* pattern_tokens, float* prob_patterns) {
  const int64_t pattern_block_stride = u.rows_pad * kMaxPatterns * kLanes;
  const float* logits = s.logits.data();
  for (int64_t i = 0; i < span.nb; ++i) {
    const int64_t block_start = (span.b0 + i) * u.block_size;
    float* patterns_out = prob_patterns + i * pattern_block_stride;
    for (int64_t pat = 0; pat < u.patterns; ++pat) {
      const i32x16 token = pattern_tokens[pat];
      for (int64_t g = 0; g < u.rows_pad; ++g) {
        float* dst = patterns_out + (g * kMaxPatterns + pat) * kLanes;
        const float* row =
            logits + (hh * u.head_rows + std::min(g, u.head_rows - 1)) * s.logit_stride;
        if (g >= u.head_rows) {
          std::fill(dst, dst + kLanes, 0.0f);
        } else if (!span.partial[i]) {
          if constexpr (kSplit) {
            permute_block_split(dst, row + (block_start - u.begin), token, u.block_size);
          } else {
            store_vector(dst, permute_block(row + (block_start - u.begin), token, u.block_size));
          }
        } else {
          for (int l = 0; l < kLanes; ++l) {
            const int64_t pos = block_start - u.begin + token[l];
            dst[l] = pos >= 0 && pos < u.n ? row[pos] : 0.0f;
          }
        }
      }
    }
  }
}

// Steps: load value chunks [m0, m0 + kTile) of every block of the span and add their
// probability-weighted sums for rows [g0, g0 + kRowsPerVector) to the accumulators, in
// registers over the span. m0 is a multiple of kTile, so chunk m0 + m uses the patterns of row
// chunk m % chunks_per_row. While at it, the rows' first group requests the same chunks of the
// tiles read next, one tile per block so that the requests spread between the multiply-adds (2%
// faster than all at once, bf16 32 x 4096).
template <int kTile, typename cache_t, bool kSplit>
inline void value_chunks(const DecodeUnit<cache_t, kSplit>& u, const ValueSpan<cache_t>& span,
                         const float* prob_patterns, int64_t g0, int64_t m0, float* head_acc) {
  using Unit = DecodeUnit<cache_t, kSplit>;
  constexpr int k = Unit::k;
  constexpr int kRowsPerVector = Unit::kRowsPerVector;
  const int64_t pattern_block_stride = u.rows_pad * kMaxPatterns * kLanes;
  f32x16 acc[kRowsPerVector][kTile];
  for (int g = 0; g < kRowsPerVector; ++g) {
    for (int m = 0; m < kTile; ++m) {
      acc[g][m] = load_vector<f32x16>(head_acc + ((g0 + g) * u.value_chunks + m0 + m) * kLanes);
    }
  }
  for (int64_t i = 0; i < span.nb; ++i) {
    if (g0 == 0 && i < span.prefetch_nb) {
      prefetch_lines<kToL1>(span.next_tiles[i] + m0 * Unit::chunk_elems, kTile * 64);
    }
    f32x16 values[kTile][k];
    for (int m = 0; m < kTile; ++m) {
      load_chunk(span.tiles[i] + (m0 + m) * Unit::chunk_elems, u.p.value_scale, values[m]);
    }
    if (span.partial[i]) {  // never let 0 * NaN from an unused slot into the sum
      for (int m = 0; m < kTile; ++m) {
        for (int v = 0; v < k; ++v) {
          values[m][v] = zero_where_not(values[m][v], span.keep[i][(m % u.chunks_per_row) * k + v]);
        }
      }
    }
    const float* pp = prob_patterns + i * pattern_block_stride + g0 * kMaxPatterns * kLanes;
    for (int v = 0; v < k; ++v) {
      for (int g = 0; g < kRowsPerVector; ++g) {
        const float* pattern = pp + (g * kMaxPatterns + v) * kLanes;
        const f32x16 even = load_vector<f32x16>(pattern);
        const f32x16 odd =
            u.chunks_per_row > 1 ? load_vector<f32x16>(pattern + k * kLanes) : even;
        for (int m = 0; m < kTile; ++m) acc[g][m] += (m % 2 ? odd : even) * values[m][v];
      }
    }
  }
  for (int g = 0; g < kRowsPerVector; ++g) {
    for (int m = 0; m < kTile; ++m) {
      store_vector(head_acc + ((g0 + g) * u.value_chunks + m0 + m) * kLanes, acc[g][m]);
    }
  }
}

// value_chunks as 8-lane halves (kSplit), 2 chunks at a time. A function of its own rather than
// value_chunks over kParts pieces (as score_chunks is): that form made GCC spill more vectors in
// the AVX-512 build (45 -> 67-116 zmm spill stores) and measured slower.
template <typename cache_t, bool kSplit>
inline void value_chunks_split(const DecodeUnit<cache_t, kSplit>& u,
                               const ValueSpan<cache_t>& span, const float* prob_patterns,
                               int64_t g0, int64_t m0, float* head_acc) {
  using Unit = DecodeUnit<cache_t, kSplit>;
  constexpr int k = Unit::k;
  constexpr int kRowsPerVector = Unit::kRowsPerVector;
  constexpr int kTile = 2;
  const int64_t pattern_block_stride = u.rows_pad * kMaxPatterns * kLanes;
  f32x8 acc[kRowsPerVector][kTile][2];
  for (int g = 0; g < kRowsPerVector; ++g) {
    for (int m = 0; m < kTile; ++m) {
      for (int h = 0; h < 2; ++h) {
        acc[g][m][h] =
            load_vector<f32x8>(head_acc + ((g0 + g) * u.value_chunks + m0 + m) * kLanes + 8 * h);
      }
    }
  }
  // Here all at once: spread over the block loop (as in value_chunks), bf16 at 32 x 4096
  // measured 2-7% slower in this variant.
  if (g0 == 0) {
    for (int64_t i = 0; i < span.prefetch_nb; ++i) {
      prefetch_lines<kToL1>(span.next_tiles[i] + m0 * Unit::chunk_elems, kTile * 64);
    }
  }
  for (int64_t i = 0; i < span.nb; ++i) {
    f32x8 values[kTile][2][k];
    for (int m = 0; m < kTile; ++m) {
      for (int h = 0; h < 2; ++h) {
        load_chunk(span.tiles[i] + (m0 + m) * Unit::chunk_elems + h * Unit::chunk_elems / 2,
                   u.p.value_scale, values[m][h]);
      }
    }
    if (span.partial[i]) {  // never let 0 * NaN from an unused slot into the sum
      for (int m = 0; m < kTile; ++m) {
        for (int h = 0; h < 2; ++h) {
          for (int v = 0; v < k; ++v) {
            const auto* mask =
                reinterpret_cast<const char*>(&span.keep[i][(m % u.chunks_per_row) * k + v]) +
                h * sizeof(i32x8);
            values[m][h][v] =
                bit_cast<f32x8>(bit_cast<i32x8>(values[m][h][v]) & load_vector<i32x8>(mask));
          }
        }
      }
    }
    const float* pp = prob_patterns + i * pattern_block_stride + g0 * kMaxPatterns * kLanes;
    for (int v = 0; v < k; ++v) {
      for (int g = 0; g < kRowsPerVector; ++g) {
        for (int h = 0; h < 2; ++h) {
          const f32x8 even = load_vector<f32x8>(pp + (g * kMaxPatterns + v) * kLanes + 8 * h);
          const f32x8 odd =
              u.chunks_per_row > 1
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
        store_vector(head_acc + ((g0 + g) * u.value_chunks + m0 + m) * kLanes + 8 * h,
                     acc[g][m][h]);
      }
    }
  }
}

// The value pass: per span of kValueBlocks blocks and KV head, the probabilities staged, then
// the value product, the lane-wise sums accumulating in s.accumulators
// [kv_heads][rows_pad][value_chunks] vectors. The probability pattern holds each lane's token
// probability; it repeats every chunk when a chunk spans whole rows, and every 2 chunks when a
// row spans two chunks (fp32, block size 32).
template <typename cache_t, bool kSplit>
inline void value_pass(const DecodeUnit<cache_t, kSplit>& u, Scratch& s) {
  using Unit = DecodeUnit<cache_t, kSplit>;
  constexpr int k = Unit::k;
  const AttentionParams& p = u.p;
  float* acc_mem = s.accumulators.data();
  std::fill(acc_mem, acc_mem + u.kv_heads * u.head_acc_floats, 0.0f);
  float* prob_patterns = s.prob_patterns.data();
  i32x16 pattern_tokens[kMaxPatterns];  // token of each lane of each pattern, within a block
  for (int64_t pat = 0; pat < u.patterns; ++pat) {
    for (int l = 0; l < kLanes; ++l) {
      pattern_tokens[pat][l] = static_cast<int32_t>(
          ((pat / k) * Unit::chunk_elems + pat % k + l * k) % u.block_size);
    }
  }
  ValueSpan<cache_t> span;
  const cache_t* block_tiles[kValueBlocks];       // first KV head's tiles of this span of blocks
  const cache_t* next_block_tiles[kValueBlocks];  // and of the next span
  for (span.b0 = u.first_block; span.b0 < u.end_block; span.b0 += kValueBlocks) {
    span.nb = std::min<int64_t>(kValueBlocks, u.end_block - span.b0);
    const int64_t next_nb = std::min<int64_t>(kValueBlocks, u.end_block - span.b0 - span.nb);
    for (int64_t i = 0; i < next_nb; ++i) {
      next_block_tiles[i] =
          u.value_base + u.block_table[span.b0 + span.nb + i] * p.value_block_stride;
    }
    for (int64_t i = 0; i < span.nb; ++i) {
      const int64_t block_start = (span.b0 + i) * u.block_size;
      block_tiles[i] = u.value_base + u.block_table[span.b0 + i] * p.value_block_stride;
      span.partial[i] = block_start < u.begin || block_start + u.block_size > u.end;
      if (!span.partial[i]) continue;
      for (int64_t pat = 0; pat < u.patterns; ++pat) {
        for (int l = 0; l < kLanes; ++l) {
          const int64_t pos = block_start - u.begin + pattern_tokens[pat][l];
          span.keep[i][pat][l] = pos >= 0 && pos < u.n ? -1 : 0;
        }
      }
    }
    for (int64_t hh = 0; hh < u.kv_heads; ++hh) {
      // The tiles read next: the next KV head's of this span, or the first head's of the next.
      span.prefetch_nb = hh + 1 < u.kv_heads ? span.nb : next_nb;
      for (int64_t i = 0; i < span.prefetch_nb; ++i) {
        span.next_tiles[i] = hh + 1 < u.kv_heads
                                 ? block_tiles[i] + (hh + 1) * p.value_head_stride
                                 : next_block_tiles[i];
      }
      for (int64_t i = 0; i < span.nb; ++i) {
        span.tiles[i] = block_tiles[i] + hh * p.value_head_stride;
      }
      stage_probabilities(u, s, span, hh, pattern_tokens, prob_patterns);
      float* head_acc = acc_mem + hh * u.head_acc_floats;
      for (int64_t g0 = 0; g0 < u.rows_pad; g0 += Unit::kRowsPerVector) {
        int64_t m0 = 0;
        if constexpr (kSplit) {
          for (; m0 < u.value_chunks; m0 += 2) {
            value_chunks_split(u, span, prob_patterns, g0, m0, head_acc);
          }
        } else {
          if (Unit::kWideTile) {
            for (; m0 + 4 <= u.value_chunks; m0 += 4) {
              value_chunks<4>(u, span, prob_patterns, g0, m0, head_acc);
            }
          }
          for (; m0 < u.value_chunks; m0 += 2) {
            value_chunks<2>(u, span, prob_patterns, g0, m0, head_acc);
          }
        }
      }
    }
  }
}

// Step: store. Folds the lane-wise sums into head dims (a chunk covers rows_per_chunk rows of
// lanes_per_row lanes each, or, when chunks_per_row > 1, part of one row) and normalises each
// row by its exp sum, into out [rows][v_head_size].
template <typename cache_t, bool kSplit>
inline void store_rows(const DecodeUnit<cache_t, kSplit>& u, Scratch& s, const float* exp_sum,
                       float* out) {
  constexpr int64_t chunk_elems = DecodeUnit<cache_t, kSplit>::chunk_elems;
  const int64_t rows_per_chunk = std::max<int64_t>(1, chunk_elems / u.block_size);
  const int64_t lanes_per_row = kLanes / rows_per_chunk;
  const float* acc_mem = s.accumulators.data();
  std::fill(out, out + u.rows * u.v_head_size, 0.0f);
  for (int64_t hh = 0; hh < u.kv_heads; ++hh) {
    for (int64_t g = 0; g < u.head_rows; ++g) {
      const float* lanes = acc_mem + hh * u.head_acc_floats + g * u.value_chunks * kLanes;
      float* row_out = out + (hh * u.head_rows + g) * u.v_head_size;
      for (int64_t m = 0; m < u.value_chunks; ++m) {
        const f32x16 sums = group_sum(load_vector<f32x16>(lanes + m * kLanes), lanes_per_row);
        const int64_t first_row = m / u.chunks_per_row * rows_per_chunk;
        for (int64_t r = 0; r < rows_per_chunk; ++r) {
          row_out[first_row + r] += sums[r * lanes_per_row];
        }
      }
      const float inv_sum = 1.0f / exp_sum[hh * u.head_rows + g];
      for (int64_t d = 0; d < u.v_head_size; ++d) row_out[d] *= inv_sum;
    }
  }
}

// One unit, step by step (see DecodeUnit). Writes, per row, the normalised output (float), the
// max logit and the exp sum (a sink included).
template <typename scalar_t, typename cache_t, bool kSplit>
inline void attend_tokens(const AttentionParams& p, Scratch& s, int64_t seq, int64_t kv_head,
                          int64_t kv_heads, int64_t begin, int64_t end, float* out,
                          float* max_logit, float* exp_sum) {
  const DecodeUnit<cache_t, kSplit> u(p, seq, kv_head, kv_heads, begin, end);
  stage_query_patterns<scalar_t>(u, s);
  key_pass(u, s);
  for (int64_t r = 0; r < u.rows; ++r) {
    float* row = s.logits.data() + r * s.logit_stride;
    const AttendedRange range = attended_range(u, r);
    max_logit[r] = mask_and_max(u, range, row);
    exp_sum[r] = exponentials(u, range, max_logit[r], row);
  }
  value_pass(u, s);
  store_rows(u, s, exp_sum, out);
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
  // Kept by each thread from call to call: a decode step makes one call per layer, and
  // allocating and zeroing the buffers each time cost more than attending a short context.
  thread_local Scratch s;
  s.resize(p.unit_kv_heads, max_head_rows, p.head_size, p.v_head_size, p.block_size,
           p.max_unit_tokens);
  std::vector<float> result(p.unit_kv_heads * max_head_rows * p.v_head_size);
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
      scalar_t* dst = static_cast<scalar_t*>(p.out) + row * p.v_head_size;
      for (int64_t d = 0; d < p.v_head_size; ++d) {
        dst[d] = static_cast<scalar_t>(result[r * p.v_head_size + d]);
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
