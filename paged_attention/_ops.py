"""Loads the compiled ops, gives them fake (meta) kernels, and wraps them in typed functions.

The raw ops live in ``torch.ops.paged_attention``; their schemas are in csrc/torch_bindings.cpp
and their semantics in reference.py.
"""

from __future__ import annotations

import math

import torch

from paged_attention import _C  # noqa: F401  (loading the library registers the ops)
from paged_attention.reference import PARTITION_SIZE

ops = torch.ops.paged_attention

# --------------------------------------------------------------------------------------------
# Fake kernels: every op only mutates its arguments, so tracing needs nothing but the schema.


@torch.library.register_fake("paged_attention::paged_attention_v1")
def _paged_attention_v1_fake(out, query, key_cache, value_cache, *args, **kwargs) -> None:
    return None


@torch.library.register_fake("paged_attention::paged_attention_v2")
def _paged_attention_v2_fake(out, exp_sums, max_logits, tmp_out, query, *args, **kwargs) -> None:
    return None


@torch.library.register_fake("paged_attention::reshape_and_cache")
def _reshape_and_cache_fake(key, value, key_cache, value_cache, *args, **kwargs) -> None:
    return None


@torch.library.register_fake("paged_attention::copy_blocks")
def _copy_blocks_fake(key_caches, value_caches, block_mapping) -> None:
    return None


@torch.library.register_fake("paged_attention::swap_blocks")
def _swap_blocks_fake(src, dst, block_mapping) -> None:
    return None


# --------------------------------------------------------------------------------------------
# Typed wrappers


def _unit_scale(device: torch.device) -> torch.Tensor:
    return torch.ones(1, dtype=torch.float32, device=device)


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
    """Store ``key``/``value`` ``[num_tokens, num_kv_heads, head_size]`` at ``slot_mapping``
    (int64; negative = skip). Scales default to 1."""
    device = key_cache.device
    ops.reshape_and_cache(
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        kv_cache_dtype,
        _unit_scale(device) if k_scale is None else k_scale,
        _unit_scale(device) if v_scale is None else v_scale,
    )


def copy_blocks(
    key_caches: list[torch.Tensor], value_caches: list[torch.Tensor], block_mapping: torch.Tensor
) -> None:
    """Copy blocks ``src -> dst`` (int64 ``[n, 2]``) in every layer's caches, in one call."""
    ops.copy_blocks(key_caches, value_caches, block_mapping)


def swap_blocks(src: torch.Tensor, dst: torch.Tensor, block_mapping: torch.Tensor) -> None:
    """Copy blocks ``src[s] -> dst[d]`` for each row ``(s, d)``; src and dst may be on different
    devices (host <-> GPU)."""
    ops.swap_blocks(src, dst, block_mapping)


def num_partitions(max_seq_len: int) -> int:
    """Partitions of ``PARTITION_SIZE`` tokens that v2 splits the longest sequence into."""
    return max(1, math.ceil(max_seq_len / PARTITION_SIZE))


# v1 is one unit of work per (sequence, KV head); below this many units per core, v2's extra
# parallelism over partitions wins. (The CPU kernel serves adjacent KV heads of a sequence in one
# unit only while that still leaves this many units per thread.)
_CPU_UNITS_PER_THREAD = 4


@torch._dynamo.assume_constant_result
def _cpu_threads() -> int:
    # A constant to torch.compile, so that paged_attention() traces with fullgraph=True.
    return torch.get_num_threads()


def use_v2(query: torch.Tensor, num_kv_heads: int, max_seq_len: int, block_size: int = 16) -> bool:
    """The v1/v2 choice of ``paged_attention``: v2 when the context spans several partitions and
    the batch is too small to keep the machine busy without splitting sequences. On the CPU, v1
    keeps its logits in per-thread buffers, so long contexts need no split (and v1 was the
    faster kernel at 16k and 32k tokens; README, "Decode attention on the CPU"). On CUDA, always
    v1: it splits each sequence itself, into as many parts as fill the GPU's waves of CTAs
    (csrc/cuda/attention/plan.h), where v2's partitions are fixed at 512 tokens."""
    if num_partitions(max_seq_len) == 1:
        return False
    if query.device.type == "cuda":
        return False
    work_units = query.shape[0] * num_kv_heads
    return work_units < _CPU_UNITS_PER_THREAD * _cpu_threads()


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
    out: torch.Tensor | None = None,
    version: int | None = None,
) -> torch.Tensor:
    """Decode attention over a paged KV cache; returns ``[num_seqs, num_heads, head_size]``.

    ``query`` is ``[num_seqs, num_heads, head_size]``; ``key_cache``/``value_cache`` are in the
    layout of DESIGN.md (num_kv_heads and block_size are read from them); ``block_tables`` int32
    ``[num_seqs, max_blocks]``; ``seq_lens`` int32 ``[num_seqs]``. ``scale`` defaults to
    ``head_size ** -0.5``. Pass ``max_seq_len`` (an int >= every seq_len) to avoid reading
    ``seq_lens`` back from the GPU, which synchronises and cannot be captured in a CUDA graph.
    ``version`` forces the v1 or v2 kernel; by default :func:`use_v2` chooses.
    """
    num_seqs, num_heads, head_size = query.shape
    num_kv_heads, block_size = value_cache.shape[1], value_cache.shape[3]
    if scale is None:
        scale = head_size**-0.5
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max().item()) if seq_lens.numel() else 0
    if out is None:
        out = torch.empty((num_seqs, num_heads, head_size), dtype=query.dtype, device=query.device)
    if k_scale is None or v_scale is None:
        unit = _unit_scale(key_cache.device)
        k_scale = unit if k_scale is None else k_scale
        v_scale = unit if v_scale is None else v_scale
    if version is None:
        version = 2 if use_v2(query, num_kv_heads, max_seq_len, block_size) else 1
    if version not in (1, 2):
        raise ValueError(f"version must be 1, 2 or None, got {version!r}")
    common = (
        query,
        key_cache,
        value_cache,
        num_kv_heads,
        float(scale),
        block_tables,
        seq_lens,
        block_size,
        max_seq_len,
        alibi_slopes,
        kv_cache_dtype,
        k_scale,
        v_scale,
        sliding_window,
        float(logits_soft_cap),
    )
    if version == 1:
        ops.paged_attention_v1(out, *common)
        return out
    partitions = num_partitions(max_seq_len)
    exp_sums = torch.empty(
        (num_seqs, num_heads, partitions), dtype=torch.float32, device=query.device
    )
    max_logits = torch.empty_like(exp_sums)
    tmp_out = torch.empty(
        (num_seqs, num_heads, partitions, head_size), dtype=query.dtype, device=query.device
    )
    ops.paged_attention_v2(out, exp_sums, max_logits, tmp_out, *common)
    return out
