// Attention on tensor cores, for fp16/bf16 queries (fp16/bf16 or fp8 caches): decode (v1, v2)
// and varlen (any number of query rows per sequence) with one kernel body.
//
// The design follows FlashInfer's prefill kernel, which also serves its decode for grouped
// queries (flashinfer-ai/flashinfer, include/flashinfer/attention/prefill.cuh): query rows,
// (token, head) pairs of one sequence and KV head packed token-major, are the M rows of
// mma.m16n8k16; tokens of the KV cache are N. One CTA of four warps per (work item, KV head[,
// GQA chunk], split of the sequence), in one of two row tilings (plan.h):
//   one warp of rows (16 rows; decode, short queries): warp w takes the CTA's KV tiles
//       w, w + 4, ... through its own ring, and the four warps' softmax states are merged at
//       the end (attention_common.h);
//   four warps of rows (64 rows; long queries): warp w owns rows 16 w .. 16 w + 15, and all
//       four read every KV tile of one CTA-wide ring (a warp skips the tiles none of its rows
//       attends); each warp's state is its rows' result.
// The code is this project's own.
//
// Tiles of 16 tokens (tile t covers positions 16 t .. 16 t + 15, so a tile never straddles a
// block of 16 or 32 and holds two blocks of 8) go through a ring of two to four shared-memory
// stages filled by cp.async; each thread's copies of a tile lie in one block, whose id it reads
// from the block table one tile ahead (only blocks some row attends). Per tile and warp:
//   S = Q K^T      ldmatrix on the key tile as the cache lays it out: a 16-byte key chunk row is
//                  x dims of one token, i.e. one row of an 8x8 B fragment; fp32 accumulators.
//   softmax        scale, soft-cap, ALiBi (slope x (key position - query position)), the causal
//                  and window masks of each row, running max and sum in registers (rows of a
//                  quad of lanes reduced with two shuffles); the output accumulators are
//                  rescaled only when some row's max grew. Tiles inside every row's range skip
//                  the masks.
//   O += P V       the S accumulators, rounded to 16 bits, are the A fragments of P directly;
//                  a value row is x tokens of one dim, one row of an 8x8 B fragment, so V needs
//                  no transpose either.
//
// fp8 caches: the MMA runs in fp16 (both fp8 formats convert to fp16 exactly: e4m3 with cvt on
// sm_89+, e5m2 by a byte shift); bf16 queries are scaled per row by a power of two into fp16's
// range, and the logit scale undoes it. A 16-byte fp8 key row holds 16 dims, which ldmatrix
// (b16) hands out as dims 4q..4q+3 to lane q of a quad: the query fragments use the same
// permutation of the k dimension. A fp8 value row holds 16 tokens, handed out as tokens
// 4q..4q+3; the S columns (key rows) are permuted to match (column 2q + j and 8 + 2q + j hold
// tokens 4q + j and 4q + 2 + j), so P is still S in registers.
//
// Shared memory per stage: the key tile [chunk][16 tokens][16 B] and the value tile
// [bucket][16 tokens] (rows below v_head_size filled). 16-bit values are swizzled (the two
// 16-byte halves of row d swap when bit 2 of d is set) and fp8 keys of tokens 8..15 move by two
// rows, so that the eight rows of every 8x8 matrix ldmatrix reads fall into eight different bank
// groups.
//
// The body is the steps of FlashInfer's prefill kernel, each a function below: stage the query
// (stage_query, kernel_steps.h; scale_query_to_fp16; QueryFragments), load K/V tiles (MmaTiles
// through a KvRing), then per tile compute_scores, transform_logits, mask_logits,
// update_softmax, accumulate_values; at the end store_states and merge_and_store
// (attention_common.h).
//
// NaN safety: positions a row does not attend get logit -inf (a select, never a product), and
// in tiles that hold positions no row of the warp attends their value elements are zeroed in
// registers before the MMA (0 * NaN is NaN inside an MMA too); key chunks past a head size
// below the bucket's are zero in every stage, as are the query's dims there. Value rows past
// v_head_size are never copied: whatever a stage holds there reaches only output columns
// d >= v_head_size (each output column of an MMA is its own), and those are never stored. A
// position some row of the warp attends reaches the warp's other rows with weight 0
// (docs/cuda.md: a NaN value there makes them NaN).
//
// Keys and values may have head sizes of their own (multi-head latent attention: keys 192,
// values 128); both run in the variant of the larger one's bucket (plan_head_size).
#pragma once

#include <cstdint>

#include "cuda/attention/attention_common.h"
#include "cuda/attention/kernel_steps.h"

