"""The Scheduler without a model: admission, the token budget, preemption by swap and by
recompute, resumption, rejection and rollback, over a real BlockManager. A fake "model" marks the
scheduled tokens computed (commit) and appends one token to every sampling sequence."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from paged_attention.engine.request import (
    Drawn,
    Request,
    RequestMetrics,
    RequestStatus,
    SamplingParams,
)
from paged_attention.engine.scheduler import Scheduler
from paged_attention.kv.block_manager import BlockManager

BLOCK = 4


def make_request(request_id, prompt_len, max_new_tokens=4, n=1):
    params = SamplingParams(max_new_tokens, temperature=1.0 if n > 1 else 0.0, n=n)
    prompt = [(request_id * 31 + i) % 97 + 3 for i in range(prompt_len)]
    return Request(request_id, prompt, params, torch.Generator(), RequestMetrics(0.0))


def run_step(scheduler: Scheduler):
    """schedule, then ``update_from_output`` with token 7 for every sampling sequence (samples
    fork after the prompt; a sequence ends at max_new_tokens); returns the step's output."""
    out = scheduler.schedule()
    out.plan = [(c.request.request_id, c.start, c.count, c.samples) for c in out.chunks]
    sampled = {id(c.request): c.request for c in out.chunks if c.samples}
    choices = [(r, Drawn([7] * r.params.n)) for r in sampled.values()]
    scheduler.update_from_output(out, choices, length_only, end_token_ids=())
    return out


def length_only(request, seq):
    return "length" if len(seq.tokens) == request.params.max_new_tokens else None


def snapshot(scheduler: Scheduler):
    manager = scheduler.block_manager
    return (
        [r.request_id for r in scheduler.waiting],
        [r.request_id for r in scheduler.running],
        [r.request_id for r in scheduler.swapped],
        {s: manager.num_tokens(s) for s in manager.seq_ids()},
        manager.num_free_device_blocks(),
        [[(s.seq_id, s.num_computed, len(s.tokens)) for s in r.seqs] for r in scheduler.running],
    )


def test_budget_splits_a_long_prompt_and_decodes_come_first():
    scheduler = Scheduler(BlockManager(64, BLOCK), max_num_seqs=4, max_num_batched_tokens=8)
    first, second = make_request(0, 10), make_request(1, 5)
    scheduler.add(first)
    scheduler.add(second)
    out = run_step(scheduler)
    assert out.plan == [(0, 0, 8, False)]
    out = run_step(scheduler)  # the rest of the first prompt (it samples), then the second's
    assert out.plan == [(0, 8, 2, True), (1, 0, 5, True)]
    out = run_step(scheduler)  # both decode: 2 of the 8 tokens
    assert out.plan == [(0, 10, 1, True), (1, 5, 1, True)]
    assert out.num_tokens == 2 and not out.prefill and len(out.decode) == 2


def test_seats_count_every_sample_before_the_fork():
    scheduler = Scheduler(BlockManager(64, BLOCK), max_num_seqs=4)
    wide, next_one = make_request(0, 5, n=3), make_request(1, 5, n=2)
    scheduler.add(wide)
    scheduler.add(next_one)
    out = run_step(scheduler)
    assert out.admitted == [wide]  # 3 seats taken, 1 left: the 2-sample request waits
    assert len(wide.seqs) == 3


def test_the_newest_request_is_preempted_by_swap_then_resumed_first():
    manager = BlockManager(6, BLOCK, num_host_blocks=16, watermark=0.0)
    scheduler = Scheduler(manager, max_num_seqs=4)
    old, new = make_request(0, 8, max_new_tokens=8), make_request(1, 8, max_new_tokens=8)
    scheduler.add(old)
    scheduler.add(new)
    run_step(scheduler)  # both prompts: 2 blocks each
    swapped_at = None
    for step in range(20):
        out = run_step(scheduler)
        kinds = [kind for kind, _ in out.block_ops]
        if "swap_out" in kinds and swapped_at is None:
            swapped_at = step
            assert scheduler.swapped == [new] and new.status is RequestStatus.SWAPPED
            assert scheduler.running == [old]
        if "swap_in" in kinds:
            assert swapped_at is not None and scheduler.running[0] is new
            break
    assert swapped_at is not None
    assert scheduler.stats.preemptions_by_swap == 1 and scheduler.stats.swaps_in == 1


