"""Speculative decoding: drafts proposed from a sequence's own tokens, slots reserved for them,
and their verification by the logits of one forward pass.

A step with drafts feeds each drafting sequence its last token followed by up to ``k`` drafted
tokens, as one multi-token query of the varlen attention (the path chunked prefill takes), and
keeps the logits of every one of those rows: row ``i`` is the model's distribution after the
first ``i`` drafts. Verification walks the rows in order: the model's token at row ``i`` is
chosen exactly as a plain decode step would choose it (the same controls, computed as if the
drafts before it were already generated; greedy: the argmax; sampling: one draw from the
processed distribution with the request's own generator), and the draft at ``i`` is accepted
when it equals that token. The first token that differs, or the one after the last draft, is
the step's last token: 1 to ``k + 1`` tokens per step.

For sampling this is the rejection sampling of speculative decoding for a deterministic draft
(one-hot draft distribution ``q``): the draft ``d`` is accepted with probability ``p(d)``
(``min(1, p(d) / q(d))``), and on rejection the token drawn is distributed as ``p`` with ``d``
removed and renormalised (``norm(max(0, p - q))``), so every token has exactly the plain
sampler's distribution. Drawing the model's token first and comparing realises both with one
draw per token, the draw a plain decode step makes: a seeded request gets the same tokens with
and without speculation, whatever the batch around it.

:class:`DraftSlots` is the scheduler's helper (drafts are block reservations, so the
scheduler's); :func:`verify_drafts` runs in the engine core beside the sampler.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from paged_attention.engine.config import SpeculativeConfig
from paged_attention.engine.logits_processors import RowState, StepControls, sampling_probabilities
from paged_attention.engine.logprobs import token_logprobs
from paged_attention.engine.plan import ScheduledChunk, SchedulerOutput
from paged_attention.engine.request import Request, TokenLogprobs
from paged_attention.kv.block_manager import BlockManager, OutOfBlocksError
from paged_attention.kv.step_inputs import StepInputs


class NgramProposer:
    """Prompt lookup (vLLM's ``ngram`` method): for ``n`` from ``prompt_lookup_max`` down to
    ``prompt_lookup_min``, the last ``n`` tokens are looked up earlier in the sequence; at the
    first ``n`` that occurs, the tokens that followed its earliest occurrence are proposed."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max

    def propose(self, tokens: Sequence[int], limit: int, seq_id: int | None = None) -> list[int]:
        """At most ``limit`` drafts to follow ``tokens`` (prompt then output); [] when no
        n-gram matches. (``seq_id`` is not needed: the drafts depend on the tokens only.)"""
        ids = np.asarray(tokens, dtype=np.int64)
        length = ids.size
        if limit <= 0 or length <= self.min_n:
            return []
        # Every earlier position holding the last token, which is where any match must end.
        ends = np.flatnonzero(ids[: length - 1] == ids[-1])
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            candidates = ends[ends >= n - 1]
            for back in range(1, n):  # the match's earlier tokens, nearest first
                if not candidates.size:
                    break
                candidates = candidates[ids[candidates - back] == ids[length - 1 - back]]
            if candidates.size:
                follow = int(candidates[0]) + 1
                return ids[follow : follow + limit].tolist()
        return []

    def propose_batch(self, work: Sequence[tuple[int, Sequence[int], int]]) -> list[list[int]]:
        """:meth:`propose` for each ``(seq_id, tokens, limit)`` of ``work`` (the proposers'
        common interface: the draft model's drafts all sequences together)."""
        return [self.propose(tokens, limit) for _, tokens, limit in work]

    @property
    def states(self) -> dict:
        """Nothing is kept between steps."""
        return {}

    def end_step(self, keep: Collection[int] = ()) -> None:
        """Nothing is kept between steps."""


def make_proposer(config: SpeculativeConfig | None, manager: BlockManager):
    """The proposer of ``config``'s method, or None when nothing is drafted. A draft model's
    pool has as many blocks of the same size as ``manager``'s device pool."""
    if config is None:
        return None
    if config.method == "draft_model":
        from paged_attention.engine.draft_model import DraftModelProposer

        blocks, size = manager.num_device_blocks, manager.block_size
        return DraftModelProposer(config.draft_model, blocks, size)
    return NgramProposer(config)


def drafts_allowed(request: Request) -> bool:
    """Whether ``request`` is given drafts: one sample, no beam search, no grammar (the others
    decode one token per step, as without speculation)."""
    params = request.params
    return params.n == 1 and not params.is_beam_search and request.grammar is None


class DraftSlots:
    """The slots of a step's drafts in ``manager``, and their return once verified. With
    ``config`` None, nothing is drafted (only copies an earlier cut left are carried)."""

    def __init__(self, manager: BlockManager, config: SpeculativeConfig | None) -> None:
        self.manager = manager
        self.config = config
        self.proposer = make_proposer(config, manager)
        self._carried: list[tuple[int, tuple[int, int]]] = []

    def reserve(self, out: SchedulerOutput, budget: float) -> int:
        """After the step's decode slots are reserved: drafts for its decoding sequences, within
        ``budget`` tokens and the blocks the pool has beyond its watermark (a sequence the pool
        cannot give more slots decodes plainly; nothing is preempted for drafts). The drafting
        sequences are proposed for together, one call per round (the draft model drafts them
        in one batch): a round shares the budget out in decode order, and the sequences it left
        without any get another round with what the proposals left unused (n-gram proposals
        are often shorter than their limits). Returns the drafted tokens; the step's decode
        rows are re-read from the manager if any."""
        self._carry_copies(out)
        if self.proposer is None or not out.decode:
            return 0
        drafted, pending = 0, list(out.decode)
        while pending and budget - drafted > 0:
            placed, pending = self._draft_round(pending, budget - drafted, out)
            drafted += placed
        self.proposer.end_step()
        if drafted:
            ids = [c.seq.seq_id for c in out.decode]
            counts = [c.count for c in out.decode]
            out.inputs = StepInputs.from_manager(self.manager, ids, counts)
        return drafted

    def _draft_round(
        self, pending: list[ScheduledChunk], budget: float, out: SchedulerOutput
    ) -> tuple[int, list[ScheduledChunk]]:
        """Drafts for ``pending`` within ``budget``, in one call to the proposer: the tokens
        placed, and the chunks the budget ran out before (none when nothing was proposed)."""
        chunks, work, left, skipped = [], [], budget, []
        for chunk in pending:
            limit = self._limit(chunk, left)
            if limit > 0:
                request, seq = chunk.request, chunk.seq
                chunks.append(chunk)
                work.append((seq.seq_id, request.prompt + seq.tokens, limit))
                left -= limit
            elif left <= 0:
                skipped.append(chunk)
        if not work:
            return 0, []
        proposals = self.proposer.propose_batch(work)
        return sum(self._place(c, d, out) for c, d in zip(chunks, proposals)), skipped

    def _limit(self, chunk: ScheduledChunk, budget: float) -> int:
        """The most drafts ``chunk``'s sequence may get: the config's, within ``budget``, short
        of ``max_new_tokens`` (a step emits at most one token more than it drafts) and within
        the pool's room; 0 for requests not given drafts."""
        request, seq = chunk.request, chunk.seq
        if budget <= 0 or not drafts_allowed(request):
            return 0
        limit = min(self.config.num_speculative_tokens, int(min(budget, 1 << 30)))
        return min(limit, request.params.max_new_tokens - len(seq.tokens) - 1, self._room(chunk))

    def _place(self, chunk: ScheduledChunk, drafts: list[int], out: SchedulerOutput) -> int:
        """Slots for ``drafts`` after ``chunk``'s decode slot, as many as the pool still has
        room for (earlier sequences of the step took theirs since the limits were set)."""
        drafts = drafts[: self._room(chunk)]
        if not drafts:
            return 0
        try:
            pairs = self.manager.append_slots(chunk.seq.seq_id, len(drafts), drafts)
        except OutOfBlocksError:
            return 0
        if pairs:
            out.block_ops.append(("copy", pairs))
        chunk.drafts = drafts
        chunk.count += len(drafts)
        return len(drafts)

    def _room(self, chunk: ScheduledChunk) -> int:
        """The most slots ``chunk``'s sequence may add: the rest of its last block, and whole
        blocks while the pool keeps its watermark free."""
        manager, size = self.manager, self.manager.block_size
        length = chunk.request.num_tokens(chunk.seq)  # slots held, the decode's included
        spare = manager.num_free_device_blocks() - manager.watermark_blocks
        return -(-length // size) * size - length + max(spare, 0) * size

    def give_back(self, seq_id: int, num_tokens: int) -> None:
        """Cut a sequence whose drafts were rejected back to ``num_tokens`` (their KV is valid for
        the drafted ids, so full blocks of them may stay in the prefix cache); a copy the cut
        needs is made at the start of the next step."""
        pairs = self.manager.truncate(seq_id, num_tokens)
        self._carried += [(seq_id, pair) for pair in pairs]

    def let_go_of_freed(self) -> None:
        """The proposer forgets what it kept for sequences the manager no longer holds
        (finished, aborted, or preempted by recompute)."""
        if self.proposer is not None:
            states = self.proposer.states
            self.proposer.end_step(keep=[s for s in states if self.manager.has_seq(s)])

    def restore(self, out: SchedulerOutput) -> None:
        """The step ``out`` failed: the copies it carried are carried again."""
        self._carried = out.carried_copies + self._carried

    def _carry_copies(self, out: SchedulerOutput) -> None:
        """The copies earlier cuts left, first among the step's block operations; those of
        sequences that no longer hold the copy's destination (finished since) are dropped."""
        carried, self._carried = self._carried, []
        manager = self.manager
        live = [
            (seq_id, pair)
            for seq_id, pair in carried
            if manager.has_seq(seq_id) and pair[1] in manager.block_table(seq_id)
        ]
        if live:
            out.block_ops.insert(0, ("copy", [pair for _, pair in live]))
        out.carried_copies = live


@dataclass
class Verified:
    """A drafting sequence's tokens of one step: the accepted drafts, then the model's own
    token (``accepted`` of the ``drafted`` drafts were accepted), and with
    ``SamplingParams.logprobs`` one entry per token."""

    tokens: list[int]
    drafted: int
    accepted: int
    logprobs: list[TokenLogprobs] | None = None


def verify_drafts(
    logits: torch.Tensor,
    groups: list[tuple[Request, ScheduledChunk, list[int]]],
    end_tokens: Collection[int] = frozenset(),
) -> list[Verified]:
    """The tokens of each ``(request, its drafting chunk, its rows of logits)``: row ``i``
    follows the first ``i`` drafts. Touches nothing but the requests' generators."""
    rows = [row for _, _, group_rows in groups for row in group_rows]
    states = [
        RowState(request.params, request.prompt, chunk.seq.tokens + chunk.drafts[:i])
        for request, chunk, group_rows in groups
        for i in range(len(group_rows))
    ]
    selected = logits[rows]
    want_logprobs = any(request.params.logprobs is not None for request, _, _ in groups)
    raw = selected.log_softmax(-1) if want_logprobs else None
    StepControls(states, end_tokens, logits.shape[-1], logits.device).apply(selected)
    greedy_rows = [i for i, state in enumerate(states) if state.params.is_greedy]
    sampled_rows = [i for i, state in enumerate(states) if not state.params.is_greedy]
    argmax = dict(zip(greedy_rows, selected[greedy_rows].argmax(-1).tolist()))
    probs = None
    if sampled_rows:
        params = [states[i].params for i in sampled_rows]
        probs = sampling_probabilities(selected[sampled_rows], params)
    place = {row: i for i, row in enumerate(sampled_rows)}
    results, first = [], 0
    for request, chunk, group_rows in groups:
        tokens = []
        for i, draft in enumerate([*chunk.drafts, None]):
            row = first + i
            if request.params.is_greedy:
                token = argmax[row]
            else:
                drawn = torch.multinomial(probs[place[row]][None], 1, generator=request.generator)
                token = int(drawn[0, 0])
            tokens.append(token)
            if token != draft:
                break
        entries = None
        if request.params.logprobs is not None:
            span = raw[first : first + len(tokens)]
            chosen = torch.tensor(tokens, device=logits.device)
            entries = token_logprobs(span, chosen, [request.params.logprobs] * len(tokens))
        results.append(Verified(tokens, len(chunk.drafts), len(tokens) - 1, entries))
        first += len(group_rows)
    return results
