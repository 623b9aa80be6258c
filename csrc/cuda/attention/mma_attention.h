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
// [head_size][16 tokens]. 16-bit values are swizzled (the two 16-byte halves of row d swap when
// bit 2 of d is set) and fp8 keys of tokens 8..15 move by two rows, so that the eight rows of
// every 8x8 matrix ldmatrix reads fall into eight different bank groups.
//
// NaN safety: positions a row does not attend get logit -inf (a select, never a product), and
// in tiles that hold positions no row of the warp attends their value elements are zeroed in
// registers before the MMA (0 * NaN is NaN inside an MMA too); key chunks past a head size
// below the bucket's are zero in every stage, as are the query's dims there.
#pragma once

#include <cstdint>

#include "cuda/attention/attention_common.h"

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


template <typename Scalar, CacheDtype kCache, int kD, int kRowWarps, int kStages>
PA_DEVICE void mma_attention(const AttentionParams& p, const AttentionLaunch& launch) {
  using Cache = MmaCache<Scalar, kCache>;
  using QueryStorage = typename Scalar::Storage;
  constexpr bool kFp8 = Cache::kFp8;
  constexpr prim::MmaType kMma = Cache::kMma;
  constexpr bool kWide = kRowWarps > 1;
  constexpr int kRows = kMmaRows * kRowWarps;
  constexpr int kContributors = merge_contributors(kRowWarps);
  // The threads that fill one ring: its warp, or the whole CTA.
  constexpr int kCopyThreads = kWide ? kAttentionThreads : kWarpSize;
  constexpr int kT = 16;
  constexpr int kKSteps = kD / 16;
  constexpr int kNBlocks = kD / 8;
  constexpr uint32_t kKeyTileBytes = kT * kD * Cache::kElementBytes;
  constexpr uint32_t kStageBytes = 2 * kKeyTileBytes;
  constexpr int kQueryRow = query_row_elements(KernelFamily::kTensorCore, kD);
  // Tile copies: a key unit is 16 bytes of (chunk, token); thread j copies token j % 16 of
  // chunks j / 16 + kKeyStep i. A value unit is half a row (8 tokens) of 16-bit values or of
  // fp8 values in blocks of 8, thread j copying half (j / 8) % 2 of rows j % 8 + 8 (j / 16) +
  // kValueHalfStep i; or a whole fp8 row of 16 tokens, thread j copying rows
  // j + kCopyThreads i.
  constexpr int kKeyChunks = kD / Cache::kX;
  constexpr int kKeyStep = kCopyThreads / 16;
  constexpr int kKeyUnits = (kKeyChunks + kKeyStep - 1) / kKeyStep;
  constexpr int kValueHalfStep = kCopyThreads / 2;
  constexpr int kValueHalfUnits = kD / kValueHalfStep;
  constexpr int kValueRowUnits = (kD + kCopyThreads - 1) / kCopyThreads;
  // Every thread has all its units when the head size is the bucket's.
  constexpr bool kEvenKeys = kKeyChunks % kKeyStep == 0;
  constexpr bool kEvenValueRows = kD % kCopyThreads == 0;
  static_assert(kD % kValueHalfStep == 0, "value half rows split evenly");
  static_assert(kQueryRow >= kD + 2, "a query row's padding holds a float");
  using Merge = MergeLayout<kRows, kContributors, kD>;

  const int tid = prim::thread_index();
  const int warp = tid / kWarpSize;
  const int lane = tid % kWarpSize;
  const int g = lane / 4;  // MMA groupID: rows g and g + 8
  const int q = lane % 4;  // MMA threadID_in_group
  const int copier = kWide ? tid : lane;  // this thread's index among its ring's copiers
  const prim::Index3 block = prim::block_index();

  const CtaRows rows = cta_rows(p, launch, block.x, block.y);
  if (rows.tokens <= 0) return;
  const CtaWork work = cta_work(p, launch, rows, block.z);
  if (work.begin >= work.end) {
    store_empty<Scalar>(p, launch, rows, work.split);
    return;
  }
  const KernelShape shape = attention_kernel_shape(Scalar::kKind, kCache, kD, p.num_heads,
                                                   p.num_kv_heads, kRowWarps, kStages);

  // ---- this lane's two rows (g and g + 8 of its warp's 16) --------------------------------
  const int warp_row0 = kWide ? kMmaRows * warp : 0;
  int row_pos[2];  // query positions
  int row_head[2];  // head offsets
  bool row_valid[2];  // false for padding rows, whose logits are all masked
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int r = warp_row0 + g + 8 * i;
    const int t = r / rows.heads_per_token;
    row_head[i] = r % rows.heads_per_token;
    row_valid[i] = rows.valid(t, row_head[i]);
    row_pos[i] = rows.first_pos + t;
  }
  // The tokens of the warp's rows ([t_first, t_last]; all of the CTA's with one warp of rows),
  // and from them (a row's range moves forward with its position): the union of their ranges
  // (the tiles the warp reads, and where values are real data) and the positions all of them
  // attend (tiles without masks; a row with an empty range leaves none).
  const int t_first = kWide ? warp_row0 / rows.heads_per_token : 0;
  int t_last = kWide ? (warp_row0 + kMmaRows - 1) / rows.heads_per_token : rows.tokens - 1;
  if (t_last > rows.tokens - 1) t_last = rows.tokens - 1;
  const PositionRange first_range = attended_range(p, work, rows.first_pos + t_first);
  const PositionRange last_range = attended_range(p, work, rows.first_pos + t_last);
  const bool warp_attends = t_first <= t_last && first_range.begin < last_range.end;
  const int union_begin = warp_attends ? first_range.begin : work.end;
  const int union_end = warp_attends ? last_range.end : work.begin;
  const int common_begin = last_range.begin, common_end = first_range.end;

  const int head_size = p.head_size;
  const int block_size = p.block_size;

  // ---- the ring: per warp (one warp of rows) or per CTA (four) ----------------------------
  const int first_tile = work.begin >> 4;
  const int num_tiles = ((work.end + 15) >> 4) - first_tile;
  const int my_tiles = kWide ? num_tiles
                             : (num_tiles > warp ? (num_tiles - warp + kAttentionWarps - 1) /
                                                       kAttentionWarps
                                                 : 0);
  const auto tile_of = [&](int i) {
    return kWide ? first_tile + i : first_tile + warp + kAttentionWarps * i;
  };
  const uint32_t ring = kWide ? 0u : static_cast<uint32_t>(warp) * kStages * kStageBytes;
  const auto* key_head = static_cast<const unsigned char*>(p.key_cache) +
                         (int64_t{rows.kv_head} * p.key_head_stride) * Cache::kElementBytes;
  const auto* value_head = static_cast<const unsigned char*>(p.value_cache) +
                           (int64_t{rows.kv_head} * p.value_head_stride) * Cache::kElementBytes;
  const int64_t key_block_bytes = p.key_block_stride * Cache::kElementBytes;
  const int64_t value_block_bytes = p.value_block_stride * Cache::kElementBytes;
  const int key_chunks = head_size / Cache::kX;
  const bool whole = head_size == kD;  // no padding: every thread copies all its units

  // Thread j's copies of a tile lie in one block: its keys are of token j % 16, its value units
  // of half (j / 8) % 2 of the tile (tokens 8 h .. 8 h + 7, the half holding that token), or of
  // the whole tile (fp8 values in blocks of 16 or 32, which hold the whole tile). The physical
  // block of this thread's copies of the i-th tile, or -1 (nothing to copy).
  const int half = (copier >> 3) & 1;
  const auto tile_block = [&](int i) {
    if (i >= my_tiles) return -1;
    return block_size == 8 ? block_id(p, rows, work, tile_of(i) * kT + 8 * half, 8)
                           : block_id(p, rows, work, tile_of(i) * kT, kT);
  };

  // The copies of the i-th tile into its stage, for a block size of kB (the strides between
  // one thread's copies are then immediates).
  const auto issue_tile = [&]<int kB>(int i, int block) {
    const int tile = tile_of(i);
    const uint32_t stage = ring + static_cast<uint32_t>(i % kStages) * kStageBytes;
    {
      const int t = copier & 15;
      const int pos = tile * kT + t;
      const int chunk = copier >> 4;
      const unsigned char* src =
          key_head + block * key_block_bytes + ((pos & (kB - 1)) + chunk * kB) * 16;
      const uint32_t dst = stage + (chunk * kT + (kFp8 ? fp8_key_row(t) : t)) * 16;
      copy_units<kKeyUnits, 16, kKeyStep * kB * 16>(
          whole && kEvenKeys, src, [&](int j) { return dst + j * kKeyStep * kT * 16; },
          units_below(key_chunks, chunk, kKeyStep, kKeyUnits));
    }
    const uint32_t vstage = stage + kKeyTileBytes;
    if constexpr (!kFp8 || kB == 8) {
      // Value half `half` of rows d0 + kValueHalfStep j, d0 = j % 8 + 8 (j / 16): the eight
      // rows one group of eight threads writes fall into eight bank groups.
      const int pos = tile * kT + 8 * half;
      const int d0 = (copier & 7) | ((copier >> 4) << 3);
      const unsigned char* src = value_head + block * value_block_bytes +
                                 (d0 * kB + (pos & (kB - 1))) * Cache::kElementBytes;
      const uint32_t dst = kFp8 ? vstage + d0 * 16 + 8 * half
                                : vstage + (2 * d0 + (half ^ ((d0 >> 2) & 1))) * 16;
      const int count = units_below(head_size, d0, kValueHalfStep, kValueHalfUnits);
      if constexpr (kFp8) {
        copy_units<kValueHalfUnits, 8, kValueHalfStep * kB>(
            whole, src, [&](int j) { return dst + j * kValueHalfStep * 16; }, count);
      } else {
        copy_units<kValueHalfUnits, 16, kValueHalfStep * kB * 2>(
            whole, src, [&](int j) { return dst + j * kValueHalfStep * 32; }, count);
      }
    } else {
      const int pos = tile * kT;
      const unsigned char* src =
          value_head + block * value_block_bytes + copier * kB + (pos & (kB - 1));
      copy_units<kValueRowUnits, 16, kCopyThreads * kB>(
          whole && kEvenValueRows, src,
          [&](int j) { return vstage + (kCopyThreads * j + copier) * 16; },
          units_below(head_size, copier, kCopyThreads, kValueRowUnits));
    }
  };
  // Issues the i-th tile (if this thread has copies of it) and commits them as one group.
  const auto issue = [&](int i, int block) {
    if (block >= 0) {
      if (block_size == 16) {
        issue_tile.template operator()<16>(i, block);
      } else if (block_size == 32) {
        issue_tile.template operator()<32>(i, block);
      } else {
        issue_tile.template operator()<8>(i, block);
      }
    }
    prim::cp_async_commit();
  };
  const auto ring_barrier = [] {
    if constexpr (kWide) {
      prim::syncthreads();
    } else {
      prim::syncwarp();
    }
  };

  // A head size below the bucket's: the key chunks past it are never copied; zero them once
  // in every stage, so that the bucket's k-steps add 0 * 0 there. (Value rows past it only
  // reach output columns that are never stored.)
  if (key_chunks * Cache::kX < kD) {
    for (int stage = 0; stage < kStages; ++stage) {
      const uint32_t first = ring + stage * kStageBytes + key_chunks * kT * 16;
      for (int w = copier; w < (kKeyChunks - key_chunks) * kT * 4; w += kCopyThreads) {
        *prim::shared<uint32_t>(first + 4u * w) = 0;
      }
    }
    ring_barrier();
  }

  // The first stages go out before the query is loaded (a one-stage ring: the first tile);
  // block ids run one tile ahead.
  int next_block = tile_block(0);
  const auto issue_ahead = [&](int i) {
    const int block = next_block;
    next_block = tile_block(i + 1);
    issue(i, block);
  };
