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

constexpr uint32_t kScheduleSharedBytes = 8u * kScheduleThreads;

PA_DEVICE void schedule_varlen_work(const AttentionParams& p, int tokens_per_cta, int32_t* work,
                                    int num_items) {
  const int tid = prim::thread_index();
  int64_t carry = 0;  // items of the sequences before this round
  for (int base = 0; base < p.num_seqs; base += kScheduleThreads) {
    const int seq = base + tid;
    int64_t chunks = 0;
    if (seq < p.num_seqs) chunks = (query_rows(p, seq).len + tokens_per_cta - 1) / tokens_per_cta;
    // Inclusive scan of the round's chunk counts (Hillis-Steele in shared memory).
    const auto count = [](int j) { return prim::shared<int64_t>(8u * j); };
    *count(tid) = chunks;
    prim::syncthreads();
    for (int offset = 1; offset < kScheduleThreads; offset *= 2) {
      const int64_t before = tid >= offset ? *count(tid - offset) : 0;
      prim::syncthreads();
      *count(tid) += before;
      prim::syncthreads();
    }
    // The round's items, spread over all threads (one long query has many): item i belongs to
    // the round's first sequence whose inclusive count exceeds i.
    const int64_t round_items = *count(kScheduleThreads - 1);
    for (int64_t i = tid; i < round_items && carry + i < num_items; i += kScheduleThreads) {
      int lo = 0, hi = kScheduleThreads - 1;
      while (lo < hi) {
        const int mid = (lo + hi) / 2;
        if (*count(mid) > i) {
          hi = mid;
        } else {
          lo = mid + 1;
        }
      }
      const int64_t before = lo > 0 ? *count(lo - 1) : 0;
      prim::store(work + 2 * (carry + i), static_cast<int32_t>(base + lo));
      prim::store(work + 2 * (carry + i) + 1, static_cast<int32_t>(i - before));
    }
    carry += round_items;
    prim::syncthreads();  // the scan buffer is rewritten by the next round
  }
  for (int64_t x = carry + tid; x < num_items; x += kScheduleThreads) {
    prim::store(work + 2 * x, int32_t{-1});
    prim::store(work + 2 * x + 1, int32_t{0});
  }
}

}  // namespace paged_attention::cuda
