import random

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from paged_attention.kv import block_pool
from paged_attention.kv.block_manager import (
    RELEASED,
    AllocStatus,
    BlockManager,
    BlockManagerError,
    BlockManagerStats,
    DoubleFreeError,
    DuplicateSequenceError,
    OutOfBlocksError,
    PoolStats,
    SwapError,
    UnknownSequenceError,
)

# ---------------------------------------------------------------------------- helpers


def check_invariants(bm: BlockManager) -> None:
    """Refcounts match the tables; every block is exactly one of free, cached-free or used."""
    size = bm.block_size
    expected = {
        "device": np.zeros(bm.num_device_blocks, int),
        "host": np.zeros(bm.num_host_blocks, int),
    }
    for seq_id in bm.seq_ids():
        host = bm.is_swapped(seq_id)
        table = bm.host_block_table(seq_id) if host else bm.block_table(seq_id)
        assert len(table) == -(-bm.num_tokens(seq_id) // size)
        live = [b for b in table if b != RELEASED]
        assert len(set(live)) == len(live), f"sequence {seq_id} holds a block twice"
        assert table[: len(table) - len(live)] == [RELEASED] * (len(table) - len(live))
        np.add.at(expected["host" if host else "device"], live, 1)
        for index, block in enumerate(table):  # cached blocks are full, so never written
            if not host and block in bm._device._entries:
                assert (index + 1) * size <= bm.num_tokens(seq_id)
    assert expected["device"].tolist() == bm._device.refs.tolist()
    assert expected["host"].tolist() == bm._host.refs.tolist()

    used = set(np.flatnonzero(bm._device.refs).tolist())
    free = list(bm._device._free)
    cached_free = list(bm._device._evictable)
    assert len(set(free)) == len(free)
    assert not (set(free) & set(cached_free)) and not (set(free) & used)
    assert not (set(cached_free) & used)
    assert len(free) + len(cached_free) + len(used) == bm.num_device_blocks
    host_used = set(np.flatnonzero(bm._host.refs).tolist())
    host_free = list(bm._host._free)
    assert len(set(host_free)) == len(host_free) and not (set(host_free) & host_used)
    assert len(host_free) + len(host_used) == bm.num_host_blocks

    # The prefix cache indexes exactly its entries, and only device blocks nobody writes to.
    assert {entry[0]: b for b, entry in bm._device._entries.items()} == bm._device._map
    assert set(cached_free) <= set(bm._device._entries)
    assert not (set(bm._device._entries) & set(free))

    # The batch tensor is the tables padded with 0, released entries 0 as well.
    device_seqs = [s for s in bm.seq_ids() if not bm.is_swapped(s)]
    tables = [[max(b, 0) for b in bm.block_table(s)] for s in device_seqs]
    width = max(map(len, tables), default=0)
    padded = [t + [0] * (width - len(t)) for t in tables]
    assert bm.block_tables_tensor(device_seqs).tolist() == (padded if device_seqs else [])

    stats = bm.stats()
    assert stats.device.free_blocks + stats.device.used_blocks == bm.num_device_blocks
    assert stats.host.free_blocks + stats.host.used_blocks == bm.num_host_blocks
    assert stats == stats_by_walking_the_tables(bm)


def stats_by_walking_the_tables(bm: BlockManager) -> BlockManagerStats:
    """stats() computed the straightforward way, from the public tables."""
    size = bm.block_size
    pools = {}
    for host in (False, True):
        filled, entries = {}, 0  # tokens held in each used block; table entries
        for seq_id in bm.seq_ids():
            if bm.is_swapped(seq_id) != host:
                continue
            table = bm.host_block_table(seq_id) if host else bm.block_table(seq_id)
            for index, block in enumerate(table):
                if block != RELEASED:
                    held = min(size, bm.num_tokens(seq_id) - index * size)
                    filled[block] = max(filled.get(block, 0), held)
                    entries += 1
        refs = bm._host.refs if host else bm._device.refs
        num_blocks = bm.num_host_blocks if host else bm.num_device_blocks
        cached = 0 if host else len(bm._device._evictable)
        used, tokens = len(filled), sum(filled.values())
        pools[host] = PoolStats(
            num_blocks=num_blocks,
            free_blocks=num_blocks - used,
            cached_free_blocks=cached,
            used_blocks=used,
            shared_blocks=sum(1 for b in filled if refs[b] > 1),
            tokens_stored=tokens,
            reserved_slots=used * size,
            empty_slots=used * size - tokens,
            fragmentation=(used * size - tokens) / (used * size) if used else 0.0,
            blocks_saved_by_sharing=entries - used,
        )
    return BlockManagerStats(
        device=pools[False],
        host=pools[True],
        num_seqs=len(bm.seq_ids()),
        num_swapped_seqs=sum(map(bm.is_swapped, bm.seq_ids())),
        bytes_per_block=0,
        bytes_saved_by_sharing=0,
    )


def snapshot(bm: BlockManager) -> dict:
    """Everything observable and internal, for 'a failed call changes nothing' checks."""
    seqs = {}
    for seq_id in bm.seq_ids():
        host = bm.is_swapped(seq_id)
        seqs[seq_id] = (
            host,
            bm.host_block_table(seq_id) if host else bm.block_table(seq_id),
            bm.num_tokens(seq_id),
            bm.num_cached_tokens(seq_id),
        )
    chains = {s: (list(c.links), list(c.pending)) for s, c in bm._prefixes.chains.items()}
    return {
        "seqs": seqs,
        "device_refs": bm._device.refs.tolist(),
        "host_refs": bm._host.refs.tolist(),
        "device_free": list(bm._device._free),
        "host_free": list(bm._host._free),
        "evictable": list(bm._device._evictable),
        "cache_map": dict(bm._device._map),
        "cache_entries": dict(bm._device._entries),
        "chains": chains,
        "freed": list(bm._tables.freed_ids),
        "stats": bm.stats(),
    }


def assert_fails_cleanly(bm: BlockManager, error: type, call, *match: str) -> None:
    before = snapshot(bm)
    with pytest.raises(error) as info:
        call()
    for text in match:
        assert text in str(info.value)
    assert snapshot(bm) == before
    check_invariants(bm)


# ---------------------------------------------------------------------------- allocation


def test_allocate_and_queries():
    bm = BlockManager(10, 4)
    bm.allocate(7, 9)
    assert bm.has_seq(7) and not bm.has_seq(8)
    assert bm.num_tokens(7) == 9
    assert bm.block_table(7) == [0, 1, 2]
    assert not bm.is_swapped(7)
    assert bm.num_cached_tokens(7) == 0
    assert bm.num_free_device_blocks() == 7
    bm.allocate(8, 0)
    assert bm.block_table(8) == [] and bm.num_tokens(8) == 0
    table = bm.block_table(7)
    table.append(99)
    assert bm.block_table(7) == [0, 1, 2]
    check_invariants(bm)


def test_can_allocate_watermark():
    bm = BlockManager(100, 4, watermark=0.1)  # 10 blocks held back
    assert bm.can_allocate(4 * 90) is AllocStatus.OK
    assert bm.can_allocate(4 * 91) is AllocStatus.NEVER
    bm.allocate(1, 4 * 50)
    assert bm.can_allocate(4 * 40) is AllocStatus.OK
    assert bm.can_allocate(4 * 41) is AllocStatus.LATER
    assert bm.can_allocate(list(range(4 * 41))) is AllocStatus.LATER
    assert BlockManager(4, 4, max_blocks_per_seq=2).can_allocate(9) is AllocStatus.NEVER


def test_table_grows_past_initial_width_and_rows_past_capacity():
    bm = BlockManager(400, 1)
    bm.allocate(0, 100)
    bm.append_slots(0, 50)
    assert bm.block_table(0) == list(range(150))
    for seq_id in range(1, 200):
        bm.allocate(seq_id, 1)
    assert bm.block_table(199) == [348]
    check_invariants(bm)


def test_allocate_errors_leave_state_unchanged():
    bm = BlockManager(4, 4, max_blocks_per_seq=3)
    bm.allocate(1, 8)
    assert_fails_cleanly(bm, DuplicateSequenceError, lambda: bm.allocate(1, 1), "1")
    assert_fails_cleanly(bm, OutOfBlocksError, lambda: bm.allocate(2, 9), "2", "3", "2 free")
    assert_fails_cleanly(bm, OutOfBlocksError, lambda: bm.allocate(3, 13), "max_blocks_per_seq")
    assert_fails_cleanly(bm, ValueError, lambda: bm.allocate(4, -1))
    assert issubclass(DuplicateSequenceError, ValueError)
    assert issubclass(UnknownSequenceError, KeyError)


# ---------------------------------------------------------------------------- copy-on-write


def test_append_private_block_needs_no_copy():
    bm = BlockManager(8, 4)
    bm.allocate(1, 5)
    assert bm.append_slots(1) == []
    assert bm.block_table(1) == [0, 1] and bm.num_tokens(1) == 6


def test_append_opening_fresh_block_needs_no_copy():
    bm = BlockManager(8, 4)
    bm.allocate(1, 4)
    bm.fork(1, 2)  # the full shared block is never written
    assert bm.append_slots(1) == []
    assert bm.append_slots(2) == []
    assert bm.block_table(1) == [0, 1] and bm.block_table(2) == [0, 2]
    check_invariants(bm)


def test_append_shared_partial_block_copies_once():
    bm = BlockManager(8, 4)
    bm.allocate(1, 6)
    bm.fork(1, 2)
    assert bm.num_free_device_blocks() == 6  # fork allocates nothing
    assert bm.append_slots(2) == [(1, 2)]
    assert bm.block_table(2) == [0, 2] and bm.block_table(1) == [0, 1]
    assert bm.append_slots(1) == []  # now private again
    check_invariants(bm)


def test_fan_out_of_one_block_to_several_children():
    bm = BlockManager(8, 4)
    bm.allocate(0, 2)
    for child in (1, 2, 3):
        bm.fork(0, child)
    assert bm._device.refs[0] == 4
    pairs = [p for child in (1, 2, 3) for p in bm.append_slots(child)]
    assert pairs == [(0, 1), (0, 2), (0, 3)]
    assert bm.append_slots(0) == []  # the last holder writes in place
    assert bm.block_table(0) == [0]
    check_invariants(bm)


def test_decode_step_batch_sharing_a_block_copies_for_all_but_one():
    bm = BlockManager(8, 4)
    bm.allocate(0, 2)
    bm.fork(0, 1)
    bm.fork(0, 2)
    pairs, tables, lens, slots = bm.decode_step([0, 1, 2])
    assert pairs == [(0, 1), (0, 2)]
    assert tables.tolist() == [[1], [2], [0]]  # the last sharer in the batch writes in place
    assert lens.tolist() == [3, 3, 3] and slots.tolist() == [6, 10, 2]
    check_invariants(bm)


def test_decode_step_shared_block_also_held_outside_batch():
    bm = BlockManager(8, 4)
    bm.allocate(0, 2)
    bm.fork(0, 1)
    pairs, *_ = bm.decode_step([1])
    assert pairs == [(0, 1)]


def test_append_errors_leave_state_unchanged():
    bm = BlockManager(3, 4, max_blocks_per_seq=3)
    bm.allocate(1, 6)
    bm.fork(1, 2)
    bm.allocate(3, 1)
    # Seq 2 needs a copy of block 1 plus two fresh blocks; none are free.
    assert_fails_cleanly(bm, OutOfBlocksError, lambda: bm.append_slots(2, 4), "sequence 2")
    assert_fails_cleanly(bm, OutOfBlocksError, lambda: bm.append_slots(1, 20), "max_blocks")
    assert_fails_cleanly(bm, OutOfBlocksError, lambda: bm.decode_step([3, 2]), "needs 1")
    assert_fails_cleanly(bm, UnknownSequenceError, lambda: bm.append_slots(9), "9")
    assert_fails_cleanly(bm, UnknownSequenceError, lambda: bm.decode_step([1, 9]), "9")
    assert_fails_cleanly(bm, DuplicateSequenceError, lambda: bm.decode_step([3, 3]), "twice")
    assert_fails_cleanly(bm, ValueError, lambda: bm.append_slots(1, 2, tokens=[1]))
    assert_fails_cleanly(bm, ValueError, lambda: bm.append_slots(1, -1))


# ---------------------------------------------------------------------------- truncate


def test_truncate_frees_the_blocks_past_the_cut():
    bm = BlockManager(8, 4)
    bm.allocate(1, 10)
    assert bm.truncate(1, 10) == [] and bm.block_table(1) == [0, 1, 2]
    assert bm.truncate(1, np.int64(5)) == []
    assert bm.block_table(1) == [0, 1] and bm.num_tokens(1) == 5
    assert bm.num_free_device_blocks() == 6
    assert bm.slot_mapping_tensor([1], 5).tolist() == [0, 1, 2, 3, 4]
    assert bm.append_slots(1, 4) == [] and bm.block_table(1) == [0, 1, 3]
    pairs, tables, lens, slots = bm.decode_step([1])
    assert lens.tolist() == [10] and slots.tolist() == [13]
    assert bm.truncate(1, 0) == [] and bm.block_table(1) == [] and bm.num_tokens(1) == 0
    bm.append_slots(1, 1)
    assert bm.block_table(1) == [4] and bm.num_free_device_blocks() == 7
    check_invariants(bm)


def test_truncate_into_a_shared_block_copies_on_the_next_append():
    bm = BlockManager(8, 4)
    bm.allocate(1, 8)
    bm.fork(1, 2)
    assert bm.truncate(2, 6) == []  # nothing is written yet
    assert bm.block_table(2) == [0, 1] and bm._device.refs[1] == 2
    assert bm.stats().device.tokens_stored == 8  # block 1 is still full for sequence 1
    check_invariants(bm)
    assert bm.append_slots(2) == [(1, 2)]  # block 1 is full for sequence 1: copied first
    assert bm.block_table(2) == [0, 2] and bm.block_table(1) == [0, 1]
    bm.fork(1, 3)
    bm.free(2)
    bm.truncate(3, 2)
    bm.truncate(1, 3)
    pairs, *_ = bm.decode_step([3, 1])  # both hold block 0, partly filled: one copy
    assert pairs == [(0, bm.block_table(3)[0])] and bm.block_table(1) == [0]
    check_invariants(bm)


def test_truncate_keeps_the_prefix_cache_consistent():
    bm = BlockManager(16, 4, enable_prefix_caching=True)
    prompt = list(range(1, 10))  # blocks 0 [1..4] and 1 [5..8] cached, block 2 holds [9]
    bm.allocate(1, prompt)
    assert bm.truncate(1, 6) == []  # block 1, now partial and only held by 1, leaves the cache
    assert not bm._device.is_cached(1) and bm._device.is_cached(0)
    assert bm.cached_prefix_length(prompt) == 4
    bm.append_slots(1, 2, tokens=[60, 70])  # overwrites block 1, registered again when full
    assert bm.block_table(1) == [0, 1] and bm._device.is_cached(1)
    bm.allocate(2, [1, 2, 3, 4, 5, 6, 60, 70, 0])
    assert bm.num_cached_tokens(2) == 8 and bm.block_table(2)[:2] == [0, 1]
    # Block 1 is cached and shared with sequence 2: cutting into it copies it now.
    (pair,) = bm.truncate(2, 5)
    assert pair[0] == 1 and bm.block_table(2) == [0, pair[1]] and bm._device.is_cached(1)
    assert bm.num_cached_tokens(2) == 5 and not bm._device.is_cached(pair[1])
    bm.append_slots(2, 3, tokens=[6, 60, 70])  # the same tokens again: the cached entry serves
    bm.append_slots(2, 4, tokens=[80, 81, 82, 83])
    bm.allocate(3, [1, 2, 3, 4, 5, 6, 60, 70, 80, 81, 82, 83, 0])
    assert bm.num_cached_tokens(3) == 12
    assert bm.block_table(3)[:3] == [0, 1, bm.block_table(2)[2]]
    check_invariants(bm)


def test_truncate_leaves_valid_blocks_past_the_cut_cached_unless_told():
    bm = BlockManager(16, 2, enable_prefix_caching=True)
    prompt = [1, 2, 3, 4, 5, 6, 7]  # blocks 0 [1, 2], 1 [3, 4], 2 [5, 6] cached, 3 holds [7]
    bm.allocate(1, prompt)
    entries = [bm._device._entries[b] for b in (0, 1, 2)]
    bm.truncate(1, 2)
    assert bm.cached_prefix_length(prompt) == 6  # their KV is still valid
    assert bm.num_free_device_blocks() == 15 and bm._device.num_evictable() == 2
    bm.append_slots(1, 4, tokens=[3, 4, 5, 6])  # new blocks, chained through the cached ones
    assert bm._prefixes.chains[1].links == entries
    bm.allocate(2, prompt)
    assert bm.block_table(2)[:3] == [0, 1, 2]
    bm.truncate(2, 2, cache=False)  # as for tokens whose forward pass never ran
    assert bm.cached_prefix_length(prompt) == 2
    check_invariants(bm)


def test_truncate_cuts_the_prefix_chain_back():
    bm = BlockManager(16, 2, enable_prefix_caching=True)
    bm.allocate(1, [1, 2, 3, 4, 5])
    bm.truncate(1, 3)  # the chain now ends after block 0, with [3] pending
    assert bm._prefixes.chains[1].pending == [3] and len(bm._prefixes.chains[1].links) == 1
    bm.append_slots(1, 3, tokens=[9, 9, 9])
    bm.allocate(2, [1, 2, 3, 9, 9, 9, 0])
    assert bm.num_cached_tokens(2) == 6
    bm.allocate(3, [1, 2, 3, 4, 9, 9, 0])  # the old block [3, 4] was overwritten: no hit on it
    assert bm.num_cached_tokens(3) == 2
    check_invariants(bm)


def test_truncate_errors_leave_state_unchanged():
    bm = BlockManager(5, 4, 4, enable_prefix_caching=True, watermark=0.0)
    bm.allocate(1, list(range(9)))
    bm.allocate(2, list(range(8)) + [99])  # shares the cached blocks 0 and 1
    assert_fails_cleanly(bm, UnknownSequenceError, lambda: bm.truncate(9, 1), "9")
    assert_fails_cleanly(bm, ValueError, lambda: bm.truncate(1, 10), "has 9 tokens")
    assert_fails_cleanly(bm, ValueError, lambda: bm.truncate(1, -1), "num_tokens")
    assert_fails_cleanly(bm, TypeError, lambda: bm.truncate(1, 2.0), "num_tokens")
    bm.allocate(3, 4)  # the last free block
    bm.fork(1, 4)
    # Cutting sequence 1 into the shared cached block 1 needs a copy; its block 2 is shared too.
    assert_fails_cleanly(
        bm, OutOfBlocksError, lambda: bm.truncate(1, 6), "needs 1 device", "0 free"
    )
    assert bm.truncate(2, 6) != []  # dropping its own last block makes room for the copy
    bm.swap_out([3])
    assert_fails_cleanly(bm, SwapError, lambda: bm.truncate(3, 1), "swapped out")
    check_invariants(bm)


def test_truncate_with_a_sliding_window():
    bm = BlockManager(8, 4, sliding_window=6)
    bm.allocate(1, 12)
    bm.append_slots(1, 2)  # position 12 attends 7..12: block 0 is released
    assert bm.block_table(1) == [RELEASED, 1, 2, 3]
    # Cut to 9 tokens: the next token (position 9) attends 4..9, still held.
    assert_fails_cleanly(bm, ValueError, lambda: bm.truncate(1, 8), "keep at least 9")
    assert bm.truncate(1, 9) == [] and bm.block_table(1) == [RELEASED, 1, 2]
    assert bm.slot_mapping_tensor([1], 9).tolist() == [-1] * 4 + [4, 5, 6, 7, 8]
    check_invariants(bm)
    bm.append_slots(1)
    assert bm.block_table(1) == [RELEASED, 1, 2]


def test_decode_copy_decision_counts_the_step_window_releases():
    bm = BlockManager(8, 2, sliding_window=3, watermark=0.0)
    bm.allocate(1, 4)  # blocks 0, 1
    bm.fork(1, 2)
    bm.truncate(2, 1)  # sequence 2 keeps 1 token of block 0, which is full for sequence 1
    pairs, *_ = bm.decode_step([2, 1])
    # Sequence 1's window leaves block 0, which sequence 2 then holds alone: no copy, no leak.
    assert pairs == [] and bm.block_table(1)[0] == RELEASED and bm.block_table(2) == [0]
    check_invariants(bm)


# ---------------------------------------------------------------------------- fork and free


def test_fork_errors_and_free():
    bm = BlockManager(8, 4, 8)
    bm.allocate(1, 5)
    assert_fails_cleanly(bm, UnknownSequenceError, lambda: bm.fork(9, 10), "9")
    assert_fails_cleanly(bm, DuplicateSequenceError, lambda: bm.fork(1, 1), "1")
    bm.fork(1, 2)
    bm.free(1)
    assert bm.block_table(2) == [0, 1] and bm.num_free_device_blocks() == 6
    bm.free(2)
    assert bm.num_free_device_blocks() == 8
    assert_fails_cleanly(bm, DoubleFreeError, lambda: bm.free(2), "2", "already freed")
    assert_fails_cleanly(bm, UnknownSequenceError, lambda: bm.free(3), "3")
    bm.allocate(2, 1)  # an id can be reused after free
    bm.free(2)
    bm.allocate(3, 1)
    bm.swap_out([3])
    assert_fails_cleanly(bm, SwapError, lambda: bm.fork(3, 4), "3")
    check_invariants(bm)


def test_fork_many_and_free_many_reorder_beams():
    bm = BlockManager(16, 4, 8)
    bm.allocate(0, 6)
    bm.fork_many([0, 0, 0], [1, 2, 3])
    assert bm._device.refs[[0, 1]].tolist() == [4, 4]
    bm.decode_step([0, 1, 2, 3])  # beams diverge: three copies
    # New beams 10..13 from parents 2, 2, 3, 0; the old beams go.
    parents = [2, 2, 3, 0]
    bm.fork_many(parents, [10, 11, 12, 13])
    tables = {s: bm.block_table(s) for s in (0, 2, 3)}
    bm.free_many([0, 1, 2, 3])
    assert [bm.block_table(c) for c in (10, 11, 12, 13)] == [tables[p] for p in parents]
    assert bm.stats().device.used_blocks == 1 + 3  # block 0 and the three surviving last blocks
    check_invariants(bm)
    pairs, *_ = bm.decode_step([10, 11, 12, 13])
    assert len(pairs) == 1  # 10 and 11 share a last block: the first copies
    bm.swap_out([12])
    bm.free_many([10, 11, 12, 13])  # device and host at once
    assert bm.num_free_device_blocks() == 16 and bm.num_free_host_blocks() == 8
    check_invariants(bm)


def test_fork_many_and_free_many_errors_leave_state_unchanged():
    bm = BlockManager(16, 4)
    bm.allocate(0, 6)
    bm.allocate(1, 2)
    bm.allocate(5, 2)
    bm.free(5)
    assert_fails_cleanly(bm, DuplicateSequenceError, lambda: bm.fork_many([0, 0], [2, 1]), "[1]")
    assert_fails_cleanly(bm, DuplicateSequenceError, lambda: bm.fork_many([0, 1], [2, 2]))
    assert_fails_cleanly(bm, UnknownSequenceError, lambda: bm.fork_many([0, 9], [2, 3]), "9")
    assert_fails_cleanly(bm, ValueError, lambda: bm.fork_many([0], [2, 3]))
    assert_fails_cleanly(bm, DoubleFreeError, lambda: bm.free_many([0, 5]), "5")
    assert_fails_cleanly(bm, DoubleFreeError, lambda: bm.free_many([0, 1, 0]), "twice")
    assert_fails_cleanly(bm, UnknownSequenceError, lambda: bm.free_many([0, 7]), "7")


# ---------------------------------------------------------------------------- swapping


def test_swap_keeps_sharing_and_round_trips():
    bm = BlockManager(8, 4, 8)
    bm.allocate(1, 6)
    bm.fork(1, 2)
    bm.append_slots(2, 3)  # seq 2: [0, 2, 3], seq 1: [0, 1]
    assert bm.can_swap_out([1, 2])
    out = bm.swap_out([1, 2])
    assert sorted(d for d, _ in out) == [0, 1, 2, 3]  # the shared block moves once
    assert bm.is_swapped(1) and bm.is_swapped(2)
    host1, host2 = bm.host_block_table(1), bm.host_block_table(2)
    assert host1[0] == host2[0] and bm._host.refs[host1[0]] == 2
    assert bm.num_free_device_blocks() == 8
    assert bm.can_swap_in([1, 2]) is AllocStatus.OK
    back = bm.swap_in([1, 2])
    assert sorted(h for h, _ in back) == sorted(h for _, h in out)
    assert bm.block_table(1)[0] == bm.block_table(2)[0]
    assert bm.num_free_host_blocks() == 8
    check_invariants(bm)


def test_swap_of_sequence_sharing_with_one_left_behind_copies():
    bm = BlockManager(8, 4, 8)
    bm.allocate(1, 6)
    bm.fork(1, 2)
    out = bm.swap_out([2])
    assert [d for d, _ in out] == [0, 1]
    assert bm.block_table(1) == [0, 1] and bm._device.refs[[0, 1]].tolist() == [1, 1]
    assert bm.num_free_host_blocks() == 6
    bm.swap_in([2])
    assert not set(bm.block_table(2)) & {0, 1}  # back in its own blocks, no longer shared
    check_invariants(bm)


def test_swap_errors_leave_state_unchanged():
    bm = BlockManager(6, 4, 2, watermark=0.0)
    bm.allocate(1, 12)
    bm.allocate(2, 4)
    assert not bm.can_swap_out([1])
    assert_fails_cleanly(bm, OutOfBlocksError, lambda: bm.swap_out([1]), "3 host blocks", "2")
    assert_fails_cleanly(bm, SwapError, lambda: bm.swap_in([2]), "[2]")
    assert_fails_cleanly(bm, UnknownSequenceError, lambda: bm.swap_out([2, 5]), "5")
    assert_fails_cleanly(bm, DuplicateSequenceError, lambda: bm.swap_out([2, 2]))
    bm.swap_out([2])
    assert_fails_cleanly(bm, SwapError, lambda: bm.swap_out([2]), "[2]")
    assert_fails_cleanly(bm, SwapError, lambda: bm.append_slots(2), "2")
    assert_fails_cleanly(bm, SwapError, lambda: bm.decode_step([1, 2]), "[2]")
    assert_fails_cleanly(bm, SwapError, lambda: bm.block_table(2))
    assert_fails_cleanly(bm, SwapError, lambda: bm.host_block_table(1))
    assert_fails_cleanly(bm, SwapError, lambda: bm.block_tables_tensor([2]))
    bm.allocate(3, 12)
    assert bm.can_swap_in([2]) is AllocStatus.LATER
    assert_fails_cleanly(bm, OutOfBlocksError, lambda: bm.swap_in([2]), "1 device", "0 free")
    assert BlockManager(4, 4, 8).can_swap_in([]) is AllocStatus.OK
    big = BlockManager(10, 4, 20, watermark=0.2)  # 2 blocks held back
    big.allocate(1, 36)  # 9 blocks: allocate itself ignores the watermark
    big.swap_out([1])
    assert big.can_swap_in([1]) is AllocStatus.NEVER
    bm.free(2)
    assert bm.num_free_host_blocks() == 2
    check_invariants(bm)


# ---------------------------------------------------------------------------- prefix caching


def test_prefix_cache_hit_shares_full_blocks_but_not_the_last_token():
    bm = BlockManager(16, 4, enable_prefix_caching=True)
    prompt = list(range(10))
    bm.allocate(1, prompt)
    bm.allocate(2, prompt[:8] + [50, 51])
    assert bm.block_table(2)[:2] == bm.block_table(1)[:2]
    assert bm.num_cached_tokens(2) == 8
    bm.allocate(3, prompt[:8])  # the whole prompt is cached, yet its last token is computed
    assert bm.num_cached_tokens(3) == 4
    assert bm.block_table(3)[0] == bm.block_table(1)[0]
    assert bm.block_table(3)[1] != bm.block_table(1)[1]
    bm.allocate(4, [99] + prompt[1:])  # first block differs: no hit at all, even later ones
    assert bm.num_cached_tokens(4) == 0
    bm.allocate(5, 10)  # a count cannot hit
    assert bm.num_cached_tokens(5) == 0
    check_invariants(bm)


def test_cached_prefix_length_is_what_allocate_would_hit():
    bm = BlockManager(6, 4, enable_prefix_caching=True, watermark=0.0)
    prompt = list(range(10))
    assert bm.cached_prefix_length(prompt) == 0
    bm.allocate(1, prompt)  # registers blocks 0 [0..3] and 1 [4..7]
    assert BlockManager(6, 4).cached_prefix_length(prompt) == 0  # no prefix caching
    before = snapshot(bm)
    queries = [prompt, prompt[:8], prompt[:9], prompt[:4] + [50, 51], torch.tensor(prompt)]
    assert [bm.cached_prefix_length(q) for q in queries] == [8, 4, 8, 4, 8]
    assert bm.cached_prefix_length(np.array([], dtype=np.int64)) == 0
    assert snapshot(bm) == before  # read-only
    bm.free(1)
    assert bm.cached_prefix_length(prompt) == 8  # unreferenced, still cached
    assert list(bm._device._evictable) == [1, 0]  # the query touched no LRU position
    for query in queries:
        bm.allocate(2, query)
        assert bm.num_cached_tokens(2) == bm.cached_prefix_length(query)
        bm.free(2)
    bm.allocate(3, 24)  # evicts both cached blocks
    assert bm.cached_prefix_length(prompt) == 0
    for bad in (5, torch.tensor(5), torch.tensor([[1, 2]]), torch.ones(2)):
        with pytest.raises(TypeError, match="tokens"):
            bm.cached_prefix_length(bad)


def test_chunked_prefill_registers_only_what_each_step_computes():
    # The documented rule for an engine prefilling a prompt in chunks with prefix caching.
    bm = BlockManager(16, 4, enable_prefix_caching=True)
    prompt = list(range(20))
    bm.allocate(1, prompt[:8])  # the first chunk's blocks are registered as it is computed
    assert bm.cached_prefix_length(prompt) == 8
    bm.append_slots(1, 8, tokens=prompt[8:16])
    assert bm.cached_prefix_length(prompt) == 16
    served = bm.cached_prefix_length(prompt)
    bm.allocate(2, prompt[: served + 4])  # a second request computes only its last chunk
    assert bm.num_cached_tokens(2) == served
    check_invariants(bm)


def test_prefix_cache_survives_free_and_evicts_lru():
    bm = BlockManager(4, 2, enable_prefix_caching=True, watermark=0.0)
    bm.allocate(1, [1, 2, 3, 4, 5])  # blocks 0,1 cached; block 2 holds [5]
    bm.free(1)
    assert bm.num_free_device_blocks() == 4 and len(bm._device._evictable) == 2
    assert bm.can_allocate([1, 2, 3, 4, 6]) is AllocStatus.OK
    bm.allocate(2, [1, 2, 3, 4, 6])
    assert bm.num_cached_tokens(2) == 4 and bm.block_table(2)[:2] == [0, 1]
    bm.free(2)
    # Freed in reverse: block 1 (the chain's tail) is least recently used, then block 0.
    assert list(bm._device._evictable) == [1, 0]
    bm.allocate(3, 6)  # takes the two free blocks, then evicts block 1
    assert bm.block_table(3) == [2, 3, 1]
    assert 1 not in bm._device._entries and 0 in bm._device._entries
    bm.free(3)
    bm.allocate(4, [1, 2, 3, 4, 7])
    assert bm.num_cached_tokens(4) == 2
    check_invariants(bm)


def test_prefix_cache_hash_collision_is_verified(monkeypatch):
    monkeypatch.setattr(block_pool, "hash", lambda value: 7, raising=False)
    bm = BlockManager(8, 2, enable_prefix_caching=True)
    bm.allocate(1, [1, 2, 3])
    bm.allocate(2, [5, 6, 3])  # same hash, other tokens: no hit
    assert bm.num_cached_tokens(2) == 0
    assert bm.block_table(2)[0] != bm.block_table(1)[0]
    check_invariants(bm)


def test_prefix_cache_hit_needs_same_predecessor():
    # Blocks [3,4] after [1,2] and after [9,9] must not alias even when hashes collide.
    bm = BlockManager(16, 2, enable_prefix_caching=True)
    bm.allocate(1, [1, 2, 3, 4, 0])
    bm.allocate(2, [9, 9, 3, 4, 0])
    assert bm.num_cached_tokens(2) == 0


def test_prefix_cache_hit_needs_same_predecessor_under_collisions(monkeypatch):
    # A hash of the tokens alone: [3,4] after [1,2] and after [9,9] collide.
    monkeypatch.setattr(block_pool, "hash", lambda value: hash(value[1]), raising=False)
    bm = BlockManager(16, 2, enable_prefix_caching=True)
    bm.allocate(1, [1, 2, 3, 4, 0])
    bm.allocate(2, [9, 9, 3, 4, 0])
    bm.allocate(3, [9, 9, 3, 4, 0])
    assert bm.num_cached_tokens(3) == 2
    assert bm.block_table(3)[0] == bm.block_table(2)[0]
    assert bm.block_table(3)[1] not in (bm.block_table(1)[1], bm.block_table(2)[1])
    check_invariants(bm)


def test_appended_tokens_become_cacheable():
    bm = BlockManager(16, 2, enable_prefix_caching=True)
    bm.allocate(1, torch.tensor([1, 2, 3]))
    bm.append_slots(1, 1, tokens=[4])
    bm.decode_step([1], tokens=torch.tensor([5]))
    bm.decode_step([1], tokens=np.array([6]))
    bm.allocate(2, [1, 2, 3, 4, 5, 6, 7])
    assert bm.num_cached_tokens(2) == 6
    assert bm.block_table(2)[:3] == bm.block_table(1)
    bm.append_slots(2, 1)  # unknown token ids end caching for this sequence
    bm.append_slots(2, 2, tokens=[8, 9])
    bm.allocate(3, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11])
    assert bm.num_cached_tokens(3) == 6
    check_invariants(bm)


