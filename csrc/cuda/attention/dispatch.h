// From a launch's runtime values to the compiled kernel variant and its grid, in plain C++:
// shared by the CUDA launchers (attention_kernels.cuh) and the host emulation
// (csrc/cuda/emulator/), so that both run the same variants with the same plan.
#pragma once

#include <cstdint>
#include <type_traits>
#include <utility>

#include "cuda/attention/plan.h"

namespace paged_attention::cuda {

// A whole attention launch: the kernel variant, the split of each sequence, the grids.
struct AttentionPlan {
  KernelShape shape;
  SplitPlan split;
  AttentionOp op;
  bool partial;  // the kernel writes partial results and a reduce kernel writes `out`
  bool scheduled;  // a schedule kernel lists the (sequence, query chunk) work items first
  int grid_x, grid_y, grid_z;  // work items (sequences), KV heads x GQA chunks, splits
  int reduce_rows;  // grid z of the reduce kernel: one CTA per row of a main CTA
};

// The kernel shape a launch runs on `device` (plan.h: launch_kernel_shape).
inline KernelShape launch_shape(const AttentionParams& p, AttentionOp op,
                                const DeviceLimits& device) {
  return launch_kernel_shape(
      p.scalar, p.cache, plan_head_size(p.head_size, p.v_head_size), p.num_heads, p.num_kv_heads,
      launch_row_warps(p.scalar, op, p.num_heads, p.num_kv_heads, p.max_query_len), device);
}

// v2 splits as the op's scratch says (partitions of kV2PartitionSize tokens). v1 and varlen
// split so that the CTAs fill whole waves of `ctas_per_sm` (resident CTAs of the variant on one
// SM) times the device's SMs (plan_splits).
//
// Varlen CTAs: a sequence of q_len rows takes ceil(q_len / tokens_per_cta) CTAs per KV head
// chunk. When every query fits one CTA (max_query_len <= tokens_per_cta) CTA x serves sequence
// x; otherwise the schedule kernel lists the work items, at most
// min(num_seqs * ceil(max_query_len / T), (num_tokens + num_seqs * (T - 1)) / T) of them for
// T = tokens_per_cta (the grid is sized by that bound; CTAs past the last item exit).
inline AttentionPlan make_attention_plan(const AttentionParams& p, AttentionOp op,
                                         const DeviceLimits& device, int ctas_per_sm) {
  AttentionPlan plan{};
  plan.shape = launch_shape(p, op, device);
  plan.op = op;
  const int64_t tokens_per_cta = plan.shape.tokens_per_cta;
  int64_t items = p.num_seqs;
  if (op == AttentionOp::kVarlen) {
    if (p.max_query_len <= 0) {
      items = 0;
    } else if (p.max_query_len > tokens_per_cta) {
      plan.scheduled = true;
      const int64_t chunks = (p.max_query_len + tokens_per_cta - 1) / tokens_per_cta;
      items = std::min<int64_t>(
          int64_t{p.num_seqs} * chunks,
          (int64_t{p.num_tokens} + int64_t{p.num_seqs} * (tokens_per_cta - 1)) / tokens_per_cta);
    }
  }
  plan.grid_x = static_cast<int>(std::min<int64_t>(items, INT32_MAX));
  plan.grid_y = p.num_kv_heads * plan.shape.head_chunks;
  if (op == AttentionOp::kDecodeV2) {
    plan.split = {p.num_partitions, kV2PartitionSize};
    plan.partial = true;
  } else {
    plan.split = plan_splits(int64_t{plan.grid_x} * plan.grid_y, p.max_seq_len, device.sms,
                             ctas_per_sm);
    plan.partial = plan.split.splits > 1;
  }
  plan.grid_z = plan.split.splits;
  plan.reduce_rows = op == AttentionOp::kVarlen ? plan.shape.rows : plan.shape.heads_per_token;
  return plan;
}

// Device scratch a launch needs (v2 brings its own partial results): the work items of a
// scheduled varlen launch, then float32 partial results of several splits: per (query row,
// head, split) the max logit, the exp-sum and the partial output row (v_head_size floats).
struct ScratchLayout {
  int64_t work_ints;  // 2 per work item, at byte 0
  int64_t partial_offset;  // bytes, 256-aligned
  int64_t partial_rows;  // num_tokens * num_heads * splits
  int64_t bytes;
};

inline ScratchLayout scratch_layout(const AttentionParams& p, const AttentionPlan& plan) {
  ScratchLayout s{};
  s.work_ints = plan.scheduled ? 2 * int64_t{plan.grid_x} : 0;
  s.partial_offset = (4 * s.work_ints + 255) / 256 * 256;
  if (plan.partial && plan.op != AttentionOp::kDecodeV2) {
    s.partial_rows = int64_t{p.num_tokens} * p.num_heads * plan.split.splits;
  }
  s.bytes = s.partial_rows > 0 ? s.partial_offset + 4 * s.partial_rows * (2 + p.v_head_size)
                               : 4 * s.work_ints;
  return s;
}

inline AttentionLaunch attention_launch(const AttentionParams& p, const AttentionPlan& plan,
                                        void* scratch) {
  AttentionLaunch launch{};
  launch.heads_per_token = plan.shape.heads_per_token;
  launch.head_chunks = plan.shape.head_chunks;
  launch.tokens_per_cta = plan.shape.tokens_per_cta;
  launch.split_tokens = plan.split.split_tokens;
  launch.num_splits = plan.split.splits;
  launch.partial = plan.partial;
  launch.inverse_soft_cap =
      p.logits_soft_cap > 0.0f ? static_cast<float>(1.0 / p.logits_soft_cap) : 0.0f;
  const ScratchLayout layout = scratch_layout(p, plan);
  auto* bytes = static_cast<unsigned char*>(scratch);
  if (plan.scheduled) launch.work = reinterpret_cast<const int32_t*>(bytes);
  if (plan.op == AttentionOp::kDecodeV2) {
    launch.partial_fp32 = false;
    launch.max_logits = p.max_logits;
    launch.exp_sums = p.exp_sums;
    launch.partial_out = p.tmp_out;
  } else if (plan.partial) {
    auto* floats = reinterpret_cast<float*>(bytes + layout.partial_offset);
    launch.partial_fp32 = true;
    launch.max_logits = floats;
    launch.exp_sums = floats + layout.partial_rows;
    launch.partial_out = floats + 2 * layout.partial_rows;
  }
  return launch;
}

// Calls f.template operator()<kCache, kD>() for the compiled variant that serves a cache
// format and head size: kD is the head size's bucket (64, 128, 256); smaller head sizes (32;
// 80-120; 192) run the bucket's code on zero-padded keys, or with the bucket's upper value
// columns unstored. `head_size` is plan_head_size's: keys and values share one bucket.
template <typename F>
decltype(auto) with_cache_variant(CacheDtype cache, int head_size, F&& f) {
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

// Calls f.template operator()<kCache, kD, kRowWarps, kStages>() for the compiled variant of a
// kernel shape of query type kScalar: the tensor-core kernel has both row tilings, the CUDA-core
// kernel one; each has its full ring and, where that differs, its compact one (plan.h).
template <ScalarKind kScalar, typename F>
decltype(auto) with_attention_variant(CacheDtype cache, const KernelShape& shape, F&& f) {
  return with_cache_variant(cache, shape.head_bucket, [&]<CacheDtype kCache, int kD>() {
    const auto by_ring = [&]<int kRowWarps>() {
      constexpr int kFull =
          full_ring_stages(kD, cache_element_bytes(kScalar, kCache), kRowWarps);
      constexpr int kCompact = compact_ring_stages(kScalar, kCache, kD, kRowWarps);
      if constexpr (kCompact != kFull) {
        if (shape.stages == kCompact) {
          return f.template operator()<kCache, kD, kRowWarps, kCompact>();
        }
      }
      return f.template operator()<kCache, kD, kRowWarps, kFull>();
    };
    if constexpr (kScalar != ScalarKind::kFloat) {
      if (shape.row_warps == kWideRowWarps) return by_ring.template operator()<kWideRowWarps>();
    }
    return by_ring.template operator()<kNarrowRowWarps>();
  });
}

}  // namespace paged_attention::cuda
