// The decode kernels for half queries under the host emulation.
#include "cuda/emulator/decode_entry.h"

namespace paged_attention::cuda {

std::string emulate_decode_half(const AttentionParams& p, const DecodePlan& plan,
                              const DecodeLaunch& launch, int workers) {
  return emulate_decode<Float16>(p, plan, launch, workers);
}

}  // namespace paged_attention::cuda
