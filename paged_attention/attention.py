"""PagedAttention: a drop-in attention module that keeps its keys and values in a paged KV cache.

A step's input is *packed*: the new tokens of every sequence, one after the other, as
``query [num_tokens, num_heads, head_size]`` and ``key``/``value [num_tokens, num_kv_heads,
head_size]``; :class:`AttentionMetadata` says how many tokens each sequence contributes, how long
each sequence is after the step, where its blocks are and which slot each new token goes to.

``forward`` first stores the new keys and values (``reshape_and_cache``), then computes
attention of every new token against its sequence's whole context in the cache, in one op call
for the whole step: the decode kernel (``paged_attention``) when every sequence adds one token,
else ``paged_attention_varlen``, which serves prefill, prompt chunks after a cached context (a
prefix-cache hit, a resumed sequence), multi-token decode and decode rows mixed. The varlen op
has a CPU kernel only so far: on CUDA, a step with several new tokens in a sequence runs its
decode rows through the decode kernel and each longer sequence through SDPA over its gathered
context.

Logit semantics are those of reference.py: ``s = scale * q.k``, then the soft-cap, then ALiBi
``slope * (p - query_position)``, and a sliding window of ``W`` keeps the last ``W`` positions up
to and including the query's own; ``sinks`` add one logit per head to the softmax's denominator.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from paged_attention import _ops
from paged_attention.supported import FP8_FORMATS, check_head_size, is_fp8


def debug_checks_enabled() -> bool:
    """The switch of the ops' content checks on CUDA (README, "Install from source")."""
    return os.environ.get("PAGED_ATTENTION_DEBUG_CHECKS") == "1"


@dataclass
class AttentionMetadata:
    """One step of packed (varlen) attention over a paged cache.

    ``query_lens[i]`` new tokens of sequence ``i`` sit contiguously in the packed input, in
    sequence order; ``seq_lens[i]`` counts its tokens *including* them, so its cached context
    before the step is ``seq_lens[i] - query_lens[i]``. ``block_tables`` (int32 ``[num_seqs,
    max_blocks]``), ``seq_lens_tensor`` (int32 ``[num_seqs]``) and ``slot_mapping`` (int64
    ``[num_tokens]``, negative = do not store) live on the cache's device; the lists live on the
    host so that no step reads a length back from the GPU.

    ``manager_window`` is the sliding window of the block manager that planned the step: it
    releases blocks wholly before the last ``manager_window`` positions, so no module may attend
    further back (``None``: every block is kept).
    """

    query_lens: list[int]
    seq_lens: list[int]
    block_tables: torch.Tensor
    seq_lens_tensor: torch.Tensor
    slot_mapping: torch.Tensor
    max_seq_len: int
    query_start_loc: torch.Tensor  # int32 [num_seqs + 1]: where each sequence's rows start
    max_query_len: int
    manager_window: int | None = None

    @classmethod
    def build(
        cls,
        query_lens: Sequence[int],
        seq_lens: Sequence[int],
        block_tables: torch.Tensor,
        slot_mapping: torch.Tensor,
        device: torch.device | str | None = None,
        seq_lens_tensor: torch.Tensor | None = None,
        manager_window: int | None = None,
    ) -> AttentionMetadata:
        """Validate the host lists and move the tensors to ``device`` (default: where
        ``block_tables`` is)."""
        query_lens, seq_lens = [int(n) for n in query_lens], [int(n) for n in seq_lens]
        if len(query_lens) != len(seq_lens) or block_tables.shape[0] != len(seq_lens):
            raise ValueError(
                f"query_lens ({len(query_lens)}), seq_lens ({len(seq_lens)}) and block_tables "
                f"({block_tables.shape[0]} rows) must have one entry per sequence"
            )
        for i, (q, s) in enumerate(zip(query_lens, seq_lens)):
            if not 0 <= q <= s:
                raise ValueError(f"sequence {i}: need 0 <= query_len ({q}) <= seq_len ({s})")
        if slot_mapping.shape != (sum(query_lens),):
            raise ValueError(
                f"slot_mapping must have one slot per new token ({sum(query_lens)}), "
                f"got shape {tuple(slot_mapping.shape)}"
            )
        device = block_tables.device if device is None else torch.device(device)
        if seq_lens_tensor is None:
            seq_lens_tensor = torch.tensor(seq_lens, dtype=torch.int32)
        starts = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
        starts[1:] = torch.tensor(query_lens, dtype=torch.int32).cumsum(0)
        return cls(
            query_lens=query_lens,
            seq_lens=seq_lens,
            block_tables=block_tables.to(device=device, dtype=torch.int32, non_blocking=True),
            seq_lens_tensor=seq_lens_tensor.to(device=device, dtype=torch.int32, non_blocking=True),
            slot_mapping=slot_mapping.to(device=device, dtype=torch.int64, non_blocking=True),
            max_seq_len=max(seq_lens, default=0),
            query_start_loc=starts.to(device=device, non_blocking=True),
            max_query_len=max(query_lens, default=0),
            manager_window=manager_window,
        )

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens)

    @property
    def context_lens(self) -> list[int]:
        return [s - q for s, q in zip(self.seq_lens, self.query_lens)]

    @property
    def is_decode(self) -> bool:
        """Every sequence contributes exactly one new token."""
        return all(q == 1 for q in self.query_lens)


