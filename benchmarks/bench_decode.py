"""Decode attention over a paged KV cache: our kernels against plain PyTorch, side by side.

One decode step (one query token per sequence) for every (dtype, batch, context) of the grid,
32 query heads, 8 KV heads, head size 128, block size 16 (``--heads``, ``--kv-heads``,
``--head-size`` and ``--block-size`` change them), every sequence as long as the context, with
scattered block tables (a random permutation of the block pool). Methods, all on the same cache
contents:

* ``v1``, ``v2``: ``paged_attention.paged_attention(..., version=1|2)``.
* ``gather+sdpa``: what a plain PyTorch user writes: gather the blocks through the block table
  into contiguous K/V, then ``scaled_dot_product_attention(..., enable_gqa=True)``.
* ``flex``: ``torch.compile``d FlexAttention over a paged cache in FlexAttention's own token-major
  layout ``[1, kv_heads, blocks * block_size, head_size]`` (the layout of PyTorch's
  ``torch.nn.attention.experimental._paged_attention``), holding the same values, with a block
  mask whose KV indices are the physical pages of each sequence and a mask_mod that maps
  physical positions back to logical ones. Where it cannot run, the reason is reported instead
  of a number.
* ``limit``: the read limit of the row, the fastest streaming read of as many bytes with all of
  torch's threads (the threads the kernels use): every reader of
  ``paged_attention.cli.machine.STREAM_READERS`` (a float32 ``sum()``, an int32 ``amax()``, a
  float32 matrix-vector product) over a buffer as large as the step's K and V, before and after
  the methods, and over the memory buffer (``--memory-buffer-mib``, default four times the
  last-level cache and at least 1 GiB) at the start and the end of the run; the fastest of all.
  A row whose K and V fit in the cache is bounded by the cached read, a larger one by memory.

No method can read the row's bytes faster than the fastest reader reads as many, so a method at
more than 100% of the limit is a measurement error (a reader slowed down by other work on a
shared machine): the limit of that row is measured again, and a method still above it is
reported under ``measurement_errors`` in the JSON, its percentage left out, and the run exits
with status 1 (publish.py refuses such a file).

GPU-only peers are named with ``--cuda-methods`` (timed only with ``--device cuda``; on the CPU
the option is recorded in the JSON's notes and nothing runs):

* ``flashinfer``: FlashInfer's ``BatchDecodeWithPagedKVCacheWrapper`` with
  ``use_tensor_cores=True`` (its prefill kernel with the GQA group in one 16-row query tile), on
  the same cache values converted to its HND pages; planned once, outside the timed loop.
* ``flashinfer-cc``: the same wrapper on CUDA cores (``use_tensor_cores=False``).
  Both check their output against ``gather+sdpa`` first; where FlashInfer cannot run (not
  installed, or no prebuilt module for the dtype and head size), the reason is reported.

With ``--huge-pages`` the cache and the limit's buffer are advised to use 2 MiB pages, as
:class:`paged_attention.PagedKVCache` allocates CPU caches (plain ``torch`` tensors, the default
here, get 4 KiB pages).

Every time is the best of several repetitions (the CPU machine this was written on is shared; on
CUDA each repetition is 10 back-to-back calls, so launch overhead overlaps the previous call).
Effective bandwidth = bytes of K and V the step must read / time.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch

import paged_attention.ops.bindings  # registers torch.ops.paged_attention
from paged_attention.cli import machine
from paged_attention.cli.machine import (
    CUDA_CALLS_PER_SAMPLE,
    ReadLimit,
    describe_machine,
    last_level_cache_bytes,
    measure_read_limit,
    memory_buffer_bytes,
)
from paged_attention.cli.machine import best_call_seconds as best_time
from paged_attention.kv.cache import advise_huge_pages
from paged_attention.testing import make_paged_kv


@dataclasses.dataclass(frozen=True)
class Shape:
    """The attention shape of every row: query heads, KV heads, head size, block size."""

    num_heads: int = 32
    num_kv_heads: int = 8
    head_size: int = 128
    block_size: int = 16


CUDA_PEAK_BYTES_PER_S = {"H200": 4.8e12}
METHODS = ("v1", "v2", "gather+sdpa", "flex")
CUDA_METHODS = ("flashinfer", "flashinfer-cc")
# FlashInfer's workspace (its README's size).
FLASHINFER_WORKSPACE_BYTES = 128 << 20
# FlexAttention's GPU decode kernel tiles the query rows of a KV head by at least 16 and needs the
# block mask's query block to be a multiple of that tile (torch/_inductor/kernel/flex/
# flex_decoding.py): with a 1-row query block it found no valid configuration on an H200. One
# 128-row block holds the single query row.
FLEX_QUERY_BLOCK = 128


# --------------------------------------------------------------------------------------------
# Timing


# --------------------------------------------------------------------------------------------
# The paged cache


def allocate(shape, dtype, device, huge_pages: bool) -> torch.Tensor:
    """An uninitialised tensor; with ``huge_pages``, advised to use 2 MiB pages (CPU, Linux) as
    PagedKVCache's caches are."""
    tensor = torch.empty(shape, dtype=dtype, device=device)
    if huge_pages:
        advise_huge_pages(tensor)
    return tensor


