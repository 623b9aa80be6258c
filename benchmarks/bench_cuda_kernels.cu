// The CUDA attention kernels timed on their own: no torch, no Python, one nvcc command instead of
// the whole extension's build (93 s on a 16-core H200 machine), so a short GPU lease can time
// several variants of the kernel headers.
//
//   nvcc -O3 -std=c++20 --expt-relaxed-constexpr -gencode=arch=compute_90,code=sm_90 -Icsrc \
//       benchmarks/bench_cuda_kernels.cu -o bench_cuda_kernels
//   ./bench_cuda_kernels [--json PATH] [--save DIR] [--compare DIR]
//
// Build it with -I pointing at a modified copy of csrc/ to time a variant. --save writes each
// case's output to DIR; --compare reports the largest difference from the outputs saved there.
// Cases: decode (v1, v2) and varlen attention (q_len new rows per sequence) over a paged cache with
// 32 query heads, 8 KV heads, head size 128, block size 16, every sequence as long as the context
// (its new rows included), block tables a random permutation of the pool; each launch plans as
// the op does (plan_attention_on_device). Each time is the best of 5 samples of 20 back-to-back
// launches (CUDA events); the limit is a plain read of the same K and V bytes by a grid-stride
// kernel; FLOP counts the attended (query row, key) pairs, 4 x head size each.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <initializer_list>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "cuda/attention_kernels.cuh"

namespace {

using paged_attention::CacheDtype;
using namespace paged_attention::cuda;

constexpr int kHeads = 32, kKvHeads = 8, kHeadSize = 128, kBlockSize = 16;

#define CHECK_CUDA(call)                                                              \
  do {                                                                                \
    const cudaError_t status_ = (call);                                               \
    if (status_ != cudaSuccess) {                                                     \
      std::fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(status_)); \
      std::exit(1);                                                                   \
    }                                                                                 \
  } while (0)

__device__ __forceinline__ void store_as(float* p, float v) { *p = v; }
__device__ __forceinline__ void store_as(__half* p, float v) { *p = __float2half_rn(v); }
__device__ __forceinline__ void store_as(__nv_bfloat16* p, float v) { *p = __float2bfloat16_rn(v); }

// Values in [-1.5, 1.5) from a hash of the index, written as T.
template <typename T>
__global__ void fill_hashed(T* data, size_t n, uint32_t seed) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n;
       i += size_t{gridDim.x} * blockDim.x) {
    uint32_t h = static_cast<uint32_t>(i) * 2654435761u ^ seed;
    h ^= h >> 13;
    h *= 0x5bd1e995u;
    h ^= h >> 15;
    store_as(data + i, ((h & 0xffff) / 65536.0f - 0.5f) * 3.0f);
  }
}

__global__ void read_once(const uint4* data, size_t n, unsigned* sink) {
  unsigned folded = 0;
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n;
       i += size_t{gridDim.x} * blockDim.x) {
    const uint4 v = __ldg(data + i);
    folded ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (folded == 0x12345678u) *sink = folded;  // keeps the loads
}

enum class Dtype { kFloat, kHalf, kBFloat16 };

struct Case {
  const char* name;
  Dtype dtype;
  AttentionOp op;
  int batch;
  int context;  // tokens of each sequence in the cache, its q_len new ones included
  int q_len;  // query rows per sequence (1 for decode)
};

size_t element_bytes(Dtype dtype) { return dtype == Dtype::kFloat ? 4 : 2; }

// Best milliseconds per call of `fn` over 5 samples of `calls` calls.
template <typename Fn>
float best_ms(Fn fn, int calls) {
  cudaEvent_t start, end;
  CHECK_CUDA(cudaEventCreate(&start));
  CHECK_CUDA(cudaEventCreate(&end));
  float best = INFINITY;
  for (int sample = 0; sample < 5; ++sample) {
    CHECK_CUDA(cudaEventRecord(start));
    for (int i = 0; i < calls; ++i) fn();
    CHECK_CUDA(cudaEventRecord(end));
    CHECK_CUDA(cudaEventSynchronize(end));
    float ms = 0;
    CHECK_CUDA(cudaEventElapsedTime(&ms, start, end));
    best = std::min(best, ms / calls);
  }
  CHECK_CUDA(cudaEventDestroy(start));
  CHECK_CUDA(cudaEventDestroy(end));
  return best;
}

template <typename Scalar>
void plan_and_launch(const AttentionParams& p, AttentionOp op, AttentionPlan* plan,
                     void** scratch, const void** kernel) {
  CHECK_CUDA(plan_attention_on_device<Scalar>(p, op, plan));
  const int64_t bytes = scratch_layout(p, *plan).bytes;
  if (bytes > 0 && *scratch == nullptr) CHECK_CUDA(cudaMalloc(scratch, bytes));
  CHECK_CUDA(launch_attention_kernels<Scalar>(p, *plan, *scratch, nullptr));
  *kernel = planned_kernel<Scalar>(p.cache, plan->shape);
}

