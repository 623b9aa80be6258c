"""A small continuous-batching engine over a transformers causal LM with a paged KV cache.

Every ``step()`` runs one forward pass over a packed batch: the prompts of newly admitted
requests (prefill) and one token of every running sequence (decode), concatenated into a
single row. The scheduler works in request units, in this order each step:

1. Resume: swapped-out requests come back, oldest first, once the device pool has room for
   their blocks plus one new block per sequence.
2. Reserve: every running sequence gets a slot for its next token. If the pool is short, the
   most recently admitted running request is preempted: all its sequences are swapped to host
   memory together (their shared blocks move once and stay shared).
3. Admit: waiting requests are admitted first-come first-served while ``can_allocate`` says
   ``OK`` for the prompt; ``LATER`` makes them wait, ``NEVER`` rejects with the reason. Nothing
   new is admitted while a request is swapped out, so preempted requests are served first.

Parallel samples fork the prompt's blocks after the prefill; beam search forks a beam for
every extra child and frees the beams nobody picked; writing into a shared block copies it
first (copy-on-write, planned by the block manager). Sampling runs on the CPU in float32 with
one ``torch.Generator`` per request, seeded from the request's seed; a request's sequences are
always scheduled and preempted together, so its random draws happen in the same order however
the batch around it is composed, and the results do not depend on the KV budget.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from paged_attention.block_manager import AllocStatus, OutOfBlocksError
from paged_attention.integrations.transformers import (
    ATTN_IMPLEMENTATION,
    PagedCache,
    cache_argument_name,
)


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 16
    temperature: float = 0.0  # 0 means greedy
    top_p: float = 1.0
    n: int = 1  # parallel samples
    beam_width: int = 1  # beam search when > 1 (deterministic: needs temperature 0)
    seed: int = 0

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.n < 1 or self.beam_width < 1:
            raise ValueError(f"n and beam_width must be >= 1, got {self.n}, {self.beam_width}")
        if self.beam_width > 1 and (self.n > 1 or self.temperature > 0):
            raise ValueError("beam search (beam_width > 1) needs n = 1 and temperature = 0")

    @property
    def num_seqs(self) -> int:
        """Sequences the request runs at once."""
        return max(self.n, self.beam_width)


@dataclass
class RequestOutput:
    request_id: int
    prompt: list[int]
    outputs: list[list[int]]  # the n samples in order, or the beams best first
    finish_reasons: list[str]  # per output: "eos" or "length"
    rejected: str | None = None  # why the request was not served; None when it was


@dataclass
class EngineStats:
    steps: int = 0
    generated_tokens: int = 0  # tokens sampled, over all sequences
    peak_blocks: int = 0  # most device blocks in use at once
    peak_contiguous_blocks: int = 0  # most blocks a max-length contiguous reservation needed
    peak_blocks_saved_by_sharing: int = 0
    cow_copies: int = 0
    swaps_out: int = 0  # requests preempted to the host
    swaps_in: int = 0
    blocks_swapped_out: int = 0
    blocks_swapped_in: int = 0
    seconds: float = 0.0  # time spent in step()
    # per step: (device blocks in use, blocks a max-length contiguous reservation would hold)
    timeline: list[tuple[int, int]] = field(default_factory=list)


@dataclass
class _Sequence:
    seq_id: int
    tokens: list[int]  # generated tokens; the last one is not in the KV cache yet
    score: float = 0.0  # beam search: sum of log-probabilities
    finish_reason: str | None = None


@dataclass
class _Request:
    request_id: int
    prompt: list[int]
    params: SamplingParams
    generator: torch.Generator
    seqs: list[_Sequence] = field(default_factory=list)  # live sequences
    done: list[_Sequence] = field(default_factory=list)  # finished samples or beam hypotheses
    prefilled: bool = False


class Engine:
    """Continuous batching over ``model`` with a KV budget of ``num_blocks`` device blocks and
    ``num_host_blocks`` of swap space (default: four times the budget). Switches ``model`` to the
    ``"paged_attention"`` attention implementation."""

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        num_blocks: int,
        block_size: int = 16,
        num_host_blocks: int | None = None,
        max_num_seqs: int = 64,
        eos_token_id: int | Sequence[int] | None = None,
    ) -> None:
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
        self.model = model
        self.device = next(model.parameters()).device
        self.cache = PagedCache(
            model,
            block_size=block_size,
            num_blocks=num_blocks,
            num_host_blocks=4 * num_blocks if num_host_blocks is None else num_host_blocks,
        )
        self.manager = self.cache.manager
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        if eos_token_id is None:
            eos_token_id = model.generation_config.eos_token_id
        if eos_token_id is None:
            eos_token_id = []
        elif isinstance(eos_token_id, int):
            eos_token_id = [eos_token_id]
        self.eos_token_ids = frozenset(eos_token_id)
        self.stats = EngineStats()
        self._waiting: deque[_Request] = deque()
        self._running: list[_Request] = []  # in admission order
        self._swapped: deque[_Request] = deque()  # oldest admitted first
        self._request_ids = itertools.count()
        self._seq_ids = itertools.count()

    # ------------------------------------------------------------------ public

    def add_request(self, prompt: Sequence[int], params: SamplingParams) -> int:
        prompt = [int(t) for t in prompt]
        if not prompt:
            raise ValueError("prompt must hold at least one token")
        if params.num_seqs > self.max_num_seqs:
            raise ValueError(
                f"the request runs {params.num_seqs} sequences, more than "
                f"max_num_seqs={self.max_num_seqs}"
            )
        request_id = next(self._request_ids)
        generator = torch.Generator().manual_seed(params.seed)
        self._waiting.append(_Request(request_id, prompt, params, generator))
        return request_id

    def has_unfinished(self) -> bool:
        return bool(self._waiting or self._running or self._swapped)

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams]
    ) -> list[RequestOutput]:
        """Serve ``prompts`` to completion; outputs in the order of the prompts."""
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        ids = [self.add_request(p, s) for p, s in zip(prompts, params, strict=True)]
        results: dict[int, RequestOutput] = {}
        while self.has_unfinished():
            results.update((r.request_id, r) for r in self.step())
        return [results[i] for i in ids]

    def step(self) -> list[RequestOutput]:
        """Schedule and run one packed forward pass; returns the requests that ended."""
        started = time.perf_counter()
        ended: list[RequestOutput] = []
        self._resume_swapped()
        decoding = self._reserve_decode_slots(ended)
        prefilling = self._admit_waiting(ended)
        if decoding or prefilling:
            ended += self._run_model(prefilling, decoding)
        self._record(started)
        return ended

    # ------------------------------------------------------------------ scheduling

    def _resume_swapped(self) -> None:
        manager = self.manager
        while self._swapped:
            request = self._swapped[0]
            ids = [s.seq_id for s in request.seqs]
            host_blocks = {b for s in ids for b in manager.host_block_table(s)}
            # Room for its blocks and a new block per sequence, or it would be preempted again
            # (unless it runs alone: then it gets the whole pool, or is aborted if that is short).
            headroom = len(ids) if self._running else 0
            room = manager.num_free_device_blocks() - manager.watermark_blocks
            if room < len(host_blocks) + headroom:
                return
            pairs = manager.swap_in(ids)
            self.cache.kv.swap_in(pairs)
            self._swapped.popleft()
            self._running.append(request)  # older than everything admitted after it
            self.stats.swaps_in += 1
            self.stats.blocks_swapped_in += len(pairs)

    def _reserve_decode_slots(self, ended: list[RequestOutput]) -> list[_Request]:
        """Give every running sequence a slot for its next token, preempting the most
        recently admitted requests while the pool is short."""
        while self._running:
            ids = [s.seq_id for r in self._running for s in r.seqs]
            try:
                pairs = self.manager.decode_step(ids)[0]
            except OutOfBlocksError:
                victim = self._running.pop()
                if self._running:
                    self._swap_out(victim)
                else:  # alone with the whole pool and still short: it can never run
                    ended.append(self._abort(victim))
                continue
            if pairs:
                self.cache.kv.copy_blocks(pairs)
                self.stats.cow_copies += len(pairs)
            break
        return list(self._running)

    def _swap_out(self, request: _Request) -> None:
        ids = [s.seq_id for s in request.seqs]
        if not self.manager.can_swap_out(ids):
            raise RuntimeError(
                f"cannot preempt request {request.request_id}: the host swap space "
                f"({self.manager.num_host_blocks} blocks) is full; raise num_host_blocks"
            )
        pairs = self.manager.swap_out(ids)
        self.cache.kv.swap_out(pairs)
        self._swapped.appendleft(request)  # older than every request already swapped out
        self.stats.swaps_out += 1
        self.stats.blocks_swapped_out += len(pairs)

    def _abort(self, request: _Request) -> RequestOutput:
        self.manager.free_many(s.seq_id for s in request.seqs)
        return self._rejection(
            request,
            f"its {len(request.seqs)} sequences outgrew the whole KV budget "
            f"({self.manager.num_device_blocks} blocks)",
        )

    def _admit_waiting(self, ended: list[RequestOutput]) -> list[_Request]:
        manager = self.manager
        admitted = []
        running_seqs = sum(len(r.seqs) for r in self._running)
        while self._waiting and not self._swapped:
            request = self._waiting[0]
            prompt_len, params = len(request.prompt), request.params
            if running_seqs + params.num_seqs > self.max_num_seqs:
                break
            # The cache holds prompt + max_new_tokens - 1 tokens at most (the last is never fed).
            longest = prompt_len + params.max_new_tokens - 1
            status = manager.can_allocate(request.prompt)
            if status is AllocStatus.NEVER or manager.can_allocate(longest) is AllocStatus.NEVER:
                self._waiting.popleft()
                ended.append(
                    self._rejection(
                        request,
                        f"a sequence of {longest} tokens needs "
                        f"{-(-longest // self.block_size)} blocks of {self.block_size}; the "
                        f"pool has {manager.num_device_blocks} "
                        f"({manager.watermark_blocks} held back as watermark)",
                    )
                )
                continue
            if status is AllocStatus.LATER:
                break
            self._waiting.popleft()
            seq = _Sequence(next(self._seq_ids), [])
            manager.allocate(seq.seq_id, request.prompt)
            request.seqs.append(seq)
            self._running.append(request)
            admitted.append(request)
            running_seqs += params.num_seqs
        return admitted

    # ------------------------------------------------------------------ model

    def _run_model(
        self, prefilling: list[_Request], decoding: list[_Request]
    ) -> list[RequestOutput]:
        seq_ids, counts, inputs, positions = [], [], [], []
        for request in prefilling:
            seq_ids.append(request.seqs[0].seq_id)
            counts.append(len(request.prompt))
            inputs += request.prompt
            positions += range(len(request.prompt))
        for request in decoding:
            for seq in request.seqs:
                seq_ids.append(seq.seq_id)
                counts.append(1)
                inputs.append(seq.tokens[-1])
                positions.append(self.manager.num_tokens(seq.seq_id) - 1)
        last_token_rows = torch.tensor(counts).cumsum(0) - 1

        self.cache.set_step(seq_ids, counts)
        try:
            with torch.inference_mode():
                logits = self.model(
                    input_ids=torch.tensor([inputs], device=self.device),
                    position_ids=torch.tensor([positions], device=self.device),
                    **{cache_argument_name(self.model): self.cache},
                    use_cache=True,
                    logits_to_keep=last_token_rows.to(self.device),
                ).logits[0]
        finally:
            self.cache.clear_step()
        logits = logits.float().cpu()

        ended = []
        row = 0
        for request in prefilling + decoding:
            rows = logits[row : row + len(request.seqs)]
            row += len(request.seqs)
            if request.params.beam_width > 1:
                self._beam_step(request, rows)
            else:
                self._sample_step(request, rows)
            request.prefilled = True
            if not request.seqs:
                self._running.remove(request)
                ended.append(self._finished(request))
        return ended

    def _sample_step(self, request: _Request, logits: torch.Tensor) -> None:
        params = request.params
        if not request.prefilled:  # one prompt row: every sample draws from it
            logits = logits.expand(params.n, -1)
        tokens = _sample(logits, params, request.generator).tolist()
        if not request.prefilled:
            parent = request.seqs[0].seq_id
            children = [_Sequence(next(self._seq_ids), []) for _ in range(params.n - 1)]
            self.manager.fork_many([parent] * len(children), [c.seq_id for c in children])
            request.seqs += children
        for seq, token in zip(request.seqs, tokens):
            seq.tokens.append(token)
            self._check_finished(seq, params)
        self.stats.generated_tokens += len(tokens)
        self._retire_finished(request)

    def _beam_step(self, request: _Request, logits: torch.Tensor) -> None:
        """Keep the ``beam_width`` best continuations; a continuation ending in EOS becomes a
        finished hypothesis if it ranks among them. Stops when ``beam_width`` hypotheses are
        finished or the beams reach ``max_new_tokens``."""
        params, beams = request.params, request.seqs
        width = params.beam_width
        scores = torch.tensor([b.score for b in beams])[:, None] + logits.log_softmax(-1)
        top_scores, top = scores.flatten().topk(min(2 * width, scores.numel()))
        vocab = logits.shape[-1]
        chosen: list[tuple[_Sequence, int, float]] = []
        for rank, (score, index) in enumerate(zip(top_scores.tolist(), top.tolist())):
            parent, token = beams[index // vocab], index % vocab
            if token in self.eos_token_ids:
                if rank < width:  # a finished hypothesis holds no blocks: seq_id -1
                    tokens = [*parent.tokens, token]
                    request.done.append(_Sequence(-1, tokens, score, "eos"))
            elif len(chosen) < width:
                chosen.append((parent, token, score))

        # A parent's first child keeps its sequence, later children fork it; the beams
        # nobody picked are freed. Copy-on-write of shared last blocks happens next step.
        next_beams, reused, parents, forks = [], set(), [], []
        for parent, token, score in chosen:
            seq_id = parent.seq_id
            if seq_id in reused:
                seq_id = next(self._seq_ids)
                parents.append(parent.seq_id)
                forks.append(seq_id)
            reused.add(seq_id)
            next_beams.append(_Sequence(seq_id, [*parent.tokens, token], score))
        self.manager.fork_many(parents, forks)
        self.manager.free_many(b.seq_id for b in beams if b.seq_id not in reused)
        request.seqs = next_beams
        self.stats.generated_tokens += len(next_beams)

        finished_early = len(request.done) >= width
        if finished_early or len(next_beams[0].tokens) == params.max_new_tokens:
            self.manager.free_many(b.seq_id for b in next_beams)
            if not finished_early:
                for beam in next_beams:
                    beam.finish_reason = "length"
                request.done += next_beams
            request.done.sort(key=lambda b: b.score / len(b.tokens), reverse=True)
            del request.done[width:]
            request.seqs = []

    def _check_finished(self, seq: _Sequence, params: SamplingParams) -> None:
        if seq.tokens[-1] in self.eos_token_ids:
            seq.finish_reason = "eos"
        elif len(seq.tokens) == params.max_new_tokens:
            seq.finish_reason = "length"

    def _retire_finished(self, request: _Request) -> None:
        finished = [s for s in request.seqs if s.finish_reason is not None]
        self.manager.free_many(s.seq_id for s in finished)
        request.done += finished
        request.seqs = [s for s in request.seqs if s.finish_reason is None]

    # ------------------------------------------------------------------ results and stats

    @staticmethod
    def _finished(request: _Request) -> RequestOutput:
        if request.params.beam_width == 1:
            request.done.sort(key=lambda s: s.seq_id)  # sample order
        return RequestOutput(
            request.request_id,
            request.prompt,
            [s.tokens for s in request.done],
            [s.finish_reason for s in request.done],
        )

    @staticmethod
    def _rejection(request: _Request, reason: str) -> RequestOutput:
        return RequestOutput(request.request_id, request.prompt, [], [], rejected=reason)

    def _record(self, started: float) -> None:
        stats, manager = self.stats, self.manager
        stats.steps += 1
        stats.seconds += time.perf_counter() - started
        in_use = manager.num_device_blocks - manager.num_free_device_blocks()
        contiguous_slots = sum(
            r.params.num_seqs * (len(r.prompt) + r.params.max_new_tokens) for r in self._running
        )
        contiguous = -(-contiguous_slots // self.block_size)
        saved = manager.stats().device.blocks_saved_by_sharing
        stats.peak_blocks = max(stats.peak_blocks, in_use)
        stats.peak_contiguous_blocks = max(stats.peak_contiguous_blocks, contiguous)
        stats.peak_blocks_saved_by_sharing = max(stats.peak_blocks_saved_by_sharing, saved)
        stats.timeline.append((in_use, contiguous))


def _sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator):
    """One token per row of float32 CPU ``logits``."""
    if params.temperature == 0:
        return logits.argmax(-1)
    probs = (logits / params.temperature).softmax(-1)
    if params.top_p < 1:
        sorted_probs, order = probs.sort(-1, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (always the most likely token).
        outside = sorted_probs.cumsum(-1) - sorted_probs >= params.top_p
        sorted_probs[outside] = 0
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return torch.multinomial(probs, 1, generator=generator)[:, 0]