namespace paged_attention::cuda {

template <typename Scalar, CacheDtype kCache>
struct MmaCache {
  static constexpr bool kFp8 = kCache != CacheDtype::kAuto;
  static constexpr prim::MmaType kMma = kFp8 ? prim::MmaType::kF16 : Scalar::kMma;
  static constexpr int kElementBytes = kFp8 ? 1 : 2;
  static constexpr int kX = 16 / kElementBytes;  // key chunk width (dims)
  // Rescale bf16 queries per row into fp16's range (fp8 caches only).
  static constexpr bool kScaleQuery = kFp8 && Scalar::kMma == prim::MmaType::kBF16;
  // Four fp8 values of the cache (bytes 0-3) -> two registers of two halves each.
  static PA_DEVICE void to_halves(uint32_t four, uint32_t& lo, uint32_t& hi) {
    if constexpr (kCache == CacheDtype::kFp8E4M3) {
      prim::e4m3x4_to_half2x2(four, lo, hi);
    } else {
      prim::e5m2x4_to_half2x2(four, lo, hi);
    }
  }
};

// Token (0..15) of S column n of a tile: the identity for 16-bit caches, the fp8 permutation.
template <bool kFp8>
PA_DEVICE int s_column_token(int n) {
  if constexpr (kFp8) {
    return n < 8 ? 4 * (n >> 1) + (n & 1) : 4 * ((n - 8) >> 1) + 2 + (n & 1);
  } else {
    return n;
  }
}

// Row of the fp8 key tile that holds token t (tokens 8..15 move by two rows).
PA_DEVICE int fp8_key_row(int t) { return t ^ ((t >> 3) << 1); }

// The compile-time shape of one tensor-core variant.
template <typename Scalar, CacheDtype kCache, int kD, int kRowWarps, int kStages_>
struct MmaVariant {
  using Cache = MmaCache<Scalar, kCache>;
  static constexpr bool kFp8 = Cache::kFp8;
  static constexpr prim::MmaType kMma = Cache::kMma;
  static constexpr int kHeadBucket = kD;
  static constexpr int kStages = kStages_;
  static constexpr bool kWide = kRowWarps > 1;
  static constexpr int kRows = kMmaRows * kRowWarps;
  static constexpr int kContributors = merge_contributors(kRowWarps);
  // The threads that fill one ring: its warp, or the whole CTA.
  static constexpr int kCopyThreads = kWide ? kAttentionThreads : kWarpSize;
  static constexpr int kT = 16;
  static constexpr int kKSteps = kD / 16;
  static constexpr int kNBlocks = kD / 8;
  static constexpr uint32_t kKeyTileBytes = kT * kD * Cache::kElementBytes;
  static constexpr uint32_t kStageBytes = 2 * kKeyTileBytes;
  static constexpr int kQueryRow = query_row_elements(KernelFamily::kTensorCore, kD);
  // Tile copies: a key unit is 16 bytes of (chunk, token); thread j copies token j % 16 of
  // chunks j / 16 + kKeyStep i. A value unit is half a row (8 tokens) of 16-bit values or of
  // fp8 values in blocks of 8, thread j copying half (j / 8) % 2 of rows j % 8 + 8 (j / 16) +
  // kValueHalfStep i; or a whole fp8 row of 16 tokens, thread j copying rows
  // j + kCopyThreads i.
  static constexpr int kKeyChunks = kD / Cache::kX;
  static constexpr int kKeyStep = kCopyThreads / 16;
  static constexpr int kKeyUnits = (kKeyChunks + kKeyStep - 1) / kKeyStep;
  static constexpr int kValueHalfStep = kCopyThreads / 2;
  static constexpr int kValueHalfUnits = kD / kValueHalfStep;
  static constexpr int kValueRowUnits = (kD + kCopyThreads - 1) / kCopyThreads;
  // Every thread has all its units when the head size is the bucket's.
  static constexpr bool kEvenKeys = kKeyChunks % kKeyStep == 0;
  static constexpr bool kEvenValueRows = kD % kCopyThreads == 0;
  // A fragments of Q are kept in registers up to head size 128 with one warp of rows (64 with
  // four, whose CTAs are compute-bound and take a third CTA per SM for the registers, as
  // FlashInfer's prefill reloads Q per tile); above that they would not fit next to the output
  // accumulators and are reloaded per tile.
  static constexpr bool kQueryInRegisters = kD <= (kWide ? 64 : 128);
  static_assert(kD % kValueHalfStep == 0, "value half rows split evenly");
  static_assert(kQueryRow >= kD + 2, "a query row's padding holds a float");
};

// ---- the rows of a lane and the positions of its warp ----------------------------------------

// Rows g and g + 8 of the lane's warp (MMA groupID g): their query positions, head offsets and
// whether the CTA serves them (a padding row's logits are all masked).
struct LaneRows {
  int pos[2];
  int head[2];
  bool valid[2];
};

PA_DEVICE LaneRows lane_rows(const CtaRows& rows, int warp_row0, int g) {
  LaneRows lane{};
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int r = warp_row0 + g + 8 * i;
    const int t = r / rows.heads_per_token;
    lane.head[i] = r % rows.heads_per_token;
    lane.valid[i] = rows.valid(t, lane.head[i]);
    lane.pos[i] = rows.first_pos + t;
  }
  return lane;
}

