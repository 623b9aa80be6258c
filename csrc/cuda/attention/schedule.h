// The work list of a varlen launch whose queries are longer than one CTA's tokens (T): sequence
// s takes ceil(q_len_s / T) CTAs, in sequence order, and CTA x of the attention kernel reads its
// (sequence, query chunk) from entry x. One CTA of kScheduleThreads threads scans the query
// lengths on the device, so the launch needs no host synchronisation (and replays in a CUDA
// graph); entries past the last item are (-1, 0), and items past the grid's bound (only
// possible for query_start_loc / max_query_len that break their contract) are dropped.
#pragma once

#include <cstdint>

#include "cuda/attention/attention_common.h"

namespace paged_attention::cuda {

constexpr uint32_t kScheduleSharedBytes = 4u * kScheduleThreads;

PA_DEVICE void schedule_varlen_work(const AttentionParams& p, int tokens_per_cta, int32_t* work,
                                    int num_items) {
  const int tid = prim::thread_index();
  int64_t carry = 0;  // items of the sequences before this round
  for (int base = 0; base < p.num_seqs; base += kScheduleThreads) {
    const int seq = base + tid;
    int chunks = 0;
    if (seq < p.num_seqs) chunks = (query_rows(p, seq).len + tokens_per_cta - 1) / tokens_per_cta;
    // Inclusive scan of the round's chunk counts (Hillis-Steele in shared memory).
    *prim::shared<int>(4u * tid) = chunks;
    prim::syncthreads();
    for (int offset = 1; offset < kScheduleThreads; offset *= 2) {
      const int before = tid >= offset ? *prim::shared<int>(4u * (tid - offset)) : 0;
      prim::syncthreads();
      *prim::shared<int>(4u * tid) += before;
      prim::syncthreads();
    }
    const int64_t first = carry + *prim::shared<int>(4u * tid) - chunks;
    for (int k = 0; k < chunks && first + k < num_items; ++k) {
      prim::store(work + 2 * (first + k), static_cast<int32_t>(seq));
      prim::store(work + 2 * (first + k) + 1, static_cast<int32_t>(k));
    }
    carry += *prim::shared<int>(4u * (kScheduleThreads - 1));
    prim::syncthreads();  // the scan buffer is rewritten by the next round
  }
  for (int64_t x = carry + tid; x < num_items; x += kScheduleThreads) {
    prim::store(work + 2 * x, int32_t{-1});
    prim::store(work + 2 * x + 1, int32_t{0});
  }
}

}  // namespace paged_attention::cuda