def test_fork_children_cache_their_own_continuations():
    bm = BlockManager(16, 2, enable_prefix_caching=True)
    bm.allocate(1, [1, 2, 3])
    bm.fork(1, 2)
    bm.append_slots(1, 1, tokens=[4])
    bm.append_slots(2, 1, tokens=[5])
    bm.allocate(3, [1, 2, 3, 5, 0])
    assert bm.block_table(3)[:2] == bm.block_table(2)
    check_invariants(bm)


def test_free_without_cache_forgets_unwritten_blocks():
    bm = BlockManager(8, 2, enable_prefix_caching=True)
    bm.allocate(1, [1, 2, 3])
    bm.free(1, cache=False)
    assert not bm._device._entries and not bm._device._evictable
    bm.allocate(2, [1, 2, 3])
    assert bm.num_cached_tokens(2) == 0


def test_prefix_hit_on_evictable_blocks_counts_against_free_space():
    bm = BlockManager(3, 2, enable_prefix_caching=True, watermark=0.0)
    bm.allocate(1, [1, 2, 3, 4, 5])
    bm.free(1)
    bm.allocate(2, [1, 2, 0])  # hits block 0, takes one fresh block
    assert bm.can_allocate(4) is AllocStatus.LATER
    assert bm.can_allocate(2) is AllocStatus.OK
    assert_fails_cleanly(bm, OutOfBlocksError, lambda: bm.allocate(3, [1, 2, 3, 4, 0]))