// Largest absolute difference between `out` and the output saved as `path`; -1 if none is saved.
double largest_difference(const std::vector<float>& out, const std::string& path) {
  FILE* file = std::fopen(path.c_str(), "rb");
  if (file == nullptr) return -1;
  std::vector<float> saved(out.size());
  const size_t read = std::fread(saved.data(), sizeof(float), saved.size(), file);
  std::fclose(file);
  if (read != saved.size()) return -1;
  double largest = 0;
  for (size_t i = 0; i < out.size(); ++i) {
    const bool one_nan = std::isnan(out[i]) != std::isnan(saved[i]);
    largest = std::max(largest, one_nan ? INFINITY : std::fabs(double{out[i]} - saved[i]));
  }
  return largest;
}

template <typename T>
std::vector<float> to_floats(const void* device, size_t n) {
  std::vector<T> raw(n);
  CHECK_CUDA(cudaMemcpy(raw.data(), device, n * sizeof(T), cudaMemcpyDeviceToHost));
  std::vector<float> out(n);
  for (size_t i = 0; i < n; ++i) out[i] = static_cast<float>(raw[i]);
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  std::string json_path, save_dir, compare_dir;
  for (int i = 1; i < argc; i += 2) {
    const std::string flag = argv[i];
    std::string* value = flag == "--json"      ? &json_path
                         : flag == "--save"    ? &save_dir
                         : flag == "--compare" ? &compare_dir
                                               : nullptr;
    if (value == nullptr || i + 1 == argc) {
      std::fprintf(stderr, "usage: %s [--json PATH] [--save DIR] [--compare DIR]\n", argv[0]);
      return 2;
    }
    *value = argv[i + 1];
  }
  constexpr AttentionOp kV1 = AttentionOp::kDecodeV1, kV2 = AttentionOp::kDecodeV2,
                        kVarlen = AttentionOp::kVarlen;
  const Case cases[] = {
      {"bf16 v1 64x4096", Dtype::kBFloat16, kV1, 64, 4096, 1},
      {"bf16 v2 64x4096", Dtype::kBFloat16, kV2, 64, 4096, 1},
      {"fp16 v1 64x4096", Dtype::kHalf, kV1, 64, 4096, 1},
      {"bf16 v1 8x4096", Dtype::kBFloat16, kV1, 8, 4096, 1},
      {"bf16 v1 8x32768", Dtype::kBFloat16, kV1, 8, 32768, 1},
      {"fp32 v1 64x4096", Dtype::kFloat, kV1, 64, 4096, 1},
      {"fp32 v1 8x4096", Dtype::kFloat, kV1, 8, 4096, 1},
      // The targets of the varlen kernel: speculative decoding (bandwidth) and a prompt chunk
      // after a cached context (tensor-core rate).
      {"bf16 varlen q4 32x4096", Dtype::kBFloat16, kVarlen, 32, 4096, 4},
      {"bf16 varlen q512 4x2048", Dtype::kBFloat16, kVarlen, 4, 2048, 512},
  };
  cudaDeviceProp device{};
  CHECK_CUDA(cudaGetDeviceProperties(&device, 0));
  unsigned* sink = nullptr;
  CHECK_CUDA(cudaMalloc(&sink, sizeof(unsigned)));
  std::printf("%s\n%-24s %9s %9s %10s %8s %8s %5s %5s %6s %s\n", device.name, "case", "us",
              "GB/s", "limit GB/s", "% limit", "TFLOP/s", "regs", "CTAs", "splits",
              "difference");
  std::string json = std::string("{\"device\": \"") + device.name + "\", \"rows\": [";

  for (const Case& c : cases) {
    const size_t element = element_bytes(c.dtype);
    const int blocks_per_seq = c.context / kBlockSize;
    const int num_blocks = c.batch * blocks_per_seq;
    const int partitions = (c.context + kV2PartitionSize - 1) / kV2PartitionSize;
    const size_t cache_elements = static_cast<size_t>(num_blocks) * kKvHeads * kHeadSize * kBlockSize;
    const size_t rows = static_cast<size_t>(c.batch) * c.q_len * kHeads;
    void *key_cache, *value_cache, *query, *out, *tmp_out;
    float *exp_sums, *max_logits, *unit_scale;
    void* scratch = nullptr;
    int32_t *block_tables, *seq_lens, *query_start_loc;
    CHECK_CUDA(cudaMalloc(&key_cache, cache_elements * element));
    CHECK_CUDA(cudaMalloc(&value_cache, cache_elements * element));
    CHECK_CUDA(cudaMalloc(&query, rows * kHeadSize * element));
    CHECK_CUDA(cudaMalloc(&out, rows * kHeadSize * element));
    CHECK_CUDA(cudaMalloc(&tmp_out, rows * partitions * kHeadSize * element));
    CHECK_CUDA(cudaMalloc(&exp_sums, rows * partitions * sizeof(float)));
    CHECK_CUDA(cudaMalloc(&max_logits, rows * partitions * sizeof(float)));
    CHECK_CUDA(cudaMalloc(&unit_scale, sizeof(float)));
    CHECK_CUDA(cudaMalloc(&block_tables, num_blocks * sizeof(int32_t)));
    CHECK_CUDA(cudaMalloc(&seq_lens, c.batch * sizeof(int32_t)));
    CHECK_CUDA(cudaMalloc(&query_start_loc, (c.batch + 1) * sizeof(int32_t)));
    const float one = 1.0f;
    CHECK_CUDA(cudaMemcpy(unit_scale, &one, sizeof(float), cudaMemcpyHostToDevice));
    const auto fill = [&](auto* typed_key, auto* typed_value, auto* typed_query) {
      fill_hashed<<<1024, 256>>>(typed_key, cache_elements, 1);
      fill_hashed<<<1024, 256>>>(typed_value, cache_elements, 2);
      fill_hashed<<<64, 256>>>(typed_query, rows * kHeadSize, 3);
    };
    if (c.dtype == Dtype::kBFloat16) {
      fill(static_cast<__nv_bfloat16*>(key_cache), static_cast<__nv_bfloat16*>(value_cache),
           static_cast<__nv_bfloat16*>(query));
    } else if (c.dtype == Dtype::kHalf) {
      fill(static_cast<__half*>(key_cache), static_cast<__half*>(value_cache),
           static_cast<__half*>(query));
    } else {
      fill(static_cast<float*>(key_cache), static_cast<float*>(value_cache),
           static_cast<float*>(query));
    }
    CHECK_CUDA(cudaGetLastError());
    std::vector<int32_t> table(num_blocks);
    std::iota(table.begin(), table.end(), 0);
    std::shuffle(table.begin(), table.end(), std::mt19937(0));
    const std::vector<int32_t> lens(c.batch, c.context);
    CHECK_CUDA(cudaMemcpy(block_tables, table.data(), num_blocks * sizeof(int32_t),
                          cudaMemcpyHostToDevice));
    CHECK_CUDA(
        cudaMemcpy(seq_lens, lens.data(), c.batch * sizeof(int32_t), cudaMemcpyHostToDevice));
    std::vector<int32_t> starts(c.batch + 1);
    for (int s = 0; s <= c.batch; ++s) starts[s] = s * c.q_len;
    CHECK_CUDA(cudaMemcpy(query_start_loc, starts.data(), (c.batch + 1) * sizeof(int32_t),
                          cudaMemcpyHostToDevice));

    AttentionParams p{};
    p.out = out;
    p.exp_sums = exp_sums;
    p.max_logits = max_logits;
    p.tmp_out = tmp_out;
    p.query = query;
    p.query_seq_stride = kHeads * kHeadSize;
    p.query_head_stride = kHeadSize;
    p.key_cache = key_cache;
    p.value_cache = value_cache;
    p.key_block_stride = p.value_block_stride = int64_t{kKvHeads} * kHeadSize * kBlockSize;
    p.key_head_stride = p.value_head_stride = int64_t{kHeadSize} * kBlockSize;
    p.block_tables = block_tables;
    p.block_table_stride = blocks_per_seq;
    p.max_blocks_per_seq = blocks_per_seq;
    p.seq_lens = seq_lens;
    p.query_start_loc = c.op == kVarlen ? query_start_loc : nullptr;
    p.num_tokens = c.batch * c.q_len;
    p.max_query_len = c.q_len;
    p.num_seqs = c.batch;
    p.num_heads = kHeads;
    p.num_kv_heads = kKvHeads;
    p.head_size = kHeadSize;
    p.block_size = kBlockSize;
    p.max_seq_len = c.context;
    p.scale = 1.0f / std::sqrt(static_cast<float>(kHeadSize));
    p.k_scale = p.v_scale = unit_scale;
    p.num_partitions = partitions;
    p.scalar = c.dtype == Dtype::kFloat  ? ScalarKind::kFloat
               : c.dtype == Dtype::kHalf ? ScalarKind::kHalf
                                         : ScalarKind::kBFloat16;
    p.cache = CacheDtype::kAuto;

    AttentionPlan plan{};
    const void* kernel = nullptr;
    const auto launch = [&] {
      switch (c.dtype) {
        case Dtype::kFloat:
          return plan_and_launch<Float32>(p, c.op, &plan, &scratch, &kernel);
        case Dtype::kHalf:
          return plan_and_launch<Float16>(p, c.op, &plan, &scratch, &kernel);
        case Dtype::kBFloat16:
          return plan_and_launch<BFloat16>(p, c.op, &plan, &scratch, &kernel);
      }
    };
    launch();
    CHECK_CUDA(cudaDeviceSynchronize());
    const float kernel_ms = best_ms(launch, 20);
    const size_t vectors = cache_elements * element / sizeof(uint4);
    const float read_ms = best_ms(
        [&] {
          read_once<<<device.multiProcessorCount * 16, 512>>>(
              static_cast<const uint4*>(key_cache), vectors, sink);
          read_once<<<device.multiProcessorCount * 16, 512>>>(
              static_cast<const uint4*>(value_cache), vectors, sink);
        },
        10);
    cudaFuncAttributes attributes{};
    CHECK_CUDA(cudaFuncGetAttributes(&attributes, kernel));
    const int regs = attributes.numRegs;
    int ctas_per_sm = 0;
    CHECK_CUDA(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
        &ctas_per_sm, kernel, kAttentionThreads, plan.shape.shared_bytes));

    const std::vector<float> result =
        c.dtype == Dtype::kFloat  ? to_floats<float>(out, rows * kHeadSize)
        : c.dtype == Dtype::kHalf ? to_floats<__half>(out, rows * kHeadSize)
                                  : to_floats<__nv_bfloat16>(out, rows * kHeadSize);
    std::string file_name = c.name;
    std::replace(file_name.begin(), file_name.end(), ' ', '_');
    double difference = -1;
    if (!compare_dir.empty()) difference = largest_difference(result, compare_dir + "/" + file_name);
    if (!save_dir.empty()) {
      FILE* file = std::fopen((save_dir + "/" + file_name).c_str(), "wb");
      if (file == nullptr) {
        std::fprintf(stderr, "cannot write to %s\n", save_dir.c_str());
        return 1;
      }
      std::fwrite(result.data(), sizeof(float), result.size(), file);
      std::fclose(file);
    }

    const double bytes = 2.0 * cache_elements * element;
    const double gbps = bytes / (kernel_ms * 1e-3) / 1e9;
    const double q_len = c.q_len;
    const double pairs = static_cast<double>(c.batch) * kHeads *
                         (q_len * (c.context - q_len) + q_len * (q_len + 1) / 2);
    const double flops = 4.0 * kHeadSize * pairs;
    const double tflops = flops / (kernel_ms * 1e-3) / 1e12;
    const double limit_gbps = bytes / (read_ms * 1e-3) / 1e9;
    char difference_text[32] = "-";
    if (difference >= 0) std::snprintf(difference_text, sizeof difference_text, "%.3g", difference);
    std::printf("%-24s %9.1f %9.0f %10.0f %7.1f%% %8.1f %5d %5d %6d %s\n", c.name,
                kernel_ms * 1e3, gbps, limit_gbps, 100.0 * read_ms / kernel_ms, tflops, regs,
                ctas_per_sm, plan.split.splits, difference_text);
    char row[512];
    std::snprintf(row, sizeof row,
                  "%s{\"case\": \"%s\", \"time_s\": %.9g, \"bytes\": %.0f, \"bytes_per_s\": %.6g, "
                  "\"limit_bytes_per_s\": %.6g, \"flops\": %.6g, \"flops_per_s\": %.6g, "
                  "\"registers\": %d, \"ctas_per_sm\": %d, \"row_warps\": %d, "
                  "\"splits\": %d, \"largest_difference\": %s}",
                  &c == cases ? "" : ", ", c.name, kernel_ms * 1e-3, bytes, gbps * 1e9,
                  limit_gbps * 1e9, flops, tflops * 1e12, regs, ctas_per_sm,
                  plan.shape.row_warps, plan.split.splits,
                  difference >= 0 ? difference_text : "null");
    json += row;

    for (void* buffer : std::initializer_list<void*>{key_cache, value_cache, query, out, tmp_out,
                                                     exp_sums, max_logits, unit_scale,
                                                     block_tables, seq_lens, query_start_loc,
                                                     scratch}) {
      if (buffer != nullptr) CHECK_CUDA(cudaFree(buffer));
    }
  }
  json += "]}\n";
  if (!json_path.empty()) {
    FILE* file = std::fopen(json_path.c_str(), "w");
    if (file == nullptr) {
      std::fprintf(stderr, "cannot write %s\n", json_path.c_str());
      return 1;
    }
    std::fputs(json.c_str(), file);
    std::fclose(file);
    std::printf("wrote %s\n", json_path.c_str());
  }
  return 0;
}
