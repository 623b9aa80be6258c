"""A step's attention inputs: host arrays the block manager planned, and the one function that
turns them into the :class:`~paged_attention.attention.AttentionMetadata` the layers read.

Every driver of the paged cache goes through :func:`build_metadata`: the engine's eager steps,
its CUDA-graph and compiled decode steps (over :class:`StaticStepBuffers`), transformers'
``PagedCache`` and ``PagedKVCache.metadata``. What the manager decides stays numpy until here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from paged_attention.attention import AttentionMetadata


@dataclass(frozen=True)
class StepInputs:
    """The packed rows of one step, sequence by sequence: ``query_lens[i]`` new tokens of a
    sequence that holds ``seq_lens[i]`` tokens after the step, its ``block_tables`` row (int32,
    unused entries 0) and the slots of its new tokens in ``slot_mapping`` (int64, -1: store
    nothing). ``sliding_window`` / ``attention_chunk_size``: what the planning manager releases
    (``AttentionMetadata.manager_window`` / ``manager_chunk``)."""

    query_lens: np.ndarray
    seq_lens: np.ndarray
    block_tables: np.ndarray
    slot_mapping: np.ndarray
    sliding_window: int | None = None
    attention_chunk_size: int | None = None

    @classmethod
    def from_manager(
        cls, manager, seq_ids: Sequence[int], query_lens: int | Sequence[int] = 1
    ) -> StepInputs:
        """The inputs of sequences whose last ``query_lens`` tokens are new (their slots
        reserved already); reads ``manager``, changes nothing."""
        seq_ids = list(seq_ids)
        if isinstance(query_lens, (int, np.integer)):
            query_lens = [int(query_lens)] * len(seq_ids)
        query_lens = np.asarray(list(query_lens), dtype=np.int32)
        return cls(
            query_lens,
            manager.seq_lens_array(seq_ids),
            manager.block_tables_array(seq_ids),
            manager.slot_mapping_array(seq_ids, query_lens),
            manager.sliding_window,
            manager.attention_chunk_size,
        )

    @classmethod
    def decode(cls, manager, tables, seq_lens, slots) -> StepInputs:
        """The inputs of a decode step, from what ``manager.decode_step`` returned."""
        ones = np.ones(len(seq_lens), dtype=np.int32)
        reach = manager.sliding_window, manager.attention_chunk_size
        return cls(ones, seq_lens, tables, slots, *reach)

    @staticmethod
    def concat(parts: Sequence[StepInputs]) -> StepInputs:
        """One step of ``parts``' rows in order (block tables padded to the widest)."""
        if len(parts) == 1:
            return parts[0]
        width = max(p.block_tables.shape[1] for p in parts)
        tables = np.concatenate(
            [np.pad(p.block_tables, ((0, 0), (0, width - p.block_tables.shape[1]))) for p in parts]
        )
        first = parts[0]
        return StepInputs(
            np.concatenate([p.query_lens for p in parts]),
            np.concatenate([p.seq_lens for p in parts]),
            tables,
            np.concatenate([p.slot_mapping for p in parts]),
            first.sliding_window,
            first.attention_chunk_size,
        )

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)


