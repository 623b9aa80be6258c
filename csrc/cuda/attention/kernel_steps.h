// The steps both attention kernels (mma_attention.h, cuda_core_attention.h) take alike: claiming
// the CTA's rows and positions, the logit options, staging the CTA's query rows in shared memory,
// and the ring that streams the KV tiles of the CTA's split through shared memory (FlashInfer's
// prefill kernel has the same steps: load_q_global_smem, produce_kv).
#pragma once

#include <cstdint>

#include "cuda/attention/attention_common.h"

namespace paged_attention::cuda {

// The rows and positions of this CTA; false when it has nothing to compute: past the last work
// item, or nothing attended in its split (it has then stored the empty result).
template <typename Scalar>
PA_DEVICE bool claim_cta(const AttentionParams& p, const AttentionLaunch& launch, CtaRows& rows,
                         CtaWork& work) {
  const prim::Index3 block = prim::block_index();
  rows = cta_rows(p, launch, block.x, block.y);
  if (rows.tokens <= 0) return false;
  work = cta_work(p, launch, rows, block.z);
  if (work.begin >= work.end) {
    store_empty<Scalar>(p, launch, rows, work.split);
    return false;
  }
  return true;
}

// The logit options of a launch besides the scale: the soft cap (0: none) and ALiBi.
struct LogitOptions {
  float soft_cap;
  float inverse_cap;  // 1 / soft_cap, divided once on the host
  bool alibi;

  PA_DEVICE LogitOptions(const AttentionParams& p, const AttentionLaunch& launch)
      : soft_cap(p.logits_soft_cap),
        inverse_cap(launch.inverse_soft_cap),
        alibi(p.alibi_slopes != nullptr) {}

  PA_DEVICE float soft_capped(float logit) const {
    return soft_cap * prim::tanh(logit * inverse_cap);
  }
};

// The CTA's query rows in shared memory: element d of row r (token r / heads_per_token, head
// r % heads_per_token) at byte offset dst(r, d), for d < kD; zero (+0 in every format) past the
// rows the CTA serves and past the head size. Every thread of the CTA takes part.
template <typename Storage, int kRows, int kD, typename Dst>
PA_DEVICE void stage_query(const AttentionParams& p, const CtaRows& rows, const Dst& dst) {
  const auto* query = static_cast<const Storage*>(p.query);
  for (int i = prim::thread_index(); i < kRows * kD; i += kAttentionThreads) {
    const int row = i / kD, d = i % kD;
    const int t = row / rows.heads_per_token, h = row % rows.heads_per_token;
    Storage v = 0;
    if (rows.valid(t, h) && d < p.head_size) {
      v = prim::load(query + int64_t{rows.first_token + t} * p.query_seq_stride +
                     int64_t{rows.first_head + h} * p.query_head_stride + d);
    }
    *prim::shared<Storage>(dst(row, d)) = v;
  }
}

// A thread's view of the ring its KV tiles go through: kStages stages of kStageBytes from byte
// `base`, filled by the kCopyThreads threads of one warp (its own ring: the warps take every
// kAttentionWarps-th tile of the split) or of the whole CTA (one ring: every warp reads every
// tile). Its i-th tile goes to stage i % kStages; a one-stage ring waits for each tile before
// the warps compute on it.
//
// `Tiles` describes the copies of one kernel's tiles:
//   block(i)                      the physical block of this thread's copies of its i-th tile,
//                                 or -1 (nothing to copy: past the split, or unattended);
//   copy<kB>(i, stage, block)     issues them into the stage at byte offset `stage`, for a
//                                 block size of kB (strides between copies are immediates).
// Block ids are read from the block table one tile ahead of the copies.
template <int kStages, int kCopyThreads, uint32_t kStageBytes, typename Tiles>
struct KvRing {
  const Tiles& tiles;
  uint32_t base;
  int block_size;
  int next_block;

  PA_DEVICE uint32_t stage(int i) const {
    return base + static_cast<uint32_t>(i % kStages) * kStageBytes;
  }

  PA_DEVICE static void barrier() {
    if constexpr (kCopyThreads == kWarpSize) {
      prim::syncwarp();
    } else {
      prim::syncthreads();
    }
  }

  // Issues the i-th tile's copies (if this thread has any) as one commit group.
  PA_DEVICE void issue(int i) {
    const int block = next_block;
    next_block = tiles.block(i + 1);
    if (block >= 0) {
      if (block_size == 16) {
        tiles.template copy<16>(i, stage(i), block);
      } else if (block_size == 32) {
        tiles.template copy<32>(i, stage(i), block);
      } else {
        tiles.template copy<8>(i, stage(i), block);
      }
    }
    prim::cp_async_commit();
  }

  // Key chunks [key_chunks, kKeyChunks) of every stage's key tile (kTileTokens rows of 16 bytes
  // per chunk) hold zeros: a head size below the bucket's never copies them, and the bucket's
  // dot products then add 0 * 0 there. (Value rows past v_head_size only reach output
  // columns that are never stored.)
  template <int kKeyChunks, int kTileTokens>
  PA_DEVICE void zero_key_padding(int key_chunks, int copier) const {
    if (key_chunks >= kKeyChunks) return;
    for (int s = 0; s < kStages; ++s) {
      const uint32_t first = stage(s) + key_chunks * kTileTokens * 16;
      for (int w = copier; w < (kKeyChunks - key_chunks) * kTileTokens * 4; w += kCopyThreads) {
        *prim::shared<uint32_t>(first + 4u * w) = 0;
      }
    }
    barrier();
  }

  // The first tiles go out (all stages but one; a one-stage ring: the first tile).
  PA_DEVICE void start() {
    next_block = tiles.block(0);
#pragma unroll 1
    for (int i = 0; i < (kStages > 1 ? kStages - 1 : 1); ++i) issue(i);
  }

  // At the top of iteration i of the main loop: tile i has landed in its stage for every copier
  // of the ring, and every thread of the ring is done with tile i - 1, whose stage the next
  // issue refills.
  PA_DEVICE void wait_for(int i) {
    if constexpr (kStages == 1) {
      if (i > 0) {
        barrier();
        issue(i);
      }
      prim::cp_async_wait<0>();
      barrier();
    } else {
      prim::cp_async_wait<kStages - 2>();
      barrier();
      issue(i + kStages - 1);
    }
  }
};

}  // namespace paged_attention::cuda
