// The C interface of the emulation library (libpa_emulator.so) that tests/cuda_emulator.py
// loads with ctypes: the attention ops (v1, v2, varlen) as the CUDA glue launches them on a GPU
// of given limits, the plan of every kernel variant per target GPU, and self-tests of the
// primitives.
#include <algorithm>
#include <cstring>
#include <iterator>
#include <string>
#include <vector>

#include "cuda/emulator/attention_entry.h"

using namespace paged_attention;
using namespace paged_attention::cuda;

namespace {

void copy_error(const std::string& error, char* out, int64_t capacity) {
  if (capacity <= 0) return;
  const size_t n = std::min<size_t>(error.size(), static_cast<size_t>(capacity - 1));
  std::memcpy(out, error.data(), n);
  out[n] = '\0';
}

struct Regions {
  explicit Regions(const int64_t* triples, int64_t count) {
    emulator::clear_globals();
    for (int64_t i = 0; i < count; ++i) {
      emulator::register_global(reinterpret_cast<const void*>(triples[3 * i]),
                                static_cast<size_t>(triples[3 * i + 1]), triples[3 * i + 2] != 0);
    }
  }
  ~Regions() { emulator::clear_globals(); }
};

// Resident CTAs per SM of a launch's variant on `device`, at the registers its launch bounds
// allow (the device asks the CUDA occupancy API instead).
int modelled_ctas(const KernelShape& shape, const DeviceLimits& device, const AttentionParams& p) {
  const int compiled = compiled_ctas_per_sm(p.scalar, p.cache, shape.head_bucket,
                                            shape.row_warps, shape.stages);
  return std::max(1, resident_ctas(device, shape.shared_bytes, register_budget(compiled)));
}

}  // namespace

