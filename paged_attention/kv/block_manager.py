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
  pass never ran with ``free(seq_id, cache=False)``. ``allocate`` never shares the block of a
  prompt's last token, which the model must compute; when that block is cached whole,
  ``cached_copy_of_last_block`` names it, so that an engine can copy it into the sequence's
  own last block and compute only the last token (a block registered by a sequence whose
  forward pass has not run yet holds no KV: do not copy that one).
* ``truncate(seq_id, n)`` cuts a sequence back to its first ``n`` tokens (the rejected draft
  tokens of speculative decoding, transformers' ``crop``). Blocks wholly past the cut are
  dropped as ``free`` drops them: one another sequence shares stays with it; an unreferenced
  cached one stays cached, its tokens and KV still valid, unless ``cache=False``. A kept last
  block left partly filled is written by the next append, and a prefix-cache entry must never be
  written: if only this sequence holds it, it leaves the cache; if others share it, it is copied
  now (the returned ``(src, dst)`` pair) and the cached original stays theirs. A shared block
  that is not cached is copied by the next append, as after ``fork``. The sequence's prefix chain
  is cut back with it, so its later full blocks are registered under the right hashes. A
  swapped-out sequence raises ``SwapError``; a cut whose next token would attend a released
  block raises ``ValueError``.
* Swapping moves whole sequences between pools. Blocks shared inside the swapped set move once
  and stay shared. A block also referenced by a sequence outside the set is *copied*: the
  swapped sequences get their own copy on the other side and the original keeps its other
  references. (This is vLLM's behaviour; refusing would make any sequence that shares a cached
  prompt prefix impossible to swap.)
* Blocks no layer reads any more are released. With ``sliding_window=W`` the kernel only reads
  positions ``p >= seq_len - W``; with ``attention_chunk_size=C`` (chunked local attention, as
  Llama 4's local layers) a token at position ``p`` reads only its own chunk, from ``p - p % C``;
  with both, each layer does one or the other and the earlier position is kept (``Reach``).
  Appending releases the blocks wholly before what the first new token reads (``allocate`` keeps
  the whole prompt: the prompt's own attention reads it). ``block_table`` shows released entries
  as ``RELEASED`` (-1); the tensors show them as the pad block id (0 unless the caller gives
  another), a valid id the kernel never reads, and ``slot_mapping_tensor`` gives -1 (skip). A
  model with any full-attention layer releases nothing (give neither).

The parts follow vLLM v1's split: ``block_pool`` holds reference counts and free lists (the
host pool is a plain ``BlockPool``; the device pool, a ``CachingBlockPool``, adds the prefix
cache's hash map and LRU eviction); ``block_tables`` holds the per-sequence state (``BlockTables``:
one preallocated numpy row per live sequence, so a decode step over a batch is a few vectorised
operations, with Python loops only for releases and for recording token ids in the prefix
cache; ``PrefixChains``: each sequence's place in the prefix cache); ``block_swap``'s
``SwapSpace`` moves whole sequences between the pools; ``BlockManager`` is the facade: it
validates every call before anything changes (a call that raises leaves the manager exactly as it
was), decides copy-on-write, releases and when a swap may happen, and reports stats.

Sizes and counts (block counts, ``block_size``, ``sliding_window``, ``attention_chunk_size``,
``max_blocks_per_seq``,
token counts, ``n``) are integers: an ``int``, a numpy integer or a 0-d integer tensor or array
(so ``allocate(seq_id, torch.tensor(5))`` allocates 5 tokens); a bool or a float (even ``2.0``)
raises ``TypeError`` naming the argument, a value out of range ``ValueError``. ``watermark`` is
the fraction of device blocks ``can_allocate`` holds back, in ``[0, 1)``. Token ids are a list,
a 1-d integer tensor or array, or any other iterable of ints.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from paged_attention.kv.block_errors import (
    BlockManagerError,
    DoubleFreeError,
    DuplicateSequenceError,
    OutOfBlocksError,
    SwapError,
    UnknownSequenceError,
)
from paged_attention.kv.block_pool import BlockPool, CachingBlockPool
from paged_attention.kv.block_swap import SwapSpace
from paged_attention.kv.block_tables import RELEASED, BlockTables, PrefixChains, Reach

__all__ = [
    "RELEASED",
    "AllocStatus",
    "BlockManager",
    "BlockManagerError",
    "BlockManagerStats",
    "DoubleFreeError",
    "DuplicateSequenceError",
    "OutOfBlocksError",
    "PoolStats",
    "SwapError",
    "UnknownSequenceError",
    "reassign",
]


class AllocStatus(enum.Enum):
    OK = enum.auto()
    LATER = enum.auto()  # fits once other sequences free blocks
    NEVER = enum.auto()  # needs more blocks than the device pool has minus the watermark


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


class BlockManager:
    """Block tables, reference counts and the prefix cache for a paged KV cache: the facade over
    the device and host pools and the per-sequence state (see the module docstring)."""

    def __init__(
        self,
        num_device_blocks: int,
        block_size: int,
        num_host_blocks: int = 0,
        *,
        watermark: float = 0.01,
        enable_prefix_caching: bool = False,
        sliding_window: int | None = None,
        attention_chunk_size: int | None = None,
        max_blocks_per_seq: int | None = None,
    ) -> None:
        self.num_device_blocks = _as_int(num_device_blocks, "num_device_blocks", 1)
        self.block_size = _as_int(block_size, "block_size", 1)
        self.num_host_blocks = _as_int(num_host_blocks, "num_host_blocks", 0)
        self.watermark_blocks = int(_checked_watermark(watermark) * self.num_device_blocks)
        self.enable_prefix_caching = enable_prefix_caching
        self.sliding_window = _as_optional_int(sliding_window, "sliding_window")
        self.attention_chunk_size = _as_optional_int(attention_chunk_size, "attention_chunk_size")
        self.reach = Reach(self.sliding_window, self.attention_chunk_size)
        if self.reach.releases and enable_prefix_caching:
            # A cached prefix block may already have been released by its owner.
            raise ValueError(
                "prefix caching cannot be combined with releasing blocks (sliding_window, "
                "attention_chunk_size)"
            )
        self.max_blocks_per_seq = _as_optional_int(max_blocks_per_seq, "max_blocks_per_seq")
        self._device = CachingBlockPool(self.num_device_blocks, self.block_size)
        self._host = BlockPool(self.num_host_blocks)
        self._tables = BlockTables(self.block_size, self.max_blocks_per_seq)
        self._prefixes = PrefixChains(self._device, enable_prefix_caching)
        self._swap = SwapSpace(self._tables, self._device, self._host, self._prefixes)

    # ------------------------------------------------------------------ queries

    def has_seq(self, seq_id: int) -> bool:
        return seq_id in self._tables.row_of

    def is_swapped(self, seq_id: int) -> bool:
        return bool(self._tables.on_host[self._tables.row(seq_id)])

    def num_tokens(self, seq_id: int) -> int:
        return int(self._tables.seq_lens[self._tables.row(seq_id)])

    def num_cached_tokens(self, seq_id: int) -> int:
        self._tables.row(seq_id)
        return self._prefixes.cached_tokens.get(seq_id, 0)

    def cached_copy_of_last_block(self, seq_id: int) -> tuple[int, int] | None:
        """``(cached block, last block)``: a cached block with the tokens of the sequence's full
        last block, to copy instead of computing them (see the module docstring), or None."""
        row = self._tables.device_row(seq_id)
        last = int(self._tables.table[row, self._tables.num_blocks[row] - 1])
        cached = self._prefixes.cached_copy(seq_id, last, int(self._tables.seq_lens[row]))
        return None if cached is None else (cached, last)

    def num_free_device_blocks(self) -> int:
        return self._device.num_free()

    def num_free_host_blocks(self) -> int:
        return self._host.num_free()

    def blocks_saved_by_sharing(self) -> int:
        """``stats().device.blocks_saved_by_sharing`` alone (the engine reads it every step)."""
        refs = self._device.refs
        return int(refs.sum()) - int(np.count_nonzero(refs))

    def seq_ids(self) -> list[int]:
        return list(self._tables.row_of)

    def block_table(self, seq_id: int) -> list[int]:
        """Device block ids of a sequence on the device; RELEASED for released entries."""
        return self._tables.table_of(seq_id, on_host=False)

    def host_block_table(self, seq_id: int) -> list[int]:
        """Host block ids of a swapped-out sequence; RELEASED for released entries."""
        return self._tables.table_of(seq_id, on_host=True)

    def cached_prefix_length(self, tokens: Sequence[int]) -> int:
        """Leading tokens of ``tokens`` (ids) the prefix cache serves now: the hits
        ``allocate(seq_id, tokens)`` would take, in tokens (whole blocks, never the last token,
        which the model must compute; 0 without prefix caching). Nothing is allocated and the
        LRU order does not change. A block is registered as soon as its token ids are known,
        and its KV is written by the sequence's next forward pass: an engine that prefills a
        prompt over several steps must allocate, then append_slots, only the tokens it computes
        in each step (with their ids), or another sequence could hit unwritten blocks."""
        return len(self._prefixes.lookup(_as_list(tokens))[0]) * self.block_size

    # ------------------------------------------------------------------ allocation

    def can_allocate(self, num_tokens_or_tokens: int | Sequence[int]) -> AllocStatus:
        num_tokens, tokens = _token_args(num_tokens_or_tokens)
        num_blocks = _cdiv(num_tokens, self.block_size)
        # Judged without prefix hits, which eviction may take away before the sequence runs.
        too_big = self.num_device_blocks - num_blocks < self.watermark_blocks
        if too_big or not self._tables.fits(num_blocks):
            return AllocStatus.NEVER
        needed = self._device.count_to_take(num_blocks, self._prefixes.lookup(tokens)[0])
        return _status(self._device.num_free() - needed, self.watermark_blocks)

    def allocate(self, seq_id: int, tokens: int | Sequence[int]) -> None:
        """Give a new sequence blocks for its prompt: a token count, or the token ids (which
        enables prefix-cache hits). The watermark is the scheduler's business (can_allocate);
        this only fails when the blocks do not exist."""
        tables, device = self._tables, self._device
        if seq_id in tables.row_of:
            raise DuplicateSequenceError(f"sequence {seq_id} is already allocated")
        num_tokens, tokens = _token_args(tokens)
        num_blocks = _cdiv(num_tokens, self.block_size)
        tables.check_fits(seq_id, num_blocks)
        hits, chain = self._prefixes.lookup(tokens)
        needed = device.count_to_take(num_blocks, hits)
        self._device.check_room(needed, 0, "allocating sequence {} ({} tokens)", seq_id, num_tokens)

        device.touch(hits)
        fresh = device.take(num_blocks - len(hits))
        tables.add(seq_id, hits + fresh, num_tokens)
        self._prefixes.start(seq_id, hits, chain, fresh, tokens)

    def append_slots(
        self, seq_id: int, n: int = 1, tokens: Sequence[int] | None = None
    ) -> list[tuple[int, int]]:
        """Reserve slots for ``n`` new tokens; returns the copy-on-write ``(src, dst)`` pairs.
        ``tokens`` (``n`` ids) keep the sequence's new full blocks eligible for prefix caching."""
        tables, device = self._tables, self._device
        row = tables.device_row(seq_id)
        n, tokens = _append_args(seq_id, n, tokens)
        if n == 0:
            return []
        old_len, num_blocks = int(tables.seq_lens[row]), int(tables.num_blocks[row])
        new_blocks = _cdiv(old_len + n, self.block_size) - num_blocks
        tables.check_fits(seq_id, num_blocks + new_blocks)
        last = int(tables.table[row, num_blocks - 1]) if num_blocks else -1
        copy = old_len % self.block_size != 0 and device.refs[last] > 1
        released = tables.releases(row, old_len, self.reach)
        freed = _num_freed([released], device.refs)
        self._device.check_room(
            new_blocks + copy, freed, "appending {} tokens to sequence {}", n, seq_id
        )

        if released.size:
            device.drop(tables.release(row, released))
        pairs = _copy_on_write(tables, device, np.array([row]), np.array([last])) if copy else []
        tables.extend(row, device.take(new_blocks), old_len + n)
        self._prefixes.record(seq_id, tables, row, old_len, tokens)
        return pairs

    def truncate(
        self, seq_id: int, num_tokens: int, *, cache: bool = True
    ) -> list[tuple[int, int]]:
        """Cut a sequence back to its first ``num_tokens`` tokens (rejected draft tokens,
        transformers' ``crop``); returns the copy-on-write ``(src, dst)`` pairs to copy before
        the next forward pass. ``cache`` as in ``free``; see the module docstring."""
        tables, device, size = self._tables, self._device, self.block_size
        row = tables.device_row(seq_id)
        num_tokens = _as_int(num_tokens, "num_tokens")
        tables.check_cut(seq_id, row, num_tokens, self.reach)
        keep = _cdiv(num_tokens, size)
        last = int(tables.table[row, keep - 1]) if num_tokens % size else -1
        cached = last >= 0 and device.is_cached(last)
        copy = int(cached and device.refs[last] > 1)  # a block to take
        freed = _num_freed([tables.table[row, keep : tables.num_blocks[row]]], device.refs)
        self._device.check_room(
            copy, freed, "truncating sequence {} to {} tokens", seq_id, num_tokens
        )

        device.drop(tables.cut(row, keep, num_tokens), cache=cache)
        if cached and not copy:
            device.uncache(last)  # written in place by the next append
        self._prefixes.cut(seq_id, num_tokens)
        return _copy_on_write(tables, device, np.array([row]), np.array([last])) if copy else []

    def fork(self, parent_id: int, child_id: int) -> None:
        """The child shares every block of the parent; nothing is allocated."""
        self.fork_many([parent_id], [child_id])

    def fork_many(self, parent_ids: Sequence[int], child_ids: Sequence[int]) -> None:
        """``fork(p, c)`` for every pair at once (a parent may repeat). With ``free_many`` this
        reorders beams: fork each new beam from its chosen parent, then free the old beams."""
        if len(parent_ids) != len(child_ids):
            raise ValueError(f"fork_many got {len(parent_ids)} parents, {len(child_ids)} children")
        children = self._tables.fork(parent_ids, child_ids)
        self._device.add_refs(self._tables.live_entries(children))
        self._prefixes.fork(parent_ids, child_ids)

    def free(self, seq_id: int, *, cache: bool = True) -> None:
        """Drop a sequence. ``cache=False`` also forgets its blocks that leave the prefix cache
        unreferenced (for a sequence whose forward pass never wrote them)."""
        self.free_many([seq_id], cache=cache)

    def free_many(self, seq_ids: Iterable[int], *, cache: bool = True) -> None:
        """``free`` for several sequences at once."""
        seq_ids = list(seq_ids)
        rows = self._tables.rows_to_free(seq_ids)
        device_rows = self._swap.drop_host_rows(rows)
        self._device.drop(self._tables.live_entries(device_rows), cache=cache)
        self._tables.remove(seq_ids, rows)
        self._prefixes.forget(seq_ids)

    # ------------------------------------------------------------------ swapping

    def can_swap_out(self, seq_ids: Iterable[int]) -> bool:
        return self._swap.blocks_to_move(list(seq_ids), on_host=False) <= self._host.num_free()

    def swap_out(self, seq_ids: Iterable[int]) -> list[tuple[int, int]]:
        """Move sequences to host blocks; returns the ``(device, host)`` blocks to copy."""
        return self._swap.swap_out(list(seq_ids))

    def can_swap_in(self, seq_ids: Iterable[int]) -> AllocStatus:
        needed = self._swap.blocks_to_move(list(seq_ids), on_host=True)
        if self.num_device_blocks - needed < self.watermark_blocks:
            return AllocStatus.NEVER
        return _status(self._device.num_free() - needed, self.watermark_blocks)

    def swap_in(self, seq_ids: Iterable[int]) -> list[tuple[int, int]]:
        """Move swapped sequences back to the device; returns the ``(host, device)`` copies."""
        return self._swap.swap_in(list(seq_ids))

    # ------------------------------------------------------------------ step tensors, stats

    def block_tables_array(self, seq_ids: Sequence[int], pad: int = 0) -> np.ndarray:
        """int32 ``[len(seq_ids), max blocks in the batch]``; unused and released entries
        hold ``pad``."""
        rows = self._tables.device_rows(seq_ids)
        return self._tables.batch_table(rows, pad)

    def seq_lens_array(self, seq_ids: Sequence[int]) -> np.ndarray:
        """int32 tokens held by each sequence."""
        rows = self._tables.rows(seq_ids)
        return self._tables.seq_lens[rows].astype(np.int32)

    def slot_mapping_array(
        self, seq_ids: Sequence[int], num_new_tokens: int | Sequence[int] = 1
    ) -> np.ndarray:
        """int64 slots of the last ``k`` tokens of each sequence, in ``seq_ids`` order;
        -1 (skip) for a token whose block was released."""
        rows = self._tables.device_rows(seq_ids)
        counts = _token_counts(num_new_tokens, seq_ids, self._tables.seq_lens[rows])
        return self._tables.slots(rows, counts)

    def block_tables_tensor(self, seq_ids: Sequence[int], pad: int = 0) -> torch.Tensor:
        """:meth:`block_tables_array` as a tensor."""
        return torch.from_numpy(self.block_tables_array(seq_ids, pad))

    def seq_lens_tensor(self, seq_ids: Sequence[int]) -> torch.Tensor:
        """:meth:`seq_lens_array` as a tensor."""
        return torch.from_numpy(self.seq_lens_array(seq_ids))

    def slot_mapping_tensor(
        self, seq_ids: Sequence[int], num_new_tokens: int | Sequence[int] = 1
    ) -> torch.Tensor:
        """:meth:`slot_mapping_array` as a tensor."""
        return torch.from_numpy(self.slot_mapping_array(seq_ids, num_new_tokens))

    def decode_step(
        self, seq_ids: Sequence[int], tokens: Sequence[int] | None = None
    ) -> tuple[list[tuple[int, int]], np.ndarray, np.ndarray, np.ndarray]:
        """Append one token to every sequence (``tokens``: their ids, for prefix caching) and
        return ``(cow_pairs, block_tables int32, seq_lens int32, slot_mapping int64)``, numpy
        arrays. Equivalent to ``append_slots(s, 1)`` for each sequence, then the three arrays."""
        tables, device, size = self._tables, self._device, self.block_size
        rows = tables.device_rows(seq_ids)
        tokens = _decode_args(seq_ids, tokens)
        lens, num_blocks = tables.seq_lens[rows], tables.num_blocks[rows]
        opens = lens % size == 0
        open_rows = rows[opens]
        if open_rows.size:  # the widest table after the step is the one that may not fit
            widest = int(np.argmax(np.where(opens, num_blocks, -1)))
            tables.check_fits(seq_ids[widest], int(num_blocks[widest]) + 1)
        releasing, released = tables.rows_releasing(rows, lens, self.reach)
        refs = _refs_after(device.refs, released)  # a release may unshare a row's last block
        copy_rows, copied = _decode_copies(tables, refs, rows, num_blocks, opens)
        needed, freed = open_rows.size + copy_rows.size, _num_freed(released, device.refs)
        self._device.check_room(needed, freed, "decode step over {} sequences", rows.size)

        for row, blocks in zip(releasing, released):
            device.drop(tables.release(row, blocks))
        pairs = _copy_on_write(tables, device, copy_rows, copied) if copy_rows.size else []
        if open_rows.size:
            tables.extend_rows(open_rows, device.take(open_rows.size), int(num_blocks[widest]) + 1)
        tables.seq_lens[rows] = lens + 1
        if self._prefixes.chains:
            self._prefixes.record_each(seq_ids, tables, rows, lens, tokens)
        slots = tables.table[rows, lens // size] * np.int64(size) + lens % size
        return pairs, tables.batch_table(rows, 0), (lens + 1).astype(np.int32), slots

    @staticmethod
    def mapping_tensor(pairs: Sequence[tuple[int, int]]) -> torch.Tensor:
        """int64 ``[n, 2]`` copy or swap mapping."""
        return torch.tensor(list(pairs), dtype=torch.int64).reshape(-1, 2)

    def stats(self, bytes_per_block: int = 0) -> BlockManagerStats:
        return _stats(self._tables, self._device, self._host, bytes_per_block)


def reassign(
    manager: BlockManager,
    seq_ids: Sequence[int | None],
    sources: Sequence[int],
    new_id: Callable[[], int],
) -> list[int | None]:
    """Slot ``i`` continues the sequence of old slot ``sources[i]`` (beam search's reordering):
    the first slot that takes a sequence keeps it, later ones fork it (``new_id()`` names each
    fork), and the sequences no slot takes are freed, in one ``free_many`` and then one
    ``fork_many``: no block is copied. Slots without a sequence (None) stay so. Returns the new
    slots' sequence ids."""
    if any(not 0 <= s < len(seq_ids) for s in sources):
        raise ValueError(f"sources {list(sources)} out of range for {len(seq_ids)} slots")
    taken: set[int] = set()
    new: list[int | None] = []
    parents, children = [], []
    for source in sources:
        seq_id = seq_ids[source]
        if seq_id is not None and source in taken:
            parents.append(seq_id)
            seq_id = new_id()
            children.append(seq_id)
        taken.add(source)
        new.append(seq_id)
    dropped = [s for slot, s in enumerate(seq_ids) if slot not in taken and s is not None]
    if dropped:  # first, so that the forks may take what they held (a hybrid's state slots)
        manager.free_many(dropped)
    if parents:  # never a dropped sequence: a parent is a taken one
        manager.fork_many(parents, children)
    return new


def _copy_on_write(
    tables: BlockTables, device: CachingBlockPool, rows: np.ndarray, blocks: np.ndarray
) -> list[tuple[int, int]]:
    """Give ``rows`` fresh blocks for their last ones, ``blocks`` (shared, so still referenced
    after); the ``(src, dst)`` pairs to copy."""
    copies = device.take(rows.size)
    device.add_refs(blocks, -1)
    tables.replace_last(rows, copies)
    return list(zip(blocks.tolist(), copies))


# ---------------------------------------------------------------------------- arguments


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


def _as_optional_int(value, name: str) -> int | None:
    return None if value is None else _as_int(value, name, 1)


def _checked_watermark(watermark: float) -> float:
    if isinstance(watermark, bool) or not isinstance(watermark, (int, float, np.number)):
        raise TypeError(f"watermark must be a fraction of the device blocks, got {watermark!r}")
    if not 0.0 <= watermark < 1.0:  # NaN fails too
        raise ValueError(f"watermark must be in [0, 1), got {watermark}")
    return float(watermark)


def _is_count(value) -> bool:
    """Whether a tokens-or-count argument is a count (a scalar: checked by _as_int)."""
    return isinstance(value, (int, float, np.number)) or getattr(value, "ndim", 1) == 0


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


def _token_args(tokens: int | Sequence[int]) -> tuple[int, list[int] | None]:
    """A token count (an integer, 0-d integer tensors included) or the token ids."""
    if _is_count(tokens):
        return _as_int(tokens, "token count"), None
    tokens = _as_list(tokens)
    return len(tokens), tokens


def _append_args(seq_id: int, n, tokens) -> tuple[int, list[int] | None]:
    """append_slots' ``n`` and ``tokens``, checked."""
    if type(n) is not int:
        n = _as_int(n, "n", minimum=None)
    if n < 0:
        raise ValueError(f"cannot append {n} tokens to sequence {seq_id}")
    if tokens is not None:
        tokens = _as_list(tokens)
        if len(tokens) != n:
            raise ValueError(f"append_slots({seq_id}, n={n}) got {len(tokens)} token ids")
    return n, tokens


def _decode_args(seq_ids: Sequence[int], tokens) -> list[int] | None:
    """decode_step's ``seq_ids`` (distinct) and ``tokens`` (one per sequence), checked."""
    if len(set(seq_ids)) != len(seq_ids):
        raise DuplicateSequenceError(f"decode_step got a sequence twice: {list(seq_ids)}")
    if tokens is not None:
        tokens = _as_list(tokens)
        if len(tokens) != len(seq_ids):
            raise ValueError(f"decode_step got {len(tokens)} token ids for {len(seq_ids)} seqs")
    return tokens


def _token_counts(counts, seq_ids: Sequence[int], lens: np.ndarray) -> np.ndarray:
    """slot_mapping_tensor's ``num_new_tokens`` as int64 ``[len(seq_ids)]``, each at most the
    sequence's length."""
    if _is_count(counts):
        array = np.full(lens.size, _as_int(counts, "num_new_tokens", minimum=None))
    else:
        array = np.asarray(counts.tolist() if isinstance(counts, torch.Tensor) else counts)
        if array.shape != lens.shape:
            raise ValueError(
                f"num_new_tokens must be one count per sequence ({lens.size}), got "
                f"shape {list(array.shape)}"
            )
        if array.size and array.dtype.kind not in "iu":
            raise TypeError(f"num_new_tokens must be integers, got {counts!r}")
        array = array.astype(np.int64, copy=False)
    bad = np.flatnonzero((array < 0) | (array > lens))
    if bad.size:
        i = int(bad[0])
        raise ValueError(
            f"sequence {seq_ids[i]} has {lens[i]} tokens, asked for the last {array[i]}"
        )
    return array


# ---------------------------------------------------------------------------- decisions


def _status(free_after: int, watermark_blocks: int) -> AllocStatus:
    return AllocStatus.OK if free_after >= watermark_blocks else AllocStatus.LATER


def _refs_after(refs: np.ndarray, released: list[np.ndarray]) -> np.ndarray:
    """Reference counts once every table entry in ``released`` drops its block."""
    if not released:
        return refs
    refs = refs.copy()
    np.subtract.at(refs, np.concatenate(released), 1)
    return refs


def _num_freed(released: list[np.ndarray], refs: np.ndarray) -> int:
    """Blocks left unreferenced once every table entry in ``released`` drops its block."""
    if not released:
        return 0
    blocks, counts = np.unique(np.concatenate(released), return_counts=True)
    return int(np.count_nonzero(refs[blocks] == counts))


def _decode_copies(
    tables: BlockTables, refs: np.ndarray, rows: np.ndarray, num_blocks, opens: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """The rows of a decode step that copy their shared, partly filled last block, and those
    blocks: every sharer in the batch copies, in batch order, except the last one when no one
    outside the batch holds the block (it then writes in place)."""
    last = tables.table[rows, np.maximum(num_blocks - 1, 0)]
    shared = ~opens & (refs[last] > 1)
    last_blocks = last[shared]
    if not last_blocks.size:
        return rows[:0], last_blocks
    _, group, group_sizes = np.unique(last_blocks, return_inverse=True, return_counts=True)
    order = np.argsort(group, kind="stable")
    rank = np.empty_like(order)  # position among the batch's sharers of the same block
    rank[order] = np.arange(order.size) - np.repeat(
        np.cumsum(group_sizes) - group_sizes, group_sizes
    )
    in_batch = group_sizes[group]
    copying = (rank < in_batch - 1) | (refs[last_blocks] > in_batch)
    return rows[shared][copying], last_blocks[copying]


# ---------------------------------------------------------------------------- stats


def _stats(
    tables: BlockTables, device: CachingBlockPool, host: BlockPool, bytes_per_block: int
) -> BlockManagerStats:
    rows = tables.live_rows()
    on_host = tables.on_host[rows]
    device_stats = _pool_stats(tables, rows[~on_host], device, device.num_evictable())
    host_stats = _pool_stats(tables, rows[on_host], host, 0)
    saved = device_stats.blocks_saved_by_sharing + host_stats.blocks_saved_by_sharing
    return BlockManagerStats(
        device=device_stats,
        host=host_stats,
        num_seqs=rows.size,
        num_swapped_seqs=int(np.count_nonzero(on_host)),
        bytes_per_block=bytes_per_block,
        bytes_saved_by_sharing=saved * bytes_per_block,
    )


def _pool_stats(
    tables: BlockTables, rows: np.ndarray, pool: BlockPool, num_cached: int
) -> PoolStats:
    """A pool's stats from its reference counts and the partly filled last blocks of the
    ``rows`` in it. Every used block is full in some table and so holds ``block_size`` tokens,
    unless all its references are partly filled last entries: then it holds the most of
    those."""
    refs, size = pool.refs, tables.block_size
    used = int(np.count_nonzero(refs))
    tokens = used * size
    blocks, held = tables.partial_last_blocks(rows)
    if blocks.size:
        partial, group, entries = np.unique(blocks, return_inverse=True, return_counts=True)
        most = np.zeros(partial.size, dtype=np.int64)
        np.maximum.at(most, group, held)
        tokens -= int((size - most[refs[partial] == entries]).sum())
    reserved = used * size
    return PoolStats(
        num_blocks=refs.size,
        free_blocks=pool.num_free(),
        cached_free_blocks=num_cached,
        used_blocks=used,
        shared_blocks=int(np.count_nonzero(refs > 1)),
        tokens_stored=tokens,
        reserved_slots=reserved,
        empty_slots=reserved - tokens,
        fragmentation=(reserved - tokens) / reserved if reserved else 0.0,
        blocks_saved_by_sharing=int(refs.sum()) - used,
    )