#pragma unroll 1
  for (int i = 0; i < (kStages > 1 ? kStages - 1 : 1); ++i) issue_ahead(i);

  // ---- the query: rows [row][dim] in shared memory, zero past the rows and the head size ---
  // For fp8 caches the dims of each k-step are stored permuted (dim 4q + 2h + j of a k-step at
  // column 8h + 2q + j), so that ldmatrix hands lane q the dims its fp8 key bytes hold.
  {
    const auto* query = static_cast<const QueryStorage*>(p.query);
    for (int i = tid; i < kRows * kD; i += kAttentionThreads) {
      const int row = i / kD, d = i % kD;
      const int t = row / rows.heads_per_token, h = row % rows.heads_per_token;
      QueryStorage v = 0;  // +0 in every format
      if (rows.valid(t, h) && d < head_size) {
        v = prim::load(query + int64_t{rows.first_token + t} * p.query_seq_stride +
                       int64_t{rows.first_head + h} * p.query_head_stride + d);
      }
      const int r16 = d & 15;
      const int col =
          kFp8 ? (d & ~15) + 8 * ((r16 >> 1) & 1) + 2 * (r16 >> 2) + (r16 & 1) : d;
      *prim::shared<QueryStorage>(shape.query_offset + 2u * (row * kQueryRow + col)) = v;
    }
  }
  prim::syncthreads();
  // The logit scale of rows g and g + 8; fp8 caches fold in k_scale.
  const float k_scale = kFp8 ? prim::load(p.k_scale) : 1.0f;
  float row_scale[2] = {p.scale * k_scale, p.scale * k_scale};
  if constexpr (Cache::kScaleQuery) {
    // bf16 rows into fp16 for the fp16 MMA: a power of two per row brings its largest element
    // to [2^14, 2^15); the logit scale undoes it. Warp w converts rows w, w + 4, ... and leaves
    // each row's descale in the row's padding (past kD elements, never read by ldmatrix).
    const auto descale = [&](int row) {
      return shape.query_offset + 2u * (row * kQueryRow + kD);
    };
    for (int row = warp; row < kRows; row += kAttentionWarps) {
      const uint32_t row_offset = shape.query_offset + 2u * row * kQueryRow;
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
    for (int i = 0; i < 2; ++i) {
      row_scale[i] *= *prim::shared<float>(descale(warp_row0 + g + 8 * i));
    }
  }
  // A fragments of Q (ldmatrix_x4 of the 16 x 16 block of k-step ks of the warp's rows):
  // registers 0-3 are rows 0-7 / 8-15 of columns 0-7, then of columns 8-15. Kept in registers
  // up to head size 128 with one warp of rows (64 with four, whose CTAs are compute-bound and
  // take a third CTA per SM for the registers, as FlashInfer's prefill reloads Q per tile); above
  // that they would not fit next to the output accumulators and are reloaded per tile.
  constexpr bool kQueryInRegisters = kD <= (kWide ? 64 : 128);
  const uint32_t query_lane =
      shape.query_offset +
      2u * ((warp_row0 + (lane & 7) + 8 * ((lane >> 3) & 1)) * kQueryRow + 8 * (lane >> 4));
  uint32_t qa[kQueryInRegisters ? kKSteps : 1][4];
  if constexpr (kQueryInRegisters) {
#pragma unroll
    for (int ks = 0; ks < kKSteps; ++ks) prim::ldmatrix_x4(qa[ks], query_lane + 32u * ks);
  }
  const auto query_fragment = [&](int ks) -> const uint32_t(&)[4] {
    if constexpr (kQueryInRegisters) {
      return qa[ks];
    } else {
      prim::ldmatrix_x4(qa[0], query_lane + 32u * ks);
      return qa[0];
    }
  };
  float slope[2] = {0.0f, 0.0f};
  const bool has_alibi = p.alibi_slopes != nullptr;
  if (has_alibi) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      if (row_valid[i]) slope[i] = prim::load(p.alibi_slopes + rows.first_head + row_head[i]);
    }
  }
  const float soft_cap = p.logits_soft_cap;
  const float inverse_cap = launch.inverse_soft_cap;

  // ---- running softmax state and output accumulators ------------------------------------
  float o[kNBlocks][4];