def test_without_swap_space_the_victim_is_recomputed():
    manager = BlockManager(6, BLOCK, num_host_blocks=0, watermark=0.0)
    scheduler = Scheduler(manager, max_num_seqs=4)
    old, new = make_request(0, 8, max_new_tokens=8), make_request(1, 8, max_new_tokens=8)
    scheduler.add(old)
    scheduler.add(new)
    for _ in range(40):
        if not scheduler.has_unfinished():
            break
        out = run_step(scheduler)
        if scheduler.stats.preemptions_by_recompute and new.status is RequestStatus.WAITING:
            assert scheduler.waiting[0] is new and new.seqs[0].num_computed == 0
            assert new.seqs[0].tokens  # its tokens are kept, to be recomputed
            assert not manager.has_seq(new.seqs[0].seq_id)
    assert not scheduler.has_unfinished()
    assert scheduler.stats.preemptions_by_recompute >= 1
    assert len(new.done[0].tokens) == 8 and len(old.done[0].tokens) == 8  # finished
    assert manager.num_free_device_blocks() == 6
    del out


def test_a_request_that_can_never_run_is_rejected_and_the_next_one_admitted():
    scheduler = Scheduler(BlockManager(4, BLOCK), max_num_seqs=4)
    too_big, fine = make_request(0, 20), make_request(1, 3)
    scheduler.add(too_big)
    scheduler.add(fine)
    out = scheduler.schedule()
    assert [(r.request_id, "needs 6 blocks of 4" in why) for r, why in out.rejected] == [(0, True)]
    assert out.admitted == [fine]


def test_rollback_restores_the_scheduler_and_the_manager():
    manager = BlockManager(32, BLOCK, enable_prefix_caching=True)
    scheduler = Scheduler(manager, max_num_seqs=8, max_num_batched_tokens=12)
    for i, length in enumerate([6, 9, 14]):
        scheduler.add(make_request(i, length, max_new_tokens=6))
    run_step(scheduler)
    run_step(scheduler)
    scheduler.add(make_request(3, 10))
    before = snapshot(scheduler)
    out = scheduler.schedule()
    assert out.decode and out.prefill and out.admitted
    scheduler.rollback(out)
    assert snapshot(scheduler) == before
    again = scheduler.schedule()  # the same plan again
    assert [(c.request.request_id, c.start, c.count) for c in again.chunks] == [
        (c.request.request_id, c.start, c.count) for c in out.chunks
    ]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    lengths=st.lists(st.integers(1, 30), min_size=1, max_size=8),
    samples=st.lists(st.integers(1, 3), min_size=8, max_size=8),
    pool=st.integers(6, 24),
    host=st.sampled_from([0, 64]),
    budget=st.sampled_from([None, 4, 9]),
    prefix_caching=st.booleans(),
)
def test_every_request_ends_and_every_block_returns(
    lengths, samples, pool, host, budget, prefix_caching
):
    manager = BlockManager(pool, BLOCK, num_host_blocks=host, enable_prefix_caching=prefix_caching)
    scheduler = Scheduler(manager, max_num_seqs=4, max_num_batched_tokens=budget)
    requests = [
        make_request(i, length, max_new_tokens=5, n=samples[i]) for i, length in enumerate(lengths)
    ]
    for request in requests:
        scheduler.add(request)
    rejected = set()
    for _ in range(600):
        if not scheduler.has_unfinished():
            break
        out = run_step(scheduler)
        rejected |= {r.request_id for r, _ in out.rejected}
    assert not scheduler.has_unfinished()
    for request in requests:
        if request.request_id in rejected:
            assert scheduler.blocks_needed(request) > pool
        else:
            assert [len(s.tokens) for s in request.done] == [5] * request.params.n
    assert manager.seq_ids() == []
    assert manager.num_free_device_blocks() == pool and manager.num_free_host_blocks() == host


def test_a_request_outgrowing_the_pool_alone_ends_instead_of_looping():
    # blocks_needed bounds what admission lets in; should a request still outgrow the whole
    # pool while it runs alone, it ends with the reason rather than preempting itself forever.
    class Permissive(Scheduler):
        def blocks_needed(self, request):
            return 1

    manager = BlockManager(3, BLOCK, num_host_blocks=16)
    scheduler = Permissive(manager, max_num_seqs=4)
    request = make_request(0, 8, max_new_tokens=10)  # 17 tokens: 5 blocks of 4
    scheduler.add(request)
    rejected = []
    for _ in range(20):
        if not scheduler.has_unfinished():
            break
        rejected += run_step(scheduler).rejected
    assert [(r, "outgrew the whole KV budget" in why) for r, why in rejected] == [(request, True)]
    assert manager.seq_ids() == [] and manager.num_free_device_blocks() == 3