def test_options_validation():
    with pytest.raises(ValueError):
        BlockManager(0, 16)
    with pytest.raises(ValueError):
        BlockManager(4, 16, sliding_window=0)
    with pytest.raises(ValueError):
        BlockManager(4, 16, sliding_window=8, enable_prefix_caching=True)
    with pytest.raises(ValueError, match="prefix caching"):
        BlockManager(4, 16, attention_chunk_size=8, enable_prefix_caching=True)
    with pytest.raises(ValueError, match="attention_chunk_size"):
        BlockManager(4, 16, attention_chunk_size=0)
    with pytest.raises(ValueError):
        BlockManager(4, 16, max_blocks_per_seq=0)


@pytest.mark.parametrize(
    "kwargs, error, name",
    [
        ({"watermark": -1.0}, ValueError, "watermark"),
        ({"watermark": 1.0}, ValueError, "watermark"),
        ({"watermark": float("nan")}, ValueError, "watermark"),
        ({"watermark": True}, TypeError, "watermark"),
        ({"watermark": "0.1"}, TypeError, "watermark"),
        ({"block_size": 2.5}, TypeError, "block_size"),
        ({"block_size": 4.0}, TypeError, "block_size"),
        ({"block_size": True}, TypeError, "block_size"),
        ({"block_size": torch.tensor(4.0)}, TypeError, "block_size"),
        ({"block_size": torch.tensor([4])}, TypeError, "block_size"),
        ({"num_device_blocks": 8.0}, TypeError, "num_device_blocks"),
        ({"num_host_blocks": 1.5}, TypeError, "num_host_blocks"),
        ({"num_host_blocks": -1}, ValueError, "num_host_blocks"),
        ({"sliding_window": 2.5}, TypeError, "sliding_window"),
        ({"sliding_window": True}, TypeError, "sliding_window"),
        ({"attention_chunk_size": 8.0}, TypeError, "attention_chunk_size"),
        ({"max_blocks_per_seq": 2.5}, TypeError, "max_blocks_per_seq"),
    ],
)
def test_constructor_refuses_non_integers_and_bad_watermarks(kwargs, error, name):
    arguments = {"num_device_blocks": 8, "block_size": 4, "num_host_blocks": 2, **kwargs}
    with pytest.raises(error, match=name):
        BlockManager(**arguments)


