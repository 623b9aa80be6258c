// The CUDA decode kernels: __global__ wrappers around the kernel bodies of csrc/cuda/attention/
// (written against csrc/cuda/primitives/ and tested on the host by its emulation), and their
// launchers. Included by one .cu file per query dtype, which instantiates only its variants.
//
// The design follows vLLM's classic kernels (csrc/attention/attention_kernels.cuh) for the
// cache layout, the op semantics and v2's partitions, and FlashInfer's decode for grouped
// queries (tensor cores with the GQA group as the MMA's M rows, a cp.async K/V ring, block ids
// staged in shared memory, split-KV with a merge): see mma_decode.h and cuda_core_decode.h.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <type_traits>

#include "cuda/attention/cuda_core_decode.h"
#include "cuda/attention/dispatch.h"
#include "cuda/attention/mma_decode.h"
#include "cuda/attention/reduce.h"
#include "cuda/launchers.h"

namespace paged_attention::cuda {

template <typename Scalar, CacheDtype kCache, int kD>
__global__ void __launch_bounds__(kAttentionThreads,
                                  compiled_ctas_per_sm(Scalar::kKind, kCache, kD))
    mma_decode_kernel(const AttentionParams p, const DecodeLaunch launch) {
  mma_decode<Scalar, kCache, kD>(p, launch);
}

template <CacheDtype kCache, int kD>
__global__ void __launch_bounds__(kAttentionThreads,
                                  compiled_ctas_per_sm(ScalarKind::kFloat, kCache, kD))
    cuda_core_decode_kernel(const AttentionParams p, const DecodeLaunch launch) {
  cuda_core_decode<kCache, kD>(p, launch);
}

template <typename Scalar, bool kPartialFp32>
__global__ void __launch_bounds__(kReduceThreads)
    reduce_partials_kernel(const AttentionParams p, const DecodeLaunch launch) {
  reduce_partials<Scalar, kPartialFp32>(p, launch);
}

template <typename Scalar, CacheDtype kCache, int kD>
constexpr auto decode_kernel() {
  if constexpr (std::is_same_v<Scalar, Float32>) {
    return cuda_core_decode_kernel<kCache, kD>;
  } else {
    return mma_decode_kernel<Scalar, kCache, kD>;
  }
}

constexpr int kMaxDevices = 64;

// Raises a variant's dynamic shared memory limit on `device` (once) and returns its resident
// CTAs per SM there, cached per device (0 while unknown).
template <typename Scalar, CacheDtype kCache, int kD>
cudaError_t prepare_variant(int device, uint32_t shared_bytes, int* ctas_per_sm) {
  static std::atomic<int> cached[kMaxDevices];
  if (device >= 0 && device < kMaxDevices) {
    const int known = cached[device].load(std::memory_order_relaxed);
    if (known > 0) {
      *ctas_per_sm = known;
      return cudaSuccess;
    }
  }
  const auto kernel = decode_kernel<Scalar, kCache, kD>();
  cudaError_t status = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                            static_cast<int>(shared_bytes));
  int ctas = 0;
  if (status == cudaSuccess) {
    status = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&ctas, kernel, kAttentionThreads,
                                                           shared_bytes);
  }
  if (status != cudaSuccess) return status;
  ctas = ctas > 0 ? ctas : 1;
  if (device >= 0 && device < kMaxDevices) cached[device].store(ctas, std::memory_order_relaxed);
  *ctas_per_sm = ctas;
  return cudaSuccess;
}

inline cudaError_t multiprocessor_count(int device, int* count) {
  static std::atomic<int> cached[kMaxDevices];
  if (device >= 0 && device < kMaxDevices) {
    const int known = cached[device].load(std::memory_order_relaxed);
    if (known > 0) {
      *count = known;
      return cudaSuccess;
    }
  }
  const cudaError_t status =
      cudaDeviceGetAttribute(count, cudaDevAttrMultiProcessorCount, device);
  if (status == cudaSuccess && device >= 0 && device < kMaxDevices) {
    cached[device].store(*count, std::memory_order_relaxed);
  }
  return status;
}

template <typename Scalar>
cudaError_t plan_decode_on_device(const AttentionParams& p, bool v2, DecodePlan* plan) {
  int device = 0, sms = 0, limit = 0;
  cudaError_t status = cudaGetDevice(&device);
  if (status == cudaSuccess) status = multiprocessor_count(device, &sms);
  if (status == cudaSuccess) {
    status = cudaDeviceGetAttribute(&limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  }
  if (status != cudaSuccess) return status;
  const KernelShape shape =
      attention_kernel_shape(p.scalar, p.cache, p.head_size, p.num_heads, p.num_kv_heads);
  int ctas_per_sm = 1;
  if (shape.shared_bytes <= static_cast<uint32_t>(limit)) {
    status = with_decode_variant(p.cache, p.head_size, [&]<CacheDtype kCache, int kD>() {
      return prepare_variant<Scalar, kCache, kD>(device, shape.shared_bytes, &ctas_per_sm);
    });
    if (status != cudaSuccess) return status;
  }
  *plan = plan_decode(p, v2, sms, ctas_per_sm);
  return cudaSuccess;
}

template <typename Scalar>
cudaError_t launch_decode(const AttentionParams& p, const DecodePlan& plan, float* scratch,
                          cudaStream_t stream) {
  if (p.num_seqs == 0 || p.num_heads == 0) return cudaSuccess;
  int device = 0;
  cudaError_t status = cudaGetDevice(&device);
  if (status != cudaSuccess) return status;
  const DecodeLaunch launch = decode_launch(p, plan, scratch);
  status = with_decode_variant(p.cache, p.head_size, [&]<CacheDtype kCache, int kD>() {
    int ctas_per_sm = 0;
    const cudaError_t prepared =
        prepare_variant<Scalar, kCache, kD>(device, plan.shape.shared_bytes, &ctas_per_sm);
    if (prepared != cudaSuccess) return prepared;
    decode_kernel<Scalar, kCache, kD>()<<<dim3(plan.grid_x, plan.grid_y, plan.grid_z),
                                          kAttentionThreads, plan.shape.shared_bytes, stream>>>(
        p, launch);
    return cudaGetLastError();
  });
  if (status != cudaSuccess || !plan.partial) return status;
  const dim3 grid(p.num_seqs, p.num_heads);
  if (launch.partial_fp32) {
    reduce_partials_kernel<Scalar, true><<<grid, kReduceThreads, kReduceSharedBytes, stream>>>(
        p, launch);
  } else {
    reduce_partials_kernel<Scalar, false><<<grid, kReduceThreads, kReduceSharedBytes, stream>>>(
        p, launch);
  }
  return cudaGetLastError();
}

}  // namespace paged_attention::cuda
