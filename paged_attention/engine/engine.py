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
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Union

import torch

from paged_attention.cache import default_num_host_blocks
from paged_attention.engine.detokenizer import IncrementalDetokenizer, backend_of
from paged_attention.engine.model_runner import CompiledDecode, ModelRunner
from paged_attention.engine.request import (
    Request,
    RequestError,
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
            block_manager=self.block_manager,
            compile_decode=compile,
        )
        self.tensor_parallel = geometry.tensor_parallel
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        embeddings = model.get_input_embeddings()
        self.vocab_size = getattr(embeddings, "num_embeddings", None) or model.config.vocab_size
        config = model.config.get_text_config()
        positions = getattr(config, "max_position_embeddings", None)
        self.max_model_len: int | None = positions
        """The most tokens (prompt and generated) a sequence may hold: the model's
        ``max_position_embeddings`` (``None`` if it sets none)."""
        if eos_token_id is None:
            eos_token_id = model.generation_config.eos_token_id
        if eos_token_id is None:
            eos_token_id = []
        elif isinstance(eos_token_id, int):
            eos_token_id = [eos_token_id]
        self.eos_token_ids = frozenset(eos_token_id)
        self.tokenizer = tokenizer
        self._tokenizer_backend = None if tokenizer is None else backend_of(tokenizer)
        self.stats = EngineStats()
        self._requests: dict[int, Request] = {}
        self._request_ids = itertools.count()
        # Outputs not delivered yet, one (merged) per request, in the order they were produced.
        self._undelivered: dict[int, RequestOutput] = {}
        # The stream or generate() call that consumes a request's outputs (a weak reference: a
        # dropped stream's request is aborted at the next step).
        self._owners: dict[int, weakref.ref] = {}

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
                logits = self.runner.run(out, self.block_manager)
                choices = self._choose_tokens(out, logits)
        except BaseException:
            self.runner.execute_block_ops([("copy", self.scheduler.rollback(out))])
            raise
        self.scheduler.commit(out)
        if choices is not None:
            for output in self._apply_tokens(out, choices):
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
            choices = dict(zip((id(r) for r, _ in sampled), draw(logits, sampled)))
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

    def _apply_tokens(self, out: SchedulerOutput, choices: dict) -> list[RequestOutput]:
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
        now = time.perf_counter()
        outputs = []
        for request, choice in choices.values():
            request.new_tokens = {}
            if request.params.is_beam_search:
                self._beam_step(request, *choice)
            else:
                self._sample_step(request, choice)
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
            seq.finish_reason = self._finish_reason(request, seq)
        self.stats.generated_tokens += len(tokens)
        finished = [s for s in request.seqs if s.finish_reason is not None]
        self.scheduler.free(finished)
        request.done += finished
        request.seqs = [s for s in request.seqs if s.finish_reason is None]

    def _beam_step(self, request: Request, continuing, finished) -> None:
        """Keep the ``beam_width`` best continuations; a continuation ending in an end token
        becomes a finished hypothesis if it ranks among them. Stops when ``beam_width``
        hypotheses are finished or the beams reach ``max_new_tokens``."""
        params, beams = request.params, request.seqs
        width = params.beam_width
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

    def _finish_reason(self, request: Request, seq: EngineSequence) -> str | None:
        params = request.params
        token = seq.tokens[-1]
        stopped_by_string = False
        if self._tokenizer_backend is not None:
            text = request.detokenizers.get(seq.seq_id)
            if text is None:
                text = IncrementalDetokenizer(self._tokenizer_backend, params.stop)
                request.detokenizers[seq.seq_id] = text
            stopped_by_string = text.append(token)
        if token in self.eos_token_ids:
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
        if not isinstance(params, SamplingParams):
            raise RequestError(
                f"params must be SamplingParams, got {type(params).__name__}", "params"
            )
        if params.stop and self.tokenizer is None:
            raise RequestError(
                "stop strings need an engine with a tokenizer (Engine(tokenizer=...))", "stop"
            )
        tokens = self._prompt_ids(prompt)
        if not tokens:
            raise RequestError("prompt must hold at least one token", "prompt")
        outside = [t for t in tokens if not 0 <= t < self.vocab_size]
        if outside:
            raise RequestError(
                f"prompt token {outside[0]} is outside the model's vocabulary [0, "
                f"{self.vocab_size})",
                "prompt",
            )
        if params.num_seqs > self.max_num_seqs:
            raise RequestError(
                f"the request runs {params.num_seqs} sequences, more than "
                f"max_num_seqs={self.max_num_seqs}",
                "beam_width" if params.is_beam_search else "n",
            )
        wanted = len(tokens) + params.max_new_tokens
        if self.max_model_len is not None and wanted > self.max_model_len:
            raise RequestError(
                f"the prompt ({len(tokens)} tokens) and max_new_tokens ({params.max_new_tokens}) "
                f"need {wanted} positions; the model's context holds {self.max_model_len}",
                "prompt" if len(tokens) >= self.max_model_len else "max_new_tokens",
                limit="context",
            )
        request = Request(
            request_id=next(self._request_ids),
            prompt=tokens,
            params=params,
            generator=torch.Generator(device=self.runner.device).manual_seed(params.seed),
            metrics=RequestMetrics(time.perf_counter() if arrival_time is None else arrival_time),
        )
        reason = self.scheduler.rejection_reason(request)
        if reason is not None:
            prompt_blocks = -(-(len(tokens) + 1) // self.block_size)
            raise RequestError(
                f"the request can never run in this engine's KV cache: {reason}",
                "prompt"
                if prompt_blocks > self.block_manager.num_device_blocks
                else "max_new_tokens",
                limit="kv_cache",
            )
        return request

    def _prompt_ids(self, prompt) -> list[int]:
        """Token ids of a prompt given as ids, text or chat messages."""
        if isinstance(prompt, str) or _is_chat(prompt):
            if self.tokenizer is None:
                kind = "text" if isinstance(prompt, str) else "chat messages"
                raise RequestError(
                    f"a prompt of {kind} needs an engine with a tokenizer (Engine(tokenizer=...)); "
                    "without one, pass token ids",
                    "prompt",
                )
            if isinstance(prompt, str):
                return list(self.tokenizer(prompt)["input_ids"])
            for message in prompt:
                if not isinstance(message.get("role"), str) or not isinstance(
                    message.get("content"), str
                ):
                    raise RequestError(
                        "chat messages must be dicts with string 'role' and 'content', got "
                        f"{message!r}",
                        "prompt",
                    )
            text = self.tokenizer.apply_chat_template(
                list(prompt), add_generation_prompt=True, tokenize=False
            )
            return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        try:
            return _token_list(prompt)
        except (TypeError, ValueError) as error:
            raise RequestError(str(error), "prompt") from None

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
                    new_texts.append(text.take_new(final=seq.finish_reason is not None))
                    texts.append(text.handed_out)
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


Prompt = Union[Sequence[int], torch.Tensor, str, Sequence[Mapping[str, str]]]
"""Token ids; or, for an engine with a tokenizer, text or chat messages."""


def _is_chat(prompt) -> bool:
    return isinstance(prompt, (list, tuple)) and bool(prompt) and isinstance(prompt[0], Mapping)


def _merge(earlier: RequestOutput, later: RequestOutput, beams: bool) -> RequestOutput:
    """One output for two of the same request that wait for delivery: the later state, with
    both outputs' new tokens and text (beam search reorders its entries, so its later output
    stands alone: read its ``outputs``)."""
    if beams or len(earlier.new_tokens) != len(later.new_tokens):
        return later
    later.new_tokens = [a + b for a, b in zip(earlier.new_tokens, later.new_tokens)]
    if earlier.new_texts is not None and later.new_texts is not None:
        later.new_texts = [a + b for a, b in zip(earlier.new_texts, later.new_texts)]
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
