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
#include <cstdlib>
#include <type_traits>

#include "cuda/attention/cuda_core_attention.h"
#include "cuda/attention/dispatch.h"
#include "cuda/attention/mma_attention.h"
#include "cuda/attention/reduce.h"
#include "cuda/attention/schedule.h"
#include "cuda/launchers.h"

namespace paged_attention::cuda {

// The parameters are __grid_constant__: the bodies take them by reference, and nvcc reads them
// from the constant bank instead of copying them to local memory first.
template <typename Scalar, CacheDtype kCache, int kD, int kRowWarps, int kStages>
__global__ void __launch_bounds__(kAttentionThreads,
                                  compiled_ctas_per_sm(Scalar::kKind, kCache, kD, kRowWarps,
                                                       kStages))
    mma_attention_kernel(const __grid_constant__ AttentionParams p,
                         const __grid_constant__ AttentionLaunch launch) {
  mma_attention<Scalar, kCache, kD, kRowWarps, kStages>(p, launch);
}

template <CacheDtype kCache, int kD, int kStages>
__global__ void __launch_bounds__(kAttentionThreads,
                                  compiled_ctas_per_sm(ScalarKind::kFloat, kCache, kD,
                                                       kNarrowRowWarps, kStages))
    cuda_core_attention_kernel(const __grid_constant__ AttentionParams p,
                               const __grid_constant__ AttentionLaunch launch) {
  cuda_core_attention<kCache, kD, kStages>(p, launch);
}

template <typename Scalar, bool kPartialFp32>
__global__ void __launch_bounds__(kReduceThreads)
    reduce_partials_kernel(const __grid_constant__ AttentionParams p,
                           const __grid_constant__ AttentionLaunch launch) {
  reduce_partials<Scalar, kPartialFp32>(p, launch);
}

// A template (of the thread count) so that every .cu file including this header may instantiate
// it: the copies merge at link time.
template <int kThreads>
__global__ void __launch_bounds__(kThreads)
    schedule_varlen_kernel(const __grid_constant__ AttentionParams p, int tokens_per_cta,
                           int32_t* work, int num_items) {
  static_assert(kThreads == kScheduleThreads, "the schedule body's thread count");
  schedule_varlen_work(p, tokens_per_cta, work, num_items);
}

template <typename Scalar, CacheDtype kCache, int kD, int kRowWarps, int kStages>
constexpr auto attention_kernel() {
  if constexpr (std::is_same_v<Scalar, Float32>) {
    return cuda_core_attention_kernel<kCache, kD, kStages>;
  } else {
    return mma_attention_kernel<Scalar, kCache, kD, kRowWarps, kStages>;
  }
}

// Calls f.template operator()<kCache, kD, kRowWarps, kStages>() for the compiled variant of a
// shape.
template <typename Scalar, typename F>
decltype(auto) with_variant(CacheDtype cache, const KernelShape& shape, F&& f) {
  return with_attention_variant<Scalar::kKind>(cache, shape, std::forward<F>(f));
}

// The kernel a plan launches (for attributes and occupancy queries).
template <typename Scalar>
const void* planned_kernel(CacheDtype cache, const KernelShape& shape) {
  return with_variant<Scalar>(cache, shape, [&]<CacheDtype kCache, int kD, int kRowWarps,
                                                int kStages>() {
    return reinterpret_cast<const void*>(attention_kernel<Scalar, kCache, kD, kRowWarps,
                                                          kStages>());
  });
}

constexpr int kMaxDevices = 64;

// Raises a variant's dynamic shared memory limit on `device` (once) and returns its resident
// CTAs per SM there, cached per device (0 while unknown).
template <typename Scalar, CacheDtype kCache, int kD, int kRowWarps, int kStages>
cudaError_t prepare_variant(int device, uint32_t shared_bytes, int* ctas_per_sm) {
  static std::atomic<int> cached[kMaxDevices];
  if (device >= 0 && device < kMaxDevices) {
    const int known = cached[device].load(std::memory_order_relaxed);
    if (known > 0) {
      *ctas_per_sm = known;
      return cudaSuccess;
    }
  }
  const auto kernel = attention_kernel<Scalar, kCache, kD, kRowWarps, kStages>();
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

// The limits of `device` that shape a launch, read once per device.
inline cudaError_t device_limits(int device, DeviceLimits* limits) {
  static std::atomic<bool> known[kMaxDevices];
  static DeviceLimits cached[kMaxDevices];
  const bool cacheable = device >= 0 && device < kMaxDevices;
  if (cacheable && known[device].load(std::memory_order_acquire)) {
    *limits = cached[device];
    return cudaSuccess;
  }
  const auto read = [device](cudaDeviceAttr attribute, auto* value) {
    int v = 0;
    const cudaError_t status = cudaDeviceGetAttribute(&v, attribute, device);
    *value = static_cast<std::remove_pointer_t<decltype(value)>>(v);
    return status;
  };
  DeviceLimits d{};
  for (const cudaError_t status :
       {read(cudaDevAttrMultiProcessorCount, &d.sms),
        read(cudaDevAttrMaxSharedMemoryPerBlockOptin, &d.shared_per_block_optin),
        read(cudaDevAttrMaxSharedMemoryPerMultiprocessor, &d.shared_per_sm),
        read(cudaDevAttrReservedSharedMemoryPerBlock, &d.reserved_shared_per_block),
        read(cudaDevAttrMaxRegistersPerMultiprocessor, &d.registers_per_sm),
        read(cudaDevAttrMaxThreadsPerMultiProcessor, &d.threads_per_sm),
        read(cudaDevAttrMaxBlocksPerMultiprocessor, &d.ctas_per_sm)}) {
    if (status != cudaSuccess) return status;
  }
  // PAGED_ATTENTION_SHARED_LIMIT=<bytes> plans as if the GPU offered at most that much shared
  // memory per CTA: a GPU with more runs the rings of one with less (benchmarks/gpu_check.sh
  // tests the 99 KiB plan of sm_86, sm_89 and sm_120 on the GPU it has).
  if (const char* limit = std::getenv("PAGED_ATTENTION_SHARED_LIMIT")) {
    const long long bytes = std::strtoll(limit, nullptr, 10);
    if (bytes > 0 && bytes < d.shared_per_block_optin) {
      d.shared_per_block_optin = static_cast<uint32_t>(bytes);
    }
  }
  if (cacheable) {
    cached[device] = d;  // equal values if two threads race here
    known[device].store(true, std::memory_order_release);
  }
  *limits = d;
  return cudaSuccess;
}

// The plan of a launch on the current device: the variant that fits its shared memory, the
// variant's occupancy there (the CUDA occupancy API) and the splits that fill its SMs. A shape
// the device cannot hold (below every target) is returned unlaunched for the caller's error.
template <typename Scalar>
cudaError_t plan_attention_on_device(const AttentionParams& p, AttentionOp op,
                                     AttentionPlan* plan) {
  int device = 0;
  DeviceLimits limits{};
  cudaError_t status = cudaGetDevice(&device);
  if (status == cudaSuccess) status = device_limits(device, &limits);
  if (status != cudaSuccess) return status;
  const KernelShape shape = launch_shape(p, op, limits);
  int ctas_per_sm = 1;
  if (shape.shared_bytes <= limits.shared_per_block_optin) {
    status = with_variant<Scalar>(p.cache, shape, [&]<CacheDtype kCache, int kD, int kRowWarps,
                                                      int kStages>() {
      return prepare_variant<Scalar, kCache, kD, kRowWarps, kStages>(device, shape.shared_bytes,
                                                                     &ctas_per_sm);
    });
    if (status != cudaSuccess) return status;
  }
  *plan = make_attention_plan(p, op, limits, ctas_per_sm);
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
                                                         int kRowWarps, int kStages>() {
    int ctas_per_sm = 0;
    const cudaError_t prepared = prepare_variant<Scalar, kCache, kD, kRowWarps, kStages>(
        device, plan.shape.shared_bytes, &ctas_per_sm);
    if (prepared != cudaSuccess) return prepared;
    attention_kernel<Scalar, kCache, kD, kRowWarps, kStages>()<<<
        dim3(plan.grid_x, plan.grid_y, plan.grid_z), kAttentionThreads, plan.shape.shared_bytes,
        stream>>>(p, launch);
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
