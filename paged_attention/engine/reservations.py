"""Reserving a request's next chunks of prompt (or recomputed) tokens in the block manager,
within a step's token budget: all of a request's chunks or none, and undoing reservations whose
forward pass never ran. The scheduler's helper for admission and chunked prefill."""

from __future__ import annotations

from paged_attention.engine.plan import ScheduledChunk, SchedulerOutput, SchedulerStats
from paged_attention.engine.request import Request
from paged_attention.kv.block_manager import AllocStatus, BlockManager, OutOfBlocksError
from paged_attention.kv.state_pool import StatefulBlockManager


class ChunkReserver:
    """Reserves chunks in ``manager``, counting the copy-on-write copies in ``stats``."""

    def __init__(self, manager: BlockManager, stats: SchedulerStats) -> None:
        self.manager = manager
        self.stats = stats

    def reserve(
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
        ``blocks_needed`` counted. With a manager that keeps conv and recurrent states
        (:class:`~paged_attention.kv.state_pool.StatefulBlockManager`), the first sequence
        stops at the end of the prompt until every other one has forked: they copy its state
        there (a state cannot be cut back to the prompt)."""
        manager = self.manager
        leader = request.seqs[0]
        prompt = len(request.prompt)
        reserved: list[ScheduledChunk] = []
        pairs: list[tuple[int, int]] = []
        holds_state_at_prompt = isinstance(manager, StatefulBlockManager) and any(
            not manager.has_seq(s.seq_id) for s in request.seqs[1:]
        )
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
                if holds_state_at_prompt and seq is leader:
                    count = min(count, max(prompt - start, 0))
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
            pairs += self.release(reserved)
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
        pair = self.manager.cached_copy_of_last_block(chunk.seq.seq_id)
        if pair is None or pair[0] in out.blocks_computed:
            return []
        chunk.start, chunk.count = chunk.end - 1, 1
        return [pair]

    def release(self, chunks: list[ScheduledChunk]) -> list[tuple[int, int]]:
        """Undo the reservations of ``chunks``, last first; their tokens were never computed,
        so blocks they registered in the prefix cache leave it. Returns the copies to make."""
        pairs = []
        for chunk in reversed(chunks):
            if chunk.allocated:
                self.manager.free(chunk.seq.seq_id, cache=False)
            else:
                pairs += self.manager.truncate(chunk.seq.seq_id, chunk.start, cache=False)
        return pairs