// The positions of a warp's rows: the union of their ranges (the tiles the warp reads, and where
// values are real data) and the positions all of them attend (tiles without masks; a row with an
// empty range leaves none). From the ranges of the warp's first and last token: a row's range
// moves forward with its position.
struct WarpPositions {
  int union_begin, union_end;
  int common_begin, common_end;
};

template <bool kWide>
PA_DEVICE WarpPositions warp_positions(const AttentionParams& p, const CtaWork& work,
                                       const CtaRows& rows, int warp_row0) {
  // The tokens of the warp's rows: all of the CTA's with one warp of rows.
  const int t_first = kWide ? warp_row0 / rows.heads_per_token : 0;
  int t_last = kWide ? (warp_row0 + kMmaRows - 1) / rows.heads_per_token : rows.tokens - 1;
  if (t_last > rows.tokens - 1) t_last = rows.tokens - 1;
  const PositionRange first_range = attended_range(p, work, rows.first_pos + t_first);
  const PositionRange last_range = attended_range(p, work, rows.first_pos + t_last);
  const bool warp_attends = t_first <= t_last && first_range.begin < last_range.end;
  WarpPositions w{};
  w.union_begin = warp_attends ? first_range.begin : work.end;
  w.union_end = warp_attends ? last_range.end : work.begin;
  w.common_begin = last_range.begin;
  w.common_end = first_range.end;
  return w;
}

// ---- load K/V tiles: the copies of one thread -------------------------------------------------

// Thread j's copies of a tile lie in one block: its keys are of token j % 16, its value units of
// half (j / 8) % 2 of the tile (tokens 8 h .. 8 h + 7, the half holding that token), or of the
// whole tile (fp8 values in blocks of 16 or 32, which hold the whole tile).
template <typename V>
struct MmaTiles {
  using Cache = typename V::Cache;
  static constexpr int kT = V::kT;
  const AttentionParams& p;
  const CtaRows& rows;
  const CtaWork& work;
  int first_tile;
  int my_tiles;
  int warp;
  int copier;  // this thread's index among its ring's copiers
  int half;  // the tile half of this thread's value copies
  const unsigned char* key_head;
  const unsigned char* value_head;
  int64_t key_block_bytes;
  int64_t value_block_bytes;
  int key_chunks;
  // Keys and values of the bucket's head size: every thread copies all its units (one flag for
  // both, so that equal head sizes keep one predicate; a smaller key or value head size takes
  // the bounded copies for both).
  bool whole;

  PA_DEVICE MmaTiles(const AttentionParams& p_, const CtaRows& rows_, const CtaWork& work_,
                     int warp_, int copier_)
      : p(p_), rows(rows_), work(work_), warp(warp_), copier(copier_) {
    first_tile = work.begin >> 4;
    const int num_tiles = ((work.end + 15) >> 4) - first_tile;
    my_tiles = V::kWide ? num_tiles
                        : (num_tiles > warp ? (num_tiles - warp + kAttentionWarps - 1) /
                                                  kAttentionWarps
                                            : 0);
    half = (copier >> 3) & 1;
    key_head = static_cast<const unsigned char*>(p.key_cache) +
               (int64_t{rows.kv_head} * p.key_head_stride) * Cache::kElementBytes;
    value_head = static_cast<const unsigned char*>(p.value_cache) +
                 (int64_t{rows.kv_head} * p.value_head_stride) * Cache::kElementBytes;
    key_block_bytes = p.key_block_stride * Cache::kElementBytes;
    value_block_bytes = p.value_block_stride * Cache::kElementBytes;
    key_chunks = p.head_size / Cache::kX;
    whole = p.head_size == V::kHeadBucket && p.v_head_size == V::kHeadBucket;
  }

  // The tile of this warp's (or the CTA's) i-th iteration: one warp of rows takes tiles warp,
  // warp + 4, ... of the split; four take every tile.
  PA_DEVICE int tile_of(int i) const {
    return V::kWide ? first_tile + i : first_tile + warp + kAttentionWarps * i;
  }

