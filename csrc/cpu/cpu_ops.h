// CPU implementations of the paged_attention ops (registered in cpu_ops.cpp).
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <string>
#include <vector>

namespace paged_attention::cpu {

void paged_attention_v1(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                        const at::Tensor& value_cache, int64_t num_kv_heads, double scale,
                        const at::Tensor& block_tables, const at::Tensor& seq_lens,
                        int64_t block_size, int64_t max_seq_len,
                        const std::optional<at::Tensor>& alibi_slopes,
                        const std::string& kv_cache_dtype, const at::Tensor& k_scale,
                        const at::Tensor& v_scale, int64_t sliding_window,
                        double logits_soft_cap, int64_t attention_chunk_size);

void paged_attention_v2(at::Tensor& out, at::Tensor& exp_sums, at::Tensor& max_logits,
                        at::Tensor& tmp_out, const at::Tensor& query, const at::Tensor& key_cache,
                        const at::Tensor& value_cache, int64_t num_kv_heads, double scale,
                        const at::Tensor& block_tables, const at::Tensor& seq_lens,
                        int64_t block_size, int64_t max_seq_len,
                        const std::optional<at::Tensor>& alibi_slopes,
                        const std::string& kv_cache_dtype, const at::Tensor& k_scale,
                        const at::Tensor& v_scale, int64_t sliding_window,
                        double logits_soft_cap, int64_t attention_chunk_size);

void paged_attention_varlen(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                            const at::Tensor& value_cache, int64_t num_kv_heads, double scale,
                            const at::Tensor& block_tables, const at::Tensor& seq_lens,
                            const at::Tensor& query_start_loc, int64_t max_query_len,
                            int64_t max_seq_len, const std::optional<at::Tensor>& alibi_slopes,
                            const std::string& kv_cache_dtype, const at::Tensor& k_scale,
                            const at::Tensor& v_scale, int64_t sliding_window,
                            double logits_soft_cap, const std::optional<at::Tensor>& sinks,
                            int64_t attention_chunk_size);

void reshape_and_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
                       at::Tensor& value_cache, const at::Tensor& slot_mapping,
                       const std::string& kv_cache_dtype, const at::Tensor& k_scale,
                       const at::Tensor& v_scale);

void copy_blocks(const std::vector<at::Tensor>& key_caches,
                 const std::vector<at::Tensor>& value_caches, const at::Tensor& block_mapping);

void swap_blocks(const at::Tensor& src, at::Tensor& dst, const at::Tensor& block_mapping);

}  // namespace paged_attention::cpu