def build_case(device, dtype, batch, context, shape=Shape(), seed=0, huge_pages=False):
    """Random paged cache in the layout of docs/design.md (paged_attention.testing), scattered
    block tables, and a query."""
    kv = make_paged_kv(
        batch,
        context,
        shape.num_kv_heads,
        shape.head_size,
        shape.block_size,
        dtype,
        device=device,
        seed=seed,
        tokens=False,
        allocate=lambda shape_, dtype_, device_: allocate(shape_, dtype_, device_, huge_pages),
    )
    query = torch.randn(batch, shape.num_heads, shape.head_size, dtype=dtype, device=device)
    return dict(
        query=query,
        key_cache=kv.key_cache,
        value_cache=kv.value_cache,
        block_tables=kv.block_tables,
        seq_lens=kv.seq_lens,
        context=context,
        shape=shape,
    )


def kv_bytes(batch, context, dtype, shape=Shape()) -> int:
    itemsize = torch.empty((), dtype=dtype).itemsize
    return 2 * batch * context * shape.num_kv_heads * shape.head_size * itemsize


# --------------------------------------------------------------------------------------------
# Methods: each returns a zero-argument callable that runs one decode step.


def method_ours(case, version):
    out = torch.empty_like(case["query"])

    def run():
        return paged_attention.paged_attention(
            case["query"],
            case["key_cache"],
            case["value_cache"],
            case["block_tables"],
            case["seq_lens"],
            max_seq_len=case["context"],
            out=out,
            version=version,
        )

    return run


def gather_kv(case):
    """Contiguous [batch, kv_heads, context, head_size] keys and values, via the block table."""
    tables = case["block_tables"].long()
    batch, blocks = tables.shape
    shape, context = case["shape"], case["context"]
    tokens = blocks * shape.block_size
    keys = case["key_cache"][tables]  # [b, blocks, kv, D/x, B, x]
    keys = keys.permute(0, 2, 1, 4, 3, 5).reshape(batch, shape.num_kv_heads, tokens, -1)
    values = case["value_cache"][tables]  # [b, blocks, kv, D, B]
    values = values.permute(0, 2, 1, 4, 3).reshape(batch, shape.num_kv_heads, tokens, -1)
    return keys[:, :, :context], values[:, :, :context]


def method_gather_sdpa(case):
    query = case["query"].unsqueeze(2)  # [b, heads, 1, D]

    def run():
        keys, values = gather_kv(case)
        return torch.nn.functional.scaled_dot_product_attention(
            query, keys, values, enable_gqa=True
        )

    return run