  PA_DEVICE int block(int i) const {
    if (i >= my_tiles) return -1;
    return p.block_size == 8 ? block_id(p, rows, work, tile_of(i) * kT + 8 * half, 8)
                             : block_id(p, rows, work, tile_of(i) * kT, kT);
  }

  template <int kB>
  PA_DEVICE void copy(int i, uint32_t stage, int block) const {
    constexpr bool kFp8 = V::kFp8;
    const int tile = tile_of(i);
    {
      const int t = copier & 15;
      const int pos = tile * kT + t;
      const int chunk = copier >> 4;
      const unsigned char* src =
          key_head + block * key_block_bytes + ((pos & (kB - 1)) + chunk * kB) * 16;
      const uint32_t dst = stage + (chunk * kT + (kFp8 ? fp8_key_row(t) : t)) * 16;
      copy_units<V::kKeyUnits, 16, V::kKeyStep * kB * 16>(
          whole && V::kEvenKeys, src, [&](int j) { return dst + j * V::kKeyStep * kT * 16; },
          units_below(key_chunks, chunk, V::kKeyStep, V::kKeyUnits));
    }
    const uint32_t vstage = stage + V::kKeyTileBytes;
    if constexpr (!kFp8 || kB == 8) {
      // Value half `half` of rows d0 + kValueHalfStep j, d0 = j % 8 + 8 (j / 16): the eight
      // rows one group of eight threads writes fall into eight bank groups.
      const int pos = tile * kT + 8 * half;
      const int d0 = (copier & 7) | ((copier >> 4) << 3);
      const unsigned char* src = value_head + block * value_block_bytes +
                                 (d0 * kB + (pos & (kB - 1))) * Cache::kElementBytes;
      const uint32_t dst = kFp8 ? vstage + d0 * 16 + 8 * half
                                : vstage + (2 * d0 + (half ^ ((d0 >> 2) & 1))) * 16;
      const int count = units_below(p.v_head_size, d0, V::kValueHalfStep, V::kValueHalfUnits);
      if constexpr (kFp8) {
        copy_units<V::kValueHalfUnits, 8, V::kValueHalfStep * kB>(
            whole, src, [&](int j) { return dst + j * V::kValueHalfStep * 16; }, count);
      } else {
        copy_units<V::kValueHalfUnits, 16, V::kValueHalfStep * kB * 2>(
            whole, src, [&](int j) { return dst + j * V::kValueHalfStep * 32; }, count);
      }
    } else {
      const int pos = tile * kT;
      const unsigned char* src =
          value_head + block * value_block_bytes + copier * kB + (pos & (kB - 1));
      copy_units<V::kValueRowUnits, 16, V::kCopyThreads * kB>(
          whole && V::kEvenValueRows, src,
          [&](int j) { return vstage + (V::kCopyThreads * j + copier) * 16; },
          units_below(p.v_head_size, copier, V::kCopyThreads, V::kValueRowUnits));
    }
  }
};

// ---- stage the query ------------------------------------------------------------------------

// The query rows [row][dim] in shared memory (rows of kQueryRow elements). For fp8 caches the
// dims of each k-step are stored permuted (dim 4q + 2h + j of a k-step at column 8h + 2q + j),
// so that ldmatrix hands lane q the dims its fp8 key bytes hold.
template <typename V, typename Storage>
PA_DEVICE void stage_mma_query(const AttentionParams& p, const CtaRows& rows,
                               uint32_t query_offset) {
  stage_query<Storage, V::kRows, V::kHeadBucket>(p, rows, [&](int row, int d) {
    const int r16 = d & 15;
    const int col = V::kFp8 ? (d & ~15) + 8 * ((r16 >> 1) & 1) + 2 * (r16 >> 2) + (r16 & 1) : d;
    return query_offset + 2u * (row * V::kQueryRow + col);
  });
}

