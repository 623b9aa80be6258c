// What an attention launch looks like, in plain C++ (no CUDA or torch headers): the parameters
// of the kernels, the kernel a (query dtype, cache format, head size, GQA group, query length)
// runs on, its shared memory, how its CTAs tile the query rows, how many of them one SM of a given
// GPU holds and how many splits of the KV sequence fill that GPU. Shared by the CUDA launchers,
// the torch glue and the host emulation.
//
// One kernel design serves decode (v1, v2) and varlen attention: a CTA computes a block of
// query rows, each row one (query token, query head) pair of one sequence and KV head, packed
// token-major (row r = token r / heads_per_token, head r % heads_per_token). A decode step is the
// case of one token per sequence at position seq_len - 1 (query_start_loc = nullptr).
#pragma once

#include <algorithm>
#include <cstdint>

#include "cache_dtype.h"

namespace paged_attention::cuda {

enum class ScalarKind { kFloat, kHalf, kBFloat16 };

struct AttentionParams {
  // v1 and varlen: `out` only. v2: exp_sums/max_logits/tmp_out hold per-partition results (row
  // stride num_partitions) and a reduce kernel writes `out`.
  void* out;  // [num_tokens, num_heads, v_head_size], contiguous
  float* exp_sums;
  float* max_logits;
  void* tmp_out;
  const void* query;
  int64_t query_seq_stride;  // between query tokens (decode: sequences)
  int64_t query_head_stride;
  const void* key_cache;  // [num_blocks, num_kv_heads, head_size / x, block_size, x]
  const void* value_cache;  // [num_blocks, num_kv_heads, v_head_size, block_size]
  int64_t key_block_stride;
  int64_t key_head_stride;
  int64_t value_block_stride;
  int64_t value_head_stride;
  const int32_t* block_tables;
  int64_t block_table_stride;
  int32_t max_blocks_per_seq;
  const int32_t* seq_lens;
  // Varlen: sequence s owns query rows [query_start_loc[s], query_start_loc[s + 1]) (values
  // clamped to [0, num_tokens] and q_len to max_query_len, so no input reaches outside `query`
  // or `out`). nullptr for decode: sequence s owns query row s.
  const int32_t* query_start_loc;
  int32_t num_tokens;  // rows of query and out (decode: num_seqs)
  int32_t max_query_len;  // decode: 1
  const float* sinks;  // [num_heads] extra softmax logits (varlen), or nullptr
  int32_t num_seqs;
  int32_t num_heads;
  int32_t num_kv_heads;
  int32_t head_size;  // of the query and the keys
  // Of the values, out and the partial results: head_size, but for multi-head latent attention
  // (keys 192, values 128, say). Both run in the bucket of the larger (plan_head_size).
  int32_t v_head_size;
  int32_t block_size;  // 8, 16 or 32
  int32_t max_seq_len;
  float scale;
  float logits_soft_cap;  // 0 = none
  int32_t sliding_window;  // 0 = none
  int32_t attention_chunk_size;  // 0 = none; else a query at p attends [p - p % C, p] only
  const float* alibi_slopes;  // [num_heads] or nullptr
  const float* k_scale;  // device pointers, read only for fp8 caches
  const float* v_scale;
  int32_t num_partitions;  // v2: scratch partitions (>= ceil(max_seq_len / partition_size))
  ScalarKind scalar;
  CacheDtype cache;
};

enum class AttentionOp { kDecodeV1, kDecodeV2, kVarlen };

constexpr int kWarpSize = 32;
constexpr int kAttentionThreads = 128;  // four warps per CTA
constexpr int kAttentionWarps = kAttentionThreads / kWarpSize;
constexpr int kMaxHeadSize = 256;
// v2 splits each sequence into partitions of this many tokens (checks.h's kPartitionSize; the
// glue asserts they agree).
constexpr int kV2PartitionSize = 512;
// Query rows of one MMA tile (tensor-core kernel), and of one CTA of the CUDA-core kernel (fp32
// queries: the 4 rows a lane's registers hold).
constexpr int kMmaRows = 16;
constexpr int kCudaCoreRows = 4;
// The tensor-core kernel comes in two row tilings (FlashInfer's NUM_WARPS_Q of 1 or 4):
//   1 warp of rows:  the CTA's 16 rows are shared by the four warps, which split its KV tiles
//                    (each through its own ring) and merge their softmax states at the end:
//                    decode and short queries, where the KV bytes are the cost;
//   4 warps of rows: each warp owns 16 of the CTA's 64 rows and every warp reads every KV tile
//                    of one CTA-wide ring: long queries, where each KV byte then serves 64 rows.
constexpr int kNarrowRowWarps = 1;
constexpr int kWideRowWarps = 4;
// v1 / varlen split-KV: a split has at least this many tokens, unless the context is shorter.
constexpr int kMinSplitTokens = 128;
// The fixed cost of a CTA (query staging, ring fill, merge) in 16-token tiles, for choosing the
// number of splits.
constexpr int kCtaOverheadTiles = 8;
constexpr int kMaxSplits = 1024;
// Threads of the one CTA that lists a varlen launch's (sequence, query chunk) work items.
constexpr int kScheduleThreads = 256;

enum class KernelFamily {
  kTensorCore,  // fp16/bf16 queries: mma.sync, query rows on the MMA's M dimension
  kCudaCore,    // fp32 queries: FMAs, query in registers
};

// ---- the GPUs a launch is planned for ----------------------------------------------------

// The limits of one GPU that shape a launch: the CUDA device attributes of the same names.
struct DeviceLimits {
  int sms;  // cudaDevAttrMultiProcessorCount
  uint32_t shared_per_block_optin;  // cudaDevAttrMaxSharedMemoryPerBlockOptin
  uint32_t shared_per_sm;  // cudaDevAttrMaxSharedMemoryPerMultiprocessor
  uint32_t reserved_shared_per_block;  // cudaDevAttrReservedSharedMemoryPerBlock
  int registers_per_sm;  // cudaDevAttrMaxRegistersPerMultiprocessor
  int threads_per_sm;  // cudaDevAttrMaxThreadsPerMultiProcessor
  int ctas_per_sm;  // cudaDevAttrMaxBlocksPerMultiprocessor
};

// The architectures the kernels are planned for, with the limits of the CUDA C++ Programming
// Guide's technical specifications per compute capability (`sms`: the first GPU named).
struct TargetGpu {
  const char* arch;
  const char* gpus;
  DeviceLimits limits;
};
inline constexpr TargetGpu kTargetGpus[] = {
    {"sm_80", "A100", {108, 166912, 167936, 1024, 65536, 2048, 32}},
    {"sm_86", "A10, A40, RTX 30 series", {72, 101376, 102400, 1024, 65536, 1536, 16}},
    {"sm_87", "Jetson AGX Orin", {16, 166912, 167936, 1024, 65536, 1536, 16}},
    {"sm_89", "L4, L40S, RTX 40 series", {58, 101376, 102400, 1024, 65536, 1536, 24}},
    {"sm_90", "H100, H200", {132, 232448, 233472, 1024, 65536, 2048, 32}},
    {"sm_100", "B200, B300", {148, 232448, 233472, 1024, 65536, 2048, 32}},
    {"sm_120", "RTX 50 series, RTX PRO 6000 Blackwell", {170, 101376, 102400, 1024, 65536, 1536,
                                                         32}},
};

constexpr uint32_t smallest_target_shared_optin() {
  uint32_t least = kTargetGpus[0].limits.shared_per_block_optin;
  for (const TargetGpu& t : kTargetGpus) least = std::min(least, t.limits.shared_per_block_optin);
  return least;
}
constexpr const DeviceLimits& largest_target() {
  const TargetGpu* most = &kTargetGpus[0];
  for (const TargetGpu& t : kTargetGpus) {
    if (t.limits.shared_per_sm > most->limits.shared_per_sm) most = &t;
  }
  return most->limits;
}

// ---- the kernel variants and their shared memory ------------------------------------------

// The cache ring: stages, each one tile of tokens. Every variant is built with the deepest ring
// that suits GPUs with the most shared memory (sm_80, sm_90: 163 and 227 KiB per CTA) and, where
// that one needs more than the 99 KiB of sm_86, sm_89 and sm_120, also with the deepest ring that
// fits those (compact_ring_stages); the plan takes the deeper one the GPU holds.
// Full rings, per warp with one warp of rows: three stages, or two where a tile is 16 KiB (head
// size 256 with 16- or 32-bit caches), which keeps the ring within an A100's 163 KiB; CTA-wide
// with four warps of rows: four (three for 16 KiB tiles).
constexpr int full_ring_stages(int head_bucket, int cache_element_bytes, int row_warps) {
  const bool large = head_bucket == 256 && cache_element_bytes >= 2;
  if (row_warps > 1) return large ? 3 : 4;
  return large ? 2 : 3;
}

// The kernel a launch runs and its resources.
struct KernelShape {
  KernelFamily family;
  int row_warps;  // tensor-core kernel: warps that own distinct query rows (1 or 4)
  int rows;  // query rows per CTA
  int head_bucket;  // the compiled head size (64, 128 or 256) the actual one is padded to
  int tile_tokens;  // tokens per ring stage
  int stages;  // ring stages (per warp with one warp of rows, else per CTA)
  int heads_per_token;  // query heads of one token a CTA serves (rows = tokens x heads)
  int head_chunks;  // CTAs per KV head (a GQA group larger than a CTA's rows, split evenly)
  int tokens_per_cta;  // query tokens per CTA: rows / heads_per_token
  // Shared memory, from byte 0: the ring, the CUDA-core kernel's probabilities and the staged
  // query rows, which the main loop reads; once it is done, the merge buffer and after it the
  // merge's per-row weights overlay them.
  uint32_t ring_bytes;
  uint32_t probs_offset;  // CUDA-core kernel: per warp, one tile of probabilities
  uint32_t query_offset;  // the CTA's query rows, staged once
  uint32_t merge_bytes;  // the softmax states of the rows
  uint32_t weights_offset;
  uint32_t shared_bytes;
};

constexpr int head_bucket(int head_size) {
  return head_size <= 64 ? 64 : head_size <= 128 ? 128 : 256;
}

// The head size a launch's variant is chosen by: keys and values share the bucket of the larger
// of their head sizes. Keys below it run on zero-padded chunks; values below it fill only their
// own columns of the output accumulators (the bucket's other columns are never stored).
constexpr int plan_head_size(int head_size, int v_head_size) {
  return std::max(head_size, v_head_size);
}

constexpr int cache_element_bytes(ScalarKind scalar, CacheDtype cache) {
  if (cache != CacheDtype::kAuto) return 1;
  return scalar == ScalarKind::kFloat ? 4 : 2;
}

constexpr int tile_tokens(KernelFamily family) {
  return family == KernelFamily::kTensorCore ? 16 : 8;
}

// Softmax states written per row for the final merge: one per warp where the warps split the
// KV tiles (the CUDA-core kernel and one warp of rows), one where each warp owns its rows.
constexpr int merge_contributors(int row_warps) {
  return row_warps > 1 ? 1 : kAttentionWarps;
}
// The row stride of the merge buffer in floats (padded so that the rows of one warp's fragment
// stores fall into different banks).
constexpr int merge_row_floats(int bucket) { return bucket + 8; }
// Elements per staged query row: 16-bit rows padded by 16 bytes, so that the eight rows of a
// fragment read fall into different banks (the padding also holds the row's descale factor).
constexpr int query_row_elements(KernelFamily family, int bucket) {
  return family == KernelFamily::kTensorCore ? bucket + 8 : bucket;
}

constexpr uint32_t align_up(uint32_t bytes, uint32_t alignment) {
  return (bytes + alignment - 1) / alignment * alignment;
}

// The shape of a variant with a ring of `stages` stages (0: the full ring).
constexpr KernelShape attention_kernel_shape(ScalarKind scalar, CacheDtype cache, int head_size,
                                             int num_heads, int num_kv_heads, int row_warps,
                                             int stages = 0) {
  KernelShape k{};
  k.family = scalar == ScalarKind::kFloat ? KernelFamily::kCudaCore : KernelFamily::kTensorCore;
  k.row_warps = k.family == KernelFamily::kTensorCore ? row_warps : 1;
  k.rows = k.family == KernelFamily::kTensorCore ? kMmaRows * k.row_warps : kCudaCoreRows;
  k.head_bucket = head_bucket(head_size);
  k.tile_tokens = tile_tokens(k.family);
  const int group = num_kv_heads > 0 ? std::max(1, num_heads / num_kv_heads) : 1;
  k.head_chunks = (group + k.rows - 1) / k.rows;
  k.heads_per_token = (group + k.head_chunks - 1) / k.head_chunks;
  k.tokens_per_cta = k.rows / k.heads_per_token;
  const int element_bytes = cache_element_bytes(scalar, cache);
  k.stages = stages > 0 ? stages : full_ring_stages(k.head_bucket, element_bytes, k.row_warps);
  const uint32_t tile_bytes = 2u * k.tile_tokens * k.head_bucket * element_bytes;
  k.ring_bytes = (k.row_warps > 1 ? 1 : kAttentionWarps) * k.stages * tile_bytes;
  k.probs_offset = align_up(k.ring_bytes, 128);
  const uint32_t probs_bytes =
      k.family == KernelFamily::kCudaCore ? 4u * kAttentionWarps * kCudaCoreRows * k.tile_tokens
                                          : 0u;
  k.query_offset = align_up(k.probs_offset + probs_bytes, 16);
  const uint32_t query_bytes = k.family == KernelFamily::kTensorCore
                                   ? 2u * k.rows * query_row_elements(k.family, k.head_bucket)
                                   : 4u * kCudaCoreRows * k.head_bucket;
  const int contributors = merge_contributors(k.row_warps);
  k.merge_bytes = 4u * contributors * k.rows * (merge_row_floats(k.head_bucket) + 2);
  k.weights_offset = align_up(k.merge_bytes, 16);
  const uint32_t weights_end = k.weights_offset + 4u * (contributors + 1) * k.rows;
  k.shared_bytes = align_up(std::max(k.query_offset + query_bytes, weights_end), 128);
  return k;
}

// The ring of a variant for GPUs with the smallest shared memory of the targets (99 KiB per
// CTA): the deepest that fits there (one stage at the least, where a warp waits for each tile
// before it computes on it); the full ring where that fits already.
constexpr int compact_ring_stages(ScalarKind scalar, CacheDtype cache, int bucket,
                                  int row_warps) {
  const KernelShape full = attention_kernel_shape(scalar, cache, bucket, 1, 1, row_warps);
  int stages = full.stages;
  while (stages > 1 && attention_kernel_shape(scalar, cache, bucket, 1, 1, row_warps, stages)
                               .shared_bytes > smallest_target_shared_optin()) {
    --stages;
  }
  return stages;
}

// The row tiling of a launch: decode keeps the heads of one token, 16 rows; a varlen launch
// whose longest query has more rows per KV head than one MMA tile takes 64-row CTAs.
constexpr int launch_row_warps(ScalarKind scalar, AttentionOp op, int num_heads, int num_kv_heads,
                               int max_query_len) {
  if (scalar == ScalarKind::kFloat || op != AttentionOp::kVarlen) return kNarrowRowWarps;
  const int group = num_kv_heads > 0 ? std::max(1, num_heads / num_kv_heads) : 1;
  return int64_t{max_query_len} * std::min(group, kMmaRows) > kMmaRows ? kWideRowWarps
                                                                        : kNarrowRowWarps;
}

// ---- occupancy --------------------------------------------------------------------------

// CTAs of kAttentionThreads threads, `shared_bytes` and `registers` per thread that one SM of
// `device` holds at once (what cudaOccupancyMaxActiveBlocksPerMultiprocessor computes):
// registers go to warps in units of 256, from each quarter of the register file to the warps of
// one SM sub-partition.
constexpr int resident_ctas(const DeviceLimits& device, uint32_t shared_bytes, int registers) {
  const int by_shared =
      static_cast<int>(device.shared_per_sm / (shared_bytes + device.reserved_shared_per_block));
  const int warp_registers = static_cast<int>(align_up(32u * std::max(registers, 1), 256));
  const int warps_by_registers = device.registers_per_sm / 4 / warp_registers * 4;
  const int by_registers = warps_by_registers / kAttentionWarps;
  const int by_threads = device.threads_per_sm / kAttentionThreads;
  return std::min({by_shared, by_registers, by_threads, device.ctas_per_sm});
}

// Registers per thread a variant compiled for `ctas` resident CTAs may use at most (the budget
// its __launch_bounds__ gives nvcc).
constexpr int register_budget(int ctas) {
  return std::min(255, 65536 / (kAttentionThreads * ctas) / 8 * 8);
}

// The resident CTAs per SM a variant is compiled for (the minimum of its __launch_bounds__): as
// many as its shared memory allows on the largest GPU it runs on (an H100/H200 for a full ring;
// the largest whose shared memory refuses the full ring for a compact one), and at most as many
// as leave each thread the registers (register_budget: 128 at 4, 168 at 3, 255 at 2) to hold
// the kernel without spills. Tensor cores, head size 64: 4 (3 with one warp of rows and an fp8
// cache, whose conversions need more); 128: 3 (2 with one warp of rows and an fp8 cache; with
// four warps of rows the query fragments are reloaded per tile to fit); 256: 2; CUDA cores: 2.
// Registers thereby never cost a CTA that shared memory would fit.
constexpr int compiled_ctas_per_sm(ScalarKind scalar, CacheDtype cache, int bucket, int row_warps,
                                   int stages) {
  const KernelShape full = attention_kernel_shape(scalar, cache, bucket, 1, 1, row_warps);
  const KernelShape k = attention_kernel_shape(scalar, cache, bucket, 1, 1, row_warps, stages);
  DeviceLimits host = largest_target();
  if (k.stages != full.stages) {
    bool found = false;
    for (const TargetGpu& t : kTargetGpus) {
      if (t.limits.shared_per_block_optin < full.shared_bytes &&
          (!found || t.limits.shared_per_sm > host.shared_per_sm)) {
        host = t.limits;
        found = true;
      }
    }
  }
  const bool fp8 = cache != CacheDtype::kAuto;
  int most = 2;
  if (k.family == KernelFamily::kTensorCore) {
    if (bucket == 64) {
      most = fp8 && k.row_warps == 1 ? 3 : 4;
    } else if (bucket == 128) {
      most = fp8 && k.row_warps == 1 ? 2 : 3;
    }
  }
  const int by_shared = static_cast<int>(host.shared_per_sm /
                                         (k.shared_bytes + host.reserved_shared_per_block));
  return std::max(1, std::min({by_shared, most, 16}));
}

// The kernel shape a launch runs on `device`: the row tiling of the op and the longest query,
// the deepest of the variant's rings that fits the device (shared_bytes is above the device's
// limit only where even the compact ring does not fit: a GPU below the targets).
constexpr KernelShape launch_kernel_shape(ScalarKind scalar, CacheDtype cache, int head_size,
                                          int num_heads, int num_kv_heads, int row_warps,
                                          const DeviceLimits& device) {
  const KernelShape full =
      attention_kernel_shape(scalar, cache, head_size, num_heads, num_kv_heads, row_warps);
  if (full.shared_bytes <= device.shared_per_block_optin) return full;
  return attention_kernel_shape(
      scalar, cache, head_size, num_heads, num_kv_heads, row_warps,
      compact_ring_stages(scalar, cache, head_bucket(head_size), full.row_warps));
}

// ---- splits of the KV sequence ------------------------------------------------------------

// How one launch splits each sequence.
struct SplitPlan {
  int splits;  // CTAs per (work item, KV head chunk)
  int split_tokens;  // tokens per split (a multiple of 16)
};

// The number of splits that fills whole waves of `ctas_per_sm * num_sms` CTAs best for `work`
// CTAs without splits, by a cost model of ceil(CTAs / slots) waves, each as long as one split's
// tiles plus a fixed CTA overhead. Depends only on host values (no device sync; the same launch
// in a CUDA graph).
inline SplitPlan plan_splits(int64_t work, int max_seq_len, int num_sms, int ctas_per_sm) {
  if (max_seq_len <= 0 || work <= 0) return {1, 16};
  const auto round_tiles = [](int64_t tokens) { return (tokens + 15) / 16 * 16; };
  const int64_t slots = std::max<int64_t>(1, int64_t{num_sms} * std::max(1, ctas_per_sm));
  const int64_t most = std::max<int64_t>(
      1, std::min<int64_t>((max_seq_len + kMinSplitTokens - 1) / kMinSplitTokens, kMaxSplits));
  SplitPlan best{0, 0};
  int64_t best_cost = 0;
  for (int64_t s = 1; s <= most; ++s) {
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

// Everything one launch of the attention kernel needs besides AttentionParams.
struct AttentionLaunch {
  int heads_per_token;
  int head_chunks;
  int tokens_per_cta;
  int split_tokens;
  int num_splits;  // grid z; the row stride of the partial results
  bool partial;  // write per-split partial results (v2, or v1 / varlen with several splits)
  bool partial_fp32;  // partial outputs in float32 (v1 / varlen scratch) or query dtype (v2)
  float* max_logits;  // [num_tokens, num_heads, num_splits]
  float* exp_sums;
  void* partial_out;  // [num_tokens, num_heads, num_splits, v_head_size]
  // Varlen with queries longer than a CTA's tokens: (sequence, query chunk) of CTA x, written
  // by the schedule kernel; (-1, 0) past the last. nullptr: CTA x serves sequence x (chunk 0).
  const int32_t* work;
  float inverse_soft_cap;  // 1 / logits_soft_cap (0 without a cap), divided once on the host
};

}  // namespace paged_attention::cuda
