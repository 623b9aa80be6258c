import numpy as np
import pytest

from paged_attention.kv.block_errors import (
    DoubleFreeError,
    DuplicateSequenceError,
    OutOfBlocksError,
    SwapError,
    UnknownSequenceError,
)
from paged_attention.kv.block_pool import CachingBlockPool
from paged_attention.kv.block_tables import RELEASED, BlockTables, PrefixChains, Reach


def make_tables(block_size: int = 4, max_blocks_per_seq: int | None = None) -> BlockTables:
    """Tables holding sequence 1 (5 tokens in blocks 3, 7) and sequence 2 (8 tokens in 0, 1)."""
    tables = BlockTables(block_size, max_blocks_per_seq)
    tables.add(1, [3, 7], 5)
    tables.add(2, [0, 1], 8)
    return tables


# ---------------------------------------------------------------------------- lookups


def test_checked_lookups_raise_the_block_manager_errors():
    tables = make_tables()
    assert tables.rows([2, 1]).tolist() == [1, 0] and tables.row(2) == 1
    with pytest.raises(UnknownSequenceError, match="unknown sequence 9"):
        tables.rows([1, 9])
    with pytest.raises(UnknownSequenceError, match="unknown sequence 9"):
        tables.row(9)
    tables.on_host[tables.row(2)] = True
    with pytest.raises(SwapError, match=r"sequences \[2\] are swapped out"):
        tables.device_rows([1, 2])
    with pytest.raises(SwapError, match="sequence 2 is swapped out"):
        tables.device_row(2)
    with pytest.raises(SwapError, match=r"sequences \[1\] are not swapped out"):
        tables.swap_rows([1, 2], on_host=True)
    with pytest.raises(DuplicateSequenceError, match="twice"):
        tables.swap_rows([2, 2], on_host=True)
    with pytest.raises(SwapError, match="sequence 2 is swapped out; use host_block_table"):
        tables.table_of(2, on_host=False)
    with pytest.raises(SwapError, match="sequence 1 is on the device; use block_table"):
        tables.table_of(1, on_host=True)


def test_rows_to_free_tells_a_double_free_from_an_unknown_id():
    tables = make_tables()
    tables.remove([2], tables.rows([2]))
    with pytest.raises(DoubleFreeError, match="sequence 2 was already freed"):
        tables.rows_to_free([1, 2])
    with pytest.raises(UnknownSequenceError, match="unknown sequence 5"):
        tables.rows_to_free([5, 5])
    with pytest.raises(DoubleFreeError, match="twice"):
        tables.rows_to_free([1, 1])
    assert tables.rows_to_free([1]).tolist() == [0]


def test_check_fits_names_the_limit():
    tables = make_tables(max_blocks_per_seq=3)
    assert tables.fits(3) and not tables.fits(4)
    with pytest.raises(OutOfBlocksError, match="sequence 1 would need 4 blocks.*=3"):
        tables.check_fits(1, 4)


# ---------------------------------------------------------------------------- rows


def test_rows_and_width_grow_and_rows_are_reused():
    tables = BlockTables(1, None)
    assert tables.table.shape == (64, 16)
    tables.add(0, list(range(40)), 40)
    assert tables.table.shape[1] == 40 and tables.table_of(0, on_host=False) == list(range(40))
    for seq_id in range(1, 100):
        tables.add(seq_id, [seq_id], 1)
    assert tables.table.shape[0] == 128 and tables.row(99) == 99
    tables.remove([5], tables.rows([5]))
    assert not tables.table[5].any() and tables.seq_lens[5] == 0
    assert tables.add(500, [], 0) == 5  # a freed row is reused
    assert 500 not in tables.freed_ids and 5 in tables.freed_ids
    assert tables.live_rows().size == 100


def test_width_is_capped_by_max_blocks_per_seq():
    tables = BlockTables(1, 20)
    assert tables.table.shape[1] == 16
    tables.add(0, list(range(17)), 17)
    assert tables.table.shape[1] == 20


def test_extend_fork_and_replace_last():
    tables = make_tables()
    tables.extend(1, [9], 9)  # row 1 is sequence 2
    assert tables.table_of(2, on_host=False) == [0, 1, 9] and tables.seq_lens[1] == 9
    children = tables.fork([2, 2], [5, 6])
    assert [tables.table_of(c, on_host=False) for c in (5, 6)] == [[0, 1, 9]] * 2
    with pytest.raises(DuplicateSequenceError, match=r"cannot fork \[1\] into .* \[5\]"):
        tables.fork([1], [5])
    tables.extend_rows(children, [10, 11], width=4)
    assert tables.table_of(6, on_host=False) == [0, 1, 9, 11]
    tables.replace_last(children[:1], [12])
    assert tables.table_of(5, on_host=False) == [0, 1, 9, 12]