def test_constructor_takes_numpy_and_0d_tensor_integers():
    bm = BlockManager(
        np.int64(8),
        torch.tensor(4),
        np.array(2, dtype=np.int32),
        watermark=np.float32(0.25),
        sliding_window=np.uint8(6),
        max_blocks_per_seq=torch.tensor(5, dtype=torch.int16),
    )
    sizes = (bm.num_device_blocks, bm.block_size, bm.num_host_blocks, bm.sliding_window)
    assert sizes == (8, 4, 2, 6) and bm.max_blocks_per_seq == 5 and bm.watermark_blocks == 2
    assert all(type(v) is int for v in (*sizes, bm.max_blocks_per_seq))
    bm.allocate(1, 9)
    assert bm.block_table(1) == [0, 1, 2]
    check_invariants(bm)


def test_token_counts_are_integers_0d_tensors_included():
    bm = BlockManager(16, 4, 4, enable_prefix_caching=True)
    assert bm.can_allocate(torch.tensor(9)) is AllocStatus.OK
    bm.allocate(1, torch.tensor(9))
    bm.allocate(2, np.int64(5))
    bm.allocate(3, np.array(1))
    assert [bm.num_tokens(s) for s in (1, 2, 3)] == [9, 5, 1]
    assert bm.append_slots(1, torch.tensor(2)) == [] and bm.num_tokens(1) == 11
    for bad in (2.5, 2.0, True, torch.tensor(2.0), torch.tensor(True), np.float64(3)):
        assert_fails_cleanly(bm, TypeError, lambda bad=bad: bm.allocate(9, bad), "token count")
        with pytest.raises(TypeError, match="token count"):
            bm.can_allocate(bad)
        assert_fails_cleanly(bm, TypeError, lambda bad=bad: bm.append_slots(1, bad), "n must")
    for bad in (torch.tensor([1.0, 2.0]), torch.tensor([[1, 2]]), np.array([True]), "ab"):
        assert_fails_cleanly(bm, TypeError, lambda bad=bad: bm.allocate(9, bad), "tokens")
    assert_fails_cleanly(
        bm, TypeError, lambda: bm.append_slots(1, 1, tokens=torch.tensor([1.5])), "tokens"
    )
    assert_fails_cleanly(
        bm, TypeError, lambda: bm.decode_step([1], tokens=np.array([0.5])), "tokens"
    )
    assert bm.slot_mapping_tensor([1, 2], torch.tensor(1)).tolist() == [10, 16]
    assert bm.slot_mapping_tensor([1, 2], torch.tensor([1, 0])).tolist() == [10]
    for bad in (1.5, [1.0, 1.0], np.array([True, True])):
        with pytest.raises(TypeError, match="num_new_tokens"):
            bm.slot_mapping_tensor([1, 2], bad)
    with pytest.raises(ValueError, match="one count per sequence"):
        bm.slot_mapping_tensor([1, 2], [1, 1, 1])
    check_invariants(bm)


