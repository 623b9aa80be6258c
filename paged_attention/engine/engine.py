"""The engine facade: requests in, outputs out; a Scheduler plans each step, a ModelRunner runs
it, and the engine turns logits into tokens.

Sampling runs on the CPU in float32 with one ``torch.Generator`` per request, seeded from the
request's seed; a request's sequences are always scheduled, sampled and preempted together, so
its random draws happen in the same order however the batch around it is composed: the results
do not depend on the KV budget, on preemption, on prefix caching or on chunked prefill.
"""

from __future__ import annotations

import itertools
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from paged_attention.cache import default_num_host_blocks
from paged_attention.engine.detokenizer import IncrementalDetokenizer, backend_of
from paged_attention.engine.input_processor import InputProcessor, Prompt, RequestLimits
from paged_attention.engine.logprobs import output_logprobs, record_prompt_logprobs
from paged_attention.engine.model_runner import CompiledDecode, ModelRunner
from paged_attention.engine.request import (
    Request,
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


class Engine:
    """Continuous batching over a transformers causal LM with a KV budget of ``num_blocks``
    device blocks and ``num_host_blocks`` of host swap space (default: four times the budget on
    a GPU, none on a CPU, where host blocks would be more of the same RAM; 0: preemption
    recomputes instead of swapping).

    ``tokenizer`` (optional, a transformers tokenizer): prompts may then be text or chat
    messages, outputs carry text, and ``SamplingParams.stop`` strings apply.
    ``enable_prefix_caching`` (default on): a prompt whose leading full blocks are cached, by an
    earlier request or a running one, computes only the rest. ``max_num_batched_tokens`` (default
    no limit, else at least ``max_num_seqs``): the tokens one step computes, decodes first;
    longer prompts are prefilled in chunks over several steps. ``cuda_graphs`` (default: on for
    a model on one CUDA device, off for a tensor-parallel one): decode steps replay CUDA graphs
    captured per padded batch size. ``kv_cache_dtype`` (``"auto"`` or an fp8 format) with
    ``k_scale``/``v_scale`` as :class:`~paged_attention.cache.PagedKVCache` takes them (without
    them, each layer's scales are calibrated from the first step's keys and values).
    ``compile`` (default off; a CPU model): decode steps run through ``torch.compile`` instead,
    one graph per padded batch size, each compiled at its first step (a minute or more for a
    30-layer model on two cores), which pays back on a long-running server, not in a short run
    (docs/performance.md).
    Logits stay on the model's device; only sampled token ids come back to the host. Switches
    ``model`` to the ``"paged_attention"`` attention implementation.

    Outputs (docs/design.md, "Engine outputs"): every output a step produces is delivered
    exactly once, to the stream or ``generate`` call that owns its request, else to ``step()``,
    whoever drives the step. Outputs of one request that wait for delivery are merged into one
    (their new tokens and text joined), so a consumer that falls behind loses nothing.
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
        tokenizer=None,
        kv_cache_dtype: str = "auto",
        k_scale: float | None = None,
        v_scale: float | None = None,
        compile: bool = False,
    ) -> None:
        if not isinstance(compile, bool):
            raise ValueError(f"compile must be True or False, got {compile!r}")
        geometry = ModelGeometry.of(model)
        if cuda_graphs is None:  # not yet with tensor parallelism: graphs of NCCL not run here
            cuda_graphs = geometry.device.type == "cuda" and geometry.tensor_parallel.size == 1
        self.kv_cache = geometry.kv_cache(
            block_size,
            num_blocks,
            None,
            num_host_blocks=(
                default_num_host_blocks(num_blocks, geometry.device)
                if num_host_blocks is None
                else num_host_blocks
            ),
            kv_cache_dtype=kv_cache_dtype,
            k_scale=k_scale,
            v_scale=v_scale,
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
            compile_decode=compile,
            released=(self.block_manager.sliding_window, self.block_manager.attention_chunk_size),
        )
        self.tensor_parallel = geometry.tensor_parallel
        self.block_size = block_size
        embeddings = model.get_input_embeddings()
        positions = getattr(model.config.get_text_config(), "max_position_embeddings", None)
        self.limits = RequestLimits(
            vocab_size=getattr(embeddings, "num_embeddings", None) or model.config.vocab_size,
            max_model_len=positions,
            max_num_seqs=max_num_seqs,
        )
        """What a request may ask (checked once, by :attr:`input_processor`): the vocabulary,
        the model's context (``max_position_embeddings``; ``None`` if it sets none), the
        sequences one request may run."""
        self.input_processor = InputProcessor(
            tokenizer, self.limits, self.scheduler, self.runner.device
        )
        self.eos_token_ids = _end_tokens(model, eos_token_id)
        self.tokenizer = tokenizer
        self._tokenizer_backend = None if tokenizer is None else backend_of(tokenizer)
        self.stats = EngineStats()
        self._requests: dict[int, Request] = {}
        # Outputs not delivered yet, one (merged) per request, in the order they were produced.
        self._undelivered: dict[int, RequestOutput] = {}
        # The stream or generate() call that consumes a request's outputs (a weak reference: a
        # dropped stream's request is aborted at the next step).
        self._owners: dict[int, weakref.ref] = {}

    @property
    def max_model_len(self) -> int | None:
        """The most tokens (prompt and generated) a sequence may hold (``limits``)."""
        return self.limits.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.limits.vocab_size

    @property
    def max_num_seqs(self) -> int:
        return self.limits.max_num_seqs

    # ------------------------------------------------------------------ requests

    def compile_decode_steps(self) -> dict[int, float]:
        """With ``compile=True``: compiles the decode step of every padded batch size now, so
        that no request waits for a compile (a server calls this before it accepts requests);
        sizes already compiled are kept. Touches neither the cache nor any request. Returns the
        seconds each size's compile took."""
        if not isinstance(self.runner.graphs, CompiledDecode):
            raise ValueError("compile_decode_steps needs an engine built with compile=True")
        return self.runner.graphs.compile_all()

    def add_request(
        self,
        prompt: Prompt,
        params: SamplingParams,
        arrival_time: float | None = None,
    ) -> int:
        """Queue a request; returns its id. ``prompt``: token ids, or with a tokenizer a string
        or chat messages (``[{"role": ..., "content": ...}, ...]``, formatted by the tokenizer's
        chat template with the generation prompt added). ``arrival_time``
        (``time.perf_counter()`` seconds, default now) is what its time to first token is
        measured from. Raises ValueError, naming what is wrong, for a request that is malformed
        or could never run (longer than the model's context, or more blocks than the pool)."""
        request = self._new_request(prompt, params, arrival_time)
        self._admit(request)
        return request.request_id

    def abort(self, request_id: int) -> RequestOutput:
        """End a request wherever it is (waiting, running or swapped out), freeing every block
        it holds; returns its final output (finish reason ``"abort"`` for unfinished entries),
        which also holds what it produced and was not delivered yet. A stream of the request
        ends with that output."""
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
        output = self._output(request, finished=True)
        pending = self._undelivered.pop(request_id, None)
        if pending is not None:
            output = _merge(pending, output, request.params.is_beam_search)
        if self._owner(request_id) is not None:
            self._undelivered[request_id] = output  # for the stream that owns it
        else:
            self._owners.pop(request_id, None)
        return output

    def has_unfinished(self) -> bool:
        """Requests are waiting or running, or outputs wait to be returned by ``step()``."""
        return self.scheduler.has_unfinished() or any(
            self._owner(request_id) is None for request_id in self._undelivered
        )

    def generate(self, prompts: Sequence[Prompt], params) -> list[RequestOutput]:
        """Serve ``prompts`` to completion; final outputs in the order of the prompts. Every
        prompt and parameter set is checked before any is queued: all or nothing. If a step
        raises, the requests of this call are aborted before the exception propagates."""
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts and {len(params)} SamplingParams")
        requests = [self._new_request(p, s, None) for p, s in zip(prompts, params)]
        owner = _Consumer()
        for request in requests:
            self._admit(request, owner)
        results: dict[int, RequestOutput] = {}
        try:
            while len(results) < len(requests):
                self._run_step()
                for request in requests:
                    output = self._undelivered.get(request.request_id)
                    if output is not None and output.finished:
                        results[request.request_id] = self._undelivered.pop(request.request_id)
                        self._owners.pop(request.request_id, None)
        except BaseException:
            for request in requests:
                if request.request_id in self._requests:
                    self.abort(request.request_id)
                self._undelivered.pop(request.request_id, None)
                self._owners.pop(request.request_id, None)
            raise
        return [results[r.request_id] for r in requests]

    def stream(self, prompt: Prompt, params: SamplingParams) -> RequestStream:
        """Queue a request (now: a bad one raises here) and return an iterator over its outputs,
        one after every step that gives it tokens, the last one with ``finished`` set. Other
        requests keep running meanwhile; their outputs are returned by ``step()`` (or by their
        own stream). Closing the stream (``close()``, or leaving a ``with`` block) aborts the
        request if it has not finished; a stream dropped unfinished is aborted at the next
        step."""
        request = self._new_request(prompt, params, None)
        stream = RequestStream(self, request.request_id)
        self._admit(request, stream)
        return stream

    # ------------------------------------------------------------------ one step

    def step(self) -> list[RequestOutput]:
        """Schedule and run one packed forward pass. Returns an output for every request that
        no stream or ``generate`` call owns and that gained tokens, finished or was rejected in
        this step or in steps they drove, each delivered once. If the forward pass or sampling
        raises, the step's reservations are released first and nothing is lost: the engine is
        as it was before the step, outputs produced earlier stay for the next call, and
        ``step()`` may be called again."""
        self._run_step()
        outputs = []
        for request_id in list(self._undelivered):
            if self._owner(request_id) is None:
                outputs.append(self._undelivered.pop(request_id))
                self._owners.pop(request_id, None)
        return outputs

    def _run_step(self) -> None:
        """One step; its outputs go to ``_undelivered``."""
        started = time.perf_counter()
        self._abort_dropped_streams()
        out = self.scheduler.schedule()
        if self.tensor_parallel.checks_steps:
            self._check_plan_on_every_rank(out)
        for request, reason in out.rejected:  # final whether or not the forward pass succeeds
            self._deliver(self._rejection(request, reason))
        choices = None
        try:
            self.runner.execute_block_ops(out.block_ops)
            if out.chunks:
                logits = self.runner.run(out)
                choices = self._choose_tokens(out, logits)
        except BaseException:
            self.runner.execute_block_ops([("copy", self.scheduler.rollback(out))])
            raise
        self._count_prompt_tokens(out)
        if choices is not None:
            record_prompt_logprobs(out.chunks, logits)
        updated = self.scheduler.update_from_output(
            out,
            () if choices is None else choices.values(),
            self._finish_reason,
            self.eos_token_ids,
        )
        for output in self._outputs(updated):
            self._deliver(output)
        self._record(out, started)

    def _choose_tokens(self, out: SchedulerOutput, logits: torch.Tensor) -> dict:
        """Every sampling request's next tokens and every beam request's candidates, keyed by
        ``id(request)``, touching nothing but the requests' generators, which are restored if
        anything raises (a retried step then draws the same tokens)."""
        rows: dict[int, tuple[Request, list[int]]] = {}
        row = 0
        for chunk in out.chunks:
            if chunk.samples:
                rows.setdefault(id(chunk.request), (chunk.request, []))[1].append(row)
                row += 1
        sampled = [(r, rows) for r, rows in rows.values() if not r.params.is_beam_search]
        states = [(r.generator, r.generator.get_state()) for r, _ in sampled]
        try:
            choices = dict(
                zip((id(r) for r, _ in sampled), draw(logits, sampled, self.eos_token_ids))
            )
            for request, request_rows in rows.values():
                if request.params.is_beam_search:
                    end_tokens = self.eos_token_ids | set(request.params.stop_token_ids)
                    scores = [b.score for b in request.seqs]
                    width = request.params.beam_width
                    choices[id(request)] = beam_candidates(
                        logits[request_rows], scores, width, end_tokens
                    )
        except BaseException:
            for generator, state in states:
                generator.set_state(state)
            raise
        return {id(r): (r, choices[id(r)]) for r, _ in rows.values()}

    def _count_prompt_tokens(self, out: SchedulerOutput) -> None:
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

    def _outputs(self, updated: list[Request]) -> list[RequestOutput]:
        """The outputs of the requests a step gave tokens (and the end of those it finished)."""
        now, outputs = time.perf_counter(), []
        for request in updated:
            self.stats.generated_tokens += sum(map(len, request.new_tokens.values()))
            metrics = request.metrics
            metrics.token_times.append(now)
            if metrics.first_token_time is None:
                metrics.first_token_time = now
            finished = not request.seqs
            if finished:
                self._requests.pop(request.request_id, None)
                metrics.finished_time = now
                metrics.finished_step = self.stats.steps
            outputs.append(self._output(request, finished))
        return outputs

    # ------------------------------------------------------------------ delivery

    def _owner(self, request_id: int):
        ref = self._owners.get(request_id)
        return None if ref is None else ref()

    def _deliver(self, output: RequestOutput) -> None:
        pending = self._undelivered.pop(output.request_id, None)
        request = self._requests.get(output.request_id)
        beams = request is not None and request.params.is_beam_search
        self._undelivered[output.request_id] = (
            output if pending is None else _merge(pending, output, beams)
        )

    def _abort_dropped_streams(self) -> None:
        """A stream that was garbage-collected unfinished no longer consumes its request."""
        for request_id, ref in list(self._owners.items()):
            if ref() is None:
                del self._owners[request_id]
                self._undelivered.pop(request_id, None)
                if request_id in self._requests:
                    self.abort(request_id)
                    self._undelivered.pop(request_id, None)

    # ------------------------------------------------------------------ sampling

    def _finish_reason(self, request: Request, seq: EngineSequence) -> str | None:
        params = request.params
        token = seq.tokens[-1]
        stopped_by_string = False
        if self._tokenizer_backend is not None:
            text = request.detokenizers.get(seq.seq_id)
            if text is None:
                text = IncrementalDetokenizer(self._tokenizer_backend, params.stop)
                request.detokenizers[seq.seq_id] = text
            stopped_by_string = text.append(token, len(seq.tokens) >= params.min_tokens)
        if token in self.eos_token_ids and not params.ignore_eos:
            return "eos"
        if token in params.stop_token_ids or stopped_by_string:
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
        return self.input_processor.process(prompt, params, arrival_time)

    def _admit(self, request: Request, owner=None) -> None:
        self._requests[request.request_id] = request
        if owner is not None:
            self._owners[request.request_id] = weakref.ref(owner)
        self.scheduler.add(request)

    def _output(self, request: Request, finished: bool) -> RequestOutput:
        if request.params.is_beam_search:
            entries = request.done if finished else sorted(request.seqs, key=lambda b: -b.score)
        else:
            entries = sorted(request.seqs + request.done, key=lambda s: s.seq_id)  # sample order
        new_tokens = [request.new_tokens.get(s.seq_id, []) for s in entries]
        texts = new_texts = None
        if self.tokenizer is not None:
            if request.params.is_beam_search:  # beams reorder: each output has whole texts
                decode = self._tokenizer_backend.decode
                texts = [decode(s.tokens, skip_special_tokens=True) for s in entries]
                new_texts = [decode(t, skip_special_tokens=True) for t in new_tokens]
            else:
                texts, new_texts = [], []
                for seq in entries:
                    text = request.detokenizers.get(seq.seq_id)
                    if text is None:  # aborted before its first token
                        texts.append("")
                        new_texts.append("")
                        continue
                    stopped = text.stopped
                    new_texts.append(text.take_new(final=seq.finish_reason is not None))
                    texts.append(text.handed_out)
                    if text.stopped and not stopped and seq.finish_reason != "abort":
                        seq.finish_reason = "stop"  # the final text completed a stop string
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            outputs=[list(s.tokens) for s in entries],
            finish_reasons=[s.finish_reason for s in entries],
            new_tokens=new_tokens,
            finished=finished,
            metrics=request.metrics,
            texts=texts,
            new_texts=new_texts,
            **output_logprobs(request, entries, new_tokens),
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
            texts=None if self.tokenizer is None else [],
            new_texts=None if self.tokenizer is None else [],
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


def _end_tokens(model: torch.nn.Module, eos_token_id) -> frozenset[int]:
    """The tokens that end a sequence as ``"eos"``: ``eos_token_id`` (one id or several), by
    default the model's generation config's."""
    if eos_token_id is None:
        eos_token_id = model.generation_config.eos_token_id
    if eos_token_id is None:
        return frozenset()
    return frozenset([eos_token_id] if isinstance(eos_token_id, int) else eos_token_id)


def _merge(earlier: RequestOutput, later: RequestOutput, beams: bool) -> RequestOutput:
    """One output for two of the same request that wait for delivery: the later state, with
    both outputs' new tokens and text (beam search reorders its entries, so its later output
    stands alone: read its ``outputs``)."""
    if beams or len(earlier.new_tokens) != len(later.new_tokens):
        return later
    later.new_tokens = [a + b for a, b in zip(earlier.new_tokens, later.new_tokens)]
    if earlier.new_texts is not None and later.new_texts is not None:
        later.new_texts = [a + b for a, b in zip(earlier.new_texts, later.new_texts)]
    if earlier.new_logprobs is not None and later.new_logprobs is not None:
        later.new_logprobs = [a + b for a, b in zip(earlier.new_logprobs, later.new_logprobs)]
    return later


class _Consumer:
    """What a ``generate()`` call owns its requests by."""


class RequestStream:
    """The outputs of one request, as ``Engine.stream`` returns them: iterating drives the
    engine's steps until the request's next output is there. ``close()`` (or leaving a ``with``
    block) aborts the request if it has not finished."""

    def __init__(self, engine: Engine, request_id: int) -> None:
        self._engine = engine
        self.request_id = request_id
        self._done = False

    def __iter__(self) -> RequestStream:
        return self

    def __next__(self) -> RequestOutput:
        engine = self._engine
        while not self._done:
            output = engine._undelivered.pop(self.request_id, None)
            if output is not None:
                if output.finished:
                    self._done = True
                    engine._owners.pop(self.request_id, None)
                return output
            if self.request_id not in engine._requests:
                break  # ended by a path that delivered elsewhere
            engine._run_step()
        self._done = True
        raise StopIteration

    def close(self) -> None:
        if self._done:
            return
        self._done = True
        engine = self._engine
        engine._owners.pop(self.request_id, None)
        if self.request_id in engine._requests:
            engine.abort(self.request_id)
        engine._undelivered.pop(self.request_id, None)

    def __enter__(self) -> RequestStream:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
