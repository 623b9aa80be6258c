// From a launch's runtime values to the compiled kernel variant and its grid, in plain C++:
// shared by the CUDA launchers (attention_kernels.cuh) and the host emulation
// (csrc/cuda/emulator/), so that both run the same variants with the same plan.
#pragma once

#include <cstdint>
#include <type_traits>
#include <utility>

#include "cuda/attention/plan.h"

namespace paged_attention::cuda {

// A whole decode launch: the kernel variant, the split of each sequence, the grid.
struct DecodePlan {
  KernelShape shape;
  SplitPlan split;
  bool v2;
  bool partial;  // the kernel writes partial results and a reduce kernel writes `out`
  int grid_x, grid_y, grid_z;  // sequences, KV heads x GQA chunks, splits
};

// v2 splits as the op's scratch says (partitions of kV2PartitionSize tokens). v1 splits so
// that the CTAs fill whole waves of `ctas_per_sm * num_sms` (plan_v1_splits).
inline DecodePlan plan_decode(const AttentionParams& p, bool v2, int num_sms, int ctas_per_sm) {
  DecodePlan plan{};
  plan.shape = attention_kernel_shape(p.scalar, p.cache, p.head_size, p.num_heads, p.num_kv_heads);
  plan.v2 = v2;
  if (v2) {
    plan.split = {p.num_partitions, kV2PartitionSize};
    plan.partial = true;
  } else {
    plan.split = plan_v1_splits(plan.shape, p.num_seqs, p.num_kv_heads, p.max_seq_len, num_sms,
                                ctas_per_sm);
    plan.partial = plan.split.splits > 1;
  }
  plan.grid_x = p.num_seqs;
  plan.grid_y = p.num_kv_heads * plan.shape.head_chunks;
  plan.grid_z = plan.split.splits;
  return plan;
}

// Float32 scratch a v1 launch with several splits needs: per (sequence, head, split) the max
// logit, the exp-sum and the partial output row.
inline int64_t decode_scratch_floats(const AttentionParams& p, const DecodePlan& plan) {
  if (plan.v2 || !plan.partial) return 0;
  const int64_t rows = int64_t{p.num_seqs} * p.num_heads * plan.split.splits;
  return rows * (2 + p.head_size);
}

inline DecodeLaunch decode_launch(const AttentionParams& p, const DecodePlan& plan,
                                  float* scratch) {
  DecodeLaunch launch{};
  launch.heads_per_cta = plan.shape.heads_per_cta;
  launch.head_chunks = plan.shape.head_chunks;
  launch.split_tokens = plan.split.split_tokens;
  launch.num_splits = plan.split.splits;
  launch.partial = plan.partial;
  launch.inverse_soft_cap =
      p.logits_soft_cap > 0.0f ? static_cast<float>(1.0 / p.logits_soft_cap) : 0.0f;
  if (plan.v2) {
    launch.partial_fp32 = false;
    launch.max_logits = p.max_logits;
    launch.exp_sums = p.exp_sums;
    launch.partial_out = p.tmp_out;
  } else if (plan.partial) {
    const int64_t rows = int64_t{p.num_seqs} * p.num_heads * plan.split.splits;
    launch.partial_fp32 = true;
    launch.max_logits = scratch;
    launch.exp_sums = scratch + rows;
    launch.partial_out = scratch + 2 * rows;
  }
  return launch;
}

// Calls f.template operator()<kCache, kD>() for the compiled variant that serves a cache
// format and head size: kD is the head size's bucket (64, 128, 256); smaller head sizes (32;
// 80-120; 192) run the bucket's code on zero-padded keys.
template <typename F>
decltype(auto) with_decode_variant(CacheDtype cache, int head_size, F&& f) {
  const int bucket = head_bucket(head_size);
  const auto by_bucket = [&](auto cache_constant) -> decltype(auto) {
    constexpr CacheDtype kCache = decltype(cache_constant)::value;
    if (bucket == 64) return f.template operator()<kCache, 64>();
    if (bucket == 128) return f.template operator()<kCache, 128>();
    return f.template operator()<kCache, 256>();
  };
  switch (cache) {
    case CacheDtype::kFp8E4M3:
      return by_bucket(std::integral_constant<CacheDtype, CacheDtype::kFp8E4M3>{});
    case CacheDtype::kFp8E5M2:
      return by_bucket(std::integral_constant<CacheDtype, CacheDtype::kFp8E5M2>{});
    case CacheDtype::kAuto:
    default:
      return by_bucket(std::integral_constant<CacheDtype, CacheDtype::kAuto>{});
  }
}

}  // namespace paged_attention::cuda
