"""Loads the compiled ops, gives them fake (meta) kernels, and wraps them in typed functions.

The raw ops live in ``torch.ops.paged_attention``; their schemas are in csrc/torch_bindings.cpp
and their semantics in reference.py.
"""

from __future__ import annotations

import importlib
import math
import numbers

import torch

from paged_attention.ops.supported import PARTITION_SIZE, is_fp8

# The compiled library: importing it registers torch.ops.paged_attention.*. By name, because
# an import of the package would make the bottom layer import the package's root, and with
# it every layer the root re-exports (lint-imports sees a Python import of a C++ module so).
importlib.import_module("paged_attention._C")

ops = torch.ops.paged_attention

# --------------------------------------------------------------------------------------------
# Fake kernels: every op only mutates its arguments, so tracing needs nothing but the schema.
#
# The dispatcher also runs a fake kernel for a real call that has a single ``meta`` tensor among
# CPU or CUDA ones (the Meta key outranks every backend), which would make the call a silent
# no-op. Each fake kernel therefore first rejects a mix of meta and other devices, as torch's own
# ops do; all-meta calls and FakeTensor tracing (where tensors report their fake device) pass.


def _named_tensors(op_name: str, args: tuple, kwargs: dict):
    """``(name, tensor)`` for every tensor argument of a call, list elements as ``name[i]``."""
    schema = getattr(ops, op_name).default._schema
    for position, argument in enumerate(schema.arguments):
        if position < len(args):
            value = args[position]
        elif argument.name in kwargs:
            value = kwargs[argument.name]
        else:
            continue
        if isinstance(value, torch.Tensor):
            yield argument.name, value
        elif isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                if isinstance(item, torch.Tensor):
                    yield f"{argument.name}[{i}]", item


def _check_no_meta_among_real(op_name: str, args: tuple, kwargs: dict) -> None:
    named = list(_named_tensors(op_name, args, kwargs))
    meta = next((name for name, t in named if t.device.type == "meta"), None)
    real = next(((name, t.device) for name, t in named if t.device.type != "meta"), None)
    if meta is not None and real is not None:
        raise RuntimeError(
            f"{op_name}: expected all tensors to be on the same device, but {meta} is on meta "
            f"and {real[0]} on {real[1]}"
        )


def _register_fake(op_name: str) -> None:
    def fake(*args, **kwargs) -> None:
        _check_no_meta_among_real(op_name, args, kwargs)

    fake.__name__ = f"_{op_name}_fake"
    torch.library.register_fake(f"paged_attention::{op_name}")(fake)


for _op_name in (
    "paged_attention_v1",
    "paged_attention_v2",
    "paged_attention_varlen",
    "reshape_and_cache",
    "copy_blocks",
    "swap_blocks",
):
    _register_fake(_op_name)


# --------------------------------------------------------------------------------------------
# Typed wrappers


