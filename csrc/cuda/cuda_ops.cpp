// Registers the CUDA kernels of every paged_attention op: argument checks (checks.h), device
// guard, current stream, then the plain launchers of launchers.h. Nothing here synchronises with
// the host unless PAGED_ATTENTION_DEBUG_CHECKS=1 (content checks) or swap_blocks has to read a
// device-side block_mapping for per-block copies (documented below).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <climits>
#include <optional>
#include <string>
#include <vector>

#include "checks.h"
#include "cuda/launchers.h"

namespace paged_attention::cuda {

namespace {

static_assert(kV2PartitionSize == paged_attention::kPartitionSize,
              "the CUDA and CPU partition sizes must agree");

// Blocks at least this large are swapped between host and device with one DMA copy each
// (cudaMemcpyAsync); smaller ones with one gather/scatter kernel over mapped pinned memory, which
// avoids the per-call overhead that makes many small copies slow (vLLM PR #11531).
constexpr int64_t kDmaMinBlockBytes = 1 << 20;

ScalarKind scalar_kind(at::ScalarType type) {
  switch (type) {
    case at::kFloat:
      return ScalarKind::kFloat;
    case at::kHalf:
      return ScalarKind::kHalf;
    case at::kBFloat16:
      return ScalarKind::kBFloat16;
    default:
      TORCH_CHECK(false, "unsupported dtype ", type);
  }
}

void check_launch(cudaError_t status, const char* op) {
  TORCH_CHECK(status == cudaSuccess, op, ": CUDA kernel launch failed: ",
              cudaGetErrorString(status));
}

cudaStream_t current_stream(const at::Tensor& t) {
  return c10::cuda::getCurrentCUDAStream(t.get_device()).stream();
}

// The attention kernel reads 16-byte vectors from every block of every head.
void check_vector_aligned(const at::Tensor& cache, const char* name) {
  const int64_t element = static_cast<int64_t>(cache.element_size());
  // A stride of a size-1 dim is never used to address anything.
  const auto aligned_stride = [&](int64_t dim) {
    return cache.size(dim) == 1 || (cache.stride(dim) * element) % 16 == 0;
  };
  TORCH_CHECK(reinterpret_cast<uintptr_t>(cache.data_ptr()) % 16 == 0 && aligned_stride(0) &&
                  aligned_stride(1),
              name, " must start on a 16-byte boundary with block and head strides that are "
                    "multiples of 16 bytes (got strides ",
              cache.strides(), ")");
}

void check_fits_int32(int64_t value, const char* name) {
  TORCH_CHECK_VALUE(value <= INT_MAX, name, " (", value, ") is too large for the CUDA kernels");
}

// The parameters every attention launch shares, from arguments the checks have accepted.
AttentionParams attention_params(const AttentionArgs& args, const AttentionDims& dims) {
  const auto& [out, query, key_cache, value_cache, num_kv_heads, scale, block_tables, seq_lens,
               max_seq_len, alibi_slopes, kv_cache_dtype, k_scale, v_scale, sliding_window,
               logits_soft_cap, attention_chunk_size] = args;
  AttentionParams p{};
  p.out = out.data_ptr();
  p.query = query.data_ptr();
  p.query_seq_stride = query.stride(0);
  p.query_head_stride = query.stride(1);
  p.key_cache = key_cache.data_ptr();
  p.value_cache = value_cache.data_ptr();
  p.key_block_stride = key_cache.stride(0);
  p.key_head_stride = key_cache.stride(1);
  p.value_block_stride = value_cache.stride(0);
  p.value_head_stride = value_cache.stride(1);
  p.block_tables = block_tables.data_ptr<int32_t>();
  p.block_table_stride = block_tables.stride(0);
  p.max_blocks_per_seq = static_cast<int32_t>(dims.max_blocks_per_seq);
  p.seq_lens = seq_lens.data_ptr<int32_t>();
  p.num_seqs = static_cast<int32_t>(dims.num_seqs);
  p.num_heads = static_cast<int32_t>(dims.num_heads);
  p.num_kv_heads = static_cast<int32_t>(dims.num_kv_heads);
  p.head_size = static_cast<int32_t>(dims.head_size);
  p.v_head_size = static_cast<int32_t>(dims.v_head_size);
  p.block_size = static_cast<int32_t>(dims.block_size);
  p.max_seq_len = static_cast<int32_t>(max_seq_len);
  p.scale = static_cast<float>(scale);
  p.logits_soft_cap = static_cast<float>(logits_soft_cap);
  p.sliding_window = static_cast<int32_t>(sliding_window);
  p.attention_chunk_size = static_cast<int32_t>(attention_chunk_size);
  p.alibi_slopes = alibi_slopes.has_value() ? alibi_slopes->data_ptr<float>() : nullptr;
  const bool fp8 = dims.cache_dtype != CacheDtype::kAuto;
  p.k_scale = fp8 ? k_scale.data_ptr<float>() : nullptr;
  p.v_scale = fp8 ? v_scale.data_ptr<float>() : nullptr;
  p.scalar = scalar_kind(query.scalar_type());
  p.cache = dims.cache_dtype;
  return p;
}

// The checks every attention launch shares: 16-byte vectors of the caches, the int32 values
// of the kernels' parameters.
void check_attention_launch(const AttentionArgs& args, const AttentionDims& dims) {
  const at::Tensor& key_cache = args.key_cache;
  const at::Tensor& value_cache = args.value_cache;
  check_vector_aligned(key_cache, "key_cache");
  check_vector_aligned(value_cache, "value_cache");
  check_fits_int32(dims.num_seqs, "num_seqs");
  check_fits_int32(dims.max_seq_len, "max_seq_len");
  check_fits_int32(args.sliding_window, "sliding_window");
  check_fits_int32(args.attention_chunk_size, "attention_chunk_size");
  check_fits_int32(dims.max_blocks_per_seq, "block_tables.size(1)");
  TORCH_CHECK_VALUE(dims.num_heads <= 65535, "num_heads (", dims.num_heads,
                    ") must be at most 65535");
}

// Plans, allocates the plan's scratch from the caching allocator (no host synchronisation;
// inside a CUDA graph the allocation is part of the capture) and launches.
void plan_and_launch(const AttentionParams& p, AttentionOp op, const at::Tensor& query,
                     const AttentionDims& dims, const char* name) {
  AttentionPlan plan{};
  check_launch(plan_attention(p, op, &plan), name);
  int device_limit = 0;
  const cudaError_t query_status = cudaDeviceGetAttribute(
      &device_limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, query.get_device());
  TORCH_CHECK(query_status == cudaSuccess, name,
              ": cannot read the device's shared memory limit: ",
              cudaGetErrorString(query_status));
  TORCH_CHECK(plan.shape.shared_bytes <= static_cast<uint32_t>(device_limit), name, " needs ",
              plan.shape.shared_bytes, " bytes of shared memory per CTA for head size ",
              plan_head_size(p.head_size, p.v_head_size), ", more than the device's ",
              device_limit);
  TORCH_CHECK_VALUE(plan.grid_z <= 65535, name, ": max_seq_len (", dims.max_seq_len,
                    ") needs more than 65535 splits");
  const int64_t scratch_bytes = scratch_layout(p, plan).bytes;
  at::Tensor scratch;
  if (scratch_bytes > 0) scratch = at::empty({scratch_bytes}, query.options().dtype(at::kByte));
  check_launch(launch_attention(p, plan, scratch_bytes > 0 ? scratch.data_ptr() : nullptr,
                                current_stream(query)),
               name);
}

// The v1 and v2 ops (v2 with its scratch exp_sums, max_logits and tmp_out): checks, plan, launch.
void check_and_launch_decode(const AttentionArgs& args, int64_t block_size,
                   const std::optional<at::Tensor>& exp_sums,
                   const std::optional<at::Tensor>& max_logits,
                   const std::optional<at::Tensor>& tmp_out) {
  const at::Tensor& query = args.query;
  const bool v2 = exp_sums.has_value();
  const char* op = v2 ? "paged_attention_v2" : "paged_attention_v1";
  const AttentionDims dims = check_attention_args(args, block_size);
  TORCH_CHECK(query.is_cuda(), op, ": query must be a CUDA tensor, got ", query.device());
  if (v2) check_v2_scratch(*exp_sums, *max_logits, *tmp_out, dims, args);
  if (debug_checks_enabled()) {
    check_attention_indices(args.block_tables, args.seq_lens, dims, args.sliding_window,
                            args.attention_chunk_size);
  }
  check_attention_launch(args, dims);
  if (v2) {
    TORCH_CHECK_VALUE(exp_sums->size(2) <= 65535, "exp_sums.size(2) (", exp_sums->size(2),
                      ") must be at most 65535 partitions");
  }

  if (dims.num_seqs == 0 || dims.num_heads == 0) return;
  const c10::cuda::CUDAGuard guard(query.device());
  AttentionParams p = attention_params(args, dims);
  p.num_tokens = p.num_seqs;
  p.max_query_len = 1;
  if (v2) {
    p.exp_sums = exp_sums->data_ptr<float>();
    p.max_logits = max_logits->data_ptr<float>();
    p.tmp_out = tmp_out->data_ptr();
    p.num_partitions = static_cast<int32_t>(exp_sums->size(2));
  }
  plan_and_launch(p, v2 ? AttentionOp::kDecodeV2 : AttentionOp::kDecodeV1, query, dims, op);
}

void paged_attention_v1(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                        const at::Tensor& value_cache, int64_t num_kv_heads, double scale,
                        const at::Tensor& block_tables, const at::Tensor& seq_lens,
                        int64_t block_size, int64_t max_seq_len,
                        const std::optional<at::Tensor>& alibi_slopes,
                        const std::string& kv_cache_dtype, const at::Tensor& k_scale,
                        const at::Tensor& v_scale, int64_t sliding_window,
                        double logits_soft_cap, int64_t attention_chunk_size) {
  const AttentionArgs args{out,          query,          key_cache,       value_cache,
                           num_kv_heads, scale,          block_tables,    seq_lens,
                           max_seq_len,  alibi_slopes,   kv_cache_dtype,  k_scale,
                           v_scale,      sliding_window, logits_soft_cap, attention_chunk_size};
  check_and_launch_decode(args, block_size, std::nullopt, std::nullopt, std::nullopt);
}

void paged_attention_v2(at::Tensor& out, at::Tensor& exp_sums, at::Tensor& max_logits,
                        at::Tensor& tmp_out, const at::Tensor& query, const at::Tensor& key_cache,
                        const at::Tensor& value_cache, int64_t num_kv_heads, double scale,
                        const at::Tensor& block_tables, const at::Tensor& seq_lens,
                        int64_t block_size, int64_t max_seq_len,
                        const std::optional<at::Tensor>& alibi_slopes,
                        const std::string& kv_cache_dtype, const at::Tensor& k_scale,
                        const at::Tensor& v_scale, int64_t sliding_window,
                        double logits_soft_cap, int64_t attention_chunk_size) {
  const AttentionArgs args{out,          query,          key_cache,       value_cache,
                           num_kv_heads, scale,          block_tables,    seq_lens,
                           max_seq_len,  alibi_slopes,   kv_cache_dtype,  k_scale,
                           v_scale,      sliding_window, logits_soft_cap, attention_chunk_size};
  check_and_launch_decode(args, block_size, exp_sums, max_logits, tmp_out);
}

// Every query length in one launch (csrc/cuda/attention/plan.h): no host synchronisation, so
// a step replays in a CUDA graph; max_query_len and max_seq_len (host ints) size the grid, and a
// launch whose queries are longer than one CTA's tokens lists its work items on the device.
void paged_attention_varlen(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                            const at::Tensor& value_cache, int64_t num_kv_heads, double scale,
                            const at::Tensor& block_tables, const at::Tensor& seq_lens,
                            const at::Tensor& query_start_loc, int64_t max_query_len,
                            int64_t max_seq_len, const std::optional<at::Tensor>& alibi_slopes,
                            const std::string& kv_cache_dtype, const at::Tensor& k_scale,
                            const at::Tensor& v_scale, int64_t sliding_window,
                            double logits_soft_cap, const std::optional<at::Tensor>& sinks,
                            int64_t attention_chunk_size) {
  const char* op = "paged_attention_varlen";
  const AttentionArgs args{out,          query,          key_cache,       value_cache,
                           num_kv_heads, scale,          block_tables,    seq_lens,
                           max_seq_len,  alibi_slopes,   kv_cache_dtype,  k_scale,
                           v_scale,      sliding_window, logits_soft_cap, attention_chunk_size};
  const VarlenDims dims = check_varlen_args(args, query_start_loc, max_query_len, sinks);
  TORCH_CHECK(query.is_cuda(), op, ": query must be a CUDA tensor, got ", query.device());
  if (debug_checks_enabled()) {
    check_varlen_indices(block_tables, seq_lens, query_start_loc, dims, sliding_window,
                         attention_chunk_size);
  }
  check_attention_launch(args, dims);
  check_fits_int32(dims.num_tokens, "num_tokens (query.size(0))");

  if (dims.num_seqs == 0 || dims.num_tokens == 0 || dims.num_heads == 0 || max_query_len == 0) {
    return;
  }
  const c10::cuda::CUDAGuard guard(query.device());
  AttentionParams p = attention_params(args, dims);
  p.query_start_loc = query_start_loc.data_ptr<int32_t>();
  p.num_tokens = static_cast<int32_t>(dims.num_tokens);
  // No sequence has more rows than the query has.
  p.max_query_len = static_cast<int32_t>(std::min(max_query_len, dims.num_tokens));
  p.sinks = sinks.has_value() ? sinks->data_ptr<float>() : nullptr;
  plan_and_launch(p, AttentionOp::kVarlen, query, dims, op);
}

void reshape_and_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
                       at::Tensor& value_cache, const at::Tensor& slot_mapping,
                       const std::string& kv_cache_dtype, const at::Tensor& k_scale,
                       const at::Tensor& v_scale) {
  const CacheDims dims = check_reshape_and_cache_args(key, value, key_cache, value_cache,
                                                      slot_mapping, kv_cache_dtype, k_scale,
                                                      v_scale);
  TORCH_CHECK(key.is_cuda(), "reshape_and_cache: key must be a CUDA tensor, got ", key.device());
  if (debug_checks_enabled()) check_slot_mapping(slot_mapping, dims);
  check_fits_int32(dims.num_tokens, "num_tokens");
  const c10::cuda::CUDAGuard guard(key.device());
  ReshapeAndCacheParams p{};
  p.key = key.data_ptr();
  p.value = value.data_ptr();
  for (int d = 0; d < 3; ++d) {
    p.key_strides[d] = key.stride(d);
    p.value_strides[d] = value.stride(d);
  }
  p.key_cache = key_cache.data_ptr();
  p.value_cache = value_cache.data_ptr();
  p.key_cache_block_stride = key_cache.stride(0);
  p.key_cache_head_stride = key_cache.stride(1);
  p.value_cache_block_stride = value_cache.stride(0);
  p.value_cache_head_stride = value_cache.stride(1);
  p.slot_mapping = slot_mapping.data_ptr<int64_t>();
  p.num_tokens = dims.num_tokens;
  p.num_slots = dims.num_blocks * dims.block_size;
  p.num_kv_heads = static_cast<int32_t>(dims.num_kv_heads);
  p.head_size = static_cast<int32_t>(dims.head_size);
  p.v_head_size = static_cast<int32_t>(dims.v_head_size);
  p.block_size = static_cast<int32_t>(dims.block_size);
  p.x = static_cast<int32_t>(dims.x);
  const bool fp8 = dims.cache_dtype != CacheDtype::kAuto;
  p.k_scale = fp8 ? k_scale.data_ptr<float>() : nullptr;
  p.v_scale = fp8 ? v_scale.data_ptr<float>() : nullptr;
  p.scalar = scalar_kind(key.scalar_type());
  p.cache = dims.cache_dtype;
  check_launch(launch_reshape_and_cache(p, current_stream(key)),
               "reshape_and_cache");
}

// block_mapping as a contiguous int64 tensor on `device`. A CPU mapping is staged through pinned
// memory and copied without blocking the host (the pinned buffer stays reserved until the copy
// has run). Inside a CUDA graph pass the mapping on the device: a staged copy would be replayed
// from a buffer that has since been reused.
at::Tensor mapping_on(const at::Tensor& block_mapping, const c10::Device& device) {
  if (block_mapping.device() == device) return block_mapping.contiguous();
  TORCH_CHECK(block_mapping.is_cpu(), "block_mapping must be on the CPU or on ", device, ", got ",
              block_mapping.device());
  at::Tensor host = block_mapping.contiguous();
  if (!host.is_pinned()) host = host.pin_memory();
  return host.to(device, /*non_blocking=*/true);
}

CopyTensor copy_tensor(const at::Tensor& src, const char* src_ptr, char* dst_ptr,
                       const at::Tensor& dst) {
  return {src_ptr, dst_ptr, block_stride_bytes(src), block_stride_bytes(dst), block_bytes(src)};
}

void copy_blocks(const std::vector<at::Tensor>& key_caches,
                 const std::vector<at::Tensor>& value_caches, const at::Tensor& block_mapping) {
  check_copy_blocks_args(key_caches, value_caches, block_mapping);
  if (key_caches.empty() || block_mapping.size(0) == 0) return;
  const at::Tensor& first = key_caches[0];
  TORCH_CHECK(first.is_cuda(), "copy_blocks: the caches must be CUDA tensors, got ",
              first.device());
  const c10::cuda::CUDAGuard guard(first.device());
  const at::Tensor mapping = mapping_on(block_mapping, first.device());
  std::vector<CopyTensor> tensors;
  tensors.reserve(2 * key_caches.size());
  for (const auto* caches : {&key_caches, &value_caches}) {
    for (const at::Tensor& cache : *caches) {
      char* base = static_cast<char*>(cache.data_ptr());
      tensors.push_back(copy_tensor(cache, base, base, cache));
    }
  }
  check_launch(copy_blocks_batched(tensors.data(), static_cast<int>(tensors.size()),
                                   mapping.data_ptr<int64_t>(), mapping.size(0),
                                   current_stream(first)),
               "copy_blocks");
}

// The address a kernel on the current device can use for `t`'s data: the data pointer of a CUDA
// tensor, the mapped address of pinned host memory, or nullptr for pageable host memory.
const char* device_address(const at::Tensor& t) {
  if (t.is_cuda()) return static_cast<const char*>(t.data_ptr());
  cudaPointerAttributes attributes{};
  if (cudaPointerGetAttributes(&attributes, t.data_ptr()) != cudaSuccess) {
    (void)cudaGetLastError();  // pageable memory on old drivers reports an error: clear it
    return nullptr;
  }
  if (attributes.type != cudaMemoryTypeHost || attributes.devicePointer == nullptr) {
    return nullptr;
  }
  return static_cast<const char*>(attributes.devicePointer);
}

// swap_blocks moves whole blocks between two tensors that may live on different devices:
//   * device <-> device on one GPU, and small blocks between a GPU and pinned host memory: one
//     batched copy kernel (host memory is read or written through its mapped address); the
//     mapping may be on the CPU (staged without a host sync) or on the GPU;
//   * large blocks (>= 1 MiB) between a GPU and pinned host memory, any block to or from pageable
//     host memory, and copies between two GPUs: one cudaMemcpyAsync per block, which needs the
//     mapping on the host (a GPU-side mapping is copied back, which synchronises).
// Like torch's non_blocking copies, a device -> pinned host swap is ordered on the current stream:
// synchronise it before reading the host tensor.
void swap_blocks(const at::Tensor& src, at::Tensor& dst, const at::Tensor& block_mapping) {
  check_swap_blocks_args(src, dst, block_mapping);
  TORCH_CHECK(src.is_cuda() || dst.is_cuda(),
              "swap_blocks: src and dst are both on the CPU; pass block_mapping on the CPU too");
  TORCH_CHECK((src.is_cuda() || src.is_cpu()) && (dst.is_cuda() || dst.is_cpu()),
              "swap_blocks: src and dst must be CUDA or CPU tensors, got ", src.device(), " and ",
              dst.device());
  if (block_mapping.size(0) == 0) return;
  const at::Tensor& gpu_side = src.is_cuda() ? src : dst;
  const c10::cuda::CUDAGuard guard(gpu_side.device());
  const cudaStream_t stream = current_stream(gpu_side);
  const int64_t bytes = block_bytes(src);
  if (bytes == 0) return;

  const char* src_address = device_address(src);
  char* dst_address = const_cast<char*>(device_address(dst));
  const bool same_gpu = !(src.is_cuda() && dst.is_cuda()) || src.device() == dst.device();
  const bool host_side = !(src.is_cuda() && dst.is_cuda());
  const bool use_kernel = same_gpu && src_address != nullptr && dst_address != nullptr &&
                          !(host_side && bytes >= kDmaMinBlockBytes);
  if (use_kernel) {
    const at::Tensor mapping = mapping_on(block_mapping, gpu_side.device());
    const CopyTensor tensor = copy_tensor(src, src_address, dst_address, dst);
    check_launch(copy_blocks_batched(&tensor, 1, mapping.data_ptr<int64_t>(), mapping.size(0),
                                     stream),
                 "swap_blocks");
    return;
  }
  const at::Tensor mapping = block_mapping.to(at::kCPU).contiguous();
  check_block_mapping(mapping, src.size(0), dst.size(0));  // on the host now, so check it
  const int64_t* pairs = mapping.data_ptr<int64_t>();
  const char* src_base = static_cast<const char*>(src.data_ptr());
  char* dst_base = static_cast<char*>(dst.data_ptr());
  const int64_t src_stride = block_stride_bytes(src);
  const int64_t dst_stride = block_stride_bytes(dst);
  for (int64_t i = 0; i < mapping.size(0); ++i) {
    check_launch(cudaMemcpyAsync(dst_base + pairs[2 * i + 1] * dst_stride,
                                 src_base + pairs[2 * i] * src_stride, bytes, cudaMemcpyDefault,
                                 stream),
                 "swap_blocks");
  }
}

}  // namespace

}  // namespace paged_attention::cuda

TORCH_LIBRARY_IMPL(paged_attention, CUDA, m) {
  m.impl("paged_attention_v1", &paged_attention::cuda::paged_attention_v1);
  m.impl("paged_attention_v2", &paged_attention::cuda::paged_attention_v2);
  m.impl("paged_attention_varlen", &paged_attention::cuda::paged_attention_varlen);
  m.impl("reshape_and_cache", &paged_attention::cuda::reshape_and_cache);
  m.impl("copy_blocks", &paged_attention::cuda::copy_blocks);
  m.impl("swap_blocks", &paged_attention::cuda::swap_blocks);
}
