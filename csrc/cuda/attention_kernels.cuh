// The CUDA attention kernels: __global__ wrappers around the kernel bodies of
// csrc/cuda/attention/ (written against csrc/cuda/primitives/ and tested on the host by its
// emulation), and their launchers. Included by one .cu file per query dtype, which instantiates
// only its variants.
//
// The design follows vLLM's classic kernels (csrc/attention/attention_kernels.cuh) for the
// cache layout, the op semantics and v2's partitions, and FlashInfer's prefill kernel, which
// also serves its decode (tensor cores with query rows as the MMA's M rows, a cp.async K/V ring,
// split-KV with a merge): see mma_attention.h and cuda_core_attention.h.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <type_traits>

#include "cuda/attention/cuda_core_attention.h"
#include "cuda/attention/dispatch.h"
#include "cuda/attention/mma_attention.h"
#include "cuda/attention/reduce.h"
#include "cuda/attention/schedule.h"
#include "cuda/launchers.h"

namespace paged_attention::cuda {

template <typename Scalar, CacheDtype kCache, int kD, int kRowWarps>
__global__ void __launch_bounds__(kAttentionThreads,
                                  compiled_ctas_per_sm(Scalar::kKind, kCache, kD, kRowWarps))
    mma_attention_kernel(const AttentionParams p, const AttentionLaunch launch) {
  mma_attention<Scalar, kCache, kD, kRowWarps>(p, launch);
}

template <CacheDtype kCache, int kD>
__global__ void __launch_bounds__(kAttentionThreads, compiled_ctas_per_sm(ScalarKind::kFloat,
                                                                          kCache, kD,
                                                                          kNarrowRowWarps))
    cuda_core_attention_kernel(const AttentionParams p, const AttentionLaunch launch) {
  cuda_core_attention<kCache, kD>(p, launch);
}

template <typename Scalar, bool kPartialFp32>
__global__ void __launch_bounds__(kReduceThreads)
    reduce_partials_kernel(const AttentionParams p, const AttentionLaunch launch) {
  reduce_partials<Scalar, kPartialFp32>(p, launch);
}

// A template (of the thread count) so that every .cu file including this header may instantiate
// it: the copies merge at link time.
template <int kThreads>
__global__ void __launch_bounds__(kThreads)
    schedule_varlen_kernel(const AttentionParams p, int tokens_per_cta, int32_t* work,
                           int num_items) {
  static_assert(kThreads == kScheduleThreads, "the schedule body's thread count");
  schedule_varlen_work(p, tokens_per_cta, work, num_items);
}

template <typename Scalar, CacheDtype kCache, int kD, int kRowWarps>
constexpr auto attention_kernel() {
  if constexpr (std::is_same_v<Scalar, Float32>) {
    return cuda_core_attention_kernel<kCache, kD>;
  } else {
    return mma_attention_kernel<Scalar, kCache, kD, kRowWarps>;
  }
}

// Calls f.template operator()<kCache, kD, kRowWarps>() for the compiled variant of a shape.
template <typename Scalar, typename F>
decltype(auto) with_variant(CacheDtype cache, const KernelShape& shape, F&& f) {
  return with_attention_variant<!std::is_same_v<Scalar, Float32>>(cache, shape,
                                                                   std::forward<F>(f));
}

constexpr int kMaxDevices = 64;

// Raises a variant's dynamic shared memory limit on `device` (once) and returns its resident
// CTAs per SM there, cached per device (0 while unknown).
template <typename Scalar, CacheDtype kCache, int kD, int kRowWarps>
cudaError_t prepare_variant(int device, uint32_t shared_bytes, int* ctas_per_sm) {
  static std::atomic<int> cached[kMaxDevices];
  if (device >= 0 && device < kMaxDevices) {
    const int known = cached[device].load(std::memory_order_relaxed);
    if (known > 0) {
      *ctas_per_sm = known;
      return cudaSuccess;
    }
  }
  const auto kernel = attention_kernel<Scalar, kCache, kD, kRowWarps>();
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
cudaError_t plan_attention_on_device(const AttentionParams& p, AttentionOp op,
                                     AttentionPlan* plan) {
  int device = 0, sms = 0, limit = 0;
  cudaError_t status = cudaGetDevice(&device);
  if (status == cudaSuccess) status = multiprocessor_count(device, &sms);
  if (status == cudaSuccess) {
    status = cudaDeviceGetAttribute(&limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  }
  if (status != cudaSuccess) return status;
  const KernelShape shape = launch_shape(p, op);
  int ctas_per_sm = 1;
  if (shape.shared_bytes <= static_cast<uint32_t>(limit)) {
    status = with_variant<Scalar>(p.cache, shape, [&]<CacheDtype kCache, int kD, int kRowWarps>() {
      return prepare_variant<Scalar, kCache, kD, kRowWarps>(device, shape.shared_bytes,
                                                            &ctas_per_sm);
    });
    if (status != cudaSuccess) return status;
  }
  *plan = make_attention_plan(p, op, sms, ctas_per_sm);
  return cudaSuccess;
}

template <typename Scalar>
cudaError_t launch_attention_kernels(const AttentionParams& p, const AttentionPlan& plan,
                                     void* scratch, cudaStream_t stream) {
  if (plan.grid_x == 0 || p.num_heads == 0) return cudaSuccess;
  int device = 0;
  cudaError_t status = cudaGetDevice(&device);
  if (status != cudaSuccess) return status;
  const AttentionLaunch launch = attention_launch(p, plan, scratch);
  if (plan.scheduled) {
    schedule_varlen_kernel<kScheduleThreads><<<1, kScheduleThreads, kScheduleSharedBytes,
                                               stream>>>(
        p, plan.shape.tokens_per_cta, static_cast<int32_t*>(scratch), plan.grid_x);
    status = cudaGetLastError();
    if (status != cudaSuccess) return status;
  }
  status = with_variant<Scalar>(p.cache, plan.shape, [&]<CacheDtype kCache, int kD,
                                                         int kRowWarps>() {
    int ctas_per_sm = 0;
    const cudaError_t prepared = prepare_variant<Scalar, kCache, kD, kRowWarps>(
        device, plan.shape.shared_bytes, &ctas_per_sm);
    if (prepared != cudaSuccess) return prepared;
    attention_kernel<Scalar, kCache, kD, kRowWarps>()<<<dim3(plan.grid_x, plan.grid_y,
                                                             plan.grid_z),
                                                        kAttentionThreads,
                                                        plan.shape.shared_bytes, stream>>>(
        p, launch);
    return cudaGetLastError();
  });
  if (status != cudaSuccess || !plan.partial) return status;
  const dim3 grid(plan.grid_x, plan.grid_y, plan.reduce_rows);
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