def test_free_many_of_a_never_allocated_id_is_unknown_not_a_double_free():
    bm = BlockManager(8, 4)
    bm.allocate(0, 4)
    assert_fails_cleanly(bm, UnknownSequenceError, lambda: bm.free_many([7, 7]), "7")
    assert_fails_cleanly(bm, UnknownSequenceError, lambda: bm.free_many([0, 7, 7]), "7")
    assert_fails_cleanly(bm, DoubleFreeError, lambda: bm.free_many([0, 0]), "twice")


# ---------------------------------------------------------------------------- sliding window


def test_sliding_window_releases_blocks_outside_the_window():
    bm = BlockManager(8, 4, sliding_window=6)
    bm.allocate(1, 10)  # blocks 0,1,2; the prompt's own attention still needs them all
    assert bm.block_table(1) == [0, 1, 2]
    bm.append_slots(1)  # position 10 attends 5..10: block 0 (0..3) is outside
    assert bm.block_table(1) == [RELEASED, 1, 2]
    assert bm.num_free_device_blocks() == 6
    assert bm.block_tables_tensor([1]).tolist() == [[0, 1, 2]]
    assert bm.block_tables_tensor([1], pad=7).tolist() == [[7, 1, 2]]
    assert bm.slot_mapping_tensor([1], 11).tolist() == [-1] * 4 + list(range(4, 11))
    pairs, tables, lens, slots = bm.decode_step([1])  # position 11 attends 6..11
    assert tables.tolist() == [[0, 1, 2]] and lens.tolist() == [12] and slots.tolist() == [11]
    pairs, tables, lens, slots = bm.decode_step([1])  # position 12 attends 7..12: opens block 3
    assert bm.block_table(1) == [RELEASED, 1, 2, 3]
    assert slots.tolist() == [12]
    bm.append_slots(1, 2)  # first new token (position 13) attends 8..13: block 1 goes
    assert bm.block_table(1) == [RELEASED, RELEASED, 2, 3]
    check_invariants(bm)
    bm.free(1)
    assert bm.num_free_device_blocks() == 8


