// Attention on CUDA cores, for fp32 queries (fp32 or fp8 caches), decode and varlen: tensor
// cores would need TF32, which misses fp32's tolerance.
//
// The CTA layout, the rows and positions, the per-warp cp.async ring and the final merge are
// those of the tensor-core kernel with one warp of rows (mma_attention.h), with tiles of 8
// tokens and kCudaCoreRows = 4 query rows per CTA, (token, head) pairs as there; all four are
// always computed (padding rows are zero queries whose logits are masked), so no branch depends
// on the group size or the query length.
//
// Keys: the lanes of a warp form 32 / L groups of L = head_bucket / 16 lanes; each group takes
// 8 / (32 / L) tokens of the tile and each lane of it 16 dims of every row (the query of those
// dims stays in registers: 64 floats). The partial dots of a lane (4 rows x its tokens = L
// values) are summed over its group by a transposing reduction (L - 1 shuffles), after which
// lane l holds the logit of one (row, key token) pair: the tile's 32 logits, one per lane.
// Softmax runs per lane on that logit (max and sum over the lanes of one row: 3 shuffles);
// the probabilities go through shared memory to every lane.
// Values: lane l owns dims l, l + 32, ... of every row and accumulates the tile's 8 tokens.
//
// Shared memory: the key tile [chunk][8 tokens][16 B] (fp32: chunk = 4 dims; fp8: 16 dims) with
// the token rows of chunk c rotated by a XOR with c (times 8 / L when L < 8), and the value
// tile [head_size][8 tokens] (fp32: the two 16-byte halves of row d swap when bit 2 of d is
// set), so that the 8 lanes of each 16-byte access phase hit 8 different bank groups.
#pragma once

#include <cstdint>

#include "cuda/attention/attention_common.h"

namespace paged_attention::cuda {

template <CacheDtype kCache>
struct CudaCoreCache {
  static constexpr bool kFp8 = kCache != CacheDtype::kAuto;
  static constexpr int kElementBytes = kFp8 ? 1 : 4;
  static constexpr int kX = 16 / kElementBytes;  // key chunk width (dims)
  // 16 cache bytes -> floats (4 fp32 or 16 fp8 values, the latter without the scale).
  static PA_DEVICE void to_floats(const uint32_t (&raw)[4], float (&out)[kX]) {
    if constexpr (!kFp8) {
#pragma unroll
      for (int i = 0; i < 4; ++i) out[i] = prim::bits_to_float(raw[i]);
    } else {
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const auto pair = static_cast<uint16_t>(raw[i / 2] >> (16 * (i % 2)));
        const uint32_t h2 = kCache == CacheDtype::kFp8E4M3 ? prim::e4m3x2_to_half2(pair)
                                                           : prim::e5m2x2_to_half2(pair);
        prim::half2_to_float2(h2, out[2 * i], out[2 * i + 1]);
      }
    }
  }
};

// Sums values[i] over the kN lanes of an aligned group (lane index cl in the group), leaving
// the sum of index cl in values[0]: at each step with lane offset o the lanes with bit o set
// keep the upper half of the remaining values and trade the other half with lane ^ o.
template <int kN>
PA_DEVICE void transpose_reduce(float (&values)[kN], int cl) {
  if constexpr (kN > 1) {
    constexpr int kHalf = kN / 2;
    const bool upper = (cl & kHalf) != 0;
    float kept[kHalf];
#pragma unroll
    for (int j = 0; j < kHalf; ++j) {
      const float send = prim::select(upper, values[j], values[j + kHalf]);
      kept[j] = prim::select(upper, values[j + kHalf], values[j]) + prim::shfl_xor(send, kHalf);
    }
    transpose_reduce<kHalf>(kept, cl);
    values[0] = kept[0];
  }
}