// bf16 rows into fp16 for the fp16 MMA of fp8 caches: a power of two per row brings its largest
// element to [2^14, 2^15); the lane's logit scales (rows g and g + 8) undo it. Warp w converts
// rows w, w + 4, ... and leaves each row's descale in the row's padding (past kD elements, never
// read by ldmatrix).
template <typename V>
PA_DEVICE void scale_query_to_fp16(uint32_t query_offset, int warp, int lane, int first_row,
                                   float (&row_scale)[2]) {
  constexpr int kD = V::kHeadBucket;
  const auto descale = [&](int row) { return query_offset + 2u * (row * V::kQueryRow + kD); };
  for (int row = warp; row < V::kRows; row += kAttentionWarps) {
    const uint32_t row_offset = query_offset + 2u * row * V::kQueryRow;
    float largest = 0.0f;
    for (int d = lane; d < kD; d += kWarpSize) {
      const float v = prim::bf16_to_float(*prim::shared<uint16_t>(row_offset + 2u * d));
      largest = prim::max(largest, v < 0 ? -v : v);
    }
#pragma unroll
    for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
      largest = prim::max(largest, prim::shfl_xor(largest, offset));
    }
    const int exponent = static_cast<int>((prim::float_to_bits(largest) >> 23) & 0xffu) - 127;
    int e = largest > 0.0f && exponent < 128 ? 14 - exponent : 0;
    e = e > 100 ? 100 : (e < -100 ? -100 : e);
    const float up = prim::bits_to_float(static_cast<uint32_t>(127 + e) << 23);
    for (int d = lane; d < kD; d += kWarpSize) {
      uint16_t* element = prim::shared<uint16_t>(row_offset + 2u * d);
      *element = prim::float_to_half(prim::bf16_to_float(*element) * up);
    }
    if (lane == 0) {
      *prim::shared<float>(descale(row)) =
          prim::bits_to_float(static_cast<uint32_t>(127 - e) << 23);
    }
  }
  prim::syncthreads();
#pragma unroll
  for (int i = 0; i < 2; ++i) row_scale[i] *= *prim::shared<float>(descale(first_row + 8 * i));
}

// The A fragments of Q: ldmatrix_x4 of the 16 x 16 block of k-step ks of the warp's rows,
// registers 0-3 being rows 0-7 / 8-15 of columns 0-7, then of columns 8-15; loaded once
// (kQueryInRegisters) or per tile.
template <typename V>
struct QueryFragments {
  uint32_t lane_offset;
  uint32_t qa[V::kQueryInRegisters ? V::kKSteps : 1][4];

  PA_DEVICE QueryFragments(uint32_t query_offset, int warp_row0, int lane)
      : lane_offset(query_offset +
                    2u * ((warp_row0 + (lane & 7) + 8 * ((lane >> 3) & 1)) * V::kQueryRow +
                          8 * (lane >> 4))) {
    if constexpr (V::kQueryInRegisters) {
#pragma unroll
      for (int ks = 0; ks < V::kKSteps; ++ks) prim::ldmatrix_x4(qa[ks], lane_offset + 32u * ks);
    }
  }

  PA_DEVICE const uint32_t (&operator()(int ks))[4] {
    if constexpr (V::kQueryInRegisters) {
      return qa[ks];
    } else {
      prim::ldmatrix_x4(qa[0], lane_offset + 32u * ks);
      return qa[0];
    }
  }
};

// ---- per tile: scores, logits, masks, online softmax, value product ----------------------------

// S = Q K^T of one tile: s[nb][c] for columns 8 nb + 2q + c % 2, rows g (c < 2) and g + 8.
// `key_lane` is the lane's ldmatrix row in the stage's key tile: a 16-byte key chunk row is x
// dims of one token, i.e. one row of an 8x8 B fragment.
template <typename V>
PA_DEVICE void compute_scores(float (&s)[2][4], uint32_t stage, uint32_t key_lane,
                              QueryFragments<V>& query) {
  constexpr int kT = V::kT;
#pragma unroll
  for (int nb = 0; nb < 2; ++nb) {
#pragma unroll
    for (int c = 0; c < 4; ++c) s[nb][c] = 0.0f;
  }
  if constexpr (V::kFp8) {
#pragma unroll
    for (int kk = 0; kk < V::kKSteps / 2; ++kk) {
      uint32_t kb[4];
      prim::ldmatrix_x4(kb, stage + key_lane + kk * 2 * kT * 16);
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const uint32_t(&a)[4] = query(2 * kk + h);
#pragma unroll
        for (int nb = 0; nb < 2; ++nb) {
          uint32_t b0, b1;
          V::Cache::to_halves(kb[2 * h + nb], b0, b1);
          prim::mma_16816<V::kMma>(s[nb], a, b0, b1);
        }
      }
    }
  } else {
#pragma unroll
    for (int ks = 0; ks < V::kKSteps; ++ks) {
      uint32_t kb[4];
      prim::ldmatrix_x4(kb, stage + key_lane + ks * 2 * kT * 16);
      const uint32_t(&a)[4] = query(ks);
      prim::mma_16816<V::kMma>(s[0], a, kb[0], kb[1]);
      prim::mma_16816<V::kMma>(s[1], a, kb[2], kb[3]);
    }
  }
}