def test_attention_chunks_release_the_blocks_before_the_current_chunk():
    bm = BlockManager(8, 4, attention_chunk_size=8)
    bm.allocate(1, 7)  # positions 0..6 in blocks 0, 1
    bm.append_slots(1, 2)  # position 7 still reads chunk 0..7: nothing released
    assert bm.block_table(1) == [0, 1, 2]
    bm.append_slots(1)  # position 9 reads 8..9: blocks 0 and 1 (positions 0..7) go
    assert bm.block_table(1) == [RELEASED, RELEASED, 2]
    assert bm.num_free_device_blocks() == 7
    assert bm.slot_mapping_tensor([1], 10).tolist() == [-1] * 8 + [8, 9]
    for _ in range(5):  # positions 10..14 read from 8: block 2 stays
        bm.decode_step([1])
    assert bm.block_table(1) == [RELEASED, RELEASED, 2, 3]
    bm.decode_step([1])  # position 15 reads 8..15
    pairs, tables, lens, slots = bm.decode_step([1])  # position 16 opens chunk 16..23
    assert bm.block_table(1) == [RELEASED] * 4 + [4] and tables.tolist() == [[0, 0, 0, 0, 4]]
    assert lens.tolist() == [17] and slots.tolist() == [16]
    check_invariants(bm)


def test_truncate_with_attention_chunks():
    bm = BlockManager(8, 4, attention_chunk_size=8)
    bm.allocate(1, 12)
    bm.append_slots(1, 2)  # position 12 reads 8..12: blocks 0 and 1 are released
    assert bm.block_table(1) == [RELEASED, RELEASED, 2, 3]
    # Cut to 7 tokens: the next token (position 7) would read chunk 0..7, released.
    assert_fails_cleanly(bm, ValueError, lambda: bm.truncate(1, 7), "keep at least 8")
    assert bm.truncate(1, 8) == [] and bm.block_table(1) == [RELEASED, RELEASED]
    bm.append_slots(1)  # position 8 reads 8: a fresh block for it, nothing else
    assert bm.block_table(1)[:2] == [RELEASED, RELEASED] and len(bm.block_table(1)) == 3
    check_invariants(bm)


def test_windowed_and_chunked_layers_keep_what_either_reads():
    bm = BlockManager(16, 4, sliding_window=6, attention_chunk_size=8)
    bm.allocate(1, 8)
    bm.append_slots(1, 4)  # position 8: the window reads 3..8, the chunk 8: block 0 stays
    assert bm.block_table(1) == [0, 1, 2]
    bm.append_slots(1, 2)  # position 12: the window reads 7..12, the chunk 8..12
    assert bm.block_table(1) == [RELEASED, 1, 2, 3]
    for _ in range(4):  # up to position 17: the window reads from 12, the chunk from 16
        bm.decode_step([1])
    assert bm.block_table(1) == [RELEASED, RELEASED, RELEASED, 3, 4]
    check_invariants(bm)


def test_sliding_window_shared_release_and_swap():
    bm = BlockManager(8, 2, 8, sliding_window=2)
    bm.allocate(1, 4)
    bm.fork(1, 2)
    bm.decode_step([1, 2])  # both release block 0; each copies nothing (the last block opens)
    assert bm.block_table(1)[0] == RELEASED and bm._device.refs[0] == 0
    bm.swap_out([1, 2])
    assert bm.host_block_table(1)[0] == RELEASED
    bm.swap_in([1, 2])
    check_invariants(bm)


# ---------------------------------------------------------------------------- tensors and stats


def test_step_tensors():
    bm = BlockManager(16, 4)
    bm.allocate(1, 5)
    bm.allocate(2, 12)
    tables = bm.block_tables_tensor([2, 1])
    assert tables.dtype == torch.int32 and tables.tolist() == [[2, 3, 4], [0, 1, 0]]
    assert bm.block_tables_tensor([2, 1], pad=-1).tolist() == [[2, 3, 4], [0, 1, -1]]
    lens = bm.seq_lens_tensor([1, 2])
    assert lens.dtype == torch.int32 and lens.tolist() == [5, 12]
    slots = bm.slot_mapping_tensor([1, 2])
    assert slots.dtype == torch.int64 and slots.tolist() == [4, 19]
    assert bm.slot_mapping_tensor([1, 2], [5, 2]).tolist() == [0, 1, 2, 3, 4, 18, 19]
    assert bm.slot_mapping_tensor([2, 1], 0).tolist() == []
    with pytest.raises(ValueError, match="sequence 1 has 5 tokens"):
        bm.slot_mapping_tensor([1], 6)
    assert bm.block_tables_tensor([]).shape == (0, 0)
    mapping = BlockManager.mapping_tensor([(1, 2), (3, 4)])
    assert mapping.dtype == torch.int64 and mapping.tolist() == [[1, 2], [3, 4]]
    assert BlockManager.mapping_tensor([]).shape == (0, 2)


def test_decode_step_matches_append_slots_and_arrays():
    rng = random.Random(0)
    fast, slow = BlockManager(64, 4), BlockManager(64, 4)
    for manager in (fast, slow):
        manager.allocate(0, 7)
        manager.allocate(1, 4)
        manager.fork(0, 2)
    ids = [2, 0, 1]
    for _ in range(9):
        rng.shuffle(ids)
        pairs, tables, lens, slots = fast.decode_step(ids)
        expected = [p for s in ids for p in slow.append_slots(s)]
        assert pairs == expected
        for got, want in (
            (tables, slow.block_tables_array(ids)),
            (lens, slow.seq_lens_array(ids)),
            (slots, slow.slot_mapping_array(ids)),
        ):
            assert isinstance(got, np.ndarray) and got.dtype == want.dtype  # plain arrays
            assert np.array_equal(got, want)
        assert torch.equal(slow.seq_lens_tensor(ids), torch.from_numpy(lens))
    assert snapshot(fast) == snapshot(slow)


def test_stats():
    bm = BlockManager(8, 4, 4)
    bm.allocate(1, 6)
    bm.fork(1, 2)
    bm.fork(1, 3)
    bm.append_slots(3, 2)
    stats = bm.stats(bytes_per_block=1000)
    device = stats.device
    assert (device.used_blocks, device.free_blocks, device.shared_blocks) == (3, 5, 2)
    assert device.tokens_stored == 4 + 2 + 4  # block 0 once, block 1 (2 tokens), block 2
    assert device.reserved_slots == 12 and device.empty_slots == 2
    assert device.fragmentation == pytest.approx(2 / 12)
    assert device.blocks_saved_by_sharing == 3  # 6 table entries in 3 blocks
    assert bm.blocks_saved_by_sharing() == 3
    assert stats.bytes_saved_by_sharing == 3000
    assert stats.num_seqs == 3 and stats.num_swapped_seqs == 0
    bm.swap_out([1, 2])
    stats = bm.stats()
    assert stats.host.used_blocks == 2 and stats.host.blocks_saved_by_sharing == 2
    assert stats.num_swapped_seqs == 2 and stats.device.used_blocks == 2
    assert bm.blocks_saved_by_sharing() == stats.device.blocks_saved_by_sharing == 0


# ---------------------------------------------------------------------------- replay


