"""The host emulation of the CUDA kernels (csrc/cuda/emulator/) as a Python helper for the tests.

``library()`` compiles ``libpa_emulator.so`` with the host C++ compiler (no CUDA toolkit, no
torch headers) into ``build/emulator/<hash of the sources>/``, once per source state, and loads
it with ctypes. ``paged_attention_v1`` / ``paged_attention_v2`` / ``paged_attention_varlen`` take
the arguments of the ops of the same name (CPU tensors) and run the CUDA kernels' bodies under the
emulation, with the same kernel variants, split plan and grids as the CUDA launcher on a target GPU
(``targets()``: the limits of each architecture the kernels are planned for; an H200 by default).
``plan_variant`` is the plan of one kernel variant on one target.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
CSRC = ROOT / "csrc"
SOURCE_DIRS = [
    CSRC / "cuda" / "primitives",
    CSRC / "cuda" / "attention",
    CSRC / "cuda" / "emulator",
]
UNITS = ["runtime", "c_api", "emulated_float", "emulated_half", "emulated_bfloat16"]
FLAGS = ["-O2", "-std=c++20", "-fPIC", "-pthread", "-Wall", "-Wextra", "-Wno-unknown-pragmas"]
SCALAR = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
CACHE = {"auto": 0, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 2}
# The GPU the plan is made for by default: an H200 (132 SMs).
DEFAULT_TARGET = "sm_90"
# DeviceLimits (csrc/cuda/attention/plan.h), in its order.
LIMITS = (
    "sms shared_per_block_optin shared_per_sm reserved_shared_per_block registers_per_sm "
    "threads_per_sm max_ctas_per_sm"
).split()


class Call(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_double if name in ("scale", "logits_soft_cap") else ctypes.c_int64)
        for name in (
            "version scalar cache num_sms shared_per_block_optin shared_per_sm "
            "reserved_shared_per_block registers_per_sm threads_per_sm max_ctas_per_sm "
            "ctas_per_sm workers regions num_regions out exp_sums "
            "max_logits tmp_out query query_seq_stride query_head_stride key_cache value_cache "
            "key_block_stride key_head_stride value_block_stride value_head_stride block_tables "
            "block_table_stride max_blocks_per_seq seq_lens num_seqs num_heads num_kv_heads "
            "head_size block_size max_seq_len scale logits_soft_cap sliding_window alibi_slopes "
            "k_scale v_scale num_partitions query_start_loc num_tokens max_query_len sinks "
            "attention_chunk_size v_head_size"
        ).split()
    ]


class Report(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_int64)
        for name in (
            "row_warps rows_per_cta tokens_per_cta work_items scheduled "
            "splits split_tokens ctas shared_bytes stages ctas_per_sm heads_per_cta ldmatrix "
            "ldmatrix_conflicted ldmatrix_max_ways mma cp_async_bytes"
        ).split()
    ]


class VariantPlan(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_int64)
        for name in (
            "stages full_stages shared_bytes compiled_ctas_per_sm register_budget ctas_per_sm"
        ).split()
    ]


class EmulationError(RuntimeError):
    """The emulator found an error in a kernel (bad access, deadlock, divergent collective)."""


def _sources() -> list[Path]:
    files = [CSRC / "cache_dtype.h"]
    for directory in SOURCE_DIRS:
        files += sorted(p for p in directory.iterdir() if p.suffix in (".h", ".cuh", ".cpp"))
    return files


def _compiler() -> str:
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if not compiler:
        raise RuntimeError("no C++ compiler found (set CXX)")
    return compiler


_LIBRARY = None


def library() -> ctypes.CDLL:
    """Builds (if needed) and loads the emulation library."""
    global _LIBRARY
    if _LIBRARY is not None:
        return _LIBRARY
    compiler = _compiler()
    digest = hashlib.sha256(" ".join([compiler, *FLAGS]).encode())
    for path in _sources():
        digest.update(path.name.encode() + path.read_bytes())
    out_dir = ROOT / "build" / "emulator" / digest.hexdigest()[:16]
    so = out_dir / "libpa_emulator.so"
    if not so.exists():
        out_dir.mkdir(parents=True, exist_ok=True)
        jobs = []
        for unit in UNITS:  # compiled in parallel, one process per translation unit
            cmd = [
                compiler,
                *FLAGS,
                f"-I{CSRC}",
                "-c",
                str(CSRC / "cuda" / "emulator" / f"{unit}.cpp"),
            ]
            cmd += ["-o", str(out_dir / f"{unit}.o")]
            jobs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
        failures = []
        for job in jobs:
            output = job.communicate()[0].decode()
            if job.returncode != 0:
                failures.append(output)
        if failures:
            raise RuntimeError("building the emulator failed:\n" + "\n".join(failures))
        tmp = so.with_suffix(".tmp")
        objects = [str(out_dir / f"{unit}.o") for unit in UNITS]
        subprocess.run([compiler, "-shared", "-pthread", *objects, "-o", str(tmp)], check=True)
        tmp.rename(so)
    lib = ctypes.CDLL(str(so))
    lib.pa_emulate_paged_attention.argtypes = [
        ctypes.POINTER(Call),
        ctypes.POINTER(Report),
        ctypes.c_char_p,
        ctypes.c_int64,
    ]
    for name in ("ldmatrix", "mma", "cp_async", "rejects"):
        getattr(lib, f"pa_selftest_{name}").restype = ctypes.c_int
    lib.pa_num_targets.restype = ctypes.c_int64
    lib.pa_target_arch.restype = ctypes.c_char_p
    lib.pa_target_gpus.restype = ctypes.c_char_p
    lib.pa_target_arch.argtypes = lib.pa_target_gpus.argtypes = [ctypes.c_int64]
    lib.pa_target_limits.argtypes = [ctypes.c_int64, ctypes.POINTER(ctypes.c_int64)]
    lib.pa_plan_variant.argtypes = [ctypes.c_int64] * 5 + [ctypes.POINTER(VariantPlan)]
    _LIBRARY = lib
    return lib


def targets() -> dict[str, dict]:
    """The target GPUs of the plan (plan.h's kTargetGpus): arch -> {"gpus": text, limits...}."""
    lib = library()
    found = {}
    for i in range(lib.pa_num_targets()):
        values = (ctypes.c_int64 * len(LIMITS))()
        lib.pa_target_limits(i, values)
        found[lib.pa_target_arch(i).decode()] = dict(
            gpus=lib.pa_target_gpus(i).decode(), **dict(zip(LIMITS, values))
        )
    return found


def plan_variant(dtype: torch.dtype, cache: str, bucket: int, row_warps: int, target: str):
    """The plan of one kernel variant on a target: ring stages, shared memory, register budget,
    CTAs per SM."""
    index = list(targets()).index(target)
    plan = VariantPlan()
    library().pa_plan_variant(SCALAR[dtype], CACHE[cache], bucket, row_warps, index, plan)
    return plan


def region(t: torch.Tensor | None, writable: bool) -> tuple[int, int, int] | None:
    """The bytes a tensor's elements span (strides included)."""
    if t is None or t.numel() == 0:
        return None
    span = 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
    return (t.data_ptr(), span * t.element_size(), int(writable))


def _pointer(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


def run(
    version: int,
    out: torch.Tensor,
    exp_sums: torch.Tensor | None,
    max_logits: torch.Tensor | None,
    tmp_out: torch.Tensor | None,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    num_kv_heads: int,
    scale: float,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    block_size: int,
    max_seq_len: int,
    alibi_slopes: torch.Tensor | None,
    kv_cache_dtype: str,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    sliding_window: int = 0,
    logits_soft_cap: float = 0.0,
    attention_chunk_size: int = 0,
    *,
    query_start_loc: torch.Tensor | None = None,
    max_query_len: int = 1,
    sinks: torch.Tensor | None = None,
    target: str = DEFAULT_TARGET,
    num_sms: int | None = None,
    ctas_per_sm: int = 0,
    workers: int = 2,
) -> Report:
    """Runs an attention op on CPU tensors under the emulation (version 1 / 2: decode, 3:
    varlen), planned for `target` (with `num_sms` SMs instead of its own if given); returns the
    kernels' report."""
    readable = [
        query,
        key_cache,
        value_cache,
        block_tables,
        seq_lens,
        alibi_slopes,
        k_scale,
        v_scale,
        query_start_loc,
        sinks,
    ]
    writable = [out, exp_sums, max_logits, tmp_out]
    regions = [region(t, False) for t in readable] + [region(t, True) for t in writable]
    flat = [v for r in regions if r is not None for v in r]
    region_array = (ctypes.c_int64 * max(1, len(flat)))(*flat)
    num_seqs = query_start_loc.shape[0] - 1 if query_start_loc is not None else query.shape[0]
    device = {name: value for name, value in targets()[target].items() if name in LIMITS}
    if num_sms is not None:
        device["sms"] = num_sms
    call = Call(
        version=version,
        scalar=SCALAR[query.dtype],
        cache=CACHE[kv_cache_dtype],
        num_sms=device.pop("sms"),
        **device,
        ctas_per_sm=ctas_per_sm,
        workers=workers,
        regions=ctypes.addressof(region_array),
        num_regions=len(flat) // 3,
        out=_pointer(out),
        exp_sums=_pointer(exp_sums),
        max_logits=_pointer(max_logits),
        tmp_out=_pointer(tmp_out),
        query=_pointer(query),
        query_seq_stride=query.stride(0),
        query_head_stride=query.stride(1),
        key_cache=_pointer(key_cache),
        value_cache=_pointer(value_cache),
        key_block_stride=key_cache.stride(0),
        key_head_stride=key_cache.stride(1),
        value_block_stride=value_cache.stride(0),
        value_head_stride=value_cache.stride(1),
        block_tables=_pointer(block_tables),
        block_table_stride=block_tables.stride(0),
        max_blocks_per_seq=block_tables.shape[1],
        seq_lens=_pointer(seq_lens),
        num_seqs=num_seqs,
        num_heads=query.shape[1],
        num_kv_heads=num_kv_heads,
        head_size=query.shape[2],
        block_size=block_size,
        max_seq_len=max_seq_len,
        scale=scale,
        logits_soft_cap=logits_soft_cap,
        sliding_window=sliding_window,
        alibi_slopes=_pointer(alibi_slopes),
        k_scale=_pointer(k_scale),
        v_scale=_pointer(v_scale),
        num_partitions=exp_sums.shape[2] if exp_sums is not None else 0,
        query_start_loc=_pointer(query_start_loc),
        num_tokens=query.shape[0],
        max_query_len=max_query_len,
        sinks=_pointer(sinks),
        attention_chunk_size=attention_chunk_size,
        v_head_size=value_cache.shape[2],
    )
    report = Report()
    error = ctypes.create_string_buffer(4096)
    status = library().pa_emulate_paged_attention(
        ctypes.byref(call), ctypes.byref(report), error, len(error)
    )
    if status != 0:
        raise EmulationError(error.value.decode())
    return report


def paged_attention_v1(out, *args, **options) -> Report:
    return run(1, out, None, None, None, *args, **options)


def paged_attention_v2(out, exp_sums, max_logits, tmp_out, *args, **options) -> Report:
    return run(2, out, exp_sums, max_logits, tmp_out, *args, **options)


def paged_attention_varlen(
    out,
    query,
    key_cache,
    value_cache,
    num_kv_heads,
    scale,
    block_tables,
    seq_lens,
    query_start_loc,
    max_query_len,
    max_seq_len,
    alibi_slopes,
    kv_cache_dtype,
    k_scale,
    v_scale,
    sliding_window=0,
    logits_soft_cap=0.0,
    sinks=None,
    attention_chunk_size=0,
    **options,
) -> Report:
    """The varlen op's arguments in its schema's order (block_size from value_cache)."""
    return run(
        3,
        out,
        None,
        None,
        None,
        query,
        key_cache,
        value_cache,
        num_kv_heads,
        scale,
        block_tables,
        seq_lens,
        value_cache.shape[3],
        max_seq_len,
        alibi_slopes,
        kv_cache_dtype,
        k_scale,
        v_scale,
        sliding_window,
        logits_soft_cap,
        attention_chunk_size,
        query_start_loc=query_start_loc,
        max_query_len=max_query_len,
        sinks=sinks,
        **options,
    )


# ---- the plan of every kernel variant per target, as docs/cuda.md shows it ----------------------

DOCS = ROOT / "docs" / "cuda.md"
TABLE_BEGIN = "<!-- plan table: python tests/cuda_emulator.py --write-docs -->"
TABLE_END = "<!-- end of plan table -->"
QUERY_NAMES = {torch.float16: "fp16/bf16", torch.float32: "fp32"}


def variants() -> list[tuple[torch.dtype, str, int, int]]:
    """Every compiled kernel variant up to its ring: (query dtype, cache, head bucket, warps of
    rows); fp16 stands for bf16 too (the same shapes), fp8_e4m3 for fp8_e5m2."""
    found = []
    for dtype in (torch.float16, torch.float32):
        for cache in ("auto", "fp8_e4m3"):
            for bucket in (64, 128, 256):
                for row_warps in (1, 4) if dtype == torch.float16 else (1,):
                    found.append((dtype, cache, bucket, row_warps))
    return found


def plan_table() -> str:
    """A markdown table of every variant's plan on every target: ring stages, shared memory per
    CTA, registers per thread its launch bounds allow, resident CTAs per SM. Targets whose
    column would be the same share one."""
    names = list(targets())
    cells: dict[str, list[str]] = {name: [] for name in names}
    for variant in variants():
        for name in names:
            plan = plan_variant(*variant, name)
            cells[name].append(
                f"{plan.stages} · {plan.shared_bytes / 1024:.1f} · {plan.register_budget} · "
                f"{plan.ctas_per_sm}"
            )
    columns: list[tuple[list[str], list[str]]] = []
    for name in names:
        same = next((c for c in columns if c[1] == cells[name]), None)
        if same is None:
            columns.append(([name], cells[name]))
        else:
            same[0].append(name)
    header = ["query", "cache", "head sizes", "rows per CTA"] + [", ".join(c[0]) for c in columns]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for i, (dtype, cache, bucket, row_warps) in enumerate(variants()):
        sizes = {64: "≤ 64", 128: "65-128", 256: "129-256"}[bucket]
        rows = 4 if dtype == torch.float32 else 16 * row_warps
        cache_name = "fp16/bf16" if dtype == torch.float16 else "fp32"
        cache_name = cache_name if cache == "auto" else "fp8"
        row = [QUERY_NAMES[dtype], cache_name, sizes, str(rows)] + [c[1][i] for c in columns]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def _main() -> int:
    import argparse

    parser = argparse.ArgumentParser(description="The plan of every CUDA kernel variant.")
    parser.add_argument("--write-docs", action="store_true", help=f"update the table in {DOCS}")
    args = parser.parse_args()
    table = plan_table()
    if not args.write_docs:
        print(table)
        return 0
    text = DOCS.read_text()
    begin, end = text.index(TABLE_BEGIN) + len(TABLE_BEGIN), text.index(TABLE_END)
    DOCS.write_text(text[:begin] + "\n" + table + "\n" + text[end:])
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())
