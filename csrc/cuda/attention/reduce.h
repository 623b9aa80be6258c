// The second pass of split-KV attention: one CTA per query row of a main CTA (grid x and y as
// the main kernel's, z the row) combines the row's split results, out = sum_j w_j * partial_j /
// (sum_j w_j + e^(sink - M)) with w_j = exp_sum_j * e^(max_logit_j - M), M the largest max_logit
// (and sink). Splits that attended nothing (max -inf, sum 0) weigh 0.
//
// The weighted sum is bound by the latency of its loads (a long context has hundreds of splits):
// the four warps take every fourth split each, a lane loading dims lane, lane + 32, ... of its
// warp's split, so that four whole rows are in flight at once; the warps' sums are added at the
// end.
#pragma once

#include <cstdint>
#include <type_traits>

#include "cuda/attention/attention_common.h"

namespace paged_attention::cuda {

constexpr int kReduceThreads = 128;
constexpr int kReduceWarps = kReduceThreads / kWarpSize;
// Split weights staged in shared memory at a time.
constexpr int kReduceChunk = 256;
// Dims of a row per lane: lane + 32 m for m < kReduceLaneDims.
constexpr int kReduceLaneDims = kMaxHeadSize / kWarpSize;
// Shared memory: the chunk's weights, the warps' sums [warp][kMaxHeadSize], block_reduce's
// scratch.
constexpr uint32_t kReduceSumsOffset = 4u * kReduceChunk;
constexpr uint32_t kReduceScratchOffset = kReduceSumsOffset + 4u * kReduceWarps * kMaxHeadSize;
constexpr uint32_t kReduceSharedBytes = kReduceScratchOffset + 4u * kReduceWarps;

PA_DEVICE float block_reduce(float v, bool is_max, uint32_t scratch) {
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
    const float other = prim::shfl_xor(v, offset);
    v = is_max ? prim::max(v, other) : v + other;
  }
  const int tid = prim::thread_index();
  if (tid % kWarpSize == 0) *prim::shared<float>(scratch + 4u * (tid / kWarpSize)) = v;
  prim::syncthreads();
  float total = *prim::shared<float>(scratch);
  for (int w = 1; w < kReduceThreads / kWarpSize; ++w) {
    const float other = *prim::shared<float>(scratch + 4u * w);
    total = is_max ? prim::max(total, other) : total + other;
  }
  prim::syncthreads();  // the scratch may be reused by the next reduction
  return total;
}

template <typename Scalar, bool kPartialFp32>
PA_DEVICE void reduce_partials(const AttentionParams& p, const AttentionLaunch& launch) {
  using Partial = typename std::conditional<kPartialFp32, float, typename Scalar::Storage>::type;
  const prim::Index3 block = prim::block_index();
  const int tid = prim::thread_index();
  const CtaRows rows = cta_rows(p, launch, block.x, block.y);
  const int t = block.z / rows.heads_per_token, h = block.z % rows.heads_per_token;
  if (!rows.valid(t, h)) return;
  const int64_t row = result_row(p, rows, t, h);
  const int splits = launch.num_splits;
  const float* max_logits = launch.max_logits + row * splits;
  const float* exp_sums = launch.exp_sums + row * splits;
  const auto* partials =
      static_cast<const Partial*>(launch.partial_out) + row * splits * p.v_head_size;
  const uint32_t weights = 0;
  const uint32_t scratch = kReduceScratchOffset;

  float local_max = -INFINITY;
  for (int j = tid; j < splits; j += kReduceThreads) {
    local_max = prim::max(local_max, prim::load(max_logits + j));
  }
  float global_max = block_reduce(local_max, true, scratch);
  const bool has_sink = p.sinks != nullptr;
  const float sink = has_sink ? prim::load(p.sinks + rows.first_head + h) : -INFINITY;
  global_max = prim::max(global_max, sink);
  if (global_max == -INFINITY) global_max = 0.0f;  // nothing attended anywhere: all weights 0

  float local_total = 0.0f;
  for (int j = tid; j < splits; j += kReduceThreads) {
    const float sum = prim::load(exp_sums + j);
    if (sum > 0.0f) {
      local_total += sum * prim::exp2((prim::load(max_logits + j) - global_max) * kLog2e);
    }
  }
  float total = block_reduce(local_total, false, scratch);
  if (has_sink) total += prim::exp2((sink - global_max) * kLog2e);
  // total >= 1 unless nothing was attended (the largest partition's sum, or the sink, gives
  // e^0).
  const float inverse = total > 0.0f ? prim::divide(1.0f, total) : 0.0f;

  const int warp = tid / kWarpSize, lane = tid % kWarpSize;
  float acc[kReduceLaneDims];
#pragma unroll
  for (int m = 0; m < kReduceLaneDims; ++m) acc[m] = 0.0f;
  for (int j0 = 0; j0 < splits; j0 += kReduceChunk) {
    const int count = splits - j0 < kReduceChunk ? splits - j0 : kReduceChunk;
    for (int j = tid; j < count; j += kReduceThreads) {
      const float sum = prim::load(exp_sums + j0 + j);
      *prim::shared<float>(weights + 4u * j) =
          sum > 0.0f ? sum * prim::exp2((prim::load(max_logits + j0 + j) - global_max) * kLog2e) *
                           inverse
                     : 0.0f;
    }
    prim::syncthreads();
#pragma unroll 2
    for (int j = warp; j < count; j += kReduceWarps) {
      const float w = *prim::shared<float>(weights + 4u * j);
      if (w == 0.0f) continue;  // uniform over the warp
      const Partial* partial = partials + int64_t{j0 + j} * p.v_head_size;
#pragma unroll
      for (int m = 0; m < kReduceLaneDims; ++m) {
        const int d = lane + kWarpSize * m;
        if (d < p.v_head_size) {
          if constexpr (kPartialFp32) {
            acc[m] += w * prim::load(partial + d);
          } else {
            acc[m] += w * Scalar::to_float(prim::load(partial + d));
          }
        }
      }
    }
    prim::syncthreads();  // the weights are rewritten by the next chunk
  }
  const auto warp_sum = [](int w, int d) {
    return kReduceSumsOffset + 4u * (w * kMaxHeadSize + d);
  };
#pragma unroll
  for (int m = 0; m < kReduceLaneDims; ++m) {
    *prim::shared<float>(warp_sum(warp, lane + kWarpSize * m)) = acc[m];
  }
  prim::syncthreads();
  auto* out = static_cast<typename Scalar::Storage*>(p.out) + row * p.v_head_size;
  for (int d = tid; d < p.v_head_size; d += kReduceThreads) {
    float v = 0.0f;
#pragma unroll
    for (int w = 0; w < kReduceWarps; ++w) v += *prim::shared<float>(warp_sum(w, d));
    prim::store(out + d, Scalar::from_float(v));
  }
}

}  // namespace paged_attention::cuda
