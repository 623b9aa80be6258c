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
// tile [bucket][8 tokens] (fp32: the two 16-byte halves of row d swap when bit 2 of d is
// set), so that the 8 lanes of each 16-byte access phase hit 8 different bank groups. Rows past
// v_head_size (values of a head size of their own, below the bucket) are never copied; a lane's
// dims there are never stored.
//
// The body takes the tensor-core kernel's steps (kernel_steps.h for those they share): claim the
// CTA, load K/V tiles (CudaCoreTiles through a KvRing), stage the query, then per tile
// compute_score, transform_logit, mask_logit, update_softmax, accumulate_values; at the end
// store_states and merge_and_store.
#pragma once

#include <cstdint>

#include "cuda/attention/attention_common.h"
#include "cuda/attention/kernel_steps.h"

namespace paged_attention::cuda {

template <CacheDtype kCache>
struct CudaCoreCache {
  static constexpr bool kFp8 = kCache != CacheDtype::kAuto;
  static constexpr int kElementBytes = kFp8 ? 1 : 4;
  static constexpr int kX = 16 / kElementBytes;  // key chunk width (dims)
  // Two fp8 values (byte 0 -> low half) -> two halves.
  static PA_DEVICE uint32_t to_half2(uint16_t pair) {
    return kCache == CacheDtype::kFp8E4M3 ? prim::e4m3x2_to_half2(pair)
                                          : prim::e5m2x2_to_half2(pair);
  }
  // 16 cache bytes -> floats (4 fp32 or 16 fp8 values, the latter without the scale).
  static PA_DEVICE void to_floats(const uint32_t (&raw)[4], float (&out)[kX]) {
    if constexpr (!kFp8) {
#pragma unroll
      for (int i = 0; i < 4; ++i) out[i] = prim::bits_to_float(raw[i]);
    } else {
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const auto pair = static_cast<uint16_t>(raw[i / 2] >> (16 * (i % 2)));
        prim::half2_to_float2(to_half2(pair), out[2 * i], out[2 * i + 1]);
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

// The compile-time shape of one CUDA-core variant.
template <CacheDtype kCache, int kD, int kStages_>
struct CudaCoreVariant {
  using Cache = CudaCoreCache<kCache>;
  static constexpr bool kFp8 = Cache::kFp8;
  static constexpr int kHeadBucket = kD;
  static constexpr int kStages = kStages_;
  static constexpr int kG = kCudaCoreRows;
  static constexpr int kT = tile_tokens(KernelFamily::kCudaCore);  // 8
  static constexpr int kLanesPerToken = kD / 16;  // L
  static constexpr int kTokenGroups = kWarpSize / kLanesPerToken;
  static constexpr int kTokensPerLane = kT / kTokenGroups;
  static constexpr int kChunksPerLane = 16 / Cache::kX;  // fp32: 4 chunks of 4 dims; fp8: 1 of 16
  static constexpr int kValueDims = kD / kWarpSize;  // dims per lane in the value pass
  static constexpr uint32_t kKeyTileBytes = kT * kD * Cache::kElementBytes;
  static constexpr uint32_t kStageBytes = 2 * kKeyTileBytes;
  static constexpr int kKeyChunks = kD / Cache::kX;
  static constexpr int kSwizzleFactor = kLanesPerToken >= 8 ? 1 : 8 / kLanesPerToken;
  static_assert(kG * kT == kWarpSize, "one logit per lane");
  static_assert(kG * kTokensPerLane == kLanesPerToken, "a lane's partials = its group's lanes");

  // Rows of key chunk c: token t sits at row t ^ key_swizzle(c).
  static PA_DEVICE int key_swizzle(int c) { return (c * kSwizzleFactor) & 7; }
};

// ---- load K/V tiles: the copies of one lane ------------------------------------------------

// A tile of 8 tokens lies in one block; each warp has its own ring and takes tiles warp,
// warp + 4, ... of the split.
template <typename V>
struct CudaCoreTiles {
  using Cache = typename V::Cache;
  static constexpr int kT = V::kT;
  const AttentionParams& p;
  const CtaRows& rows;
  const CtaWork& work;
  int first_tile;
  int my_tiles;
  int warp;
  int lane;
  const unsigned char* key_head;
  const unsigned char* value_head;
  int64_t key_block_bytes;
  int64_t value_block_bytes;
  int key_chunks;
  bool whole;  // key and value head sizes == bucket: every lane copies all its units

  PA_DEVICE CudaCoreTiles(const AttentionParams& p_, const CtaRows& rows_, const CtaWork& work_,
                          int warp_, int lane_)
      : p(p_), rows(rows_), work(work_), warp(warp_), lane(lane_) {
    first_tile = work.begin >> 3;
    const int num_tiles = ((work.end + 7) >> 3) - first_tile;
    my_tiles = num_tiles > warp ? (num_tiles - warp + kAttentionWarps - 1) / kAttentionWarps : 0;
    key_head = static_cast<const unsigned char*>(p.key_cache) +
               (int64_t{rows.kv_head} * p.key_head_stride) * Cache::kElementBytes;
    value_head = static_cast<const unsigned char*>(p.value_cache) +
                 (int64_t{rows.kv_head} * p.value_head_stride) * Cache::kElementBytes;
    key_block_bytes = p.key_block_stride * Cache::kElementBytes;
    value_block_bytes = p.value_block_stride * Cache::kElementBytes;
    key_chunks = p.head_size / Cache::kX;
    whole = p.head_size == V::kHeadBucket && p.v_head_size == V::kHeadBucket;
  }

  PA_DEVICE int tile_of(int i) const { return first_tile + warp + kAttentionWarps * i; }

  PA_DEVICE int block(int i) const {
    return i < my_tiles ? block_id(p, rows, work, tile_of(i) * kT, kT) : -1;
  }

  template <int kB>
  PA_DEVICE void copy(int i, uint32_t stage, int block) const {
    constexpr int kD = V::kHeadBucket;
    const int tile = tile_of(i);
    {
      // Keys: unit (chunk c, token t); lane copies token lane % 8 of chunks 4 j + lane / 8.
      const int t = lane & 7;
      const int pos = tile * kT + t;
      const unsigned char* src =
          key_head + block * key_block_bytes + ((pos & (kB - 1)) + (lane >> 3) * kB) * 16;
      constexpr int kN = V::kKeyChunks / 4;
      copy_units<kN, 16, 4 * kB * 16>(
          whole, src,
          [&](int j) {
            const int c = 4 * j + (lane >> 3);
            return stage + (c * kT + (t ^ V::key_swizzle(c))) * 16;
          },
          units_below(key_chunks, lane >> 3, 4, kN));
    }
    const uint32_t vstage = stage + V::kKeyTileBytes;
    if constexpr (V::kFp8) {
      // A value row of the tile is 8 bytes: lane copies row 32 j + lane.
      const int pos = tile * kT;
      const unsigned char* src =
          value_head + block * value_block_bytes + lane * kB + (pos & (kB - 1));
      constexpr int kN = kD / 32;
      copy_units<kN, 8, 32 * kB>(
          whole, src, [&](int j) { return vstage + (32 * j + lane) * 8; },
          units_below(p.v_head_size, lane, 32, kN));
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
          units_below(p.v_head_size, d0, 16, kN));
    }
  }
};

// ---- per tile: scores, logit, mask, online softmax, value product ------------------------------

// This lane's (row, key token) after the score reduction, and what its row attends.
struct LaneLogit {
  int row;  // 0 .. kG - 1
  int token;  // 0 .. kT - 1
  int head;
  bool valid;
  int pos;  // the row's query position
  PositionRange range;
};

// The logits of one tile, one per lane: the lane's partial dots (its 16 dims of every row for
// its tokens), summed over its group of lanes by the transposing reduction, after which lane
// cl of a group holds the logit of partial index cl.
template <typename V>
PA_DEVICE float compute_score(uint32_t stage,
                              const float (&qr)[V::kG][V::kChunksPerLane][V::Cache::kX],
                              int group, int cl) {
  constexpr int kT = V::kT;
  float partial[V::kLanesPerToken];
#pragma unroll
  for (int j = 0; j < V::kLanesPerToken; ++j) partial[j] = 0.0f;
#pragma unroll
  for (int tt = 0; tt < V::kTokensPerLane; ++tt) {
    const int t = group * V::kTokensPerLane + tt;
#pragma unroll
    for (int k = 0; k < V::kChunksPerLane; ++k) {
      const int c = V::kFp8 ? cl : cl + V::kLanesPerToken * k;
      const uint32_t* unit =
          prim::shared<uint32_t>(stage + (c * kT + (t ^ V::key_swizzle(c))) * 16);
      const uint32_t raw[4] = {unit[0], unit[1], unit[2], unit[3]};
      float kv[V::Cache::kX];
      V::Cache::to_floats(raw, kv);
#pragma unroll
      for (int gq = 0; gq < V::kG; ++gq) {
        float& dot = partial[gq * V::kTokensPerLane + tt];
#pragma unroll
        for (int e = 0; e < V::Cache::kX; ++e) dot += qr[gq][k][e] * kv[e];
      }
    }
  }
  transpose_reduce<V::kLanesPerToken>(partial, cl);
  return partial[0];
}

// Scale, soft cap and ALiBi of the lane's logit (key position `pos`).
PA_DEVICE float transform_logit(float s, float logit_scale, const LogitOptions& options,
                                float slope, const LaneLogit& lane, int pos) {
  s *= logit_scale;
  if (options.soft_cap > 0.0f) s = options.soft_capped(s);
  if (options.alibi) s += slope * static_cast<float>(pos - lane.pos);
  return s;
}

// -inf (a select, never a product) where the lane's row does not attend position `pos`; only
// tiles that are not inside every row's range (`boundary`) need it.
PA_DEVICE void mask_logit(float& s, const LaneLogit& lane, int pos, bool boundary) {
  if (boundary && (pos < lane.range.begin || pos >= lane.range.end)) s = -INFINITY;
}

// Reductions over the 8 lanes that hold one row's logits: the token bits of the group index and
// the token-in-lane bits of cl.
template <typename V, typename Op>
PA_DEVICE float row_reduce(float v, const Op& op) {
#pragma unroll
  for (int b = 1; b < V::kTokensPerLane; b *= 2) v = op(v, prim::shfl_xor(v, b));
#pragma unroll
  for (int b = V::kLanesPerToken; b < kWarpSize; b *= 2) v = op(v, prim::shfl_xor(v, b));
  return v;
}

// The online softmax over one tile: the running max of the lane's row (rescaling the output
// only when some row's max grew in the warp, each row's factor from the lane that holds it),
// the lane's probability into its running sum and into the warp's probability tile
// `probs` [row][token], which every lane reads back after the warp's barrier.
template <typename V>
PA_DEVICE void update_softmax(float s, float& row_max, float& row_sum,
                              float (&o)[V::kG][V::kValueDims], uint32_t probs,
                              const LaneLogit& lane) {
  const float tile_max = prim::max(
      row_max, row_reduce<V>(s, [](float a, float b) { return prim::max(a, b); }));
  if (prim::any(tile_max > row_max)) {
    const float alpha = row_max == -INFINITY ? 0.0f : prim::exp2((row_max - tile_max) * kLog2e);
    row_sum *= alpha;
#pragma unroll
    for (int gq = 0; gq < V::kG; ++gq) {
      const float row_alpha = prim::shfl(alpha, gq * V::kTokensPerLane);
#pragma unroll
      for (int k = 0; k < V::kValueDims; ++k) o[gq][k] *= row_alpha;
    }
    row_max = tile_max;
  }
  const float prob = prim::exp2(s * kLog2e - (row_max == -INFINITY ? 0.0f : row_max * kLog2e));
  row_sum += prob;
  *prim::shared<float>(probs + 4u * (lane.row * V::kT + lane.token)) = prob;
  prim::syncwarp();
}

// O += P V over one tile: lane l owns dims l, l + 32, ... of every row and accumulates the
// tile's tokens. With kMask (a tile holding positions no row attends) their values are zeroed
// first: their weight is 0, but they may be NaN, and 0 * NaN is NaN.
template <typename V, bool kMask>
PA_DEVICE void accumulate_values(float (&o)[V::kG][V::kValueDims], uint32_t probs,
                                 uint32_t values, const CtaWork& work, int tile_pos, int lane) {
  constexpr int kT = V::kT;
  float pr[V::kG][kT];
#pragma unroll
  for (int gq = 0; gq < V::kG; ++gq) {
#pragma unroll
    for (int t = 0; t < kT; ++t) pr[gq][t] = *prim::shared<float>(probs + 4u * (gq * kT + t));
  }
#pragma unroll
  for (int k = 0; k < V::kValueDims; ++k) {
    const int d = 32 * k + lane;
    float v[kT];
    if constexpr (V::kFp8) {
      const uint32_t* row = prim::shared<uint32_t>(values + d * 8);
#pragma unroll
      for (int t = 0; t < kT; t += 2) {
        const auto pair = static_cast<uint16_t>(row[t / 4] >> (8 * (t % 4)));
        prim::half2_to_float2(V::Cache::to_half2(pair), v[t], v[t + 1]);
      }
    } else {
      const int slot = (d >> 2) & 1;
#pragma unroll
      for (int u = 0; u < 2; ++u) {
        const float* unit = prim::shared<float>(values + (2 * d + (u ^ slot)) * 16);
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
    for (int gq = 0; gq < V::kG; ++gq) {
      float acc = o[gq][k];
#pragma unroll
      for (int t = 0; t < kT; ++t) acc += pr[gq][t] * v[t];
      o[gq][k] = acc;
    }
  }
}

// ---- the rows' softmax states into the merge buffer -------------------------------------------

// Every row's state, padding rows' too: the merge reads only the rows the CTA serves (and no
// validity predicate stays live across the main loop). The lane's sum is of its tokens: its
// row's lanes are added first. The caller has synchronised the CTA (the ring, the probabilities
// and the query rows are free: the merge buffer overlays them).
template <typename V>
PA_DEVICE void store_states(const float (&o)[V::kG][V::kValueDims], float row_max,
                            float row_sum, const LaneLogit& lane, int warp, int lane_id) {
  using Merge = MergeLayout<V::kG, kAttentionWarps, V::kHeadBucket>;
  row_sum = row_reduce<V>(row_sum, [](float a, float b) { return a + b; });
#pragma unroll
  for (int gq = 0; gq < V::kG; ++gq) {
#pragma unroll
    for (int k = 0; k < V::kValueDims; ++k) {
      *prim::shared<float>(Merge::o(warp, gq, 32 * k + lane_id)) = o[gq][k];
    }
  }
  if (lane_id == lane.row * V::kTokensPerLane) {
    *prim::shared<float>(Merge::max(warp, lane.row)) = row_max;
    *prim::shared<float>(Merge::sum(warp, lane.row)) = row_sum;
  }
}

// ---- the kernel body --------------------------------------------------------------------------

template <CacheDtype kCache, int kD, int kStages>
PA_DEVICE void cuda_core_attention(const AttentionParams& p, const AttentionLaunch& launch) {
  using V = CudaCoreVariant<kCache, kD, kStages>;
  using Scalar = Float32;
  constexpr int kG = V::kG;
  constexpr int kT = V::kT;
  const int tid = prim::thread_index();
  const int warp = tid / kWarpSize;
  const int lane_id = tid % kWarpSize;
  const int group = lane_id / V::kLanesPerToken;  // token group
  const int cl = lane_id % V::kLanesPerToken;  // lane in the group

  CtaRows rows;
  CtaWork work;
  if (!claim_cta<Scalar>(p, launch, rows, work)) return;
  const KernelShape shape = attention_kernel_shape(ScalarKind::kFloat, kCache, kD, p.num_heads,
                                                   p.num_kv_heads, kNarrowRowWarps, kStages);

  // The positions every row attends (tiles without masks), and the lane's (row, key token).
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
  LaneLogit lane{};
  lane.row = cl / V::kTokensPerLane;
  lane.token = group * V::kTokensPerLane + cl % V::kTokensPerLane;
  const int lane_t = lane.row / rows.heads_per_token;
  lane.head = lane.row % rows.heads_per_token;
  lane.valid = rows.valid(lane_t, lane.head);
  lane.pos = rows.first_pos + lane_t;
  lane.range = lane.valid ? attended_range(p, work, lane.pos) : PositionRange{0, 0};

  // Load K/V tiles: the warp's ring starts before the query is staged.
  const CudaCoreTiles<V> tiles(p, rows, work, warp, lane_id);
  KvRing<kStages, kWarpSize, V::kStageBytes, CudaCoreTiles<V>> ring{
      tiles, static_cast<uint32_t>(warp) * kStages * V::kStageBytes, p.block_size, 0};
  ring.template zero_key_padding<V::kKeyChunks, kT>(tiles.key_chunks, lane_id);
  ring.start();

  // Stage the query, then 16 dims of each row per lane: fp32 caches chunks cl + L k (k < 4) of
  // 4 dims, fp8 chunk cl of 16 dims.
  stage_query<float, kG, kD>(
      p, rows, [&](int row, int d) { return shape.query_offset + 4u * (row * kD + d); });
  prim::syncthreads();
  float qr[kG][V::kChunksPerLane][V::Cache::kX];
#pragma unroll
  for (int gq = 0; gq < kG; ++gq) {
#pragma unroll
    for (int k = 0; k < V::kChunksPerLane; ++k) {
      const int dim = V::kFp8 ? 16 * cl : 4 * (cl + V::kLanesPerToken * k);
      const float* chunk = prim::shared<float>(shape.query_offset + 4u * (gq * kD + dim));
#pragma unroll
      for (int e = 0; e < V::Cache::kX; ++e) qr[gq][k][e] = chunk[e];
    }
  }
  const float k_scale = V::kFp8 ? prim::load(p.k_scale) : 1.0f;
  const float logit_scale = p.scale * k_scale;
  const LogitOptions options(p, launch);
  const float slope =
      options.alibi && lane.valid ? prim::load(p.alibi_slopes + rows.first_head + lane.head)
                                  : 0.0f;

  float o[kG][V::kValueDims];
#pragma unroll
  for (int gq = 0; gq < kG; ++gq) {
#pragma unroll
    for (int k = 0; k < V::kValueDims; ++k) o[gq][k] = 0.0f;
  }
  float row_max = -INFINITY;  // of the lane's row
  float row_sum = 0.0f;  // of the lane's row, its tokens only
  const uint32_t probs = shape.probs_offset + 4u * warp * kG * kT;

  for (int i = 0; i < tiles.my_tiles; ++i) {
    ring.wait_for(i);  // also: every lane is done with the previous tile's probabilities
    const uint32_t stage = ring.stage(i);
    const int tile_pos = tiles.tile_of(i) * kT;
    const int pos = tile_pos + lane.token;
    float s = compute_score<V>(stage, qr, group, cl);
    s = transform_logit(s, logit_scale, options, slope, lane, pos);
    const bool boundary = tile_pos < common_begin || tile_pos + kT > common_end;
    mask_logit(s, lane, pos, boundary);
    update_softmax<V>(s, row_max, row_sum, o, probs, lane);
    const uint32_t values = stage + V::kKeyTileBytes;
    if (tile_pos < work.begin || tile_pos + kT > work.end) {
      accumulate_values<V, true>(o, probs, values, work, tile_pos, lane_id);
    } else {
      accumulate_values<V, false>(o, probs, values, work, tile_pos, lane_id);
    }
  }

  prim::syncthreads();
  store_states<V>(o, row_max, row_sum, lane, warp, lane_id);
  prim::syncthreads();
  const float v_scale = V::kFp8 ? prim::load(p.v_scale) : 1.0f;
  merge_and_store<Scalar, kG, kAttentionWarps, kD>(p, launch, rows, work.split,
                                                   shape.weights_offset, v_scale);
}

}  // namespace paged_attention::cuda
