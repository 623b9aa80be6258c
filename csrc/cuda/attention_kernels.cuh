// Paged decode attention: one query token per sequence against its paged KV cache.
//
// The design follows vLLM's classic kernels (csrc/attention/attention_kernels.cuh, itself adapted
// from NVIDIA FasterTransformer): thread groups reading 16-byte key vectors, logits in shared
// memory, an fp32 softmax reduced with warp shuffles, and for v2 partitions of 512 tokens merged by
// a reduce kernel. It differs where vLLM is weak:
//   * one CTA per (sequence, KV head[, partition]) serves the query heads of the GQA group (up to
//     kMaxHeadsPerCta at once), so each K/V element is loaded once per group instead of once per
//     query head;
//   * block size, head size, group size, ALiBi, soft-cap and sliding window are runtime values;
//     only (query dtype x cache kind x head size up to / above 128) is compiled: 3 x 3 x 2
//     attention kernels plus 3 reduce kernels;
//   * 64-bit block offsets; seq_len is clamped to what block_tables and max_seq_len address;
//   * value elements of token slots outside the attended range are replaced by zero before use,
//     so NaN in uninitialised cache slots never reaches the output;
//   * blocks wholly outside the sliding window are never read;
//   * fp8 scales are read from device memory (no host synchronisation);
//   * the value pass takes each block's physical id from shared memory, where the key pass left
//     it, instead of reloading it from the block table before every value load.
//
// Work split inside a CTA (128 threads, 4 warps):
//   keys:   warp w takes blocks w, w + 4, ...; within a warp, lane l handles token l % block_size
//           and the 16-byte key chunks c = l / block_size + k * (32 / block_size), so a warp reads
//           512 contiguous bytes per step; the partial dots of a token are summed with shuffles.
//   values: thread t owns head-dim rows (t and t + 128) and walks the token slots of its split
//           (head sizes below 128 split the tokens over 128 / head_size thread sets) in tiles of
//           8 vectors per row; each row of a block is block_size contiguous elements, read as
//           16-byte (fp8: 8-byte) vectors.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/launchers.h"

namespace paged_attention::cuda {

constexpr int kWarpSize = 32;
constexpr int kWarps = kAttentionThreads / kWarpSize;
// Key chunks a lane loads before using them, and value vectors per row a thread loads before
// using them (loads in flight per thread).
constexpr int kKeyChunksInFlight = 8;
constexpr int kValueVecsInFlight = 8;
constexpr int kReduceThreads = 128;

// ---------------------------------------------------------------------------------------------
// Element conversions

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) {
  return v;
}
template <>
__device__ __forceinline__ __half from_float<__half>(float v) {
  return __float2half_rn(v);
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

// 16 bytes of a 16/32-bit cache -> floats.
__device__ __forceinline__ void unpack(const uint4& raw, float (&out)[4], float /*tag*/) {
  const float4 f = *reinterpret_cast<const float4*>(&raw);
  out[0] = f.x;
  out[1] = f.y;
  out[2] = f.z;
  out[3] = f.w;
}
__device__ __forceinline__ void unpack(const uint4& raw, float (&out)[8], __half /*tag*/) {
  const __half2* h = reinterpret_cast<const __half2*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __half22float2(h[i]);
    out[2 * i] = f.x;
    out[2 * i + 1] = f.y;
  }
}
__device__ __forceinline__ void unpack(const uint4& raw, float (&out)[8], __nv_bfloat16 /*tag*/) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __bfloat1622float2(h[i]);
    out[2 * i] = f.x;
    out[2 * i + 1] = f.y;
  }
}

// fp8 pairs -> floats. fp8 -> half is exact for both formats (NaN stays NaN), half -> float too,
// so this is the exact value of each fp8 element; the scale is applied by the caller.
template <int N>
__device__ __forceinline__ void unpack_fp8(const uint16_t* pairs, float (&out)[N],
                                           __nv_fp8_interpretation_t format) {
#pragma unroll
  for (int i = 0; i < N / 2; ++i) {
    const __half2 h(__nv_cvt_fp8x2_to_halfraw2(pairs[i], format));
    const float2 f = __half22float2(h);
    out[2 * i] = f.x;
    out[2 * i + 1] = f.y;
  }
}

