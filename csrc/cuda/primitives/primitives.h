// The warp-level primitives the attention kernels are written against (namespace
// paged_attention::prim), with two implementations of the same names:
//
//   device.cuh    inline PTX, compiled by nvcc (__CUDACC__ is defined);
//   emulated.h    a host emulation for CI machines without a GPU: every thread of a CTA runs the
//                 kernel body as a fiber, with a barrier at every collective operation.
//
// A kernel body is a function written once against this interface and marked PA_DEVICE; nvcc
// wraps it in a __global__ kernel, the emulator runs it on each fiber.
//
// The interface (1-D CTAs of whole warps; every warp collective is executed by all 32 lanes):
//   thread_index(), block_index(), grid_size()        threadIdx.x, blockIdx, gridDim
//   shared<T>(offset)                                 a T* into dynamic shared memory; shared
//                                                     memory is addressed by byte offsets from
//                                                     its start (uint32_t), as PTX addresses it
//   syncthreads(), syncwarp()                         barriers (memory ordering included)
//   shfl_xor(v, mask), shfl(v, src_lane), any(p)      warp shuffles and vote
//   cp_async_16(dst, src), cp_async_8(dst, src)       asynchronous global -> shared copies
//   cp_async_commit(), cp_async_wait<N>()             close a group; wait until at most N groups
//                                                     issued by this thread are in flight
//   ldmatrix_x4(r, row_offset)                        ldmatrix.sync.aligned.m8n8.x4.shared.b16:
//                                                     lane l gives the row address of row l % 8
//                                                     of matrix l / 8 and receives, in r[j],
//                                                     row l / 4, columns 2 (l % 4) and +1 of
//                                                     matrix j
//   mma_16816<T>(d, a, b0, b1)                        mma.sync.aligned.m16n8k16.row.col.f32.T.T
//                                                     .f32 with T = f16 or bf16, d += a * b in
//                                                     the PTX ISA's fragment layout
//   load(p), store(p, v)                              global memory (loads read-only)
//   element conversions and exp2 / tanh               see each implementation
#pragma once

#include <cstdint>

namespace paged_attention::prim {

// The 16-bit operand type of an MMA.
enum class MmaType { kF16, kBF16 };

struct Index3 {
  int x, y, z;
};

}  // namespace paged_attention::prim

#if defined(__CUDACC__)
#include "cuda/primitives/device.cuh"
#else
#include "cuda/primitives/emulated.h"
#endif
