// The decode kernels for float queries under the host emulation.
#include "cuda/emulator/decode_entry.h"

namespace paged_attention::cuda {

std::string emulate_decode_float(const AttentionParams& p, const DecodePlan& plan,
                              const DecodeLaunch& launch, int workers) {
  return emulate_decode<Float32>(p, plan, launch, workers);
}

}  // namespace paged_attention::cuda