class ShadowCache:
    """One value per slot on each side; applies every mapping the manager returns and checks
    that each sequence reads back exactly the values it wrote."""

    def __init__(self, bm: BlockManager) -> None:
        self.bm = bm
        size = bm.block_size
        self.device = np.full(bm.num_device_blocks * size, -1, dtype=np.int64)
        self.host = np.full(max(bm.num_host_blocks, 1) * size, -1, dtype=np.int64)
        self.tokens: dict[int, list[int]] = {}  # what each sequence wrote, in order
        self.values: dict[int, list[int]] = {}  # a value per token that depends on its prefix
        # The first position the latest computed token of each sequence attends (window, chunk).
        self.attends_from: dict[int, int] = {}

    def _first_read(self, position: int) -> int:
        return int(self.bm.reach.first_read(np.array([position]))[0])

    @staticmethod
    def _value(previous: int, token: int) -> int:
        return (previous * 1_000_003 + token + 1) % (1 << 61)

    def _copy(self, pairs, src, dst) -> None:
        size = self.bm.block_size
        for a, b in pairs:
            dst[b * size : (b + 1) * size] = src[a * size : (a + 1) * size]

    def _extend(self, seq_id: int, tokens: list[int]) -> None:
        values = self.values.setdefault(seq_id, [])
        self.attends_from[seq_id] = self._first_read(len(values))
        self.tokens.setdefault(seq_id, []).extend(tokens)
        for token in tokens:
            values.append(self._value(values[-1] if values else 0, token))

    def _write_last(
        self, seq_ids: list[int], counts: list[int], slots: np.ndarray | torch.Tensor
    ) -> None:
        values = [
            v for s, k in zip(seq_ids, counts) for v in self.values[s][len(self.values[s]) - k :]
        ]
        slots = np.asarray(slots)
        keep = slots >= 0
        self.device[slots[keep]] = np.asarray(values, dtype=np.int64)[keep]

    def allocate(self, seq_id: int, tokens: list[int], as_count: bool) -> None:
        served = 0 if as_count else self.bm.cached_prefix_length(tokens)
        self.bm.allocate(seq_id, len(tokens) if as_count else tokens)
        assert self.bm.num_cached_tokens(seq_id) == served
        self._extend(seq_id, tokens)
        computed = len(tokens) - self.bm.num_cached_tokens(seq_id)
        assert computed >= 1 or not tokens, "the last prompt token must always be computed"
        self._write_last([seq_id], [computed], self.bm.slot_mapping_tensor([seq_id], computed))

    def append(self, seq_id: int, tokens: list[int], record: bool) -> None:
        pairs = self.bm.append_slots(seq_id, len(tokens), tokens if record else None)
        self._copy(pairs, self.device, self.device)
        self._extend(seq_id, tokens)
        self._write_last(
            [seq_id], [len(tokens)], self.bm.slot_mapping_tensor([seq_id], len(tokens))
        )

    def decode(self, seq_ids: list[int], tokens: list[int], record: bool) -> None:
        pairs, tables, lens, slots = self.bm.decode_step(seq_ids, tokens if record else None)
        assert np.array_equal(tables, self.bm.block_tables_array(seq_ids))
        assert np.array_equal(lens, self.bm.seq_lens_array(seq_ids))
        self._copy(pairs, self.device, self.device)
        for seq_id, token in zip(seq_ids, tokens):
            self._extend(seq_id, [token])
        self._write_last(seq_ids, [1] * len(seq_ids), slots)

    def fork(self, parent: int, child: int) -> None:
        self.fork_many([parent], [child])

    def fork_many(self, parents: list[int], children: list[int]) -> None:
        if len(parents) == 1:
            self.bm.fork(parents[0], children[0])
        else:
            self.bm.fork_many(parents, children)
        for parent, child in zip(parents, children):
            self.tokens[child] = list(self.tokens[parent])
            self.values[child] = list(self.values[parent])
            self.attends_from[child] = self.attends_from[parent]

    def free(self, seq_id: int) -> None:
        self.free_many([seq_id])

    def free_many(self, seq_ids: list[int]) -> None:
        if len(seq_ids) == 1:
            self.bm.free(seq_ids[0])
        else:
            self.bm.free_many(seq_ids)
        for seq_id in seq_ids:
            del self.tokens[seq_id], self.values[seq_id], self.attends_from[seq_id]

    def swap_out(self, seq_ids: list[int]) -> None:
        self._copy(self.bm.swap_out(seq_ids), self.device, self.host)

    def swap_in(self, seq_ids: list[int]) -> None:
        self._copy(self.bm.swap_in(seq_ids), self.host, self.device)

    def truncate(self, seq_id: int, num_tokens: int) -> None:
        self._copy(self.bm.truncate(seq_id, num_tokens), self.device, self.device)
        del self.tokens[seq_id][num_tokens:], self.values[seq_id][num_tokens:]
        self.attends_from[seq_id] = self._first_read(num_tokens)  # what the next token reads

    def check(self) -> None:
        size = self.bm.block_size
        for seq_id, values in self.values.items():
            host = self.bm.is_swapped(seq_id)
            table = self.bm.host_block_table(seq_id) if host else self.bm.block_table(seq_id)
            store = self.host if host else self.device
            assert self.bm.num_tokens(seq_id) == len(values)
            # Every position the latest computed token attends is still there.
            for position in range(self.attends_from[seq_id], len(values)):
                block = table[position // size]
                assert block != RELEASED, (seq_id, position)
                slot = block * size + position % size
                assert store[slot] == values[position], (seq_id, position)


def test_replay_random_workload():
    for seed, options in enumerate(
        [
            {"enable_prefix_caching": True},
            {"sliding_window": 5},
            {"attention_chunk_size": 6},
            {"sliding_window": 3, "attention_chunk_size": 8},
            {},
        ]
    ):
        rng = random.Random(seed)
        bm = BlockManager(48, 4, 48, watermark=0.0, **options)
        shadow = ShadowCache(bm)
        next_id = 0
        for _ in range(400):
            live = [s for s in shadow.values if not bm.is_swapped(s)]
            swapped = [s for s in shadow.values if bm.is_swapped(s)]
            action = rng.random()
            try:
                if action < 0.2 or not live:
                    prefix = [1, 2, 3, 4, 5, 6, 7, 8][: rng.randrange(9)]
                    tokens = prefix + [rng.randrange(4) for _ in range(rng.randrange(1, 8))]
                    shadow.allocate(next_id, tokens, as_count=rng.random() < 0.2)
                    next_id += 1
                elif action < 0.35:
                    shadow.fork(rng.choice(live), next_id)
                    next_id += 1
                elif action < 0.55:
                    tokens = [rng.randrange(4) for _ in range(rng.randrange(1, 6))]
                    shadow.append(rng.choice(live), tokens, record=rng.random() < 0.8)
                elif action < 0.75:
                    batch = rng.sample(live, rng.randrange(1, len(live) + 1))
                    shadow.decode(batch, [rng.randrange(4) for _ in batch], rng.random() < 0.8)
                elif action < 0.8:
                    shadow.free(rng.choice(live + swapped))
                elif action < 0.85:
                    old = rng.sample(live, rng.randrange(1, len(live) + 1))
                    parents = rng.choices(old, k=rng.randrange(1, 5))
                    shadow.fork_many(parents, list(range(next_id, next_id + len(parents))))
                    next_id += len(parents)
                    shadow.free_many(old)
                elif action < 0.93:
                    shadow.swap_out(rng.sample(live, rng.randrange(1, len(live) + 1)))
                elif swapped:
                    shadow.swap_in(rng.sample(swapped, rng.randrange(1, len(swapped) + 1)))
            except OutOfBlocksError:
                for seq_id in rng.sample(list(shadow.values), len(shadow.values) // 2):
                    shadow.free(seq_id)
            check_invariants(bm)
            shadow.check()
        for seq_id in list(shadow.values):
            shadow.free(seq_id)
        check_invariants(bm)
        assert bm.num_free_device_blocks() == 48 and bm.num_free_host_blocks() == 48


def test_replay_speculative_decoding():
    # Verification steps as in assisted generation: append draft tokens, keep the accepted ones.
    for seed, options in enumerate(
        [
            {"enable_prefix_caching": True},
            {"sliding_window": 6},
            {"attention_chunk_size": 4},
            {},
        ]
    ):
        rng = random.Random(seed)
        bm = BlockManager(64, 4, watermark=0.0, **options)
        shadow = ShadowCache(bm)
        next_id = 0
        for _ in range(300):
            action = rng.random()
            try:
                if action < 0.15 or not shadow.values:
                    prompt = list(range(1, rng.randrange(2, 11)))
                    shadow.allocate(next_id, prompt + [rng.randrange(3)], as_count=False)
                    next_id += 1
                elif action < 0.25:
                    shadow.fork(rng.choice(list(shadow.values)), next_id)
                    next_id += 1
                elif action < 0.9:
                    seq_id = rng.choice(list(shadow.values))
                    length = bm.num_tokens(seq_id)
                    draft = [rng.randrange(3) for _ in range(rng.randrange(1, 6))]
                    shadow.append(seq_id, draft, record=True)
                    shadow.truncate(seq_id, length + rng.randrange(len(draft) + 1))
                else:
                    shadow.free(rng.choice(list(shadow.values)))
            except OutOfBlocksError:
                for seq_id in rng.sample(list(shadow.values), len(shadow.values) // 2):
                    shadow.free(seq_id)
            check_invariants(bm)
            shadow.check()


# ---------------------------------------------------------------------------- properties


class BlockManagerMachine(RuleBasedStateMachine):
    """Random interleavings; after every step the invariants hold and every sequence reads
    back what it wrote. Failing calls must leave the manager unchanged."""

    options: dict = {"enable_prefix_caching": True}

    def __init__(self) -> None:
        super().__init__()
        self.bm = BlockManager(24, 2, 16, watermark=0.0, **self.options)
        self.shadow = ShadowCache(self.bm)
        self.next_id = 0

    def _live(self) -> list[int]:
        return [s for s in self.shadow.values if not self.bm.is_swapped(s)]

    def _swapped(self) -> list[int]:
        return [s for s in self.shadow.values if self.bm.is_swapped(s)]

    def _attempt(self, action) -> None:
        before = snapshot(self.bm)
        try:
            action()
        except OutOfBlocksError:
            assert snapshot(self.bm) == before

    @rule(
        prefix=st.integers(0, 6),
        suffix=st.lists(st.integers(0, 2), min_size=1, max_size=6),
        as_count=st.booleans(),
    )
    def allocate(self, prefix, suffix, as_count):
        tokens = [9, 8, 7, 6, 5, 4][:prefix] + suffix
        seq_id = self.next_id
        self.next_id += 1
        self._attempt(lambda: self.shadow.allocate(seq_id, tokens, as_count))

    @precondition(lambda self: self._live())
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(self._live()))
        self.shadow.fork(parent, self.next_id)
        self.next_id += 1

    @precondition(lambda self: self._live())
    @rule(data=st.data(), tokens=st.lists(st.integers(0, 2), min_size=1, max_size=5))
    def append(self, data, tokens):
        seq_id = data.draw(st.sampled_from(self._live()))
        record = data.draw(st.booleans())
        self._attempt(lambda: self.shadow.append(seq_id, tokens, record))

    @precondition(lambda self: self._live())
    @rule(data=st.data())
    def decode(self, data):
        batch = data.draw(st.lists(st.sampled_from(self._live()), min_size=1, unique=True))
        tokens = data.draw(st.lists(st.integers(0, 2), min_size=len(batch), max_size=len(batch)))
        self._attempt(lambda: self.shadow.decode(batch, tokens, record=True))

    @precondition(lambda self: self.shadow.values)
    @rule(data=st.data())
    def free(self, data):
        self.shadow.free(data.draw(st.sampled_from(sorted(self.shadow.values))))

    @precondition(lambda self: self._live())
    @rule(data=st.data())
    def reorder_beams(self, data):
        old = data.draw(st.lists(st.sampled_from(self._live()), min_size=1, unique=True))
        parents = data.draw(st.lists(st.sampled_from(old), min_size=1, max_size=4))
        children = list(range(self.next_id, self.next_id + len(parents)))
        self.next_id += len(parents)
        self.shadow.fork_many(parents, children)
        self.shadow.free_many(old)

    @precondition(lambda self: self.shadow.values)
    @rule(data=st.data())
    def free_many(self, data):
        seqs = sorted(self.shadow.values)
        self.shadow.free_many(data.draw(st.lists(st.sampled_from(seqs), min_size=1, unique=True)))

    @precondition(lambda self: self._live())
    @rule(data=st.data())
    def truncate(self, data):
        seq_id = data.draw(st.sampled_from(self._live()))
        num_tokens = data.draw(st.integers(0, self.bm.num_tokens(seq_id)))
        before = snapshot(self.bm)
        try:
            self.shadow.truncate(seq_id, num_tokens)
        except (OutOfBlocksError, ValueError) as error:  # no block for a copy; a cut too deep
            assert isinstance(error, OutOfBlocksError) or "were released" in str(error)
            assert snapshot(self.bm) == before

    @precondition(lambda self: self._live())
    @rule(data=st.data())
    def swap_out(self, data):
        batch = data.draw(st.lists(st.sampled_from(self._live()), min_size=1, unique=True))
        self._attempt(lambda: self.shadow.swap_out(batch))

    @precondition(lambda self: self._swapped())
    @rule(data=st.data())
    def swap_in(self, data):
        batch = data.draw(st.lists(st.sampled_from(self._swapped()), min_size=1, unique=True))
        self._attempt(lambda: self.shadow.swap_in(batch))

    @invariant()
    def consistent(self):
        check_invariants(self.bm)
        self.shadow.check()

    def teardown(self):
        for seq_id in list(self.shadow.values):
            self.shadow.free(seq_id)
        check_invariants(self.bm)
        assert self.bm.num_free_device_blocks() == self.bm.num_device_blocks
        assert self.bm.num_free_host_blocks() == self.bm.num_host_blocks


class SlidingWindowMachine(BlockManagerMachine):
    options = {"sliding_window": 3}


class ChunkedAttentionMachine(BlockManagerMachine):
    options = {"attention_chunk_size": 4}


_MACHINE_SETTINGS = settings(
    max_examples=80,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestBlockManagerMachine = BlockManagerMachine.TestCase
TestBlockManagerMachine.settings = _MACHINE_SETTINGS
TestSlidingWindowMachine = SlidingWindowMachine.TestCase
TestSlidingWindowMachine.settings = _MACHINE_SETTINGS
TestChunkedAttentionMachine = ChunkedAttentionMachine.TestCase
TestChunkedAttentionMachine.settings = _MACHINE_SETTINGS


def test_errors_are_block_manager_errors():
    for error in (
        OutOfBlocksError,
        UnknownSequenceError,
        DuplicateSequenceError,
        DoubleFreeError,
        SwapError,
    ):
        assert issubclass(error, BlockManagerError)


def test_public_names_come_from_the_facade_and_the_package():
    import paged_attention
    from paged_attention.kv import block_manager

    for name in block_manager.__all__:
        assert getattr(paged_attention, name, getattr(block_manager, name)) is getattr(
            block_manager, name
        )
    assert paged_attention.BlockManager is BlockManager and block_manager.RELEASED == RELEASED


def test_cached_copy_of_a_full_last_block():
    bm = BlockManager(16, 4, enable_prefix_caching=True)
    prompt = list(range(100, 112))  # 3 full blocks of 4
    bm.allocate(0, prompt)
    assert bm.cached_copy_of_last_block(0) is None  # its last block is the cached one
    bm.allocate(1, prompt)
    assert bm.num_cached_tokens(1) == 8  # never the last token's block
    source, last = bm.cached_copy_of_last_block(1)
    assert source == bm.block_table(0)[2] and last == bm.block_table(1)[2] != source
    bm.allocate(2, prompt[:-1] + [7])  # another last token: no such block cached
    assert bm.cached_copy_of_last_block(2) is None
    bm.allocate(3, prompt[:10])  # a partly filled last block
    assert bm.cached_copy_of_last_block(3) is None
    bm.free(0, cache=False)  # the cached block is forgotten
    assert bm.cached_copy_of_last_block(1) is None
    without = BlockManager(16, 4)
    without.allocate(0, prompt)
    without.allocate(1, prompt)
    assert without.cached_copy_of_last_block(1) is None


def test_reassign_keeps_the_first_taker_forks_later_ones_and_frees_the_rest():
    from paged_attention.kv.block_manager import reassign

    bm = BlockManager(16, 4)
    for seq_id in (0, 1, 2):
        bm.allocate(seq_id, 6)
    fresh = iter(range(10, 20))
    new = reassign(bm, [0, 1, 2, None], [1, 1, 3, 0], lambda: next(fresh))
    assert new == [1, 10, None, 0]  # slot 1 forks sequence 1; sequence 2 is freed
    assert sorted(bm.seq_ids()) == [0, 1, 10]
    assert bm.block_table(10) == bm.block_table(1)
    before = snapshot(bm)
    with pytest.raises(ValueError, match="out of range"):
        reassign(bm, [0, 1], [2], lambda: next(fresh))
    assert snapshot(bm) == before
