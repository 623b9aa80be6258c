"""What an engine counts over its steps (:class:`EngineStats`), and how a step adds to it."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from paged_attention.engine.plan import SchedulerOutput


@dataclass
class EngineStats:
    steps: int = 0
    generated_tokens: int = 0  # tokens sampled, over all sequences
    prompt_tokens: int = 0  # prompt tokens of the requests admitted
    prompt_tokens_cached: int = 0  # of those, served by the prefix cache at admission
    prompt_tokens_computed: int = 0  # prompt tokens fed to the model (recomputation included)
    recomputed_tokens: int = 0  # generated tokens fed again after a preemption by recompute
    peak_blocks: int = 0  # most device blocks in use at once
    peak_contiguous_blocks: int = 0  # most blocks a max-length contiguous reservation needed
    peak_blocks_saved_by_sharing: int = 0
    peak_running_requests: int = 0
    cow_copies: int = 0
    swaps_out: int = 0  # requests preempted to the host
    swaps_in: int = 0
    blocks_swapped_out: int = 0
    blocks_swapped_in: int = 0
    preemptions_by_recompute: int = 0  # requests preempted by freeing, recomputed later
    draft_tokens: int = 0  # speculative decoding: tokens drafted and verified
    accepted_draft_tokens: int = 0  # of those, accepted (each saves the model a step)
    seconds: float = 0.0  # time spent in step()
    # per step: (device blocks in use, blocks a max-length contiguous reservation would hold)
    timeline: list[tuple[int, int]] = field(default_factory=list)

    def count_prompt_tokens(self, out: SchedulerOutput) -> None:
        """The prompt tokens a successful step admitted, found cached and computed."""
        for request in out.admitted:
            if request.metrics.first_scheduled_step is None:
                request.metrics.first_scheduled_step = self.steps
                self.prompt_tokens += len(request.prompt)
                self.prompt_tokens_cached += request.metrics.num_cached_prompt_tokens
        for chunk in out.prefill:
            prompt_part = max(0, min(chunk.end, len(chunk.request.prompt)) - chunk.start)
            chunk.request.metrics.num_computed_prompt_tokens += prompt_part
            self.prompt_tokens_computed += prompt_part
            self.recomputed_tokens += chunk.count - prompt_part

    @property
    def draft_acceptance_rate(self) -> float | None:
        """Accepted drafts over drafted tokens; None before any draft."""
        if not self.draft_tokens:
            return None
        return self.accepted_draft_tokens / self.draft_tokens

    def count_drafts(self, verified) -> None:
        """The drafts a successful step verified (``Verified`` results)."""
        for result in verified:
            self.draft_tokens += result.drafted
            self.accepted_draft_tokens += result.accepted

    def record_step(self, scheduler, started: float) -> None:
        """A step that began at ``started`` (``time.perf_counter()``) ended: the pool's use and
        the scheduler's counts after it."""
        manager, counts = scheduler.block_manager, scheduler.stats
        self.steps += 1
        self.seconds += time.perf_counter() - started
        in_use = manager.num_device_blocks - manager.num_free_device_blocks()
        running = scheduler.running
        contiguous_slots = sum(
            r.params.num_seqs * (len(r.prompt) + r.params.max_new_tokens) for r in running
        )
        contiguous = -(-contiguous_slots // manager.block_size)
        saved = manager.blocks_saved_by_sharing()
        self.peak_blocks = max(self.peak_blocks, in_use)
        self.peak_contiguous_blocks = max(self.peak_contiguous_blocks, contiguous)
        self.peak_blocks_saved_by_sharing = max(self.peak_blocks_saved_by_sharing, saved)
        self.peak_running_requests = max(self.peak_running_requests, len(running))
        self.timeline.append((in_use, contiguous))
        self.cow_copies = counts.cow_copies
        self.swaps_out = counts.preemptions_by_swap
        self.swaps_in = counts.swaps_in
        self.blocks_swapped_out = counts.blocks_swapped_out
        self.blocks_swapped_in = counts.blocks_swapped_in
        self.preemptions_by_recompute = counts.preemptions_by_recompute
