"""Block manager: decides which KV-cache block and slot holds every token.

The cache is a pool of ``num_device_blocks`` fixed-size blocks on the device (and optionally
``num_host_blocks`` on the host for swapping). Each sequence owns a block table: the list of
physical blocks holding its tokens in order, so token ``p`` lives in slot
``table[p // block_size] * block_size + p % block_size``.

Bookkeeping, following vLLM v0 and nano-vllm:

* Every physical block has a reference count: the number of sequence tables pointing at it.
  ``fork`` shares all of a parent's blocks with the child; appending into a shared, partly
  filled last block first copies it (copy-on-write), returning the ``(src, dst)`` pair for the
  caller to copy. A full shared block is never written, so it is never copied. ``fork_many``
  and ``free_many`` do the same for many sequences in one vectorised call (beam reordering).
* With ``enable_prefix_caching`` every full block whose token ids are known is registered under
  a chained hash of its tokens and its predecessor's hash. ``allocate`` reuses registered
  blocks for a matching prompt prefix. A hit is verified against the stored tokens and the
  identity of the predecessor block, so a hash collision can never alias two prefixes.
  Unreferenced registered blocks stay cached and count as free; they are evicted
  least-recently-used when a fresh block is needed. A block is registered as soon as its tokens
  are known; its KV is written by the sequence's next forward pass (sequences that hit it in
  the same batch read it after the cache write of each layer). Free a sequence whose forward
  pass never ran with ``free(seq_id, cache=False)``.
* Swapping moves whole sequences between pools. Blocks shared inside the swapped set move once
  and stay shared. A block also referenced by a sequence outside the set is *copied*: the
  swapped sequences get their own copy on the other side and the original keeps its other
  references. (This is vLLM's behaviour; refusing would make any sequence that shares a cached
  prompt prefix impossible to swap.)
* With ``sliding_window=W`` the kernel only reads positions ``p >= seq_len - W``. Appending
  releases the blocks wholly before the window of the first new token (``allocate`` keeps the
  whole prompt: the prompt's own attention reads it). ``block_table`` shows released entries as
  ``RELEASED`` (-1); the tensors show them as the pad block id (0 unless the caller gives
  another), a valid id the kernel never reads, and ``slot_mapping_tensor`` gives -1 (skip).

For speed all per-sequence state lives in preallocated numpy arrays (one table row per live
sequence), so a decode step over a batch is a few vectorised operations, with Python loops only
for sliding-window releases and for recording token ids in the prefix cache. Every public
method validates before it mutates: a call that raises leaves the manager exactly as it was.
"""

from __future__ import annotations

import enum
import itertools
from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

RELEASED = -1
"""Marks a sliding-window entry whose block was released, in ``block_table`` lists."""

_ROOT_HASH = 0
_ROOT_UID = -1
_MAX_REMEMBERED_FREES = 1 << 16  # freed ids kept to tell a double free from an unknown id


class AllocStatus(enum.Enum):
    OK = enum.auto()
    LATER = enum.auto()  # fits once other sequences free blocks
    NEVER = enum.auto()  # needs more blocks than the device pool has minus the watermark


class BlockManagerError(Exception):
    """Base class of the block manager's errors."""


class OutOfBlocksError(BlockManagerError):
    pass


class UnknownSequenceError(BlockManagerError, KeyError):
    def __str__(self) -> str:  # KeyError would print the repr of the message
        return str(self.args[0]) if self.args else ""


class DuplicateSequenceError(BlockManagerError, ValueError):
    pass


class DoubleFreeError(BlockManagerError):
    pass


class SwapError(BlockManagerError):
    pass


@dataclass(frozen=True)
class PoolStats:
    num_blocks: int
    free_blocks: int  # includes cached blocks nobody references (evictable)
    cached_free_blocks: int  # the evictable prefix-cache blocks among free_blocks
    used_blocks: int
    shared_blocks: int  # used blocks referenced by more than one sequence
    tokens_stored: int  # distinct tokens held (a shared block's tokens count once)
    reserved_slots: int  # used_blocks * block_size
    empty_slots: int  # reserved slots holding no token: internal fragmentation
    fragmentation: float  # empty_slots / reserved_slots (0 when nothing is used)
    blocks_saved_by_sharing: int  # table entries minus used blocks


@dataclass(frozen=True)
class BlockManagerStats:
    device: PoolStats
    host: PoolStats
    num_seqs: int
    num_swapped_seqs: int
    bytes_per_block: int
    bytes_saved_by_sharing: int  # (device + host blocks saved) * bytes_per_block


# A prefix-cache entry, a plain tuple because allocate makes thousands (a NamedTuple costs 10x):
# (hash, parent uid, token ids, uid). The parent uid is the predecessor block's entry uid
# (_ROOT_UID for a first block); uids are never reused, so a stale child of an evicted block
# can never match.
_CacheEntry = tuple[int, int, tuple[int, ...], int]


class _PrefixChain:
    """Where a sequence's next full block hangs in the prefix cache."""

    __slots__ = ("hash", "uid", "pending")

    def __init__(self, hash_: int, uid: int, pending: list[int]) -> None:
        self.hash = hash_
        self.uid = uid
        self.pending = pending  # token ids of the partly filled last block

    def copy(self) -> _PrefixChain:
        return _PrefixChain(self.hash, self.uid, list(self.pending))


