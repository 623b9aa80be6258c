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
* ``limit``: a streaming read of the same number of bytes (``buffer.sum()`` over a float32
  buffer as large as the step's K and V; on CUDA timed with events, plus the stated peak).

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
import math
import time
from pathlib import Path

import torch

import paged_attention
from paged_attention import machine
from paged_attention.cache import advise_huge_pages
from paged_attention.machine import describe_machine
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
# On CUDA one sample is this many back-to-back calls: the host prepares the next call while the
# GPU runs the current one, so the time per call is the kernels' unless the host is the slower.
CUDA_CALLS_PER_SAMPLE = 10


# --------------------------------------------------------------------------------------------
# Timing


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def best_time(fn, device: torch.device, reps: int, budget_s: float = 2.0) -> float:
    """Best time per call of ``fn`` in seconds over up to ``reps`` samples (at least 3, fewer once
    ``budget_s`` is spent), after one warm-up run. CPU samples are one call timed by the wall
    clock; CUDA samples are ``CUDA_CALLS_PER_SAMPLE`` calls timed with events."""
    fn()
    synchronize(device)
    best = math.inf
    spent = 0.0
    for i in range(max(reps, 3)):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(CUDA_CALLS_PER_SAMPLE):
                fn()
            end.record()
            end.synchronize()
            sample_s, calls = start.elapsed_time(end) / 1e3, CUDA_CALLS_PER_SAMPLE
        else:
            t0 = time.perf_counter()
            fn()
            sample_s, calls = time.perf_counter() - t0, 1
        best = min(best, sample_s / calls)
        spent += sample_s
        if i >= 2 and spent > budget_s:
            break
    return best


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


def streaming_limit(nbytes: int, device: torch.device, reps: int, huge_pages=False) -> float:
    """Seconds to read ``nbytes`` once: ``sum()`` of a float32 buffer of that size."""
    buffer = allocate((nbytes // 4,), torch.float32, device, huge_pages).fill_(1.0)
    return best_time(buffer.sum, device, reps)


# --------------------------------------------------------------------------------------------
# Machine facts


def last_level_cache_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0))
    best = 0
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            size = (index / "size").read_text().strip()
        except OSError:
            continue
        units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
        value = int(size[:-1]) * units[size[-1]] if size[-1] in units else int(size)
        best = max(best, value)
    return best or 300 << 20


def machine_info(device: torch.device) -> dict:
    info = machine.machine_info(device)
    info["last_level_cache_bytes"] = last_level_cache_bytes(device)
    return info


def cuda_peak(device: torch.device) -> float | None:
    name = torch.cuda.get_device_properties(device).name
    for key, peak in CUDA_PEAK_BYTES_PER_S.items():
        if key in name:
            return peak
    return None


# --------------------------------------------------------------------------------------------
# Main


def run_grid(args) -> dict:
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is available")
    dtypes = [getattr(torch, name) for name in args.dtypes.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    contexts = [int(c) for c in args.contexts.split(",")]
    methods = [m for m in args.methods.split(",") if m]
    cuda_methods = [m for m in args.cuda_methods.split(",") if m]
    unknown = [m for m in cuda_methods if m not in CUDA_METHODS]
    if unknown:
        raise SystemExit(f"--cuda-methods: unknown {unknown} (known: {', '.join(CUDA_METHODS)})")
    shape = Shape(args.heads, args.kv_heads, args.head_size, args.block_size)
    llc = last_level_cache_bytes(device)
    result = dict(device=device.type, machine=machine_info(device), rows=[], notes=[])
    result["shape"] = dataclasses.asdict(shape)
    print(describe_machine(result["machine"]))
    print(shape)
    result["huge_pages"] = args.huge_pages
    result["notes"].append(
        "times are the best of N samples per call (CUDA: event-timed samples of "
        f"{CUDA_CALLS_PER_SAMPLE} back-to-back calls); limit = sum() over a float32 buffer of the "
        "same size"
    )
    if cuda_methods and device.type == "cuda":
        methods += cuda_methods
    elif cuda_methods:
        result["notes"].append(f"--cuda-methods {','.join(cuda_methods)}: not run on the CPU")
    peak = cuda_peak(device) if device.type == "cuda" else None
    if peak:
        result["notes"].append(f"stated peak memory bandwidth: {peak / 1e12:.1f} TB/s")
    peer_failures: dict[str, str] = {}
    for dtype in dtypes:
        peer_failures = {m: r for m, r in peer_failures.items() if m == "flex"}
        for batch in batches:
            for context in contexts:
                nbytes = kv_bytes(batch, context, dtype, shape)
                case = build_case(device, dtype, batch, context, shape, huge_pages=args.huge_pages)
                limit_s = streaming_limit(nbytes, device, args.reps, args.huge_pages)
                row_common = dict(
                    dtype=str(dtype).removeprefix("torch."),
                    batch=batch,
                    context=context,
                    kv_bytes=nbytes,
                    fits_in_last_level_cache=nbytes <= llc,
                )
                timings = {}
                for method in methods:
                    entry = dict(row_common, method=method)
                    try:
                        if method in peer_failures:
                            raise RuntimeError(peer_failures[method])
                        fn = make_method(method, case)
                        seconds = best_time(fn, device, args.reps)
                        timings[method] = seconds
                        entry.update(time_s=seconds, bytes_per_s=nbytes / seconds)
                    except Exception as error:  # reported in the table instead of a number
                        reason = f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
                        if method == "flex" or method in CUDA_METHODS:
                            # A peer that cannot run once (not installed, no module for
                            # this dtype) is not retried for every row of the dtype.
                            peer_failures.setdefault(method, reason)
                        entry.update(time_s=None, error=reason)
                    result["rows"].append(entry)
                # Measured again after the methods; the machine may be shared, so keep the best.
                limit_s = min(limit_s, streaming_limit(nbytes, device, args.reps, args.huge_pages))
                limit_entry = dict(row_common, method="limit", time_s=limit_s)
                limit_entry["bytes_per_s"] = nbytes / limit_s
                result["rows"].append(limit_entry)
                for entry in result["rows"][-len(methods) - 1 :]:
                    if entry.get("time_s"):
                        entry["fraction_of_limit"] = limit_s / entry["time_s"]
                        if peak:
                            entry["fraction_of_peak"] = entry["bytes_per_s"] / peak
                        if "gather+sdpa" in timings:
                            entry["speedup_vs_gather_sdpa"] = (
                                timings["gather+sdpa"] / entry["time_s"]
                            )
                print_rows(result["rows"][-len(methods) - 1 :], header=not result.get("printed"))
                result["printed"] = True
    result.pop("printed", None)
    if "flex" in peer_failures:
        result["notes"].append(f"flex could not run: {peer_failures['flex']}")
    return result


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
        print(
            prefix + f"{r['method']:>12} {r['time_s'] * 1e3:>9.3f} {r['bytes_per_s'] / 1e9:>8.2f} "
            f"{100 * r.get('fraction_of_limit', 0):>7.1f}% "
            + (f"{speedup:>7.1f}x" if speedup else f"{'':>8}")
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


if __name__ == "__main__":
    main()
