// The attention kernels for bfloat16 queries under the host emulation.
#include "cuda/emulator/attention_entry.h"

namespace paged_attention::cuda {

std::string emulate_attention_bfloat16(const AttentionParams& p, const AttentionPlan& plan,
                                 void* scratch, int workers) {
  return emulate_attention<BFloat16>(p, plan, scratch, workers);
}

}  // namespace paged_attention::cuda