@pytest.mark.parametrize(
    "window, chunk, expected",
    [(None, None, 1 + 3 * 11), (8, None, 2 + 3 * 3), (None, 16, 2 + 3 * 5), (8, 16, 2 + 3 * 5)],
)
def test_blocks_needed_caps_each_sequence_by_what_its_tokens_read(window, chunk, expected):
    # A 6-token prompt, 3 samples of up to 6 + 40 - 1 = 45 tokens in blocks of 4: without a
    # release each sample holds its own 11 blocks past the shared full prompt block; a window of
    # 8 or a chunk of 16 caps that at 8/4 + 1 or 16/4 + 1 blocks (and the prompt's 2 blocks).
    manager = BlockManager(64, BLOCK, sliding_window=window, attention_chunk_size=chunk)
    scheduler = Scheduler(manager, max_num_seqs=4)
    assert scheduler.blocks_needed(make_request(0, 6, max_new_tokens=40, n=3)) == expected


def test_update_from_output_forks_samples_and_frees_each_finished_one():
    manager = BlockManager(32, BLOCK)
    scheduler = Scheduler(manager, max_num_seqs=4)
    request = make_request(0, 6, max_new_tokens=4, n=3)
    scheduler.add(request)
    out = scheduler.schedule()
    assert [c.samples for c in out.chunks] == [True] and out.inputs.query_lens.tolist() == [6]
    updated = scheduler.update_from_output(out, [(request, Drawn([7, 8, 9]))], length_only, ())
    assert updated == [request] and [s.tokens for s in request.seqs] == [[7], [8], [9]]
    parent, *children = (s.seq_id for s in request.seqs)
    assert all(manager.block_table(c) == manager.block_table(parent) for c in children)
    assert request.new_tokens == {parent: [7], children[0]: [8], children[1]: [9]}
    assert all(s.num_computed == 6 for s in request.seqs)

    def stop_second(request, seq):
        return "stop" if seq.seq_id == children[0] else None

    out = scheduler.schedule()
    assert out.inputs.query_lens.tolist() == [1, 1, 1]  # plain arrays, one row per sample
    scheduler.update_from_output(out, [(request, Drawn([1, 2, 3]))], stop_second, ())
    assert [s.seq_id for s in request.done] == [children[0]]
    assert not manager.has_seq(children[0]) and manager.has_seq(parent)
    assert request.status is RequestStatus.RUNNING
    out = scheduler.schedule()
    scheduler.update_from_output(out, [(request, Drawn([4, 5]))], lambda r, s: "length", ())
    assert not request.seqs and request.status is RequestStatus.FINISHED
    assert manager.seq_ids() == [] and manager.num_free_device_blocks() == 32


def test_update_from_output_reassigns_beams_and_ends_them_together():
    manager = BlockManager(32, BLOCK)
    scheduler = Scheduler(manager, max_num_seqs=4)
    params = SamplingParams(3, beam_width=2)
    request = Request(0, [5, 6, 7], params, torch.Generator(), RequestMetrics(0.0))
    scheduler.add(request)
    out = scheduler.schedule()
    # The prompt's one sequence continues twice: the first keeps it, the second forks it.
    scheduler.update_from_output(out, [(request, ([(0, 11, -0.1), (0, 12, -0.2)], []))], None, ())
    first, second = request.seqs
    assert [first.tokens, second.tokens] == [[11], [12]]
    assert manager.block_table(first.seq_id) == manager.block_table(second.seq_id)
    out = scheduler.schedule()
    assert [kind for kind, _ in out.block_ops] == ["copy"]  # copy-on-write of the shared block
    # Both continuations come from the second beam: the first beam's sequence is freed; a
    # candidate ending in an end token becomes a finished hypothesis.
    choice = ([(1, 13, -0.3), (1, 14, -0.4)], [(0, 2, -0.25)])
    scheduler.update_from_output(out, [(request, choice)], None, end_token_ids={2})
    assert not manager.has_seq(first.seq_id)
    assert [b.tokens for b in request.seqs] == [[12, 13], [12, 14]]
    assert [(d.tokens, d.finish_reason) for d in request.done] == [([11, 2], "eos")]
    out = scheduler.schedule()
    choice = ([(0, 15, -0.5), (1, 16, -0.6)], [])
    scheduler.update_from_output(out, [(request, choice)], None, ())
    assert not request.seqs and len(request.done) == 2  # max_new_tokens: the best two kept
    assert request.status is RequestStatus.FINISHED and manager.seq_ids() == []
