"""The model runner: carries out a step's block copies and swaps, packs its chunks into one
forward pass of a transformers causal LM over the paged cache, and returns the logits it samples
from.

A step's tokens, decodes first and then prompt chunks, are packed into one row (batch 1) with
their positions; :class:`StepCache` is the ``transformers.Cache`` the model's attention layers
call, and it attends every sequence over its own paged context with one
:class:`~paged_attention.attention.AttentionMetadata` for the whole step. The decode rows' block
tables, seq lens and slots are the ones ``BlockManager.decode_step`` returned when the scheduler
reserved them.
"""

from __future__ import annotations

import torch

from paged_attention.attention import AttentionMetadata
from paged_attention.block_manager import BlockManager
from paged_attention.cache import PagedKVCache
from paged_attention.engine.scheduler import SchedulerOutput
from paged_attention.integrations.transformers import (
    ModelGeometry,
    PagedCacheBase,
    cache_argument_name,
)


class StepCache(PagedCacheBase):
    """The cache of one packed forward pass: every layer stores the step's new keys and values
    at ``metadata.slot_mapping`` and attends through ``metadata``. Set :attr:`metadata` before
    each forward."""

    def __init__(self, model: torch.nn.Module, geometry: ModelGeometry, kv: PagedKVCache) -> None:
        super().__init__(model, geometry, kv)
        self.metadata: AttentionMetadata | None = None

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0  # positions come from position_ids; nothing is read from here

    def get_mask_sizes(self, query_length, layer_idx: int = 0) -> tuple[int, int]:
        if isinstance(query_length, torch.Tensor):
            query_length = query_length.shape[0]
        return int(query_length), 0

    def _attend_layer(self, layer_idx, query, key, value, attention_mask, scale, window, cap):
        batch, num_heads, q_len, head_size = query.shape
        metadata = self.metadata
        if metadata is None:
            raise ValueError("StepCache.metadata must describe the step before the forward pass")
        if batch != 1 or q_len != metadata.num_tokens:
            raise ValueError(
                f"the step packs {metadata.num_tokens} tokens in one row; the forward got input "
                f"of shape [{batch}, {q_len}]"
            )
        packed = [
            t[0].transpose(0, 1).reshape(q_len, t.shape[1], head_size) for t in (query, key, value)
        ]
        out = self._packed_attention(layer_idx, *packed, metadata, scale, window, cap)
        return out.view(1, q_len, num_heads, head_size)


class ModelRunner:
    """Runs ``model`` (switched to the ``"paged_attention"`` implementation by the caller) over
    the paged cache ``kv``, one scheduler step at a time."""

    def __init__(self, model: torch.nn.Module, geometry: ModelGeometry, kv: PagedKVCache) -> None:
        self.model = model
        self.kv = kv
        self.device = geometry.device
        self.cache = StepCache(model, geometry, kv)
        self._cache_argument = cache_argument_name(model)

    def execute_block_ops(self, block_ops: list[tuple[str, list[tuple[int, int]]]]) -> None:
        """The copies and swaps the manager planned, in the order it planned them (a block a
        swap-out frees may be the destination of a later copy)."""
        for kind, pairs in block_ops:
            if kind == "copy":
                self.kv.copy_blocks(pairs)
            elif kind == "swap_out":
                self.kv.swap_out(pairs)
            else:
                self.kv.swap_in(pairs)

    def metadata(self, out: SchedulerOutput, manager: BlockManager) -> AttentionMetadata:
        """One AttentionMetadata for the step's packed rows: the decode rows first, as
        ``decode_step`` described them, then the prompt chunks."""
        window = manager.sliding_window
        query_lens = [1] * len(out.decode) + [c.count for c in out.prefill]
        parts = []  # (block tables, seq lens, slots)
        if out.decode:
            parts.append(out.decode_tensors)
        if out.prefill:
            ids = [c.seq.seq_id for c in out.prefill]
            parts.append(
                (
                    manager.block_tables_tensor(ids),
                    manager.seq_lens_tensor(ids),
                    manager.slot_mapping_tensor(ids, [c.count for c in out.prefill]),
                )
            )
        if len(parts) == 1:
            tables, seq_lens, slots = parts[0]
        else:
            width = max(p[0].shape[1] for p in parts)
            tables = torch.cat(
                [torch.nn.functional.pad(p[0], (0, width - p[0].shape[1])) for p in parts]
            )
            seq_lens = torch.cat([p[1] for p in parts])
            slots = torch.cat([p[2] for p in parts])
        return AttentionMetadata.build(
            query_lens, seq_lens.tolist(), tables, slots, self.device, seq_lens, window
        )

    def run(self, out: SchedulerOutput, manager: BlockManager) -> torch.Tensor:
        """The forward pass of the step's chunks; float32 CPU logits, one row per chunk that
        samples (in chunk order)."""
        tokens: list[int] = []
        positions: list[int] = []
        sample_rows: list[int] = []
        for chunk in out.chunks:
            tokens += chunk.request.token_slice(chunk.seq, chunk.start, chunk.end)
            positions += range(chunk.start, chunk.end)
            if chunk.samples:
                sample_rows.append(len(tokens) - 1)
        self.cache.metadata = self.metadata(out, manager)
        try:
            with torch.inference_mode():
                logits = self.model(
                    input_ids=torch.tensor([tokens], device=self.device),
                    position_ids=torch.tensor([positions], device=self.device),
                    use_cache=True,
                    logits_to_keep=torch.tensor(sample_rows, dtype=torch.long, device=self.device),
                    **{self._cache_argument: self.cache},
                ).logits[0]
        finally:
            self.cache.metadata = None
        return logits.float().cpu()
