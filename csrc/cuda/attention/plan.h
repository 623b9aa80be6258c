// What a decode-attention launch looks like, in plain C++ (no CUDA or torch headers): the
// parameters of the kernels, the kernel a (query dtype, cache format, head size, GQA group) runs
// on, its shared memory, and how many splits of the KV sequence fill the GPU. Shared by the
// CUDA launchers, the torch glue and the host emulation.
#pragma once

#include <algorithm>
#include <cstdint>

#include "cache_dtype.h"

namespace paged_attention::cuda {

enum class ScalarKind { kFloat, kHalf, kBFloat16 };

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
  int32_t block_size;  // 8, 16 or 32
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

constexpr int kWarpSize = 32;
constexpr int kAttentionThreads = 128;  // four warps per CTA
constexpr int kAttentionWarps = kAttentionThreads / kWarpSize;
constexpr int kMaxHeadSize = 256;
// v2 splits each sequence into partitions of this many tokens (checks.h's kPartitionSize; the
// glue asserts they agree).
constexpr int kV2PartitionSize = 512;
// A CTA never takes more than this many tokens of a sequence (its block ids are staged in
// shared memory): longer v1 contexts are always split.
constexpr int kMaxSplitTokens = 8192;
// Block ids one CTA stages: a split's tokens, widened to whole 16-token tiles at both ends,
// in blocks of the smallest block size (8), rounded up to 8 ids.
constexpr int kMaxStagedBlockIds = (kMaxSplitTokens + 32) / 8 + 8;
// K/V ring: stages per warp, each one tile of tokens; three, or two where a tile is 16 KiB
// (head size 256 with 16- or 32-bit caches), which keeps the ring within an A100's 163 KiB.
constexpr int ring_stages(int head_bucket, int cache_element_bytes) {
  return head_bucket == 256 && cache_element_bytes >= 2 ? 2 : 3;
}
// Query heads one CTA serves at most: the 16 rows of an MMA tile (tensor-core kernel), or the
// 4 heads a lane's registers hold (CUDA-core kernel, fp32 queries). Larger GQA groups are split
// into balanced chunks, each of which reads the group's K/V once.
constexpr int kMmaRows = 16;
constexpr int kCudaCoreHeads = 4;
// v1 split-KV: a split has at least this many tokens, unless the context is shorter.
constexpr int kMinSplitTokens = 128;
// The fixed cost of a CTA (block-id staging, ring fill, merge) in 16-token tiles, for choosing
// the number of splits.
constexpr int kCtaOverheadTiles = 8;
constexpr int kMaxSplits = 1024;

enum class KernelFamily {
  kTensorCore,  // fp16/bf16 queries: mma.sync, GQA group on the MMA's M dimension
  kCudaCore,    // fp32 queries: FMAs, query in registers
};

// The kernel a launch runs and its resources.
struct KernelShape {
  KernelFamily family;
  int head_bucket;  // the compiled head size (64, 128 or 256) the actual one is padded to
  int tile_tokens;  // tokens per ring stage
  int stages;  // ring stages per warp
  int heads_per_cta;
  int head_chunks;  // CTAs per KV head (the GQA group split into balanced chunks)
  uint32_t ring_bytes;  // per CTA: warps x stages x (K tile + V tile)
  uint32_t merge_bytes;  // per CTA: the warps' softmax states (overlays the ring)
  uint32_t block_ids_offset;
  uint32_t probs_offset;  // CUDA-core kernel: per warp, one tile of probabilities
  uint32_t weights_offset;  // the merge's per-row weights of the warps
  uint32_t query_offset;  // the served heads' query rows, staged once
  uint32_t shared_bytes;
};

constexpr int head_bucket(int head_size) {
  return head_size <= 64 ? 64 : head_size <= 128 ? 128 : 256;
}

constexpr int cache_element_bytes(ScalarKind scalar, CacheDtype cache) {
  if (cache != CacheDtype::kAuto) return 1;
  return scalar == ScalarKind::kFloat ? 4 : 2;
}

constexpr int tile_tokens(KernelFamily family) {
  return family == KernelFamily::kTensorCore ? 16 : 8;
}

// Rows of one warp's softmax state in the merge buffer, and its row stride in floats (padded
// so that the rows of one warp's fragment stores fall into different banks).
constexpr int merge_rows(KernelFamily family) {
  return family == KernelFamily::kTensorCore ? kMmaRows : kCudaCoreHeads;
}
constexpr int merge_row_floats(int bucket) { return bucket + 8; }
// Elements per staged query row: 16-bit rows padded by 16 bytes, so that the eight rows of a
// fragment read fall into different banks.
constexpr int query_row_elements(KernelFamily family, int bucket) {
  return family == KernelFamily::kTensorCore ? bucket + 8 : bucket;
}

constexpr KernelShape attention_kernel_shape(ScalarKind scalar, CacheDtype cache, int head_size,
                                          int num_heads, int num_kv_heads) {
  KernelShape k{};
  k.family = scalar == ScalarKind::kFloat ? KernelFamily::kCudaCore : KernelFamily::kTensorCore;
  k.head_bucket = head_bucket(head_size);
  k.tile_tokens = tile_tokens(k.family);
  const int group = num_kv_heads > 0 ? std::max(1, num_heads / num_kv_heads) : 1;
  const int most = k.family == KernelFamily::kTensorCore ? kMmaRows : kCudaCoreHeads;
  k.head_chunks = (group + most - 1) / most;
  k.heads_per_cta = (group + k.head_chunks - 1) / k.head_chunks;
  const int element_bytes = cache_element_bytes(scalar, cache);
  k.stages = ring_stages(k.head_bucket, element_bytes);
  const uint32_t tile_bytes = 2u * k.tile_tokens * k.head_bucket * element_bytes;
  k.ring_bytes = kAttentionWarps * k.stages * tile_bytes;
  const int rows = merge_rows(k.family);
  k.merge_bytes = 4u * kAttentionWarps * rows * (merge_row_floats(k.head_bucket) + 2);
  k.block_ids_offset = (std::max(k.ring_bytes, k.merge_bytes) + 127) / 128 * 128;
  k.probs_offset = k.block_ids_offset + 4u * kMaxStagedBlockIds;
  k.weights_offset = k.probs_offset + 4u * kAttentionWarps * kCudaCoreHeads * k.tile_tokens;
  k.query_offset = k.weights_offset + 4u * (kAttentionWarps + 1) * kMmaRows;
  const uint32_t query_bytes = k.family == KernelFamily::kTensorCore
                                   ? 2u * kMmaRows * query_row_elements(k.family, k.head_bucket)
                                   : 4u * kCudaCoreHeads * k.head_bucket;
  k.shared_bytes = (k.query_offset + query_bytes + 127) / 128 * 128;
  return k;
}

// How one launch of the decode kernel splits each sequence.
struct SplitPlan {
  int splits;  // CTAs per (sequence, KV head chunk)
  int split_tokens;  // tokens per split (a multiple of 16)
};

// v1: the number of splits that fills whole waves of `ctas_per_sm * num_sms` CTAs best, by a
// cost model of ceil(CTAs / slots) waves, each as long as one split's tiles plus a fixed CTA
// overhead. Depends only on host values (no device sync; the same launch in a CUDA graph).
inline SplitPlan plan_v1_splits(const KernelShape& k, int num_seqs, int num_kv_heads,
                                int max_seq_len, int num_sms, int ctas_per_sm) {
  if (max_seq_len <= 0) return {1, 16};
  const auto round_tiles = [](int64_t tokens) { return (tokens + 15) / 16 * 16; };
  const int64_t work = int64_t{num_seqs} * num_kv_heads * k.head_chunks;
  const int64_t slots = std::max<int64_t>(1, int64_t{num_sms} * std::max(1, ctas_per_sm));
  const int64_t fewest = (max_seq_len + kMaxSplitTokens - 1) / kMaxSplitTokens;
  const int64_t most = std::max<int64_t>(
      fewest, std::min<int64_t>((max_seq_len + kMinSplitTokens - 1) / kMinSplitTokens, kMaxSplits));
  SplitPlan best{0, 0};
  int64_t best_cost = 0;
  for (int64_t s = fewest; s <= most; ++s) {
    const int64_t tokens = round_tiles((max_seq_len + s - 1) / s);
    const int64_t splits = (max_seq_len + tokens - 1) / tokens;
    const int64_t waves = (work * splits + slots - 1) / slots;
    const int64_t cost = waves * (tokens / 16 + kCtaOverheadTiles);
    if (best.splits == 0 || cost < best_cost) {
      best = {static_cast<int>(splits), static_cast<int>(tokens)};
      best_cost = cost;
    }
  }
  return best;
}

// The model of resident CTAs per SM the host emulation plans with (the device asks the CUDA
// occupancy API): an H100/H200 SM's 228 KiB of shared memory, 1 KiB reserved per CTA.
constexpr int modelled_ctas_per_sm(uint32_t shared_bytes) {
  return std::max(1, std::min(16, static_cast<int>((228 * 1024) / (shared_bytes + 1024))));
}

// The resident CTAs per SM a variant is compiled for (the minimum of its __launch_bounds__): as
// many as its shared memory allows on an H100/H200, at most 4 (tensor-core kernel) or 2
// (CUDA-core kernel), so that registers never cost a CTA that shared memory would fit, and the
// register budget this leaves (65536 / (128 x CTAs)) still holds the kernel without spills.
constexpr int compiled_ctas_per_sm(ScalarKind scalar, CacheDtype cache, int bucket) {
  const KernelShape k = attention_kernel_shape(scalar, cache, bucket, 1, 1);
  const int most = k.family == KernelFamily::kTensorCore ? 4 : 2;
  return std::min(modelled_ctas_per_sm(k.shared_bytes), most);
}

// Everything one launch of the decode kernel needs besides AttentionParams.
struct DecodeLaunch {
  int heads_per_cta;
  int head_chunks;
  int split_tokens;
  int num_splits;  // grid z; the row stride of the partial results
  bool partial;  // write per-split partial results (v2, or v1 with several splits)
  bool partial_fp32;  // partial outputs in float32 (v1 scratch) or in the query dtype (v2)
  float* max_logits;  // [num_seqs, num_heads, num_splits]
  float* exp_sums;
  void* partial_out;  // [num_seqs, num_heads, num_splits, head_size]
  float inverse_soft_cap;  // 1 / logits_soft_cap (0 without a cap), divided once on the host
};

}  // namespace paged_attention::cuda