#pragma unroll
  for (int nb = 0; nb < kNBlocks; ++nb) {
#pragma unroll
    for (int c = 0; c < 4; ++c) o[nb][c] = 0.0f;
  }
  float row_max[2] = {-INFINITY, -INFINITY};
  float row_sum[2] = {0.0f, 0.0f};  // this lane's columns only; the quad is summed at the end

  // Per-lane ldmatrix row offsets inside a stage (see the layouts above).
  const int m = lane >> 3, r8 = lane & 7;
  const uint32_t key_lane =
      kFp8 ? static_cast<uint32_t>(
                 ((m >> 1) * kT + fp8_key_row(4 * (r8 >> 1) + 2 * (m & 1) + (r8 & 1))) * 16)
           : static_cast<uint32_t>(((m & 1) * kT + r8 + 8 * (m >> 1)) * 16);
  const int vd0 = 8 * (m >> 1) + r8;
  const uint32_t value_lane =
      kKeyTileBytes + (kFp8 ? static_cast<uint32_t>(lane * 16)
                            : static_cast<uint32_t>((2 * vd0 + ((m & 1) ^ ((vd0 >> 2) & 1))) * 16));

  for (int i = 0; i < my_tiles; ++i) {
    // Tile i has landed for this thread; after the barrier for every copier, and every warp is
    // done with tile i - 1, whose stage the next issue refills. A one-stage ring refills its
    // stage only then, and waits for it.
    if constexpr (kStages == 1) {
      if (i > 0) {
        ring_barrier();
        issue_ahead(i);
      }
      prim::cp_async_wait<0>();
      ring_barrier();
    } else {
      prim::cp_async_wait<kStages - 2>();
      ring_barrier();
      issue_ahead(i + kStages - 1);
    }
    const int tile_pos = tile_of(i) * kT;
    if (kWide && (tile_pos >= union_end || tile_pos + kT <= union_begin)) continue;
    const uint32_t stage = ring + static_cast<uint32_t>(i % kStages) * kStageBytes;

    // S = Q K^T: s[nb][c] for columns 8 nb + 2q + c % 2, rows g (c < 2) and g + 8.
    float s[2][4];
#pragma unroll
    for (int nb = 0; nb < 2; ++nb) {
#pragma unroll
      for (int c = 0; c < 4; ++c) s[nb][c] = 0.0f;
    }
    if constexpr (kFp8) {
#pragma unroll
      for (int kk = 0; kk < kKSteps / 2; ++kk) {
        uint32_t kb[4];
        prim::ldmatrix_x4(kb, stage + key_lane + kk * 2 * kT * 16);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const uint32_t(&a)[4] = query_fragment(2 * kk + h);
#pragma unroll
          for (int nb = 0; nb < 2; ++nb) {
            uint32_t b0, b1;
            Cache::to_halves(kb[2 * h + nb], b0, b1);
            prim::mma_16816<kMma>(s[nb], a, b0, b1);
          }
        }
      }
    } else {
#pragma unroll
      for (int ks = 0; ks < kKSteps; ++ks) {
        uint32_t kb[4];
        prim::ldmatrix_x4(kb, stage + key_lane + ks * 2 * kT * 16);
        const uint32_t(&a)[4] = query_fragment(ks);
        prim::mma_16816<kMma>(s[0], a, kb[0], kb[1]);
        prim::mma_16816<kMma>(s[1], a, kb[2], kb[3]);
      }
    }

    // Logits: scale, soft-cap, ALiBi, masking (each a branch uniform over the warp).