class PagedAttention(nn.Module):
    """Multi-head (MHA/GQA/MQA) attention over a paged KV cache.

    ``num_kv_heads`` defaults to ``num_heads``; ``scale`` to ``head_size ** -0.5``;
    ``alibi_slopes`` is ``None`` or ``[num_heads]`` floats; ``sliding_window = W > 0`` attends the
    last ``W`` positions; ``logits_soft_cap = c > 0`` maps logits to ``c * tanh(s / c)``;
    ``kv_cache_dtype`` is ``"auto"`` or an fp8 format (then pass ``k_scale``/``v_scale`` to
    ``forward``, as :class:`~paged_attention.cache.PagedKVCache` holds them); ``sinks`` is
    ``None`` or ``[num_heads]`` floats, one extra logit per head that only joins the softmax's
    denominator (attention sinks as in gpt-oss; CPU only for now).
    """

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        num_kv_heads: int | None = None,
        scale: float | None = None,
        alibi_slopes: Sequence[float] | torch.Tensor | None = None,
        sliding_window: int = 0,
        logits_soft_cap: float = 0.0,
        kv_cache_dtype: str = "auto",
        sinks: Sequence[float] | torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if num_heads <= 0 or num_kv_heads <= 0 or num_heads % num_kv_heads:
            raise ValueError(
                f"num_heads ({num_heads}) must be a positive multiple of num_kv_heads "
                f"({num_kv_heads})"
            )
        if sliding_window is None or sliding_window < 0:
            raise ValueError(f"sliding_window must be >= 0 (0 = none), got {sliding_window}")
        if logits_soft_cap is None or logits_soft_cap < 0:
            raise ValueError(f"logits_soft_cap must be >= 0 (0 = none), got {logits_soft_cap}")
        check_head_size(head_size, kv_cache_dtype)  # validates the cache format's name too
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_size = head_size
        self.scale = float(head_size**-0.5 if scale is None else scale)
        self.sliding_window = int(sliding_window)
        self.logits_soft_cap = float(logits_soft_cap)
        self.kv_cache_dtype = kv_cache_dtype
        if alibi_slopes is not None:
            slopes = torch.as_tensor(alibi_slopes, dtype=torch.float32).flatten()
            if slopes.numel() != num_heads:
                raise ValueError(f"alibi_slopes must have num_heads ({num_heads}) entries")
            self.register_buffer("alibi_slopes", slopes, persistent=False)
        else:
            self.alibi_slopes = None
        if sinks is not None:
            sink_logits = torch.as_tensor(sinks, dtype=torch.float32).flatten()
            if sink_logits.numel() != num_heads:
                raise ValueError(f"sinks must have num_heads ({num_heads}) entries")
            self.register_buffer("sinks", sink_logits, persistent=False)
        else:
            self.sinks = None

    def extra_repr(self) -> str:
        return (
            f"num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, "
            f"head_size={self.head_size}, scale={self.scale}, sliding_window="
            f"{self.sliding_window}, logits_soft_cap={self.logits_soft_cap}, "
            f"alibi={self.alibi_slopes is not None}, sinks={self.sinks is not None}, "
            f"kv_cache_dtype={self.kv_cache_dtype!r}"
        )

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        metadata: AttentionMetadata,
        *,
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``query`` ``[num_tokens, num_heads, head_size]`` (or ``[num_tokens, num_heads *
        head_size]``), ``key``/``value`` likewise with ``num_kv_heads`` (``None`` when they are
        already in the cache); returns the attention output in the shape of ``query``.

        Inference only: the cache writes have no autograd, so a call that would need gradients
        (grad mode on and an input requiring grad, e.g. a model in training) raises instead of
        silently dropping the key and value gradients."""
        if torch.is_grad_enabled() and any(
            t is not None and t.requires_grad for t in (query, key, value)
        ):
            raise RuntimeError(
                "PagedAttention is inference-only: the paged KV cache has no autograd, so key and "
                "value gradients would be lost. Run it under torch.no_grad() or "
                "torch.inference_mode() (transformers' generate() does)"
            )
        shape = query.shape
        query = query.view(-1, self.num_heads, self.head_size)
        if query.shape[0] != metadata.num_tokens:
            raise ValueError(
                f"query has {query.shape[0]} tokens, metadata expects {metadata.num_tokens}"
            )
        self._check_window(metadata)
        key_cache, value_cache = kv_cache
        if is_fp8(self.kv_cache_dtype):
            if k_scale is None or v_scale is None:
                raise ValueError(
                    f"kv_cache_dtype={self.kv_cache_dtype!r} needs k_scale and v_scale (the "
                    "cache's dequantisation scales, e.g. PagedKVCache.k_scale and .v_scale)"
                )
        elif k_scale is None or v_scale is None:
            unit = torch.ones(1, dtype=torch.float32, device=key_cache.device)
            k_scale = unit if k_scale is None else k_scale
            v_scale = unit if v_scale is None else v_scale
        if key is not None and value is not None:
            _ops.reshape_and_cache(
                key.view(-1, self.num_kv_heads, self.head_size),
                value.view(-1, self.num_kv_heads, self.head_size),
                key_cache,
                value_cache,
                metadata.slot_mapping,
                self.kv_cache_dtype,
                k_scale,
                v_scale,
            )
        elif key is not None or value is not None:
            raise ValueError("pass both key and value, or neither (context already cached)")
        out = self._attend(query, key_cache, value_cache, metadata, k_scale, v_scale)
        return out.view(shape)

    def _check_window(self, metadata: AttentionMetadata) -> None:
        kept = metadata.manager_window
        if kept is not None and (self.sliding_window == 0 or self.sliding_window > kept):
            reach = f"the last {self.sliding_window}" if self.sliding_window else "every"
            raise ValueError(
                f"this PagedAttention attends {reach} position(s) but its block manager keeps "
                f"only the last {kept} (BlockManager(sliding_window={kept}) releases older "
                "blocks): give the manager the module's window, or none"
            )

    # ------------------------------------------------------------------ attention

    def _attend(self, query, key_cache, value_cache, metadata, k_scale, v_scale) -> torch.Tensor:
        if query.device.type == "cpu":
            return self._varlen(query, key_cache, value_cache, metadata, k_scale, v_scale)
        return self._attend_gathered(query, key_cache, value_cache, metadata, k_scale, v_scale)

    def _attend_gathered(self, query, key_cache, value_cache, metadata, k_scale, v_scale):
        """The path of devices without a varlen kernel: decode rows through the decode kernel in
        one call, each longer sequence through SDPA over its context gathered from the cache."""
        if self.sinks is not None:
            raise ValueError(
                "attention sinks need the varlen kernel, which has no CUDA implementation in "
                "this build yet"
            )
        if metadata.is_decode:
            return self._decode(
                query,
                key_cache,
                value_cache,
                metadata.block_tables,
                metadata.seq_lens_tensor,
                metadata.max_seq_len,
                k_scale,
                v_scale,
            )
        self._check_context_tables(metadata, key_cache.shape[0], value_cache.shape[3])
        out = torch.empty_like(query)
        starts = [0]
        for n in metadata.query_lens:
            starts.append(starts[-1] + n)
        decode_seqs = [i for i, n in enumerate(metadata.query_lens) if n == 1]
        if decode_seqs:
            # All single-token sequences go through one paged-kernel call.
            rows = torch.tensor(decode_seqs, device=query.device)
            tokens = torch.tensor([starts[i] for i in decode_seqs], device=query.device)
            out[tokens] = self._decode(
                query[tokens],
                key_cache,
                value_cache,
                metadata.block_tables[rows],
                metadata.seq_lens_tensor[rows],
                max(metadata.seq_lens[i] for i in decode_seqs),
                k_scale,
                v_scale,
            )
        for i, (n, seq_len) in enumerate(zip(metadata.query_lens, metadata.seq_lens)):
            if n <= 1:
                continue
            # Only positions some query can attend: a window skips released or stale blocks.
            start = self._first_attended(seq_len, n)
            keys, values = gather_context(
                key_cache,
                value_cache,
                metadata.block_tables[i],
                start,
                seq_len,
                self.kv_cache_dtype,
                k_scale,
                v_scale,
                query.dtype,
            )
            out[starts[i] : starts[i + 1]] = prefill_attention(
                query[starts[i] : starts[i + 1]],
                keys,
                values,
                self.scale,
                self.alibi_slopes,
                self.sliding_window,
                self.logits_soft_cap,
                key_start=start,
            )
        return out

    def _varlen(self, query, key_cache, value_cache, metadata, k_scale, v_scale):
        """Every row of the step in one ``paged_attention_varlen`` call; decode-only steps
        without sinks through the decode kernel, which also splits long contexts (v2)."""
        if metadata.is_decode and self.sinks is None:
            return self._decode(
                query,
                key_cache,
                value_cache,
                metadata.block_tables,
                metadata.seq_lens_tensor,
                metadata.max_seq_len,
                k_scale,
                v_scale,
            )
        return _ops.paged_attention_varlen(
            query,
            key_cache,
            value_cache,
            metadata.block_tables,
            metadata.seq_lens_tensor,
            metadata.query_start_loc,
            scale=self.scale,
            max_query_len=metadata.max_query_len,
            max_seq_len=metadata.max_seq_len,
            alibi_slopes=self.alibi_slopes,
            kv_cache_dtype=self.kv_cache_dtype,
            k_scale=k_scale,
            v_scale=v_scale,
            sliding_window=self.sliding_window,
            logits_soft_cap=self.logits_soft_cap,
            sinks=self.sinks,
        )

    def _first_attended(self, seq_len: int, query_len: int) -> int:
        """The first position any of a sequence's last ``query_len`` tokens attends."""
        if not self.sliding_window:
            return 0
        return max(0, seq_len - query_len - self.sliding_window + 1)

    def _check_context_tables(self, metadata, num_blocks: int, block_size: int) -> None:
        """The checks the decode kernel makes, for the sequences the gather path reads: every
        seq_len within its block table, and (on the CPU, or on CUDA with
        PAGED_ATTENTION_DEBUG_CHECKS=1) every block id it reads in ``[0, num_blocks)``."""
        width = metadata.block_tables.shape[1]
        for i, seq_len in enumerate(metadata.seq_lens):
            if seq_len > width * block_size:
                raise ValueError(
                    f"sequence {i}: seq_len {seq_len} exceeds what its block table addresses "
                    f"({width} blocks of {block_size} tokens)"
                )
        tables = metadata.block_tables
        if tables.device.type != "cpu" and not debug_checks_enabled():
            return
        tables = tables.cpu()
        for i, (n, seq_len) in enumerate(zip(metadata.query_lens, metadata.seq_lens)):
            first = self._first_attended(seq_len, n) // block_size
            row = tables[i, first : -(-seq_len // block_size)]
            bad = ((row < 0) | (row >= num_blocks)).nonzero()
            if bad.numel():
                b = first + int(bad[0, 0])
                raise ValueError(
                    f"block_tables[{i}, {b}] = {int(tables[i, b])} is out of range [0, "
                    f"num_blocks = {num_blocks})"
                )

    def _decode(
        self, query, key_cache, value_cache, block_tables, seq_lens, max_seq_len, k_scale, v_scale
    ):
        return _ops.paged_attention(
            query,
            key_cache,
            value_cache,
            block_tables,
            seq_lens,
            scale=self.scale,
            max_seq_len=max_seq_len,
            alibi_slopes=self.alibi_slopes,
            kv_cache_dtype=self.kv_cache_dtype,
            k_scale=k_scale,
            v_scale=v_scale,
            sliding_window=self.sliding_window,
            logits_soft_cap=self.logits_soft_cap,
        )


def gather_context(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    start: int,
    end: int,
    kv_cache_dtype: str,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of positions ``start .. end - 1`` of one sequence, ``[end - start,
    num_kv_heads, head_size]`` in ``dtype``, read through its block table (one gather per
    cache; blocks wholly before ``start`` are not touched)."""
    _, num_kv_heads, head_size, block_size = value_cache.shape
    first = start // block_size
    blocks = block_table[first : -(-end // block_size)].long()
    keys = key_cache[blocks].permute(0, 3, 1, 2, 4).reshape(-1, num_kv_heads, head_size)
    values = value_cache[blocks].permute(0, 3, 1, 2).reshape(-1, num_kv_heads, head_size)
    offset = start - first * block_size
    keys, values = (
        keys[offset : end - first * block_size],
        values[offset : end - first * block_size],
    )
    if is_fp8(kv_cache_dtype):
        fp8 = FP8_FORMATS[kv_cache_dtype][0]
        keys = keys.view(fp8).float() * k_scale
        values = values.view(fp8).float() * v_scale
    return keys.to(dtype), values.to(dtype)


def prefill_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    scale: float,
    alibi_slopes: torch.Tensor | None = None,
    sliding_window: int = 0,
    logits_soft_cap: float = 0.0,
    key_start: int = 0,
) -> torch.Tensor:
    """Causal attention of the queries at positions ``L - n .. L - 1`` over the keys at
    positions ``key_start .. L - 1``.

    ``query`` ``[n, H, D]``, ``keys``/``values`` ``[L - key_start, Hkv, D]`` (``Hkv`` divides
    ``H``); returns ``[n, H, D]`` in the query's dtype.
    """
    num_queries, num_keys = query.shape[0], keys.shape[0]
    context = num_keys - num_queries  # keys before the first query
    q = query.transpose(0, 1)  # [H, n, D]
    k = keys.transpose(0, 1)  # [Hkv, L, D]
    v = values.transpose(0, 1)
    plain = alibi_slopes is None and logits_soft_cap == 0
    if plain and context == 0 and (sliding_window == 0 or sliding_window >= num_keys):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
        return out.transpose(0, 1)

    positions = torch.arange(num_keys, device=query.device)
    query_positions = positions[context:, None]
    distance = positions[None, :] - query_positions  # [n, L], <= 0 where attended
    allowed = distance <= 0
    if sliding_window > 0:
        allowed &= distance > -sliding_window
    if logits_soft_cap > 0:
        return _soft_capped_attention(
            q, k, v, scale, allowed, distance, alibi_slopes, logits_soft_cap
        ).transpose(0, 1)
    if alibi_slopes is None:
        mask = allowed
    else:
        bias = alibi_slopes.float().to(query.device)[:, None, None] * distance
        mask = bias.masked_fill(~allowed, -math.inf).to(query.dtype)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    return out.transpose(0, 1)


def _soft_capped_attention(q, k, v, scale, allowed, distance, alibi_slopes, cap):
    """Explicit float32 attention for a logit soft-cap, which SDPA cannot apply between the
    product and the softmax."""
    group = q.shape[0] // k.shape[0]
    k = k.float().repeat_interleave(group, dim=0)
    v = v.float().repeat_interleave(group, dim=0)
    logits = scale * torch.matmul(q.float(), k.transpose(1, 2))  # [H, n, L]
    logits = cap * torch.tanh(logits / cap)
    if alibi_slopes is not None:
        logits = logits + alibi_slopes.float().to(q.device)[:, None, None] * distance
    logits = logits.masked_fill(~allowed, -math.inf)
    return torch.matmul(torch.softmax(logits, dim=-1), v).to(q.dtype)
