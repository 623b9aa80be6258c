// Parts shared by the attention kernel bodies (mma_attention.h, cuda_core_attention.h) and the
// reduce kernel: element types, the query rows a CTA serves and the positions they attend, block
// ids, and the merge of the softmax states into the output or a partial result. Written against
// primitives.h only.
#pragma once

#include <cstdint>

#include "cuda/attention/plan.h"
#include "cuda/primitives/primitives.h"

namespace paged_attention::cuda {

constexpr float kLog2e = 1.4426950408889634f;

// Query / output element types: storage and conversions.
struct Float32 {
  using Storage = float;
  static constexpr ScalarKind kKind = ScalarKind::kFloat;
  static PA_DEVICE float to_float(float v) { return v; }
  static PA_DEVICE float from_float(float v) { return v; }
};
struct Float16 {
  using Storage = uint16_t;
  static constexpr ScalarKind kKind = ScalarKind::kHalf;
  static constexpr prim::MmaType kMma = prim::MmaType::kF16;
  static PA_DEVICE float to_float(uint16_t v) { return prim::half_to_float(v); }
  static PA_DEVICE uint16_t from_float(float v) { return prim::float_to_half(v); }
};
struct BFloat16 {
  using Storage = uint16_t;
  static constexpr ScalarKind kKind = ScalarKind::kBFloat16;
  static constexpr prim::MmaType kMma = prim::MmaType::kBF16;
  static PA_DEVICE float to_float(uint16_t v) { return prim::bf16_to_float(v); }
  static PA_DEVICE uint16_t from_float(float v) { return prim::float_to_bf16(v); }
};

PA_DEVICE int clamp_int(int v, int lo, int hi) { return v < lo ? lo : (v > hi ? hi : v); }

// The query rows of one CTA: `tokens` consecutive query tokens of one sequence times `heads`
// query heads of one KV head; row r is token r / heads_per_token, head r % heads_per_token.
struct CtaRows {
  int seq;
  int kv_head;
  int first_head;  // query head of head offset 0
  int heads;  // heads served per token (offsets 0 .. heads - 1)
  int heads_per_token;  // the row stride of a token
  int first_token;  // the query / out row of token 0
  int tokens;  // tokens served; 0 when the CTA has no work
  int first_pos;  // the sequence position of token 0
  int len;  // the sequence length, clamped to max_seq_len and what the block table addresses
  PA_DEVICE bool valid(int t, int h) const { return t < tokens && h < heads; }
};

// The query rows of sequence `seq` in a varlen launch, clamped to [0, num_tokens] and to
// max_query_len rows (the schedule kernel and the attention kernels read them alike).
struct QueryRows {
  int start, len;
};
PA_DEVICE QueryRows query_rows(const AttentionParams& p, int seq) {
  const int start = clamp_int(prim::load(p.query_start_loc + seq), 0, p.num_tokens);
  const int end = clamp_int(prim::load(p.query_start_loc + seq + 1), start, p.num_tokens);
  return {start, end - start < p.max_query_len ? end - start : p.max_query_len};
}

// The rows of CTA (x, y): sequence x (decode, or varlen queries that fit one CTA) or the x-th
// scheduled work item, and KV head chunk y. Every value read from the device is clamped, so
// that rows never leave query / out and positions never leave the block table.
PA_DEVICE CtaRows cta_rows(const AttentionParams& p, const AttentionLaunch& launch, int x, int y) {
  CtaRows r{};
  r.kv_head = y / launch.head_chunks;
  const int chunk = y % launch.head_chunks;
  const int group = p.num_heads / p.num_kv_heads;
  r.heads_per_token = launch.heads_per_token;
  r.first_head = r.kv_head * group + chunk * launch.heads_per_token;
  r.heads = group - chunk * launch.heads_per_token;
  if (r.heads > launch.heads_per_token) r.heads = launch.heads_per_token;
  int query_chunk = 0, q_start = x, q_len = 1;
  r.seq = x;
  if (p.query_start_loc != nullptr) {
    if (launch.work != nullptr) {
      r.seq = prim::load(launch.work + 2 * int64_t{x});
      query_chunk = prim::load(launch.work + 2 * int64_t{x} + 1);
      if (r.seq < 0) return r;  // past the last work item: tokens = 0
    }
    const QueryRows query = query_rows(p, r.seq);
    q_start = query.start;
    q_len = query.len;
  }
  int64_t len = prim::load(p.seq_lens + r.seq);
  const int64_t addressable = int64_t{p.max_blocks_per_seq} * p.block_size;
  if (len > p.max_seq_len) len = p.max_seq_len;
  if (len > addressable) len = addressable;
  if (len < 0) len = 0;
  r.len = static_cast<int>(len);
  const int first = query_chunk * launch.tokens_per_cta;
  r.first_token = q_start + first;
  r.tokens = q_len - first < launch.tokens_per_cta ? q_len - first : launch.tokens_per_cta;
  if (r.tokens < 0) r.tokens = 0;
  r.first_pos = r.len - q_len + first;
  return r;
}

// The positions a CTA's rows attend in its split.
struct CtaWork {
  int split;
  int split_begin, split_end;
  int begin, end;  // the union over the rows: [begin, end), empty when begin >= end
  int block_shift;  // log2(block_size)
};

PA_DEVICE int log2_of_block_size(int block_size) {
  return block_size == 8 ? 3 : block_size == 16 ? 4 : 5;
}

// [begin, end) a query at position `pos` attends in a split: positions <= pos, inside the
// window and the chunk. Empty (begin >= end) for positions before the sequence (a negative
// pos). `begin` never decreases as `pos` grows, so consecutive rows attend one contiguous union.
struct PositionRange {
  int begin, end;
};
PA_DEVICE PositionRange attended_range(const AttentionParams& p, const CtaWork& w, int pos) {
  int begin = w.split_begin;
  if (p.sliding_window > 0 && pos - p.sliding_window + 1 > begin) {
    begin = pos - p.sliding_window + 1;
  }
  if (p.attention_chunk_size > 0) {
    const int chunk_start = pos - pos % p.attention_chunk_size;  // <= 0 for pos <= 0
    if (chunk_start > begin) begin = chunk_start;
  }
  const int end = pos + 1 < w.split_end ? pos + 1 : w.split_end;
  return {begin, end};
}

PA_DEVICE CtaWork cta_work(const AttentionParams& p, const AttentionLaunch& launch,
                           const CtaRows& rows, int split) {
  CtaWork w{};
  w.split = split;
  const int64_t split_begin = int64_t{split} * launch.split_tokens;
  int64_t split_end = split_begin + launch.split_tokens;
  if (split_end > rows.len) split_end = rows.len;
  w.split_begin = static_cast<int>(split_begin < rows.len ? split_begin : rows.len);
  w.split_end = static_cast<int>(split_end);
  const PositionRange first = attended_range(p, w, rows.first_pos);
  const PositionRange last = attended_range(p, w, rows.first_pos + rows.tokens - 1);
  w.begin = first.begin;
  w.end = last.end;
  if (w.begin >= w.end) w.begin = w.end = 0;
  w.block_shift = log2_of_block_size(p.block_size);
  return w;
}

// The physical block of positions [pos, pos + count) (inside one block), or -1 when none of
// them is attended: only table entries of blocks some row reads are loaded (a block before a
// sliding window may have been released, one past seq_len may not exist).
PA_DEVICE int block_id(const AttentionParams& p, const CtaRows& rows, const CtaWork& w, int pos,
                       int count) {
  if (pos + count <= w.begin || pos >= w.end) return -1;
  return prim::load(p.block_tables + int64_t{rows.seq} * p.block_table_stride +
                    (pos >> w.block_shift));
}

// One thread's share of a tile copy: units j < count of kBytes each, from src + j * kSrcStride
// to shared offset dst(j). Head sizes equal to the bucket (`whole`, uniform over the warp) copy
// all kN units with immediate offsets; smaller ones take a loop with a run-time bound, so that
// no per-unit predicate stays live across the main loop.
template <int kN, int kBytes, int64_t kSrcStride, typename Dst>
PA_DEVICE void copy_units(bool whole, const unsigned char* src, const Dst& dst, int count) {
  const auto copy = [&](int j) {
    if constexpr (kBytes == 16) {
      prim::cp_async_16(dst(j), src + j * kSrcStride);
    } else {
      prim::cp_async_8(dst(j), src + j * kSrcStride);
    }
  };
  if (whole) {
#pragma unroll
    for (int j = 0; j < kN; ++j) copy(j);
  } else {
#pragma unroll 1
    for (int j = 0; j < count; ++j) copy(j);
  }
}

// Units j < n of one thread whose index first + j * step is below `limit`.
PA_DEVICE int units_below(int limit, int first, int step, int n) {
  const int count = limit > first ? (limit - first + step - 1) / step : 0;
  return count < n ? count : n;
}

// The out row (or partial-result row) of token t, head offset h of the CTA; its elements are
// the v_head_size output columns (store_value).
PA_DEVICE int64_t result_row(const AttentionParams& p, const CtaRows& rows, int t, int h) {
  return int64_t{rows.first_token + t} * p.num_heads + rows.first_head + h;
}

template <typename Scalar>
PA_DEVICE void store_value(const AttentionParams& p, const AttentionLaunch& launch,
                           const CtaRows& rows, int split, int t, int h, int d, float v) {
  const int64_t row = result_row(p, rows, t, h);
  if (!launch.partial) {
    prim::store(static_cast<typename Scalar::Storage*>(p.out) + row * p.v_head_size + d,
                Scalar::from_float(v));
    return;
  }
  const int64_t index = (row * launch.num_splits + split) * p.v_head_size + d;
  if (launch.partial_fp32) {
    prim::store(static_cast<float*>(launch.partial_out) + index, v);
  } else {
    prim::store(static_cast<typename Scalar::Storage*>(launch.partial_out) + index,
                Scalar::from_float(v));
  }
}

PA_DEVICE void store_row_stats(const AttentionParams& p, const AttentionLaunch& launch,
                               const CtaRows& rows, int split, int t, int h, float max_logit,
                               float exp_sum) {
  const int64_t index = result_row(p, rows, t, h) * launch.num_splits + split;
  prim::store(launch.max_logits + index, max_logit);
  prim::store(launch.exp_sums + index, exp_sum);
}

// Nothing attended: zeros (out), or the empty partial result (-inf, 0, zero row).
template <typename Scalar>
PA_DEVICE void store_empty(const AttentionParams& p, const AttentionLaunch& launch,
                           const CtaRows& rows, int split) {
  const int tid = prim::thread_index();
  for (int t = 0; t < rows.tokens; ++t) {
    for (int h = 0; h < rows.heads; ++h) {
      for (int d = tid; d < p.v_head_size; d += kAttentionThreads) {
        store_value<Scalar>(p, launch, rows, split, t, h, d, 0.0f);
      }
    }
  }
  if (launch.partial) {
    for (int i = tid; i < rows.tokens * rows.heads; i += kAttentionThreads) {
      store_row_stats(p, launch, rows, split, i / rows.heads, i % rows.heads, -INFINITY, 0.0f);
    }
  }
}

// Shared-memory layout of the rows' softmax states (overlaying the K/V ring once every warp is
// done with it): O [contributor][row][merge_row_floats(kD)], then the max and the sum
// [contributor][row]. A contributor is a warp where the warps split the KV tiles (kContributors
// = 4), or the warp owning the row (kContributors = 1, contributor 0).
template <int kRows, int kContributors, int kD>
struct MergeLayout {
  static constexpr int kRowFloats = merge_row_floats(kD);
  static PA_DEVICE uint32_t o(int k, int row, int d) {
    return 4u * ((k * kRows + row) * kRowFloats + d);
  }
  static PA_DEVICE uint32_t max(int k, int row) {
    return 4u * (kContributors * kRows * kRowFloats + k * kRows + row);
  }
  static PA_DEVICE uint32_t sum(int k, int row) {
    return 4u * (kContributors * kRows * kRowFloats + kContributors * kRows + k * kRows + row);
  }
};

// Combines the contributors' (max, sum, O) of every served row, written to shared memory in
// MergeLayout, into the CTA's result; a sink (varlen, not split) joins the denominator here, a
// split's sink in the reduce kernel. `weights` is scratch for kContributors + 1 floats per row.
// The caller has synchronised the CTA after writing the states.
template <typename Scalar, int kRows, int kContributors, int kD>
PA_DEVICE void merge_and_store(const AttentionParams& p, const AttentionLaunch& launch,
                               const CtaRows& rows, int split, uint32_t weights, float v_scale) {
  using L = MergeLayout<kRows, kContributors, kD>;
  const int tid = prim::thread_index();
  const auto weight = [&](int row, int k) {
    return weights + 4u * (row * (kContributors + 1) + k);
  };
  if (tid < kRows) {
    const int t = tid / rows.heads_per_token, h = tid % rows.heads_per_token;
    if (rows.valid(t, h)) {
      float m = -INFINITY;
      for (int k = 0; k < kContributors; ++k) {
        m = prim::max(m, *prim::shared<float>(L::max(k, tid)));
      }
      const float row_max = m;
      const bool sink = p.sinks != nullptr && !launch.partial;
      const float sink_logit = sink ? prim::load(p.sinks + rows.first_head + h) : -INFINITY;
      if (sink) m = prim::max(m, sink_logit);
      float total = 0.0f;
      float scale[kContributors];
      for (int k = 0; k < kContributors; ++k) {
        const float mk = *prim::shared<float>(L::max(k, tid));
        // A contributor that attended nothing in this row has max -inf and sum 0: weight 0.
        scale[k] = mk == -INFINITY ? 0.0f : prim::exp2((mk - m) * kLog2e);
        total += scale[k] * *prim::shared<float>(L::sum(k, tid));
      }
      if (sink && m != -INFINITY) total += prim::exp2((sink_logit - m) * kLog2e);
      // total >= 1 (the largest logit or the sink contributes exp(0)), so the fast division is
      // exact enough.
      const float inverse = total > 0.0f ? prim::divide(v_scale, total) : 0.0f;
      for (int k = 0; k < kContributors; ++k) {
        *prim::shared<float>(weight(tid, k)) = scale[k] * inverse;
      }
      if (launch.partial) {
        store_row_stats(p, launch, rows, split, t, h, total > 0.0f ? row_max : -INFINITY, total);
      }
    }
  }
  prim::syncthreads();
  for (int t = 0; t < rows.tokens; ++t) {
    for (int h = 0; h < rows.heads; ++h) {
      const int r = t * rows.heads_per_token + h;
      for (int d = tid; d < p.v_head_size; d += kAttentionThreads) {
        float v = 0.0f;
        for (int k = 0; k < kContributors; ++k) {
          const float w = *prim::shared<float>(weight(r, k));
          if (w != 0.0f) v += w * *prim::shared<float>(L::o(k, r, d));
        }
        store_value<Scalar>(p, launch, rows, split, t, h, d, v);
      }
    }
  }
}

}  // namespace paged_attention::cuda
