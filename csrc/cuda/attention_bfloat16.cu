// Attention kernels for bfloat16 queries (one file per query dtype, so they compile in parallel).
#include "cuda/attention_kernels.cuh"

namespace paged_attention::cuda {

cudaError_t paged_attention_bfloat16(const AttentionParams& params, bool v2, cudaStream_t stream) {
  return launch_paged_attention<__nv_bfloat16>(params, v2, stream);
}

}  // namespace paged_attention::cuda