#pragma unroll
    for (int nb = 0; nb < 2; ++nb) {
#pragma unroll
      for (int c = 0; c < 4; ++c) s[nb][c] *= row_scale[c >> 1];
    }
    if (soft_cap > 0.0f) {
#pragma unroll
      for (int nb = 0; nb < 2; ++nb) {
#pragma unroll
        for (int c = 0; c < 4; ++c) s[nb][c] = soft_cap * prim::tanh(s[nb][c] * inverse_cap);
      }
    }
    if (has_alibi) {
#pragma unroll
      for (int nb = 0; nb < 2; ++nb) {
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          const int pos = tile_pos + s_column_token<kFp8>(8 * nb + 2 * q + (c & 1));
          s[nb][c] += slope[c >> 1] * static_cast<float>(pos - row_pos[c >> 1]);
        }
      }
    }
    const bool boundary = tile_pos < common_begin || tile_pos + kT > common_end;
    if (boundary) {
#pragma unroll
      for (int nb = 0; nb < 2; ++nb) {
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          const int pos = tile_pos + s_column_token<kFp8>(8 * nb + 2 * q + (c & 1));
          const PositionRange r = attended_range(p, work, row_pos[c >> 1]);
          if (!row_valid[c >> 1] || pos < r.begin || pos >= r.end) s[nb][c] = -INFINITY;
        }
      }
    }

    // Running max; rescale only when it grew somewhere in the warp.
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
        for (int nb = 0; nb < kNBlocks; ++nb) {
          o[nb][2 * r] *= alpha;
          o[nb][2 * r + 1] *= alpha;
        }
        row_max[r] = tile_max[r];
      }
    }

    // P = exp(S - max), rounded into the A fragments of P V.
    uint32_t pa[4];
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
      pa[r] = prim::pack2<kMma>(e[0], e[1]);  // register 0 (row g) / 1 (row g + 8)
      pa[2 + r] = prim::pack2<kMma>(e[2], e[3]);
    }

    // O += P V. In tiles holding positions no row of the warp attends their value elements are
    // zeroed in registers first: their weight is 0, but the values may be NaN (0 * NaN is NaN
    // inside an MMA too).
    const auto accumulate_values = [&]<bool kMask>() {
      if constexpr (kFp8) {
        // This lane's value bytes are tokens 4q .. 4q + 3.
        uint32_t keep = 0xffffffffu;
        if constexpr (kMask) {
          keep = 0;
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            const int pos = tile_pos + 4 * q + j;
            if (pos >= union_begin && pos < union_end) keep |= 0xffu << (8 * j);
          }
        }
#pragma unroll
        for (int nq = 0; nq < kNBlocks / 4; ++nq) {
          uint32_t vb[4];
          prim::ldmatrix_x4(vb, stage + value_lane + nq * 32 * 16);
#pragma unroll
          for (int mm = 0; mm < 4; ++mm) {
            uint32_t b0, b1;
            Cache::to_halves(kMask ? vb[mm] & keep : vb[mm], b0, b1);
            prim::mma_16816<kMma>(o[4 * nq + mm], pa, b0, b1);
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
              const int pos = tile_pos + 8 * h + 2 * q + j;
              if (pos >= union_begin && pos < union_end) keep[h] |= 0xffffu << (16 * j);
            }
          }
        }
