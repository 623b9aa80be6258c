"""Per-sequence state: block tables kept in preallocated numpy rows, and prefix chains.

One row per live sequence holds its table (logical block -> physical block), its length, its
number of table entries, how many of the first entries were released (no layer reads them any
more: :class:`Reach`), and whether it is swapped out; rows are reused after a free and the
arrays double when full, so a step over a batch is a few vectorised operations on these arrays.
A table entry is a block id of the pool the sequence is in; unused and released entries hold 0.
The tables know nothing of reference counts: the block manager keeps the pools in step with
them. ``PrefixChains`` keeps, for each sequence
whose token ids are known, where its next full block hangs in the prefix cache.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from paged_attention.kv.block_errors import (
    DoubleFreeError,
    DuplicateSequenceError,
    OutOfBlocksError,
    SwapError,
    UnknownSequenceError,
)
from paged_attention.kv.block_pool import CachingBlockPool, PrefixChain

RELEASED = -1
"""Marks a table entry whose block was released (no layer reads it), in ``block_table`` lists."""

_MAX_REMEMBERED_FREES = 1 << 16  # freed ids kept to tell a double free from an unknown id


@dataclass(frozen=True)
class Reach:
    """How far back the token at position ``p`` reads: with a sliding window ``W``, the last
    ``W`` positions (from ``p - W + 1``); with chunked attention of ``C`` positions, its own chunk
    (from ``p - p % C``, Llama 4's local layers). A model whose layers do one or the other reads
    from the earlier of the two; with neither, from position 0 (nothing is ever released)."""

    sliding_window: int | None = None
    attention_chunk_size: int | None = None

    @property
    def releases(self) -> bool:
        return self.sliding_window is not None or self.attention_chunk_size is not None

    def first_read(self, positions: np.ndarray) -> np.ndarray:
        """The first position the tokens at ``positions`` (int64) read."""
        first = np.full_like(positions, np.iinfo(np.int64).max)
        if self.sliding_window is not None:
            first = np.minimum(first, np.maximum(positions + 1 - self.sliding_window, 0))
        if self.attention_chunk_size is not None:
            first = np.minimum(first, positions - positions % self.attention_chunk_size)
        return first if self.releases else np.zeros_like(positions)

    def shortest_reading_from(self, position: int) -> int:
        """The fewest tokens a sequence may hold for its next token to read nothing before
        ``position``."""
        least = position
        if self.sliding_window is not None:
            least = max(least, position + self.sliding_window - 1)
        if self.attention_chunk_size is not None:
            chunk = self.attention_chunk_size
            least = max(least, -(-position // chunk) * chunk)
        return least

    def describe(self) -> str:
        parts = []
        if self.sliding_window is not None:
            parts.append(f"sliding window of {self.sliding_window}")
        if self.attention_chunk_size is not None:
            parts.append(f"attention chunks of {self.attention_chunk_size}")
        return " and ".join(parts)


class BlockTables:
    """The numpy rows of every live sequence. Lookups check the ids: an unknown, repeated or
    (for device work) swapped-out sequence raises the block manager's error for it before
    anything changes."""

    def __init__(self, block_size: int, max_blocks_per_seq: int | None) -> None:
        self.block_size = block_size
        self.max_blocks_per_seq = max_blocks_per_seq
        self.row_of: dict[int, int] = {}
        self.freed_ids: OrderedDict[int, None] = OrderedDict()
        capacity = 64
        self._free_rows = list(range(capacity - 1, -1, -1))  # popped lowest first
        width = min(16, max_blocks_per_seq or 16)
        self.table = np.zeros((capacity, width), dtype=np.int32)
        self.seq_lens = np.zeros(capacity, dtype=np.int64)
        self.num_blocks = np.zeros(capacity, dtype=np.int64)  # table entries, released included
        self.num_released = np.zeros(capacity, dtype=np.int64)
        self.on_host = np.zeros(capacity, dtype=bool)

    # ------------------------------------------------------------------ checked lookups

    def row(self, seq_id: int) -> int:
        try:
            return self.row_of[seq_id]
        except KeyError:
            raise UnknownSequenceError(f"unknown sequence {seq_id}") from None

    def device_row(self, seq_id: int) -> int:
        row = self.row(seq_id)
        if self.on_host[row]:
            raise SwapError(f"sequence {seq_id} is swapped out to the host")
        return row

    def rows(self, seq_ids: Sequence[int]) -> np.ndarray:
        row_of = self.row_of
        try:
            return np.array([row_of[s] for s in seq_ids], dtype=np.int64)
        except KeyError as e:
            raise UnknownSequenceError(f"unknown sequence {e.args[0]}") from None

    def device_rows(self, seq_ids: Sequence[int]) -> np.ndarray:
        rows = self.rows(seq_ids)
        if self.on_host[rows].any():
            swapped = [s for s, r in zip(seq_ids, rows) if self.on_host[r]]
            raise SwapError(f"sequences {swapped} are swapped out to the host")
        return rows

    def swap_rows(self, seq_ids: list[int], on_host: bool) -> np.ndarray:
        """Rows of distinct sequences that are all on the host (``on_host``) or the device."""
        if len(set(seq_ids)) != len(seq_ids):
            raise DuplicateSequenceError(f"a sequence appears twice in {seq_ids}")
        rows = self.rows(seq_ids)
        wrong = [s for s, r in zip(seq_ids, rows) if self.on_host[r] != on_host]
        if wrong:
            where = "on the device" if not on_host else "swapped out"
            raise SwapError(f"sequences {wrong} are not {where}")
        return rows

    def rows_to_free(self, seq_ids: list[int]) -> np.ndarray:
        """Rows of distinct live sequences; a freed id is a double free, not an unknown one."""
        for seq_id in seq_ids:
            if seq_id not in self.row_of:
                if seq_id in self.freed_ids:
                    raise DoubleFreeError(f"sequence {seq_id} was already freed")
                raise UnknownSequenceError(f"unknown sequence {seq_id}")
        if len(set(seq_ids)) != len(seq_ids):
            raise DoubleFreeError(f"a sequence appears twice in {seq_ids}")
        return self.rows(seq_ids)

    def table_of(self, seq_id: int, on_host: bool) -> list[int]:
        """A sequence's table as a list, RELEASED for released entries; it must be on the host
        (``on_host``) or on the device."""
        row = self.row(seq_id)
        if self.on_host[row] != on_host:
            use = "block_table" if on_host else "host_block_table"
            where = "on the device" if on_host else "swapped out"
            raise SwapError(f"sequence {seq_id} is {where}; use {use}")
        table = self.table[row, : self.num_blocks[row]].tolist()
        table[: self.num_released[row]] = [RELEASED] * int(self.num_released[row])
        return table

    def fits(self, num_blocks: int) -> bool:
        return self.max_blocks_per_seq is None or num_blocks <= self.max_blocks_per_seq

    def check_fits(self, seq_id: int, num_blocks: int) -> None:
        if not self.fits(num_blocks):
            raise OutOfBlocksError(
                f"sequence {seq_id} would need {num_blocks} blocks, more than "
                f"max_blocks_per_seq={self.max_blocks_per_seq}"
            )

    def check_cut(self, seq_id: int, row: int, num_tokens: int, reach: Reach) -> None:
        """Whether a sequence can be cut to ``num_tokens``: no longer than it is, and the token
        computed next must not read a released block."""
        length, released = int(self.seq_lens[row]), int(self.num_released[row])
        if num_tokens > length:
            raise ValueError(f"sequence {seq_id} has {length} tokens, cannot keep {num_tokens}")
        first = int(reach.first_read(np.array([num_tokens]))[0])
        if released and first // self.block_size < released:
            least = reach.shortest_reading_from(released * self.block_size)
            raise ValueError(
                f"cannot truncate sequence {seq_id} to {num_tokens} tokens: its first "
                f"{released} blocks were released (a {reach.describe()}) and the next token "
                f"would attend them; keep at least {least} tokens"
            )

    # ------------------------------------------------------------------ rows

    def live_rows(self) -> np.ndarray:
        return np.fromiter(self.row_of.values(), dtype=np.int64, count=len(self.row_of))

    def add(self, seq_id: int, blocks: list[int], num_tokens: int) -> int:
        """A row for a new sequence of ``num_tokens`` tokens held in ``blocks``."""
        row = self._new_row(seq_id)
        self.extend(row, blocks, num_tokens)
        return row

    def _new_row(self, seq_id: int) -> int:
        if not self._free_rows:
            old = self.seq_lens.size
            self.table = np.concatenate([self.table, np.zeros_like(self.table)])
            for name in ("seq_lens", "num_blocks", "num_released", "on_host"):
                array = getattr(self, name)
                setattr(self, name, np.concatenate([array, np.zeros_like(array)]))
            self._free_rows.extend(range(2 * old - 1, old - 1, -1))
        row = self._free_rows.pop()
        self.row_of[seq_id] = row
        self.freed_ids.pop(seq_id, None)
        return row

    def fork(self, parent_ids: Sequence[int], child_ids: Sequence[int]) -> np.ndarray:
        """Rows for new sequences ``child_ids``, copies of the rows of ``parent_ids`` (which
        are on the device)."""
        parents = self.device_rows(parent_ids)
        existing = [c for c in child_ids if c in self.row_of]
        if existing or len(set(child_ids)) != len(child_ids):
            raise DuplicateSequenceError(
                f"cannot fork {list(parent_ids)} into existing or repeated children {existing}"
            )
        children = np.array([self._new_row(c) for c in child_ids], dtype=np.int64)
        self.table[children] = self.table[parents]
        for array in (self.seq_lens, self.num_blocks, self.num_released):
            array[children] = array[parents]
        return children

    def remove(self, seq_ids: Sequence[int], rows: np.ndarray) -> None:
        """Forget sequences (their blocks' references are the caller's to drop first)."""
        self.table[rows] = 0
        for array in (self.seq_lens, self.num_blocks, self.num_released, self.on_host):
            array[rows] = 0
        self._free_rows.extend(rows.tolist())
        for seq_id in seq_ids:
            del self.row_of[seq_id]
            self.freed_ids[seq_id] = None
        while len(self.freed_ids) > _MAX_REMEMBERED_FREES:
            self.freed_ids.popitem(last=False)

    def ensure_width(self, num_blocks: int) -> None:
        width = self.table.shape[1]
        if num_blocks > width:
            new_width = max(num_blocks, 2 * width)
            if self.max_blocks_per_seq is not None:
                new_width = min(new_width, self.max_blocks_per_seq)
            grown = np.zeros((self.table.shape[0], new_width), dtype=np.int32)
            grown[:, :width] = self.table
            self.table = grown

    def extend(self, row: int, blocks: list[int], num_tokens: int) -> None:
        """Append ``blocks`` to a row, which now holds ``num_tokens`` tokens."""
        start = int(self.num_blocks[row])
        self.ensure_width(start + len(blocks))
        self.table[row, start : start + len(blocks)] = blocks
        self.num_blocks[row] = start + len(blocks)
        self.seq_lens[row] = num_tokens

    def extend_rows(self, rows: np.ndarray, blocks: list[int], width: int) -> None:
        """Append one block to each of ``rows``, the widest of which then has ``width``."""
        self.ensure_width(width)
        self.table[rows, self.num_blocks[rows]] = blocks
        self.num_blocks[rows] += 1

    def replace_last(self, rows: np.ndarray, blocks: list[int]) -> None:
        """Point the last entry of each of ``rows`` at the matching one of ``blocks``."""
        self.table[rows, self.num_blocks[rows] - 1] = blocks

    def releases(self, row: int, position: int, reach: Reach) -> np.ndarray:
        """The live entries of a row wholly before what the token computed next, at
        ``position``, reads (``reach``): a view of the row."""
        if not reach.releases:
            return self.table[row, :0]
        keep_from = int(reach.first_read(np.array([position]))[0]) // self.block_size
        return self.table[row, self.num_released[row] : keep_from]

    def rows_releasing(
        self, rows: np.ndarray, positions: np.ndarray, reach: Reach
    ) -> tuple[list[int], list[np.ndarray]]:
        """``releases`` for a batch whose next tokens sit at ``positions``: the rows that
        release entries, and those entries."""
        if not reach.releases:
            return [], []
        keep_from = reach.first_read(positions) // self.block_size
        releasing = np.flatnonzero(keep_from > self.num_released[rows])
        return rows[releasing].tolist(), [
            self.releases(int(rows[i]), int(positions[i]), reach) for i in releasing
        ]

    def release(self, row: int, entries: np.ndarray) -> np.ndarray:
        """Mark the first live ``entries`` of a row (a view from ``releases``) released;
        their blocks, for the caller to drop."""
        blocks = entries.copy()
        start = self.num_released[row]
        self.table[row, start : start + blocks.size] = 0
        self.num_released[row] += blocks.size
        return blocks

    def cut(self, row: int, num_blocks: int, num_tokens: int) -> np.ndarray:
        """Keep a row's first ``num_blocks`` entries and ``num_tokens`` tokens; the removed
        entries' blocks, for the caller to drop."""
        end = int(self.num_blocks[row])
        removed = self.table[row, num_blocks:end].copy()
        self.table[row, num_blocks:end] = 0
        self.num_blocks[row] = num_blocks
        self.seq_lens[row] = num_tokens
        return removed

    # ------------------------------------------------------------------ vectorised queries

    def live_mask(self, rows: np.ndarray) -> np.ndarray:
        """For ``rows``' tables cut to the widest: which entries hold a (not released) block."""
        counts = self.num_blocks[rows]
        columns = np.arange(int(counts.max()) if rows.size else 0)
        return (columns >= self.num_released[rows][:, None]) & (columns < counts[:, None])

    def live_entries(self, rows: np.ndarray) -> np.ndarray:
        """The blocks in ``rows``' live table entries, row after row (a block may repeat)."""
        if rows.size == 1:  # the common single-sequence case needs no mask
            row = rows[0]
            return self.table[row, self.num_released[row] : self.num_blocks[row]].copy()
        live = self.live_mask(rows)
        return self.table[rows, : live.shape[1]][live]

    def batch_table(self, rows: np.ndarray, pad: int) -> np.ndarray:
        """``rows``' tables cut to the widest; unused and released entries hold ``pad``."""
        width = int(self.num_blocks[rows].max()) if rows.size else 0
        table = self.table[rows, :width]
        if pad != 0:
            table[~self.live_mask(rows)] = pad
        return table

    def num_distinct_blocks(self, rows: np.ndarray) -> int:
        return np.unique(self.live_entries(rows)).size

    def move_rows(self, rows: np.ndarray, mapping: dict[int, int], on_host: bool) -> None:
        """Point ``rows``' live entries at ``mapping[old block]``, in the other pool."""
        live = self.live_mask(rows)
        table = self.table[rows, : live.shape[1]]
        table[live] = np.array([mapping[b] for b in table[live].tolist()], dtype=np.int32)
        self.table[rows, : live.shape[1]] = table
        self.on_host[rows] = on_host

    def slots(self, rows: np.ndarray, counts: np.ndarray) -> np.ndarray:
        """int64 slots of the last ``counts[i]`` tokens of each row, row after row; -1 (skip)
        for a token whose block was released."""
        size = self.block_size
        lens = self.seq_lens[rows]
        token_rows = np.repeat(rows, counts)
        starts = np.repeat(np.cumsum(counts) - counts, counts)
        positions = np.repeat(lens - counts, counts) + np.arange(token_rows.size) - starts
        block_index = positions // size
        slots = self.table[token_rows, block_index] * np.int64(size)
        slots += positions % size
        slots[block_index < self.num_released[token_rows]] = -1
        return slots

    def partial_last_blocks(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The partly filled last blocks of ``rows`` and how many tokens each row holds there
        (every other live entry holds ``block_size`` tokens)."""
        lens, num_blocks = self.seq_lens[rows], self.num_blocks[rows]
        partial = (lens % self.block_size != 0) & (num_blocks > self.num_released[rows])
        blocks = self.table[rows[partial], num_blocks[partial] - 1]
        return blocks, lens[partial] % self.block_size


class PrefixChains:
    """Each sequence's place in the prefix cache: its chain while its token ids are known and
    prefix caching is on (unknown ids, a hash collision or a swap-out end it: its later blocks
    are not cached), and how many of its prompt tokens the cache served."""

    def __init__(self, pool: CachingBlockPool, enabled: bool) -> None:
        self.pool = pool
        self.enabled = enabled
        self.chains: dict[int, PrefixChain] = {}
        self.cached_tokens: dict[int, int] = {}

    def lookup(self, tokens: list[int] | None) -> tuple[list[int], PrefixChain | None]:
        """The pool's prefix hits for ``tokens`` and the chain to continue (none for a count
        or without prefix caching)."""
        if tokens is None or not self.enabled:
            return [], None
        return self.pool.lookup(tokens)

    def start(self, seq_id: int, hits: list[int], chain, blocks: list[int], tokens) -> None:
        """A new sequence holding ``tokens`` (None: a count): the ``hits``, then ``blocks``."""
        cached = len(hits) * self.pool.block_size
        if hits:
            self.cached_tokens[seq_id] = cached
        if chain is not None and self.pool.register(chain, blocks, tokens[cached:]):
            self.chains[seq_id] = chain

    def record(self, seq_id: int, tables: BlockTables, row: int, old_len: int, tokens) -> None:
        """Feed the ids of the tokens after the first ``old_len`` (None: unknown) to the
        sequence's chain, registering the blocks they fill."""
        chain = self.chains.get(seq_id)
        if chain is None:
            return
        size = self.pool.block_size
        if tokens is None:
            del self.chains[seq_id]
        elif len(chain.pending) + len(tokens) < size:
            chain.pending.extend(tokens)
        else:
            first_block = (old_len - len(chain.pending)) // size
            blocks = tables.table[row, first_block : tables.num_blocks[row]].tolist()
            if not self.pool.register(chain, blocks, chain.pending + list(tokens)):
                del self.chains[seq_id]

    def record_each(self, seq_ids, tables: BlockTables, rows, old_lens, tokens) -> None:
        """``record`` one token per sequence (``tokens[i]``, or unknown ids)."""
        for i, (seq_id, row) in enumerate(zip(seq_ids, rows.tolist())):
            new = None if tokens is None else [tokens[i]]
            self.record(seq_id, tables, row, int(old_lens[i]), new)

    def fork(self, parent_ids: Sequence[int], child_ids: Sequence[int]) -> None:
        for parent_id, child_id in zip(parent_ids, child_ids):
            if parent_id in self.cached_tokens:
                self.cached_tokens[child_id] = self.cached_tokens[parent_id]
            if parent_id in self.chains:
                self.chains[child_id] = self.chains[parent_id].copy()

    def end(self, seq_ids: Sequence[int]) -> None:
        """End the sequences' chains."""
        for seq_id in seq_ids:
            self.chains.pop(seq_id, None)

    def forget(self, seq_ids: Sequence[int]) -> None:
        for seq_id in seq_ids:
            self.chains.pop(seq_id, None)
            self.cached_tokens.pop(seq_id, None)

    def cached_copy(self, seq_id: int, last_block: int, num_tokens: int) -> int | None:
        """Another cached block holding the tokens of the sequence's full last block (the one
        its chain links to when ``allocate`` found the block already cached), or None."""
        chain = self.chains.get(seq_id)
        if (
            chain is None
            or not chain.links
            or len(chain.links) * self.pool.block_size != num_tokens
        ):
            return None
        cached = self.pool.block_of(chain.links[-1])
        return None if cached in (None, last_block) else cached

    def cut(self, seq_id: int, num_tokens: int) -> None:
        """A sequence now holds only its first ``num_tokens`` tokens."""
        if seq_id in self.chains:
            self.chains[seq_id].cut(num_tokens, self.pool.block_size)
        if self.cached_tokens.get(seq_id, 0) > num_tokens:
            self.cached_tokens[seq_id] = num_tokens
