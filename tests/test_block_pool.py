import numpy as np
import pytest

from paged_attention.kv import block_pool
from paged_attention.kv.block_pool import (
    ROOT_HASH,
    ROOT_UID,
    BlockPool,
    CachingBlockPool,
    PrefixChain,
)


def check_pool(pool: BlockPool) -> None:
    """Every block is exactly one of free, cached-free (evictable) or referenced."""
    free = list(pool._free)
    evictable = list(getattr(pool, "_evictable", []))
    used = set(np.flatnonzero(pool.refs).tolist())
    assert len(set(free)) == len(free) and not set(free) & used
    assert not set(evictable) & used and not set(evictable) & set(free)
    assert len(free) + len(evictable) + len(used) == pool.num_blocks
    assert (pool.refs >= 0).all()
    if isinstance(pool, CachingBlockPool):
        assert {entry[0]: b for b, entry in pool._entries.items()} == pool._map
        assert set(evictable) <= set(pool._entries)
        assert not set(pool._entries) & set(free)


# ---------------------------------------------------------------------------- BlockPool


def test_take_hands_out_free_blocks_in_order_each_referenced_once():
    pool = BlockPool(5)
    assert pool.num_blocks == 5 and pool.num_free() == 5
    assert pool.take(0) == []
    assert pool.take(3) == [0, 1, 2]
    assert pool.refs.tolist() == [1, 1, 1, 0, 0] and pool.num_free() == 2
    check_pool(pool)


@pytest.mark.parametrize("repeats", [3, 300])  # ufunc.at below 256 entries, bincount above
def test_add_refs_counts_repeated_blocks(repeats):
    pool = BlockPool(4)
    pool.take(4)
    pool.add_refs(np.array([1, 3] * repeats))
    assert pool.refs.tolist() == [1, 1 + repeats, 1, 1 + repeats]
    pool.add_refs(np.array([3] * repeats), -1)
    assert pool.refs.tolist() == [1, 1 + repeats, 1, 1]


def test_drop_frees_blocks_at_zero_last_entries_first():
    pool = BlockPool(6)
    pool.take(6)
    pool.add_refs(np.array([2]))
    pool.drop(np.array([1, 2, 4]))  # block 2 is still referenced once
    assert pool.refs.tolist() == [1, 0, 1, 1, 0, 1]
    assert list(pool._free) == [4, 1]
    pool.drop(np.array([], dtype=np.int32))
    assert pool.take(2) == [4, 1]
    check_pool(pool)


def test_transfer_moves_each_block_once_with_its_references():
    device, host = BlockPool(6), BlockPool(4)
    device.take(6)
    device.add_refs(np.array([2, 3, 5]))  # 3 and 5 are also held outside the moved entries
    entries = np.array([5, 2, 3, 2, 0])
    mapping = device.transfer(entries, host)
    assert list(mapping.items()) == [(5, 0), (2, 1), (3, 2), (0, 3)]  # first appearance order
    assert host.refs.tolist() == [1, 2, 1, 1]  # block 2 was in two entries
    assert device.refs.tolist() == [0, 1, 0, 1, 1, 1]
    assert list(device._free) == [0, 2]
    check_pool(device)
    check_pool(host)


# ---------------------------------------------------------------------------- prefix cache