#pragma unroll
        for (int np = 0; np < kNBlocks / 2; ++np) {
          uint32_t vb[4];
          prim::ldmatrix_x4(vb, stage + value_lane + np * 2 * 16 * 16);
          if constexpr (kMask) {
#pragma unroll
            for (int r = 0; r < 4; ++r) vb[r] &= keep[r & 1];
          }
          prim::mma_16816<kMma>(o[2 * np], pa, vb[0], vb[1]);
          prim::mma_16816<kMma>(o[2 * np + 1], pa, vb[2], vb[3]);
        }
      }
    };
    if (tile_pos < union_begin || tile_pos + kT > union_end) {
      accumulate_values.template operator()<true>();
    } else {
      accumulate_values.template operator()<false>();
    }
  }

  // ---- the rows' softmax states into the merge buffer -------------------------------------
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    row_sum[r] += prim::shfl_xor(row_sum[r], 1);
    row_sum[r] += prim::shfl_xor(row_sum[r], 2);
  }
  prim::syncthreads();  // the ring and the query rows are free: the merge buffer overlays them
  const int contributor = kWide ? 0 : warp;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = warp_row0 + g + 8 * r;
    if (row_valid[r]) {
#pragma unroll
      for (int nb = 0; nb < kNBlocks; ++nb) {
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
  prim::syncthreads();
  const float v_scale = kFp8 ? prim::load(p.v_scale) : 1.0f;
  merge_and_store<Scalar, kRows, kContributors, kD>(p, launch, rows, work.split,
                                                    shape.weights_offset, v_scale);
}

}  // namespace paged_attention::cuda
