"""What the tests and the benchmarks share: random paged KV caches laid out the way a block
manager leaves them (one builder for both), and the tiny random Llama with its byte-level
tokenizer (``--model tiny``, from :mod:`paged_attention.modeling.tiny`)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch

from paged_attention.modeling.tiny import (  # noqa: F401  (re-exported: what the tests share)
    BYTE_TOKENIZER_SPECIAL_TOKENS,
    CHATML_TEMPLATE,
    TINY_LLAMA,
    byte_tokenizer,
    tiny_chat_model,
    tiny_llama,
    tiny_llama_config,
)
from paged_attention.ops import reference
from paged_attention.ops.supported import is_fp8

# Bit pattern that is NaN in both fp8 formats (float8_e4m3fn and float8_e5m2).
FP8_NAN_BITS = 0xFF


def make_paged_kv(
    num_seqs: int,
    seq_lens: int | list[int],
    num_kv_heads: int,
    head_size: int,
    block_size: int,
    dtype: torch.dtype,
    kv_cache_dtype: str = "auto",
    device: str | torch.device = "cpu",
    num_blocks: int | None = None,
    nan_fill: bool = True,
    seed: int = 0,
    *,
    tokens: bool = True,
    allocate=None,
) -> SimpleNamespace:
    """A random paged cache holding ``num_seqs`` sequences of ``seq_lens`` tokens (an int: all
    the same length).

    Each sequence's blocks are drawn from a random permutation of a pool of ``num_blocks`` blocks
    (default: the blocks needed plus a few spare), so block order is scattered; every block table
    row has at least one unused trailing entry holding an out-of-range id that must never be read.
    With ``nan_fill`` every cache slot that holds no token (spare blocks, the tail of each last
    block) is NaN, so a kernel that lets one into its result fails loudly.

    ``dtype`` is the model dtype of the keys/values; fp8 caches (``kv_cache_dtype`` "fp8",
    "fp8_e4m3", "fp8_e5m2") are uint8 tensors quantised with ``k_scale``/``v_scale``.

    ``tokens=False`` (the benchmarks, whose caches take gigabytes): every slot holds random
    values drawn on ``device`` instead of stored tokens, and there are no spare blocks and no
    unused table entries unless ``num_blocks`` asks for spares. ``allocate(shape, dtype,
    device)`` makes the two cache tensors (e.g. advised to use huge pages).

    Returns a namespace with ``key_cache``, ``value_cache``, ``block_tables`` (int32),
    ``seq_lens`` (int32 tensor), ``max_seq_len``, ``k_scale``, ``v_scale`` (1-element float32),
    ``kv_cache_dtype``, ``block_size``, ``num_kv_heads``, ``head_size``, ``num_blocks``.
    """
    device = torch.device(device)
    lens, num_blocks = _sizes(num_seqs, seq_lens, block_size, num_blocks, spares=tokens)
    generator = torch.Generator().manual_seed(seed)
    fp8 = is_fp8(kv_cache_dtype)
    cache_dtype = torch.uint8 if fp8 else dtype
    key_cache, value_cache = _allocate_caches(
        num_blocks, num_kv_heads, head_size, block_size, cache_dtype, device, allocate or _empty
    )
    # Scales that use most of the e4m3 range for standard-normal data.
    k_scale = torch.tensor([0.02 if fp8 else 1.0], dtype=torch.float32, device=device)
    v_scale = torch.tensor([0.015 if fp8 else 1.0], dtype=torch.float32, device=device)
    block_tables, slot_mapping = _scattered_tables(
        lens, block_size, num_blocks, 1 if tokens else 0, generator
    )
    if tokens:
        empty = (FP8_NAN_BITS if fp8 else math.nan) if nan_fill else 0
        for cache in (key_cache, value_cache):
            cache.fill_(empty)
        shape = (slot_mapping.numel(), num_kv_heads, head_size)
        key, value = (torch.randn(shape, generator=generator).to(device, dtype) for _ in "kv")
        scales = (kv_cache_dtype, k_scale, v_scale)
        slots = slot_mapping.to(device)
        reference.reshape_and_cache(key, value, key_cache, value_cache, slots, *scales)
    else:
        for cache in (key_cache, value_cache):
            _fill_random(cache, kv_cache_dtype)
    return SimpleNamespace(
        key_cache=key_cache,
        value_cache=value_cache,
        block_tables=block_tables.to(device),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=device),
        max_seq_len=max(lens, default=0),
        k_scale=k_scale,
        v_scale=v_scale,
        kv_cache_dtype=kv_cache_dtype,
        block_size=block_size,
        num_kv_heads=num_kv_heads,
        head_size=head_size,
        num_blocks=num_blocks,
    )


def _sizes(
    num_seqs: int, seq_lens, block_size: int, num_blocks: int | None, spares: bool
) -> tuple[list[int], int]:
    """Each sequence's length, and the pool's blocks: ``num_blocks``, or by default the blocks
    needed plus (with ``spares``) a few spare ones."""
    lens = [seq_lens] * num_seqs if isinstance(seq_lens, int) else list(seq_lens)
    if len(lens) != num_seqs:
        raise ValueError(f"seq_lens has {len(lens)} entries for {num_seqs} sequences")
    needed = sum(math.ceil(n / block_size) for n in lens)
    if num_blocks is None:
        num_blocks = needed + (max(4, num_seqs) if spares else 0)
    if num_blocks < needed:
        raise ValueError(f"num_blocks={num_blocks} is fewer than the {needed} blocks needed")
    return lens, num_blocks


def _allocate_caches(
    num_blocks, num_kv_heads, head_size, block_size, cache_dtype, device, allocate
) -> tuple[torch.Tensor, torch.Tensor]:
    """The key cache ``[blocks, kv_heads, head_size / x, block_size, x]`` (``x`` elements make 16
    bytes) and the value cache ``[blocks, kv_heads, head_size, block_size]``, by ``allocate``."""
    x = 16 // torch.empty((), dtype=cache_dtype).element_size()
    key_shape = (num_blocks, num_kv_heads, head_size // x, block_size, x)
    value_shape = (num_blocks, num_kv_heads, head_size, block_size)
    return allocate(key_shape, cache_dtype, device), allocate(value_shape, cache_dtype, device)


def _empty(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device=device)


def _scattered_tables(
    lens: list[int], block_size: int, num_blocks: int, spare_entries: int, generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Block tables (int32, ``spare_entries`` unused trailing entries per row holding an
    out-of-range id) giving each sequence blocks drawn in turn from a random permutation of the
    pool, and the int64 slot of every token of every sequence in order."""
    blocks_per_seq = [math.ceil(n / block_size) for n in lens]
    pool = torch.randperm(num_blocks, generator=generator)
    width = max(blocks_per_seq, default=0) + spare_entries
    block_tables = torch.full((len(lens), width), num_blocks + 1000, dtype=torch.int32)
    slots = [torch.empty(0, dtype=torch.int64)]
    used = 0
    for s, n_blocks in enumerate(blocks_per_seq):
        blocks = pool[used : used + n_blocks]
        used += n_blocks
        block_tables[s, :n_blocks] = blocks.to(torch.int32)
        positions = torch.arange(lens[s])
        slots.append(blocks[positions // block_size] * block_size + positions % block_size)
    return block_tables, torch.cat(slots)


def _fill_random(cache: torch.Tensor, kv_cache_dtype: str) -> None:
    """Fill every slot of a cache with standard-normal values (quantised at scale 1 for fp8)."""
    if not is_fp8(kv_cache_dtype):
        cache.normal_()
    else:
        values = torch.randn(cache.shape, device=cache.device)
        cache.copy_(reference.quantize(values, kv_cache_dtype, 1.0))
