"""What a step's sampled tokens do to the scheduler's requests, after the forward pass: tokens
appended, stops checked, samples forked from the prompt, beams reassigned, and what finished
freed. The block changes this makes go through the scheduler's block manager, so that every
block change of a step is the scheduler's (its reservations in ``schedule()``, these after the
forward pass, and ``finish``/``rollback``)."""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable
from typing import TYPE_CHECKING

from paged_attention.engine.request import Drawn, Request, Sequence
from paged_attention.engine.spec_decode import Verified
from paged_attention.kv.block_manager import reassign

if TYPE_CHECKING:
    from paged_attention.engine.scheduler import Scheduler

FinishReason = Callable[[Request, Sequence], "str | None"]


class StepUpdate:
    """Applies sampled tokens to the requests of ``scheduler``."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler

    def apply(
        self,
        sampled: Iterable[tuple[Request, object]],
        finish_reason: FinishReason,
        end_token_ids: Collection[int],
    ) -> list[Request]:
        """Give each request its ``sampled`` choice (a sampling request: a
        :class:`~paged_attention.engine.request.Drawn`, one token per sequence, in order, or for
        a drafting one a :class:`~paged_attention.engine.spec_decode.Verified`; a beam
        request: ``(continuing, finished)`` candidates, :func:`~paged_attention.engine.sampler.
        beam_candidates`). Samples fork from the prompt at their first token, beams are
        reassigned, ``finish_reason(request, seq)`` ends sequences (``end_token_ids``: what
        ends a beam as ``"eos"``), and what finished is freed. Returns the requests updated,
        each with its ``new_tokens``; a request with no ``seqs`` left has finished."""
        updated = []
        for request, choice in sampled:
            request.new_tokens = {}
            if request.params.is_beam_search:
                self._update_beams(request, *choice, end_token_ids)
            elif isinstance(choice, Verified):
                self._update_verified(request, choice, finish_reason)
            else:
                self._update_samples(request, choice, finish_reason)
            if not request.seqs:
                self.scheduler.finish(request)
            updated.append(request)
        return updated

    def _update_samples(self, request: Request, drawn: Drawn, finish_reason: FinishReason) -> None:
        manager = self.scheduler.block_manager
        first = len(request.seqs) == 1 and not request.seqs[0].tokens
        if first and request.params.n > 1:  # the samples fork from the prompt
            parent = request.seqs[0]
            children = [self.scheduler.new_sequence(parent) for _ in range(request.params.n - 1)]
            manager.fork_many([parent.seq_id] * len(children), [c.seq_id for c in children])
            request.seqs += children
        for i, (seq, token) in enumerate(zip(request.seqs, drawn.tokens)):
            if drawn.logprobs is not None:
                request.logprobs.setdefault(seq.seq_id, []).append(drawn.logprobs[i])
            seq.tokens.append(token)
            request.new_tokens[seq.seq_id] = [token]
            seq.finish_reason = finish_reason(request, seq)
        finished = [s for s in request.seqs if s.finish_reason is not None]
        manager.free_many(s.seq_id for s in finished)
        request.done += finished
        request.seqs = [s for s in request.seqs if s.finish_reason is None]

    def _update_verified(
        self, request: Request, verified: Verified, finish_reason: FinishReason
    ) -> None:
        """A drafting sequence's tokens, appended one by one until one ends it (the rest are
        dropped); a sequence that goes on gives back the slots of its rejected drafts."""
        seq = request.seqs[0]
        new = request.new_tokens[seq.seq_id] = []
        for i, token in enumerate(verified.tokens):
            seq.tokens.append(token)
            new.append(token)
            if verified.logprobs is not None:
                request.logprobs.setdefault(seq.seq_id, []).append(verified.logprobs[i])
            seq.finish_reason = finish_reason(request, seq)
            if seq.finish_reason is not None:
                self.scheduler.block_manager.free(seq.seq_id)
                request.done.append(seq)
                request.seqs = []
                return
        # The fed token and the accepted drafts are computed; the model's own token is next.
        seq.num_computed = request.num_tokens(seq) - 1
        if verified.accepted < verified.drafted:
            self.scheduler.drafts.give_back(seq.seq_id, seq.num_computed)

    def _update_beams(self, request: Request, continuing, finished, end_token_ids) -> None:
        """Keep the ``beam_width`` best continuations; a continuation ending in an end token
        becomes a finished hypothesis if it ranks among them. Stops when ``beam_width``
        hypotheses are finished or the beams reach ``max_new_tokens``."""
        manager = self.scheduler.block_manager
        params, beams = request.params, request.seqs
        width = params.beam_width
        for beam, token, score in finished:  # a finished hypothesis holds no blocks: seq_id -1
            reason = "eos" if token in end_token_ids else "stop"
            request.done.append(Sequence(-1, [*beams[beam].tokens, token], 0, score, reason))
        # A parent's first child keeps its sequence, later children fork it; the beams nobody
        # picked are freed. Copy-on-write of shared last blocks happens in the next step.
        ids = reassign(
            manager,
            [b.seq_id for b in beams],
            [beam for beam, _, _ in continuing],
            self.scheduler.new_seq_id,
        )
        next_beams = [
            Sequence(seq_id, [*beams[beam].tokens, token], beams[beam].num_computed, score)
            for seq_id, (beam, token, score) in zip(ids, continuing)
        ]
        request.seqs = next_beams
        request.new_tokens = {b.seq_id: [b.tokens[-1]] for b in next_beams}
        finished_early = len(request.done) >= width
        if finished_early or not next_beams or len(next_beams[0].tokens) == params.max_new_tokens:
            manager.free_many(b.seq_id for b in next_beams)
            if not finished_early:
                for beam in next_beams:
                    beam.finish_reason = "length"
                request.done += next_beams
            request.done.sort(key=lambda b: b.score / len(b.tokens), reverse=True)
            del request.done[width:]
            request.seqs = []