// What the kernel needs to know about a cache: its element type, the key chunk width x (elements
// per 16 bytes), the value vector (kValueVec consecutive tokens of one head-dim row) and how to
// turn raw loads into floats (without the fp8 scale).
template <typename scalar_t, CacheDtype kCache>
struct CacheTraits {
  using elem_t = scalar_t;
  using value_raw_t = uint4;
  static constexpr int kX = 16 / sizeof(scalar_t);
  static constexpr int kValueVec = kX;
  static constexpr bool kFp8 = false;
  __device__ static void key(const uint4& raw, float (&out)[kX]) { unpack(raw, out, scalar_t()); }
  __device__ static void value(const value_raw_t& raw, float (&out)[kValueVec]) {
    unpack(raw, out, scalar_t());
  }
};

template <typename scalar_t, __nv_fp8_interpretation_t kFormat>
struct Fp8CacheTraits {
  using elem_t = uint8_t;
  using value_raw_t = uint2;  // 8 tokens: block sizes start at 8
  static constexpr int kX = 16;
  static constexpr int kValueVec = 8;
  static constexpr bool kFp8 = true;
  __device__ static void key(const uint4& raw, float (&out)[kX]) {
    unpack_fp8(reinterpret_cast<const uint16_t*>(&raw), out, kFormat);
  }
  __device__ static void value(const value_raw_t& raw, float (&out)[kValueVec]) {
    unpack_fp8(reinterpret_cast<const uint16_t*>(&raw), out, kFormat);
  }
};

template <typename scalar_t>
struct CacheTraits<scalar_t, CacheDtype::kFp8E4M3> : Fp8CacheTraits<scalar_t, __NV_E4M3> {};
template <typename scalar_t>
struct CacheTraits<scalar_t, CacheDtype::kFp8E5M2> : Fp8CacheTraits<scalar_t, __NV_E5M2> {};

__device__ __forceinline__ uint4 load_raw(const uint4* p) { return __ldg(p); }
__device__ __forceinline__ uint2 load_raw(const uint2* p) { return __ldg(p); }

// ---------------------------------------------------------------------------------------------
// Reductions

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
  }
  return v;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
    v += __shfl_xor_sync(0xffffffffu, v, offset);
  }
  return v;
}

// ---------------------------------------------------------------------------------------------
// Attention kernel (v1 and the partition pass of v2)

struct AttentionLaunch {
  int partition_size;  // tokens per partition; 0 = the whole sequence (v1)
  int logit_capacity;  // logit slots per head in shared memory
  int heads_per_cta;
  int head_chunks;  // CTAs per KV head (GQA group split)
};

