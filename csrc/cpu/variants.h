// Which compiled variant of the CPU kernels runs: chosen at run time from the CPU's features,
// never from its vendor, and each one forceable so that every variant is tested on any machine
// that has its instructions.
//
// Vector instruction set (decode_attention.h, prefill_attention.h): AVX-512, AVX2+FMA or baseline,
// following torch's CPU capability, so ATEN_CPU_CAPABILITY=avx2|default forces a narrower one.
//
// bf16 matrix products (prefill_attention.h's score and value products for bf16 queries and
// caches): PAGED_ATTENTION_CPU_BF16_MATMUL, read at every call:
//   auto (or unset)  AMX where the CPU has it and the OS grants its tile state, else AVX512-BF16
//                    (vdpbf16ps) where the CPU has it, else none; only with the AVX-512 variant
//   amx, avx512bf16  that one; raises if this CPU or OS cannot run it
//   reference        the portable scalar product (slow: for tests on CPUs without either)
//   none             no bf16 products: tiles converted to float32 and torch's float32 product
#pragma once

#include <string>
#include <vector>

#include "cpu/bf16_dot.h"

namespace paged_attention::cpu {

enum class Isa { kBaseline, kAvx2, kAvx512 };

enum class Bf16Matmul { kNone, kReference, kAvx512Bf16, kAmx };

// torch's choice (which honours ATEN_CPU_CAPABILITY) checked against the CPU's features; once.
Isa selected_isa();

// PAGED_ATTENTION_CPU_BF16_MATMUL's choice for this call (see the top of the file).
Bf16Matmul selected_bf16_matmul(Isa isa);

// The product of a variant other than kNone, and what ends a thread's run of them (AMX: releases
// the tile state; null where there is nothing to release).
struct Bf16MatmulKernels {
  Bf16MatmulFn matmul;
  void (*release)();
};
Bf16MatmulKernels bf16_matmul_kernels(Bf16Matmul variant);

const char* isa_name(Isa isa);
const char* bf16_matmul_name(Bf16Matmul variant);

// The bf16 product variants this CPU and OS run, best first ("reference" always last).
std::vector<std::string> usable_bf16_matmuls();

}  // namespace paged_attention::cpu