def test_reach_of_windows_and_chunks():
    positions = np.arange(12)
    assert Reach().first_read(positions).tolist() == [0] * 12
    assert Reach(sliding_window=3).first_read(positions).tolist() == [0, 0, *range(10)]
    assert (
        Reach(attention_chunk_size=4).first_read(positions).tolist() == [0] * 4 + [4] * 4 + [8] * 4
    )
    both = Reach(sliding_window=2, attention_chunk_size=4).first_read(positions)
    assert both.tolist() == [0, 0, 0, 0, 3, 4, 4, 4, 7, 8, 8, 8]  # the earlier of the two
    # The shortest sequence whose next token reads nothing before position 8.
    assert Reach(sliding_window=3).shortest_reading_from(8) == 10
    assert Reach(attention_chunk_size=6).shortest_reading_from(8) == 12
    assert Reach(sliding_window=3, attention_chunk_size=6).shortest_reading_from(8) == 12
    assert not Reach().releases and Reach(attention_chunk_size=4).releases


def test_releases_and_release():
    tables = make_tables()
    row = tables.row(2)  # 8 tokens in blocks 0, 1
    assert tables.releases(row, 8, Reach()).tolist() == []
    assert tables.releases(row, 8, Reach(4)).tolist() == [0]  # token 8 attends 5..8
    assert tables.releases(row, 8, Reach(6)).tolist() == []  # token 8 attends 3..8
    assert tables.releases(row, 8, Reach(attention_chunk_size=8)).tolist() == [0, 1]
    assert tables.releases(row, 8, Reach(attention_chunk_size=6)).tolist() == [0]  # reads 6..8
    assert tables.releases(row, 8, Reach(attention_chunk_size=12)).tolist() == []
    rows = tables.rows([1, 2])
    releasing, released = tables.rows_releasing(rows, tables.seq_lens[rows], Reach(4))
    assert releasing == [row] and [r.tolist() for r in released] == [[0]]
    assert tables.release(row, released[0]).tolist() == [0]
    assert tables.table_of(2, on_host=False) == [RELEASED, 1]
    assert tables.live_entries(rows).tolist() == [3, 7, 1]
    assert tables.batch_table(rows, -1).tolist() == [[3, 7], [-1, 1]]
    assert tables.batch_table(rows, 0).tolist() == [[3, 7], [0, 1]]


def test_slots_of_the_last_tokens_skip_released_blocks():
    tables = make_tables()
    rows = tables.rows([1, 2])
    assert tables.slots(rows, np.array([2, 3])).tolist() == [15, 28, 5, 6, 7]
    tables.release(1, tables.releases(1, 8, Reach(4)))
    assert tables.slots(rows[1:], np.array([6])).tolist() == [-1, -1, 4, 5, 6, 7]


def test_move_rows_and_distinct_blocks():
    tables = make_tables()
    tables.fork([1], [3])
    rows = tables.rows([1, 3])
    assert tables.num_distinct_blocks(rows) == 2
    tables.move_rows(rows, {3: 0, 7: 1}, on_host=True)
    assert tables.table_of(3, on_host=True) == [0, 1] and tables.on_host[rows].all()


# ---------------------------------------------------------------------------- stats


def test_partial_last_blocks():
    tables = make_tables()  # sequence 1 holds 1 token in block 7; sequence 2 fills block 1
    tables.fork([1], [3])
    tables.extend(tables.row(3), [8], 10)  # sequence 3 fills block 7, 2 tokens in block 8
    blocks, held = tables.partial_last_blocks(tables.rows([1, 2, 3]))
    assert blocks.tolist() == [7, 8] and held.tolist() == [1, 2]
    blocks, held = tables.partial_last_blocks(tables.rows([]))
    assert blocks.size == held.size == 0


# ---------------------------------------------------------------------------- prefix chains


def test_prefix_chains_follow_known_tokens_and_end_on_unknown_ones():
    pool = CachingBlockPool(16, 2)
    tables = BlockTables(2, None)
    chains = PrefixChains(pool, enabled=True)
    assert chains.lookup(None) == ([], None)
    assert PrefixChains(pool, enabled=False).lookup([1, 2, 3]) == ([], None)
    hits, chain = chains.lookup([1, 2, 3])
    blocks = pool.take(2)
    row = tables.add(1, blocks, 3)
    chains.start(1, hits, chain, blocks, [1, 2, 3])
    assert 1 in chains.chains and chains.chains[1].pending == [3] and blocks[0] in pool._entries
    tables.extend(row, [], 4)
    chains.record(1, tables, row, 3, [4])
    assert blocks[1] in pool._entries and chains.chains[1].pending == []
    hits, chain = chains.lookup([1, 2, 3, 4, 5])
    assert hits == blocks
    fresh = pool.take(1)
    tables.add(2, hits + fresh, 5)
    chains.start(2, hits, chain, fresh, [1, 2, 3, 4, 5])
    assert chains.cached_tokens == {2: 4}
    chains.fork([2, 1], [3, 4])
    assert chains.cached_tokens == {2: 4, 3: 4}
    assert chains.chains[3].pending == [5] and chains.chains[3] is not chains.chains[2]
    chains.record_each([3, 2], tables, tables.rows([2, 2]), np.array([5, 5]), None)
    assert 3 not in chains.chains and 2 not in chains.chains  # unknown ids end the chain
    chains.end([4])
    assert 4 not in chains.chains
    chains.forget([2, 3])
    assert chains.cached_tokens == {} and list(chains.chains) == [1]