def method_flex(case):
    """FlexAttention over a token-major paged cache; raises if this torch cannot run it."""
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    tables = case["block_tables"].long()
    batch, blocks = tables.shape
    device = tables.device
    num_blocks = case["value_cache"].shape[0]
    shape = case["shape"]
    kv_heads, head_size, block_size = shape.num_kv_heads, shape.head_size, shape.block_size
    # Same values, in FlexAttention's paged layout: physical position = page * block + offset.
    key_pages = case["key_cache"].permute(1, 0, 3, 2, 4).reshape(kv_heads, -1, head_size)
    value_pages = case["value_cache"].permute(1, 0, 3, 2).reshape(kv_heads, -1, head_size)
    key_pages, value_pages = key_pages.unsqueeze(0), value_pages.unsqueeze(0)
    physical_to_logical = torch.full((batch, num_blocks), -1, dtype=torch.long, device=device)
    physical_to_logical.scatter_(1, tables, torch.arange(blocks, device=device).expand(batch, -1))
    seq_lens = case["seq_lens"].long()

    def mask_mod(b, h, q_idx, physical_kv):
        page = physical_kv // block_size
        logical = physical_to_logical[b, page] * block_size + physical_kv % block_size
        return (physical_to_logical[b, page] >= 0) & (logical < seq_lens[b])

    # One column per physical page (as PagedAttention.convert_logical_block_mask does). Pages
    # holding block_size tokens are "full" (no mask_mod call); a partly filled last page is not.
    full_pages = seq_lens // block_size
    partial_pages = (seq_lens % block_size > 0).to(torch.int32)
    full_indices = torch.zeros(batch, 1, 1, num_blocks, dtype=torch.int32, device=device)
    full_indices[:, 0, 0, :blocks] = tables.to(torch.int32)
    partial_indices = torch.zeros_like(full_indices)
    partial_indices[:, 0, 0, 0] = tables.gather(1, full_pages.clamp(max=blocks - 1)[:, None])[:, 0]
    block_mask = BlockMask.from_kv_blocks(
        partial_pages.reshape(batch, 1, 1),
        partial_indices,
        full_pages.to(torch.int32).reshape(batch, 1, 1),
        full_indices,
        BLOCK_SIZE=(FLEX_QUERY_BLOCK, block_size),
        mask_mod=mask_mod,
        seq_lengths=(1, num_blocks * block_size),
    )
    query = case["query"].unsqueeze(2)
    # A fresh compilation per shape: past torch._dynamo's recompile limit, torch.compile would
    # silently fall back to the unfused eager implementation.
    torch._dynamo.reset()
    compiled = torch.compile(flex_attention, dynamic=False)

    def run():
        return compiled(query, key_pages, value_pages, block_mask=block_mask, enable_gqa=True)

    expected = method_gather_sdpa(case)().float()
    got = run().float()
    err = (got - expected).abs().max().item()
    if not err < 2e-2:
        raise RuntimeError(f"FlexAttention result differs from gather+sdpa by {err:.3g}")
    return run


def flashinfer_inputs(case):
    """The case's cache as FlashInfer's HND pages with identical values, and its CSR page table:
    (k_pages [N, kv_heads, block, D], v_pages, indptr, indices, last_page_len), all int32."""
    key_cache, value_cache = case["key_cache"], case["value_cache"]
    num_blocks, kv_heads, _, block_size, _ = key_cache.shape
    head_size = value_cache.shape[2]
    k_pages = key_cache.permute(0, 1, 3, 2, 4).reshape(num_blocks, kv_heads, block_size, head_size)
    v_pages = value_cache.permute(0, 1, 3, 2)
    seq_lens = case["seq_lens"].long()
    pages = (seq_lens + block_size - 1) // block_size  # every seq_len >= 1
    indptr = torch.cat([pages.new_zeros(1), pages.cumsum(0)]).to(torch.int32)
    tables = case["block_tables"]
    columns = torch.arange(tables.shape[1], device=tables.device)
    indices = tables[columns[None] < pages[:, None]].to(torch.int32)
    last_page_len = (seq_lens - (pages - 1) * block_size).to(torch.int32)
    return k_pages.contiguous(), v_pages.contiguous(), indptr, indices, last_page_len


