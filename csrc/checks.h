// Argument validation shared by the CPU and CUDA backends.
//
// Shape, dtype and device checks run on every call. Checks of tensor *contents* (block ids, slots,
// mapping entries, seq_lens) need the data on the host: the CPU backend always runs them; the
// CUDA backend runs them only when the environment variable PAGED_ATTENTION_DEBUG_CHECKS=1 is set,
// because they need a device-to-host copy (a synchronisation that also breaks CUDA graphs).
#pragma once

#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "cache_dtype.h"

namespace paged_attention {

// v2 splits each sequence into partitions of this many tokens.
constexpr int64_t kPartitionSize = 512;

// "auto" | "fp8" | "fp8_e4m3" | "fp8_e5m2"; anything else raises, naming kv_cache_dtype.
CacheDtype parse_cache_dtype(const std::string& kv_cache_dtype);

// Head sizes and block sizes the kernels are built for.
const std::vector<int64_t>& supported_head_sizes();
const std::vector<int64_t>& supported_block_sizes();

struct AttentionDims {
  int64_t num_seqs;
  int64_t num_heads;
  int64_t num_kv_heads;
  int64_t head_size;    // of the query and keys
  int64_t v_head_size;  // of the values and out: value_cache.size(2)
  int64_t block_size;
  int64_t num_blocks;
  int64_t max_blocks_per_seq;  // block_tables.size(1)
  int64_t max_seq_len;
  int64_t max_partitions;  // ceil(max_seq_len / kPartitionSize), at least 1
  CacheDtype cache_dtype;
};

// The arguments every attention op takes (paged_attention_v1, _v2, _varlen), named as in their
// schemas: each op gathers them once and hands them to the checks and to its backend.
struct AttentionArgs {
  const at::Tensor& out;
  const at::Tensor& query;
  const at::Tensor& key_cache;
  const at::Tensor& value_cache;
  int64_t num_kv_heads;
  double scale;
  const at::Tensor& block_tables;
  const at::Tensor& seq_lens;
  int64_t max_seq_len;
  const std::optional<at::Tensor>& alibi_slopes;
  const std::string& kv_cache_dtype;
  const at::Tensor& k_scale;
  const at::Tensor& v_scale;
  int64_t sliding_window;
  double logits_soft_cap;
  int64_t attention_chunk_size;
};

// The first position a query at `pos` (>= 0) attends: with a sliding window W the last W
// positions, with a chunk size C its own chunk [pos - pos % C, pos], with both the later start
// (0 = none for either).
inline int64_t first_attended_position(int64_t pos, int64_t sliding_window,
                                       int64_t attention_chunk_size) {
  int64_t first = 0;
  if (sliding_window > 0) first = std::max<int64_t>(first, pos - sliding_window + 1);
  if (attention_chunk_size > 0) first = std::max(first, pos - pos % attention_chunk_size);
  return first;
}

// Checks everything but tensor contents for paged_attention_v1/v2 and returns the dimensions.
// Requirements: query [num_seqs, num_heads, head_size] with unit stride in the last dim (it may be
// a slice of a fused QKV); out contiguous [num_seqs, num_heads, v_head_size] in query's dtype, where
// v_head_size = value_cache.size(2) (equal to head_size but for multi-head latent attention's
// keys of 192 and values of 128, say); caches in the layout of docs/design.md, contiguous within a block (dims 0 and 1 may be strided); block_tables int32
// 2-D with unit inner stride; seq_lens int32 [num_seqs] contiguous; alibi_slopes float32
// [num_heads]; scale finite and logits_soft_cap 0 or positive, both in float32; sliding_window
// and attention_chunk_size >= 0; out sharing no memory with any input.
AttentionDims check_attention_args(const AttentionArgs& args, int64_t block_size);

struct VarlenDims : AttentionDims {
  int64_t num_tokens;  // query rows (num_seqs = query_start_loc.size(0) - 1)
  int64_t max_query_len;
};

// Checks everything but tensor contents for paged_attention_varlen: query [num_tokens,
// num_heads, head_size] and out [num_tokens, num_heads, v_head_size] as for v1; block_size from
// value_cache; query_start_loc int32 [num_seqs + 1] contiguous; sinks float32 [num_heads]
// contiguous; the rest as for v1.
VarlenDims check_varlen_args(const AttentionArgs& args, const at::Tensor& query_start_loc,
                             int64_t max_query_len, const std::optional<at::Tensor>& sinks);

// Contents: query_start_loc starts at 0, never decreases and ends within query's rows; each
// sequence's q_len <= max_query_len and <= seq_len <= max_seq_len; every block id a row reads
// in range (from the first position row 0 attends, inside its window and chunk).
void check_varlen_indices(const at::Tensor& block_tables, const at::Tensor& seq_lens,
                          const at::Tensor& query_start_loc, const VarlenDims& dims,
                          int64_t sliding_window, int64_t attention_chunk_size);

// exp_sums, max_logits: float32 [num_seqs, num_heads, >= max_partitions];
// tmp_out: query dtype [num_seqs, num_heads, same partitions, v_head_size]; all contiguous, sharing
// no memory with each other, out or any input.
void check_v2_scratch(const at::Tensor& exp_sums, const at::Tensor& max_logits,
                      const at::Tensor& tmp_out, const AttentionDims& dims,
                      const AttentionArgs& args);

// Contents: 0 <= seq_lens[i] <= max_seq_len and <= max_blocks_per_seq * block_size; every block
// id a sequence reads (inside the sliding window and the chunk, if any) in [0, num_blocks).
void check_attention_indices(const at::Tensor& block_tables, const at::Tensor& seq_lens,
                             const AttentionDims& dims, int64_t sliding_window,
                             int64_t attention_chunk_size);

struct CacheDims {
  int64_t num_tokens;
  int64_t num_kv_heads;
  int64_t head_size;    // of key
  int64_t v_head_size;  // of value
  int64_t block_size;
  int64_t num_blocks;
  int64_t x;  // elements per 16-byte chunk of the key layout
  CacheDtype cache_dtype;
};

// key [num_tokens, num_kv_heads, head_size], value [num_tokens, num_kv_heads, v_head_size] (the
// value cache's head size), any strides; slot_mapping int64 [num_tokens];
// the caches overlap neither themselves nor any input.
CacheDims check_reshape_and_cache_args(const at::Tensor& key, const at::Tensor& value,
                                       const at::Tensor& key_cache, const at::Tensor& value_cache,
                                       const at::Tensor& slot_mapping,
                                       const std::string& kv_cache_dtype, const at::Tensor& k_scale,
                                       const at::Tensor& v_scale);

// Contents: each slot is negative (skip) or in [0, num_blocks * block_size), and no slot is
// written twice.
void check_slot_mapping(const at::Tensor& slot_mapping, const CacheDims& dims);

// block_mapping int64 [n, 2]; each (src, dst) in range of its pool.
void check_block_mapping_shape(const at::Tensor& block_mapping);
void check_block_mapping(const at::Tensor& block_mapping, int64_t num_src_blocks,
                         int64_t num_dst_blocks);

// key_caches/value_caches: one pair per layer, all with identical shape, dtype and device, none
// overlapping itself or block_mapping. When block_mapping is on the host (or under the debug
// switch) its contents too: ids in range, each destination at most once and never also a source
// (the pairs are copied in parallel; one source may fan out to several destinations).
void check_copy_blocks_args(const std::vector<at::Tensor>& key_caches,
                            const std::vector<at::Tensor>& value_caches,
                            const at::Tensor& block_mapping);

// src/dst: same dtype, same shape after dim 0 (the block dim), each block contiguous, dst not
// overlapping itself or block_mapping. Contents as for copy_blocks where readable; src and dst
// ids index different pools, so a destination that is also a source conflicts only when src and
// dst share memory (then blocks are compared by address).
void check_swap_blocks_args(const at::Tensor& src, const at::Tensor& dst,
                            const at::Tensor& block_mapping);

// `written` (an output) must share no memory with `read` (an input), as torch's out= ops
// require; raises naming both.
void check_no_overlap(const at::Tensor& written, const char* written_name, const at::Tensor& read,
                      const char* read_name);

// Bytes between consecutive blocks of a cache tensor and bytes in one block.
int64_t block_stride_bytes(const at::Tensor& cache);
int64_t block_bytes(const at::Tensor& cache);

// True when PAGED_ATTENTION_DEBUG_CHECKS=1 (read once).
bool debug_checks_enabled();

}  // namespace paged_attention
