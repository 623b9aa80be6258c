// Attention kernels for float queries (one file per query dtype, so they compile in parallel).
#include "cuda/attention_kernels.cuh"

namespace paged_attention::cuda {

cudaError_t plan_attention_float(const AttentionParams& p, AttentionOp op, AttentionPlan* plan) {
  return plan_attention_on_device<Float32>(p, op, plan);
}

cudaError_t launch_attention_float(const AttentionParams& p, const AttentionPlan& plan,
                                   void* scratch, cudaStream_t stream) {
  return launch_attention_kernels<Float32>(p, plan, scratch, stream);
}

}  // namespace paged_attention::cuda
