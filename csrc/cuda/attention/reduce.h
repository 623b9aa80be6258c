// The second pass of split-KV attention: one CTA per query row of a main CTA (grid x and y as
// the main kernel's, z the row) combines the row's split results, out = sum_j w_j * partial_j /
// (sum_j w_j + e^(sink - M)) with w_j = exp_sum_j * e^(max_logit_j - M), M the largest max_logit
// (and sink). Splits that attended nothing (max -inf, sum 0) weigh 0.
#pragma once

#include <cstdint>
#include <type_traits>

#include "cuda/attention/attention_common.h"

namespace paged_attention::cuda {

constexpr int kReduceThreads = 128;
// Split weights staged in shared memory at a time.
constexpr int kReduceChunk = 256;
constexpr uint32_t kReduceSharedBytes = 4u * (kReduceChunk + kReduceThreads / kWarpSize);

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
  const auto* partials = static_cast<const Partial*>(launch.partial_out) + row * splits * p.head_size;
  const uint32_t weights = 0;
  const uint32_t scratch = 4u * kReduceChunk;

  float local_max = -INFINITY;
  for (int j = tid; j < splits; j += kReduceThreads) local_max = prim::max(local_max, prim::load(max_logits + j));
  float global_max = block_reduce(local_max, true, scratch);
  const bool has_sink = p.sinks != nullptr;
  const float sink = has_sink ? prim::load(p.sinks + rows.first_head + h) : -INFINITY;
  global_max = prim::max(global_max, sink);
  if (global_max == -INFINITY) global_max = 0.0f;  // nothing attended anywhere: all weights 0

  float local_total = 0.0f;
  for (int j = tid; j < splits; j += kReduceThreads) {
    const float sum = prim::load(exp_sums + j);
    if (sum > 0.0f) local_total += sum * prim::exp2((prim::load(max_logits + j) - global_max) * kLog2e);
  }
  float total = block_reduce(local_total, false, scratch);
  if (has_sink) total += prim::exp2((sink - global_max) * kLog2e);
  // total >= 1 unless nothing was attended (the largest partition's sum, or the sink, gives
  // e^0).
  const float inverse = total > 0.0f ? prim::divide(1.0f, total) : 0.0f;

  constexpr int kDimsPerThread = (kMaxHeadSize + kReduceThreads - 1) / kReduceThreads;
  float acc[kDimsPerThread];
#pragma unroll
  for (int k = 0; k < kDimsPerThread; ++k) acc[k] = 0.0f;
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
    for (int j = 0; j < count; ++j) {
      const float w = *prim::shared<float>(weights + 4u * j);
      if (w == 0.0f) continue;
      const Partial* partial = partials + int64_t{j0 + j} * p.head_size;
#pragma unroll
      for (int k = 0; k < kDimsPerThread; ++k) {
        const int d = tid + k * kReduceThreads;
        if (d < p.head_size) {
          if constexpr (kPartialFp32) {
            acc[k] += w * prim::load(partial + d);
          } else {
            acc[k] += w * Scalar::to_float(prim::load(partial + d));
          }
        }
      }
    }
    prim::syncthreads();
  }
  auto* out = static_cast<typename Scalar::Storage*>(p.out) + row * p.head_size;
#pragma unroll
  for (int k = 0; k < kDimsPerThread; ++k) {
    const int d = tid + k * kReduceThreads;
    if (d < p.head_size) prim::store(out + d, Scalar::from_float(acc[k]));
  }
}

}  // namespace paged_attention::cuda
