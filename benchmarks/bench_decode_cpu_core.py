"""What one CPU core can do for decode attention: compute rate vs. memory rate.

bench_decode.py reports our kernels against the machine's streaming-read limit. This script
splits that comparison per core, on one thread:

* ``compute``: the v1 kernel over a cache small enough to stay in the core's L2 (one sequence,
  one KV head serving 4 query heads, head size 128, block size 16, 1024 tokens, scattered
  blocks), repeated many times. Bytes of K and V per step over the time per step, after
  subtracting the time of the same call over a 1-token sequence (the fixed cost of a call).
* ``memory``: the read limit of one thread, the fastest of ``paged_attention.cli.machine``'s
  streaming readers (``STREAM_READERS``) over a buffer four times the last-level cache and at
  least 1 GiB (``--memory-buffer-mib``), at the start and at the end of the run: the rate one
  core streams from memory.
* ``from_memory``: the v1 kernel on one thread over bench_decode.py's main row (32 x 4096, 32/8
  heads, head size 128, block size 16, scattered blocks; 1 GiB in fp32, 512 MiB in bf16): the
  rate one core reaches when it must read everything from memory, and its fraction of the read
  limit for as many bytes (the faster of the memory limit and the readers over a buffer of the
  row's size, where part of it may stay cached). A kernel faster than the limit is a measurement
  error: the limit is measured again, and if the kernel still beats it the run fails (status 1,
  ``measurement_errors`` in the JSON) rather than report more than 100%.

When ``compute`` is not well above ``memory``, the kernel can only approach the memory limit if
its arithmetic overlaps the loads; ``from_memory`` against ``memory`` shows how far it does. The
JSON records the CPU model and features (bench_decode.py's machine facts). Prints a table and
writes JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from bench_decode import (
    LIMIT_RETRIES,
    LIMIT_RETRY_BUDGET_S,
    LIMIT_RETRY_REPS_FACTOR,
    build_case,
    describe_limit,
    kv_bytes,
    machine_info,
    method_ours,
)

import paged_attention.ops.bindings  # noqa: F401  (registers torch.ops.paged_attention)
from paged_attention.cli.machine import (
    ReadLimit,
    describe_machine,
    measure_read_limit,
    memory_buffer_bytes,
)

LIMIT_REPS = 5

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


def from_memory_rate(dtype: torch.dtype, memory: ReadLimit, batch=32, context=4096) -> dict:
    """v1 on one thread over bench_decode.py's main row, against the read limit of as many bytes;
    a kernel faster than the limit is recorded as a measurement error (``limit_error``)."""
    case = build_case(torch.device("cpu"), dtype, batch, context)
    step = method_ours(case, 1)
    seconds = per_call_seconds(step, 1, rounds=5)
    nbytes = kv_bytes(batch, context, dtype)
    same_size = measure_read_limit(nbytes, reps=LIMIT_REPS)
    for _ in range(LIMIT_RETRIES):
        if same_size.faster(memory).seconds(nbytes) <= seconds:
            break
        retry = measure_read_limit(nbytes, reps=LIMIT_REPS * LIMIT_RETRY_REPS_FACTOR,
                                   budget_s=LIMIT_RETRY_BUDGET_S)  # fmt: skip
        same_size = same_size.faster(retry)
    row = dict(dtype=str(dtype).removeprefix("torch."), batch=batch, context=context,
               kv_bytes=nbytes, time_s=seconds, bytes_per_s=nbytes / seconds,
               same_size_limit=same_size.as_dict())  # fmt: skip
    return row


def apply_limit(rows: list[dict], memory: ReadLimit) -> list[str]:
    """Each row's ``limit_bytes_per_s`` (the faster of its same-size read and ``memory``) and
    ``fraction_of_limit``; a row faster than its limit is a measurement error, named in the
    returned list, its fraction left out."""
    errors = []
    for row in rows:
        limit = ReadLimit(**row["same_size_limit"]).faster(memory)
        row["limit_bytes_per_s"], row["limit_reader"] = limit.bytes_per_s, limit.reader
        fraction = limit.seconds(row["kv_bytes"]) / row["time_s"]
        if fraction > 1.0:
            row.pop("fraction_of_limit", None)
            row["limit_error"] = "faster than the read limit: a measurement error"
            errors.append(
                f"v1 {row['dtype']} {row['batch']} x {row['context']}: "
                f"{row['bytes_per_s'] / 1e9:.2f} GB/s, above the read limit "
                f"{limit.bytes_per_s / 1e9:.2f} GB/s ({limit.reader})"
            )
        else:
            row["fraction_of_limit"] = fraction
    return errors


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default="results/bench_decode_cpu_core.json")
    parser.add_argument(
        "--memory-buffer-mib",
        type=int,
        default=None,
        help="the memory read limit's buffer (default: 4x the last-level cache, at least 1 GiB)",
    )
    args = parser.parse_args()
    if args.memory_buffer_mib is not None and args.memory_buffer_mib < 1:
        parser.error(f"--memory-buffer-mib must be at least 1, got {args.memory_buffer_mib}")
    torch.set_num_threads(1)
    memory_bytes = (args.memory_buffer_mib or 0) << 20 or memory_buffer_bytes("cpu")
    dtypes = (torch.float32, torch.bfloat16)
    memory = measure_read_limit(memory_bytes, reps=LIMIT_REPS)
    result = dict(
        machine=machine_info(torch.device("cpu")),
        compute=[compute_rate(dtype) for dtype in dtypes],
        from_memory=[from_memory_rate(dtype, memory) for dtype in dtypes],
        cpu_capability=torch.backends.cpu.get_cpu_capability(),
    )
    memory = memory.faster(measure_read_limit(memory_bytes, reps=LIMIT_REPS))
    result["memory"] = dict(memory.as_dict(), bytes=memory.buffer_bytes)
    result["measurement_errors"] = apply_limit(result["from_memory"], memory)
    print_report(result, memory)
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2))
    print(f"wrote {path}")
    if result["measurement_errors"]:
        for error in result["measurement_errors"]:
            print(f"measurement error: {error}", file=sys.stderr)
        raise SystemExit(
            "the kernel read faster than the read limit: a measurement error (the machine was "
            f"busy while the limit was measured); not publishable, run again ({path} keeps it)"
        )


def print_report(result: dict, memory: ReadLimit) -> None:
    print(describe_machine(result["machine"]))
    print(f"one core, memory read limit: {describe_limit(memory)}")
    for row in result["compute"]:
        print(
            f"one core, compute: v1 {row['dtype']:>8} in L2 "
            f"{row['bytes_per_s'] / 1e9:6.1f} GB/s ({row['time_s'] * 1e6:.1f} us per step)"
        )
    for row in result["from_memory"]:
        share = row.get("fraction_of_limit")
        share = f"{100 * share:.1f}% of the read limit" if share else "ABOVE the read limit"
        print(
            f"one core, from memory: v1 {row['dtype']:>8} {row['batch']} x {row['context']} "
            f"{row['bytes_per_s'] / 1e9:6.1f} GB/s ({row['time_s'] * 1e3:.1f} ms per step, "
            f"{share})"
        )


if __name__ == "__main__":
    main()
