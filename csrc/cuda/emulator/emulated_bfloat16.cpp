// The decode kernels for bfloat16 queries under the host emulation.
#include "cuda/emulator/decode_entry.h"

namespace paged_attention::cuda {

std::string emulate_decode_bfloat16(const AttentionParams& p, const DecodePlan& plan,
                              const DecodeLaunch& launch, int workers) {
  return emulate_decode<BFloat16>(p, plan, launch, workers);
}

}  // namespace paged_attention::cuda
