"""PagedAttention: a drop-in attention module that keeps its keys and values in a paged KV cache.

A step's input is *packed*: the new tokens of every sequence, one after the other, as ``query
[num_tokens, num_heads, head_size]``, ``key [num_tokens, num_kv_heads, head_size]`` and ``value
[num_tokens, num_kv_heads, v_head_size]`` (``v_head_size = head_size`` but for multi-head latent
attention through transformers' attention interface, whose values are narrower);
:class:`AttentionMetadata` says how many tokens each sequence contributes, how long each sequence
is after the step, where its blocks are and which slot each new token goes to.

``forward`` first stores the new keys and values (``reshape_and_cache``), then computes
attention of every new token against its sequence's whole context in the cache, in one op call
for the whole step, on every device: the decode op (``paged_attention``) when every sequence adds
one token, else ``paged_attention_varlen``, which serves prefill, prompt chunks after a cached
context (a prefix-cache hit, a resumed sequence), multi-token decode and decode rows mixed. On
CUDA both run one kernel design (csrc/cuda/attention/), and neither synchronises with the host,
so a step can be captured in a CUDA graph.

Logit semantics are those of reference.py: ``s = scale * q.k``, then the soft-cap, then ALiBi
``slope * (p - query_position)``, and a sliding window of ``W`` keeps the last ``W`` positions up
to and including the query's own; chunked local attention of ``C`` keeps only the query's own
chunk, positions ``q - q % C .. q`` for the query at ``q``; ``sinks`` add one logit per head to the
softmax's denominator.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from paged_attention.ops import bindings as _ops
from paged_attention.ops.supported import check_head_size, is_fp8


def debug_checks_enabled() -> bool:
    """The switch of the ops' content checks on CUDA (docs/install.md)."""
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
    further back (``None``: every block is kept). ``manager_chunk`` is its attention chunk size:
    it releases blocks wholly before the chunk of a sequence's first new token, so only modules
    with that chunk size may read the cache (``None``: no such release).
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
    manager_chunk: int | None = None

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
        manager_chunk: int | None = None,
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
            manager_chunk=manager_chunk,
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
    last ``W`` positions; ``attention_chunk_size = C > 0`` attends only the query's own chunk of
    ``C`` positions (chunked local attention, as Llama 4's; with a window too, positions both
    allow); ``logits_soft_cap = c > 0`` maps logits to ``c * tanh(s / c)``;
    ``kv_cache_dtype`` is ``"auto"`` or an fp8 format (then pass ``k_scale``/``v_scale`` to
    ``forward``, as :class:`~paged_attention.kv.cache.PagedKVCache` holds them); ``sinks`` is
    ``None`` or ``[num_heads]`` floats, one extra logit per head that only joins the softmax's
    denominator (attention sinks as in gpt-oss); ``v_head_size`` is the values' head size, and
    so the output's, where it differs from the keys' (multi-head latent attention: DeepSeek-V3's
    keys hold 192 dims and its values 128); None: ``head_size``.
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
        attention_chunk_size: int = 0,
        v_head_size: int | None = None,
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
        if attention_chunk_size is None or attention_chunk_size < 0:
            raise ValueError(
                f"attention_chunk_size must be >= 0 (0 = none), got {attention_chunk_size}"
            )
        if logits_soft_cap is None or logits_soft_cap < 0:
            raise ValueError(f"logits_soft_cap must be >= 0 (0 = none), got {logits_soft_cap}")
        check_head_size(head_size, kv_cache_dtype)  # validates the cache format's name too
        v_head_size = head_size if v_head_size is None else v_head_size
        check_head_size(v_head_size, kv_cache_dtype, name="v_head_size")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_size = head_size
        self.v_head_size = v_head_size
        self.scale = float(head_size**-0.5 if scale is None else scale)
        self.sliding_window = int(sliding_window)
        self.attention_chunk_size = int(attention_chunk_size)
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
            f"head_size={self.head_size}, v_head_size={self.v_head_size}, scale={self.scale}, "
            "sliding_window="
            f"{self.sliding_window}, attention_chunk_size={self.attention_chunk_size}, "
            f"logits_soft_cap={self.logits_soft_cap}, "
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
        head_size]``), ``key`` likewise with ``num_kv_heads`` and ``value`` with ``num_kv_heads``
        and ``v_head_size`` (``None`` when they are already in the cache); returns the attention
        output in the shape of ``query`` with ``v_head_size`` for ``head_size``.

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
                    "cache's dequantisation scales, e.g. PagedKVCache.scales(layer))"
                )
        elif k_scale is None or v_scale is None:
            unit = torch.ones(1, dtype=torch.float32, device=key_cache.device)
            k_scale = unit if k_scale is None else k_scale
            v_scale = unit if v_scale is None else v_scale
        if key is not None and value is not None:
            _ops.reshape_and_cache(
                key.view(-1, self.num_kv_heads, self.head_size),
                value.view(-1, self.num_kv_heads, self.v_head_size),
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
        return out.view(*shape[:-1], shape[-1] // self.head_size * self.v_head_size)

    def _check_window(self, metadata: AttentionMetadata) -> None:
        """Refuses a step whose block manager may have released blocks this module reads."""
        kept = metadata.manager_window
        # A query reads at most this many positions back, its own included (0: all of them).
        reach = min(
            (n for n in (self.sliding_window, self.attention_chunk_size) if n > 0), default=0
        )
        if kept is not None and (reach == 0 or reach > kept):
            what = f"the last {reach}" if reach else "every"
            raise ValueError(
                f"this PagedAttention attends {what} position(s) but its block manager keeps "
                f"only the last {kept} (BlockManager(sliding_window={kept}) releases older "
                "blocks): give the manager the module's window, or none"
            )
        chunk = metadata.manager_chunk
        if chunk is not None and self.attention_chunk_size != chunk:
            what = (
                f"in chunks of {self.attention_chunk_size}"
                if self.attention_chunk_size
                else "across chunks"
            )
            raise ValueError(
                f"this PagedAttention attends {what} but its block manager releases the blocks "
                f"before the current chunk of {chunk} positions: give the module the manager's "
                "chunk size, or the manager none"
            )

    # ------------------------------------------------------------------ attention

    def _attend(self, query, key_cache, value_cache, metadata, k_scale, v_scale) -> torch.Tensor:
        """Every row of the step in one op call: the decode op for a decode-only step without
        sinks (it takes a padding row's seq_len of 0, and on the CPU its v2 splits long contexts
        across threads), else ``paged_attention_varlen``."""
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
            attention_chunk_size=self.attention_chunk_size,
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
            attention_chunk_size=self.attention_chunk_size,
        )