def method_flashinfer(case, use_tensor_cores: bool):
    """FlashInfer's paged decode on the same cache values; raises if it cannot run here."""
    import flashinfer

    query = case["query"]
    shape = case["shape"]
    k_pages, v_pages, indptr, indices, last_page_len = flashinfer_inputs(case)
    workspace = torch.zeros(FLASHINFER_WORKSPACE_BYTES, dtype=torch.uint8, device=query.device)
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
        workspace, kv_layout="HND", use_tensor_cores=use_tensor_cores
    )
    wrapper.plan(
        indptr,
        indices,
        last_page_len,
        shape.num_heads,
        shape.num_kv_heads,
        shape.head_size,
        shape.block_size,
        pos_encoding_mode="NONE",
        q_data_type=query.dtype,
        kv_data_type=k_pages.dtype,
        sm_scale=shape.head_size**-0.5,
    )

    def run():
        return wrapper.run(query, (k_pages, v_pages))

    expected = method_gather_sdpa(case)().squeeze(2).float()
    err = (run().float() - expected).abs().max().item()
    if not err < 2e-2:
        raise RuntimeError(f"FlashInfer result differs from gather+sdpa by {err:.3g}")
    return run


def make_method(method: str, case: dict):
    if method == "v1":
        return method_ours(case, 1)
    if method == "v2":
        return method_ours(case, 2)
    if method == "gather+sdpa":
        return method_gather_sdpa(case)
    if method == "flex":
        return method_flex(case)
    if method in ("flashinfer", "flashinfer-cc"):
        return method_flashinfer(case, use_tensor_cores=method == "flashinfer")
    raise ValueError(f"unknown method {method!r} (known: {', '.join(METHODS + CUDA_METHODS)})")


def read_limit(
    nbytes: int, device: torch.device, reps: int, huge_pages=False, budget_s: float = 2.0
) -> ReadLimit:
    """The fastest streaming read of ``nbytes`` (machine.measure_read_limit), from a buffer on
    2 MiB pages with ``huge_pages``."""

    def make_buffer(size, device_):
        return allocate((size,), torch.uint8, device_, huge_pages)

    return measure_read_limit(nbytes, device, reps, allocate=make_buffer, budget_s=budget_s)


# --------------------------------------------------------------------------------------------
# Machine facts


def machine_info(device: torch.device) -> dict:
    info = machine.machine_info(device)
    info["last_level_cache_bytes"] = last_level_cache_bytes(device) or None
    return info


def cuda_peak(device: torch.device) -> float | None:
    name = torch.cuda.get_device_properties(device).name
    for key, peak in CUDA_PEAK_BYTES_PER_S.items():
        if key in name:
            return peak
    return None


# --------------------------------------------------------------------------------------------
# Main


# A row whose fastest method beats its read limit has the limit measured again this many times,
# with LIMIT_RETRY_REPS_FACTOR times the samples over up to LIMIT_RETRY_BUDGET_S seconds per
# reader (on a shared machine a longer look catches the quiet moments the method's best sample
# had), before the row is reported as a measurement error.
LIMIT_RETRIES = 3
LIMIT_RETRY_REPS_FACTOR = 5
LIMIT_RETRY_BUDGET_S = 6.0


def parse_grid(args) -> dict:
    """The run's device, dtypes, batches, contexts, methods and shape, from the arguments."""
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is available")
    cuda_methods = [m for m in args.cuda_methods.split(",") if m]
    unknown = [m for m in cuda_methods if m not in CUDA_METHODS]
    if unknown:
        raise SystemExit(f"--cuda-methods: unknown {unknown} (known: {', '.join(CUDA_METHODS)})")
    if args.memory_buffer_mib is not None and args.memory_buffer_mib < 1:
        raise SystemExit(f"--memory-buffer-mib must be at least 1, got {args.memory_buffer_mib}")
    return dict(
        device=device,
        dtypes=[getattr(torch, name) for name in args.dtypes.split(",")],
        batches=[int(b) for b in args.batches.split(",")],
        contexts=[int(c) for c in args.contexts.split(",")],
        methods=[m for m in args.methods.split(",") if m],
        cuda_methods=cuda_methods,
        shape=Shape(args.heads, args.kv_heads, args.head_size, args.block_size),
    )


