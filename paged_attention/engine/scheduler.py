"""The scheduler: which requests run in a step, and which of their tokens, over a BlockManager.

Pure policy: no model and no tensors but the ones the block manager returns. Each step
(``schedule``), in this order:

1. Resume: swapped-out requests come back, oldest first, once the device pool has room for their
   blocks (plus one new block per sequence and the manager's watermark, unless nothing else runs:
   a request running alone gets the whole pool).
2. Reserve: every decoding sequence gets a slot for its next token (one ``decode_step`` for all
   of them); then running requests whose prompt is not fully computed get their next chunk.
   When blocks run short, the most recently admitted request is preempted: swapped to host
   memory with all its sequences when there is room there, else freed to be recomputed later
   (with prefix caching its prompt and generated blocks usually stay cached, so recomputing
   costs little). A request is never lost: it stays in ``swapped`` or goes back to ``waiting``.
3. Admit: waiting requests, first come first served, while seats (``max_num_seqs``), the token
   budget (``max_num_batched_tokens``) and blocks allow. A request that could never run, even
   alone with the whole pool, is rejected with the reason; one that fits later waits (and so do
   the requests behind it). Nothing new is admitted while a request is swapped out.

Every step's work is a list of chunks: ``count`` tokens of one sequence starting at position
``start``. Decodes come first, then prompt chunks, oldest request first, until the token budget
is spent; a prompt longer than the budget spreads over several steps and its last chunk samples
the first token. A chunk only reserves slots: ``commit`` marks its tokens computed after the
forward pass, ``rollback`` releases what the step reserved if the forward pass failed, so the
scheduler is then as it was before the step (preemptions and swaps done by it stand; they are
consistent states of their own).

With prefix caching, an admitted prompt skips the leading tokens whose blocks the cache holds
(and when even its last block is cached, that block is copied and only the last token is
computed); the rest is allocated and appended chunk by chunk, so that a block is registered in
the prefix cache only in the step that computes its tokens.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections import deque
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field

from paged_attention.block_manager import (
    RELEASED,
    AllocStatus,
    BlockManager,
    OutOfBlocksError,
    reassign,
)
from paged_attention.engine.request import Drawn, Request, RequestStatus, Sequence
from paged_attention.kv.step_inputs import StepInputs


@dataclass
class ScheduledChunk:
    """Tokens ``start .. start + count - 1`` of ``seq`` are computed in this step."""

    request: Request
    seq: Sequence
    start: int
    count: int
    allocated: bool = False  # the step allocated the sequence (rather than appending to it)

    @property
    def end(self) -> int:
        return self.start + self.count

    @property
    def samples(self) -> bool:
        """The chunk computes the sequence's last token: its logits give the next one."""
        return self.end == self.request.num_tokens(self.seq)


@dataclass
class SchedulerOutput:
    """The plan of one step: plain ids and numpy arrays, no tensor data."""

    decode: list[ScheduledChunk] = field(default_factory=list)
    # The attention inputs of ``chunks`` (decodes, then prompt chunks), as the manager planned
    # them; None for a step that computes nothing.
    inputs: StepInputs | None = None
    prefill: list[ScheduledChunk] = field(default_factory=list)
    # Recomputed samples or beams forked from their request's first sequence with nothing of
    # their own to compute in this step (count 0).
    forked: list[ScheduledChunk] = field(default_factory=list)
    # ("swap_in" | "swap_out" | "copy", pairs), in the order the cache must carry them out.
    block_ops: list[tuple[str, list[tuple[int, int]]]] = field(default_factory=list)
    admitted: list[Request] = field(default_factory=list)
    rejected: list[tuple[Request, str]] = field(default_factory=list)
    # Blocks whose KV this step's prompt chunks compute (not written yet while it is planned).
    blocks_computed: set[int] = field(default_factory=set)

    @property
    def chunks(self) -> list[ScheduledChunk]:
        return self.decode + self.prefill

    @property
    def num_tokens(self) -> int:
        return len(self.decode) + sum(c.count for c in self.prefill)


