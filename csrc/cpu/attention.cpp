// The torch side of the CPU attention ops: argument checks, kernel parameters, the choice of
// instruction-set variant, threads, and the v2 reduction. The kernels are in decode_attention.h
// (v1, v2, and varlen sequences of few query rows) and prefill_attention.h (longer ones).
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "checks.h"
#include "cpu/cpu_ops.h"
#include "cpu/decode_attention.h"
#include "cpu/prefill_attention.h"
#include "cpu/variants.h"

namespace paged_attention::cpu {

namespace {

template <typename scalar_t, typename cache_t>
void run_all_units(const AttentionParams& p) {
  const int64_t units = unit_count(p);
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), units);
  const Isa isa = selected_isa();
  std::atomic<int64_t> next_unit{0};
  at::parallel_for(0, workers, 1, [&](int64_t begin, int64_t end) {
    for (int64_t worker = begin; worker < end; ++worker) {
#ifdef PA_HAVE_X86_VARIANTS
      if (isa == Isa::kAvx512) {
        run_units_avx512<scalar_t, cache_t>(p, next_unit);
        continue;
      }
      if (isa == Isa::kAvx2) {
        run_units_avx2<scalar_t, cache_t>(p, next_unit);
        continue;
      }
#endif
      run_units_baseline<scalar_t, cache_t>(p, next_unit);
    }
  });
}

// The float32 product of the prefill kernel: torch's batch-reduce GEMM (oneDNN's JIT kernel
// where available, else its BLAS), one thread's worth, inside our parallel region.
void gemm_f32(int64_t m, int64_t n, int64_t k, int64_t lda, int64_t ldb, int64_t ldc,
              bool accumulate, const float* a, const float* b, float* c) {
  at::native::cpublas::brgemm(m, n, k, lda, ldb, ldc, accumulate, a, b, c, /*is_vnni=*/false);
}

// The products of the prefill kernel: bf16 ones where the query and cache are bf16 and a bf16
// variant is chosen (variants.h), float32 ones otherwise.
template <typename scalar_t, typename cache_t>
PrefillProducts prefill_products(Bf16Matmul variant) {
  PrefillProducts products{&gemm_f32, nullptr, nullptr};
  if constexpr (kBf16Operands<scalar_t, cache_t>) {
    if (variant != Bf16Matmul::kNone) {
      const Bf16MatmulKernels kernels = bf16_matmul_kernels(variant);
      products.bf16 = kernels.matmul;
      products.release_bf16 = kernels.release;
    }
  }
  return products;
}

template <typename scalar_t, typename cache_t>
void run_prefill(const AttentionParams& p, const PrefillProducts& products) {
  const std::vector<PrefillUnit> units = plan_prefill_units(p);
  if (units.empty()) return;
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), units.size());
  const Isa isa = selected_isa();
  std::atomic<int64_t> next_unit{0};
  at::parallel_for(0, workers, 1, [&](int64_t begin, int64_t end) {
    for (int64_t worker = begin; worker < end; ++worker) {
#ifdef PA_HAVE_X86_VARIANTS
      if (isa == Isa::kAvx512) {
        run_prefill_units_avx512<scalar_t, cache_t>(p, products, units, next_unit);
        continue;
      }
      if (isa == Isa::kAvx2) {
        run_prefill_units_avx2<scalar_t, cache_t>(p, products, units, next_unit);
        continue;
      }
#endif
      run_prefill_units_baseline<scalar_t, cache_t>(p, products, units, next_unit);
    }
  });
}

// Sequences with at most p.max_query_len query rows go to the decode kernel, the others (varlen
// only) to the prefill kernel.
template <typename scalar_t, typename cache_t>
void run_kernels(const AttentionParams& p, Bf16Matmul bf16_matmul) {
  run_all_units<scalar_t, cache_t>(p);
  if (p.query_start_loc != nullptr) {
    run_prefill<scalar_t, cache_t>(p, prefill_products<scalar_t, cache_t>(bf16_matmul));
  }
}

// The query dtypes the kernels support (the checks reject others first).
#define PA_DISPATCH_QUERY_TYPES(TYPE, NAME, ...)             \
  AT_DISPATCH_SWITCH(TYPE, NAME,                            \
                     AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__) \
                     AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__)  \
                     AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__))

