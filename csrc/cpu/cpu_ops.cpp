// Registers the CPU kernels of every paged_attention op.
#include <torch/library.h>

#include "cpu/cpu_ops.h"

TORCH_LIBRARY_IMPL(paged_attention, CPU, m) {
  m.impl("paged_attention_v1", &paged_attention::cpu::paged_attention_v1);
  m.impl("paged_attention_v2", &paged_attention::cpu::paged_attention_v2);
  m.impl("paged_attention_varlen", &paged_attention::cpu::paged_attention_varlen);
  m.impl("reshape_and_cache", &paged_attention::cpu::reshape_and_cache);
  m.impl("copy_blocks", &paged_attention::cpu::copy_blocks);
  m.impl("swap_blocks", &paged_attention::cpu::swap_blocks);
}
