"""What one CPU core can do for decode attention: compute rate vs. memory rate.

bench_decode.py reports our kernels against the machine's streaming-read limit. This script
splits that comparison per core, on one thread:

* ``compute``: the v1 kernel over a cache small enough to stay in the core's L2 (one sequence,
  one KV head serving 4 query heads, head size 128, block size 16, 1024 tokens, scattered
  blocks), repeated many times. Bytes of K and V per step over the time per step, after
  subtracting the time of the same call over a 1-token sequence (the fixed cost of a call).
* ``memory``: ``sum()`` over a float32 buffer of 512 MiB on one thread, the rate one core
  streams from memory.
* ``from_memory``: the v1 kernel on one thread over bench_decode.py's main row (32 x 4096, 32/8
  heads, head size 128, block size 16, scattered blocks; 1 GiB in fp32, 512 MiB in bf16): the
  rate one core reaches when it must read everything from memory.

When ``compute`` is not well above ``memory``, the kernel can only approach the memory limit if
its arithmetic overlaps the loads; ``from_memory`` against ``memory`` shows how far it does. The
JSON records the CPU model and features (bench_decode.py's machine facts). Prints a table and
writes JSON.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from bench_decode import build_case, kv_bytes, machine_info, method_ours

import paged_attention  # noqa: F401  (registers torch.ops.paged_attention)
from paged_attention.machine import describe_machine

HEAD_SIZE = 128
BLOCK_SIZE = 16
QUERY_HEADS = 4
CONTEXT = 1024


def per_call_seconds(fn, calls: int, rounds: int = 15) -> float:
    """Best average time of ``fn`` over ``rounds`` rounds of ``calls`` calls."""
    for _ in range(calls // 10 + 1):
        fn()
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls)
    return best


def compute_rate(dtype: torch.dtype) -> dict:
    generator = torch.Generator().manual_seed(0)
    x = 16 // torch.empty((), dtype=dtype).element_size()
    num_blocks = CONTEXT // BLOCK_SIZE
    key_cache = torch.randn(num_blocks, 1, HEAD_SIZE // x, BLOCK_SIZE, x, generator=generator)
    value_cache = torch.randn(num_blocks, 1, HEAD_SIZE, BLOCK_SIZE, generator=generator)
    key_cache, value_cache = key_cache.to(dtype), value_cache.to(dtype)
    block_tables = torch.randperm(num_blocks, generator=generator).to(torch.int32)[None]
    query = torch.randn(1, QUERY_HEADS, HEAD_SIZE, generator=generator).to(dtype)
    out = torch.empty_like(query)
    unit_scale = torch.ones(1)

    def step(seq_lens):
        torch.ops.paged_attention.paged_attention_v1(
            out, query, key_cache, value_cache, 1, HEAD_SIZE**-0.5, block_tables, seq_lens,
            BLOCK_SIZE, CONTEXT, None, "auto", unit_scale, unit_scale, 0, 0.0,
        )  # fmt: skip

    full = torch.tensor([CONTEXT], dtype=torch.int32)
    one_token = torch.tensor([1], dtype=torch.int32)
    seconds = per_call_seconds(lambda: step(full), 200) - per_call_seconds(
        lambda: step(one_token), 200
    )
    nbytes = 2 * key_cache.numel() * key_cache.element_size()
    return dict(dtype=str(dtype).removeprefix("torch."), kv_bytes=nbytes, time_s=seconds,
                bytes_per_s=nbytes / seconds)  # fmt: skip


def memory_rate(nbytes: int = 512 << 20) -> dict:
    buffer = torch.ones(nbytes // 4)
    seconds = per_call_seconds(buffer.sum, 1, rounds=7)
    return dict(bytes=nbytes, time_s=seconds, bytes_per_s=nbytes / seconds)


def from_memory_rate(dtype: torch.dtype, batch: int = 32, context: int = 4096) -> dict:
    case = build_case(torch.device("cpu"), dtype, batch, context)
    step = method_ours(case, 1)
    seconds = per_call_seconds(step, 1, rounds=5)
    nbytes = kv_bytes(batch, context, dtype)
    return dict(dtype=str(dtype).removeprefix("torch."), batch=batch, context=context,
                kv_bytes=nbytes, time_s=seconds, bytes_per_s=nbytes / seconds)  # fmt: skip


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default="results/bench_decode_cpu_core.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dtypes = (torch.float32, torch.bfloat16)
    result = dict(
        machine=machine_info(torch.device("cpu")),
        memory=memory_rate(),
        compute=[compute_rate(dtype) for dtype in dtypes],
        from_memory=[from_memory_rate(dtype) for dtype in dtypes],
        cpu_capability=torch.backends.cpu.get_cpu_capability(),
    )
    print(describe_machine(result["machine"]))
    print(f"one core, memory: sum() of 512 MiB  {result['memory']['bytes_per_s'] / 1e9:6.1f} GB/s")
    for row in result["compute"]:
        print(
            f"one core, compute: v1 {row['dtype']:>8} in L2 "
            f"{row['bytes_per_s'] / 1e9:6.1f} GB/s ({row['time_s'] * 1e6:.1f} us per step)"
        )
    for row in result["from_memory"]:
        print(
            f"one core, from memory: v1 {row['dtype']:>8} {row['batch']} x {row['context']} "
            f"{row['bytes_per_s'] / 1e9:6.1f} GB/s ({row['time_s'] * 1e3:.1f} ms per step)"
        )
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
