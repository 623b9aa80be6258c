"""The engine: the public door, composing three parts (docs/engine.md):

* :class:`~paged_attention.engine.input_processor.InputProcessor` — prompts (token ids, text,
  chat messages rendered by the
  :class:`~paged_attention.engine.prompt_renderer.PromptRenderer`) and :class:`SamplingParams`
  in, validated requests out;
* :class:`~paged_attention.engine.core.EngineCore` — each step: schedule, run the model, sample,
  update (the scheduler owns every block change);
* :class:`~paged_attention.engine.output_processor.OutputProcessor` — detokenizes, checks stop
  strings and delivers each output exactly once to its stream, ``generate`` call or ``step()``.

Sampling runs on the CPU in float32 with one ``torch.Generator`` per request, seeded from the
request's seed; a request's sequences are always scheduled, sampled and preempted together, so
its random draws happen in the same order however the batch around it is composed: the results
do not depend on the KV budget, on preemption, on prefix caching or on chunked prefill.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from paged_attention.engine.config import EngineConfig
from paged_attention.engine.core import CoreStepOutput, EngineCore
from paged_attention.engine.input_processor import InputProcessor, Prompt, RequestLimits
from paged_attention.engine.output_processor import OutputProcessor, RequestStream
from paged_attention.engine.request import Request, RequestOutput, SamplingParams
from paged_attention.engine.stats import EngineStats

__all__ = ["Engine", "EngineStats", "RequestStream"]


class Engine:
    """Continuous batching over a transformers causal LM, built from ``config`` (an
    :class:`~paged_attention.engine.config.EngineConfig`) or from its fields as keyword
    arguments (``Engine(model, num_blocks=64, max_num_seqs=8)``; :meth:`EngineConfig.from_kwargs
    <paged_attention.engine.config.EngineConfig.from_kwargs>`): a KV budget of ``num_blocks``
    device blocks (or ``max_memory``) and ``num_host_blocks`` of host swap space (default: four
    times the budget on a GPU, none on a CPU, where host blocks would be more of the same RAM;
    0: preemption recomputes instead of swapping).

    ``tokenizer`` (optional, a transformers tokenizer): prompts may then be text or chat
    messages, outputs carry text, and ``SamplingParams.stop`` strings apply.
    ``enable_prefix_caching`` (default on): a prompt whose leading full blocks are cached, by an
    earlier request or a running one, computes only the rest. ``max_num_batched_tokens`` (default
    no limit, else at least ``max_num_seqs``): the tokens one step computes, decodes first;
    longer prompts are prefilled in chunks over several steps. ``cuda_graphs`` (default: on for
    a model on one CUDA device, off for a tensor-parallel one): decode steps replay CUDA graphs
    captured per padded batch size. ``kv_cache_dtype`` (``"auto"`` or an fp8 format) with
    ``k_scale``/``v_scale`` as :class:`~paged_attention.kv.cache.PagedKVCache` takes them (without
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
        config: EngineConfig | None = None,
        *,
        tokenizer=None,
        **kwargs,
    ) -> None:
        if config is None:
            config = EngineConfig.from_kwargs(**kwargs)
        elif not isinstance(config, EngineConfig):
            raise TypeError(f"config must be an EngineConfig, got {type(config).__name__}")
        elif kwargs:
            raise TypeError(f"give config or its fields, not both (got {sorted(kwargs)})")
        self.config = config
        self.output_processor = OutputProcessor(tokenizer)
        self.core = EngineCore(model, config, self.output_processor.stop_string_hit)
        core = self.core
        self.model, self.tokenizer, self.stats = model, tokenizer, core.stats
        self.kv_cache, self.block_manager = core.kv_cache, core.block_manager
        self.scheduler, self.runner = core.scheduler, core.runner
        self.tensor_parallel, self.eos_token_ids = core.tensor_parallel, core.eos_token_ids
        self.block_size = config.cache.block_size
        embeddings = model.get_input_embeddings()
        positions = getattr(model.config.get_text_config(), "max_position_embeddings", None)
        self.limits = RequestLimits(
            vocab_size=getattr(embeddings, "num_embeddings", None) or model.config.vocab_size,
            max_model_len=positions,
            max_num_seqs=config.scheduler.max_num_seqs,
        )
        """What a request may ask (checked once, by :attr:`input_processor`): the vocabulary,
        the model's context (``max_position_embeddings``; ``None`` if it sets none), the
        sequences one request may run."""
        self.input_processor = InputProcessor(
            tokenizer, self.limits, self.scheduler, self.runner.device
        )

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
        return self.core.compile_decode_steps()

    def warm_up(self) -> float:
        """Run one short request (a prefill, then a decode step) and forget it, so that the
        first real request does not pay for the model's first run (one-time initialisation of
        its kernels: about half a second of SmolLM2's first prefill on two cores), as
        llama-server warms up before it serves. Its prompt and generated token fill less than a
        block (for blocks of 3 tokens or more), so it leaves nothing in the prefix cache; the
        counters (``stats``) start again from zero. On the CPU without compiled steps (which are
        compiled for the thread count they run with) it runs on one of torch's threads (a
        process-wide setting, restored afterwards): its work is mostly first touches and first
        runs, and on cores shared with other busy processes every parallel region of a step
        waits for a descheduled thread (docs/performance.md, the start). A
        server calls this before it accepts requests; raises ValueError while any request is
        unfinished. Returns the seconds it took."""
        if self.has_unfinished():
            raise ValueError("warm_up needs an idle engine: requests are unfinished")
        started = time.perf_counter()
        context = self.max_model_len or self.block_size
        length = max(1, min(self.block_size - 2, context - 2))
        params = SamplingParams(max_new_tokens=2, temperature=0.0, ignore_eos=True)
        threads = torch.get_num_threads()
        # compiled steps keep the thread count they were compiled for (torch.compile guards
        # it; a saved step's key holds it)
        one_thread = not self.config.compile and self.runner.device.type == "cpu"
        if one_thread:
            torch.set_num_threads(1)
        try:
            self.generate([[0] * length], params)
        finally:
            torch.set_num_threads(threads)
        vars(self.stats).update(vars(EngineStats()))
        return time.perf_counter() - started

    def add_request(
        self,
        prompt: Prompt,
        params: SamplingParams,
        arrival_time: float | None = None,
    ) -> int:
        """Queue a request; returns its id. ``prompt``: token ids, or with a tokenizer a string
        or chat messages (``[{"role": ..., "content": ...}, ...]``, formatted by the tokenizer's
        chat template with the generation prompt added; a
        :class:`~paged_attention.engine.prompt_renderer.ChatPrompt` adds tools and the template's
        options). ``arrival_time``
        (``time.perf_counter()`` seconds, default now) is what its time to first token is
        measured from. Raises ValueError, naming what is wrong, for a request that is malformed
        or could never run (longer than the model's context, or more blocks than the pool)."""
        request = self.input_processor.process(prompt, params, arrival_time)
        self._admit(request)
        return request.request_id

    def abort(self, request_id: int) -> RequestOutput:
        """End a request wherever it is (waiting, running or swapped out), freeing every block
        it holds; returns its final output (finish reason ``"abort"`` for unfinished entries),
        which also holds what it produced and was not delivered yet. A stream of the request
        ends with that output."""
        request = self.core.abort(request_id)
        processor = self.output_processor
        output = processor.output(request, finished=True)
        return processor.deliver_final(output, request.params.is_beam_search)

    def has_unfinished(self) -> bool:
        """Requests are waiting or running, or outputs wait to be returned by ``step()``."""
        return self.core.has_unfinished() or self.output_processor.has_unowned()

    def generate(self, prompts: Sequence[Prompt], params) -> list[RequestOutput]:
        """Serve ``prompts`` to completion; final outputs in the order of the prompts. Every
        prompt and parameter set is checked before any is queued: all or nothing. If a step
        raises, the requests of this call are aborted before the exception propagates."""
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts and {len(params)} SamplingParams")
        requests = [self.input_processor.process(p, s) for p, s in zip(prompts, params)]
        owner, processor = _Consumer(), self.output_processor
        for request in requests:
            self._admit(request, owner)
        results: dict[int, RequestOutput] = {}
        try:
            while len(results) < len(requests):
                self._run_step()
                for request in requests:
                    output = processor.peek(request.request_id)
                    if output is not None and output.finished:
                        results[request.request_id] = processor.take(request.request_id)
        except BaseException:
            for request in requests:
                if request.request_id in self.core.requests:
                    self.abort(request.request_id)
                processor.discard(request.request_id)
                processor.release(request.request_id)
            raise
        return [results[r.request_id] for r in requests]

    def stream(self, prompt: Prompt, params: SamplingParams) -> RequestStream:
        """Queue a request (now: a bad one raises here) and return an iterator over its outputs,
        one after every step that gives it tokens, the last one with ``finished`` set. Other
        requests keep running meanwhile; their outputs are returned by ``step()`` (or by their
        own stream). Closing the stream (``close()``, or leaving a ``with`` block) aborts the
        request if it has not finished; a stream dropped unfinished is aborted at the next
        step."""
        request = self.input_processor.process(prompt, params)
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
        return self.output_processor.take_unowned()

    def _run_step(self) -> None:
        """One step of the core; its outputs wait in the output processor for their owners."""
        processor = self.output_processor
        for request_id in processor.dropped():  # a stream garbage-collected unfinished
            if request_id in self.core.requests:
                self.abort(request_id)
                processor.discard(request_id)
        result = CoreStepOutput()
        try:
            self.core.step(result)
        finally:  # a rejection is final whether or not the forward pass succeeded
            for request, reason in result.rejected:
                processor.deliver(processor.rejection(request, reason), beams=False)
        for request in result.updated:
            output = processor.output(request, finished=not request.seqs)
            processor.deliver(output, request.params.is_beam_search)

    def _admit(self, request: Request, owner=None) -> None:
        if owner is not None:
            self.output_processor.own(request.request_id, owner)
        self.core.add_request(request)


class _Consumer:
    """What a ``generate()`` call owns its requests by."""