def run_grid(args) -> dict:
    grid = parse_grid(args)
    device, methods, shape = grid["device"], grid["methods"], grid["shape"]
    llc = last_level_cache_bytes(device)
    result = dict(device=device.type, machine=machine_info(device), rows=[], notes=[])
    result["shape"] = dataclasses.asdict(shape)
    print(describe_machine(result["machine"]))
    print(shape)
    result["huge_pages"] = args.huge_pages
    result["notes"].append(
        "times are the best of N samples per call (CUDA: event-timed samples of "
        f"{CUDA_CALLS_PER_SAMPLE} back-to-back calls); limit = the fastest streaming read "
        "(machine.STREAM_READERS) of a buffer of the row's size and of the memory buffer"
    )
    if grid["cuda_methods"] and device.type == "cuda":
        methods += grid["cuda_methods"]
    elif grid["cuda_methods"]:
        result["notes"].append(
            f"--cuda-methods {','.join(grid['cuda_methods'])}: not run on the CPU"
        )
    peak = cuda_peak(device) if device.type == "cuda" else None
    if peak:
        result["notes"].append(f"stated peak memory bandwidth: {peak / 1e12:.1f} TB/s")
    memory_bytes = (args.memory_buffer_mib << 20) if args.memory_buffer_mib else None
    memory_bytes = memory_bytes or memory_buffer_bytes(device)
    memory = read_limit(memory_bytes, device, args.reps, args.huge_pages)
    print(f"memory read limit: {describe_limit(memory)}")
    peer_failures: dict[str, str] = {}
    for dtype in grid["dtypes"]:
        peer_failures = {m: r for m, r in peer_failures.items() if m == "flex"}
        for batch in grid["batches"]:
            for context in grid["contexts"]:
                case = build_case(device, dtype, batch, context, shape, huge_pages=args.huge_pages)
                entries = time_row(case, dtype, methods, llc, memory, peer_failures, args)
                for entry in entries:
                    if entry.get("time_s") and peak:
                        entry["fraction_of_peak"] = entry["bytes_per_s"] / peak
                print_rows(entries, header=not result["rows"])
                result["rows"] += entries
    # Measured again at the end: the machine may be shared, so keep the best.
    memory = memory.faster(read_limit(memory_bytes, device, args.reps, args.huge_pages))
    result["read_limit"] = dict(memory=memory.as_dict(), last_level_cache_bytes=llc or None)
    result["measurement_errors"] = apply_limits(result["rows"], memory)
    if "flex" in peer_failures:
        result["notes"].append(f"flex could not run: {peer_failures['flex']}")
    return result


def time_row(case, dtype, methods, llc, memory: ReadLimit, peer_failures, args) -> list[dict]:
    """Every method's entry for one (dtype, batch, context), then the row's ``limit`` entry, with
    times, bytes per second, and ratios to the read limit and to gather+sdpa."""
    device = case["query"].device
    shape, batch, context = case["shape"], case["query"].shape[0], case["context"]
    nbytes = kv_bytes(batch, context, dtype, shape)
    row_common = dict(
        dtype=str(dtype).removeprefix("torch."),
        batch=batch,
        context=context,
        kv_bytes=nbytes,
        fits_in_last_level_cache=nbytes <= llc,
    )
    same_size = read_limit(nbytes, device, args.reps, args.huge_pages)
    entries = [
        time_method(method, case, row_common, peer_failures, args.reps) for method in methods
    ]
    # Measured again after the methods; the machine may be shared, so keep the best.
    same_size = same_size.faster(read_limit(nbytes, device, args.reps, args.huge_pages))
    fastest = min((e["time_s"] for e in entries if e.get("time_s")), default=None)
    for _ in range(LIMIT_RETRIES):
        if fastest is None or same_size.faster(memory).seconds(nbytes) <= fastest:
            break
        retry = read_limit(nbytes, device, args.reps * LIMIT_RETRY_REPS_FACTOR, args.huge_pages,
                           LIMIT_RETRY_BUDGET_S)  # fmt: skip
        same_size = same_size.faster(retry)
    limit_entry = dict(row_common, method="limit", same_size=same_size.as_dict())
    entries.append(limit_entry)
    apply_limits(entries, memory)
    gather = next((e for e in entries if e["method"] == "gather+sdpa" and e.get("time_s")), None)
    for entry in entries:
        if entry.get("time_s") and gather:
            entry["speedup_vs_gather_sdpa"] = gather["time_s"] / entry["time_s"]
    return entries


