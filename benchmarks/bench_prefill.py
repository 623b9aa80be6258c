"""Attention of several new query rows per sequence over a paged KV cache (speculative
verification, prompt chunks, whole prompts, decode): our varlen op against plain PyTorch, side by
side.

Rows (32 query heads, 8 KV heads, head size 128, block size 16 unless ``--heads``,
``--kv-heads``, ``--head-size``, ``--block-size`` say otherwise; every sequence as long as the
context, scattered block tables):

* ``a``: 32 x 4096 context, the last 4 tokens new (multi-token decode, e.g. speculative
  verification): bandwidth-bound, reported against the streaming-read limit;
* ``b``: 4 x 2048 context, the last 512 new (a prompt chunk): compute-bound, GFLOP/s;
* ``c``: 1 x 4096, the whole prompt new: compute-bound, GFLOP/s;
* ``d``: 32 x 4096, 1 new token (decode): against the decode kernel v1.

Methods, all on the same cache contents:

* ``ours``: ``paged_attention.paged_attention_varlen``, one call for the batch.
* ``gather+sdpa``: the prefill path PagedAttention had before the varlen op (paged_attention/
  attention.py's ``gather_context`` + ``prefill_attention``): per sequence, gather its blocks
  into contiguous K/V, then ``scaled_dot_product_attention`` (``is_causal`` when every key is a
  new token, else a boolean bottom-right causal mask).
* ``sdpa-contig``: SDPA over K/V that are already contiguous ``[batch, kv_heads, context, D]``
  (no paging, the ceiling paging must not lose much against), one call for the batch, with the
  same mask; the contiguous copy is made outside the timed region.
* ``flex``: ``torch.compile``d FlexAttention over the same cache in its token-major paged layout
  with a block mask of each sequence's physical pages and a causal mask_mod; where it cannot run,
  the reason is reported instead of a number.
* ``v1`` (row ``d``): ``paged_attention.paged_attention(..., version=1)``.
* ``limit`` (rows ``a`` and ``d``): a streaming ``sum()`` over a float32 buffer as large as the
  K and V the step must read.
* ``flop-limit`` (every row): a matrix product of as many floating-point operations as the row's
  attention, ``[2048, 2048] @ [2048, N]``, in float32 on the CPU and in the row's dtype on CUDA:
  the rate the machine reaches on dense arithmetic. On the CPU a bf16 or fp16 row also times the
  product in its own dtype (``flop-limit-bfloat16``; torch's bf16 product runs on AMX or
  AVX512-BF16 where the CPU has them, and is the slower one where it has neither). A row can be
  no faster than the larger of its read limit and its arithmetic at the faster product's rate
  (``% roof``).

Times are the best of ``--reps`` samples after a warm-up. The samples of a row's methods are taken
in turns (one of each, then the next round), so that on a shared machine a busy moment slows all
of them alike. GB/s = bytes of K and V the step reads / time; GFLOP/s = 4 x head_size x query
heads x (keys each query row attends, summed) / time.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from pathlib import Path

import torch
from bench_decode import (
    Shape,
    allocate,
    build_case,
    gather_kv,
    machine_info,
)

import paged_attention.ops.bindings  # registers torch.ops.paged_attention
from paged_attention.cli.machine import describe_machine, seconds_per_call, synchronize


@dataclasses.dataclass(frozen=True)
class Row:
    name: str
    batch: int
    context: int
    query_len: int
    bound: str  # "bandwidth" or "compute"


ROWS = {
    "a": Row("a", 32, 4096, 4, "bandwidth"),
    "b": Row("b", 4, 2048, 512, "compute"),
    "c": Row("c", 1, 4096, 4096, "compute"),
    "d": Row("d", 32, 4096, 1, "bandwidth"),
}
METHODS = ("ours", "gather+sdpa", "sdpa-contig", "flex", "v1")
FLEX_QUERY_BLOCK = 128


def shrink(row: Row, max_batch: int | None, max_context: int | None) -> Row:
    """The row with batch and context capped: a few new tokens stay as many, a long run of new
    tokens stays the same fraction of the context."""
    batch = min(row.batch, max_batch or row.batch)
    context = min(row.context, max_context or row.context)
    query_len = row.query_len
    if query_len > 16:
        query_len = max(1, round(query_len * context / row.context))
    return dataclasses.replace(row, batch=batch, context=context, query_len=min(query_len, context))


def attention_flops(row: Row, shape: Shape) -> float:
    """4 x D x H x sum over rows of the keys each attends (causal)."""
    first = row.context - row.query_len + 1
    attended = row.query_len * (first + row.context) / 2
    return 4.0 * shape.head_size * shape.num_heads * row.batch * attended


GEMM_SIZE = 2048


def flop_limit(flops: float, dtype, device):
    """A matrix product of about ``flops`` operations: [GEMM_SIZE, GEMM_SIZE] @ [GEMM_SIZE, N]."""
    columns = max(16, round(flops / (2 * GEMM_SIZE * GEMM_SIZE) / 16) * 16)
    generator = torch.Generator(device="cpu").manual_seed(2)
    a = torch.randn(GEMM_SIZE, GEMM_SIZE, generator=generator).to(device, dtype)
    b = torch.randn(GEMM_SIZE, columns, generator=generator).to(device, dtype)
    out = torch.empty(GEMM_SIZE, columns, device=device, dtype=dtype)
    return (lambda: torch.mm(a, b, out=out)), 2.0 * GEMM_SIZE * GEMM_SIZE * columns


def new_queries(row: Row, shape: Shape, dtype, device, seed=1):
    generator = torch.Generator(device="cpu").manual_seed(seed)
    query = torch.randn(row.batch * row.query_len, shape.num_heads, shape.head_size,
                        generator=generator, dtype=torch.float32)  # fmt: skip
    return query.to(dtype=dtype, device=device)


def bottom_right_causal_mask(query_len: int, context: int, device) -> torch.Tensor:
    keys = torch.arange(context, device=device)
    queries = context - query_len + torch.arange(query_len, device=device)
    return keys[None, :] <= queries[:, None]


# --------------------------------------------------------------------------------------------
# Methods: each returns a zero-argument callable that runs the step.


def method_ours(case, query, row):
    device = query.device
    starts = torch.arange(0, row.batch * row.query_len + 1, row.query_len, dtype=torch.int32)
    starts = starts.to(device)
    out = torch.empty_like(query)

    def run():
        return paged_attention.paged_attention_varlen(
            query, case["key_cache"], case["value_cache"], case["block_tables"], case["seq_lens"],
            starts, max_query_len=row.query_len, max_seq_len=row.context, out=out,
        )  # fmt: skip

    return run


def method_gather_sdpa(case, query, row):
    """Per sequence: its blocks gathered into contiguous K/V, then SDPA (as PagedAttention's
    prefill path did with gather_context + prefill_attention)."""
    shape, context = case["shape"], row.context
    kv_heads, head_size, block_size = shape.num_kv_heads, shape.head_size, shape.block_size
    blocks_needed = -(-context // block_size)
    mask = None
    if row.query_len < context:
        mask = bottom_right_causal_mask(row.query_len, context, query.device)
    out = torch.empty_like(query)

    def run():
        for s in range(row.batch):
            blocks = case["block_tables"][s, :blocks_needed].long()
            keys = case["key_cache"][blocks].permute(0, 3, 1, 2, 4).reshape(-1, kv_heads, head_size)
            values = (
                case["value_cache"][blocks].permute(0, 3, 1, 2).reshape(-1, kv_heads, head_size)
            )
            keys, values = keys[:context].transpose(0, 1), values[:context].transpose(0, 1)
            rows = slice(s * row.query_len, (s + 1) * row.query_len)
            q = query[rows].transpose(0, 1)  # [H, n, D]
            result = torch.nn.functional.scaled_dot_product_attention(
                q, keys, values, attn_mask=mask, is_causal=mask is None, enable_gqa=True
            )
            out[rows] = result.transpose(0, 1)
        return out

    return run


def method_sdpa_contig(case, query, row):
    keys, values = gather_kv(case)  # [batch, kv_heads, context, D], made contiguous once
    keys, values = keys.contiguous(), values.contiguous()
    q = query.view(row.batch, row.query_len, *query.shape[1:]).transpose(1, 2)
    mask = None
    if row.query_len < row.context:
        mask = bottom_right_causal_mask(row.query_len, row.context, query.device)

    def run():
        return torch.nn.functional.scaled_dot_product_attention(
            q, keys, values, attn_mask=mask, is_causal=mask is None, enable_gqa=True
        )

    return run


def method_flex(case, query, row):
    """FlexAttention over a token-major paged cache; raises if this torch cannot run it."""
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    tables = case["block_tables"].long()
    batch, blocks = tables.shape
    device = tables.device
    num_blocks = case["value_cache"].shape[0]
    shape = case["shape"]
    kv_heads, head_size, block_size = shape.num_kv_heads, shape.head_size, shape.block_size
    key_pages = case["key_cache"].permute(1, 0, 3, 2, 4).reshape(1, kv_heads, -1, head_size)
    value_pages = case["value_cache"].permute(1, 0, 3, 2).reshape(1, kv_heads, -1, head_size)
    physical_to_logical = torch.full((batch, num_blocks), -1, dtype=torch.long, device=device)
    physical_to_logical.scatter_(1, tables, torch.arange(blocks, device=device).expand(batch, -1))
    first_query = row.context - row.query_len

    def mask_mod(b, h, q_idx, physical_kv):
        logical_page = physical_to_logical[b, physical_kv // block_size]
        logical = logical_page * block_size + physical_kv % block_size
        return (logical_page >= 0) & (logical <= first_query + q_idx)

    # Every page of a sequence in one column list; query blocks of FLEX_QUERY_BLOCK rows.
    query_blocks = -(-row.query_len // FLEX_QUERY_BLOCK)
    indices = torch.zeros(batch, 1, query_blocks, num_blocks, dtype=torch.int32, device=device)
    indices[:, 0, :, :blocks] = tables.to(torch.int32)[:, None, :]
    counts = torch.full((batch, 1, query_blocks), blocks, dtype=torch.int32, device=device)
    block_mask = BlockMask.from_kv_blocks(
        counts, indices, BLOCK_SIZE=(FLEX_QUERY_BLOCK, block_size), mask_mod=mask_mod,
        seq_lengths=(row.query_len, num_blocks * block_size),
    )  # fmt: skip
    q = query.view(batch, row.query_len, *query.shape[1:]).transpose(1, 2)
    torch._dynamo.reset()
    compiled = torch.compile(flex_attention, dynamic=False)

    def run():
        return compiled(q, key_pages, value_pages, block_mask=block_mask, enable_gqa=True)

    expected = method_sdpa_contig(case, query, row)().float()
    got = run().float()
    err = (got - expected).abs().max().item()
    if not err < 2e-2:
        raise RuntimeError(f"FlexAttention result differs from SDPA by {err:.3g}")
    return run


def method_v1(case, query, row):
    if row.query_len != 1:
        raise ValueError("v1 takes one query row per sequence")
    out = torch.empty_like(query)

    def run():
        return paged_attention.paged_attention(
            query, case["key_cache"], case["value_cache"], case["block_tables"], case["seq_lens"],
            max_seq_len=row.context, out=out, version=1,
        )  # fmt: skip

    return run


MAKERS = {
    "ours": method_ours,
    "gather+sdpa": method_gather_sdpa,
    "sdpa-contig": method_sdpa_contig,
    "flex": method_flex,
    "v1": method_v1,
}


# --------------------------------------------------------------------------------------------
# Timing


def best_times_in_turns(fns: dict, device, reps: int) -> dict:
    """The best of `reps` samples of each callable, taken one of each per round, after a warm-up
    call of each."""
    for fn in fns.values():
        fn()
    synchronize(device)
    best = {name: math.inf for name in fns}
    for _ in range(max(reps, 1)):
        for name, fn in fns.items():
            best[name] = min(best[name], seconds_per_call(fn, device))
    return best


# --------------------------------------------------------------------------------------------
# Main


def run_grid(args) -> dict:
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is available")
    dtypes = [getattr(torch, name) for name in args.dtypes.split(",")]
    methods = [m for m in args.methods.split(",") if m]
    for method in methods:
        if method not in MAKERS:
            raise SystemExit(f"unknown method {method!r} (known: {', '.join(METHODS)})")
    rows = []
    for name in args.rows.split(","):
        if name not in ROWS:
            raise SystemExit(f"unknown row {name!r} (known: {', '.join(ROWS)})")
        rows.append(shrink(ROWS[name], args.max_batch, args.max_context))
    shape = Shape(args.heads, args.kv_heads, args.head_size, args.block_size)
    result = dict(device=device.type, machine=machine_info(device), shape=dataclasses.asdict(shape),
                  rows=[], notes=[])  # fmt: skip
    result["notes"].append(
        "times are the best of N samples per call; limit = sum() over a float32 buffer as large "
        "as the step's K and V; flop-limit = a matrix product of as many operations (float32 on "
        "the CPU, the row's dtype on CUDA); GFLOP/s counts 4 x D x H per (query row, attended key)"
    )
    print(describe_machine(result["machine"]))
    print(shape)
    print_header()
    for dtype in dtypes:
        for row in rows:
            case = build_case(device, dtype, row.batch, row.context, shape)
            query = new_queries(row, shape, dtype, device)
            itemsize = torch.empty((), dtype=dtype).itemsize
            nbytes = 2 * row.batch * row.context * shape.num_kv_heads * shape.head_size * itemsize
            common = dict(dtype=str(dtype).removeprefix("torch."), row=row.name,
                          batch=row.batch, context=row.context, query_len=row.query_len,
                          bound=row.bound, kv_bytes=nbytes,
                          flops=attention_flops(row, shape))  # fmt: skip
            entries, fns = {}, {}
            for method in methods:
                if method == "v1" and row.query_len != 1:
                    continue
                entries[method] = dict(common, method=method)
                try:
                    fns[method] = MAKERS[method](case, query, row)
                    fns[method]()
                except Exception as error:  # reported in the table instead of a number
                    reason = f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
                    fns.pop(method, None)
                    entries[method].update(time_s=None, error=reason)
            if row.bound == "bandwidth":  # a streaming read of as many bytes
                buffer = allocate((nbytes // 4,), torch.float32, device, False).fill_(1.0)
                fns["limit"] = buffer.sum
                entries["limit"] = dict(common, method="limit")
            gemm_dtypes = {"flop-limit": torch.float32 if device.type == "cpu" else dtype}
            if device.type == "cpu" and dtype != torch.float32:
                gemm_dtypes[f"flop-limit-{common['dtype']}"] = dtype
            for method, gemm_dtype in gemm_dtypes.items():
                fns[method], gemm_flops = flop_limit(common["flops"], gemm_dtype, device)
                entries[method] = dict(common, method=method, flops=gemm_flops)
            for method, seconds in best_times_in_turns(fns, device, args.reps).items():
                entries[method]["time_s"] = seconds
            entries = list(entries.values())
            finish(entries)
            result["rows"] += entries
            print_rows(entries)
    return result


def is_flop_limit(entry) -> bool:
    return entry["method"].startswith("flop-limit")


def finish(entries):
    """Throughputs and ratios against the other methods of the same row."""
    times = {e["method"]: e["time_s"] for e in entries if e.get("time_s")}
    # the fastest the row's work could run: no faster than its bytes and no faster than its
    # arithmetic at the dense-product rate (the GEMM's time scaled to the attention's FLOPs)
    attention_flops = next(e["flops"] for e in entries if not is_flop_limit(e))
    arithmetic = [
        times[e["method"]] * attention_flops / e["flops"]
        for e in entries
        if is_flop_limit(e) and e["method"] in times
    ]
    roof = max(min(arithmetic), times.get("limit", 0.0)) if arithmetic else None
    for e in entries:
        if not e.get("time_s"):
            continue
        e["flops_per_s"] = e["flops"] / e["time_s"]
        if is_flop_limit(e):  # reads no K or V
            continue
        e["bytes_per_s"] = e["kv_bytes"] / e["time_s"]
        if "limit" in times:
            e["fraction_of_limit"] = times["limit"] / e["time_s"]
        if roof is not None and e["method"] != "limit":
            e["roof_s"] = roof
            e["fraction_of_roof"] = roof / e["time_s"]
        for peer, key in (
            ("gather+sdpa", "speedup_vs_gather_sdpa"),
            ("sdpa-contig", "speedup_vs_sdpa_contig"),
            ("v1", "speedup_vs_v1"),
        ):
            if peer in times and not e["method"].endswith("limit"):
                e[key] = times[peer] / e["time_s"]  # fmt: skip


def print_header():
    print(f"{'dtype':>8} {'row':>3} {'batch x ctx':>12} {'new':>5} {'method':>12} {'time ms':>10} "
          f"{'GB/s':>7} {'% limit':>8} {'GFLOP/s':>8} {'% roof':>7} {'vs g+sdpa':>9} "
          f"{'vs contig':>9} {'vs v1':>6}")  # fmt: skip


def print_rows(entries):
    def ratio(e, key):
        return f"{e[key]:.2f}x" if key in e else ""

    for e in entries:
        prefix = (f"{e['dtype']:>8} {e['row']:>3} {e['batch']:>4} x {e['context']:<5} "
                  f"{e['query_len']:>5} {e['method']:>12} ")  # fmt: skip
        if not e.get("time_s"):
            print(prefix + f" n/a: {e['error']}")
            continue
        limit = f"{100 * e['fraction_of_limit']:.1f}%" if "fraction_of_limit" in e else ""
        roof = f"{100 * e['fraction_of_roof']:.1f}%" if "fraction_of_roof" in e else ""
        gbps = f"{e['bytes_per_s'] / 1e9:.2f}" if "bytes_per_s" in e else ""
        print(
            prefix + f"{e['time_s'] * 1e3:>10.3f} {gbps:>7} {limit:>8} "
            f"{e['flops_per_s'] / 1e9:>8.1f} {roof:>7} {ratio(e, 'speedup_vs_gather_sdpa'):>9} "
            f"{ratio(e, 'speedup_vs_sdpa_contig'):>9} {ratio(e, 'speedup_vs_v1'):>6}"
        )


def plot(result, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({(r["row"], r["dtype"]) for r in result["rows"]})
    methods = [m for m in (*METHODS, "limit", "flop-limit")
               if any(r["method"] == m for r in result["rows"])]  # fmt: skip
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(groups)), 4.5))
    width = 0.8 / len(methods)
    for k, method in enumerate(methods):
        xs, ys = [], []
        for i, group in enumerate(groups):
            for r in result["rows"]:
                if (r["row"], r["dtype"]) == group and r["method"] == method and r.get("time_s"):
                    xs.append(i + k * width)
                    ys.append(r["time_s"] * 1e3)
        ax.bar(xs, ys, width, label=method)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(groups))])
    labels = []
    for name, dtype in groups:
        r = next(r for r in result["rows"] if (r["row"], r["dtype"]) == (name, dtype))
        labels.append(f"{name}: {r['batch']}x{r['context']}\nnew {r['query_len']}, {dtype}")
    ax.set_xticklabels(labels, fontsize=7)
    ax.set_yscale("log")
    ax.set_ylabel("time per step (ms, log scale)")
    ax.set_title(f"paged attention over new query rows, {result['device']}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--rows", default="a,b,c,d", help="rows of the grid (see the docstring)")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--heads", type=int, default=Shape.num_heads, help="query heads")
    parser.add_argument("--kv-heads", type=int, default=Shape.num_kv_heads)
    parser.add_argument("--head-size", type=int, default=Shape.head_size)
    parser.add_argument("--block-size", type=int, default=Shape.block_size)
    parser.add_argument("--max-batch", type=int, default=None, help="cap every row's batch")
    parser.add_argument("--max-context", type=int, default=None,
                        help="cap every row's context (new tokens scaled with it)")  # fmt: skip
    parser.add_argument("--reps", type=int, default=5, help="repetitions (best is reported)")
    parser.add_argument("--json", default=None, help="default: results/bench_prefill_<device>.json")
    parser.add_argument("--plot", default=None, help="PNG path (matplotlib)")
    args = parser.parse_args()
    if args.plot:
        Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
    result = run_grid(args)
    json_path = Path(args.json or f"results/bench_prefill_{args.device}.json")
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(result, indent=2))
    print(f"wrote {json_path}")
    if args.plot:
        plot(result, args.plot)
        print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
