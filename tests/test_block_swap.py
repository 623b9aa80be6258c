"""paged_attention/kv/block_swap.py: whole sequences moving between the device and host pools
(through the block manager in tests/test_block_manager.py; here on the parts directly)."""

import numpy as np
import pytest

from paged_attention.kv.block_errors import OutOfBlocksError, SwapError
from paged_attention.kv.block_pool import BlockPool, CachingBlockPool
from paged_attention.kv.block_swap import SwapSpace
from paged_attention.kv.block_tables import BlockTables, PrefixChains


def make_space(num_host_blocks: int = 8, prefix_caching: bool = False):
    """Device pool of 8 blocks of 4; sequence 1 holds 6 tokens (ids 0-5), sequence 2 is its
    fork (sharing both blocks), sequence 3 holds 4 tokens of its own."""
    tables = BlockTables(4, None)
    device, host = CachingBlockPool(8, 4), BlockPool(num_host_blocks)
    prefixes = PrefixChains(device, prefix_caching)
    hits, chain = prefixes.lookup(list(range(6)))
    blocks = device.take(2)
    tables.add(1, blocks, 6)
    prefixes.start(1, hits, chain, blocks, list(range(6)))
    device.add_refs(tables.live_entries(tables.fork([1], [2])))
    prefixes.fork([1], [2])
    tables.add(3, device.take(1), 4)
    return SwapSpace(tables, device, host, prefixes), tables, device, host, prefixes


def snapshot(tables, device, host):
    return (
        tables.table.copy().tolist(),
        tables.on_host.copy().tolist(),
        device.refs.tolist(),
        host.refs.tolist(),
        device.num_free(),
        host.num_free(),
    )


def test_a_shared_block_moves_once_and_comes_back_shared():
    space, tables, device, host, _ = make_space()
    assert space.blocks_to_move([1, 2], on_host=False) == 2
    out = space.swap_out([1, 2])
    assert [d for d, _ in out] == [0, 1] and device.num_free() == 7
    assert tables.on_host[tables.rows([1, 2])].tolist() == [True, True]
    host_blocks = [h for _, h in out]
    assert host.refs[host_blocks].tolist() == [2, 2] and host.num_free() == 6
    assert tables.table_of(1, on_host=True) == tables.table_of(2, on_host=True) == host_blocks
    assert space.blocks_to_move([1, 2], on_host=True) == 2
    back = space.swap_in([1, 2])
    assert [h for h, _ in back] == host_blocks and host.num_free() == 8
    assert tables.table_of(1, on_host=False) == tables.table_of(2, on_host=False)
    assert device.refs[[d for _, d in back]].tolist() == [2, 2]


def test_a_block_shared_with_a_sequence_left_behind_is_copied():
    space, tables, device, host, _ = make_space()
    out = space.swap_out([2])
    assert [d for d, _ in out] == [0, 1]
    assert device.refs[[0, 1]].tolist() == [1, 1]  # sequence 1 keeps the originals
    assert host.refs[[h for _, h in out]].tolist() == [1, 1]


def test_a_swap_out_ends_the_prefix_chain():
    space, _, _, _, prefixes = make_space(prefix_caching=True)
    assert set(prefixes.chains) == {1, 2}
    space.swap_out([2])
    assert set(prefixes.chains) == {1}


def test_a_refused_swap_changes_nothing():
    space, tables, device, host, prefixes = make_space(num_host_blocks=1, prefix_caching=True)
    before = snapshot(tables, device, host)
    with pytest.raises(OutOfBlocksError, match=r"swapping out \[1\] needs 2 host blocks, 1 free"):
        space.swap_out([1])
    with pytest.raises(SwapError, match="not swapped out"):
        space.swap_in([3])
    assert snapshot(tables, device, host) == before and set(prefixes.chains) == {1, 2}
    space.swap_out([3])
    device.take(device.num_free())  # the device fills up while sequence 3 is out
    before = snapshot(tables, device, host)
    with pytest.raises(OutOfBlocksError, match="swapping in"):
        space.swap_in([3])
    assert snapshot(tables, device, host) == before


def test_freeing_drops_the_host_blocks_and_returns_the_device_rows():
    space, tables, device, host, _ = make_space()
    space.swap_out([3])
    rows = tables.rows([1, 3, 2])
    assert space.drop_host_rows(rows).tolist() == rows[[0, 2]].tolist()
    assert host.num_free() == 8
    device_only = tables.rows([1, 2])
    assert space.drop_host_rows(device_only) is device_only
    assert np.array_equal(host.refs, np.zeros(8))
