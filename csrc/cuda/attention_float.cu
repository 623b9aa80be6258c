// Attention kernels for float queries (one file per query dtype, so they compile in parallel).
#include "cuda/attention_kernels.cuh"

namespace paged_attention::cuda {

cudaError_t paged_attention_float(const AttentionParams& params, bool v2, cudaStream_t stream) {
  return launch_paged_attention<float>(params, v2, stream);
}

}  // namespace paged_attention::cuda