def time_method(method, case, row_common, peer_failures, reps) -> dict:
    """One method's entry: its best time and bytes per second, or the reason it cannot run."""
    entry = dict(row_common, method=method)
    try:
        if method in peer_failures:
            raise RuntimeError(peer_failures[method])
        seconds = best_time(make_method(method, case), case["query"].device, reps)
        entry.update(time_s=seconds, bytes_per_s=row_common["kv_bytes"] / seconds)
    except Exception as error:  # reported in the table instead of a number
        reason = f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
        if method == "flex" or method in CUDA_METHODS:
            # A peer that cannot run once (not installed, no module for this dtype) is not
            # retried for every row of the dtype.
            peer_failures.setdefault(method, reason)
        entry.update(time_s=None, error=reason)
    return entry


def apply_limits(entries: list[dict], memory: ReadLimit) -> list[str]:
    """Set each ``limit`` entry to the faster of its same-size read and ``memory``, and every
    method's ``fraction_of_limit`` against its row's limit. A method faster than the limit is a
    measurement error: its fraction is left out, and the returned list names it."""
    limits = {}
    for entry in entries:
        if entry["method"] == "limit":
            same_size = ReadLimit(**entry["same_size"])
            limit = same_size.faster(memory)
            nbytes = entry["kv_bytes"]
            entry.update(time_s=limit.seconds(nbytes), bytes_per_s=limit.bytes_per_s)
            entry.update(reader=limit.reader, limit_buffer_bytes=limit.buffer_bytes)
            entry["bound"] = "memory" if limit is memory else "same-size buffer"
            limits[row_key(entry)] = entry
    errors = []
    for entry in entries:
        limit = limits.get(row_key(entry))
        if limit is None or not entry.get("time_s"):
            continue
        fraction = limit["time_s"] / entry["time_s"]
        if fraction > 1.0:
            message = (
                f"{entry['dtype']} {entry['batch']} x {entry['context']} {entry['method']}: "
                f"{entry['bytes_per_s'] / 1e9:.2f} GB/s, above the read limit "
                f"{limit['bytes_per_s'] / 1e9:.2f} GB/s ({limit['reader']})"
            )
            entry.pop("fraction_of_limit", None)
            entry["limit_error"] = "faster than the read limit: a measurement error"
            errors.append(message)
        else:
            entry["fraction_of_limit"] = fraction
            entry.pop("limit_error", None)
    return errors


def row_key(entry: dict) -> tuple:
    return entry["dtype"], entry["batch"], entry["context"]


def describe_limit(limit: ReadLimit) -> str:
    rates = ", ".join(f"{name} {rate / 1e9:.1f}" for name, rate in limit.rates.items())
    return (
        f"{limit.bytes_per_s / 1e9:.2f} GB/s by {limit.reader} over "
        f"{limit.buffer_bytes / 2**20:.0f} MiB, {limit.threads} threads (GB/s: {rates})"
    )


def print_rows(rows, header=False):
    if header:
        print(
            f"{'dtype':>8} {'batch':>5} {'ctx':>6} {'KV MiB':>8} {'LLC':>3} {'method':>12} "
            f"{'time ms':>9} {'GB/s':>8} {'% limit':>8} {'vs sdpa':>8}"
        )
    for r in rows:
        mib = r["kv_bytes"] / 2**20
        llc = "yes" if r["fits_in_last_level_cache"] else "no"
        prefix = f"{r['dtype']:>8} {r['batch']:>5} {r['context']:>6} {mib:>8.1f} {llc:>3} "
        if r.get("time_s") is None:
            print(prefix + f"{r['method']:>12}  n/a: {r['error']}")
            continue
        speedup = r.get("speedup_vs_gather_sdpa")
        fraction = r.get("fraction_of_limit")
        share = "ERROR" if r.get("limit_error") else f"{100 * fraction:.1f}%" if fraction else ""
        print(
            prefix + f"{r['method']:>12} {r['time_s'] * 1e3:>9.3f} {r['bytes_per_s'] / 1e9:>8.2f} "
            f"{share:>8} "
            + (f"{speedup:>7.1f}x" if speedup else f"{'':>8}")
            + (f"  ({r['reader']}, {r['bound']})" if r["method"] == "limit" else "")
        )