// Scale, soft cap and ALiBi (slope x (key position - query position)) of a tile's logits; each
// option a branch uniform over the warp.
template <bool kFp8>
PA_DEVICE void transform_logits(float (&s)[2][4], const float (&row_scale)[2],
                                const LogitOptions& options, const float (&slope)[2],
                                const LaneRows& lane, int tile_pos, int q) {
#pragma unroll
  for (int nb = 0; nb < 2; ++nb) {
#pragma unroll
    for (int c = 0; c < 4; ++c) s[nb][c] *= row_scale[c >> 1];
  }
  if (options.soft_cap > 0.0f) {
#pragma unroll
    for (int nb = 0; nb < 2; ++nb) {
#pragma unroll
      for (int c = 0; c < 4; ++c) s[nb][c] = options.soft_capped(s[nb][c]);
    }
  }
  if (options.alibi) {
#pragma unroll
    for (int nb = 0; nb < 2; ++nb) {
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const int pos = tile_pos + s_column_token<kFp8>(8 * nb + 2 * q + (c & 1));
        s[nb][c] += slope[c >> 1] * static_cast<float>(pos - lane.pos[c >> 1]);
      }
    }
  }
}

// Logit -inf (a select, never a product) for the positions a row does not attend: the causal
// and window masks of each row, and every position of a padding row. Only tiles that are not
// inside every row's range (`boundary`) need it.
template <bool kFp8>
PA_DEVICE void mask_logits(float (&s)[2][4], const AttentionParams& p, const CtaWork& work,
                           const LaneRows& lane, int tile_pos, int q) {
#pragma unroll
  for (int nb = 0; nb < 2; ++nb) {
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const int pos = tile_pos + s_column_token<kFp8>(8 * nb + 2 * q + (c & 1));
      const PositionRange r = attended_range(p, work, lane.pos[c >> 1]);
      if (!lane.valid[c >> 1] || pos < r.begin || pos >= r.end) s[nb][c] = -INFINITY;
    }
  }
}

// The online softmax over one tile: the running max of rows g and g + 8 (a quad of lanes
// reduced with two shuffles), the output rescaled only when some row's max grew in the warp,
// P = exp(S - max) added to the lane's running sums and rounded into the A fragments of P V
// (the S accumulators' layout is P's: no shuffle).
template <typename V>
PA_DEVICE void update_softmax(const float (&s)[2][4], float (&row_max)[2], float (&row_sum)[2],
                              float (&o)[V::kNBlocks][4], uint32_t (&pa)[4]) {
  float tile_max[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float v = prim::max(prim::max(s[0][2 * r], s[0][2 * r + 1]),
                        prim::max(s[1][2 * r], s[1][2 * r + 1]));
    v = prim::max(v, prim::shfl_xor(v, 1));
    v = prim::max(v, prim::shfl_xor(v, 2));
    tile_max[r] = prim::max(row_max[r], v);
  }
  if (prim::any(tile_max[0] > row_max[0] || tile_max[1] > row_max[1])) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float alpha =
          row_max[r] == -INFINITY ? 0.0f : prim::exp2((row_max[r] - tile_max[r]) * kLog2e);
      row_sum[r] *= alpha;
#pragma unroll
      for (int nb = 0; nb < V::kNBlocks; ++nb) {
        o[nb][2 * r] *= alpha;
        o[nb][2 * r + 1] *= alpha;
      }
      row_max[r] = tile_max[r];
    }
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const float shifted_max = row_max[r] == -INFINITY ? 0.0f : row_max[r] * kLog2e;
    float e[4];
#pragma unroll
    for (int nb = 0; nb < 2; ++nb) {
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        e[2 * nb + j] = prim::exp2(s[nb][2 * r + j] * kLog2e - shifted_max);
      }
    }
    row_sum[r] += (e[0] + e[1]) + (e[2] + e[3]);
    pa[r] = prim::pack2<V::kMma>(e[0], e[1]);  // register 0 (row g) / 1 (row g + 8)
    pa[2 + r] = prim::pack2<V::kMma>(e[2], e[3]);
  }
}

