"""Block pools: reference counts and free lists of KV-cache blocks, and the prefix cache.

The split follows vLLM v1's ``BlockPool``: a pool knows nothing of sequences, only how many table
entries point at each block and which blocks are free. ``BlockPool`` is the host pool (swap
space); ``CachingBlockPool`` is the device pool, which adds the prefix cache: full blocks
registered under a chained hash of their tokens and their predecessor's hash, every hit verified
against the stored tokens and the identity of the predecessor (so a hash collision can never
alias two prefixes), and unreferenced registered blocks kept, counted as free, until they are
evicted least-recently-used. Callers check that enough blocks are free before they take any.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict, deque
from collections.abc import Sequence

import numpy as np

from paged_attention.kv.block_errors import OutOfBlocksError

ROOT_HASH = 0
ROOT_UID = -1

# A prefix-cache entry, a plain tuple because allocate makes thousands (a NamedTuple costs 10x):
# (hash, parent uid, token ids, uid). The parent uid is the predecessor block's entry uid
# (ROOT_UID for a first block); uids are never reused, so a stale child of an evicted block
# can never match.
CacheEntry = tuple[int, int, tuple[int, ...], int]


class PrefixChain:
    """Where a sequence's next full block hangs in the prefix cache: ``links`` holds the cache
    entry of each of its full blocks in order (the entry that holds those tokens, which may be
    another sequence's block), ``pending`` the token ids of its partly filled last block."""

    __slots__ = ("links", "pending")

    def __init__(self, links: list[CacheEntry], pending: list[int]) -> None:
        self.links = links
        self.pending = pending

    @property
    def hash(self) -> int:
        return self.links[-1][0] if self.links else ROOT_HASH

    @property
    def uid(self) -> int:
        return self.links[-1][3] if self.links else ROOT_UID

    def copy(self) -> PrefixChain:
        return PrefixChain(list(self.links), list(self.pending))

    def cut(self, num_tokens: int, block_size: int) -> None:
        """Keep the chain of the sequence's first ``num_tokens`` tokens (at most its length)."""
        full, rest = divmod(num_tokens, block_size)
        if full < len(self.links):
            self.pending = list(self.links[full][2][:rest])
            del self.links[full:]
        else:
            del self.pending[rest:]


class BlockPool:
    """``num_blocks`` blocks, each with a reference count: the number of table entries that
    point at it. A block is free exactly when nothing references it."""

    def __init__(self, num_blocks: int) -> None:
        self.refs = np.zeros(num_blocks, dtype=np.int32)
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_blocks(self) -> int:
        return self.refs.size

    def num_free(self) -> int:
        return len(self._free)

    def take(self, count: int) -> list[int]:
        """``count`` free blocks, each now referenced once."""
        free = self._free
        blocks = [free.popleft() for _ in range(count)]
        self.refs[blocks] = 1
        return blocks

    def add_refs(self, blocks: np.ndarray, delta: int = 1) -> None:
        """``refs[b] += delta`` for every entry ``b`` of ``blocks``, which may repeat a block."""
        if blocks.size > 256:  # ufunc.at is quick on a few entries, bincount on many
            self.refs += (delta * np.bincount(blocks, minlength=self.refs.size)).astype(np.int32)
        else:
            np.add.at(self.refs, blocks, delta)

    def drop(self, blocks: np.ndarray) -> None:
        """Drop one reference per entry of ``blocks``; the blocks left unreferenced are free."""
        self._free.extend(self._unreferenced_after_drop(blocks))

    def transfer(self, entries: np.ndarray, dest: BlockPool) -> dict[int, int]:
        """Move the blocks that table ``entries`` point at to ``dest`` (which has room for the
        distinct ones), each with its references; ``{block here: block there}`` in order of
        first appearance. The caller points the entries at the new blocks."""
        blocks, first, counts = np.unique(entries, return_index=True, return_counts=True)
        order = np.argsort(first)
        moved = dest.take(blocks.size)
        dest.refs[moved] = counts[order]
        self.drop(entries)
        return dict(zip(blocks[order].tolist(), moved))

    def _unreferenced_after_drop(self, blocks: np.ndarray) -> list[int]:
        """Drop one reference per entry; the blocks left unreferenced, last entries first."""
        if not blocks.size:
            return []
        self.add_refs(blocks, -1)
        backwards = blocks[::-1]
        return list(dict.fromkeys(backwards[self.refs[backwards] == 0].tolist()))


class CachingBlockPool(BlockPool):
    """The device pool: a ``BlockPool`` plus the prefix cache (hash -> block, block -> entry,
    and the unreferenced cached blocks in least-recently-used order). Cached blocks nobody
    references count as free; ``take`` evicts them, oldest first, once the free list is empty.
    A block in the cache is full in every table that holds it, so it is never written."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        super().__init__(num_blocks)
        self.block_size = block_size
        self._map: dict[int, int] = {}
        self._entries: dict[int, CacheEntry] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._uids = itertools.count()

    def num_free(self) -> int:
        return len(self._free) + len(self._evictable)

    def check_room(self, needed: int, freed: int, what: str, *args) -> None:
        """OutOfBlocksError (for ``what.format(*args)``) unless ``needed`` blocks are free,
        counting ``freed`` more that the caller's change releases first."""
        available = self.num_free() + freed
        if needed > available:
            what = what.format(*args)
            raise OutOfBlocksError(f"{what} needs {needed} device blocks, {available} free")

    def num_evictable(self) -> int:
        return len(self._evictable)

    def is_cached(self, block: int) -> bool:
        return block in self._entries

    def take(self, count: int) -> list[int]:
        if not count:
            return []
        free = self._free
        blocks = [free.popleft() for _ in range(min(count, len(free)))]
        while len(blocks) < count:
            block, _ = self._evictable.popitem(last=False)
            self.uncache(block)
            blocks.append(block)
        self.refs[blocks] = 1
        return blocks

    def touch(self, hits: list[int]) -> None:
        """Reference each hit block once more (an unreferenced one leaves the LRU queue)."""
        for block in hits:
            self._evictable.pop(block, None)
        self.refs[hits] += 1

    def count_to_take(self, num_blocks: int, hits: list[int]) -> int:
        """Free blocks a sequence of ``num_blocks`` blocks consumes: its fresh blocks, and the
        hits that sit unreferenced in the cache (they count as free until taken)."""
        return num_blocks - len(hits) + sum(1 for b in hits if b in self._evictable)

    def drop(self, blocks: np.ndarray, cache: bool = True) -> None:
        """As ``BlockPool.drop``; unreferenced cached blocks stay cached, the last entries most
        recently used (a chain's later blocks are evicted before its prefix), unless ``cache``
        is False, which forgets them (blocks whose KV was never written)."""
        unreferenced = self._unreferenced_after_drop(blocks)
        cached = [b for b in unreferenced if b in self._entries]
        if cache:
            self._evictable.update(dict.fromkeys(cached))
            self._free.extend(b for b in unreferenced if b not in self._entries)
        else:
            for block in cached:
                self.uncache(block)
            self._free.extend(unreferenced)

    def block_of(self, entry: CacheEntry) -> int | None:
        """The block registered under ``entry``, if it is still cached."""
        block = self._map.get(entry[0])
        return block if block is not None and self._entries[block] is entry else None

    def uncache(self, block: int) -> None:
        """Forget a cached block's entry (its later blocks can no longer be reached)."""
        del self._map[self._entries.pop(block)[0]]

    def lookup(self, tokens: list[int]) -> tuple[list[int], PrefixChain]:
        """Cached blocks holding a prefix of ``tokens`` (never the last token, which the model
        must compute) and the chain the rest of the sequence continues from."""
        size = self.block_size
        hits: list[int] = []
        links: list[CacheEntry] = []
        chain_hash, chain_uid = ROOT_HASH, ROOT_UID
        for start in range(0, len(tokens) - size, size):  # blocks ending before the last token
            block_tokens = tuple(tokens[start : start + size])
            block_hash = hash((chain_hash, block_tokens))
            block = self._map.get(block_hash)
            if block is None:
                break
            entry = self._entries[block]
            if entry[1] != chain_uid or entry[2] != block_tokens:
                break  # a hash collision
            hits.append(block)
            links.append(entry)
            chain_hash, chain_uid = block_hash, entry[3]
        return hits, PrefixChain(links, [])

    def register(self, chain: PrefixChain, blocks: Sequence[int], tokens: list[int]) -> bool:
        """Put the full blocks among ``blocks`` (which hold ``tokens`` from their start, the
        chain's next block first) in the cache and extend the chain; the rest of ``tokens``
        become its pending tokens. False on a hash collision: the chain must then end."""
        size = self.block_size
        num_full = len(tokens) // size
        chain_hash, chain_uid, links = chain.hash, chain.uid, chain.links
        for i in range(num_full):
            block_tokens = tuple(tokens[i * size : (i + 1) * size])
            block_hash = hash((chain_hash, block_tokens))
            existing = self._map.get(block_hash)
            if existing is None:
                entry = (block_hash, chain_uid, block_tokens, next(self._uids))
                self._map[block_hash] = blocks[i]
                self._entries[blocks[i]] = entry
            else:
                entry = self._entries[existing]
                if entry[1] != chain_uid or entry[2] != block_tokens:
                    return False
                # The same prefix is cached in another block; later blocks may hang from it.
            links.append(entry)
            chain_hash, chain_uid = block_hash, entry[3]
        chain.pending = tokens[num_full * size :]
        return True
