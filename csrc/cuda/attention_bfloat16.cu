// Decode attention kernels for bfloat16 queries (one file per query dtype, so they compile in
// parallel).
#include "cuda/attention_kernels.cuh"

namespace paged_attention::cuda {

cudaError_t plan_paged_attention_bfloat16(const AttentionParams& p, bool v2, DecodePlan* plan) {
  return plan_decode_on_device<BFloat16>(p, v2, plan);
}

cudaError_t launch_paged_attention_bfloat16(const AttentionParams& p, const DecodePlan& plan,
                                            float* scratch, cudaStream_t stream) {
  return launch_decode<BFloat16>(p, plan, scratch, stream);
}

}  // namespace paged_attention::cuda
