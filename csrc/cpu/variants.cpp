// The run-time choice of CPU kernel variants (variants.h), and private ops that report it and run
// the bf16 products alone (tests and benchmarks use them; they are not part of the public API).
#include "cpu/variants.h"

#include <ATen/ATen.h>
#include <ATen/Version.h>
#include <torch/library.h>

#include <cstdlib>
#include <string>
#include <vector>

#include "cpu/amx.h"
#include "cpu/bf16_dot.h"

namespace paged_attention::cpu {

Isa selected_isa() {
  static const Isa isa = [] {
#ifdef PA_HAVE_BF16_DOT  // x86-64 with GCC or Clang: the AVX-512 and AVX2 variants exist
    const std::string capability = at::get_cpu_capability();
    if (capability.find("AVX512") != std::string::npos && __builtin_cpu_supports("avx512f") &&
        __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
        __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("fma")) {
      return Isa::kAvx512;
    }
    if (capability.find("AVX2") != std::string::npos && __builtin_cpu_supports("avx2") &&
        __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c")) {
      return Isa::kAvx2;
    }
#endif
    return Isa::kBaseline;
  }();
  return isa;
}

namespace {

constexpr const char* kBf16MatmulVariable = "PAGED_ATTENTION_CPU_BF16_MATMUL";

bool usable(Bf16Matmul variant) {
  switch (variant) {
    case Bf16Matmul::kNone:
    case Bf16Matmul::kReference:
      return true;
    case Bf16Matmul::kAvx512Bf16:
#ifdef PA_HAVE_BF16_DOT
      return cpu_has_avx512_bf16();
#else
      return false;
#endif
    case Bf16Matmul::kAmx:
      return amx_usable();
  }
  return false;
}

Bf16Matmul parse_bf16_matmul(const std::string& name) {
  for (const Bf16Matmul variant : {Bf16Matmul::kNone, Bf16Matmul::kReference,
                                   Bf16Matmul::kAvx512Bf16, Bf16Matmul::kAmx}) {
    if (name == bf16_matmul_name(variant)) return variant;
  }
  TORCH_CHECK(false, kBf16MatmulVariable, "=", name,
              " is not a bf16 product variant (expected auto, amx, avx512bf16, reference or none)");
}

const char* missing_feature(Bf16Matmul variant) {
  return variant == Bf16Matmul::kAmx
             ? "AMX (amx_tile, amx_bf16), or the OS did not grant its tile state"
             : "AVX512-BF16 (avx512_bf16)";
}

}  // namespace

Bf16Matmul selected_bf16_matmul(Isa isa) {
  const char* value = std::getenv(kBf16MatmulVariable);
  const std::string name = value == nullptr ? "auto" : value;
  if (name.empty() || name == "auto") {
    if (isa != Isa::kAvx512) return Bf16Matmul::kNone;
    if (usable(Bf16Matmul::kAmx)) return Bf16Matmul::kAmx;
    if (usable(Bf16Matmul::kAvx512Bf16)) return Bf16Matmul::kAvx512Bf16;
    return Bf16Matmul::kNone;
  }
  const Bf16Matmul variant = parse_bf16_matmul(name);
  TORCH_CHECK(usable(variant), kBf16MatmulVariable, "=", name, ": this CPU does not run ",
              missing_feature(variant));
  return variant;
}

Bf16MatmulKernels bf16_matmul_kernels(Bf16Matmul variant) {
  switch (variant) {
#ifdef PA_HAVE_AMX
    case Bf16Matmul::kAmx:
      return {&matmul_bf16_amx, &amx_release};
#endif
#ifdef PA_HAVE_BF16_DOT
    case Bf16Matmul::kAvx512Bf16:
      return {&matmul_bf16_avx512bf16, nullptr};
#endif
    default:
      return {&matmul_bf16_reference, nullptr};
  }
}

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::kAvx512:
      return "avx512";
    case Isa::kAvx2:
      return "avx2";
    default:
      return "baseline";
  }
}

const char* bf16_matmul_name(Bf16Matmul variant) {
  switch (variant) {
    case Bf16Matmul::kAmx:
      return "amx";
    case Bf16Matmul::kAvx512Bf16:
      return "avx512bf16";
    case Bf16Matmul::kReference:
      return "reference";
    default:
      return "none";
  }
}

