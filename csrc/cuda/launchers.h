// Plain-C++ entry points of the CUDA kernels: raw pointers, strides (in elements unless named
// *_bytes), dimensions and a stream. Shared by the torch-facing glue (cuda_ops.cpp) and the .cu
// files, so it must not include torch or ATen headers.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "cache_dtype.h"
#include "cuda/attention/dispatch.h"

namespace paged_attention::cuda {

// Attention, decode (v1, v2) and varlen (csrc/cuda/attention/plan.h has AttentionParams,
// dispatch.h the plan): one pair of entry points per query dtype (one .cu file each, so they
// compile in parallel).
//   plan_*:   the kernel variant, its occupancy on the current device and the split of each
//             sequence (v1 / varlen: sized to fill whole waves; v2: the op's partitions);
//   launch_*: the schedule kernel of a varlen launch with long queries, the attention kernel,
//             then the reduce kernel when the plan splits. `scratch` holds
//             scratch_layout(p, plan).bytes of device memory (none for most decode plans).
// No host synchronisation: the same plan is valid inside a CUDA graph.
cudaError_t plan_attention_float(const AttentionParams& p, AttentionOp op, AttentionPlan* plan);
cudaError_t plan_attention_half(const AttentionParams& p, AttentionOp op, AttentionPlan* plan);
cudaError_t plan_attention_bfloat16(const AttentionParams& p, AttentionOp op, AttentionPlan* plan);
cudaError_t launch_attention_float(const AttentionParams& p, const AttentionPlan& plan,
                                   void* scratch, cudaStream_t stream);
cudaError_t launch_attention_half(const AttentionParams& p, const AttentionPlan& plan,
                                  void* scratch, cudaStream_t stream);
cudaError_t launch_attention_bfloat16(const AttentionParams& p, const AttentionPlan& plan,
                                      void* scratch, cudaStream_t stream);

inline cudaError_t plan_attention(const AttentionParams& p, AttentionOp op, AttentionPlan* plan) {
  switch (p.scalar) {
    case ScalarKind::kFloat:
      return plan_attention_float(p, op, plan);
    case ScalarKind::kHalf:
      return plan_attention_half(p, op, plan);
    case ScalarKind::kBFloat16:
      return plan_attention_bfloat16(p, op, plan);
  }
  return cudaErrorInvalidValue;
}

inline cudaError_t launch_attention(const AttentionParams& p, const AttentionPlan& plan,
                                    void* scratch, cudaStream_t stream) {
  switch (p.scalar) {
    case ScalarKind::kFloat:
      return launch_attention_float(p, plan, scratch, stream);
    case ScalarKind::kHalf:
      return launch_attention_half(p, plan, scratch, stream);
    case ScalarKind::kBFloat16:
      return launch_attention_bfloat16(p, plan, scratch, stream);
  }
  return cudaErrorInvalidValue;
}

struct ReshapeAndCacheParams {
  const void* key;  // [num_tokens, num_kv_heads, head_size], any strides
  const void* value;  // [num_tokens, num_kv_heads, v_head_size], any strides
  int64_t key_strides[3];
  int64_t value_strides[3];
  void* key_cache;
  void* value_cache;
  int64_t key_cache_block_stride;
  int64_t key_cache_head_stride;
  int64_t value_cache_block_stride;
  int64_t value_cache_head_stride;
  const int64_t* slot_mapping;
  int64_t num_tokens;
  int64_t num_slots;  // num_blocks * block_size; larger slots are skipped like negative ones
  int32_t num_kv_heads;
  int32_t head_size;
  int32_t v_head_size;  // of the values: head_size, but for multi-head latent attention
  int32_t block_size;
  int32_t x;
  const float* k_scale;
  const float* v_scale;
  ScalarKind scalar;
  CacheDtype cache;
};

cudaError_t launch_reshape_and_cache(const ReshapeAndCacheParams& params, cudaStream_t stream);

// One tensor of a batched block copy: block b of it starts at base + b * block_stride_bytes.
struct CopyTensor {
  const char* src;
  char* dst;
  int64_t src_block_stride_bytes;
  int64_t dst_block_stride_bytes;
  int64_t block_bytes;
};

// The tensors travel as kernel parameters (no device buffer to fill, so no host synchronisation
// and nothing that could go stale in a CUDA graph). 256 tensors (128 layers) take 10 KiB: CUDA
// 12.1+ allows 32 KiB of parameters on Volta and newer. More tensors take several launches.
constexpr int kMaxCopyTensorsPerLaunch = 256;

// For each (src, dst) row of `mapping` (int64 [num_pairs, 2], device-readable) and each tensor:
// copy block src of tensor.src to block dst of tensor.dst. Pointers may be device pointers or
// mapped pinned host memory.
cudaError_t copy_blocks_batched(const CopyTensor* tensors, int num_tensors, const int64_t* mapping,
                                int64_t num_pairs, cudaStream_t stream);

}  // namespace paged_attention::cuda
