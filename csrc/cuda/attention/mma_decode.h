// Decode attention on tensor cores, for fp16/bf16 queries (fp16/bf16 or fp8 caches).
//
// The design follows FlashInfer's decode for grouped queries (its prefill kernel with the GQA
// group packed into one 16-row query tile; flashinfer-ai/flashinfer,
// include/flashinfer/attention/prefill.cuh): one CTA of four warps per (sequence, KV head[, GQA
// chunk], split of the sequence); the query heads of the group are the M rows of
// mma.m16n8k16 (padded to 16), tokens are N. The code is this project's own.
//
// Per warp, tiles of 16 tokens (tile t covers positions 16 t .. 16 t + 15, so a tile never
// straddles a block of 16 or 32 and holds two blocks of 8); warp w takes the CTA's tiles
// w, w + 4, ... through a ring of two or three shared-memory stages filled by cp.async,
// waited for by the warp alone. Per tile:
//   S = Q K^T      ldmatrix on the key tile as the cache lays it out: a 16-byte key chunk row is
//                  x dims of one token, i.e. one row of an 8x8 B fragment; fp32 accumulators.
//   softmax        scale, soft-cap, ALiBi, masking, running max and sum in registers (rows of
//                  a quad of lanes reduced with two shuffles); the output accumulators are
//                  rescaled only when some row's max grew.
//   O += P V       the S accumulators, rounded to 16 bits, are the A fragments of P directly;
//                  a value row is x tokens of one dim, one row of an 8x8 B fragment, so V needs
//                  no transpose either.
// At the end the four warps' states are merged in shared memory (decode_common.h).
//
// fp8 caches: the MMA runs in fp16 (both fp8 formats convert to fp16 exactly: e4m3 with cvt on
// sm_89+, e5m2 by a byte shift); bf16 queries are scaled per row by a power of two into fp16's
// range, and the logit scale undoes it. A 16-byte fp8 key row holds 16 dims, which ldmatrix
// (b16) hands out as dims 4q..4q+3 to lane q of a quad: the query fragments use the same
// permutation of the k dimension. A fp8 value row holds 16 tokens, handed out as tokens
// 4q..4q+3; the S columns (key rows) are permuted to match (column 2q + j and 8 + 2q + j hold
// tokens 4q + j and 4q + 2 + j), so P is still S in registers.
//
// Shared memory per warp and stage: the key tile [chunk][16 tokens][16 B] and the value tile
// [head_size][16 tokens]. 16-bit values are swizzled (the two 16-byte halves of row d swap when
// bit 2 of d is set) and fp8 keys of tokens 8..15 move by two rows, so that the eight rows of
// every 8x8 matrix ldmatrix reads fall into eight different bank groups.
//
// NaN safety: tokens outside [begin, end) get logit -inf (a select, never a product), and in
// tiles that hold such tokens their value elements are zeroed in registers before the MMA
// (0 * NaN is NaN inside an MMA too); in the last k-step of a head size that is not a multiple
// of 16 the missing dims are zeroed.
#pragma once

#include <cstdint>

#include "cuda/attention/decode_common.h"

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