// O += P V over one tile; `value_lane` is the lane's ldmatrix row in the stage's value tile (a
// value row is x tokens of one dim, one row of an 8x8 B fragment: no transpose). With kMask (a
// tile holding positions no row of the warp attends) the value elements of those positions are
// zeroed in registers first: their weight is 0, but they may be NaN (0 * NaN is NaN inside an
// MMA too).
template <typename V, bool kMask>
PA_DEVICE void accumulate_values(float (&o)[V::kNBlocks][4], const uint32_t (&pa)[4],
                                 uint32_t stage, uint32_t value_lane,
                                 const WarpPositions& warp_pos, int tile_pos, int q) {
  const auto attended = [&](int pos) {
    return pos >= warp_pos.union_begin && pos < warp_pos.union_end;
  };
  if constexpr (V::kFp8) {
    // This lane's value bytes are tokens 4q .. 4q + 3.
    uint32_t keep = 0xffffffffu;
    if constexpr (kMask) {
      keep = 0;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        if (attended(tile_pos + 4 * q + j)) keep |= 0xffu << (8 * j);
      }
    }
#pragma unroll
    for (int nq = 0; nq < V::kNBlocks / 4; ++nq) {
      uint32_t vb[4];
      prim::ldmatrix_x4(vb, stage + value_lane + nq * 32 * 16);
#pragma unroll
      for (int mm = 0; mm < 4; ++mm) {
        uint32_t b0, b1;
        V::Cache::to_halves(kMask ? vb[mm] & keep : vb[mm], b0, b1);
        prim::mma_16816<V::kMma>(o[4 * nq + mm], pa, b0, b1);
      }
    }
  } else {
    // This lane's value elements are tokens 2q, 2q + 1 (registers 0, 2) and 8 + 2q, 9 + 2q
    // (registers 1, 3).
    uint32_t keep[2] = {0xffffffffu, 0xffffffffu};
    if constexpr (kMask) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        keep[h] = 0;
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          if (attended(tile_pos + 8 * h + 2 * q + j)) keep[h] |= 0xffffu << (16 * j);
        }
      }
    }
#pragma unroll
    for (int np = 0; np < V::kNBlocks / 2; ++np) {
      uint32_t vb[4];
      prim::ldmatrix_x4(vb, stage + value_lane + np * 2 * 16 * 16);
      if constexpr (kMask) {
#pragma unroll
        for (int r = 0; r < 4; ++r) vb[r] &= keep[r & 1];
      }
      prim::mma_16816<V::kMma>(o[2 * np], pa, vb[0], vb[1]);
      prim::mma_16816<V::kMma>(o[2 * np + 1], pa, vb[2], vb[3]);
    }
  }
}

// ---- the rows' softmax states into the merge buffer -------------------------------------------

// The lane's sums are of its columns: the quad's four are added first. The caller has
// synchronised the CTA (the ring and the query rows are free: the merge buffer overlays them).
template <typename V>
PA_DEVICE void store_states(const float (&o)[V::kNBlocks][4], const float (&row_max)[2],
                            float (&row_sum)[2], const LaneRows& lane, int contributor,
                            int first_row, int q) {
  using Merge = MergeLayout<V::kRows, V::kContributors, V::kHeadBucket>;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    row_sum[r] += prim::shfl_xor(row_sum[r], 1);
    row_sum[r] += prim::shfl_xor(row_sum[r], 2);
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = first_row + 8 * r;
    if (lane.valid[r]) {
#pragma unroll
      for (int nb = 0; nb < V::kNBlocks; ++nb) {
        const int d = 8 * nb + 2 * q;
        *prim::shared<float>(Merge::o(contributor, row, d)) = o[nb][2 * r];
        *prim::shared<float>(Merge::o(contributor, row, d + 1)) = o[nb][2 * r + 1];
      }
      if (q == 0) {
        *prim::shared<float>(Merge::max(contributor, row)) = row_max[r];
        *prim::shared<float>(Merge::sum(contributor, row)) = row_sum[r];
      }
    }
  }
}

// ---- the kernel body --------------------------------------------------------------------------

