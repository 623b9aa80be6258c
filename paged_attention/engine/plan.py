"""The plan of one step, as :meth:`Scheduler.schedule
<paged_attention.engine.scheduler.Scheduler.schedule>` gives it: which tokens of which sequences
are computed (chunks), the cache's block copies and swaps, the attention inputs, and the
requests admitted or rejected. Plain ids and numpy arrays: no tensor data."""

from __future__ import annotations

from dataclasses import dataclass, field

from paged_attention.engine.request import Request, Sequence
from paged_attention.kv.step_inputs import StepInputs


@dataclass
class ScheduledChunk:
    """Tokens ``start .. start + count - 1`` of ``seq`` are computed in this step. A decode
    chunk with ``drafts`` (speculative decoding) feeds them after the sequence's last token:
    ``count`` counts them, and every one of its rows is scored."""

    request: Request
    seq: Sequence
    start: int
    count: int
    allocated: bool = False  # the step allocated the sequence (rather than appending to it)
    drafts: list[int] = field(default_factory=list)

    @property
    def end(self) -> int:
        return self.start + self.count

    @property
    def samples(self) -> bool:
        """The chunk computes the sequence's last token: its logits give the next one."""
        return self.end - len(self.drafts) == self.request.num_tokens(self.seq)

    @property
    def num_sample_rows(self) -> int:
        """The rows of logits the step keeps for this chunk: its last one if it samples, and
        one per draft (the model's choice after each)."""
        return 1 + len(self.drafts) if self.samples else 0

    def fed_tokens(self) -> list[int]:
        """The token ids the forward pass feeds for this chunk, drafts last."""
        known = self.request.token_slice(self.seq, self.start, self.end - len(self.drafts))
        return known + self.drafts if self.drafts else known


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
    # Copies an earlier step's cut of rejected drafts left to this step ((seq_id, pair)).
    carried_copies: list[tuple[int, tuple[int, int]]] = field(default_factory=list)

    @property
    def chunks(self) -> list[ScheduledChunk]:
        return self.decode + self.prefill

    @property
    def num_tokens(self) -> int:
        return sum(c.count for c in self.decode) + sum(c.count for c in self.prefill)

    @property
    def has_drafts(self) -> bool:
        return any(c.drafts for c in self.decode)


@dataclass
class SchedulerStats:
    preemptions_by_swap: int = 0
    preemptions_by_recompute: int = 0
    swaps_in: int = 0
    blocks_swapped_out: int = 0
    blocks_swapped_in: int = 0
    cow_copies: int = 0
