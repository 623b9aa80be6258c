"""State slots for hybrid models: StateSlots' bookkeeping, StatefulBlockManager (slots taken,
copied and freed with the sequences' blocks; what a recurrent state cannot do refused; failed
calls change nothing), StateStore's tensors, and a random interleaving of allocate, fork, free,
beam reordering and decode steps that keeps every sequence's state its own."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from test_block_manager import check_invariants, snapshot

from paged_attention.kv.block_manager import (
    AllocStatus,
    DoubleFreeError,
    DuplicateSequenceError,
    OutOfBlocksError,
    SwapError,
    UnknownSequenceError,
    reassign,
)
from paged_attention.kv.state_pool import (
    OutOfStateSlotsError,
    StatefulBlockManager,
    StateSlots,
    StateStore,
)


def state_snapshot(bm: StatefulBlockManager) -> dict:
    return {
        **snapshot(bm),
        "slots": dict(bm.states.slot_of),
        "free": sorted(bm.states._free),
        "copies": list(bm.states._copies),
    }


# ---------------------------------------------------------------------------- StateSlots


def test_slots_are_taken_lowest_first_and_reused_after_a_free():
    slots = StateSlots(4)
    slots.take([10, 11, 12])
    assert [slots.slot(s) for s in (10, 11, 12)] == [0, 1, 2]
    slots.free([11])
    slots.take([13])
    assert slots.slot(13) == 1
    assert slots.num_free() == 1


def test_a_fork_takes_a_slot_and_records_the_copy_in_order():
    slots = StateSlots(4)
    slots.take([1])
    slots.fork([1, 1], [2, 3])
    slots.fork([3], [4])
    assert slots.drain_copies() == [(0, 1), (0, 2), (2, 3)]
    assert slots.drain_copies() == []


def test_running_out_of_slots_names_the_need():
    slots = StateSlots(2)
    slots.take([1, 2])
    with pytest.raises(OutOfStateSlotsError, match="needs 1 state slots, 0 of 2 are free"):
        slots.check_room(1, "allocating sequence 3")
    with pytest.raises(UnknownSequenceError, match="sequence 9 holds no state slot"):
        slots.slot(9)


@pytest.mark.parametrize("bad", [0, -1])
def test_a_pool_without_slots_is_refused(bad):
    with pytest.raises(ValueError, match="num_state_slots"):
        StateSlots(bad)
    with pytest.raises(TypeError, match="num_state_slots"):
        StateSlots(2.0)


# ---------------------------------------------------------------------------- the manager


def manager(num_blocks=8, slots=3, **kwargs) -> StatefulBlockManager:
    return StatefulBlockManager(num_blocks, 4, watermark=0.0, num_state_slots=slots, **kwargs)


def test_slots_follow_the_sequences_through_allocate_fork_and_free():
    bm = manager()
    bm.allocate(0, 6)
    bm.fork(0, 1)
    assert (bm.state_slot(0), bm.state_slot(1)) == (0, 1)
    assert bm.states.drain_copies() == [(0, 1)]
    bm.free(0)
    assert bm.state_stats().used_slots == 1
    bm.allocate(2, 3)
    assert bm.state_slot(2) == 0
    with pytest.raises(UnknownSequenceError):
        bm.state_slot(0)
    stats = bm.state_stats(bytes_per_slot=100)
    assert (stats.num_slots, stats.used_slots, stats.free_slots, stats.bytes_in_use) == (
        3,
        2,
        1,
        200,
    )
    check_invariants(bm)


def test_failed_calls_change_neither_blocks_nor_slots():
    bm = manager(num_blocks=4, slots=2)
    bm.allocate(0, 4)
    bm.allocate(1, 4)
    before = state_snapshot(bm)
    for call, error in [
        (lambda: bm.allocate(2, 1), OutOfStateSlotsError),  # blocks left, no slot
        (lambda: bm.fork(0, 2), OutOfStateSlotsError),
        (lambda: bm.allocate(0, 1), DuplicateSequenceError),
        (lambda: bm.free_many([0, 7]), UnknownSequenceError),
        (lambda: bm.truncate(0, 2), ValueError),
        (lambda: bm.swap_out([0]), SwapError),
        (lambda: bm.truncate(0, 5, cache=False), ValueError),
    ]:
        with pytest.raises(error):
            call()
        assert state_snapshot(bm) == before
    bm.free(1)
    bm.allocate(2, 4)
    before = state_snapshot(bm)
    with pytest.raises(OutOfBlocksError):  # a slot is free, the blocks are not
        bm.allocate(3, 16)
    assert state_snapshot(bm) == before
    bm.free(0)
    with pytest.raises(DoubleFreeError):
        bm.free(0)


def test_out_of_slots_is_an_out_of_blocks_error_that_can_allocate_foresees():
    bm = manager(num_blocks=8, slots=1)
    assert bm.can_allocate(4) is AllocStatus.OK
    bm.allocate(0, 4)
    assert bm.can_allocate(4) is AllocStatus.LATER
    assert bm.can_allocate(64) is AllocStatus.NEVER
    assert issubclass(OutOfStateSlotsError, OutOfBlocksError)


def test_what_a_recurrent_state_cannot_do_is_refused_with_the_reason():
    with pytest.raises(ValueError, match="prefix caching cannot serve a hybrid model"):
        manager(enable_prefix_caching=True)
    bm = manager()
    bm.allocate(0, 6)
    with pytest.raises(ValueError, match="cannot be cut back"):
        bm.truncate(0, 2)
    # a fork cut to its parent's length cuts nothing (a recomputed request's samples fork so)
    assert bm.truncate(0, 6) == [] and bm.num_tokens(0) == 6
    assert not bm.can_swap_out([0])
    with pytest.raises(SwapError, match="preempt them by recompute"):
        bm.swap_out([0])


def test_uncomputed_slots_are_released_and_the_state_slot_kept():
    bm = manager()
    bm.allocate(0, 3)
    bm.append_slots(0, 6)
    assert bm.truncate(0, 3, cache=False) == []
    assert bm.num_tokens(0) == 3 and bm.block_table(0) == [bm.block_table(0)[0]]
    assert bm.state_slot(0) == 0
    check_invariants(bm)


def test_beam_reordering_forks_slots_and_frees_the_dropped_ones():
    bm = manager(num_blocks=16, slots=6)
    for seq_id in range(3):
        bm.allocate(seq_id, 5)
    ids = iter(range(10, 20))
    rows = reassign(bm, [0, 1, 2], [1, 1, 0], lambda: next(ids))
    assert rows == [1, 10, 0]
    # sequence 2 is freed first, so the fork takes its slot: no more slots than beams
    assert bm.states.drain_copies() == [(1, 2)]
    assert bm.states.slot_of == {0: 0, 1: 1, 10: 2}
    assert bm.states.num_free() == 3
    check_invariants(bm)


# ---------------------------------------------------------------------------- StateStore


def test_the_store_gathers_what_it_scattered_and_grows_by_doubling():
    store = StateStore(8)
    key = (0, "conv", 0)
    assert store.gather(key, [0]) is None
    states = torch.arange(12.0).reshape(3, 2, 2)
    store.scatter(key, [0, 2, 1], states)
    assert store.tensors[key].shape == (4, 2, 2)
    assert torch.equal(store.gather(key, [1, 0]), states[[2, 0]])
    store.scatter(key, [7], states[:1])
    assert store.tensors[key].shape == (8, 2, 2)
    assert store.bytes_per_slot == 4 * 4 and store.num_bytes() == 8 * 16


def test_the_store_copies_in_order_and_checks_its_arguments():
    store = StateStore(4)
    key = (1, "recurrent", 0)
    store.scatter(key, [0, 1], torch.tensor([[1.0], [2.0]]))
    store.copy([(0, 2), (1, 0), (2, 3)])  # 3 gets 0's old value via 2
    assert store.gather(key, [0, 1, 2, 3]).flatten().tolist() == [2.0, 2.0, 1.0, 1.0]
    with pytest.raises(ValueError, match="out of range"):
        store.copy([(0, 4)])
    with pytest.raises(ValueError, match="holds"):
        store.scatter(key, [0], torch.zeros(1, 2))
    with pytest.raises(ValueError, match="2 states for 1 slots"):
        store.scatter(key, [0], torch.zeros(2, 1))


# ---------------------------------------------------------------------------- random walks


class StatePoolMachine(RuleBasedStateMachine):
    """Sequences allocate, fork, free, reorder like beams and run decode steps (which write a
    new state value); after every step each live sequence reads back its own state, no slot is
    held twice and no slot is leaked. Failing calls change nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.bm = StatefulBlockManager(12, 2, watermark=0.0, num_state_slots=5)
        self.store = StateStore(5)
        self.values: dict[int, float] = {}  # each live sequence's state, as it should read
        self.next_id = 0
        self.counter = 0.0

    def _new_id(self) -> int:
        self.next_id += 1
        return self.next_id - 1

    def _sync(self) -> None:
        self.store.copy(self.bm.states.drain_copies())

    def _attempt(self, action) -> bool:
        before = state_snapshot(self.bm)
        try:
            action()
        except OutOfBlocksError:
            assert state_snapshot(self.bm) == before
            return False
        return True

    def _write(self, seq_id: int) -> None:
        self.counter += 1
        self.values[seq_id] = self.counter
        slot = self.bm.state_slot(seq_id)
        self.store.scatter((0, "recurrent", 0), [slot], torch.tensor([[self.counter]]))

    @rule(tokens=st.integers(1, 6))
    def allocate(self, tokens):
        seq_id = self._new_id()
        if self._attempt(lambda: self.bm.allocate(seq_id, tokens)):
            self._sync()
            self._write(seq_id)

    @precondition(lambda self: self.values)
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(sorted(self.values)))
        child = self._new_id()
        if self._attempt(lambda: self.bm.fork(parent, child)):
            self.values[child] = self.values[parent]

    @precondition(lambda self: self.values)
    @rule(data=st.data())
    def free(self, data):
        seq_id = data.draw(st.sampled_from(sorted(self.values)))
        self.bm.free(seq_id)
        del self.values[seq_id]

    @precondition(lambda self: self.values)
    @rule(data=st.data())
    def reorder(self, data):
        rows = sorted(self.values)
        sources = data.draw(st.lists(st.integers(0, len(rows) - 1), min_size=len(rows)))[
            : len(rows)
        ]
        expected = [self.values[rows[s]] for s in sources]
        before = state_snapshot(self.bm)
        try:
            new = reassign(self.bm, rows, sources, self._new_id)
        except OutOfBlocksError:  # more forks than frees: out of slots, nothing changed
            assert state_snapshot(self.bm) == before
            return
        self.values = {seq_id: value for seq_id, value in zip(new, expected)}

    @precondition(lambda self: self.values)
    @rule(data=st.data())
    def decode(self, data):
        batch = data.draw(st.lists(st.sampled_from(sorted(self.values)), min_size=1, unique=True))
        if self._attempt(lambda: self.bm.decode_step(batch)):
            self._sync()  # the forward pass runs after the step's copies
            for seq_id in batch:
                self._write(seq_id)

    @invariant()
    def every_sequence_reads_its_own_state(self):
        self._sync()
        slots = self.bm.states.slot_of
        assert sorted(slots) == sorted(self.values) == sorted(self.bm.seq_ids())
        assert len(set(slots.values())) == len(slots), "a slot is shared"
        assert len(slots) + self.bm.states.num_free() == 5, "a slot leaked"
        for seq_id, value in self.values.items():
            read = self.store.gather((0, "recurrent", 0), [slots[seq_id]])
            assert read is None or read.item() == value, f"sequence {seq_id}"
        check_invariants(self.bm)


TestStatePoolMachine = StatePoolMachine.TestCase
TestStatePoolMachine.settings = settings(
    max_examples=60,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