// Fills the parameters shared by v1, v2 and varlen from checked arguments and runs the kernels
// for the given output target; p.max_query_len is the caller's (1 for v1/v2), and so is the bf16
// product variant of the prefill kernel (varlen only).
void fill_params_and_run(AttentionParams& p, const AttentionDims& dims, const AttentionArgs& args,
                         Bf16Matmul bf16_matmul = Bf16Matmul::kNone) {
  const auto& [out, query, key_cache, value_cache, num_kv_heads, scale, block_tables, seq_lens,
               max_seq_len, alibi_slopes, kv_cache_dtype, k_scale, v_scale, sliding_window,
               logits_soft_cap, attention_chunk_size] = args;
  p.query = query.data_ptr();
  p.query_row_stride = query.stride(0);
  p.query_head_stride = query.stride(1);
  p.key_cache = key_cache.data_ptr();
  p.value_cache = value_cache.data_ptr();
  p.key_block_stride = key_cache.stride(0);
  p.key_head_stride = key_cache.stride(1);
  p.value_block_stride = value_cache.stride(0);
  p.value_head_stride = value_cache.stride(1);
  p.block_tables = block_tables.data_ptr<int32_t>();
  p.block_table_stride = block_tables.stride(0);
  p.seq_lens = seq_lens.data_ptr<int32_t>();
  p.alibi_slopes = alibi_slopes.has_value() ? alibi_slopes->data_ptr<float>() : nullptr;
  p.scale = static_cast<float>(scale);
  p.logits_soft_cap = static_cast<float>(logits_soft_cap);
  p.sliding_window = sliding_window;
  p.attention_chunk_size = attention_chunk_size;
  p.num_seqs = dims.num_seqs;
  p.num_heads = dims.num_heads;
  p.num_kv_heads = dims.num_kv_heads;
  p.head_size = dims.head_size;
  p.v_head_size = dims.v_head_size;
  p.block_size = dims.block_size;
  // A unit attends at most the longest sequence of this call, often far fewer tokens than
  // max_seq_len (a compiled step passes its capture-time bound every time): the per-thread
  // scratch holds that many logits.
  int64_t longest = 0;
  for (int64_t s = 0; s < dims.num_seqs; ++s) longest = std::max<int64_t>(longest, p.seq_lens[s]);
  p.max_unit_tokens = std::min(longest, p.partition_size);
  if (sliding_window > 0) {
    // The first query row's window, plus the positions of the rows after it.
    p.max_unit_tokens = std::min(p.max_unit_tokens, sliding_window + p.max_query_len - 1);
  }
  if (attention_chunk_size > 0 && attention_chunk_size < p.max_unit_tokens) {
    // Likewise from the start of the first query row's chunk.
    p.max_unit_tokens = std::min(p.max_unit_tokens, attention_chunk_size + p.max_query_len - 1);
  }
  // Up to kMaxUnitKvHeads KV heads per unit (see decode_attention.h), fewer while that would
  // leave fewer than 4 units per thread to share out; with several query rows per sequence, as
  // many as keep the unit's rows within kMaxUnitRows.
  p.unit_kv_heads = std::max<int64_t>(1, std::min(kMaxUnitKvHeads, dims.num_kv_heads));
  if (p.max_query_len > 1) {
    const int64_t head_rows = p.max_query_len * (dims.num_heads / dims.num_kv_heads);
    while (p.unit_kv_heads > 1 && p.unit_kv_heads * head_rows > kMaxUnitRows) {
      p.unit_kv_heads /= 2;
    }
  }
  while (p.unit_kv_heads > 1 && unit_count(p) < 4 * at::get_num_threads()) p.unit_kv_heads /= 2;
  if (dims.num_seqs == 0 || dims.num_heads == 0) return;

  p.key_scale = 1.0f;
  p.value_scale = 1.0f;
  if (dims.cache_dtype != CacheDtype::kAuto) {
    p.key_scale = k_scale.item<float>();
    p.value_scale = v_scale.item<float>();
  }
  PA_DISPATCH_QUERY_TYPES(query.scalar_type(), "paged_attention_cpu", [&] {
    switch (dims.cache_dtype) {
      case CacheDtype::kAuto:
        run_kernels<scalar_t, scalar_t>(p, bf16_matmul);
        break;
      case CacheDtype::kFp8E4M3:
        run_kernels<scalar_t, c10::Float8_e4m3fn>(p, bf16_matmul);
        break;
      case CacheDtype::kFp8E5M2:
        run_kernels<scalar_t, c10::Float8_e5m2>(p, bf16_matmul);
        break;
    }
  });
}

