// Cache kernels: scatter new tokens into the paged cache (optionally quantising to fp8) and copy
// whole blocks in batches (copy_blocks, swap_blocks). The design follows vLLM's
// csrc/cache_kernels.cu; the block copy serves all tensors and pairs in one launch.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "cuda/launchers.h"
#include "fp8.h"

// copy_blocks passes up to kMaxCopyTensorsPerLaunch tensor descriptors (10 KiB) as kernel
// parameters, which CUDA allows from 12.1 on (4 KiB before).
#if CUDART_VERSION < 12010
#error "paged_attention's CUDA kernels need CUDA 12.1 or newer"
#endif

namespace paged_attention::cuda {

namespace {

constexpr int kScatterThreads = 256;
constexpr int kCopyThreads = 256;
// Bytes of one block one CTA copies at most; larger blocks are split over grid.z.
constexpr int64_t kCopyChunkBytes = 64 * 1024;

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

// Input element -> cache element: a plain copy for "auto", the CPU op's quantize_fp8 otherwise.
template <typename scalar_t, CacheDtype kCache>
struct Encoder {
  using cache_t = scalar_t;
  __device__ static cache_t encode(scalar_t v, float /*scale*/) { return v; }
};
template <typename scalar_t>
struct Encoder<scalar_t, CacheDtype::kFp8E4M3> {
  using cache_t = uint8_t;
  __device__ static cache_t encode(scalar_t v, float scale) {
    return quantize_fp8<c10::Float8_e4m3fn>(to_float(v), scale);
  }
};
template <typename scalar_t>
struct Encoder<scalar_t, CacheDtype::kFp8E5M2> {
  using cache_t = uint8_t;
  __device__ static cache_t encode(scalar_t v, float scale) {
    return quantize_fp8<c10::Float8_e5m2>(to_float(v), scale);
  }
};

// One CTA per token: its threads walk the num_kv_heads * head_size key elements, then the
// num_kv_heads * v_head_size value elements (the values' own head size).
template <typename scalar_t, CacheDtype kCache>
__global__ void __launch_bounds__(kScatterThreads)
    reshape_and_cache_kernel(const ReshapeAndCacheParams p) {
  using E = Encoder<scalar_t, kCache>;
  using cache_t = typename E::cache_t;
  const int64_t token = blockIdx.x;
  const int64_t slot = p.slot_mapping[token];
  if (slot < 0 || slot >= p.num_slots) return;  // padding token (or, unchecked, out of range)
  const int64_t block = slot / p.block_size;
  const int offset = static_cast<int>(slot % p.block_size);
  const float k_scale = kCache == CacheDtype::kAuto ? 1.0f : *p.k_scale;
  const float v_scale = kCache == CacheDtype::kAuto ? 1.0f : *p.v_scale;
  const scalar_t* key = static_cast<const scalar_t*>(p.key) + token * p.key_strides[0];
  const scalar_t* value = static_cast<const scalar_t*>(p.value) + token * p.value_strides[0];
  cache_t* key_block = static_cast<cache_t*>(p.key_cache) + block * p.key_cache_block_stride;
  cache_t* value_block =
      static_cast<cache_t*>(p.value_cache) + block * p.value_cache_block_stride;
  const int key_elements = p.num_kv_heads * p.head_size;
  for (int i = threadIdx.x; i < key_elements; i += kScatterThreads) {
    const int head = i / p.head_size;
    const int d = i % p.head_size;
    const scalar_t k = key[head * p.key_strides[1] + d * p.key_strides[2]];
    key_block[head * p.key_cache_head_stride + (d / p.x) * p.block_size * p.x + offset * p.x +
              d % p.x] = E::encode(k, k_scale);
  }
  const int value_elements = p.num_kv_heads * p.v_head_size;
  for (int i = threadIdx.x; i < value_elements; i += kScatterThreads) {
    const int head = i / p.v_head_size;
    const int d = i % p.v_head_size;
    const scalar_t v = value[head * p.value_strides[1] + d * p.value_strides[2]];
    value_block[head * p.value_cache_head_stride + d * p.block_size + offset] =
        E::encode(v, v_scale);
  }
}

template <typename scalar_t, CacheDtype kCache>
cudaError_t launch_scatter(const ReshapeAndCacheParams& p, cudaStream_t stream) {
  reshape_and_cache_kernel<scalar_t, kCache>
      <<<static_cast<unsigned>(p.num_tokens), kScatterThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

template <typename scalar_t>
cudaError_t launch_scatter(const ReshapeAndCacheParams& p, cudaStream_t stream) {
  switch (p.cache) {
    case CacheDtype::kAuto:
      return launch_scatter<scalar_t, CacheDtype::kAuto>(p, stream);
    case CacheDtype::kFp8E4M3:
      return launch_scatter<scalar_t, CacheDtype::kFp8E4M3>(p, stream);
    case CacheDtype::kFp8E5M2:
      return launch_scatter<scalar_t, CacheDtype::kFp8E5M2>(p, stream);
  }
  return cudaErrorInvalidValue;
}

struct CopyBatch {
  CopyTensor tensors[kMaxCopyTensorsPerLaunch];
  const int64_t* mapping;  // [num_pairs, 2]
};

// grid: (pair, tensor, chunk of the block). The batch is read in place from parameter memory
// (__grid_constant__: no per-thread copy). `word_t` is the widest unit that divides every
// pointer, stride and size of the batch.
template <typename word_t>
__global__ void __launch_bounds__(kCopyThreads)
    copy_blocks_kernel(const __grid_constant__ CopyBatch batch) {
  const int64_t pair = blockIdx.x;
  const CopyTensor& t = batch.tensors[blockIdx.y];
  const int64_t src_block = batch.mapping[2 * pair];
  const int64_t dst_block = batch.mapping[2 * pair + 1];
  const int64_t begin = blockIdx.z * kCopyChunkBytes;
  if (begin >= t.block_bytes) return;
  const int64_t words = (min(t.block_bytes, begin + kCopyChunkBytes) - begin) /
                        static_cast<int64_t>(sizeof(word_t));
  const word_t* src =
      reinterpret_cast<const word_t*>(t.src + src_block * t.src_block_stride_bytes + begin);
  word_t* dst = reinterpret_cast<word_t*>(t.dst + dst_block * t.dst_block_stride_bytes + begin);
#pragma unroll 4
  for (int64_t i = threadIdx.x; i < words; i += kCopyThreads) dst[i] = src[i];
}

bool aligned_to(int64_t value, int64_t alignment) { return value % alignment == 0; }

bool batch_aligned_to(const CopyTensor* tensors, int count, int64_t alignment) {
  for (int i = 0; i < count; ++i) {
    const CopyTensor& t = tensors[i];
    if (!aligned_to(reinterpret_cast<intptr_t>(t.src), alignment) ||
        !aligned_to(reinterpret_cast<intptr_t>(t.dst), alignment) ||
        !aligned_to(t.src_block_stride_bytes, alignment) ||
        !aligned_to(t.dst_block_stride_bytes, alignment) || !aligned_to(t.block_bytes, alignment)) {
      return false;
    }
  }
  return true;
}

}  // namespace

cudaError_t launch_reshape_and_cache(const ReshapeAndCacheParams& params, cudaStream_t stream) {
  if (params.num_tokens == 0) return cudaSuccess;
  switch (params.scalar) {
    case ScalarKind::kFloat:
      return launch_scatter<float>(params, stream);
    case ScalarKind::kHalf:
      return launch_scatter<__half>(params, stream);
    case ScalarKind::kBFloat16:
      return launch_scatter<__nv_bfloat16>(params, stream);
  }
  return cudaErrorInvalidValue;
}

cudaError_t copy_blocks_batched(const CopyTensor* tensors, int num_tensors, const int64_t* mapping,
                                int64_t num_pairs, cudaStream_t stream) {
  for (int first = 0; first < num_tensors && num_pairs > 0; first += kMaxCopyTensorsPerLaunch) {
    const int count = std::min(kMaxCopyTensorsPerLaunch, num_tensors - first);
    CopyBatch batch{};
    int64_t max_bytes = 0;
    for (int i = 0; i < count; ++i) {
      batch.tensors[i] = tensors[first + i];
      max_bytes = std::max(max_bytes, tensors[first + i].block_bytes);
    }
    batch.mapping = mapping;
    if (max_bytes == 0) continue;
    const dim3 grid(static_cast<unsigned>(num_pairs), static_cast<unsigned>(count),
                    static_cast<unsigned>((max_bytes + kCopyChunkBytes - 1) / kCopyChunkBytes));
    if (batch_aligned_to(batch.tensors, count, 16)) {
      copy_blocks_kernel<uint4><<<grid, kCopyThreads, 0, stream>>>(batch);
    } else if (batch_aligned_to(batch.tensors, count, 4)) {
      copy_blocks_kernel<uint32_t><<<grid, kCopyThreads, 0, stream>>>(batch);
    } else {
      copy_blocks_kernel<uint8_t><<<grid, kCopyThreads, 0, stream>>>(batch);
    }
    const cudaError_t status = cudaGetLastError();
    if (status != cudaSuccess) return status;
  }
  return cudaSuccess;
}

}  // namespace paged_attention::cuda
