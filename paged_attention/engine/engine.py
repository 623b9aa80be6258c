"""The engine facade: requests in, outputs out; a Scheduler plans each step, a ModelRunner runs
it, and the engine turns logits into tokens.

Sampling runs on the CPU in float32 with one ``torch.Generator`` per request, seeded from the
request's seed; a request's sequences are always scheduled, sampled and preempted together, so
its random draws happen in the same order however the batch around it is composed: the results
do not depend on the KV budget, on preemption, on prefix caching or on chunked prefill.
"""

from __future__ import annotations

import itertools
import numbers
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

from paged_attention.engine.model_runner import ModelRunner
from paged_attention.engine.request import (
    Request,
    RequestMetrics,
    RequestOutput,
    SamplingParams,
)
from paged_attention.engine.request import Sequence as EngineSequence
from paged_attention.engine.sampler import beam_candidates, draw
from paged_attention.engine.scheduler import Scheduler, SchedulerOutput
from paged_attention.geometry import ModelGeometry


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
    seconds: float = 0.0  # time spent in step()
    # per step: (device blocks in use, blocks a max-length contiguous reservation would hold)
    timeline: list[tuple[int, int]] = field(default_factory=list)


def _token_list(prompt) -> list[int]:
    tokens = prompt.tolist() if hasattr(prompt, "tolist") else list(prompt)
    for token in tokens:
        if isinstance(token, bool) or not isinstance(token, numbers.Integral):
            raise ValueError(f"prompt tokens must be integers, got {token!r}")
    return [int(t) for t in tokens]