// out[s, h] = sum_j w_j * tmp_out[s, h, j] / sum_j w_j with w_j = exp_sum_j * exp(max_j - max).
template <typename scalar_t>
void combine_partitions(at::Tensor& out, const at::Tensor& exp_sums,
                        const at::Tensor& max_logits, const at::Tensor& tmp_out) {
  const int64_t rows = out.size(0) * out.size(1);
  const int64_t head_size = out.size(2);
  const int64_t partitions = exp_sums.size(2);
  const float* sums = exp_sums.data_ptr<float>();
  const float* maxes = max_logits.data_ptr<float>();
  const scalar_t* parts = tmp_out.data_ptr<scalar_t>();
  scalar_t* dst = out.data_ptr<scalar_t>();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(head_size);
    std::vector<float> weights(partitions);
    for (int64_t row = begin; row < end; ++row) {
      const float* m = maxes + row * partitions;
      float global_max = -std::numeric_limits<float>::infinity();
      for (int64_t j = 0; j < partitions; ++j) global_max = std::max(global_max, m[j]);
      if (!std::isfinite(global_max)) global_max = 0.0f;
      float total = 0.0f;
      for (int64_t j = 0; j < partitions; ++j) {
        weights[j] = sums[row * partitions + j] * std::exp(m[j] - global_max);
        total += weights[j];
      }
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t j = 0; j < partitions; ++j) {
        if (weights[j] == 0.0f) continue;  // empty partition: its zero row adds nothing
        const scalar_t* part = parts + (row * partitions + j) * head_size;
        for (int64_t d = 0; d < head_size; ++d) acc[d] += weights[j] * static_cast<float>(part[d]);
      }
      const float inv_total = total > 0.0f ? 1.0f / std::max(total, 1e-30f) : 0.0f;
      for (int64_t d = 0; d < head_size; ++d) {
        dst[row * head_size + d] = static_cast<scalar_t>(acc[d] * inv_total);
      }
    }
  });
}

}  // namespace

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
  const AttentionDims dims = check_attention_args(args, block_size);
  check_attention_indices(block_tables, seq_lens, dims, sliding_window,
                          attention_chunk_size);
  AttentionParams p{};
  p.out = out.data_ptr();
  p.num_partitions = 1;
  p.partition_size = std::numeric_limits<int64_t>::max() / 2;
  p.max_query_len = 1;
  fill_params_and_run(p, dims, args);
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
  const AttentionDims dims = check_attention_args(args, block_size);
  check_v2_scratch(exp_sums, max_logits, tmp_out, dims, args);
  check_attention_indices(block_tables, seq_lens, dims, sliding_window,
                          attention_chunk_size);
  AttentionParams p{};
  p.out = tmp_out.data_ptr();
  p.max_logits = max_logits.data_ptr<float>();
  p.exp_sums = exp_sums.data_ptr<float>();
  p.num_partitions = exp_sums.size(2);
  p.partition_size = kPartitionSize;
  p.max_query_len = 1;
  fill_params_and_run(p, dims, args);
  if (dims.num_seqs == 0 || dims.num_heads == 0) return;
  PA_DISPATCH_QUERY_TYPES(query.scalar_type(),
                                  "paged_attention_v2_combine",
                                  [&] { combine_partitions<scalar_t>(out, exp_sums, max_logits,
                                                                     tmp_out); });
}

void paged_attention_varlen(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                            const at::Tensor& value_cache, int64_t num_kv_heads, double scale,
                            const at::Tensor& block_tables, const at::Tensor& seq_lens,
                            const at::Tensor& query_start_loc, int64_t max_query_len,
                            int64_t max_seq_len, const std::optional<at::Tensor>& alibi_slopes,
                            const std::string& kv_cache_dtype, const at::Tensor& k_scale,
                            const at::Tensor& v_scale, int64_t sliding_window,
                            double logits_soft_cap, const std::optional<at::Tensor>& sinks,
                            int64_t attention_chunk_size) {
  const AttentionArgs args{out,          query,          key_cache,       value_cache,
                           num_kv_heads, scale,          block_tables,    seq_lens,
                           max_seq_len,  alibi_slopes,   kv_cache_dtype,  k_scale,
                           v_scale,      sliding_window, logits_soft_cap, attention_chunk_size};
  const VarlenDims dims = check_varlen_args(args, query_start_loc, max_query_len, sinks);
  check_varlen_indices(block_tables, seq_lens, query_start_loc, dims, sliding_window,
                       attention_chunk_size);
  AttentionParams p{};
  p.out = out.data_ptr();
  p.num_partitions = 1;
  p.partition_size = std::numeric_limits<int64_t>::max() / 2;
  p.query_start_loc = query_start_loc.data_ptr<int32_t>();
  p.sinks = sinks.has_value() ? sinks->data_ptr<float>() : nullptr;
  // The bf16 products apply to a bf16 query over a bf16 cache; chosen here, before any kernel
  // writes to out (a bad PAGED_ATTENTION_CPU_BF16_MATMUL raises with out as it was).
  const Bf16Matmul bf16_matmul = query.scalar_type() == at::kBFloat16 &&
                                         dims.cache_dtype == CacheDtype::kAuto
                                     ? selected_bf16_matmul(selected_isa())
                                     : Bf16Matmul::kNone;
  // Sequences of up to kDecodeMaxRows query rows per KV head (and single-row ones) through the
  // decode kernel, the longer ones tiled; with AMX products, up to kDecodeMaxRowsBesideAmx.
  const int64_t group = dims.num_heads / std::max<int64_t>(1, dims.num_kv_heads);
  const int64_t decode_max_rows =
      bf16_matmul == Bf16Matmul::kAmx ? kDecodeMaxRowsBesideAmx : kDecodeMaxRows;
  p.max_query_len =
      std::clamp<int64_t>(max_query_len, 1, std::max<int64_t>(1, decode_max_rows / group));
  fill_params_and_run(p, dims, args, bf16_matmul);
}

}  // namespace paged_attention::cpu
