// Plain-C++ entry points of the CUDA kernels: raw pointers, strides (in elements unless named
// *_bytes), dimensions and a stream. Shared by the torch-facing glue (cuda_ops.cpp) and the .cu
// files, so it must not include torch or ATen headers.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "cache_dtype.h"

namespace paged_attention::cuda {

enum class ScalarKind { kFloat, kHalf, kBFloat16 };

// Threads per attention CTA (four warps).
constexpr int kAttentionThreads = 128;
// A CTA serves at most this many query heads of one KV head; larger GQA groups are split into
// ceil(group / kMaxHeadsPerCta) balanced chunks (each K/V element is then read once per chunk).
// The per-head registers size the kernel's occupancy: 4 instead of 8 took the auto-cache kernels
// for head sizes up to 128 from 113-128 to 86-96 registers (ptxas -v, nvcc 13.0). With commit
// f746766, which also moved the value pass's block ids into shared memory, v2 at batch 64 x 4096
// tokens on an H200 took 0.48 ms instead of 0.68 (bf16) and 0.70 instead of 0.96 (fp32)
// (`benchmarks/bench_decode.py --device cuda` before and after it).
constexpr int kMaxHeadsPerCta = 4;
constexpr int kMaxHeadSize = 256;

// Query heads one CTA serves for a GQA group of `group` query heads per KV head.
inline int heads_per_cta(int64_t group) {
  if (group <= 0) return 1;
  const int64_t chunks = (group + kMaxHeadsPerCta - 1) / kMaxHeadsPerCta;
  return static_cast<int>((group + chunks - 1) / chunks);
}

// v2 splits each sequence into partitions of this many tokens (checks.h's kPartitionSize; the
// glue asserts they agree).
constexpr int kV2PartitionSize = 512;

// Dynamic shared memory (bytes) of the attention kernel, in float32 words per served head:
// the query row (head_size), one logit per token slot of the partition (logit_capacity), the
// cross-warp max and sum (2 * warps) and the partial value sums of the token splits (only when
// head_size < kAttentionThreads, and then splits * head_size <= kAttentionThreads); then one int32
// block id per block of the partition. The total is at most
// 4 * heads * (logit_capacity + kMaxHeadSize + 8) + 4 * logit_capacity / block_size:
// paged_attention/_ops.py's cuda_v1_shared_memory_bytes uses that bound.
inline int64_t attention_shared_memory_bytes(int64_t heads, int64_t head_size,
                                             int64_t logit_capacity, int64_t block_size) {
  const int64_t splits = head_size >= kAttentionThreads ? 1 : kAttentionThreads / head_size;
  const int64_t words = head_size + logit_capacity + 2 * (kAttentionThreads / 32) +
                        (splits - 1) * head_size;
  return 4 * heads * words + 4 * (logit_capacity / block_size);
}

// Logit slots per head: v1 holds the whole (block-padded) context, v2 one partition.
inline int64_t attention_logit_capacity(int64_t max_seq_len, int64_t block_size, bool v2) {
  const int64_t padded = (max_seq_len + block_size - 1) / block_size * block_size;
  return v2 && padded > kV2PartitionSize ? kV2PartitionSize : padded;
}

struct AttentionParams {
  // v1: `out` only. v2: exp_sums/max_logits/tmp_out hold per-partition results (row stride
  // num_partitions) and a reduce kernel writes `out`.
  void* out;  // [num_seqs, num_heads, head_size], contiguous
  float* exp_sums;
  float* max_logits;
  void* tmp_out;
  const void* query;
  int64_t query_seq_stride;
  int64_t query_head_stride;
  const void* key_cache;  // [num_blocks, num_kv_heads, head_size / x, block_size, x]
  const void* value_cache;  // [num_blocks, num_kv_heads, head_size, block_size]
  int64_t key_block_stride;
  int64_t key_head_stride;
  int64_t value_block_stride;
  int64_t value_head_stride;
  const int32_t* block_tables;
  int64_t block_table_stride;
  int32_t max_blocks_per_seq;
  const int32_t* seq_lens;
  int32_t num_seqs;
  int32_t num_heads;
  int32_t num_kv_heads;
  int32_t head_size;
  int32_t block_size;
  int32_t max_seq_len;
  float scale;
  float logits_soft_cap;  // 0 = none
  int32_t sliding_window;  // 0 = none
  const float* alibi_slopes;  // [num_heads] or nullptr
  const float* k_scale;  // device pointers, read only for fp8 caches
  const float* v_scale;
  int32_t num_partitions;  // v2: scratch partitions (>= ceil(max_seq_len / partition_size))
  ScalarKind scalar;
  CacheDtype cache;
};

// Dynamic shared memory one launch of the attention kernel needs (bytes).
inline int64_t attention_shared_memory_bytes(const AttentionParams& params, bool v2) {
  return attention_shared_memory_bytes(
      heads_per_cta(params.num_heads / params.num_kv_heads), params.head_size,
      attention_logit_capacity(params.max_seq_len, params.block_size, v2), params.block_size);
}

// One launcher per query dtype (one .cu file each, so they compile in parallel); each returns the
// launch status. v2 launches the partition kernel, then the reduce kernel.
cudaError_t paged_attention_float(const AttentionParams& params, bool v2, cudaStream_t stream);
cudaError_t paged_attention_half(const AttentionParams& params, bool v2, cudaStream_t stream);
cudaError_t paged_attention_bfloat16(const AttentionParams& params, bool v2, cudaStream_t stream);

struct ReshapeAndCacheParams {
  const void* key;  // [num_tokens, num_kv_heads, head_size], any strides
  const void* value;
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
