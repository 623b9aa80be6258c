"""Swapping: whole sequences move between the device pool and the host pool.

Blocks shared inside the swapped set move once and stay shared. A block also referenced by a
sequence outside the set is *copied*: the swapped sequences get their own copy on the other side
and the original keeps its other references (vLLM's behaviour; refusing would make any sequence
that shares a cached prompt prefix impossible to swap). Host copies never enter the prefix
cache. The block manager decides when (``can_swap_out``, ``can_swap_in`` with its watermark);
:class:`SwapSpace` does the moves, each checked before anything changes.
"""

from __future__ import annotations

import numpy as np

from paged_attention.kv.block_errors import OutOfBlocksError
from paged_attention.kv.block_pool import BlockPool, CachingBlockPool
from paged_attention.kv.block_tables import BlockTables, PrefixChains


class SwapSpace:
    """The host pool and the moves of whole sequences between it and the device pool, keeping
    the block tables and the prefix chains in step."""

    def __init__(
        self,
        tables: BlockTables,
        device: CachingBlockPool,
        host: BlockPool,
        prefixes: PrefixChains,
    ) -> None:
        self.host = host
        self._tables = tables
        self._device = device
        self._prefixes = prefixes

    def blocks_to_move(self, seq_ids: list[int], on_host: bool) -> int:
        """The distinct blocks moving if ``seq_ids`` (all on the host, or all on the device, as
        ``on_host`` says) swap; raises as ``swap_out``/``swap_in`` would for bad ids."""
        return self._tables.num_distinct_blocks(self._tables.swap_rows(seq_ids, on_host))

    def swap_out(self, seq_ids: list[int]) -> list[tuple[int, int]]:
        """Move sequences to host blocks; the ``(device, host)`` blocks to copy."""
        rows = self._tables.swap_rows(seq_ids, on_host=False)
        needed, free = self._tables.num_distinct_blocks(rows), self.host.num_free()
        if needed > free:
            raise OutOfBlocksError(
                f"swapping out {seq_ids} needs {needed} host blocks, {free} free"
            )
        self._prefixes.end(seq_ids)
        return self._move(rows, self._device, self.host)

    def swap_in(self, seq_ids: list[int]) -> list[tuple[int, int]]:
        """Move swapped sequences back to the device; the ``(host, device)`` blocks to copy."""
        rows = self._tables.swap_rows(seq_ids, on_host=True)
        needed = self._tables.num_distinct_blocks(rows)
        self._device.check_room(needed, 0, "swapping in {}", seq_ids)
        return self._move(rows, self.host, self._device)

    def drop_host_rows(self, rows: np.ndarray) -> np.ndarray:
        """Drop the host blocks of the swapped-out rows among ``rows`` (sequences being freed);
        the other rows, which are on the device."""
        on_host = self._tables.on_host[rows]
        if not on_host.any():
            return rows
        self.host.drop(self._tables.live_entries(rows[on_host]))
        return rows[~on_host]

    def _move(self, rows: np.ndarray, source: BlockPool, dest: BlockPool):
        """Move ``rows``' blocks from pool ``source`` to pool ``dest``; the ``(from, to)``
        pairs."""
        mapping = source.transfer(self._tables.live_entries(rows), dest)
        self._tables.move_rows(rows, mapping, on_host=dest is self.host)
        return list(mapping.items())