def _cdiv(a, b):
    return -(-a // b)


def _integer_dtype(array: np.ndarray | torch.Tensor) -> bool:
    if isinstance(array, np.ndarray):
        return array.dtype.kind in "iu"
    dtype = array.dtype
    return not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)


def _as_int(value, name: str, minimum: int | None = 0) -> int:
    """An integer argument of at least ``minimum`` (None: any): an int, a numpy integer or a 0-d
    integer array or tensor. Bools and floats are refused, even integral ones (2.0 is likely a
    bug)."""
    if type(value) is not int:
        integer = isinstance(value, (int, np.integer)) and not isinstance(value, bool)
        if isinstance(value, (np.ndarray, torch.Tensor)):
            integer = value.ndim == 0 and _integer_dtype(value)
        if not integer:
            raise TypeError(f"{name} must be an integer, got {value!r}")
        value = int(value)
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def _as_list(tokens: Sequence[int], name: str = "tokens") -> list[int]:
    """Token ids as a list of ints (from a list, which is only read, a 1-d integer array or
    tensor, or another iterable)."""
    if isinstance(tokens, list):
        return tokens
    if isinstance(tokens, (np.ndarray, torch.Tensor)):
        if tokens.ndim != 1 or not _integer_dtype(tokens):
            raise TypeError(f"{name} must be 1-d integer ids, got {tokens.ndim}-d {tokens.dtype}")
        return tokens.tolist()
    if isinstance(tokens, (str, bytes)) or not isinstance(tokens, Iterable):
        raise TypeError(f"{name} must be token ids, got {tokens!r}")
    return list(tokens)