template <typename Scalar, CacheDtype kCache, int kD>
PA_DEVICE void mma_decode(const AttentionParams& p, const DecodeLaunch& launch) {
  using Cache = MmaCache<Scalar, kCache>;
  using QueryStorage = typename Scalar::Storage;
  constexpr bool kFp8 = Cache::kFp8;
  constexpr prim::MmaType kMma = Cache::kMma;
  constexpr int kT = 16;
  constexpr int kStages = ring_stages(kD, Cache::kElementBytes);
  constexpr int kKSteps = kD / 16;
  constexpr int kNBlocks = kD / 8;
  constexpr uint32_t kKeyTileBytes = kT * kD * Cache::kElementBytes;
  constexpr uint32_t kStageBytes = 2 * kKeyTileBytes;
  constexpr int kQueryRow = query_row_elements(KernelFamily::kTensorCore, kD);
  using Merge = MergeLayout<kMmaRows, kD>;

  const int tid = prim::thread_index();
  const int warp = tid / kWarpSize;
  const int lane = tid % kWarpSize;
  const int g = lane / 4;  // MMA groupID: rows g and g + 8
  const int q = lane % 4;  // MMA threadID_in_group

  const CtaWork work = cta_work(p, launch);
  if (work.begin >= work.end) {
    store_empty<Scalar>(p, launch, work);
    return;
  }
  const KernelShape shape =
      attention_kernel_shape(Scalar::kKind, kCache, kD, p.num_heads, p.num_kv_heads);
  stage_block_ids(p, work, shape.block_ids_offset);

  const int head_size = p.head_size;
  const int block_size = p.block_size;
  const int shift = work.block_shift;

  // ---- the ring: warp-local stages of one tile each --------------------------------------
  const int my_tiles = work.num_tiles > warp ? (work.num_tiles - warp + kAttentionWarps - 1) /
                                                   kAttentionWarps
                                             : 0;
  const uint32_t ring = static_cast<uint32_t>(warp) * kStages * kStageBytes;
  const auto* key_head = static_cast<const unsigned char*>(p.key_cache) +
                         (int64_t{work.kv_head} * p.key_head_stride) * Cache::kElementBytes;
  const auto* value_head = static_cast<const unsigned char*>(p.value_cache) +
                           (int64_t{work.kv_head} * p.value_head_stride) * Cache::kElementBytes;
  const int64_t key_block_bytes = p.key_block_stride * Cache::kElementBytes;
  const int64_t value_block_bytes = p.value_block_stride * Cache::kElementBytes;
  const int key_chunks = head_size / Cache::kX;
  const bool whole = head_size == kD;  // no padding: every lane copies all its units

  // Physical block id of the block holding tile position `pos`, or -1 past the sequence.
  const auto block_of = [&](int pos) {
    const int b = (pos >> shift) - work.first_block;
    return b < work.num_blocks ? *prim::shared<int32_t>(shape.block_ids_offset + 4u * b) : -1;
  };

  // The copies of this warp's i-th tile into its stage, for a block size of kB (the strides
  // between one lane's copies are then immediates).
  const auto issue_tile = [&]<int kB>(int i) {
    const int tile = work.first_tile + warp + kAttentionWarps * i;
    const uint32_t stage = ring + static_cast<uint32_t>(i % kStages) * kStageBytes;
    // Keys: 16-byte unit (chunk c, token t); lane copies token lane % 16 of chunks
    // 2 j + lane / 16.
    {
      const int t = lane & 15;
      const int pos = tile * kT + t;
      const int block = block_of(pos);
      if (block >= 0) {
        const unsigned char* src =
            key_head + block * key_block_bytes + ((pos & (kB - 1)) + (lane >> 4) * kB) * 16;
        const uint32_t dst = stage + ((lane >> 4) * kT + (kFp8 ? fp8_key_row(t) : t)) * 16;
        constexpr int kN = kD / Cache::kX / 2;
        copy_units<kN, 16, 2 * kB * 16>(
            whole, src, [&](int j) { return dst + j * 2 * kT * 16; },
            units_below(key_chunks, lane >> 4, 2, kN));
      }
    }
    const uint32_t vstage = stage + kKeyTileBytes;
    if constexpr (!kFp8 || kB == 8) {
      // 8 tokens per unit (16 bytes of a 16-bit row, 8 of a fp8 row): lane copies half
      // lane % 2 of rows 16 j + lane / 2.
      const int h = lane & 1;
      const int pos = tile * kT + 8 * h;
      const int block = block_of(pos);
      if (block >= 0) {
        const int d0 = lane >> 1;
        const unsigned char* src =
            value_head + block * value_block_bytes +
            (d0 * kB + (pos & (kB - 1))) * Cache::kElementBytes;
        const uint32_t dst = kFp8 ? vstage + d0 * 16 + 8 * h
                                  : vstage + (2 * d0 + (h ^ ((d0 >> 2) & 1))) * 16;
        constexpr int kN = kD / 16;
        const int count = units_below(head_size, d0, 16, kN);
        if constexpr (kFp8) {
          copy_units<kN, 8, 16 * kB>(whole, src, [&](int j) { return dst + j * 16 * 16; }, count);
        } else {
          copy_units<kN, 16, 16 * kB * 2>(
              whole, src, [&](int j) { return dst + j * 16 * 32; }, count);
        }
      }
    } else {
      // fp8, blocks of 16 or 32: a 16-byte unit is the tile's 16 tokens of row 32 j + lane.
      const int pos = tile * kT;
      const int block = block_of(pos);
      if (block >= 0) {
        const unsigned char* src =
            value_head + block * value_block_bytes + lane * kB + (pos & (kB - 1));
        constexpr int kN = kD / 32;
        copy_units<kN, 16, 32 * kB>(
            whole, src, [&](int j) { return vstage + (32 * j + lane) * 16; },
            units_below(head_size, lane, 32, kN));
      }
    }
  };
  // Issues this warp's i-th tile (if it has one) and commits its copies as one group.
  const auto issue = [&](int i) {
    if (i < my_tiles) {
      if (block_size == 16) {
        issue_tile.template operator()<16>(i);
      } else if (block_size == 32) {
        issue_tile.template operator()<32>(i);
      } else {
        issue_tile.template operator()<8>(i);
      }
    }
    prim::cp_async_commit();
  };

  // A head size below the bucket's: the key chunks past it are never copied; zero them once
  // in every stage, so that the bucket's k-steps add 0 * 0 there. (Value rows past it only
  // reach output columns that are never stored.)
  if (key_chunks * Cache::kX < kD) {
    for (int stage = 0; stage < kStages; ++stage) {
      const uint32_t first = ring + stage * kStageBytes + key_chunks * kT * 16;
      for (int w = lane; w < (kD / Cache::kX - key_chunks) * kT * 4; w += kWarpSize) {
        *prim::shared<uint32_t>(first + 4u * w) = 0;
      }
    }
    prim::syncwarp();
  }

  // The first stages go out before the query is loaded.
#pragma unroll 1
  for (int i = 0; i < kStages - 1; ++i) issue(i);

  // ---- the query: rows [head][dim] in shared memory, zero past the group and the head size ---
  // For fp8 caches the dims of each k-step are stored permuted (dim 4q + 2h + j of a k-step at
  // column 8h + 2q + j), so that ldmatrix hands lane q the dims its fp8 key bytes hold.
  {
    const auto* query = static_cast<const QueryStorage*>(p.query) +
                        int64_t{work.seq} * p.query_seq_stride +
                        int64_t{work.first_head} * p.query_head_stride;
    for (int i = tid; i < kMmaRows * kD; i += kAttentionThreads) {
      const int row = i / kD, d = i % kD;
      QueryStorage v = 0;  // +0 in every format
      if (row < work.heads && d < head_size) v = prim::load(query + row * p.query_head_stride + d);
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
    // to [2^14, 2^15); the logit scale undoes it. Warp w converts rows w, w + 4, ...
    const uint32_t descale = shape.weights_offset;  // free until the final merge
    for (int row = warp; row < kMmaRows; row += kAttentionWarps) {
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
        *prim::shared<float>(descale + 4u * row) =
            prim::bits_to_float(static_cast<uint32_t>(127 - e) << 23);
      }
    }
    prim::syncthreads();
#pragma unroll
    for (int i = 0; i < 2; ++i) row_scale[i] *= *prim::shared<float>(descale + 4u * (g + 8 * i));
  }
  // A fragments of Q (ldmatrix_x4 of the 16 x 16 block of k-step ks): registers 0-3 are rows
  // 0-7 / 8-15 of columns 0-7, then of columns 8-15. Kept in registers up to head size 128;
  // for 256 they would not fit next to the output accumulators and are reloaded per tile.
  constexpr bool kQueryInRegisters = kD <= 128;
  const uint32_t query_lane =
      shape.query_offset +
      2u * (((lane & 7) + 8 * ((lane >> 3) & 1)) * kQueryRow + 8 * (lane >> 4));
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
      const int row = g + 8 * i;
      if (row < work.heads) slope[i] = prim::load(p.alibi_slopes + work.first_head + row);
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
    issue(i + kStages - 1);
    prim::cp_async_wait<kStages - 1>();
    prim::syncwarp();
    const uint32_t stage = ring + static_cast<uint32_t>(i % kStages) * kStageBytes;
    const int tile_pos = (work.first_tile + warp + kAttentionWarps * i) * kT;

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
        {
          uint32_t kb[4];
          prim::ldmatrix_x4(kb, stage + key_lane + kk * 2 * kT * 16);
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int ks = 2 * kk + h;
            {
              const uint32_t(&a)[4] = query_fragment(ks);
#pragma unroll
              for (int nb = 0; nb < 2; ++nb) {
                uint32_t b0, b1;
                Cache::to_halves(kb[2 * h + nb], b0, b1);
                prim::mma_16816<kMma>(s[nb], a, b0, b1);
              }
            }
          }
        }
      }
    } else {
#pragma unroll
      for (int ks = 0; ks < kKSteps; ++ks) {
        {
          uint32_t kb[4];
          prim::ldmatrix_x4(kb, stage + key_lane + ks * 2 * kT * 16);
          const uint32_t(&a)[4] = query_fragment(ks);
          prim::mma_16816<kMma>(s[0], a, kb[0], kb[1]);
          prim::mma_16816<kMma>(s[1], a, kb[2], kb[3]);
        }
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
          s[nb][c] += slope[c >> 1] * static_cast<float>(pos - work.len + 1);
        }
      }
    }
    const bool boundary = tile_pos < work.begin || tile_pos + kT > work.end;
    if (boundary) {
#pragma unroll
      for (int nb = 0; nb < 2; ++nb) {
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          const int pos = tile_pos + s_column_token<kFp8>(8 * nb + 2 * q + (c & 1));
          if (pos < work.begin || pos >= work.end) s[nb][c] = -INFINITY;
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

    // O += P V. In tiles holding masked tokens their value elements are zeroed in registers
    // first: their weight is 0, but the values may be NaN (0 * NaN is NaN inside an MMA too).
    const auto accumulate_values = [&]<bool kMask>() {
      if constexpr (kFp8) {
        // This lane's value bytes are tokens 4q .. 4q + 3.
        uint32_t keep = 0xffffffffu;
        if constexpr (kMask) {
          keep = 0;
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            const int pos = tile_pos + 4 * q + j;
            if (pos >= work.begin && pos < work.end) keep |= 0xffu << (8 * j);
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
              if (pos >= work.begin && pos < work.end) keep[h] |= 0xffffu << (16 * j);
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
    if (boundary) {
      accumulate_values.template operator()<true>();
    } else {
      accumulate_values.template operator()<false>();
    }
    prim::syncwarp();  // every lane is done with this stage before it is refilled
  }

  // ---- merge the four warps ---------------------------------------------------------------
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    row_sum[r] += prim::shfl_xor(row_sum[r], 1);
    row_sum[r] += prim::shfl_xor(row_sum[r], 2);
  }
  prim::syncthreads();  // the ring is free: the merge buffer overlays it
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = g + 8 * r;
    if (row < work.heads) {
#pragma unroll
      for (int nb = 0; nb < kNBlocks; ++nb) {
        const int d = 8 * nb + 2 * q;
        *prim::shared<float>(Merge::o(warp, row, d)) = o[nb][2 * r];
        *prim::shared<float>(Merge::o(warp, row, d + 1)) = o[nb][2 * r + 1];
      }
      if (q == 0) {
        *prim::shared<float>(Merge::max(warp, row)) = row_max[r];
        *prim::shared<float>(Merge::sum(warp, row)) = row_sum[r];
      }
    }
  }
  prim::syncthreads();
  const float v_scale = kFp8 ? prim::load(p.v_scale) : 1.0f;
  merge_and_store<Scalar, kMmaRows, kD>(p, launch, work, shape.weights_offset, v_scale);
}

}  // namespace paged_attention::cuda
