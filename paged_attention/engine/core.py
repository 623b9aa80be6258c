"""The engine core: validated requests in, updated requests out. One step is

    schedule (Scheduler.schedule: a plan of plain ids and arrays)
      -> run (ModelRunner: the plan's block copies and swaps, one packed forward pass)
      -> sample (every request's tokens, on the CPU with the request's own generator)
      -> update (Scheduler.update_from_output: tokens appended, stops checked, samples forked,
         beams reassigned, what finished freed).

All or nothing: if the forward pass or sampling raises, the step's reservations are rolled
back (and the generators restored) before the exception propagates, so the core is as it was
before the step. The core knows no prompts, text or consumers: the input processor builds its
:class:`~paged_attention.engine.request.Request` objects and the output processor turns what
a step did into outputs (its ``stop_string_hit`` is the one text check the update needs, since
a stop string frees the sequence's blocks in the same step).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from paged_attention.engine.config import EngineConfig
from paged_attention.engine.draft_model import check_draft_model, draft_block_bytes
from paged_attention.engine.hybrid_runner import HybridRunner, check_hybrid_engine
from paged_attention.engine.logprobs import record_prompt_logprobs
from paged_attention.engine.model_runner import CompiledDecode, ModelRunner
from paged_attention.engine.plan import ScheduledChunk
from paged_attention.engine.request import Request
from paged_attention.engine.request import Sequence as EngineSequence
from paged_attention.engine.sampler import beam_candidates, draw
from paged_attention.engine.scheduler import Scheduler, SchedulerOutput
from paged_attention.engine.spec_decode import Verified, verify_drafts
from paged_attention.engine.stats import EngineStats
from paged_attention.modeling.geometry import ModelGeometry
from paged_attention.modeling.mla import resolve as resolve_mla

StopStringCheck = Callable[[Request, EngineSequence], bool]


@dataclass
class CoreStepOutput:
    """What one step did: the requests the scheduler refused (with the reason; final even when
    the step then raised) and the requests that got tokens (those with no ``seqs`` left
    finished and hold no blocks)."""

    rejected: list[tuple[Request, str]] = field(default_factory=list)
    updated: list[Request] = field(default_factory=list)


class EngineCore:
    """Schedules, runs and updates the requests of ``model`` under ``config``; a KV cache sized
    once from the model's geometry (:meth:`CacheConfig.build
    <paged_attention.engine.config.CacheConfig.build>`). ``stop_string_hit`` (optional) tells
    whether a sequence's newest token completed a stop string."""

    def __init__(
        self,
        model: torch.nn.Module,
        config: EngineConfig,
        stop_string_hit: StopStringCheck | None = None,
    ) -> None:
        graphs = bool(config.cuda_graphs or config.compile)
        cache = config.cache
        mla = resolve_mla(cache.mla, kv_cache_dtype=cache.kv_cache_dtype, graphs=graphs)
        geometry = ModelGeometry.of(model, mla=mla)
        if geometry.state_layers:
            config = check_hybrid_engine(model, config, geometry)
        if config.speculative is not None and geometry.tensor_parallel.size > 1:
            raise ValueError(
                "speculative decoding is not supported with tensor parallelism; pass "
                "speculative=None"
            )
        draft_bytes = 0  # a draft model's pool: one block of its own per block of the model's
        if config.speculative is not None and config.speculative.draft_model is not None:
            check_draft_model(model, config.speculative.draft_model)
            draft_bytes = draft_block_bytes(config.speculative.draft_model, cache.block_size)
        cuda_graphs = config.cuda_graphs
        if cuda_graphs is None:  # not yet with tensor parallelism: graphs of NCCL not run here
            cuda_graphs = geometry.device.type == "cuda" and geometry.tensor_parallel.size == 1
            cuda_graphs = cuda_graphs and not geometry.latent  # its attention is not captured
        self.config = config
        self.model = model
        self.kv_cache = config.cache.build(geometry, draft_bytes)
        self.block_manager = geometry.block_manager(
            self.kv_cache, config.cache.enable_prefix_caching, config.scheduler.max_num_seqs
        )
        self.scheduler = Scheduler(
            self.block_manager, config.scheduler, speculative=config.speculative
        )
        self.hybrid: HybridRunner | None = None
        if geometry.state_layers:  # conv and recurrent states in state slots
            self.hybrid = HybridRunner(model, geometry, self.kv_cache, self.block_manager.states)
            self.runner = self.hybrid
        else:
            self.runner = ModelRunner(
                model,
                geometry,
                self.kv_cache,
                decode_graphs=cuda_graphs,
                max_num_seqs=config.scheduler.max_num_seqs,
                compile_decode=config.compile,
                released=(
                    self.block_manager.sliding_window,
                    self.block_manager.attention_chunk_size,
                ),
            )
        self.tensor_parallel = geometry.tensor_parallel
        self.eos_token_ids = _end_tokens(model, config.eos_token_id)
        self.stop_string_hit = stop_string_hit
        self.stats = EngineStats()
        self.requests: dict[int, Request] = {}  # unfinished, by id

    def add_request(self, request: Request) -> None:
        """Queue a validated request (the input processor's)."""
        self.requests[request.request_id] = request
        self.scheduler.add(request)

    def abort(self, request_id: int) -> Request:
        """End a request wherever it is, freeing every block it holds; its unfinished entries
        end as ``"abort"``. Returns it."""
        request = self.requests.pop(request_id, None)
        if request is None:
            raise ValueError(f"unknown or finished request {request_id}")
        self.scheduler.finish(request)
        for seq in request.seqs:
            seq.finish_reason = "abort"
        request.done += request.seqs
        request.seqs = []
        request.new_tokens = {}
        request.metrics.finished_time = time.perf_counter()
        return request

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def compile_decode_steps(self) -> dict[int, float]:
        if not isinstance(self.runner.graphs, CompiledDecode):
            raise ValueError("compile_decode_steps needs an engine built with compile=True")
        return self.runner.graphs.compile_all()

    def step(self, result: CoreStepOutput | None = None) -> CoreStepOutput:
        """Schedule, run and update one step; returns what it did. ``result`` (optional) is
        filled instead of a new one: a caller that passes it still holds the step's rejections
        when the step raises."""
        result = CoreStepOutput() if result is None else result
        started = time.perf_counter()
        out = self.scheduler.schedule()
        if self.tensor_parallel.checks_steps:
            self._check_plan_on_every_rank(out)
        now = time.perf_counter()
        for request, _ in out.rejected:
            self.requests.pop(request.request_id, None)
            request.metrics.finished_time = now
        result.rejected += out.rejected
        choices = None
        try:
            self.runner.execute_block_ops(out.block_ops)
            if out.chunks:
                logits = self.runner.run(out)
                choices = self._choose_tokens(out, logits)
        except BaseException:
            self.runner.execute_block_ops([("copy", self.scheduler.rollback(out))])
            if self.hybrid is not None:
                self.hybrid.discard_states()
            raise
        self.stats.count_prompt_tokens(out)
        if choices is not None:
            record_prompt_logprobs(out.chunks, logits)
        sampled = () if choices is None else choices.values()
        updated = self.scheduler.update_from_output(
            out, sampled, self._finish_reason, self.eos_token_ids
        )
        if self.hybrid is not None:
            self.hybrid.commit_states()
        self._record_tokens(updated)
        if choices is not None:
            self.stats.count_drafts(c for _, c in choices.values() if isinstance(c, Verified))
        result.updated += updated
        self.stats.record_step(self.scheduler, started)
        return result

    def _choose_tokens(self, out: SchedulerOutput, logits: torch.Tensor) -> dict:
        """Every sampling request's next tokens (a drafting one's verified drafts and token)
        and every beam request's candidates, keyed by ``id(request)``, touching nothing but the
        requests' generators, which are restored if anything raises (a retried step then draws
        the same tokens)."""
        rows: dict[int, tuple[Request, list[int]]] = {}
        drafting: dict[int, ScheduledChunk] = {}
        row = 0
        for chunk in out.chunks:
            if chunk.samples:
                rows.setdefault(id(chunk.request), (chunk.request, []))[1].extend(
                    range(row, row + chunk.num_sample_rows)
                )
                row += chunk.num_sample_rows
                if chunk.drafts:
                    drafting[id(chunk.request)] = chunk
        sampled = [
            (r, its_rows)
            for r, its_rows in rows.values()
            if not r.params.is_beam_search and id(r) not in drafting
        ]
        verified = [
            (r, drafting[id(r)], its_rows) for r, its_rows in rows.values() if id(r) in drafting
        ]
        states = [(r.generator, r.generator.get_state()) for r, *_ in sampled + verified]
        try:
            choices = {}
            if sampled:
                drawn = draw(logits, sampled, self.eos_token_ids)
                choices.update(zip((id(r) for r, _ in sampled), drawn))
            if verified:
                checked = verify_drafts(logits, verified, self.eos_token_ids)
                choices.update(zip((id(r) for r, *_ in verified), checked))
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

    def _finish_reason(self, request: Request, seq: EngineSequence) -> str | None:
        params, token = request.params, seq.tokens[-1]
        stopped_by_string = self.stop_string_hit is not None and self.stop_string_hit(request, seq)
        if token in self.eos_token_ids and not params.ignore_eos:
            return "eos"
        if token in params.stop_token_ids or stopped_by_string:
            return "stop"
        if len(seq.tokens) == params.max_new_tokens:
            return "length"
        return None

    def _record_tokens(self, updated: list[Request]) -> None:
        """The token times of the requests a step gave tokens; the finished ones leave."""
        now = time.perf_counter()
        for request in updated:
            self.stats.generated_tokens += sum(map(len, request.new_tokens.values()))
            metrics = request.metrics
            metrics.token_times.append(now)
            if metrics.first_token_time is None:
                metrics.first_token_time = now
            if not request.seqs:
                self.requests.pop(request.request_id, None)
                metrics.finished_time = now
                metrics.finished_step = self.stats.steps

    def _check_plan_on_every_rank(self, out: SchedulerOutput) -> None:
        """Tensor parallel, under PAGED_ATTENTION_DEBUG_CHECKS=1: every rank's scheduler chose
        the same rejections, chunks (with the tokens they feed), copies and swaps."""
        plan = [torch.tensor([request.request_id for request, _ in out.rejected])]
        for chunk in out.chunks:
            tokens = chunk.fed_tokens()
            plan.append(torch.tensor([chunk.seq.seq_id, chunk.start, chunk.count, *tokens]))
        for kind, pairs in out.block_ops:
            code = ("copy", "swap_out", "swap_in").index(kind)
            plan.append(torch.tensor([code, *itertools.chain.from_iterable(pairs)]))
        self.tensor_parallel.check_same_on_every_rank("the engine step's plan", plan)


def _end_tokens(model: torch.nn.Module, eos_token_id) -> frozenset[int]:
    """The tokens that end a sequence as ``"eos"``: ``eos_token_id`` (one id or several), by
    default the model's generation config's."""
    if eos_token_id is None:
        eos_token_id = model.generation_config.eos_token_id
    if eos_token_id is None:
        return frozenset()
    return frozenset([eos_token_id] if isinstance(eos_token_id, int) else eos_token_id)
