"""The host emulation of the CUDA kernels (csrc/cuda/emulator/) as a Python helper for the tests.

``library()`` compiles ``libpa_emulator.so`` with the host C++ compiler (no CUDA toolkit, no
torch headers) into ``build/emulator/<hash of the sources>/``, once per source state, and loads
it with ctypes. ``paged_attention_v1`` / ``paged_attention_v2`` / ``paged_attention_varlen`` take
the arguments of the ops of the same name (CPU tensors) and run the CUDA kernels' bodies under the
emulation, with the same kernel variants, split plan and grids as the CUDA launcher.
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
# The GPU the split plan is made for by default: an H200's 132 SMs.
H200_SMS = 132


class Call(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_double if name in ("scale", "logits_soft_cap") else ctypes.c_int64)
        for name in (
            "version scalar cache num_sms ctas_per_sm workers regions num_regions out exp_sums "
            "max_logits tmp_out query query_seq_stride query_head_stride key_cache value_cache "
            "key_block_stride key_head_stride value_block_stride value_head_stride block_tables "
            "block_table_stride max_blocks_per_seq seq_lens num_seqs num_heads num_kv_heads "
            "head_size block_size max_seq_len scale logits_soft_cap sliding_window alibi_slopes "
            "k_scale v_scale num_partitions query_start_loc num_tokens max_query_len sinks "
            "attention_chunk_size"
        ).split()
    ]


class Report(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_int64)
        for name in (
            "row_warps rows_per_cta tokens_per_cta work_items scheduled "
            "splits split_tokens ctas shared_bytes ctas_per_sm heads_per_cta ldmatrix "
            "ldmatrix_conflicted ldmatrix_max_ways mma cp_async_bytes"
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
    _LIBRARY = lib
    return lib


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
    num_sms: int = H200_SMS,
    ctas_per_sm: int = 0,
    workers: int = 2,
) -> Report:
    """Runs an attention op on CPU tensors under the emulation (version 1 / 2: decode, 3:
    varlen); returns the kernels' report."""
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
    call = Call(
        version=version,
        scalar=SCALAR[query.dtype],
        cache=CACHE[kv_cache_dtype],
        num_sms=num_sms,
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
