// The attention kernels for float queries under the host emulation.
#include "cuda/emulator/attention_entry.h"

namespace paged_attention::cuda {

std::string emulate_attention_float(const AttentionParams& p, const AttentionPlan& plan,
                                 void* scratch, int workers) {
  return emulate_attention<Float32>(p, plan, scratch, workers);
}

}  // namespace paged_attention::cuda