class Engine:
    """Continuous batching over a transformers causal LM with a KV budget of ``num_blocks``
    device blocks and ``num_host_blocks`` of swap space (default: four times the budget; 0:
    preemption recomputes instead of swapping).

    ``enable_prefix_caching`` (default on): a prompt whose leading full blocks are cached, by an
    earlier request or a running one, computes only the rest. ``max_num_batched_tokens`` (default
    no limit, else at least ``max_num_seqs``): the tokens one step computes, decodes first;
    longer prompts are prefilled in chunks over several steps. ``cuda_graphs`` (default: on for
    a model on one CUDA device, off for a tensor-parallel one): decode steps replay CUDA graphs
    captured per padded batch size.
    Logits stay on the model's device; only sampled token ids come back to the host. Switches
    ``model`` to the ``"paged_attention"`` attention implementation.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        num_blocks: int,
        block_size: int = 16,
        num_host_blocks: int | None = None,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int | None = None,
        enable_prefix_caching: bool = True,
        eos_token_id: int | Sequence[int] | None = None,
        cuda_graphs: bool | None = None,
    ) -> None:
        geometry = ModelGeometry.of(model)
        if cuda_graphs is None:  # not yet with tensor parallelism: graphs of NCCL not run here
            cuda_graphs = geometry.device.type == "cuda" and geometry.tensor_parallel.size == 1
        self.kv_cache = geometry.kv_cache(
            block_size,
            num_blocks,
            None,
            num_host_blocks=4 * num_blocks if num_host_blocks is None else num_host_blocks,
        )
        self.block_manager = geometry.block_manager(self.kv_cache, enable_prefix_caching)
        self.scheduler = Scheduler(
            self.block_manager,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
        )
        self.model = model
        self.runner = ModelRunner(
            model,
            geometry,
            self.kv_cache,
            decode_graphs=cuda_graphs,
            max_num_seqs=max_num_seqs,
            block_manager=self.block_manager,
        )
        self.tensor_parallel = geometry.tensor_parallel
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        embeddings = model.get_input_embeddings()
        self.vocab_size = getattr(embeddings, "num_embeddings", None) or model.config.vocab_size
        if eos_token_id is None:
            eos_token_id = model.generation_config.eos_token_id
        if eos_token_id is None:
            eos_token_id = []
        elif isinstance(eos_token_id, int):
            eos_token_id = [eos_token_id]
        self.eos_token_ids = frozenset(eos_token_id)
        self.stats = EngineStats()
        self._requests: dict[int, Request] = {}
        self._request_ids = itertools.count()
        self._unclaimed: list[RequestOutput] = []  # final outputs stream()/generate() passed by

    # ------------------------------------------------------------------ requests

    def add_request(
        self, prompt: Sequence[int], params: SamplingParams, arrival_time: float | None = None
    ) -> int:
        """Queue a request; returns its id. ``arrival_time`` (``time.perf_counter()`` seconds,
        default now) is what its time to first token is measured from."""
        request = self._new_request(prompt, params, arrival_time)
        self._admit(request)
        return request.request_id

    def abort(self, request_id: int) -> RequestOutput:
        """End a request wherever it is (waiting, running or swapped out), freeing every block
        it holds; returns its final output (finish reason ``"abort"`` for unfinished entries)."""
        request = self._requests.pop(request_id, None)
        if request is None:
            raise ValueError(f"unknown or finished request {request_id}")
        self.scheduler.finish(request)
        for seq in request.seqs:
            seq.finish_reason = "abort"
        request.done += request.seqs
        request.seqs = []
        request.new_tokens = {}
        request.metrics.finished_time = time.perf_counter()
        return self._output(request, finished=True)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams]
    ) -> list[RequestOutput]:
        """Serve ``prompts`` to completion; final outputs in the order of the prompts. Every
        prompt and parameter set is checked before any is queued: all or nothing."""
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts and {len(params)} SamplingParams")
        requests = [self._new_request(p, s, None) for p, s in zip(prompts, params)]
        for request in requests:
            self._admit(request)
        wanted = {r.request_id for r in requests}
        results: dict[int, RequestOutput] = {}
        while len(results) < len(wanted):
            for output in self.step():
                if not output.finished:
                    continue
                if output.request_id in wanted:
                    results[output.request_id] = output
                else:
                    self._unclaimed.append(output)
        return [results[r.request_id] for r in requests]

    def stream(self, prompt: Sequence[int], params: SamplingParams) -> Iterator[RequestOutput]:
        """Queue a request and yield its output after every step that gives it tokens, the last
        one with ``finished`` set. Other requests keep running meanwhile; their final outputs
        are returned by the next ``step()``."""
        request_id = self.add_request(prompt, params)
        while True:
            for output in self.step():
                if output.request_id != request_id:
                    if output.finished:
                        self._unclaimed.append(output)
                    continue
                yield output
                if output.finished:
                    return

    # ------------------------------------------------------------------ one step

    def step(self) -> list[RequestOutput]:
        """Schedule and run one packed forward pass. Returns an output for every request that
        gained tokens, finished or was rejected in it (and the final outputs ``stream`` and
        ``generate`` left). If the forward pass raises, the step's reservations are released
        first: the engine is as it was before the step and ``step()`` may be called again."""
        started = time.perf_counter()
        outputs, self._unclaimed = self._unclaimed, []
        out = self.scheduler.schedule()
        if self.tensor_parallel.checks_steps:
            self._check_plan_on_every_rank(out)
        for request, reason in out.rejected:
            outputs.append(self._rejection(request, reason))
        logits = None
        try:
            self.runner.execute_block_ops(out.block_ops)
            if out.chunks:
                logits = self.runner.run(out, self.block_manager)
        except BaseException:
            self.runner.execute_block_ops([("copy", self.scheduler.rollback(out))])
            raise
        self.scheduler.commit(out)
        if logits is not None:
            outputs += self._after_forward(out, logits)
        self._record(out, started)
        return outputs

    def _after_forward(self, out: SchedulerOutput, logits: torch.Tensor) -> list[RequestOutput]:
        step = self.stats.steps
        for request in out.admitted:
            if request.metrics.first_scheduled_step is None:
                request.metrics.first_scheduled_step = step
                self.stats.prompt_tokens += len(request.prompt)
                self.stats.prompt_tokens_cached += request.metrics.num_cached_prompt_tokens
        for chunk in out.prefill:
            prompt_part = max(0, min(chunk.end, len(chunk.request.prompt)) - chunk.start)
            chunk.request.metrics.num_computed_prompt_tokens += prompt_part
            self.stats.prompt_tokens_computed += prompt_part
            self.stats.recomputed_tokens += chunk.count - prompt_part
        rows: dict[int, tuple[Request, list[int]]] = {}
        row = 0
        for chunk in out.chunks:
            if chunk.samples:
                rows.setdefault(id(chunk.request), (chunk.request, []))[1].append(row)
                row += 1
        sampled = [(r, rows) for r, rows in rows.values() if not r.params.is_beam_search]
        drawn = dict(zip((id(r) for r, _ in sampled), draw(logits, sampled)))
        now = time.perf_counter()
        outputs = []
        for request, request_rows in rows.values():
            request.new_tokens = {}
            if request.params.is_beam_search:
                self._beam_step(request, logits[request_rows])
            else:
                self._sample_step(request, drawn[id(request)])
            metrics = request.metrics
            metrics.token_times.append(now)
            if metrics.first_token_time is None:
                metrics.first_token_time = now
            finished = not request.seqs
            if finished:
                self.scheduler.finish(request)
                self._requests.pop(request.request_id, None)
                metrics.finished_time = now
                metrics.finished_step = step
            outputs.append(self._output(request, finished))
        return outputs

    # ------------------------------------------------------------------ sampling

    def _sample_step(self, request: Request, tokens: list[int]) -> None:
        params = request.params
        first = len(request.seqs) == 1 and not request.seqs[0].tokens
        if first and params.n > 1:  # the samples fork from the prompt
            parent = request.seqs[0]
            children = [self.scheduler.new_sequence(parent) for _ in range(params.n - 1)]
            self.scheduler.fork(request, [parent] * len(children), children)
            request.seqs += children
        for seq, token in zip(request.seqs, tokens):
            seq.tokens.append(token)
            request.new_tokens[seq.seq_id] = [token]
            seq.finish_reason = self._finish_reason(seq, params)
        self.stats.generated_tokens += len(tokens)
        finished = [s for s in request.seqs if s.finish_reason is not None]
        self.scheduler.free(finished)
        request.done += finished
        request.seqs = [s for s in request.seqs if s.finish_reason is None]

    def _beam_step(self, request: Request, logits: torch.Tensor) -> None:
        """Keep the ``beam_width`` best continuations; a continuation ending in an end token
        becomes a finished hypothesis if it ranks among them. Stops when ``beam_width``
        hypotheses are finished or the beams reach ``max_new_tokens``."""
        params, beams = request.params, request.seqs
        width = params.beam_width
        continuing, finished = beam_candidates(
            logits, [b.score for b in beams], width, self.eos_token_ids | set(params.stop_token_ids)
        )
        for beam, token, score in finished:  # a finished hypothesis holds no blocks: seq_id -1
            reason = "eos" if token in self.eos_token_ids else "stop"
            request.done.append(EngineSequence(-1, [*beams[beam].tokens, token], 0, score, reason))
        # A parent's first child keeps its sequence, later children fork it; the beams nobody
        # picked are freed. Copy-on-write of shared last blocks happens in the next step.
        ids = self.scheduler.reassign(beams, [beam for beam, _, _ in continuing])
        next_beams = [
            EngineSequence(seq_id, [*beams[beam].tokens, token], beams[beam].num_computed, score)
            for seq_id, (beam, token, score) in zip(ids, continuing)
        ]
        request.seqs = next_beams
        request.new_tokens = {b.seq_id: [b.tokens[-1]] for b in next_beams}
        self.stats.generated_tokens += len(next_beams)

        finished_early = len(request.done) >= width
        if finished_early or not next_beams or len(next_beams[0].tokens) == params.max_new_tokens:
            self.scheduler.free(next_beams)
            if not finished_early:
                for beam in next_beams:
                    beam.finish_reason = "length"
                request.done += next_beams
            request.done.sort(key=lambda b: b.score / len(b.tokens), reverse=True)
            del request.done[width:]
            request.seqs = []

    def _finish_reason(self, seq: EngineSequence, params: SamplingParams) -> str | None:
        token = seq.tokens[-1]
        if token in self.eos_token_ids:
            return "eos"
        if token in params.stop_token_ids:
            return "stop"
        if len(seq.tokens) == params.max_new_tokens:
            return "length"
        return None

    # ------------------------------------------------------------------ helpers

    def _check_plan_on_every_rank(self, out: SchedulerOutput) -> None:
        """Tensor parallel, under PAGED_ATTENTION_DEBUG_CHECKS=1: every rank's scheduler chose
        the same rejections, chunks (with the tokens they feed), copies and swaps."""
        plan = [torch.tensor([request.request_id for request, _ in out.rejected])]
        for chunk in out.chunks:
            tokens = chunk.request.token_slice(chunk.seq, chunk.start, chunk.end)
            plan.append(torch.tensor([chunk.seq.seq_id, chunk.start, chunk.count, *tokens]))
        for kind, pairs in out.block_ops:
            code = ("copy", "swap_out", "swap_in").index(kind)
            plan.append(torch.tensor([code, *itertools.chain.from_iterable(pairs)]))
        self.tensor_parallel.check_same_on_every_rank("the engine step's plan", plan)

    def _new_request(self, prompt, params, arrival_time: float | None) -> Request:
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        tokens = _token_list(prompt)
        if not tokens:
            raise ValueError("prompt must hold at least one token")
        outside = [t for t in tokens if not 0 <= t < self.vocab_size]
        if outside:
            raise ValueError(
                f"prompt token {outside[0]} is outside the model's vocabulary [0, "
                f"{self.vocab_size})"
            )
        if params.num_seqs > self.max_num_seqs:
            raise ValueError(
                f"the request runs {params.num_seqs} sequences, more than "
                f"max_num_seqs={self.max_num_seqs}"
            )
        return Request(
            request_id=next(self._request_ids),
            prompt=tokens,
            params=params,
            generator=torch.Generator(device=self.runner.device).manual_seed(params.seed),
            metrics=RequestMetrics(time.perf_counter() if arrival_time is None else arrival_time),
        )

    def _admit(self, request: Request) -> None:
        self._requests[request.request_id] = request
        self.scheduler.add(request)

    def _output(self, request: Request, finished: bool) -> RequestOutput:
        if request.params.is_beam_search:
            entries = request.done if finished else sorted(request.seqs, key=lambda b: -b.score)
        else:
            entries = sorted(request.seqs + request.done, key=lambda s: s.seq_id)  # sample order
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            outputs=[list(s.tokens) for s in entries],
            finish_reasons=[s.finish_reason for s in entries],
            new_tokens=[request.new_tokens.get(s.seq_id, []) for s in entries],
            finished=finished,
            metrics=request.metrics,
        )

    def _rejection(self, request: Request, reason: str) -> RequestOutput:
        self._requests.pop(request.request_id, None)
        request.metrics.finished_time = time.perf_counter()
        return RequestOutput(
            request.request_id,
            request.prompt,
            [],
            [],
            finished=True,
            rejected=reason,
            metrics=request.metrics,
        )

    def _record(self, out: SchedulerOutput, started: float) -> None:
        stats, manager, counts = self.stats, self.block_manager, self.scheduler.stats
        stats.steps += 1
        stats.seconds += time.perf_counter() - started
        in_use = manager.num_device_blocks - manager.num_free_device_blocks()
        running = self.scheduler.running
        contiguous_slots = sum(
            r.params.num_seqs * (len(r.prompt) + r.params.max_new_tokens) for r in running
        )
        contiguous = -(-contiguous_slots // self.block_size)
        saved = manager.stats().device.blocks_saved_by_sharing
        stats.peak_blocks = max(stats.peak_blocks, in_use)
        stats.peak_contiguous_blocks = max(stats.peak_contiguous_blocks, contiguous)
        stats.peak_blocks_saved_by_sharing = max(stats.peak_blocks_saved_by_sharing, saved)
        stats.peak_running_requests = max(stats.peak_running_requests, len(running))
        stats.timeline.append((in_use, contiguous))
        stats.cow_copies = counts.cow_copies
        stats.swaps_out = counts.preemptions_by_swap
        stats.swaps_in = counts.swaps_in
        stats.blocks_swapped_out = counts.blocks_swapped_out
        stats.blocks_swapped_in = counts.blocks_swapped_in
        stats.preemptions_by_recompute = counts.preemptions_by_recompute