def _scales(
    kv_cache_dtype: str,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The scales to pass to an op: an fp8 cache needs both (a default of 1.0 would give wrong
    values without an error); without fp8 the op ignores them, so missing ones become 1."""
    if is_fp8(kv_cache_dtype):
        missing = [name for name, t in (("k_scale", k_scale), ("v_scale", v_scale)) if t is None]
        if missing:
            raise ValueError(
                f"kv_cache_dtype={kv_cache_dtype!r} needs k_scale and v_scale (1-element float32 "
                f"tensors on the cache's device); missing: {', '.join(missing)}"
            )
        return k_scale, v_scale
    unit = None
    if k_scale is None or v_scale is None:
        unit = torch.ones(1, dtype=torch.float32, device=device)
    return (unit if k_scale is None else k_scale), (unit if v_scale is None else v_scale)


def _check_real(value, name: str) -> None:
    if not isinstance(value, (numbers.Real, torch.SymFloat)):
        raise TypeError(f"{name} must be a float, got {type(value).__name__}")


def _check_rank(t: torch.Tensor, rank: int, name: str, layout: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != rank:
        raise ValueError(f"{name} must be {rank}-D {layout}, got shape {tuple(t.shape)}")


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_cache_dtype: str = "auto",
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Store ``key`` ``[num_tokens, num_kv_heads, head_size]`` and ``value`` ``[num_tokens,
    num_kv_heads, v_head_size]`` (the value cache's head size) at ``slot_mapping`` (int64;
    negative = skip). ``key``/``value`` must not share memory with the caches.

    With an fp8 ``kv_cache_dtype``, ``k_scale`` and ``v_scale`` (1-element float32 tensors on the
    cache's device) are required: the values stored are ``x / scale``. Otherwise they are unused.
    """
    k_scale, v_scale = _scales(kv_cache_dtype, k_scale, v_scale, key_cache.device)
    ops.reshape_and_cache(
        key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale
    )


def copy_blocks(
    key_caches: list[torch.Tensor], value_caches: list[torch.Tensor], block_mapping: torch.Tensor
) -> None:
    """Copy blocks ``src -> dst`` (int64 ``[n, 2]``) in every layer's caches, in one call.

    The pairs are copied in parallel, so each destination may appear once and never also as a
    source (no chains ``[[0, 1], [1, 2]]``, no swaps ``[[0, 1], [1, 0]]``: split those into
    separate calls); one source may fan out to several destinations. A mapping on the host is
    always checked; on CUDA a device-side mapping only under ``PAGED_ATTENTION_DEBUG_CHECKS=1``.
    """
    ops.copy_blocks(key_caches, value_caches, block_mapping)


def swap_blocks(src: torch.Tensor, dst: torch.Tensor, block_mapping: torch.Tensor) -> None:
    """Copy blocks ``src[s] -> dst[d]`` for each row ``(s, d)``; src and dst may be on different
    devices (host <-> GPU).

    Each destination may appear once. ``src`` and ``dst`` ids index different pools, so a
    destination id may equal a source id, except when ``src`` and ``dst`` share memory: then no
    destination block may overlap a block some pair reads (checked as for :func:`copy_blocks`).
    ``dst`` must not overlap itself (e.g. an expanded, stride-0 tensor).
    """
    ops.swap_blocks(src, dst, block_mapping)


def num_partitions(max_seq_len: int) -> int:
    """Partitions of ``PARTITION_SIZE`` tokens that v2 splits the longest sequence into."""
    return max(1, math.ceil(max_seq_len / PARTITION_SIZE))


# v1 is one unit of work per (sequence, KV head); below this many units per core, v2's extra
# parallelism over partitions wins. (The CPU kernel serves adjacent KV heads of a sequence in one
# unit only while that still leaves this many units per thread.)
_CPU_UNITS_PER_THREAD = 4


def _cpu_threads() -> int:
    # A constant to torch.compile, so that paged_attention() traces with fullgraph=True.
    return torch.get_num_threads()


# What torch._dynamo.assume_constant_result does, without importing dynamo: a second or more
# of every start of a program that never compiles (tests/test_attention_cpu.py traces it).
_cpu_threads._dynamo_marked_constant = True


def use_v2(query: torch.Tensor, num_kv_heads: int, max_seq_len: int, block_size: int = 16) -> bool:
    """The v1/v2 choice of ``paged_attention``: v2 when the context spans several partitions and
    the batch is too small to keep the machine busy without splitting sequences. On the CPU, v1
    keeps its logits in per-thread buffers, so long contexts need no split (and v1 was the
    faster kernel at 16k and 32k tokens: docs/cpu_kernels.md). On CUDA, always
    v1: it splits each sequence itself, into as many parts as fill the GPU's waves of CTAs
    (csrc/cuda/attention/plan.h), where v2's partitions are fixed at 512 tokens."""
    if num_partitions(max_seq_len) == 1:
        return False
    if query.device.type == "cuda":
        return False
    work_units = query.shape[0] * num_kv_heads
    return work_units < _CPU_UNITS_PER_THREAD * _cpu_threads()


def _check_caches(key_cache: torch.Tensor, value_cache: torch.Tensor) -> None:
    _check_rank(
        key_cache, 5, "key_cache", "[num_blocks, num_kv_heads, head_size / x, block_size, x]"
    )
    _check_rank(
        value_cache, 4, "value_cache", "[num_blocks, num_kv_heads, v_head_size, block_size]"
    )


def _run_v2(out: torch.Tensor, common: tuple, max_seq_len: int) -> None:
    """v2 with its scratch: per partition the max logit, the exp sum and the partial output."""
    query, value_cache = common[0], common[2]
    num_seqs, num_heads = query.shape[:2]
    shape = (num_seqs, num_heads, num_partitions(max_seq_len))
    exp_sums = torch.empty(shape, dtype=torch.float32, device=query.device)
    max_logits = torch.empty_like(exp_sums)
    tmp_out = torch.empty((*shape, value_cache.shape[2]), dtype=query.dtype, device=query.device)
    ops.paged_attention_v2(out, exp_sums, max_logits, tmp_out, *common)


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    scale: float | None = None,
    max_seq_len: int | None = None,
    alibi_slopes: torch.Tensor | None = None,
    kv_cache_dtype: str = "auto",
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    sliding_window: int = 0,
    logits_soft_cap: float = 0.0,
    attention_chunk_size: int = 0,
    out: torch.Tensor | None = None,
    version: int | None = None,
) -> torch.Tensor:
    """Decode attention over a paged KV cache; returns ``[num_seqs, num_heads, v_head_size]``.

    ``query`` is ``[num_seqs, num_heads, head_size]``; ``key_cache``/``value_cache`` are in the
    layout of docs/design.md (num_kv_heads, block_size and the values' head size
    ``v_head_size``, which may differ from ``head_size`` as in multi-head latent attention, are
    read from them); ``block_tables`` int32 ``[num_seqs, max_blocks]``; ``seq_lens`` int32
    ``[num_seqs]``. ``scale`` defaults to ``head_size ** -0.5``. Pass ``max_seq_len`` (an int >=
    every seq_len) to avoid reading ``seq_lens`` back from the GPU, which synchronises and cannot
    be captured in a CUDA graph. ``version`` forces the v1 or v2 kernel; by default
    :func:`use_v2` chooses. ``sliding_window = W > 0`` attends the last ``W`` positions;
    ``attention_chunk_size = C > 0`` (chunked local attention, Llama 4) only the query's own chunk
    of ``C`` positions, ``[p - p % C, p]`` for the query at ``p = seq_len - 1``; with both,
    positions both allow. An fp8 ``kv_cache_dtype`` requires ``k_scale`` and ``v_scale`` (a
    ``ValueError`` otherwise). ``scale`` and ``logits_soft_cap`` are used in float32 and checked
    there: a scale that is inf in float32, or a cap that rounds to 0, raises.
    """
    _check_rank(query, 3, "query", "[num_seqs, num_heads, head_size]")
    _check_caches(key_cache, value_cache)
    num_seqs, num_heads, head_size = query.shape
    num_kv_heads, v_head_size, block_size = value_cache.shape[1:]
    scale = head_size**-0.5 if scale is None else scale
    _check_real(scale, "scale")
    _check_real(logits_soft_cap, "logits_soft_cap")
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max().item()) if seq_lens.numel() else 0
    if out is None:
        out = query.new_empty((num_seqs, num_heads, v_head_size))
    k_scale, v_scale = _scales(kv_cache_dtype, k_scale, v_scale, key_cache.device)
    if version is not None and (type(version) is not int or version not in (1, 2)):
        raise ValueError(f"version must be 1, 2 or None, got {version!r}")
    if version is None:
        version = 2 if use_v2(query, num_kv_heads, max_seq_len, block_size) else 1
    common = (
        *(query, key_cache, value_cache, num_kv_heads, float(scale), block_tables, seq_lens),
        *(block_size, max_seq_len, alibi_slopes, kv_cache_dtype, k_scale, v_scale),
        *(sliding_window, float(logits_soft_cap), attention_chunk_size),
    )
    if version == 1:
        ops.paged_attention_v1(out, *common)
    else:
        _run_v2(out, common, max_seq_len)
    return out


