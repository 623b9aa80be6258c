// CPU implementations of the paged_attention ops (registered in cpu_ops.cpp).
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <string>
#include <vector>

namespace paged_attention::cpu {

void reshape_and_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
                       at::Tensor& value_cache, const at::Tensor& slot_mapping,
                       const std::string& kv_cache_dtype, const at::Tensor& k_scale,
                       const at::Tensor& v_scale);

void copy_blocks(const std::vector<at::Tensor>& key_caches,
                 const std::vector<at::Tensor>& value_caches, const at::Tensor& block_mapping);

void swap_blocks(const at::Tensor& src, at::Tensor& dst, const at::Tensor& block_mapping);

}  // namespace paged_attention::cpu