std::vector<std::string> usable_bf16_matmuls() {
  std::vector<std::string> names;
  for (const Bf16Matmul variant :
       {Bf16Matmul::kAmx, Bf16Matmul::kAvx512Bf16, Bf16Matmul::kReference}) {
    if (usable(variant)) names.emplace_back(bf16_matmul_name(variant));
  }
  return names;
}

namespace {

// The variants the attention kernels run for a call made now: [vector ISA, bf16 product].
std::vector<std::string> kernel_variants() {
  const Isa isa = selected_isa();
  return {isa_name(isa), bf16_matmul_name(selected_bf16_matmul(isa))};
}

// a [M, K] (bf16) x b [K, N] (bf16, or float32 rounded to bf16 as it is packed; any strides)
// -> float32 [M, N] through one bf16 product variant, with the operands padded and b packed into
// pairs as the attention kernels do.
at::Tensor bf16_matmul(const at::Tensor& a, const at::Tensor& b, const std::string& variant) {
  TORCH_CHECK(a.dim() == 2 && b.dim() == 2 && a.size(1) == b.size(0),
              "_cpu_bf16_matmul: a must be [M, K] and b [K, N], got ", a.sizes(), " and ",
              b.sizes());
  TORCH_CHECK(a.scalar_type() == at::kBFloat16 &&
                  (b.scalar_type() == at::kBFloat16 || b.scalar_type() == at::kFloat),
              "_cpu_bf16_matmul: a must be bfloat16 and b bfloat16 or float32 (rounded to bf16)");
  TORCH_CHECK(a.device().is_cpu() && b.device().is_cpu(), "_cpu_bf16_matmul: CPU tensors only");
  const Bf16Matmul chosen = parse_bf16_matmul(variant);
  TORCH_CHECK(chosen != Bf16Matmul::kNone, "_cpu_bf16_matmul: variant 'none' has no bf16 product");
  TORCH_CHECK(usable(chosen), "_cpu_bf16_matmul: this CPU does not run ", missing_feature(chosen));
  const int64_t m = a.size(0), k = a.size(1), n = b.size(1);
  const int64_t m_pad = round_up(std::max<int64_t>(m, 1), kBf16MatmulRows);
  const int64_t n_pad = round_up(std::max<int64_t>(n, 1), kBf16MatmulRows);
  const int64_t k_pad = round_up(std::max<int64_t>(k, 1), kBf16MatmulDepth);
  const auto options = a.options().dtype(at::kFloat);
  at::Tensor a_pad = at::zeros({m_pad, k_pad}, a.options());
  a_pad.slice(0, 0, m).slice(1, 0, k).copy_(a);
  // b rows as float32, then packed two rows at a time: [k_pad / 2][n_pad][2].
  at::Tensor b_rows = at::zeros({k_pad, n_pad}, options);
  b_rows.slice(0, 0, k).slice(1, 0, n).copy_(b);
  at::Tensor b_pairs = at::empty({k_pad / 2, 2 * n_pad}, a.options());
  auto* pairs = reinterpret_cast<uint16_t*>(b_pairs.data_ptr<at::BFloat16>());
  const float* rows = b_rows.data_ptr<float>();
  for (int64_t p = 0; p < k_pad / 2; ++p) {
    pack_pair_row(rows + 2 * p * n_pad, rows + (2 * p + 1) * n_pad, n_pad, pairs + p * 2 * n_pad);
  }
  at::Tensor c = at::empty({m_pad, n_pad}, options);
  const Bf16MatmulKernels kernels = bf16_matmul_kernels(chosen);
  kernels.matmul(m_pad, n_pad, k_pad,
                 reinterpret_cast<const uint16_t*>(a_pad.data_ptr<at::BFloat16>()), k_pad, pairs,
                 2 * n_pad, c.data_ptr<float>(), n_pad, false);
  if (kernels.release != nullptr) kernels.release();
  return c.slice(0, 0, m).slice(1, 0, n).contiguous();
}

}  // namespace

}  // namespace paged_attention::cpu

TORCH_LIBRARY_FRAGMENT(paged_attention, m) {
  m.def("_cpu_kernel_variants() -> str[]", &paged_attention::cpu::kernel_variants);
  m.def("_cpu_bf16_matmuls() -> str[]", &paged_attention::cpu::usable_bf16_matmuls);
  m.def("_cpu_bf16_matmul(Tensor a, Tensor b, str variant) -> Tensor",
        &paged_attention::cpu::bf16_matmul);
}