class BlockManager:
    """Block tables, reference counts and the prefix cache for a paged KV cache (see the
    module docstring for the semantics).

    Sizes and counts (block counts, ``block_size``, ``sliding_window``, ``max_blocks_per_seq``,
    token counts, ``n``) are integers: an ``int``, a numpy integer or a 0-d integer tensor or
    array; a bool or a float (even ``2.0``) raises ``TypeError`` naming the argument, a value out
    of range ``ValueError``. ``watermark`` is the fraction of device blocks ``can_allocate``
    holds back, in ``[0, 1)``. Token ids are a list, a 1-d integer tensor or array, or any
    iterable of ints."""

    def __init__(
        self,
        num_device_blocks: int,
        block_size: int,
        num_host_blocks: int = 0,
        *,
        watermark: float = 0.01,
        enable_prefix_caching: bool = False,
        sliding_window: int | None = None,
        max_blocks_per_seq: int | None = None,
    ) -> None:
        num_device_blocks = _as_int(num_device_blocks, "num_device_blocks", 1)
        block_size = _as_int(block_size, "block_size", 1)
        num_host_blocks = _as_int(num_host_blocks, "num_host_blocks", 0)
        if isinstance(watermark, bool) or not isinstance(watermark, (int, float, np.number)):
            raise TypeError(f"watermark must be a fraction of the device blocks, got {watermark!r}")
        if not 0.0 <= watermark < 1.0:  # NaN fails too
            raise ValueError(f"watermark must be in [0, 1), got {watermark}")
        if sliding_window is not None:
            sliding_window = _as_int(sliding_window, "sliding_window", 1)
        if sliding_window is not None and enable_prefix_caching:
            # A cached prefix block may already have been released by its owner.
            raise ValueError("prefix caching and sliding window cannot be combined")
        if max_blocks_per_seq is not None:
            max_blocks_per_seq = _as_int(max_blocks_per_seq, "max_blocks_per_seq", 1)
        self.num_device_blocks = num_device_blocks
        self.block_size = block_size
        self.num_host_blocks = num_host_blocks
        self.watermark_blocks = int(watermark * num_device_blocks)
        self.enable_prefix_caching = enable_prefix_caching
        self.sliding_window = sliding_window
        self.max_blocks_per_seq = max_blocks_per_seq

        self._device_refs = np.zeros(num_device_blocks, dtype=np.int32)
        self._host_refs = np.zeros(num_host_blocks, dtype=np.int32)
        self._device_free: deque[int] = deque(range(num_device_blocks))
        self._host_free: deque[int] = deque(range(num_host_blocks))

        # Prefix cache: hash -> block, block -> entry, and unreferenced cached blocks in LRU order.
        self._cache_map: dict[int, int] = {}
        self._cache_entries: dict[int, _CacheEntry] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._uids = itertools.count()
        self._chains: dict[int, _PrefixChain] = {}
        self._cached_tokens: dict[int, int] = {}

        # One row per live sequence. Unused and released table entries hold 0.
        self._row_of: dict[int, int] = {}
        capacity = 64
        self._free_rows = list(range(capacity - 1, -1, -1))  # popped lowest first
        width = min(16, max_blocks_per_seq or 16)
        self._table = np.zeros((capacity, width), dtype=np.int32)
        self._seq_lens = np.zeros(capacity, dtype=np.int64)
        self._num_blocks = np.zeros(capacity, dtype=np.int64)  # table entries, released included
        self._num_released = np.zeros(capacity, dtype=np.int64)
        self._on_host = np.zeros(capacity, dtype=bool)
        self._freed_ids: OrderedDict[int, None] = OrderedDict()

    # ------------------------------------------------------------------ queries

    def has_seq(self, seq_id: int) -> bool:
        return seq_id in self._row_of

    def is_swapped(self, seq_id: int) -> bool:
        return bool(self._on_host[self._row(seq_id)])

    def num_tokens(self, seq_id: int) -> int:
        return int(self._seq_lens[self._row(seq_id)])

    def num_cached_tokens(self, seq_id: int) -> int:
        self._row(seq_id)
        return self._cached_tokens.get(seq_id, 0)

    def num_free_device_blocks(self) -> int:
        return len(self._device_free) + len(self._evictable)

    def num_free_host_blocks(self) -> int:
        return len(self._host_free)

    def seq_ids(self) -> list[int]:
        return list(self._row_of)

    def block_table(self, seq_id: int) -> list[int]:
        """Device block ids of a sequence on the device; RELEASED for released entries."""
        row = self._row(seq_id)
        if self._on_host[row]:
            raise SwapError(f"sequence {seq_id} is swapped out; use host_block_table")
        return self._table_list(row)

    def host_block_table(self, seq_id: int) -> list[int]:
        """Host block ids of a swapped-out sequence; RELEASED for released entries."""
        row = self._row(seq_id)
        if not self._on_host[row]:
            raise SwapError(f"sequence {seq_id} is on the device; use block_table")
        return self._table_list(row)

    # ------------------------------------------------------------------ allocation

    def can_allocate(self, num_tokens_or_tokens: int | Sequence[int]) -> AllocStatus:
        num_tokens, tokens = self._token_args(num_tokens_or_tokens)
        num_blocks = _cdiv(num_tokens, self.block_size)
        # Judged without prefix hits, which eviction may take away before the sequence runs.
        too_big = self.num_device_blocks - num_blocks < self.watermark_blocks
        if too_big or not self._fits_table(num_blocks):
            return AllocStatus.NEVER
        hits = self._lookup_prefix(tokens)[0] if tokens is not None else []
        needed = self._blocks_to_take(num_blocks, hits)
        if self.num_free_device_blocks() - needed >= self.watermark_blocks:
            return AllocStatus.OK
        return AllocStatus.LATER

    def allocate(self, seq_id: int, tokens: int | Sequence[int]) -> None:
        """Give a new sequence blocks for its prompt: a token count, or the token ids (which
        enables prefix-cache hits). The watermark is the scheduler's business (can_allocate);
        this only fails when the blocks do not exist."""
        if seq_id in self._row_of:
            raise DuplicateSequenceError(f"sequence {seq_id} is already allocated")
        num_tokens, tokens = self._token_args(tokens)
        num_blocks = _cdiv(num_tokens, self.block_size)
        self._check_table_fits(seq_id, num_blocks)
        hits, chain = self._lookup_prefix(tokens) if tokens is not None else ([], None)
        needed = self._blocks_to_take(num_blocks, hits)
        if needed > self.num_free_device_blocks():
            raise OutOfBlocksError(
                f"allocating sequence {seq_id} ({num_tokens} tokens) needs {needed} device "
                f"blocks, {self.num_free_device_blocks()} free"
            )

        for block in hits:
            self._evictable.pop(block, None)
        self._device_refs[hits] += 1
        fresh = self._take_device_blocks(num_blocks - len(hits))
        self._device_refs[fresh] = 1
        row = self._new_row(seq_id)
        self._ensure_width(num_blocks)
        self._table[row, :num_blocks] = hits + fresh
        self._seq_lens[row] = num_tokens
        self._num_blocks[row] = num_blocks
        if hits:
            self._cached_tokens[seq_id] = len(hits) * self.block_size
        if chain is not None:
            self._chains[seq_id] = chain
            self._register_full_blocks(seq_id, fresh, tokens[len(hits) * self.block_size :])

    def append_slots(
        self, seq_id: int, n: int = 1, tokens: Sequence[int] | None = None
    ) -> list[tuple[int, int]]:
        """Reserve slots for ``n`` new tokens; returns the copy-on-write ``(src, dst)`` pairs.
        ``tokens`` (``n`` ids) keep the sequence's new full blocks eligible for prefix caching."""
        row = self._device_row(seq_id)
        if type(n) is not int:
            n = _as_int(n, "n", minimum=None)
        if n < 0:
            raise ValueError(f"cannot append {n} tokens to sequence {seq_id}")
        if tokens is not None:
            tokens = _as_list(tokens)
            if len(tokens) != n:
                raise ValueError(f"append_slots({seq_id}, n={n}) got {len(tokens)} token ids")
        if n == 0:
            return []
        old_len = int(self._seq_lens[row])
        num_blocks = int(self._num_blocks[row])
        new_blocks = _cdiv(old_len + n, self.block_size) - num_blocks
        self._check_table_fits(seq_id, num_blocks + new_blocks)
        last = int(self._table[row, num_blocks - 1]) if num_blocks else -1
        copy = old_len % self.block_size != 0 and self._device_refs[last] > 1
        released = self._window_releases(row, old_len + 1)
        freed = sum(1 for b in released if self._device_refs[b] == 1)
        needed = new_blocks + copy
        if needed > self.num_free_device_blocks() + freed:
            raise OutOfBlocksError(
                f"appending {n} tokens to sequence {seq_id} needs {needed} device blocks, "
                f"{self.num_free_device_blocks() + freed} free"
            )

        self._release_window(row, released)
        pairs = [self._copy_on_write(row, num_blocks - 1)] if copy else []
        self._ensure_width(num_blocks + new_blocks)
        fresh = self._take_device_blocks(new_blocks)
        self._device_refs[fresh] = 1
        self._table[row, num_blocks : num_blocks + new_blocks] = fresh
        self._num_blocks[row] = num_blocks + new_blocks
        self._seq_lens[row] = old_len + n
        self._record_tokens(seq_id, row, old_len, tokens)
        return pairs

    def fork(self, parent_id: int, child_id: int) -> None:
        """The child shares every block of the parent; nothing is allocated."""
        self.fork_many([parent_id], [child_id])

    def fork_many(self, parent_ids: Sequence[int], child_ids: Sequence[int]) -> None:
        """``fork(p, c)`` for every pair at once (a parent may repeat). With ``free_many`` this
        reorders beams: fork each new beam from its chosen parent, then free the old beams."""
        if len(parent_ids) != len(child_ids):
            raise ValueError(f"fork_many got {len(parent_ids)} parents, {len(child_ids)} children")
        parents = self._device_rows(parent_ids)
        existing = [c for c in child_ids if c in self._row_of]
        if existing or len(set(child_ids)) != len(child_ids):
            raise DuplicateSequenceError(
                f"cannot fork {list(parent_ids)} into existing or repeated children {existing}"
            )
        children = np.array([self._new_row(c) for c in child_ids], dtype=np.int64)
        self._table[children] = self._table[parents]
        for array in (self._seq_lens, self._num_blocks, self._num_released):
            array[children] = array[parents]
        self._add_refs(self._device_refs, self._live_entries(children), 1)
        for parent_id, child_id in zip(parent_ids, child_ids):
            if parent_id in self._cached_tokens:
                self._cached_tokens[child_id] = self._cached_tokens[parent_id]
            if parent_id in self._chains:
                self._chains[child_id] = self._chains[parent_id].copy()

    def free(self, seq_id: int, *, cache: bool = True) -> None:
        """Drop a sequence. ``cache=False`` also forgets its blocks that leave the prefix cache
        unreferenced (for a sequence whose forward pass never wrote them)."""
        self.free_many([seq_id], cache=cache)

    def free_many(self, seq_ids: Iterable[int], *, cache: bool = True) -> None:
        """``free`` for several sequences at once."""
        seq_ids = list(seq_ids)
        for seq_id in seq_ids:
            if seq_id not in self._row_of:
                if seq_id in self._freed_ids:
                    raise DoubleFreeError(f"sequence {seq_id} was already freed")
                raise UnknownSequenceError(f"unknown sequence {seq_id}")
        if len(set(seq_ids)) != len(seq_ids):
            raise DoubleFreeError(f"a sequence appears twice in {seq_ids}")
        rows = self._rows(seq_ids)
        on_host = self._on_host[rows]
        device_rows, host_rows = rows[~on_host], rows[on_host]
        if device_rows.size:
            self._drop_device_refs(self._live_entries(device_rows), cache=cache)
        if host_rows.size:
            self._drop_host_refs(self._live_entries(host_rows))
        self._table[rows] = 0
        for array in (self._seq_lens, self._num_blocks, self._num_released, self._on_host):
            array[rows] = 0
        self._free_rows.extend(rows.tolist())
        for seq_id in seq_ids:
            del self._row_of[seq_id]
            self._cached_tokens.pop(seq_id, None)
            self._chains.pop(seq_id, None)
            self._freed_ids[seq_id] = None
        while len(self._freed_ids) > _MAX_REMEMBERED_FREES:
            self._freed_ids.popitem(last=False)

    # ------------------------------------------------------------------ swapping

    def can_swap_out(self, seq_ids: Iterable[int]) -> bool:
        rows = self._swap_rows(seq_ids, on_host=False)
        return len(self._distinct_blocks(rows)) <= len(self._host_free)

    def swap_out(self, seq_ids: Iterable[int]) -> list[tuple[int, int]]:
        """Move sequences to host blocks; returns the ``(device, host)`` blocks to copy."""
        seq_ids = list(seq_ids)
        rows = self._swap_rows(seq_ids, on_host=False)
        distinct = self._distinct_blocks(rows)
        if len(distinct) > len(self._host_free):
            raise OutOfBlocksError(
                f"swapping out {seq_ids} needs {len(distinct)} host blocks, "
                f"{len(self._host_free)} free"
            )
        mapping = {block: self._host_free.popleft() for block in distinct}
        self._drop_device_refs(self._live_entries(rows), cache=True)
        self._move_rows(rows, mapping, self._host_refs)
        self._on_host[rows] = True
        for seq_id in seq_ids:
            self._chains.pop(seq_id, None)  # host copies never enter the prefix cache
        return list(mapping.items())

    def can_swap_in(self, seq_ids: Iterable[int]) -> AllocStatus:
        needed = len(self._distinct_blocks(self._swap_rows(seq_ids, on_host=True)))
        if self.num_device_blocks - needed < self.watermark_blocks:
            return AllocStatus.NEVER
        if self.num_free_device_blocks() - needed >= self.watermark_blocks:
            return AllocStatus.OK
        return AllocStatus.LATER

    def swap_in(self, seq_ids: Iterable[int]) -> list[tuple[int, int]]:
        """Move swapped sequences back to the device; returns the ``(host, device)`` copies."""
        seq_ids = list(seq_ids)
        rows = self._swap_rows(seq_ids, on_host=True)
        distinct = self._distinct_blocks(rows)
        if len(distinct) > self.num_free_device_blocks():
            raise OutOfBlocksError(
                f"swapping in {seq_ids} needs {len(distinct)} device blocks, "
                f"{self.num_free_device_blocks()} free"
            )
        mapping = dict(zip(distinct, self._take_device_blocks(len(distinct))))
        self._drop_host_refs(self._live_entries(rows))
        self._move_rows(rows, mapping, self._device_refs)
        self._on_host[rows] = False
        return list(mapping.items())

    # ------------------------------------------------------------------ step tensors

    def block_tables_tensor(self, seq_ids: Sequence[int], pad: int = 0) -> torch.Tensor:
        """int32 ``[len(seq_ids), max blocks in the batch]``; unused and released entries
        hold ``pad``."""
        rows = self._device_rows(seq_ids)
        return torch.from_numpy(self._batch_table(rows, pad))

    def seq_lens_tensor(self, seq_ids: Sequence[int]) -> torch.Tensor:
        rows = self._rows(seq_ids)
        return torch.from_numpy(self._seq_lens[rows].astype(np.int32))

    def slot_mapping_tensor(
        self, seq_ids: Sequence[int], num_new_tokens: int | Sequence[int] = 1
    ) -> torch.Tensor:
        """int64 slots of the last ``k`` tokens of each sequence, in ``seq_ids`` order;
        -1 (skip) for a token whose block the sliding window released."""
        rows = self._device_rows(seq_ids)
        counts = self._token_counts(num_new_tokens, rows.size)
        lens = self._seq_lens[rows]
        if ((counts < 0) | (counts > lens)).any():
            bad = int(np.flatnonzero((counts < 0) | (counts > lens))[0])
            raise ValueError(
                f"sequence {seq_ids[bad]} has {lens[bad]} tokens, asked for the last {counts[bad]}"
            )
        token_rows = np.repeat(rows, counts)
        starts = np.repeat(np.cumsum(counts) - counts, counts)
        positions = np.repeat(lens - counts, counts) + np.arange(token_rows.size) - starts
        block_index = positions // self.block_size
        slots = self._table[token_rows, block_index] * np.int64(self.block_size)
        slots += positions % self.block_size
        slots[block_index < self._num_released[token_rows]] = -1
        return torch.from_numpy(slots)

    def decode_step(
        self, seq_ids: Sequence[int], tokens: Sequence[int] | None = None
    ) -> tuple[list[tuple[int, int]], torch.Tensor, torch.Tensor, torch.Tensor]:
        """Append one token to every sequence (``tokens``: their ids, for prefix caching) and
        return ``(cow_pairs, block_tables int32, seq_lens int32, slot_mapping int64)``.
        Equivalent to ``append_slots(s, 1)`` for each sequence, then the three tensors."""
        rows = self._device_rows(seq_ids)
        if len(set(seq_ids)) != len(seq_ids):
            raise DuplicateSequenceError(f"decode_step got a sequence twice: {list(seq_ids)}")
        if tokens is not None:
            tokens = _as_list(tokens)
            if len(tokens) != len(seq_ids):
                raise ValueError(f"decode_step got {len(tokens)} token ids for {len(seq_ids)} seqs")
        size = self.block_size
        lens = self._seq_lens[rows]
        num_blocks = self._num_blocks[rows]
        opens = lens % size == 0
        last = self._table[rows, np.maximum(num_blocks - 1, 0)]
        shared = ~opens & (self._device_refs[last] > 1)
        window = self.sliding_window
        releases = (
            np.maximum(lens + 1 - window, 0) // size > self._num_released[rows]
            if window is not None
            else np.zeros(rows.shape, dtype=bool)
        )
        open_rows = rows[opens]
        widest = int(num_blocks[opens].max()) + 1 if open_rows.size else 0
        if open_rows.size:
            longest = int(np.flatnonzero(opens & (num_blocks + 1 == widest))[0])
            self._check_table_fits(seq_ids[longest], widest)
        copying = self._copy_mask(last[shared])
        copy_rows, copied = rows[shared][copying], last[shared][copying]
        self._check_decode_fits(rows, open_rows.size + copy_rows.size, releases)

        for row in rows[releases].tolist():
            self._release_window(row, self._window_releases(row, int(self._seq_lens[row]) + 1))
        copies = self._take_device_blocks(copy_rows.size)
        if copies:
            self._add_refs(self._device_refs, copied, -1)
            self._device_refs[copies] = 1
            self._table[copy_rows, self._num_blocks[copy_rows] - 1] = copies
        if open_rows.size:
            self._ensure_width(widest)
            fresh = self._take_device_blocks(open_rows.size)
            self._device_refs[fresh] = 1
            self._table[open_rows, self._num_blocks[open_rows]] = fresh
            self._num_blocks[open_rows] += 1
        self._seq_lens[rows] = lens + 1
        if self._chains:
            for i, (seq_id, row) in enumerate(zip(seq_ids, rows.tolist())):
                self._record_tokens(
                    seq_id, row, int(lens[i]), None if tokens is None else [tokens[i]]
                )

        block_tables = self._batch_table(rows, 0)
        slots = self._table[rows, lens // size] * np.int64(size) + lens % size
        return (
            list(zip(copied.tolist(), copies)),
            torch.from_numpy(block_tables),
            torch.from_numpy((lens + 1).astype(np.int32)),
            torch.from_numpy(slots),
        )

    @staticmethod
    def mapping_tensor(pairs: Sequence[tuple[int, int]]) -> torch.Tensor:
        """int64 ``[n, 2]`` copy or swap mapping."""
        return torch.tensor(list(pairs), dtype=torch.int64).reshape(-1, 2)

    # ------------------------------------------------------------------ stats

    def stats(self, bytes_per_block: int = 0) -> BlockManagerStats:
        device_rows = [r for r in self._row_of.values() if not self._on_host[r]]
        host_rows = [r for r in self._row_of.values() if self._on_host[r]]
        device = self._pool_stats(
            device_rows, self._device_refs, len(self._device_free), len(self._evictable)
        )
        host = self._pool_stats(host_rows, self._host_refs, len(self._host_free), 0)
        saved = device.blocks_saved_by_sharing + host.blocks_saved_by_sharing
        return BlockManagerStats(
            device=device,
            host=host,
            num_seqs=len(self._row_of),
            num_swapped_seqs=len(host_rows),
            bytes_per_block=bytes_per_block,
            bytes_saved_by_sharing=saved * bytes_per_block,
        )

    def _pool_stats(
        self, rows: list[int], refs: np.ndarray, num_free: int, num_cached: int
    ) -> PoolStats:
        size = self.block_size
        filled = np.zeros(refs.size, dtype=np.int64)  # tokens held in each block
        for row in rows:
            index = np.arange(self._num_released[row], self._num_blocks[row])
            np.maximum.at(
                filled,
                self._table[row, index],
                np.minimum(size, self._seq_lens[row] - index * size),
            )
        used = int(np.count_nonzero(refs))
        tokens = int(filled.sum())
        reserved = used * size
        return PoolStats(
            num_blocks=refs.size,
            free_blocks=num_free + num_cached,
            cached_free_blocks=num_cached,
            used_blocks=used,
            shared_blocks=int(np.count_nonzero(refs > 1)),
            tokens_stored=tokens,
            reserved_slots=reserved,
            empty_slots=reserved - tokens,
            fragmentation=(reserved - tokens) / reserved if reserved else 0.0,
            blocks_saved_by_sharing=int(refs.sum()) - used,
        )

    # ------------------------------------------------------------------ internals: rows

    def _row(self, seq_id: int) -> int:
        try:
            return self._row_of[seq_id]
        except KeyError:
            raise UnknownSequenceError(f"unknown sequence {seq_id}") from None

    def _device_row(self, seq_id: int) -> int:
        row = self._row(seq_id)
        if self._on_host[row]:
            raise SwapError(f"sequence {seq_id} is swapped out to the host")
        return row

    def _rows(self, seq_ids: Sequence[int]) -> np.ndarray:
        row_of = self._row_of
        try:
            return np.array([row_of[s] for s in seq_ids], dtype=np.int64)
        except KeyError as e:
            raise UnknownSequenceError(f"unknown sequence {e.args[0]}") from None

    def _device_rows(self, seq_ids: Sequence[int]) -> np.ndarray:
        rows = self._rows(seq_ids)
        if self._on_host[rows].any():
            swapped = [s for s, r in zip(seq_ids, rows) if self._on_host[r]]
            raise SwapError(f"sequences {swapped} are swapped out to the host")
        return rows

    def _swap_rows(self, seq_ids: Iterable[int], on_host: bool) -> np.ndarray:
        seq_ids = list(seq_ids)
        if len(set(seq_ids)) != len(seq_ids):
            raise DuplicateSequenceError(f"a sequence appears twice in {seq_ids}")
        rows = self._rows(seq_ids)
        wrong = [s for s, r in zip(seq_ids, rows) if self._on_host[r] != on_host]
        if wrong:
            where = "on the device" if not on_host else "swapped out"
            raise SwapError(f"sequences {wrong} are not {where}")
        return rows

    def _new_row(self, seq_id: int) -> int:
        if not self._free_rows:
            old = self._seq_lens.size
            self._table = np.concatenate([self._table, np.zeros_like(self._table)])
            for name in ("_seq_lens", "_num_blocks", "_num_released", "_on_host"):
                array = getattr(self, name)
                setattr(self, name, np.concatenate([array, np.zeros_like(array)]))
            self._free_rows.extend(range(2 * old - 1, old - 1, -1))
        row = self._free_rows.pop()
        self._row_of[seq_id] = row
        self._freed_ids.pop(seq_id, None)
        return row

    def _fits_table(self, num_blocks: int) -> bool:
        return self.max_blocks_per_seq is None or num_blocks <= self.max_blocks_per_seq

    def _check_table_fits(self, seq_id: int, num_blocks: int) -> None:
        if not self._fits_table(num_blocks):
            raise OutOfBlocksError(
                f"sequence {seq_id} would need {num_blocks} blocks, more than "
                f"max_blocks_per_seq={self.max_blocks_per_seq}"
            )

    def _ensure_width(self, num_blocks: int) -> None:
        width = self._table.shape[1]
        if num_blocks > width:
            new_width = max(num_blocks, 2 * width)
            if self.max_blocks_per_seq is not None:
                new_width = min(new_width, self.max_blocks_per_seq)
            grown = np.zeros((self._table.shape[0], new_width), dtype=np.int32)
            grown[:, :width] = self._table
            self._table = grown

    def _table_list(self, row: int) -> list[int]:
        table = self._table[row, : self._num_blocks[row]].tolist()
        table[: self._num_released[row]] = [RELEASED] * int(self._num_released[row])
        return table

    def _live_mask(self, rows: np.ndarray) -> np.ndarray:
        """For ``rows``' tables cut to the widest: which entries hold a (not released) block."""
        counts = self._num_blocks[rows]
        columns = np.arange(int(counts.max()) if rows.size else 0)
        return (columns >= self._num_released[rows][:, None]) & (columns < counts[:, None])

    def _live_entries(self, rows: np.ndarray) -> np.ndarray:
        """The blocks in ``rows``' live table entries, row after row (a block may repeat)."""
        if rows.size == 1:  # the common single-sequence case needs no mask
            row = rows[0]
            return self._table[row, self._num_released[row] : self._num_blocks[row]].copy()
        live = self._live_mask(rows)
        return self._table[rows, : live.shape[1]][live]

    def _batch_table(self, rows: np.ndarray, pad: int) -> np.ndarray:
        width = int(self._num_blocks[rows].max()) if rows.size else 0
        table = self._table[rows, :width]
        if pad != 0:
            table[~self._live_mask(rows)] = pad
        return table

    def _distinct_blocks(self, rows: np.ndarray) -> list[int]:
        return list(dict.fromkeys(self._live_entries(rows).tolist()))

    def _move_rows(self, rows: np.ndarray, mapping: dict[int, int], new_refs: np.ndarray) -> None:
        """Point ``rows``' live entries at ``mapping[old block]`` in the other pool."""
        live = self._live_mask(rows)
        table = self._table[rows, : live.shape[1]]
        moved = np.array([mapping[b] for b in table[live].tolist()], dtype=np.int32)
        table[live] = moved
        self._table[rows, : live.shape[1]] = table
        self._add_refs(new_refs, moved, 1)

    # ------------------------------------------------------------------ internals: blocks

    def _take_device_blocks(self, count: int) -> list[int]:
        """Pop ``count`` free blocks, evicting least-recently-used cached ones when needed."""
        free = self._device_free
        blocks = [free.popleft() for _ in range(min(count, len(free)))]
        while len(blocks) < count:
            block, _ = self._evictable.popitem(last=False)
            self._uncache(block)
            blocks.append(block)
        return blocks

    @staticmethod
    def _add_refs(refs: np.ndarray, blocks: np.ndarray, delta: int) -> None:
        """``refs[b] += delta`` for every entry ``b`` of ``blocks``, which may repeat a block."""
        if blocks.size > 256:  # ufunc.at is quick on a few entries, bincount on many
            refs += (delta * np.bincount(blocks, minlength=refs.size)).astype(refs.dtype)
        else:
            np.add.at(refs, blocks, delta)

    @staticmethod
    def _drop_refs(refs: np.ndarray, blocks: np.ndarray) -> list[int]:
        """Drop one reference per entry; the blocks left unreferenced, last entries first."""
        if not blocks.size:
            return []
        BlockManager._add_refs(refs, blocks, -1)
        backwards = blocks[::-1]
        return list(dict.fromkeys(backwards[refs[backwards] == 0].tolist()))

    def _drop_device_refs(self, blocks: np.ndarray, cache: bool) -> None:
        # Last entries first, so a chain's later blocks are evicted before its prefix.
        unreferenced = self._drop_refs(self._device_refs, blocks)
        cached = [b for b in unreferenced if b in self._cache_entries]
        if cache:
            self._evictable.update(dict.fromkeys(cached))
            self._device_free.extend(b for b in unreferenced if b not in self._cache_entries)
        else:
            for block in cached:
                self._uncache(block)
            self._device_free.extend(unreferenced)

    def _uncache(self, block: int) -> None:
        del self._cache_map[self._cache_entries.pop(block)[0]]

    def _drop_host_refs(self, blocks: np.ndarray) -> None:
        self._host_free.extend(self._drop_refs(self._host_refs, blocks))

    def _copy_on_write(self, row: int, index: int) -> tuple[int, int]:
        old = int(self._table[row, index])
        (new,) = self._take_device_blocks(1)
        self._device_refs[old] -= 1
        self._device_refs[new] = 1
        self._table[row, index] = new
        return old, new

    def _copy_mask(self, last_blocks: np.ndarray) -> np.ndarray:
        """Which of a batch's appends into shared last blocks copy, taken in batch order: every
        sharer copies except the last one in the batch when no one outside it holds the block."""
        if not last_blocks.size:
            return np.zeros(0, dtype=bool)
        _, group, group_sizes = np.unique(last_blocks, return_inverse=True, return_counts=True)
        order = np.argsort(group, kind="stable")
        rank = np.empty_like(order)  # position among the batch's sharers of the same block
        rank[order] = np.arange(order.size) - np.repeat(
            np.cumsum(group_sizes) - group_sizes, group_sizes
        )
        in_batch = group_sizes[group]
        return (rank < in_batch - 1) | (self._device_refs[last_blocks] > in_batch)

    def _check_decode_fits(self, rows: np.ndarray, needed: int, releases: np.ndarray) -> None:
        """Raise OutOfBlocksError if a decode step needing ``needed`` blocks cannot get them."""
        freed = 0
        if releases.any():
            released = np.concatenate(
                [self._window_releases(r, int(self._seq_lens[r]) + 1) for r in rows[releases]]
            )
            blocks, counts = np.unique(released, return_counts=True)
            freed = int(np.count_nonzero(self._device_refs[blocks] == counts))
        available = self.num_free_device_blocks() + freed
        if needed > available:
            raise OutOfBlocksError(
                f"decode step over {rows.size} sequences needs {needed} device blocks, "
                f"{available} free"
            )

    def _window_releases(self, row: int, first_query_len: int) -> np.ndarray:
        """Blocks outside the window of the first token computed next (whose sequence length,
        counting itself, is ``first_query_len``)."""
        if self.sliding_window is None:
            return self._table[row, :0]
        keep_from = max(first_query_len - self.sliding_window, 0) // self.block_size
        return self._table[row, self._num_released[row] : keep_from]

    def _release_window(self, row: int, blocks: np.ndarray) -> None:
        if blocks.size:
            blocks = blocks.copy()
            start = self._num_released[row]
            self._table[row, start : start + blocks.size] = 0
            self._num_released[row] += blocks.size
            self._drop_device_refs(blocks, cache=True)

    # ------------------------------------------------------------------ internals: prefix cache

    def _token_args(self, tokens: int | Sequence[int]) -> tuple[int, list[int] | None]:
        """A token count (an integer, 0-d integer tensors included) or the token ids."""
        if isinstance(tokens, (int, float, np.number)) or getattr(tokens, "ndim", 1) == 0:
            return _as_int(tokens, "token count"), None
        tokens = _as_list(tokens)
        return len(tokens), tokens

    @staticmethod
    def _token_counts(counts: int | Sequence[int], num_seqs: int) -> np.ndarray:
        """``num_new_tokens`` of slot_mapping_tensor as int64 ``[num_seqs]``."""
        if isinstance(counts, (int, float, np.number)) or getattr(counts, "ndim", 1) == 0:
            return np.full(num_seqs, _as_int(counts, "num_new_tokens", minimum=None))
        array = np.asarray(counts.tolist() if isinstance(counts, torch.Tensor) else counts)
        if array.shape != (num_seqs,):
            raise ValueError(
                f"num_new_tokens must be one count per sequence ({num_seqs}), got "
                f"shape {list(array.shape)}"
            )
        if array.size and array.dtype.kind not in "iu":
            raise TypeError(f"num_new_tokens must be integers, got {counts!r}")
        return array.astype(np.int64, copy=False)

    def _blocks_to_take(self, num_blocks: int, hits: list[int]) -> int:
        """Free blocks a sequence of ``num_blocks`` consumes: its fresh blocks, and the hits
        that sit unreferenced in the cache (they count as free until taken)."""
        return num_blocks - len(hits) + sum(1 for b in hits if b in self._evictable)

    def _lookup_prefix(self, tokens: list[int]) -> tuple[list[int], _PrefixChain | None]:
        """Cached blocks holding a prefix of ``tokens`` (never the last token, which the model
        must compute) and the chain the rest of the sequence continues from."""
        if not self.enable_prefix_caching:
            return [], None
        size = self.block_size
        hits: list[int] = []
        chain_hash, chain_uid = _ROOT_HASH, _ROOT_UID
        for start in range(0, len(tokens) - size, size):  # blocks ending before the last token
            block_tokens = tuple(tokens[start : start + size])
            block_hash = hash((chain_hash, block_tokens))
            block = self._cache_map.get(block_hash)
            if block is None:
                break
            _, parent_uid, cached_tokens, uid = self._cache_entries[block]
            if parent_uid != chain_uid or cached_tokens != block_tokens:
                break  # a hash collision
            hits.append(block)
            chain_hash, chain_uid = block_hash, uid
        return hits, _PrefixChain(chain_hash, chain_uid, [])

    def _register_full_blocks(self, seq_id: int, blocks: list[int], tokens: list[int]) -> None:
        """Put the full blocks among ``blocks`` (which hold ``tokens`` from their start) in the
        cache, advancing the sequence's chain; keep the rest as the chain's pending tokens."""
        chain = self._chains[seq_id]
        size = self.block_size
        num_full = len(tokens) // size
        chain_hash, chain_uid = chain.hash, chain.uid
        for i in range(num_full):
            block_tokens = tuple(tokens[i * size : (i + 1) * size])
            block_hash = hash((chain_hash, block_tokens))
            existing = self._cache_map.get(block_hash)
            if existing is None:
                uid = next(self._uids)
                self._cache_map[block_hash] = blocks[i]
                self._cache_entries[blocks[i]] = (block_hash, chain_uid, block_tokens, uid)
            else:
                _, parent_uid, cached_tokens, uid = self._cache_entries[existing]
                if parent_uid != chain_uid or cached_tokens != block_tokens:
                    del self._chains[seq_id]  # a hash collision: stop caching this sequence
                    return
                # The same prefix is cached in another block; later blocks may hang from it.
            chain_hash, chain_uid = block_hash, uid
        chain.hash, chain.uid = chain_hash, chain_uid
        chain.pending = tokens[num_full * size :]

    def _record_tokens(
        self, seq_id: int, row: int, old_len: int, tokens: Sequence[int] | None
    ) -> None:
        """Feed appended token ids to the sequence's prefix chain (unknown ids end it)."""
        chain = self._chains.get(seq_id)
        if chain is None:
            return
        if tokens is None:
            del self._chains[seq_id]
            return
        if len(chain.pending) + len(tokens) < self.block_size:
            chain.pending.extend(tokens)
            return
        first_block = (old_len - len(chain.pending)) // self.block_size
        blocks = self._table[row, first_block : self._num_blocks[row]].tolist()
        self._register_full_blocks(seq_id, blocks, chain.pending + list(tokens))