// kRowsPerThread: value rows one thread owns, 1 for head sizes up to kAttentionThreads, 2 above
// (a compile-time count keeps the accumulators in registers).
template <typename scalar_t, CacheDtype kCache, int kRowsPerThread>
__global__ void __launch_bounds__(kAttentionThreads)
    paged_attention_kernel(const AttentionParams p, const AttentionLaunch launch) {
  using Traits = CacheTraits<scalar_t, kCache>;
  using cache_t = typename Traits::elem_t;
  using value_raw_t = typename Traits::value_raw_t;
  constexpr int kX = Traits::kX;
  constexpr int kVec = Traits::kValueVec;

  const int tid = threadIdx.x;
  const int warp = tid / kWarpSize;
  const int lane = tid % kWarpSize;
  const int seq = blockIdx.x;
  const int kv_head = blockIdx.y / launch.head_chunks;
  const int chunk = blockIdx.y % launch.head_chunks;
  const int partition = blockIdx.z;
  const int group = p.num_heads / p.num_kv_heads;
  const int first_head = kv_head * group + chunk * launch.heads_per_cta;
  const int heads = min(launch.heads_per_cta, group - chunk * launch.heads_per_cta);
  const int head_size = p.head_size;
  const int block_size = p.block_size;

  // The attended token range [token_begin, token_end) of this CTA. seq_len is clamped to what
  // max_seq_len and the block table row can address, so no input makes the kernel read past them.
  int64_t seq_len = p.seq_lens[seq];
  seq_len = max(int64_t{0}, min(seq_len, static_cast<int64_t>(p.max_seq_len)));
  seq_len = min(seq_len, static_cast<int64_t>(p.max_blocks_per_seq) * block_size);
  const int len = static_cast<int>(seq_len);
  const int part_begin = launch.partition_size > 0 ? partition * launch.partition_size : 0;
  const int part_end = launch.partition_size > 0 ? min(len, part_begin + launch.partition_size)
                                                 : len;
  const int window_begin = p.sliding_window > 0 ? max(0, len - p.sliding_window) : 0;
  const int token_begin = max(part_begin, window_begin);
  const int token_end = part_end;

  const int64_t out_row0 = static_cast<int64_t>(seq) * p.num_heads + first_head;  // head row
  const bool v2 = launch.partition_size > 0;
  if (token_begin >= token_end) {
    // Nothing attended: v1 writes zeros; v2 writes the empty partition (-inf, 0, zero row).
    for (int i = tid; i < heads * head_size; i += kAttentionThreads) {
      const int64_t row = out_row0 + i / head_size;
      if (v2) {
        static_cast<scalar_t*>(p.tmp_out)[(row * p.num_partitions + partition) * head_size +
                                          i % head_size] = from_float<scalar_t>(0.0f);
      } else {
        static_cast<scalar_t*>(p.out)[row * head_size + i % head_size] = from_float<scalar_t>(0.0f);
      }
    }
    if (v2 && tid < heads) {
      p.max_logits[(out_row0 + tid) * p.num_partitions + partition] = -INFINITY;
      p.exp_sums[(out_row0 + tid) * p.num_partitions + partition] = 0.0f;
    }
    return;
  }

  extern __shared__ float4 shared_words[];
  float* q_smem = reinterpret_cast<float*>(shared_words);  // [heads_per_cta][head_size]
  float* logits = q_smem + launch.heads_per_cta * head_size;  // [heads_per_cta][capacity]
  float* warp_maxes = logits + launch.heads_per_cta * launch.logit_capacity;  // [warps][heads]
  float* warp_sums = warp_maxes + kWarps * launch.heads_per_cta;
  float* split_partials = warp_sums + kWarps * launch.heads_per_cta;  // [splits - 1][heads][D]
  // The value pass splits the tokens over `splits` thread sets when head_size < kAttentionThreads.
  const int splits = head_size >= kAttentionThreads ? 1 : kAttentionThreads / head_size;
  // The physical block ids of this CTA's blocks: the key pass reads them from the block table and
  // writes them here, so the value pass finds them without a dependent global load.
  int* block_ids = reinterpret_cast<int*>(split_partials +
                                          (splits - 1) * launch.heads_per_cta * head_size);

  const scalar_t* query = static_cast<const scalar_t*>(p.query) + seq * p.query_seq_stride;
  for (int i = tid; i < heads * head_size; i += kAttentionThreads) {
    q_smem[i] = to_float(query[(first_head + i / head_size) * p.query_head_stride + i % head_size]);
  }
  __syncthreads();

  const int block_begin = token_begin / block_size;
  const int block_end = (token_end + block_size - 1) / block_size;
  const int32_t* block_table = p.block_tables + seq * p.block_table_stride;
  const float k_scale = Traits::kFp8 ? *p.k_scale : 1.0f;
  const float v_scale = Traits::kFp8 ? *p.v_scale : 1.0f;
  const float logit_scale = p.scale * k_scale;  // the fp8 key scale factors out of the dot

  // ---- logits -------------------------------------------------------------------------------
  const int threads_per_token = kWarpSize / block_size;
  const int token_in_block = lane % block_size;
  const int lane_chunk = lane / block_size;
  const int num_chunks = head_size / kX;
  const cache_t* key_head =
      static_cast<const cache_t*>(p.key_cache) + kv_head * p.key_head_stride;
  float local_max[kMaxHeadsPerCta];
#pragma unroll
  for (int g = 0; g < kMaxHeadsPerCta; ++g) local_max[g] = -INFINITY;

  // The next block id is loaded one iteration ahead, off the critical path of the key loads.
  int64_t next_physical_block =
      block_begin + warp < block_end ? block_table[block_begin + warp] : 0;
  for (int block = block_begin + warp; block < block_end; block += kWarps) {
    const int64_t physical_block = next_physical_block;
    if (block + kWarps < block_end) next_physical_block = block_table[block + kWarps];
    if (lane == 0) block_ids[block - block_begin] = static_cast<int>(physical_block);
    const cache_t* key_token =
        key_head + physical_block * p.key_block_stride + token_in_block * kX;
    float dot[kMaxHeadsPerCta];
#pragma unroll
    for (int g = 0; g < kMaxHeadsPerCta; ++g) dot[g] = 0.0f;

    for (int c0 = lane_chunk; c0 < num_chunks; c0 += kKeyChunksInFlight * threads_per_token) {
      uint4 raw[kKeyChunksInFlight];
#pragma unroll
      for (int i = 0; i < kKeyChunksInFlight; ++i) {
        const int c = c0 + i * threads_per_token;
        if (c < num_chunks) {
          raw[i] = load_raw(reinterpret_cast<const uint4*>(key_token + c * block_size * kX));
        }
      }
#pragma unroll
      for (int i = 0; i < kKeyChunksInFlight; ++i) {
        const int c = c0 + i * threads_per_token;
        if (c >= num_chunks) break;
        float k[kX];
        Traits::key(raw[i], k);
#pragma unroll
        for (int g = 0; g < kMaxHeadsPerCta; ++g) {
          if (g < heads) {
            const float4* q4 = reinterpret_cast<const float4*>(q_smem + g * head_size + c * kX);
#pragma unroll
            for (int e = 0; e < kX / 4; ++e) {
              const float4 q = q4[e];
              dot[g] += q.x * k[4 * e] + q.y * k[4 * e + 1] + q.z * k[4 * e + 2] +
                        q.w * k[4 * e + 3];
            }
          }
        }
      }
    }
    // Lanes of one token differ by multiples of block_size.
#pragma unroll
    for (int g = 0; g < kMaxHeadsPerCta; ++g) {
      for (int offset = block_size; offset < kWarpSize; offset *= 2) {
        dot[g] += __shfl_xor_sync(0xffffffffu, dot[g], offset);
      }
    }
    if (lane_chunk == 0) {
      const int pos = block * block_size + token_in_block;
      const bool attended = pos >= token_begin && pos < token_end;
      const int slot = pos - block_begin * block_size;
#pragma unroll
      for (int g = 0; g < kMaxHeadsPerCta; ++g) {
        if (g < heads) {
          float s = -INFINITY;
          if (attended) {
            s = logit_scale * dot[g];
            if (p.logits_soft_cap > 0.0f) s = p.logits_soft_cap * tanhf(s / p.logits_soft_cap);
            if (p.alibi_slopes != nullptr) {
              s += p.alibi_slopes[first_head + g] * static_cast<float>(pos - len + 1);
            }
            local_max[g] = fmaxf(local_max[g], s);
          }
          logits[g * launch.logit_capacity + slot] = s;
        }
      }
    }
  }

  // ---- softmax (fp32): max, exp, sum --------------------------------------------------------
#pragma unroll
  for (int g = 0; g < kMaxHeadsPerCta; ++g) {
    const float m = warp_max(local_max[g]);
    if (lane == 0 && g < heads) warp_maxes[warp * launch.heads_per_cta + g] = m;
  }
  __syncthreads();
  float max_logit[kMaxHeadsPerCta];
  float exp_sum[kMaxHeadsPerCta];
#pragma unroll
  for (int g = 0; g < kMaxHeadsPerCta; ++g) {
    max_logit[g] = -INFINITY;
    if (g < heads) {
      for (int w = 0; w < kWarps; ++w) {
        max_logit[g] = fmaxf(max_logit[g], warp_maxes[w * launch.heads_per_cta + g]);
      }
    }
    exp_sum[g] = 0.0f;
  }
  const int num_slots = (block_end - block_begin) * block_size;
  for (int i = tid; i < num_slots; i += kAttentionThreads) {
#pragma unroll
    for (int g = 0; g < kMaxHeadsPerCta; ++g) {
      if (g < heads) {
        float* slot = logits + g * launch.logit_capacity + i;
        // An unattended slot holds -inf: exp gives exactly 0.
        const float e = *slot == -INFINITY ? 0.0f : expf(*slot - max_logit[g]);
        *slot = e;
        exp_sum[g] += e;
      }
    }
  }
#pragma unroll
  for (int g = 0; g < kMaxHeadsPerCta; ++g) {
    const float s = warp_sum(exp_sum[g]);
    if (lane == 0 && g < heads) warp_sums[warp * launch.heads_per_cta + g] = s;
  }
  __syncthreads();  // also publishes the exponentials to every thread
#pragma unroll
  for (int g = 0; g < kMaxHeadsPerCta; ++g) {
    exp_sum[g] = 0.0f;
    if (g < heads) {
      for (int w = 0; w < kWarps; ++w) exp_sum[g] += warp_sums[w * launch.heads_per_cta + g];
    }
  }

  // ---- weighted value sum --------------------------------------------------------------------
  const int split = head_size >= kAttentionThreads ? 0 : tid / head_size;
  const int row0 = head_size >= kAttentionThreads ? tid : tid % head_size;
  const bool active = split < splits;
  const cache_t* value_head =
      static_cast<const cache_t*>(p.value_cache) + kv_head * p.value_head_stride;
  float acc[kRowsPerThread][kMaxHeadsPerCta];
#pragma unroll
  for (int r = 0; r < kRowsPerThread; ++r) {
#pragma unroll
    for (int g = 0; g < kMaxHeadsPerCta; ++g) acc[r][g] = 0.0f;
  }

  // Token slots are walked in tiles of kValueVecsInFlight vectors per row, so each thread has that
  // many loads in flight whatever the block size (a tile spans one or more whole blocks).
  constexpr int kTileSlots = kValueVecsInFlight * kVec;
  const int num_tiles = (num_slots + kTileSlots - 1) / kTileSlots;
  const int first_slot_pos = block_begin * block_size;  // position of slot 0
  if (active) {
    for (int tile = split; tile < num_tiles; tile += splits) {
      const int tile_begin = tile * kTileSlots;
      value_raw_t raw[kRowsPerThread][kValueVecsInFlight];
#pragma unroll
      for (int j = 0; j < kValueVecsInFlight; ++j) {
        const int slot = tile_begin + j * kVec;
        if (slot < num_slots) {
          // kVec divides block_size: a vector never straddles two blocks.
          const int64_t physical_block = block_ids[slot / block_size];
          const cache_t* vector =
              value_head + physical_block * p.value_block_stride + slot % block_size;
#pragma unroll
          for (int r = 0; r < kRowsPerThread; ++r) {
            const int row = row0 + r * kAttentionThreads;
            if (row < head_size) {
              raw[r][j] =
                  load_raw(reinterpret_cast<const value_raw_t*>(vector + row * block_size));
            }
          }
        }
      }
#pragma unroll
      for (int j = 0; j < kValueVecsInFlight; ++j) {
        const int slot = tile_begin + j * kVec;
        if (slot >= num_slots) break;
        const int first_pos = first_slot_pos + slot;
        const bool partial = first_pos < token_begin || first_pos + kVec > token_end;
        float v[kRowsPerThread][kVec];
#pragma unroll
        for (int r = 0; r < kRowsPerThread; ++r) {
          if (row0 + r * kAttentionThreads >= head_size) {
#pragma unroll
            for (int e = 0; e < kVec; ++e) v[r][e] = 0.0f;
          } else {
            Traits::value(raw[r][j], v[r]);
            if (partial) {
              // Slots outside [token_begin, token_end) may hold anything, NaN included; their
              // weight is 0, and 0 * NaN would still be NaN.
#pragma unroll
              for (int e = 0; e < kVec; ++e) {
                const int pos = first_pos + e;
                if (pos < token_begin || pos >= token_end) v[r][e] = 0.0f;
              }
            }
          }
        }
#pragma unroll
        for (int g = 0; g < kMaxHeadsPerCta; ++g) {
          if (g < heads) {
            const float4* w4 =
                reinterpret_cast<const float4*>(logits + g * launch.logit_capacity + slot);
#pragma unroll
            for (int e = 0; e < kVec / 4; ++e) {
              const float4 w = w4[e];
#pragma unroll
              for (int r = 0; r < kRowsPerThread; ++r) {
                acc[r][g] += w.x * v[r][4 * e] + w.y * v[r][4 * e + 1] + w.z * v[r][4 * e + 2] +
                             w.w * v[r][4 * e + 3];
              }
            }
          }
        }
      }
    }
  }

  if (splits > 1) {  // head_size < kAttentionThreads: one row per thread, several token splits
    if (active && split > 0) {
#pragma unroll
      for (int g = 0; g < kMaxHeadsPerCta; ++g) {
        if (g < heads) {
          split_partials[((split - 1) * launch.heads_per_cta + g) * head_size + row0] = acc[0][g];
        }
      }
    }
    __syncthreads();
    if (split == 0) {
      for (int s = 1; s < splits; ++s) {
#pragma unroll
        for (int g = 0; g < kMaxHeadsPerCta; ++g) {
          if (g < heads) {
            acc[0][g] += split_partials[((s - 1) * launch.heads_per_cta + g) * head_size + row0];
          }
        }
      }
    }
  }

  if (active && split == 0) {
#pragma unroll
    for (int g = 0; g < kMaxHeadsPerCta; ++g) {
      if (g < heads) {
        const float out_scale = v_scale / exp_sum[g];
        const int64_t row = out_row0 + g;
#pragma unroll
        for (int r = 0; r < kRowsPerThread; ++r) {
          const int d = row0 + r * kAttentionThreads;
          if (d < head_size) {
            const scalar_t value = from_float<scalar_t>(acc[r][g] * out_scale);
            if (v2) {
              static_cast<scalar_t*>(p.tmp_out)[(row * p.num_partitions + partition) * head_size +
                                                d] = value;
            } else {
              static_cast<scalar_t*>(p.out)[row * head_size + d] = value;
            }
          }
        }
      }
    }
  }
  if (v2) {
#pragma unroll
    for (int g = 0; g < kMaxHeadsPerCta; ++g) {
      if (g < heads && tid == g) {
        p.max_logits[(out_row0 + g) * p.num_partitions + partition] = max_logit[g];
        p.exp_sums[(out_row0 + g) * p.num_partitions + partition] = exp_sum[g];
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// v2 reduce: out = sum_j w_j * tmp_out_j / sum_j w_j with w_j = exp_sum_j * exp(max_j - max).

__device__ __forceinline__ float block_reduce(float v, bool is_max, float* scratch) {
  v = is_max ? warp_max(v) : warp_sum(v);
  const int warp = threadIdx.x / kWarpSize;
  if (threadIdx.x % kWarpSize == 0) scratch[warp] = v;
  __syncthreads();
  float total = scratch[0];
  for (int w = 1; w < kReduceThreads / kWarpSize; ++w) {
    total = is_max ? fmaxf(total, scratch[w]) : total + scratch[w];
  }
  __syncthreads();  // scratch may be reused by the next reduction
  return total;
}

template <typename scalar_t>
__global__ void __launch_bounds__(kReduceThreads)
    paged_attention_reduce_kernel(const AttentionParams p) {
  __shared__ float scratch[kReduceThreads / kWarpSize];
  const int64_t row = static_cast<int64_t>(blockIdx.x) * p.num_heads + blockIdx.y;
  const int num_partitions = p.num_partitions;
  const float* max_logits = p.max_logits + row * num_partitions;
  const float* exp_sums = p.exp_sums + row * num_partitions;

  float local_max = -INFINITY;
  for (int j = threadIdx.x; j < num_partitions; j += kReduceThreads) {
    local_max = fmaxf(local_max, max_logits[j]);
  }
  float global_max = block_reduce(local_max, true, scratch);
  if (global_max == -INFINITY) global_max = 0.0f;  // nothing attended anywhere: all weights 0

  float local_total = 0.0f;
  for (int j = threadIdx.x; j < num_partitions; j += kReduceThreads) {
    local_total += exp_sums[j] * expf(max_logits[j] - global_max);
  }
  const float total = block_reduce(local_total, false, scratch);

  const scalar_t* partials =
      static_cast<const scalar_t*>(p.tmp_out) + row * num_partitions * p.head_size;
  scalar_t* out = static_cast<scalar_t*>(p.out) + row * p.head_size;
  for (int d = threadIdx.x; d < p.head_size; d += kReduceThreads) {
    float acc = 0.0f;
    for (int j = 0; j < num_partitions; ++j) {
      const float w = exp_sums[j] * expf(max_logits[j] - global_max);
      acc += w * to_float(partials[static_cast<int64_t>(j) * p.head_size + d]);
    }
    out[d] = from_float<scalar_t>(total > 0.0f ? acc / total : 0.0f);
  }
}

// ---------------------------------------------------------------------------------------------
// Launch

template <typename scalar_t, CacheDtype kCache, int kRowsPerThread>
cudaError_t launch_paged_attention(const AttentionParams& p, bool v2, cudaStream_t stream) {
  if (p.num_seqs == 0 || p.num_heads == 0) return cudaSuccess;
  const int group = p.num_heads / p.num_kv_heads;
  AttentionLaunch launch{};
  launch.partition_size = v2 ? kV2PartitionSize : 0;
  launch.logit_capacity =
      static_cast<int>(attention_logit_capacity(p.max_seq_len, p.block_size, v2));
  launch.heads_per_cta = heads_per_cta(group);
  launch.head_chunks = (group + launch.heads_per_cta - 1) / launch.heads_per_cta;
  const int64_t shared_bytes = attention_shared_memory_bytes(
      launch.heads_per_cta, p.head_size, launch.logit_capacity, p.block_size);

  const auto kernel = paged_attention_kernel<scalar_t, kCache, kRowsPerThread>;
  if (shared_bytes > 48 * 1024) {
    // Always raise the limit to the device maximum (the caller checked shared_bytes against it):
    // host threads launching with different sizes then cannot lower it under each other.
    int device = 0;
    int max_bytes = 0;
    cudaError_t status = cudaGetDevice(&device);
    if (status == cudaSuccess) {
      status = cudaDeviceGetAttribute(&max_bytes, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
    }
    if (status == cudaSuccess) {
      status = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, max_bytes);
    }
    if (status != cudaSuccess) return status;
  }
  const dim3 grid(p.num_seqs, p.num_kv_heads * launch.head_chunks, v2 ? p.num_partitions : 1);
  kernel<<<grid, kAttentionThreads, shared_bytes, stream>>>(p, launch);
  cudaError_t status = cudaGetLastError();
  if (status != cudaSuccess || !v2) return status;
  paged_attention_reduce_kernel<scalar_t>
      <<<dim3(p.num_seqs, p.num_heads), kReduceThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

template <typename scalar_t, CacheDtype kCache>
cudaError_t launch_paged_attention(const AttentionParams& p, bool v2, cudaStream_t stream) {
  static_assert(kMaxHeadSize <= 2 * kAttentionThreads, "a thread owns at most two value rows");
  return p.head_size <= kAttentionThreads
             ? launch_paged_attention<scalar_t, kCache, 1>(p, v2, stream)
             : launch_paged_attention<scalar_t, kCache, 2>(p, v2, stream);
}

template <typename scalar_t>
cudaError_t launch_paged_attention(const AttentionParams& p, bool v2, cudaStream_t stream) {
  switch (p.cache) {
    case CacheDtype::kAuto:
      return launch_paged_attention<scalar_t, CacheDtype::kAuto>(p, v2, stream);
    case CacheDtype::kFp8E4M3:
      return launch_paged_attention<scalar_t, CacheDtype::kFp8E4M3>(p, v2, stream);
    case CacheDtype::kFp8E5M2:
      return launch_paged_attention<scalar_t, CacheDtype::kFp8E5M2>(p, v2, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace paged_attention::cuda