template <typename Scalar, CacheDtype kCache, int kD, int kRowWarps, int kStages>
PA_DEVICE void mma_attention(const AttentionParams& p, const AttentionLaunch& launch) {
  using V = MmaVariant<Scalar, kCache, kD, kRowWarps, kStages>;
  constexpr int kT = V::kT;
  const int tid = prim::thread_index();
  const int warp = tid / kWarpSize;
  const int lane_id = tid % kWarpSize;
  const int g = lane_id / 4;  // MMA groupID: rows g and g + 8
  const int q = lane_id % 4;  // MMA threadID_in_group

  CtaRows rows;
  CtaWork work;
  if (!claim_cta<Scalar>(p, launch, rows, work)) return;
  const KernelShape shape = attention_kernel_shape(Scalar::kKind, kCache, kD, p.num_heads,
                                                   p.num_kv_heads, kRowWarps, kStages);
  const int warp_row0 = V::kWide ? kMmaRows * warp : 0;
  const LaneRows lane = lane_rows(rows, warp_row0, g);
  const WarpPositions warp_pos = warp_positions<V::kWide>(p, work, rows, warp_row0);

  // Load K/V tiles: the ring (per warp with one warp of rows, per CTA with four) starts before
  // the query is staged.
  const int copier = V::kWide ? tid : lane_id;
  const MmaTiles<V> tiles(p, rows, work, warp, copier);
  KvRing<kStages, V::kCopyThreads, V::kStageBytes, MmaTiles<V>> ring{
      tiles, V::kWide ? 0u : static_cast<uint32_t>(warp) * kStages * V::kStageBytes,
      p.block_size, 0};
  ring.template zero_key_padding<V::kKeyChunks, kT>(tiles.key_chunks, copier);
  ring.start();

  // Stage the query; the logit scale of rows g and g + 8 (fp8 caches fold in k_scale).
  stage_mma_query<V, typename Scalar::Storage>(p, rows, shape.query_offset);
  prim::syncthreads();
  const float k_scale = V::kFp8 ? prim::load(p.k_scale) : 1.0f;
  float row_scale[2] = {p.scale * k_scale, p.scale * k_scale};
  if constexpr (V::Cache::kScaleQuery) {
    scale_query_to_fp16<V>(shape.query_offset, warp, lane_id, warp_row0 + g, row_scale);
  }
  QueryFragments<V> query(shape.query_offset, warp_row0, lane_id);
  const LogitOptions options(p, launch);
  float slope[2] = {0.0f, 0.0f};
  if (options.alibi) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      if (lane.valid[i]) slope[i] = prim::load(p.alibi_slopes + rows.first_head + lane.head[i]);
    }
  }

  // The running softmax state (this lane's columns of rows g and g + 8) and output
  // accumulators.
  float o[V::kNBlocks][4];
#pragma unroll
  for (int nb = 0; nb < V::kNBlocks; ++nb) {
#pragma unroll
    for (int c = 0; c < 4; ++c) o[nb][c] = 0.0f;
  }
  float row_max[2] = {-INFINITY, -INFINITY};
  float row_sum[2] = {0.0f, 0.0f};

  // Per-lane ldmatrix row offsets inside a stage (see the layouts above).
  const int m = lane_id >> 3, r8 = lane_id & 7;
  const uint32_t key_lane =
      V::kFp8 ? static_cast<uint32_t>(
                    ((m >> 1) * kT + fp8_key_row(4 * (r8 >> 1) + 2 * (m & 1) + (r8 & 1))) * 16)
              : static_cast<uint32_t>(((m & 1) * kT + r8 + 8 * (m >> 1)) * 16);
  const int vd0 = 8 * (m >> 1) + r8;
  const uint32_t value_lane =
      V::kKeyTileBytes +
      (V::kFp8 ? static_cast<uint32_t>(lane_id * 16)
               : static_cast<uint32_t>((2 * vd0 + ((m & 1) ^ ((vd0 >> 2) & 1))) * 16));

  for (int i = 0; i < tiles.my_tiles; ++i) {
    ring.wait_for(i);
    const int tile_pos = tiles.tile_of(i) * kT;
    if (V::kWide && (tile_pos >= warp_pos.union_end || tile_pos + kT <= warp_pos.union_begin)) {
      continue;  // none of the warp's rows attends the tile
    }
    const uint32_t stage = ring.stage(i);
    float s[2][4];
    compute_scores<V>(s, stage, key_lane, query);
    transform_logits<V::kFp8>(s, row_scale, options, slope, lane, tile_pos, q);
    if (tile_pos < warp_pos.common_begin || tile_pos + kT > warp_pos.common_end) {
      mask_logits<V::kFp8>(s, p, work, lane, tile_pos, q);
    }
    uint32_t pa[4];
    update_softmax<V>(s, row_max, row_sum, o, pa);
    if (tile_pos < warp_pos.union_begin || tile_pos + kT > warp_pos.union_end) {
      accumulate_values<V, true>(o, pa, stage, value_lane, warp_pos, tile_pos, q);
    } else {
      accumulate_values<V, false>(o, pa, stage, value_lane, warp_pos, tile_pos, q);
    }
  }

  prim::syncthreads();
  store_states<V>(o, row_max, row_sum, lane, V::kWide ? 0 : warp, warp_row0 + g, q);
  prim::syncthreads();
  const float v_scale = V::kFp8 ? prim::load(p.v_scale) : 1.0f;
  merge_and_store<Scalar, V::kRows, V::kContributors, kD>(p, launch, rows, work.split,
                                                          shape.weights_offset, v_scale);
}

}  // namespace paged_attention::cuda
