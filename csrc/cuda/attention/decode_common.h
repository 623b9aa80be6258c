// Parts shared by the two decode kernel bodies (mma_decode.h, cuda_core_decode.h): element
// types, the token range a CTA attends, staging its block ids, and the merge of the four warps'
// softmax states into the output or a partial result. Written against primitives.h only.
#pragma once

#include <cstdint>

#include "cuda/attention/plan.h"
#include "cuda/primitives/primitives.h"

namespace paged_attention::cuda {

constexpr float kLog2e = 1.4426950408889634f;

// Query / output element types: storage and conversions.
struct Float32 {
  using Storage = float;
  static constexpr ScalarKind kKind = ScalarKind::kFloat;
  static PA_DEVICE float to_float(float v) { return v; }
  static PA_DEVICE float from_float(float v) { return v; }
};
struct Float16 {
  using Storage = uint16_t;
  static constexpr ScalarKind kKind = ScalarKind::kHalf;
  static constexpr prim::MmaType kMma = prim::MmaType::kF16;
  static PA_DEVICE float to_float(uint16_t v) { return prim::half_to_float(v); }
  static PA_DEVICE uint16_t from_float(float v) { return prim::float_to_half(v); }
};
struct BFloat16 {
  using Storage = uint16_t;
  static constexpr ScalarKind kKind = ScalarKind::kBFloat16;
  static constexpr prim::MmaType kMma = prim::MmaType::kBF16;
  static PA_DEVICE float to_float(uint16_t v) { return prim::bf16_to_float(v); }
  static PA_DEVICE uint16_t from_float(float v) { return prim::float_to_bf16(v); }
};

// The tokens one CTA attends and where its block ids are.
struct CtaWork {
  int seq;
  int kv_head;
  int first_head;  // query head of merge row 0
  int heads;  // query heads served (rows 0 .. heads - 1)
  int split;
  int len;  // the sequence length, clamped to what max_seq_len and the block table address
  int begin, end;  // attended positions [begin, end)
  int first_tile;  // 16-token tiles [first_tile, first_tile + num_tiles) cover [begin, end)
  int num_tiles;
  int first_block;  // logical block of staged id 0
  int num_blocks;  // staged ids (blocks past the sequence's last one are not staged)
  int block_shift;  // log2(block_size)
};

PA_DEVICE int log2_of_block_size(int block_size) {
  return block_size == 8 ? 3 : block_size == 16 ? 4 : 5;
}

PA_DEVICE CtaWork cta_work(const AttentionParams& p, const DecodeLaunch& launch) {
  const prim::Index3 block = prim::block_index();
  CtaWork w{};
  w.seq = block.x;
  w.kv_head = block.y / launch.head_chunks;
  const int chunk = block.y % launch.head_chunks;
  w.split = block.z;
  const int group = p.num_heads / p.num_kv_heads;
  w.first_head = w.kv_head * group + chunk * launch.heads_per_cta;
  w.heads = group - chunk * launch.heads_per_cta;
  if (w.heads > launch.heads_per_cta) w.heads = launch.heads_per_cta;
  int64_t len = prim::load(p.seq_lens + w.seq);
  const int64_t addressable = int64_t{p.max_blocks_per_seq} * p.block_size;
  if (len > p.max_seq_len) len = p.max_seq_len;
  if (len > addressable) len = addressable;
  if (len < 0) len = 0;
  w.len = static_cast<int>(len);
  const int64_t split_begin = int64_t{w.split} * launch.split_tokens;
  int64_t split_end = split_begin + launch.split_tokens;
  if (split_end > w.len) split_end = w.len;
  int64_t window_begin = 0;
  if (p.sliding_window > 0 && w.len > p.sliding_window) window_begin = w.len - p.sliding_window;
  w.begin = static_cast<int>(split_begin > window_begin ? split_begin : window_begin);
  w.end = static_cast<int>(split_end);
  if (w.begin >= w.end) {
    w.begin = w.end = 0;
    return w;
  }
  w.block_shift = log2_of_block_size(p.block_size);
  w.first_tile = w.begin >> 4;
  w.num_tiles = ((w.end + 15) >> 4) - w.first_tile;
  w.first_block = (w.first_tile * 16) >> w.block_shift;
  const int tiles_end_block = (((w.first_tile + w.num_tiles) * 16) + p.block_size - 1) >> w.block_shift;
  const int seq_blocks = (w.len + p.block_size - 1) >> w.block_shift;
  w.num_blocks = (tiles_end_block < seq_blocks ? tiles_end_block : seq_blocks) - w.first_block;
  return w;
}

// Block ids [first_block, first_block + num_blocks) of the sequence's table -> shared memory.
PA_DEVICE void stage_block_ids(const AttentionParams& p, const CtaWork& w, uint32_t offset) {
  const int32_t* table = p.block_tables + int64_t{w.seq} * p.block_table_stride + w.first_block;
  for (int i = prim::thread_index(); i < w.num_blocks; i += kAttentionThreads) {
    *prim::shared<int32_t>(offset + 4u * i) = prim::load(table + i);
  }
  prim::syncthreads();
}

// One lane's share of a tile copy: units j < count of kBytes each, from src + j * kSrcStride
// to shared offset dst(j). Head sizes equal to the bucket (`whole`, uniform over the warp) copy
// all kN units with immediate offsets; smaller ones take a loop with a run-time bound, so that
// no per-unit predicate stays live across the main loop.
template <int kN, int kBytes, int64_t kSrcStride, typename Dst>
PA_DEVICE void copy_units(bool whole, const unsigned char* src, const Dst& dst, int count) {
  const auto copy = [&](int j) {
    if constexpr (kBytes == 16) {
      prim::cp_async_16(dst(j), src + j * kSrcStride);
    } else {
      prim::cp_async_8(dst(j), src + j * kSrcStride);
    }
  };
  if (whole) {
#pragma unroll
    for (int j = 0; j < kN; ++j) copy(j);
  } else {
#pragma unroll 1
    for (int j = 0; j < count; ++j) copy(j);
  }
}

// Units j < n of one lane whose index first + j * step is below `limit`.
PA_DEVICE int units_below(int limit, int first, int step, int n) {
  const int count = limit > first ? (limit - first + step - 1) / step : 0;
  return count < n ? count : n;
}

// Row r of this CTA's result: output row (sequence, head) of `out`, or of the partial results.
PA_DEVICE int64_t result_row(const AttentionParams& p, const CtaWork& w, int r) {
  return int64_t{w.seq} * p.num_heads + w.first_head + r;
}

template <typename Scalar>
PA_DEVICE void store_value(const AttentionParams& p, const DecodeLaunch& launch, const CtaWork& w,
                           int r, int d, float v) {
  const int64_t row = result_row(p, w, r);
  if (!launch.partial) {
    prim::store(static_cast<typename Scalar::Storage*>(p.out) + row * p.head_size + d,
                Scalar::from_float(v));
    return;
  }
  const int64_t index = (row * launch.num_splits + w.split) * p.head_size + d;
  if (launch.partial_fp32) {
    prim::store(static_cast<float*>(launch.partial_out) + index, v);
  } else {
    prim::store(static_cast<typename Scalar::Storage*>(launch.partial_out) + index,
                Scalar::from_float(v));
  }
}

PA_DEVICE void store_row_stats(const AttentionParams& p, const DecodeLaunch& launch,
                               const CtaWork& w, int r, float max_logit, float exp_sum) {
  const int64_t index = result_row(p, w, r) * launch.num_splits + w.split;
  prim::store(launch.max_logits + index, max_logit);
  prim::store(launch.exp_sums + index, exp_sum);
}

// Nothing attended: zeros (v1), or the empty partial result (-inf, 0, zero row).
template <typename Scalar>
PA_DEVICE void store_empty(const AttentionParams& p, const DecodeLaunch& launch, const CtaWork& w) {
  for (int i = prim::thread_index(); i < w.heads * p.head_size; i += kAttentionThreads) {
    store_value<Scalar>(p, launch, w, i / p.head_size, i % p.head_size, 0.0f);
  }
  if (launch.partial && prim::thread_index() < w.heads) {
    store_row_stats(p, launch, w, prim::thread_index(), -INFINITY, 0.0f);
  }
}

// Shared-memory layout of the warps' softmax states (overlaying the K/V ring once every warp is
// done with it): O [warp][row][merge_row_floats(kD)], then the max and sum [warp][row].
template <int kRows, int kD>
struct MergeLayout {
  static constexpr int kRowFloats = merge_row_floats(kD);
  static PA_DEVICE uint32_t o(int warp, int row, int d) {
    return 4u * ((warp * kRows + row) * kRowFloats + d);
  }
  static PA_DEVICE uint32_t max(int warp, int row) {
    return 4u * (kAttentionWarps * kRows * kRowFloats + warp * kRows + row);
  }
  static PA_DEVICE uint32_t sum(int warp, int row) {
    return 4u * (kAttentionWarps * kRows * kRowFloats + kAttentionWarps * kRows + warp * kRows +
                 row);
  }
};

// Combines the four warps' (max, sum, O) of every served row, written to shared memory in
// MergeLayout, into the CTA's result. `weights` is scratch for kAttentionWarps + 1 floats per
// row. The caller has synchronised the CTA after writing the states.
template <typename Scalar, int kRows, int kD>
PA_DEVICE void merge_and_store(const AttentionParams& p, const DecodeLaunch& launch,
                               const CtaWork& w, uint32_t weights, float v_scale) {
  using L = MergeLayout<kRows, kD>;
  const int tid = prim::thread_index();
  if (tid < w.heads) {
    float m = -INFINITY;
    for (int k = 0; k < kAttentionWarps; ++k) m = prim::max(m, *prim::shared<float>(L::max(k, tid)));
    float total = 0.0f;
    float scale[kAttentionWarps];
    for (int k = 0; k < kAttentionWarps; ++k) {
      const float mk = *prim::shared<float>(L::max(k, tid));
      // A warp that attended nothing in this row has max -inf and sum 0: weight 0.
      scale[k] = mk == -INFINITY ? 0.0f : prim::exp2((mk - m) * kLog2e);
      total += scale[k] * *prim::shared<float>(L::sum(k, tid));
    }
    // total >= 1 (the largest logit contributes exp(0)), so the fast division is exact enough.
    const float inverse = total > 0.0f ? prim::divide(v_scale, total) : 0.0f;
    for (int k = 0; k < kAttentionWarps; ++k) {
      *prim::shared<float>(weights + 4u * (tid * (kAttentionWarps + 1) + k)) = scale[k] * inverse;
    }
    if (launch.partial) {
      store_row_stats(p, launch, w, tid, total > 0.0f ? m : -INFINITY, total);
    }
  }
  prim::syncthreads();
  for (int i = tid; i < w.heads * p.head_size; i += kAttentionThreads) {
    const int r = i / p.head_size, d = i % p.head_size;
    float v = 0.0f;
    for (int k = 0; k < kAttentionWarps; ++k) {
      const float weight = *prim::shared<float>(weights + 4u * (r * (kAttentionWarps + 1) + k));
      if (weight != 0.0f) v += weight * *prim::shared<float>(L::o(k, r, d));
    }
    store_value<Scalar>(p, launch, w, r, d, v);
  }
}

}  // namespace paged_attention::cuda