@dataclass
class SchedulerStats:
    preemptions_by_swap: int = 0
    preemptions_by_recompute: int = 0
    swaps_in: int = 0
    blocks_swapped_out: int = 0
    blocks_swapped_in: int = 0
    cow_copies: int = 0


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class Scheduler:
    """Admission, resumption, preemption and the per-step token budget over ``manager``."""

    def __init__(
        self,
        manager: BlockManager,
        *,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int | None = None,
    ) -> None:
        if isinstance(max_num_seqs, bool) or not isinstance(max_num_seqs, int) or max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be an integer >= 1, got {max_num_seqs!r}")
        if max_num_batched_tokens is not None and (
            isinstance(max_num_batched_tokens, bool)
            or not isinstance(max_num_batched_tokens, int)
            or max_num_batched_tokens < max_num_seqs
        ):
            raise ValueError(
                "max_num_batched_tokens must be None (no limit) or an integer >= max_num_seqs "
                f"({max_num_seqs}: every running sequence decodes a token per step), got "
                f"{max_num_batched_tokens!r}"
            )
        self.block_manager = manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order
        self.swapped: list[Request] = []  # admission order
        self.stats = SchedulerStats()
        self._seq_ids = itertools.count()
        self._admissions = itertools.count()
        self._admission_order: dict[int, int] = {}  # request_id -> its first admission

    # ------------------------------------------------------------------ requests

    def add(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def new_sequence(self, parent: Sequence | None = None, token: int | None = None) -> Sequence:
        """A fresh sequence id; a copy of ``parent``'s progress (and tokens, plus ``token``)."""
        seq = Sequence(next(self._seq_ids))
        if parent is not None:
            seq.tokens = list(parent.tokens) if token is None else [*parent.tokens, token]
            seq.num_computed = parent.num_computed
            seq.score = parent.score
        return seq

    def blocks_needed(self, request: Request) -> int:
        """The most device blocks ``request``'s sequences can hold together: the prompt's full
        blocks, shared by every sample or beam, plus each sequence's own blocks up to
        ``prompt + max_new_tokens - 1`` tokens (the last token is never stored); with a manager
        that releases blocks (a sliding window, attention chunks), each sequence's own blocks
        are capped by the span a token reads."""
        size = self.block_manager.block_size
        prompt = len(request.prompt)
        longest = prompt + request.params.max_new_tokens - 1
        num_seqs = request.params.num_seqs
        shared = prompt // size
        own = _cdiv(longest, size) - shared
        reach = self.block_manager.reach
        if reach.releases:
            span = max(reach.sliding_window or 0, reach.attention_chunk_size or 0)
            return _cdiv(prompt, size) + num_seqs * min(own, _cdiv(span, size) + 1)
        return shared + num_seqs * own

    def rejection_reason(self, request: Request) -> str | None:
        """Why ``request`` can never run, even alone with the whole pool, or None."""
        needed = self.blocks_needed(request)
        if needed <= self.block_manager.num_device_blocks:
            return None
        params, size = request.params, self.block_manager.block_size
        longest = len(request.prompt) + params.max_new_tokens - 1
        if params.num_seqs == 1:
            who = f"a sequence of up to {longest} tokens needs {needed} blocks of {size}"
        else:
            who = (
                f"{params.num_seqs} sequences of up to {longest} tokens need {needed} blocks of "
                f"{size} together"
            )
        return f"{who}; the pool has {self.block_manager.num_device_blocks}"

    def finish(self, request: Request) -> None:
        """Release everything ``request`` holds, wherever it is, and forget it."""
        if request.status is RequestStatus.FINISHED:
            return
        if request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
        elif request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.swapped.remove(request)
        held = [s.seq_id for s in request.seqs if self.block_manager.has_seq(s.seq_id)]
        self.block_manager.free_many(held)
        request.status = RequestStatus.FINISHED
        self._admission_order.pop(request.request_id, None)

    # ------------------------------------------------------------------ one step

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = math.inf if self.max_num_batched_tokens is None else self.max_num_batched_tokens
        self._resume_swapped(out)
        budget -= self._reserve_decodes(out)
        budget = self._continue_prefills(out, budget)
        self._admit_waiting(out, budget)
        out.inputs = self._step_inputs(out)
        return out

    def commit(self, out: SchedulerOutput) -> None:
        """The forward pass computed every scheduled token."""
        for chunk in out.chunks + out.forked:
            chunk.seq.num_computed = chunk.end

    def rollback(self, out: SchedulerOutput) -> list[tuple[int, int]]:
        """The forward pass failed: release the slots and sequences the step reserved, and put
        the requests it admitted back at the front of the queue, in order. Returns the block
        copies the cache must make (a kept partly filled block that other sequences share as a
        prefix-cache entry is copied rather than rewritten)."""
        pairs = self._release(out.chunks + out.forked)
        for request in reversed(out.admitted):
            self.running.remove(request)
            if all(not s.tokens for s in request.seqs):  # a new request: its sequence goes too
                request.seqs = []
            request.status = RequestStatus.WAITING
            self.waiting.appendleft(request)
        return pairs

    def update_from_output(
        self,
        out: SchedulerOutput,
        sampled: Iterable[tuple[Request, object]],
        finish_reason: Callable[[Request, Sequence], str | None],
        end_token_ids: Collection[int],
    ) -> list[Request]:
        """After the forward pass of ``out`` succeeded: mark its tokens computed, then give each
        request its ``sampled`` choice (a sampling request: one token per sequence, in order; a
        beam request: ``(continuing, finished)`` candidates, :func:`~paged_attention.engine.
        sampler.beam_candidates`). Samples fork from the prompt at their first token, beams are
        reassigned, ``finish_reason(request, seq)`` ends sequences (``end_token_ids``: what
        ends a beam as ``"eos"``), and what finished is freed. Returns the requests updated,
        each with its ``new_tokens``; a request with no ``seqs`` left has finished."""
        self.commit(out)
        updated = []
        for request, choice in sampled:
            request.new_tokens = {}
            if request.params.is_beam_search:
                self._update_beams(request, *choice, end_token_ids)
            else:
                self._update_samples(request, choice, finish_reason)
            if not request.seqs:
                self.finish(request)
            updated.append(request)
        return updated

    def _update_samples(self, request: Request, drawn: Drawn, finish_reason) -> None:
        first = len(request.seqs) == 1 and not request.seqs[0].tokens
        if first and request.params.n > 1:  # the samples fork from the prompt
            parent = request.seqs[0]
            children = [self.new_sequence(parent) for _ in range(request.params.n - 1)]
            self.block_manager.fork_many(
                [parent.seq_id] * len(children), [c.seq_id for c in children]
            )
            request.seqs += children
        for i, (seq, token) in enumerate(zip(request.seqs, drawn.tokens)):
            if drawn.logprobs is not None:
                request.logprobs.setdefault(seq.seq_id, []).append(drawn.logprobs[i])
            seq.tokens.append(token)
            request.new_tokens[seq.seq_id] = [token]
            seq.finish_reason = finish_reason(request, seq)
        finished = [s for s in request.seqs if s.finish_reason is not None]
        self.block_manager.free_many(s.seq_id for s in finished)
        request.done += finished
        request.seqs = [s for s in request.seqs if s.finish_reason is None]

    def _update_beams(self, request: Request, continuing, finished, end_token_ids) -> None:
        """Keep the ``beam_width`` best continuations; a continuation ending in an end token
        becomes a finished hypothesis if it ranks among them. Stops when ``beam_width``
        hypotheses are finished or the beams reach ``max_new_tokens``."""
        params, beams = request.params, request.seqs
        width = params.beam_width
        for beam, token, score in finished:  # a finished hypothesis holds no blocks: seq_id -1
            reason = "eos" if token in end_token_ids else "stop"
            request.done.append(Sequence(-1, [*beams[beam].tokens, token], 0, score, reason))
        # A parent's first child keeps its sequence, later children fork it; the beams nobody
        # picked are freed. Copy-on-write of shared last blocks happens in the next step.
        ids = reassign(
            self.block_manager,
            [b.seq_id for b in beams],
            [beam for beam, _, _ in continuing],
            lambda: next(self._seq_ids),
        )
        next_beams = [
            Sequence(seq_id, [*beams[beam].tokens, token], beams[beam].num_computed, score)
            for seq_id, (beam, token, score) in zip(ids, continuing)
        ]
        request.seqs = next_beams
        request.new_tokens = {b.seq_id: [b.tokens[-1]] for b in next_beams}
        finished_early = len(request.done) >= width
        if finished_early or not next_beams or len(next_beams[0].tokens) == params.max_new_tokens:
            self.block_manager.free_many(b.seq_id for b in next_beams)
            if not finished_early:
                for beam in next_beams:
                    beam.finish_reason = "length"
                request.done += next_beams
            request.done.sort(key=lambda b: b.score / len(b.tokens), reverse=True)
            del request.done[width:]
            request.seqs = []

    # ------------------------------------------------------------------ the phases

    def _resume_swapped(self, out: SchedulerOutput) -> None:
        manager = self.block_manager
        while self.swapped:
            request = self.swapped[0]
            ids = [s.seq_id for s in request.seqs]
            blocks = {b for s in ids for b in manager.host_block_table(s) if b != RELEASED}
            others = bool(self.running)
            # Room for its blocks and a new block per sequence, or it would be preempted again;
            # a request that runs alone gets the whole pool.
            headroom = len(ids) + manager.watermark_blocks if others else 0
            if manager.num_free_device_blocks() < len(blocks) + headroom:
                return
            pairs = manager.swap_in(ids)
            out.block_ops.append(("swap_in", pairs))
            self.swapped.pop(0)
            request.status = RequestStatus.RUNNING
            self._insert_running(request)
            self.stats.swaps_in += 1
            self.stats.blocks_swapped_in += len(pairs)

    def _reserve_decodes(self, out: SchedulerOutput) -> int:
        """One slot for every decoding sequence, preempting the newest requests while the pool
        is short. Returns the tokens scheduled."""
        record = self.block_manager.enable_prefix_caching
        while True:
            decoding = [r for r in self.running if r.is_decoding]
            seqs = [(r, s) for r in decoding for s in r.seqs]
            if not seqs:
                return 0
            ids = [s.seq_id for _, s in seqs]
            tokens = [s.tokens[-1] for _, s in seqs] if record else None
            try:
                pairs, tables, seq_lens, slots = self.block_manager.decode_step(ids, tokens)
            except OutOfBlocksError:
                victim = self.running[-1]
                if len(self.running) == 1:
                    # Alone with the whole pool and still short: blocks_needed was exceeded,
                    # which admission rules out; end the request rather than loop.
                    out.rejected.append(
                        (victim, "its sequences outgrew the whole KV budget while decoding")
                    )
                    self.finish(victim)
                    continue
                self._preempt(victim, out)
                continue
            if pairs:
                out.block_ops.append(("copy", pairs))
                self.stats.cow_copies += len(pairs)
            out.decode = [ScheduledChunk(r, s, s.num_computed, 1) for r, s in seqs]
            out.inputs = StepInputs.decode(self.block_manager, tables, seq_lens, slots)
            return len(seqs)

    def _continue_prefills(self, out: SchedulerOutput, budget: float) -> float:
        """The next prompt chunk of every running request that is still prefilling, oldest
        first. A chunk that does not fit preempts newer requests that have no work in this step;
        with none left, the request waits for the next step."""
        scheduled = {id(r) for r in self.running if r.is_decoding}
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            index += 1
            if id(request) in scheduled:
                continue
            while True:
                try:
                    chunks = self._reserve_chunks(request, budget, out)
                    break
                except OutOfBlocksError:
                    newer = [r for r in self.running[index:] if id(r) not in scheduled]
                    if not newer:
                        chunks = []
                        break
                    self._preempt(newer[-1], out)
            if chunks:
                scheduled.add(id(request))
                budget -= sum(c.count for c in chunks)
        return budget

    def _admit_waiting(self, out: SchedulerOutput, budget: float) -> None:
        if self.swapped:
            return  # preempted requests are served first
        seats = self.max_num_seqs - sum(r.seats for r in self.running)
        while self.waiting and budget > 0:
            request = self.waiting[0]
            reason = self.rejection_reason(request)
            if reason is not None:
                self.waiting.popleft()
                out.rejected.append((request, reason))
                request.status = RequestStatus.FINISHED
                continue
            if seats < request.params.num_seqs:
                return
            fresh = not request.seqs
            if fresh:
                request.seqs = [self.new_sequence()]
            try:
                # Alone, a request gets the whole pool; otherwise the watermark stays free.
                chunks = self._reserve_chunks(request, budget, out, watermark=bool(self.running))
            except OutOfBlocksError:
                chunks = []
            if not chunks:
                if fresh:
                    request.seqs = []
                return
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self._admission_order.setdefault(request.request_id, next(self._admissions))
            self._insert_running(request)
            out.admitted.append(request)
            if request.metrics.first_scheduled_step is None:
                request.metrics.num_cached_prompt_tokens = min(chunks[0].start, len(request.prompt))
            seats -= request.params.num_seqs
            budget -= sum(c.count for c in chunks)

    # ------------------------------------------------------------------ helpers

    def _step_inputs(self, out: SchedulerOutput) -> StepInputs | None:
        """The step's attention inputs: the decode rows as ``decode_step`` returned them (set by
        ``_reserve_decodes``), then the prompt chunks' rows read from the manager."""
        parts = [] if out.inputs is None else [out.inputs]
        if out.prefill:
            ids = [c.seq.seq_id for c in out.prefill]
            counts = [c.count for c in out.prefill]
            parts.append(StepInputs.from_manager(self.block_manager, ids, counts))
        return StepInputs.concat(parts) if parts else None

    def _reserve_chunks(
        self, request: Request, budget: float, out: SchedulerOutput, watermark: bool = False
    ) -> list[ScheduledChunk]:
        """Reserve the next chunk of each of ``request``'s sequences that still has prompt (or
        recomputed) tokens to compute, within ``budget`` tokens: all of them, or none
        (OutOfBlocksError). ``watermark``: allocate only while the pool keeps its watermark
        free.

        A sequence the manager does not hold yet is allocated, its chunk starting after its
        prefix-cache hit, looked up just before (an earlier sequence of the same step may have
        registered the blocks it hits). The other samples or beams of a recomputed request fork
        from its first sequence once that holds the prompt, cut back to the prompt: they share
        its blocks again, as when they were first forked, so the request fits the blocks
        ``blocks_needed`` counted."""
        manager = self.block_manager
        leader = request.seqs[0]
        prompt = len(request.prompt)
        reserved: list[ScheduledChunk] = []
        pairs: list[tuple[int, int]] = []
        try:
            for seq in request.seqs:
                target = request.prefill_target(seq)
                allocate = not manager.has_seq(seq.seq_id)
                forks = allocate and seq is not leader
                start = seq.num_computed
                if forks:
                    if leader.num_computed < prompt:
                        break  # the first sequence has not computed the prompt yet
                    start = prompt
                elif (
                    allocate and manager.enable_prefix_caching and request.params.reads_prefix_cache
                ):
                    start = manager.cached_prefix_length(request.token_slice(seq, 0, target))
                if target > start and budget <= 0:
                    break  # out of budget
                count = int(min(target - start, budget))
                if count == 0 and not forks:
                    continue
                tokens = request.token_slice(seq, 0, start + count)
                chunk = ScheduledChunk(request, seq, start, count, allocated=allocate)
                if forks:
                    manager.fork(leader.seq_id, seq.seq_id)
                    reserved.append(chunk)
                    pairs += manager.truncate(seq.seq_id, start)
                    if count:
                        pairs += manager.append_slots(seq.seq_id, count, tokens[start:])
                elif allocate:
                    if watermark and manager.can_allocate(tokens) is not AllocStatus.OK:
                        raise OutOfBlocksError("the pool keeps its watermark for running sequences")
                    manager.allocate(seq.seq_id, tokens)
                    reserved.append(chunk)
                    if chunk.end == target and chunk.end - chunk.start == manager.block_size:
                        pairs += self._copy_cached_last_block(chunk, out)
                else:
                    pairs += manager.append_slots(seq.seq_id, count, tokens[start:])
                    reserved.append(chunk)
                size = manager.block_size
                table = manager.block_table(seq.seq_id)
                out.blocks_computed.update(table[chunk.start // size : -(-chunk.end // size)])
                budget -= chunk.count
        except OutOfBlocksError:
            pairs += self._release(reserved)
            if pairs:
                out.block_ops.append(("copy", pairs))
            raise
        if pairs:
            out.block_ops.append(("copy", pairs))
            self.stats.cow_copies += len(pairs)
        out.prefill += [c for c in reserved if c.count]
        out.forked += [c for c in reserved if not c.count]
        return reserved

    def _copy_cached_last_block(
        self, chunk: ScheduledChunk, out: SchedulerOutput
    ) -> list[tuple[int, int]]:
        """A prompt cached to its last token computes only that token: its block's other tokens
        are copied from the cache (when that block was computed before this step)."""
        pair = self.block_manager.cached_copy_of_last_block(chunk.seq.seq_id)
        if pair is None or pair[0] in out.blocks_computed:
            return []
        chunk.start, chunk.count = chunk.end - 1, 1
        return [pair]

    def _release(self, chunks: list[ScheduledChunk]) -> list[tuple[int, int]]:
        """Undo the reservations of ``chunks``, last first; their tokens were never computed,
        so blocks they registered in the prefix cache leave it. Returns the copies to make."""
        pairs = []
        for chunk in reversed(chunks):
            if chunk.allocated:
                self.block_manager.free(chunk.seq.seq_id, cache=False)
            else:
                pairs += self.block_manager.truncate(chunk.seq.seq_id, chunk.start, cache=False)
        return pairs

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        """Swap ``request`` out when the host has room for all its blocks, else free it to be
        recomputed from its tokens (which it keeps)."""
        self.running.remove(request)
        ids = [s.seq_id for s in request.seqs if self.block_manager.has_seq(s.seq_id)]
        # A recomputed request whose samples have not forked again yet is recomputed again.
        whole = len(ids) == len(request.seqs)
        if whole and self.block_manager.num_host_blocks and self.block_manager.can_swap_out(ids):
            pairs = self.block_manager.swap_out(ids)
            out.block_ops.append(("swap_out", pairs))
            request.status = RequestStatus.SWAPPED
            self._insert_by_admission(self.swapped, request)
            self.stats.preemptions_by_swap += 1
            self.stats.blocks_swapped_out += len(pairs)
            return
        self.block_manager.free_many(ids)  # their blocks hold computed tokens: they may stay cached
        for seq in request.seqs:
            seq.num_computed = 0
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)
        self.stats.preemptions_by_recompute += 1

    def _insert_running(self, request: Request) -> None:
        self._insert_by_admission(self.running, request)

    def _insert_by_admission(self, queue: list[Request], request: Request) -> None:
        order = self._admission_order
        keys = [order[r.request_id] for r in queue]
        queue.insert(bisect.bisect(keys, order[request.request_id]), request)
