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
4. Draft (speculative decoding): decoding sequences get slots for drafted tokens with what is
   left of the budget and of the pool above its watermark; nothing waits or is preempted for
   drafts.

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

from paged_attention.engine.config import SchedulerConfig, SpeculativeConfig
from paged_attention.engine.plan import ScheduledChunk, SchedulerOutput, SchedulerStats
from paged_attention.engine.request import Request, RequestStatus, Sequence
from paged_attention.engine.reservations import ChunkReserver
from paged_attention.engine.spec_decode import DraftSlots
from paged_attention.engine.step_update import StepUpdate
from paged_attention.kv.block_manager import (
    RELEASED,
    BlockManager,
    OutOfBlocksError,
)
from paged_attention.kv.step_inputs import StepInputs

__all__ = ["ScheduledChunk", "Scheduler", "SchedulerOutput", "SchedulerStats"]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class Scheduler:
    """Admission, resumption, preemption and the per-step token budget over ``manager``."""

    def __init__(
        self,
        manager: BlockManager,
        config: SchedulerConfig | None = None,
        *,
        speculative: SpeculativeConfig | None = None,
        **kwargs,
    ) -> None:
        """``config`` (or its fields as keyword arguments: ``max_num_seqs``,
        ``max_num_batched_tokens``) is validated by :class:`SchedulerConfig`; ``speculative``:
        drafts for decoding sequences (:class:`~paged_attention.engine.spec_decode.DraftSlots`)."""
        if config is None:
            config = SchedulerConfig(**kwargs)
        elif kwargs:
            raise TypeError(f"give config or its fields, not both (got {sorted(kwargs)})")
        self.block_manager = manager
        self.config = config
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order
        self.swapped: list[Request] = []  # admission order
        self.stats = SchedulerStats()
        self._seq_ids = itertools.count()
        self._admissions = itertools.count()
        self._admission_order: dict[int, int] = {}  # request_id -> its first admission
        self._update = StepUpdate(self)
        self._reserver = ChunkReserver(manager, self.stats)
        self.drafts = DraftSlots(manager, speculative)

    # ------------------------------------------------------------------ requests

    def add(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def new_seq_id(self) -> int:
        return next(self._seq_ids)

    def new_sequence(self, parent: Sequence | None = None, token: int | None = None) -> Sequence:
        """A fresh sequence id; a copy of ``parent``'s progress (and tokens, plus ``token``)."""
        seq = Sequence(self.new_seq_id())
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
        self.drafts.let_go_of_freed()
        request.status = RequestStatus.FINISHED
        self._admission_order.pop(request.request_id, None)

    # ------------------------------------------------------------------ one step

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        limit = math.inf if self.max_num_batched_tokens is None else self.max_num_batched_tokens
        self._resume_swapped(out)
        budget = limit - self._reserve_decodes(out)
        budget = self._continue_prefills(out, budget)
        self._admit_waiting(out, budget)
        self.drafts.reserve(out, limit - out.num_tokens)
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
        pairs = self._reserver.release(out.chunks + out.forked)
        self.drafts.restore(out)
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
        """After the forward pass of ``out`` succeeded: its tokens are computed and each request
        gets its ``sampled`` choice (:meth:`StepUpdate.apply
        <paged_attention.engine.step_update.StepUpdate.apply>`). Returns the requests updated;
        one with no ``seqs`` left has finished and holds no blocks."""
        self.commit(out)
        return self._update.apply(sampled, finish_reason, end_token_ids)

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
            _insert_by_admission(self._admission_order, self.running, request)
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
                    chunks = self._reserver.reserve(request, budget, out)
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
                chunks = self._reserver.reserve(request, budget, out, watermark=bool(self.running))
            except OutOfBlocksError:
                chunks = []
            if not chunks:
                if fresh:
                    request.seqs = []
                return
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self._admission_order.setdefault(request.request_id, next(self._admissions))
            _insert_by_admission(self._admission_order, self.running, request)
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
            _insert_by_admission(self._admission_order, self.swapped, request)
            self.stats.preemptions_by_swap += 1
            self.stats.blocks_swapped_out += len(pairs)
            return
        self.block_manager.free_many(ids)  # their blocks hold computed tokens: they may stay cached
        for seq in request.seqs:
            seq.num_computed = 0
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)
        self.stats.preemptions_by_recompute += 1


def _insert_by_admission(order: dict[int, int], queue: list[Request], request: Request) -> None:
    """Insert ``request`` into ``queue`` by its admission ``order`` (request id -> rank)."""
    keys = [order[r.request_id] for r in queue]
    queue.insert(bisect.bisect(keys, order[request.request_id]), request)
