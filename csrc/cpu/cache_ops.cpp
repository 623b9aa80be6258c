// CPU cache ops: write new tokens into the paged cache, copy blocks (copy-on-write), swap blocks.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>

#include "checks.h"
#include "cpu/cpu_ops.h"
#include "fp8.h"

namespace paged_attention::cpu {

namespace {

// Scatters key/value rows into the x-tiled key layout and the transposed value layout (the
// values of their own head size).
// `encode(value, scale)` turns one input element into one cache element. The strides are read
// once and the key's tiles addressed per tile, not per element: a division per element cost
// more than the copy itself (4x the op's time on a warm cache; on the cold lines of a real
// step the stores themselves dominate).
template <typename scalar_t, typename cache_t, typename Encode>
void scatter_tokens(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
                    at::Tensor& value_cache, const int64_t* slots, const CacheDims& dims,
                    float k_scale, float v_scale, Encode encode) {
  const scalar_t* key_ptr = key.data_ptr<scalar_t>();
  const scalar_t* value_ptr = value.data_ptr<scalar_t>();
  cache_t* key_cache_ptr = static_cast<cache_t*>(key_cache.data_ptr());
  cache_t* value_cache_ptr = static_cast<cache_t*>(value_cache.data_ptr());
  const int64_t block_size = dims.block_size;
  const int64_t x = dims.x;
  const int64_t head_size = dims.head_size;
  const int64_t v_head_size = dims.v_head_size;
  const int64_t k_token = key.stride(0), k_head = key.stride(1), k_elem = key.stride(2);
  const int64_t v_token = value.stride(0), v_head = value.stride(1), v_elem = value.stride(2);
  const int64_t kc_block = key_cache.stride(0), kc_head = key_cache.stride(1);
  const int64_t vc_block = value_cache.stride(0), vc_head = value_cache.stride(1);
  at::parallel_for(0, dims.num_tokens, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t slot = slots[t];
      if (slot < 0) continue;  // padding token: nothing to store
      const int64_t block = slot / block_size;
      const int64_t offset = slot % block_size;
      for (int64_t h = 0; h < dims.num_kv_heads; ++h) {
        const scalar_t* k_row = key_ptr + t * k_token + h * k_head;
        const scalar_t* v_row = value_ptr + t * v_token + h * v_head;
        cache_t* k_dst = key_cache_ptr + block * kc_block + h * kc_head + offset * x;
        cache_t* v_dst = value_cache_ptr + block * vc_block + h * vc_head + offset;
        for (int64_t d0 = 0, tile = 0; d0 < head_size; d0 += x, ++tile) {
          cache_t* k_tile = k_dst + tile * block_size * x;
          const int64_t width = std::min(x, head_size - d0);
          for (int64_t i = 0; i < width; ++i) {
            k_tile[i] = encode(k_row[(d0 + i) * k_elem], k_scale);
          }
        }
        for (int64_t d = 0; d < v_head_size; ++d) {
          v_dst[d * block_size] = encode(v_row[d * v_elem], v_scale);
        }
      }
    }
  });
}

// Copies whole blocks: dst_base[pair.dst] = src_base[pair.src] for every pair of every tensor.
struct BlockCopy {
  const char* src;
  char* dst;
  int64_t src_stride;
  int64_t dst_stride;
  int64_t bytes;
};

void copy_pairs(const std::vector<BlockCopy>& tensors, const at::Tensor& block_mapping) {
  const at::Tensor mapping = block_mapping.contiguous();
  const int64_t* pairs = mapping.data_ptr<int64_t>();
  const int64_t num_pairs = mapping.size(0);
  const int64_t num_tensors = static_cast<int64_t>(tensors.size());
  at::parallel_for(0, num_tensors * num_pairs, 4, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const BlockCopy& t = tensors[i / num_pairs];
      const int64_t pair = i % num_pairs;
      std::memcpy(t.dst + pairs[2 * pair + 1] * t.dst_stride, t.src + pairs[2 * pair] * t.src_stride,
                  t.bytes);
    }
  });
}

}  // namespace

void reshape_and_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
                       at::Tensor& value_cache, const at::Tensor& slot_mapping,
                       const std::string& kv_cache_dtype, const at::Tensor& k_scale,
                       const at::Tensor& v_scale) {
  const CacheDims dims = check_reshape_and_cache_args(key, value, key_cache, value_cache,
                                                      slot_mapping, kv_cache_dtype, k_scale,
                                                      v_scale);
  check_slot_mapping(slot_mapping, dims);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, key.scalar_type(), "reshape_and_cache", [&] {
    switch (dims.cache_dtype) {
      case CacheDtype::kAuto:
        scatter_tokens<scalar_t, scalar_t>(key, value, key_cache, value_cache, slots, dims, 1.0f,
                                           1.0f, [](scalar_t v, float) { return v; });
        break;
      case CacheDtype::kFp8E4M3:
        scatter_tokens<scalar_t, uint8_t>(
            key, value, key_cache, value_cache, slots, dims, k_scale.item<float>(),
            v_scale.item<float>(), [](scalar_t v, float scale) {
              return quantize_fp8<c10::Float8_e4m3fn>(static_cast<float>(v), scale);
            });
        break;
      case CacheDtype::kFp8E5M2:
        scatter_tokens<scalar_t, uint8_t>(
            key, value, key_cache, value_cache, slots, dims, k_scale.item<float>(),
            v_scale.item<float>(), [](scalar_t v, float scale) {
              return quantize_fp8<c10::Float8_e5m2>(static_cast<float>(v), scale);
            });
        break;
    }
  });
}

void copy_blocks(const std::vector<at::Tensor>& key_caches,
                 const std::vector<at::Tensor>& value_caches, const at::Tensor& block_mapping) {
  check_copy_blocks_args(key_caches, value_caches, block_mapping);
  if (key_caches.empty() || block_mapping.size(0) == 0) return;
  std::vector<BlockCopy> tensors;
  for (const auto* caches : {&key_caches, &value_caches}) {
    for (const at::Tensor& cache : *caches) {
      char* base = static_cast<char*>(cache.data_ptr());
      tensors.push_back({base, base, block_stride_bytes(cache), block_stride_bytes(cache),
                         block_bytes(cache)});
    }
  }
  copy_pairs(tensors, block_mapping);
}

void swap_blocks(const at::Tensor& src, at::Tensor& dst, const at::Tensor& block_mapping) {
  check_swap_blocks_args(src, dst, block_mapping);
  if (block_mapping.size(0) == 0) return;
  copy_pairs({{static_cast<const char*>(src.data_ptr()), static_cast<char*>(dst.data_ptr()),
               block_stride_bytes(src), block_stride_bytes(dst), block_bytes(src)}},
             block_mapping);
}

}  // namespace paged_attention::cpu
