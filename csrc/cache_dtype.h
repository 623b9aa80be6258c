// How the KV cache stores its values; shared by the checks and both backends' kernels (no torch
// headers, so CUDA kernel files can include it).
#pragma once

namespace paged_attention {

// kv_cache_dtype "auto" (the query's dtype), "fp8"/"fp8_e4m3", "fp8_e5m2" (uint8 tensors).
enum class CacheDtype { kAuto, kFp8E4M3, kFp8E5M2 };

}  // namespace paged_attention