extern "C" {

// All fields 64-bit: pointers, integers, doubles (ctypes mirrors this struct).
struct PaEmulatedAttention {
  int64_t version;  // 1 or 2 (decode), 3 (varlen)
  int64_t scalar;  // ScalarKind
  int64_t cache;  // CacheDtype
  // The GPU the launch is planned for (DeviceLimits, in its order).
  int64_t num_sms;
  int64_t shared_per_block_optin;
  int64_t shared_per_sm;
  int64_t reserved_shared_per_block;
  int64_t registers_per_sm;
  int64_t threads_per_sm;
  int64_t max_ctas_per_sm;
  int64_t ctas_per_sm;  // 0: modelled (resident_ctas at the variant's register budget)
  int64_t workers;  // host threads
  const int64_t* regions;  // (address, bytes, writable) triples: the memory the kernels may touch
  int64_t num_regions;
  void* out;
  float* exp_sums;
  float* max_logits;
  void* tmp_out;
  const void* query;
  int64_t query_seq_stride;
  int64_t query_head_stride;
  const void* key_cache;
  const void* value_cache;
  int64_t key_block_stride;
  int64_t key_head_stride;
  int64_t value_block_stride;
  int64_t value_head_stride;
  const int32_t* block_tables;
  int64_t block_table_stride;
  int64_t max_blocks_per_seq;
  const int32_t* seq_lens;
  int64_t num_seqs;
  int64_t num_heads;
  int64_t num_kv_heads;
  int64_t head_size;
  int64_t block_size;
  int64_t max_seq_len;
  double scale;
  double logits_soft_cap;
  int64_t sliding_window;
  const float* alibi_slopes;
  const float* k_scale;
  const float* v_scale;
  int64_t num_partitions;
  const int32_t* query_start_loc;  // varlen
  int64_t num_tokens;
  int64_t max_query_len;
  const float* sinks;
  int64_t attention_chunk_size;
  int64_t v_head_size;  // of the values and out (value_cache's dim 2)
};

struct PaEmulatorReport {
  int64_t row_warps;
  int64_t rows_per_cta;
  int64_t tokens_per_cta;
  int64_t work_items;  // grid x
  int64_t scheduled;
  int64_t splits;
  int64_t split_tokens;
  int64_t ctas;
  int64_t shared_bytes;
  int64_t stages;
  int64_t ctas_per_sm;
  int64_t heads_per_cta;
  int64_t ldmatrix;
  int64_t ldmatrix_conflicted;
  int64_t ldmatrix_max_ways;
  int64_t mma;
  int64_t cp_async_bytes;
};

// Returns 0, or 1 with a message in `error`.
int pa_emulate_paged_attention(const PaEmulatedAttention* call, PaEmulatorReport* report,
                               char* error, int64_t error_capacity) {
  AttentionParams p{};
  p.out = call->out;
  p.exp_sums = call->exp_sums;
  p.max_logits = call->max_logits;
  p.tmp_out = call->tmp_out;
  p.query = call->query;
  p.query_seq_stride = call->query_seq_stride;
  p.query_head_stride = call->query_head_stride;
  p.key_cache = call->key_cache;
  p.value_cache = call->value_cache;
  p.key_block_stride = call->key_block_stride;
  p.key_head_stride = call->key_head_stride;
  p.value_block_stride = call->value_block_stride;
  p.value_head_stride = call->value_head_stride;
  p.block_tables = call->block_tables;
  p.block_table_stride = call->block_table_stride;
  p.max_blocks_per_seq = static_cast<int32_t>(call->max_blocks_per_seq);
  p.seq_lens = call->seq_lens;
  p.num_seqs = static_cast<int32_t>(call->num_seqs);
  p.num_heads = static_cast<int32_t>(call->num_heads);
  p.num_kv_heads = static_cast<int32_t>(call->num_kv_heads);
  p.head_size = static_cast<int32_t>(call->head_size);
  p.v_head_size = static_cast<int32_t>(call->v_head_size);
  p.block_size = static_cast<int32_t>(call->block_size);
  p.max_seq_len = static_cast<int32_t>(call->max_seq_len);
  p.scale = static_cast<float>(call->scale);
  p.logits_soft_cap = static_cast<float>(call->logits_soft_cap);
  p.sliding_window = static_cast<int32_t>(call->sliding_window);
  p.attention_chunk_size = static_cast<int32_t>(call->attention_chunk_size);
  p.alibi_slopes = call->alibi_slopes;
  p.k_scale = call->k_scale;
  p.v_scale = call->v_scale;
  p.num_partitions = static_cast<int32_t>(call->num_partitions);
  p.scalar = static_cast<ScalarKind>(call->scalar);
  p.cache = static_cast<CacheDtype>(call->cache);
  const AttentionOp op = call->version == 3   ? AttentionOp::kVarlen
                         : call->version == 2 ? AttentionOp::kDecodeV2
                                              : AttentionOp::kDecodeV1;
  if (op == AttentionOp::kVarlen) {
    p.query_start_loc = call->query_start_loc;
    p.num_tokens = static_cast<int32_t>(call->num_tokens);
    p.max_query_len = static_cast<int32_t>(call->max_query_len);
    p.sinks = call->sinks;
  } else {
    p.num_tokens = p.num_seqs;
    p.max_query_len = 1;
  }

  const DeviceLimits device{static_cast<int>(call->num_sms),
                            static_cast<uint32_t>(call->shared_per_block_optin),
                            static_cast<uint32_t>(call->shared_per_sm),
                            static_cast<uint32_t>(call->reserved_shared_per_block),
                            static_cast<int>(call->registers_per_sm),
                            static_cast<int>(call->threads_per_sm),
                            static_cast<int>(call->max_ctas_per_sm)};
  const KernelShape shape = launch_shape(p, op, device);
  report->shared_bytes = shape.shared_bytes;
  report->stages = shape.stages;
  if (shape.shared_bytes > device.shared_per_block_optin) {
    copy_error("the kernel variant needs " + std::to_string(shape.shared_bytes) +
                   " bytes of shared memory per CTA, more than the device's " +
                   std::to_string(device.shared_per_block_optin),
               error, error_capacity);
    return 1;
  }
  const int ctas_per_sm =
      call->ctas_per_sm > 0 ? static_cast<int>(call->ctas_per_sm) : modelled_ctas(shape, device, p);
  const AttentionPlan plan = make_attention_plan(p, op, device, ctas_per_sm);
  // Scratch starts as NaN bytes, as memory from the caching allocator may hold anything.
  std::vector<unsigned char> scratch(static_cast<size_t>(scratch_layout(p, plan).bytes), 0xff);

  const Regions regions(call->regions, call->num_regions);
  if (!scratch.empty()) emulator::register_global(scratch.data(), scratch.size(), true);
  emulator::reset_stats();
  std::string failure;
  if (plan.grid_x > 0 && p.num_heads > 0) {
    const int workers = static_cast<int>(std::max<int64_t>(1, call->workers));
    switch (p.scalar) {
      case ScalarKind::kFloat:
        failure = emulate_attention_float(p, plan, scratch.data(), workers);
        break;
      case ScalarKind::kHalf:
        failure = emulate_attention_half(p, plan, scratch.data(), workers);
        break;
      case ScalarKind::kBFloat16:
        failure = emulate_attention_bfloat16(p, plan, scratch.data(), workers);
        break;
    }
  }
  const emulator::Stats stats = emulator::stats();
  report->row_warps = shape.row_warps;
  report->rows_per_cta = shape.rows;
  report->tokens_per_cta = shape.tokens_per_cta;
  report->work_items = plan.grid_x;
  report->scheduled = plan.scheduled;
  report->splits = plan.split.splits;
  report->split_tokens = plan.split.split_tokens;
  report->ctas = static_cast<int64_t>(stats.ctas);
  report->ctas_per_sm = ctas_per_sm;
  report->heads_per_cta = shape.heads_per_token;
  report->ldmatrix = static_cast<int64_t>(stats.ldmatrix);
  report->ldmatrix_conflicted = static_cast<int64_t>(stats.ldmatrix_conflicted);
  report->ldmatrix_max_ways = stats.ldmatrix_max_ways;
  report->mma = static_cast<int64_t>(stats.mma);
  report->cp_async_bytes = static_cast<int64_t>(stats.cp_async_bytes);
  copy_error(failure, error, error_capacity);
  return failure.empty() ? 0 : 1;
}

// ---- the plan of every kernel variant on the target GPUs (plan.h) ----

int64_t pa_num_targets() { return static_cast<int64_t>(std::size(kTargetGpus)); }

// Target i: its architecture name and example GPUs, and its DeviceLimits as 7 integers.
const char* pa_target_arch(int64_t i) { return kTargetGpus[i].arch; }
const char* pa_target_gpus(int64_t i) { return kTargetGpus[i].gpus; }
void pa_target_limits(int64_t i, int64_t* limits) {
  const DeviceLimits& d = kTargetGpus[i].limits;
  const int64_t values[] = {d.sms,          d.shared_per_block_optin, d.shared_per_sm,
                            d.reserved_shared_per_block, d.registers_per_sm,
                            d.threads_per_sm, d.ctas_per_sm};
  std::copy(std::begin(values), std::end(values), limits);
}

struct PaVariantPlan {
  int64_t stages;  // the ring the plan picks on the device
  int64_t full_stages;  // the variant's full ring
  int64_t shared_bytes;
  int64_t compiled_ctas_per_sm;  // its __launch_bounds__ minimum
  int64_t register_budget;  // registers per thread those bounds allow
  int64_t ctas_per_sm;  // resident on the device at that budget
};

// The variant (scalar, cache, head bucket, warps of rows) on the device of target i.
void pa_plan_variant(int64_t scalar, int64_t cache, int64_t bucket, int64_t row_warps,
                     int64_t target, PaVariantPlan* out) {
  const auto kind = static_cast<ScalarKind>(scalar);
  const auto format = static_cast<CacheDtype>(cache);
  const DeviceLimits& device = kTargetGpus[target].limits;
  const KernelShape shape = launch_kernel_shape(kind, format, static_cast<int>(bucket), 1, 1,
                                                static_cast<int>(row_warps), device);
  const int compiled =
      compiled_ctas_per_sm(kind, format, shape.head_bucket, shape.row_warps, shape.stages);
  out->stages = shape.stages;
  out->full_stages = attention_kernel_shape(kind, format, static_cast<int>(bucket), 1, 1,
                                            static_cast<int>(row_warps))
                         .stages;
  out->shared_bytes = shape.shared_bytes;
  out->compiled_ctas_per_sm = compiled;
  out->register_budget = register_budget(compiled);
  out->ctas_per_sm = resident_ctas(device, shape.shared_bytes, register_budget(compiled));
}

// ---- self-tests of the primitives: one warp (or CTA) running a small body ----

// ldmatrix_x4: shared memory initialised from `init` (bytes), lane l gives row_offsets[l] and
// returns r[0..3] in out[4 l ..].
int pa_selftest_ldmatrix(const uint8_t* init, int64_t bytes, const uint32_t* row_offsets,
                         uint32_t* out, char* error, int64_t error_capacity) {
  const int64_t regions[] = {reinterpret_cast<int64_t>(init), bytes, 0,
                             reinterpret_cast<int64_t>(row_offsets), 32 * 4, 0,
                             reinterpret_cast<int64_t>(out), 32 * 16, 1};
  const Regions guard(regions, 3);
  const std::string failure = emulator::launch(
      {{1, 1, 1}, 32, static_cast<uint32_t>(bytes)}, [&] {
        const int lane = prim::thread_index();
        for (int64_t i = lane; i < bytes; i += 32) *prim::shared<uint8_t>(i) = prim::load(init + i);
        prim::syncwarp();
        uint32_t r[4];
        prim::ldmatrix_x4(r, prim::load(row_offsets + lane));
        for (int j = 0; j < 4; ++j) prim::store(out + 4 * lane + j, r[j]);
      });
  copy_error(failure, error, error_capacity);
  return failure.empty() ? 0 : 1;
}

// mma_16816: lane l's registers a[4 l ..], b[2 l ..], accumulators c[4 l ..] -> d[4 l ..].
int pa_selftest_mma(int64_t bf16, const uint32_t* a, const uint32_t* b, const float* c, float* d,
                    char* error, int64_t error_capacity) {
  const int64_t regions[] = {reinterpret_cast<int64_t>(a), 32 * 16, 0,
                             reinterpret_cast<int64_t>(b), 32 * 8, 0,
                             reinterpret_cast<int64_t>(c), 32 * 16, 0,
                             reinterpret_cast<int64_t>(d), 32 * 16, 1};
  const Regions guard(regions, 4);
  const std::string failure = emulator::launch({{1, 1, 1}, 32, 0}, [&] {
    const int lane = prim::thread_index();
    const uint32_t ra[4] = {prim::load(a + 4 * lane), prim::load(a + 4 * lane + 1),
                            prim::load(a + 4 * lane + 2), prim::load(a + 4 * lane + 3)};
    float acc[4];
    for (int i = 0; i < 4; ++i) acc[i] = prim::load(c + 4 * lane + i);
    if (bf16) {
      prim::mma_16816<prim::MmaType::kBF16>(acc, ra, prim::load(b + 2 * lane),
                                            prim::load(b + 2 * lane + 1));
    } else {
      prim::mma_16816<prim::MmaType::kF16>(acc, ra, prim::load(b + 2 * lane),
                                           prim::load(b + 2 * lane + 1));
    }
    for (int i = 0; i < 4; ++i) prim::store(d + 4 * lane + i, acc[i]);
  });
  copy_error(failure, error, error_capacity);
  return failure.empty() ? 0 : 1;
}

// cp.async: each of 32 lanes copies 16 bytes of `src` (group 0) and 16 more (group 1), then
//   mode 0: waits for all, mode 1: waits for none, mode 2: wait_group<1>, mode 3: exits without
//   waiting (an error); after a syncwarp lane l reads back its 32 bytes into out[8 l ..].
int pa_selftest_cp_async(int64_t mode, const float* src, float* out, char* error,
                         int64_t error_capacity) {
  const int64_t regions[] = {reinterpret_cast<int64_t>(src), 32 * 32, 0,
                             reinterpret_cast<int64_t>(out), 32 * 32, 1};
  const Regions guard(regions, 2);
  const std::string failure = emulator::launch({{1, 1, 1}, 32, 32 * 32}, [&] {
    const int lane = prim::thread_index();
    prim::cp_async_16(16u * lane, src + 4 * lane);
    prim::cp_async_commit();
    prim::cp_async_16(512u + 16u * lane, src + 128 + 4 * lane);
    prim::cp_async_commit();
    if (mode == 0) prim::cp_async_wait<0>();
    if (mode == 2) prim::cp_async_wait<1>();
    if (mode == 3) return;
    prim::syncwarp();
    for (int i = 0; i < 4; ++i) {
      prim::store(out + 8 * lane + i, *prim::shared<float>(16u * lane + 4u * i));
      prim::store(out + 8 * lane + 4 + i, *prim::shared<float>(512u + 16u * lane + 4u * i));
    }
    if (mode == 1 || mode == 2) prim::cp_async_wait<0>();
  });
  copy_error(failure, error, error_capacity);
  return failure.empty() ? 0 : 1;
}

// Bodies the emulator must reject: 0 lanes of one warp at different collectives, 1 a
// syncthreads some threads never reach, 2 a global load outside the registered memory,
// 3 an ldmatrix row outside shared memory, 4 a store to read-only memory.
int pa_selftest_rejects(int64_t which, float* buffer, char* error, int64_t error_capacity) {
  const int64_t regions[] = {reinterpret_cast<int64_t>(buffer), 64 * 4, which != 4};
  const Regions guard(regions, 1);
  const std::string failure = emulator::launch({{1, 1, 1}, 64, 256}, [&] {
    const int tid = prim::thread_index();
    if (which == 0) {
      if (tid % 2 == 0) {
        prim::syncwarp();
      } else {
        (void)prim::shfl_xor(1.0f, 1);
      }
    } else if (which == 1) {
      if (tid < 32) return;
      prim::syncthreads();
    } else if (which == 2) {
      (void)prim::load(buffer + 64 + tid);
    } else if (which == 3) {
      uint32_t r[4];
      prim::ldmatrix_x4(r, 256);
    } else {
      prim::store(buffer + tid, 1.0f);
    }
  });
  copy_error(failure, error, error_capacity);
  return failure.empty() ? 0 : 1;
}

}  // extern "C"