def register(pool: CachingBlockPool, tokens: list[int]) -> tuple[list[int], PrefixChain]:
    """Take blocks for ``tokens`` and register the full ones, as a new sequence would."""
    blocks = pool.take(-(-len(tokens) // pool.block_size))
    chain = PrefixChain([], [])
    assert pool.register(chain, blocks, tokens)
    return blocks, chain


def test_register_indexes_full_blocks_and_keeps_the_rest_pending():
    pool = CachingBlockPool(8, 2)
    blocks, chain = register(pool, [1, 2, 3, 4, 5])
    assert set(pool._entries) == {blocks[0], blocks[1]}
    assert chain.pending == [5] and len(chain.links) == 2
    assert chain.links[-1] is pool._entries[blocks[1]] and chain.uid == chain.links[-1][3]
    assert pool._entries[blocks[1]][1] == pool._entries[blocks[0]][3]  # hangs from block 0
    empty = PrefixChain([], [])
    assert (empty.hash, empty.uid) == (ROOT_HASH, ROOT_UID)
    check_pool(pool)


def test_lookup_hits_whole_blocks_but_never_the_last_token():
    pool = CachingBlockPool(8, 2)
    blocks, _ = register(pool, [1, 2, 3, 4, 5])
    hits, chain = pool.lookup([1, 2, 3, 4, 9])
    assert hits == blocks[:2] and chain.links == [pool._entries[b] for b in hits]
    assert pool.lookup([1, 2, 3, 4])[0] == blocks[:1]  # block 1 ends at the last token
    assert pool.lookup([7, 2, 3, 4, 5])[0] == []  # a different first block stops the chain
    assert pool.lookup([1])[0] == []


def test_lookup_and_register_verify_tokens_and_predecessor_under_collisions(monkeypatch):
    monkeypatch.setattr(block_pool, "hash", lambda value: 7, raising=False)
    pool = CachingBlockPool(8, 2)
    register(pool, [1, 2, 0])
    assert pool.lookup([5, 6, 0])[0] == []  # same hash, other tokens
    blocks = pool.take(2)
    chain = PrefixChain([], [])
    assert not pool.register(chain, blocks, [5, 6, 7, 8])  # the chain must end
    monkeypatch.setattr(block_pool, "hash", lambda value: hash(value[1]), raising=False)
    pool = CachingBlockPool(8, 2)
    register(pool, [1, 2, 3, 4, 0])
    first, _ = register(pool, [9, 9, 0])
    hits, _ = pool.lookup([9, 9, 3, 4, 0])  # [3, 4] is cached only after [1, 2]
    assert hits == first[:1]


def test_register_of_a_prefix_cached_elsewhere_follows_the_existing_entry():
    pool = CachingBlockPool(8, 2)
    blocks, _ = register(pool, [1, 2, 3])
    other, chain = register(pool, [1, 2, 4, 5])
    assert other[0] not in pool._entries  # the same prefix stays cached once
    assert chain.links[0] is pool._entries[blocks[0]]
    assert pool._entries[other[1]][1] == pool._entries[blocks[0]][3]
    assert pool.lookup([1, 2, 4, 5, 0])[0] == [blocks[0], other[1]]
    check_pool(pool)


def test_unreferenced_cached_blocks_count_free_and_are_evicted_lru():
    pool = CachingBlockPool(4, 2)
    blocks, _ = register(pool, [1, 2, 3, 4, 5])  # blocks 0, 1 cached, 2 holds [5]
    pool.drop(np.array(blocks))
    assert list(pool._evictable) == [1, 0] and list(pool._free) == [3, 2]
    assert pool.num_free() == 4 and pool.num_evictable() == 2
    assert pool.count_to_take(3, [0]) == 3  # an evictable hit counts as taken
    pool.touch([0])
    assert pool.refs[0] == 1 and list(pool._evictable) == [1] and pool.num_free() == 3
    assert pool.take(3) == [3, 2, 1]  # the free list first, then the least recently used
    assert 1 not in pool._entries and 0 in pool._entries
    check_pool(pool)


def test_drop_without_cache_forgets_unreferenced_entries():
    pool = CachingBlockPool(4, 2)
    blocks, _ = register(pool, [1, 2, 3, 4, 5])
    pool.add_refs(np.array([0]))
    pool.drop(np.array(blocks), cache=False)
    assert list(pool._entries) == [0] and not pool._evictable  # block 0 is still referenced
    assert pool.num_free() == 3
    check_pool(pool)


def test_prefix_chain_copy_is_independent():
    pool = CachingBlockPool(8, 2)
    _, chain = register(pool, [1, 2, 3])
    copy = chain.copy()
    copy.pending.append(9)
    copy.links.append(copy.links[0])
    assert chain.pending == [3] and len(chain.links) == 1
