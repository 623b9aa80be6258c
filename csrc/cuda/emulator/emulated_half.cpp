// The attention kernels for half queries under the host emulation.
#include "cuda/emulator/attention_entry.h"

namespace paged_attention::cuda {

std::string emulate_attention_half(const AttentionParams& p, const AttentionPlan& plan,
                                 void* scratch, int workers) {
  return emulate_attention<Float16>(p, plan, scratch, workers);
}

}  // namespace paged_attention::cuda