def paged_attention_varlen(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    *,
    scale: float | None = None,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    alibi_slopes: torch.Tensor | None = None,
    kv_cache_dtype: str = "auto",
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    sliding_window: int = 0,
    logits_soft_cap: float = 0.0,
    sinks: torch.Tensor | None = None,
    attention_chunk_size: int = 0,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of any number of new query rows per sequence over a paged KV cache (one
    call for prefill, chunked prefill, multi-token and single-token decode, mixed in one batch);
    returns ``[num_tokens, num_heads, v_head_size]`` (``v_head_size = value_cache.shape[2]``,
    the values' own head size: multi-head latent attention's differs from the keys').

    ``query`` is ``[num_tokens, num_heads, head_size]``; sequence ``s`` owns rows
    ``query_start_loc[s] .. query_start_loc[s + 1] - 1`` (int32 ``[num_seqs + 1]``, starting at
    0, non-decreasing; a sequence may have none). ``seq_lens[s]`` counts every token of ``s`` in
    the cache, its new ones included (store them first, e.g. with :func:`reshape_and_cache`):
    row ``i`` sits at position ``p = seq_len - q_len + i`` and attends the positions up to its
    own (the last ``sliding_window`` of them, if set; with ``attention_chunk_size = C``, only
    those of its own chunk, ``[p - p % C, p]``). Logits as in :func:`paged_attention`, with
    ALiBi ``slope * (key position - query position)``. ``sinks`` (float32 ``[num_heads]``) adds
    one logit per head to the softmax's denominator only. Rows past ``query_start_loc[-1]``
    belong to no sequence: the op leaves them untouched (zeros in the ``out`` allocated here).

    ``max_query_len``/``max_seq_len`` bound the per-sequence values; pass them to avoid reading
    ``query_start_loc``/``seq_lens`` back from the device (on CUDA the op then never
    synchronises, so a step replays in a CUDA graph). An fp8 ``kv_cache_dtype`` requires
    ``k_scale`` and ``v_scale``.
    """
    _check_rank(query, 3, "query", "[num_tokens, num_heads, head_size]")
    _check_caches(key_cache, value_cache)
    if scale is None:
        scale = query.shape[2] ** -0.5
    _check_real(scale, "scale")
    _check_real(logits_soft_cap, "logits_soft_cap")
    if max_query_len is None:
        lens = query_start_loc[1:] - query_start_loc[:-1]
        max_query_len = int(lens.max().item()) if lens.numel() else 0
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max().item()) if seq_lens.numel() else 0
    if out is None:
        out = query.new_zeros((*query.shape[:2], value_cache.shape[2]))
    k_scale, v_scale = _scales(kv_cache_dtype, k_scale, v_scale, key_cache.device)
    ops.paged_attention_varlen(
        out,
        query,
        key_cache,
        value_cache,
        value_cache.shape[1],
        float(scale),
        block_tables,
        seq_lens,
        query_start_loc,
        max_query_len,
        max_seq_len,
        alibi_slopes,
        kv_cache_dtype,
        k_scale,
        v_scale,
        sliding_window,
        float(logits_soft_cap),
        sinks,
        attention_chunk_size,
    )
    return out