template <CacheDtype kCache, int kD, int kStages>
PA_DEVICE void cuda_core_attention(const AttentionParams& p, const AttentionLaunch& launch) {
  using Cache = CudaCoreCache<kCache>;
  using Scalar = Float32;
  constexpr bool kFp8 = Cache::kFp8;
  constexpr int kG = kCudaCoreRows;
  constexpr int kT = tile_tokens(KernelFamily::kCudaCore);  // 8
  constexpr int kLanesPerToken = kD / 16;  // L
  constexpr int kTokenGroups = kWarpSize / kLanesPerToken;
  constexpr int kTokensPerLane = kT / kTokenGroups;
  constexpr int kChunksPerLane = 16 / Cache::kX;  // fp32: 4 chunks of 4 dims; fp8: 1 of 16
  constexpr int kValueDims = kD / kWarpSize;  // dims per lane in the value pass
  constexpr uint32_t kKeyTileBytes = kT * kD * Cache::kElementBytes;
  constexpr uint32_t kStageBytes = 2 * kKeyTileBytes;
  constexpr int kSwizzleFactor = kLanesPerToken >= 8 ? 1 : 8 / kLanesPerToken;
  static_assert(kG * kT == kWarpSize, "one logit per lane");
  static_assert(kG * kTokensPerLane == kLanesPerToken, "a lane's partials = its group's lanes");
  using Merge = MergeLayout<kG, kAttentionWarps, kD>;

  const int tid = prim::thread_index();
  const int warp = tid / kWarpSize;
  const int lane = tid % kWarpSize;
  const int group = lane / kLanesPerToken;  // token group
  const int cl = lane % kLanesPerToken;  // lane in the group
  const prim::Index3 block = prim::block_index();

  const CtaRows rows = cta_rows(p, launch, block.x, block.y);
  if (rows.tokens <= 0) return;
  const CtaWork work = cta_work(p, launch, rows, block.z);
  if (work.begin >= work.end) {
    store_empty<Scalar>(p, launch, rows, work.split);
    return;
  }
  const KernelShape shape = attention_kernel_shape(ScalarKind::kFloat, kCache, kD, p.num_heads,
                                                   p.num_kv_heads, kNarrowRowWarps, kStages);

  // ---- the rows: which are real, and the positions every row attends (tiles without masks)
  int common_begin = work.begin, common_end = work.end;
#pragma unroll
  for (int r = 0; r < kG; ++r) {
    const int t = r / rows.heads_per_token;
    if (rows.valid(t, r % rows.heads_per_token)) {
      const PositionRange range = attended_range(p, work, rows.first_pos + t);
      common_begin = range.begin > common_begin ? range.begin : common_begin;
      common_end = range.end < common_end ? range.end : common_end;
    }
  }
  // This lane's (row, key token) after the reduction, and what its row attends.
  const int my_row = cl / kTokensPerLane;
  const int my_token = group * kTokensPerLane + cl % kTokensPerLane;
  const int my_t = my_row / rows.heads_per_token, my_h = my_row % rows.heads_per_token;
  const bool my_valid = rows.valid(my_t, my_h);
  const int my_pos = rows.first_pos + my_t;
  const PositionRange my_range =
      my_valid ? attended_range(p, work, my_pos) : PositionRange{0, 0};

  const int head_size = p.head_size;
  const int block_size = p.block_size;
  const int key_chunks = head_size / Cache::kX;
  const bool whole = head_size == kD;  // no padding: every lane copies all its units

  // Rows of key chunk c: token t sits at row t ^ key_swizzle(c).
  const auto key_swizzle = [](int c) { return (c * kSwizzleFactor) & 7; };

  // ---- the ring ----------------------------------------------------------------------------
  const int first_tile = work.begin >> 3;
  const int num_tiles = ((work.end + 7) >> 3) - first_tile;
  const int my_tiles =
      num_tiles > warp ? (num_tiles - warp + kAttentionWarps - 1) / kAttentionWarps : 0;
  const auto tile_of = [&](int i) { return first_tile + warp + kAttentionWarps * i; };
  const uint32_t ring = static_cast<uint32_t>(warp) * kStages * kStageBytes;
  const auto* key_head = static_cast<const unsigned char*>(p.key_cache) +
                         (int64_t{rows.kv_head} * p.key_head_stride) * Cache::kElementBytes;
  const auto* value_head = static_cast<const unsigned char*>(p.value_cache) +
                           (int64_t{rows.kv_head} * p.value_head_stride) * Cache::kElementBytes;
  const int64_t key_block_bytes = p.key_block_stride * Cache::kElementBytes;
  const int64_t value_block_bytes = p.value_block_stride * Cache::kElementBytes;

  // A tile of 8 tokens lies in one block: its physical block for this warp's i-th tile, or -1
  // (nothing to copy).
  const auto tile_block = [&](int i) {
    return i < my_tiles ? block_id(p, rows, work, tile_of(i) * kT, kT) : -1;
  };

  // The copies of this warp's i-th tile into its stage, for a block size of kB.
  const auto issue_tile = [&]<int kB>(int i, int block) {
    const int tile = tile_of(i);
    const uint32_t stage = ring + static_cast<uint32_t>(i % kStages) * kStageBytes;
    {
      // Keys: unit (chunk c, token t); lane copies token lane % 8 of chunks 4 j + lane / 8.
      const int t = lane & 7;
      const int pos = tile * kT + t;
      const unsigned char* src =
          key_head + block * key_block_bytes + ((pos & (kB - 1)) + (lane >> 3) * kB) * 16;
      constexpr int kN = kD / Cache::kX / 4;
      copy_units<kN, 16, 4 * kB * 16>(
          whole, src,
          [&](int j) {
            const int c = 4 * j + (lane >> 3);
            return stage + (c * kT + (t ^ key_swizzle(c))) * 16;
          },
          units_below(key_chunks, lane >> 3, 4, kN));
    }
    const uint32_t vstage = stage + kKeyTileBytes;
    if constexpr (kFp8) {
      // A value row of the tile is 8 bytes: lane copies row 32 j + lane.
      const int pos = tile * kT;
      const unsigned char* src =
          value_head + block * value_block_bytes + lane * kB + (pos & (kB - 1));
      constexpr int kN = kD / 32;
      copy_units<kN, 8, 32 * kB>(
          whole, src, [&](int j) { return vstage + (32 * j + lane) * 8; },
          units_below(head_size, lane, 32, kN));
    } else {
      // A value row of the tile is two 16-byte units of 4 tokens: lane copies unit lane % 2
      // of rows 16 j + lane / 2.
      const int u = lane & 1;
      const int pos = tile * kT + 4 * u;
      const int d0 = lane >> 1;
      const unsigned char* src =
          value_head + block * value_block_bytes + (d0 * kB + (pos & (kB - 1))) * 4;
      const uint32_t dst = vstage + (2 * d0 + (u ^ ((d0 >> 2) & 1))) * 16;
      constexpr int kN = kD / 16;
      copy_units<kN, 16, 16 * kB * 4>(
          whole, src, [&](int j) { return dst + j * 16 * 32; },
          units_below(head_size, d0, 16, kN));
    }
  };
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

  // A head size below the bucket's: zero the key chunks past it in every stage (never copied),
  // so that the zero query dims meet zeros there.
  if (key_chunks * Cache::kX < kD) {
    for (int stage = 0; stage < kStages; ++stage) {
      const uint32_t first = ring + stage * kStageBytes + key_chunks * kT * 16;
      for (int w = lane; w < (kD / Cache::kX - key_chunks) * kT * 4; w += kWarpSize) {
        *prim::shared<uint32_t>(first + 4u * w) = 0;
      }
    }
    prim::syncwarp();
  }

  int next_block = tile_block(0);
  const auto issue_ahead = [&](int i) {
    const int block = next_block;
    next_block = tile_block(i + 1);
    issue(i, block);
  };
#pragma unroll 1
  for (int i = 0; i < (kStages > 1 ? kStages - 1 : 1); ++i) issue_ahead(i);

  // ---- the query: the rows in shared memory, then 16 dims of each per lane ------------------
  // fp32 caches: chunks cl + L k (k < 4) of 4 dims; fp8: chunk cl of 16 dims.
  {
    const float* query = static_cast<const float*>(p.query);
    for (int i = tid; i < kG * kD; i += kAttentionThreads) {
      const int row = i / kD, d = i % kD;
      const int t = row / rows.heads_per_token, h = row % rows.heads_per_token;
      float v = 0.0f;
      if (rows.valid(t, h) && d < head_size) {
        v = prim::load(query + int64_t{rows.first_token + t} * p.query_seq_stride +
                       int64_t{rows.first_head + h} * p.query_head_stride + d);
      }
      *prim::shared<float>(shape.query_offset + 4u * i) = v;
    }
  }
  prim::syncthreads();
  float qr[kG][kChunksPerLane][Cache::kX];
#pragma unroll
  for (int gq = 0; gq < kG; ++gq) {
#pragma unroll
    for (int k = 0; k < kChunksPerLane; ++k) {
      const int dim = kFp8 ? 16 * cl : 4 * (cl + kLanesPerToken * k);
      const float* chunk = prim::shared<float>(shape.query_offset + 4u * (gq * kD + dim));
#pragma unroll
      for (int e = 0; e < Cache::kX; ++e) qr[gq][k][e] = chunk[e];
    }
  }
  const float k_scale = kFp8 ? prim::load(p.k_scale) : 1.0f;
  const float logit_scale = p.scale * k_scale;
  const float slope = p.alibi_slopes != nullptr && my_valid
                          ? prim::load(p.alibi_slopes + rows.first_head + my_h)
                          : 0.0f;
  const bool has_alibi = p.alibi_slopes != nullptr;
  const float soft_cap = p.logits_soft_cap;
  const float inverse_cap = launch.inverse_soft_cap;

  float o[kG][kValueDims];
#pragma unroll
  for (int gq = 0; gq < kG; ++gq) {
#pragma unroll
    for (int k = 0; k < kValueDims; ++k) o[gq][k] = 0.0f;
  }
  float row_max = -INFINITY;  // of my_row
  float row_sum = 0.0f;  // of my_row, this lane's tokens only
  const uint32_t probs = shape.probs_offset + 4u * warp * kG * kT;

  // Lane masks over which one row's 8 logits are spread: the token bits of the group index
  // and the token-in-lane bits of cl.
  const auto row_reduce_max = [&](float v) {
#pragma unroll
    for (int b = 1; b < kTokensPerLane; b *= 2) v = prim::max(v, prim::shfl_xor(v, b));
#pragma unroll
    for (int b = kLanesPerToken; b < kWarpSize; b *= 2) v = prim::max(v, prim::shfl_xor(v, b));
    return v;
  };
  const auto row_reduce_sum = [&](float v) {
#pragma unroll
    for (int b = 1; b < kTokensPerLane; b *= 2) v += prim::shfl_xor(v, b);
#pragma unroll
    for (int b = kLanesPerToken; b < kWarpSize; b *= 2) v += prim::shfl_xor(v, b);
    return v;
  };

  for (int i = 0; i < my_tiles; ++i) {
    // Tile i has landed; every lane is done with tile i - 1 (its stage and the probabilities).
    // A one-stage ring refills its stage only then, and waits for it.
    if constexpr (kStages == 1) {
      if (i > 0) {
        prim::syncwarp();
        issue_ahead(i);
      }
      prim::cp_async_wait<0>();
      prim::syncwarp();
    } else {
      prim::cp_async_wait<kStages - 2>();
      prim::syncwarp();
      issue_ahead(i + kStages - 1);
    }
    const uint32_t stage = ring + static_cast<uint32_t>(i % kStages) * kStageBytes;
    const int tile_pos = tile_of(i) * kT;

    // Partial dots: partial[gq * kTokensPerLane + tt] over this lane's 16 dims.
    float partial[kLanesPerToken];
#pragma unroll
    for (int j = 0; j < kLanesPerToken; ++j) partial[j] = 0.0f;
#pragma unroll
    for (int tt = 0; tt < kTokensPerLane; ++tt) {
      const int t = group * kTokensPerLane + tt;
#pragma unroll
      for (int k = 0; k < kChunksPerLane; ++k) {
        const int c = kFp8 ? cl : cl + kLanesPerToken * k;
        {
          const uint32_t* unit =
              prim::shared<uint32_t>(stage + (c * kT + (t ^ key_swizzle(c))) * 16);
          const uint32_t raw[4] = {unit[0], unit[1], unit[2], unit[3]};
          float kv[Cache::kX];
          Cache::to_floats(raw, kv);
#pragma unroll
          for (int gq = 0; gq < kG; ++gq) {
            float& dot = partial[gq * kTokensPerLane + tt];
#pragma unroll
            for (int e = 0; e < Cache::kX; ++e) dot += qr[gq][k][e] * kv[e];
          }
        }
      }
    }
    // Transposing reduction over the group's lanes: lane cl ends with partial index cl.
    transpose_reduce<kLanesPerToken>(partial, cl);

    const int pos = tile_pos + my_token;
    float s = partial[0] * logit_scale;
    if (soft_cap > 0.0f) s = soft_cap * prim::tanh(s * inverse_cap);
    if (has_alibi) s += slope * static_cast<float>(pos - my_pos);
    const bool boundary = tile_pos < common_begin || tile_pos + kT > common_end;
    if (boundary && (pos < my_range.begin || pos >= my_range.end)) s = -INFINITY;

    const float tile_max = prim::max(row_max, row_reduce_max(s));
    if (prim::any(tile_max > row_max)) {
      const float alpha = row_max == -INFINITY ? 0.0f : prim::exp2((row_max - tile_max) * kLog2e);
      row_sum *= alpha;
#pragma unroll
      for (int gq = 0; gq < kG; ++gq) {
        const float row_alpha = prim::shfl(alpha, gq * kTokensPerLane);
#pragma unroll
        for (int k = 0; k < kValueDims; ++k) o[gq][k] *= row_alpha;
      }
      row_max = tile_max;
    }
    const float prob =
        prim::exp2(s * kLog2e - (row_max == -INFINITY ? 0.0f : row_max * kLog2e));
    row_sum += prob;
    *prim::shared<float>(probs + 4u * (my_row * kT + my_token)) = prob;
    prim::syncwarp();

    float pr[kG][kT];
#pragma unroll
    for (int gq = 0; gq < kG; ++gq) {
#pragma unroll
      for (int t = 0; t < kT; ++t) pr[gq][t] = *prim::shared<float>(probs + 4u * (gq * kT + t));
    }
    // In tiles holding positions no row attends their values are zeroed first: their weight is
    // 0, but they may be NaN, and 0 * NaN is NaN.
    const uint32_t vstage = stage + kKeyTileBytes;
    const auto accumulate_values = [&]<bool kMask>() {
#pragma unroll
      for (int k = 0; k < kValueDims; ++k) {
        const int d = 32 * k + lane;
        float v[kT];
        if constexpr (kFp8) {
          const uint32_t* row = prim::shared<uint32_t>(vstage + d * 8);
#pragma unroll
          for (int t = 0; t < kT; t += 2) {
            const auto pair = static_cast<uint16_t>(row[t / 4] >> (8 * (t % 4)));
            const uint32_t h2 = kCache == CacheDtype::kFp8E4M3 ? prim::e4m3x2_to_half2(pair)
                                                               : prim::e5m2x2_to_half2(pair);
            prim::half2_to_float2(h2, v[t], v[t + 1]);
          }
        } else {
          const int slot = (d >> 2) & 1;
#pragma unroll
          for (int u = 0; u < 2; ++u) {
            const float* unit = prim::shared<float>(vstage + (2 * d + (u ^ slot)) * 16);
#pragma unroll
            for (int e = 0; e < 4; ++e) v[4 * u + e] = unit[e];
          }
        }
        if constexpr (kMask) {
#pragma unroll
          for (int t = 0; t < kT; ++t) {
            const int pos = tile_pos + t;
            v[t] = pos >= work.begin && pos < work.end ? v[t] : 0.0f;
          }
        }
#pragma unroll
        for (int gq = 0; gq < kG; ++gq) {
          float acc = o[gq][k];
#pragma unroll
          for (int t = 0; t < kT; ++t) acc += pr[gq][t] * v[t];
          o[gq][k] = acc;
        }
      }
    };
    if (tile_pos < work.begin || tile_pos + kT > work.end) {
      accumulate_values.template operator()<true>();
    } else {
      accumulate_values.template operator()<false>();
    }
  }

  // ---- merge the four warps ---------------------------------------------------------------
  row_sum = row_reduce_sum(row_sum);
  prim::syncthreads();
  // Every row's state, padding rows' too: the merge reads only the rows the CTA serves (and no
  // validity predicate stays live across the main loop).
#pragma unroll
  for (int gq = 0; gq < kG; ++gq) {
#pragma unroll
    for (int k = 0; k < kValueDims; ++k) {
      *prim::shared<float>(Merge::o(warp, gq, 32 * k + lane)) = o[gq][k];
    }
  }
  if (lane == my_row * kTokensPerLane) {
    *prim::shared<float>(Merge::max(warp, my_row)) = row_max;
    *prim::shared<float>(Merge::sum(warp, my_row)) = row_sum;
  }
  prim::syncthreads();
  const float v_scale = kFp8 ? prim::load(p.v_scale) : 1.0f;
  merge_and_store<Scalar, kG, kAttentionWarps, kD>(p, launch, rows, work.split,
                                                   shape.weights_offset, v_scale);
}

}  // namespace paged_attention::cuda
