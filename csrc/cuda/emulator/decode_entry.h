// The decode kernels under the host emulation: the same variant, plan and grids as the CUDA
// launcher (attention_kernels.cuh), run by emulator::launch. One translation unit per query
// dtype (emulated_<dtype>.cpp), so they compile in parallel.
#pragma once

#include <string>
#include <type_traits>

#include "cuda/attention/cuda_core_decode.h"
#include "cuda/attention/dispatch.h"
#include "cuda/attention/mma_decode.h"
#include "cuda/attention/reduce.h"

namespace paged_attention::cuda {

template <typename Scalar>
std::string emulate_decode(const AttentionParams& p, const DecodePlan& plan,
                           const DecodeLaunch& launch, int workers) {
  const emulator::LaunchConfig config{
      {plan.grid_x, plan.grid_y, plan.grid_z}, kAttentionThreads, plan.shape.shared_bytes};
  const std::string error =
      with_decode_variant(p.cache, p.head_size, [&]<CacheDtype kCache, int kD>() {
        return emulator::launch(
            config,
            [&] {
              if constexpr (std::is_same_v<Scalar, Float32>) {
                cuda_core_decode<kCache, kD>(p, launch);
              } else {
                mma_decode<Scalar, kCache, kD>(p, launch);
              }
            },
            workers);
      });
  if (!error.empty() || !plan.partial) return error;
  const emulator::LaunchConfig reduce{{p.num_seqs, p.num_heads, 1}, kReduceThreads,
                                      kReduceSharedBytes};
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

std::string emulate_decode_float(const AttentionParams& p, const DecodePlan& plan,
                                 const DecodeLaunch& launch, int workers);
std::string emulate_decode_half(const AttentionParams& p, const DecodePlan& plan,
                                const DecodeLaunch& launch, int workers);
std::string emulate_decode_bfloat16(const AttentionParams& p, const DecodePlan& plan,
                                    const DecodeLaunch& launch, int workers);

}  // namespace paged_attention::cuda
