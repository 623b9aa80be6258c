// The attention kernels under the host emulation: the same variant, plan and grids as the CUDA
// launcher (attention_kernels.cuh), run by emulator::launch. One translation unit per query
// dtype (emulated_<dtype>.cpp), so they compile in parallel.
#pragma once

#include <string>
#include <type_traits>

#include "cuda/attention/cuda_core_attention.h"
#include "cuda/attention/dispatch.h"
#include "cuda/attention/mma_attention.h"
#include "cuda/attention/reduce.h"
#include "cuda/attention/schedule.h"

namespace paged_attention::cuda {

template <typename Scalar>
std::string emulate_attention(const AttentionParams& p, const AttentionPlan& plan, void* scratch,
                              int workers) {
  const AttentionLaunch launch = attention_launch(p, plan, scratch);
  if (plan.scheduled) {
    const std::string error = emulator::launch(
        {{1, 1, 1}, kScheduleThreads, kScheduleSharedBytes},
        [&] {
          schedule_varlen_work(p, plan.shape.tokens_per_cta, static_cast<int32_t*>(scratch),
                               plan.grid_x);
        },
        workers);
    if (!error.empty()) return error;
  }
  const emulator::LaunchConfig config{
      {plan.grid_x, plan.grid_y, plan.grid_z}, kAttentionThreads, plan.shape.shared_bytes};
  const std::string error = with_attention_variant<Scalar::kKind>(
      p.cache, plan.shape, [&]<CacheDtype kCache, int kD, int kRowWarps, int kStages>() {
        return emulator::launch(
            config,
            [&] {
              if constexpr (std::is_same_v<Scalar, Float32>) {
                cuda_core_attention<kCache, kD, kStages>(p, launch);
              } else {
                mma_attention<Scalar, kCache, kD, kRowWarps, kStages>(p, launch);
              }
            },
            workers);
      });
  if (!error.empty() || !plan.partial) return error;
  const emulator::LaunchConfig reduce{
      {plan.grid_x, plan.grid_y, plan.reduce_rows}, kReduceThreads, kReduceSharedBytes};
  return emulator::launch(
      reduce,
      [&] {
        if (launch.partial_fp32) {
          reduce_partials<Scalar, true>(p, launch);
        } else {
          reduce_partials<Scalar, false>(p, launch);
        }
      },
      workers);
}

std::string emulate_attention_float(const AttentionParams& p, const AttentionPlan& plan,
                                    void* scratch, int workers);
std::string emulate_attention_half(const AttentionParams& p, const AttentionPlan& plan,
                                   void* scratch, int workers);
std::string emulate_attention_bfloat16(const AttentionParams& p, const AttentionPlan& plan,
                                       void* scratch, int workers);

}  // namespace paged_attention::cuda