def plot(result, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dtypes = sorted({r["dtype"] for r in result["rows"]})
    fig, axes = plt.subplots(1, len(dtypes), figsize=(7 * len(dtypes), 4.5), squeeze=False)
    for ax, dtype in zip(axes[0], dtypes):
        rows = [r for r in result["rows"] if r["dtype"] == dtype]
        labels = sorted({(r["batch"], r["context"]) for r in rows})
        for method in [*METHODS, *CUDA_METHODS, "limit"]:
            points = {
                (r["batch"], r["context"]): r["bytes_per_s"] / 1e9
                for r in rows
                if r["method"] == method and r.get("time_s")
            }
            if points:
                xs = [i for i, label in enumerate(labels) if label in points]
                ys = [points[labels[i]] for i in xs]
                style = "k--" if method == "limit" else "o-"
                ax.plot(xs, ys, style, label=method)
        ax.set_xticks(range(len(labels)))
        ax.set_xticklabels([f"b{b}\nc{c}" for b, c in labels], fontsize=7)
        ax.set_ylabel("effective KV bandwidth (GB/s)")
        ax.set_title(f"paged decode, {result['device']}, {dtype}")
        ax.set_yscale("log")
        ax.legend(fontsize=8)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--contexts", default="512,2048,4096,8192")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument(
        "--cuda-methods",
        default="",
        help=f"GPU-only peers, timed with --device cuda: {', '.join(CUDA_METHODS)}",
    )
    parser.add_argument("--heads", type=int, default=Shape.num_heads, help="query heads")
    parser.add_argument("--kv-heads", type=int, default=Shape.num_kv_heads)
    parser.add_argument("--head-size", type=int, default=Shape.head_size)
    parser.add_argument("--block-size", type=int, default=Shape.block_size)
    parser.add_argument("--reps", type=int, default=10, help="repetitions (best is reported)")
    parser.add_argument(
        "--memory-buffer-mib",
        type=int,
        default=None,
        help="the memory read limit's buffer (default: 4x the last-level cache, at least 1 GiB)",
    )
    parser.add_argument("--json", default=None, help="default: results/bench_decode_<device>.json")
    parser.add_argument("--plot", default=None, help="PNG path (matplotlib)")
    parser.add_argument("--quick", action="store_true", help="small grid, few reps, no flex")
    parser.add_argument(
        "--huge-pages",
        action="store_true",
        help="CPU: cache and limit buffer advised to use 2 MiB pages, as PagedKVCache allocates",
    )
    args = parser.parse_args()
    if args.quick:
        args.batches, args.contexts, args.reps = "1,8", "512,2048", 3
        args.methods = "v1,v2,gather+sdpa"
    result = run_grid(args)
    suffix = "_huge_pages" if args.huge_pages else ""
    json_path = Path(args.json or f"results/bench_decode_{args.device}{suffix}.json")
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(result, indent=2))
    print(f"wrote {json_path}")
    if args.plot:
        plot(result, args.plot)
        print(f"wrote {args.plot}")
    if result["measurement_errors"]:
        for error in result["measurement_errors"]:
            print(f"measurement error: {error}", file=sys.stderr)
        raise SystemExit(
            f"{len(result['measurement_errors'])} method(s) read faster than the read limit: a "
            "measurement error (the machine was busy while the limit was measured); not "
            f"publishable, run again ({json_path} keeps the figures)"
        )


if __name__ == "__main__":
    main()