class StaticStepBuffers:
    """Device buffers of a decode step of up to ``max_batch`` sequences whose addresses never
    change, what a CUDA graph or a compiled step captures: ids, positions, block tables
    ``max_seq_len`` wide, seq lens and slots. Padding rows (seq_len 0, slot -1) store and attend
    nothing."""

    def __init__(
        self, max_batch: int, max_seq_len: int, block_size: int, device, reach=(None, None)
    ) -> None:
        self.max_batch = max_batch
        self.max_seq_len = max_seq_len
        self.max_blocks = -(-max_seq_len // block_size)
        self.sliding_window, self.attention_chunk_size = reach
        self.input_ids = torch.zeros(1, max_batch, dtype=torch.long, device=device)
        self.positions = torch.zeros(1, max_batch, dtype=torch.long, device=device)
        self.block_tables = torch.zeros(
            max_batch, self.max_blocks, dtype=torch.int32, device=device
        )
        self.seq_lens = torch.zeros(max_batch, dtype=torch.int32, device=device)
        self.slots = torch.full((max_batch,), -1, dtype=torch.int64, device=device)
        self.query_start_loc = torch.arange(max_batch + 1, dtype=torch.int32, device=device)

    def fits(self, inputs: StepInputs) -> bool:
        return (
            0 < inputs.num_seqs <= self.max_batch
            and bool((inputs.query_lens == 1).all())
            and inputs.block_tables.shape[1] <= self.max_blocks
            and int(inputs.seq_lens.max()) <= self.max_seq_len
        )

    def fill(self, inputs: StepInputs, tokens: Sequence[int], size: int) -> None:
        """Copy a decode step (``tokens``: each sequence's newest token) into the first rows;
        rows up to ``size`` become padding."""
        batch = inputs.num_seqs
        self.pad(size, start=batch)
        width = inputs.block_tables.shape[1]
        copies = (
            (self.input_ids[0, :batch], np.asarray(tokens, dtype=np.int64)),
            (self.positions[0, :batch], inputs.seq_lens.astype(np.int64) - 1),
            (self.block_tables[:batch, :width], inputs.block_tables),
            (self.seq_lens[:batch], inputs.seq_lens),
            (self.slots[:batch], inputs.slot_mapping),
        )
        for buffer, values in copies:
            buffer.copy_(torch.from_numpy(np.ascontiguousarray(values)), non_blocking=True)

    def pad(self, size: int, start: int = 0) -> None:
        """Rows ``start`` to ``size`` become padding (seq_len 0, slot -1: they store and attend
        nothing); the block tables of all ``size`` rows are cleared."""
        self.input_ids[0, start:size] = 0
        self.positions[0, start:size] = 0
        self.block_tables[:size].zero_()
        self.seq_lens[start:size] = 0
        self.slots[start:size] = -1


def build_metadata(
    inputs: StepInputs | None,
    device: torch.device | str,
    *,
    static: StaticStepBuffers | None = None,
    size: int | None = None,
) -> AttentionMetadata:
    """The :class:`AttentionMetadata` of a step. ``inputs`` on their own: fresh tensors on
    ``device``, lengths from the step. With ``static``: the metadata of its first ``size`` rows
    (a captured step; ``inputs`` must then be None, filled before with
    :meth:`StaticStepBuffers.fill`): every row one token, with the buffers' ``max_seq_len``, so
    that one capture serves every step of its batch size."""
    if static is not None:
        if inputs is not None or size is None:
            raise ValueError("build_metadata over static buffers takes a size, not inputs")
        return AttentionMetadata(
            query_lens=[1] * size,
            seq_lens=[static.max_seq_len] * size,
            block_tables=static.block_tables[:size],
            seq_lens_tensor=static.seq_lens[:size],
            slot_mapping=static.slots[:size],
            max_seq_len=static.max_seq_len,
            query_start_loc=static.query_start_loc[: size + 1],
            max_query_len=1,
            manager_window=static.sliding_window,
            manager_chunk=static.attention_chunk_size,
        )
    if inputs is None:
        raise ValueError("build_metadata needs the step's inputs or static buffers")
    return AttentionMetadata.build(
        inputs.query_lens.tolist(),
        inputs.seq_lens.tolist(),
        torch.from_numpy(np.ascontiguousarray(inputs.block_tables, dtype=np.int32)),
        torch.from_numpy(np.ascontiguousarray(inputs.slot_mapping, dtype=np.int64)),
        device,
        torch.from_numpy(np.ascontiguousarray(inputs.seq_lens, dtype=np.int32)),
        inputs.sliding_window,
        inputs.attention_chunk_size,
    )
