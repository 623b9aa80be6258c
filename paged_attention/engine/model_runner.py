"""The model runner: carries out a step's block copies and swaps, packs its chunks into one
forward pass of a transformers causal LM over the paged cache, and returns the logits it samples
from.

A step's tokens, decodes first and then prompt chunks, are packed into one row (batch 1) with
their positions; :class:`StepCache` is the ``transformers.Cache`` the model's attention layers
call, and it attends every sequence over its own paged context with one
:class:`~paged_attention.attention.AttentionMetadata` for the whole step, built by
:func:`~paged_attention.kv.step_inputs.build_metadata` from the arrays the scheduler planned
(``SchedulerOutput.inputs``). The runner never sees the block manager.

Decode steps may run through an executor instead of eagerly: :class:`DecodeGraphs` (CUDA graphs)
or :class:`CompiledDecode` (``torch.compile`` on the CPU), two strategies over one holder of
static batch buffers (:class:`~paged_attention.kv.step_inputs.StaticStepBuffers`).
"""

from __future__ import annotations

import functools
import math
import time
import types
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch._inductor.config

from paged_attention.attention import AttentionMetadata
from paged_attention.engine.logprobs import prompt_positions
from paged_attention.engine.scheduler import SchedulerOutput
from paged_attention.kv.cache import PagedKVCache
from paged_attention.kv.step_inputs import StaticStepBuffers, build_metadata
from paged_attention.modeling.geometry import ModelGeometry
from paged_attention.modeling.mla import resolve as resolve_mla
from paged_attention.modeling.transformers_backend import (
    ATTN_IMPLEMENTATION,
    PagedCacheBase,
    cache_argument_name,
)

if TYPE_CHECKING:
    from torch._dynamo.aot_compile import AOTCompiledFunction


class StepCache(PagedCacheBase):
    """The cache of one packed forward pass: every layer stores the step's new keys and values
    at ``metadata.slot_mapping`` and attends through ``metadata``. Set :attr:`metadata` before
    each forward."""

    def __init__(self, model: torch.nn.Module, geometry: ModelGeometry, kv: PagedKVCache) -> None:
        super().__init__(model, geometry, kv)
        self.metadata: AttentionMetadata | None = None

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0  # positions come from position_ids; nothing is read from here

    def get_mask_sizes(self, query_length, layer_idx: int = 0) -> tuple[int, int]:
        if isinstance(query_length, torch.Tensor):
            query_length = query_length.shape[0]
        return int(query_length), 0

    def _attend_layer(self, layer_idx, query, key, value, padding, scale, sinks):
        batch, num_heads, q_len, _ = query.shape
        metadata = self.metadata
        if metadata is None:
            raise ValueError("StepCache.metadata must describe the step before the forward pass")
        if batch != 1 or q_len != metadata.num_tokens:
            raise ValueError(
                f"the step packs {metadata.num_tokens} tokens in one row; the forward got input "
                f"of shape [{batch}, {q_len}]"
            )
        packed = [  # values may have a head size of their own (multi-head latent attention)
            t[0].transpose(0, 1).reshape(q_len, t.shape[1], t.shape[3]) for t in (query, key, value)
        ]
        out = self._packed_attention(layer_idx, *packed, metadata, scale, sinks)
        return out.view(1, q_len, num_heads, value.shape[3])


class ModelRunner:
    """Runs ``model`` over the paged cache ``kv``, one scheduler step at a time; switches the
    model to the ``"paged_attention"`` attention implementation. With ``decode_graphs`` (CUDA),
    decode steps of up to ``max_num_seqs`` sequences replay CUDA graphs instead
    (:class:`DecodeGraphs`); with ``compile_decode`` (CPU), they run through ``torch.compile``
    (:class:`CompiledDecode`). Prompt chunks, and steps that mix them with decodes, always run
    eagerly. ``released``: ``(sliding_window, attention_chunk_size)`` of the manager that plans
    the steps (what it releases bounds what a layer may attend; the static buffers of the
    decode executors carry it)."""

    def __init__(
        self,
        model: torch.nn.Module,
        geometry: ModelGeometry,
        kv: PagedKVCache,
        *,
        decode_graphs: bool = False,
        max_num_seqs: int = 64,
        compile_decode: bool = False,
        released: tuple[int | None, int | None] = (None, None),
    ) -> None:
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
        self.model = model
        self.kv_cache = kv
        self.device = geometry.device
        self.cache = StepCache(model, geometry, kv)
        self._cache_argument = cache_argument_name(model)
        self.graphs: DecodeGraphs | CompiledDecode | None = None
        if decode_graphs and self.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a model on a CUDA device, not {self.device}")
        if compile_decode:
            _check_compilable(self.device, geometry)
        if (decode_graphs or compile_decode) and geometry.latent:
            resolve_mla("latent", graphs=True)  # raises: the latent form's attention is eager
        if decode_graphs or compile_decode:
            # The longest context the cache and the model allow, computed once for both.
            positions = getattr(model.config, "max_position_embeddings", None) or math.inf
            max_seq_len = int(min(positions, kv.num_blocks * kv.block_size))
            buffers = StaticStepBuffers(
                max_num_seqs, max_seq_len, kv.block_size, self.device, released
            )
            executor = CompiledDecode if compile_decode else DecodeGraphs
            self.graphs = executor(self, buffers)

    def execute_block_ops(self, block_ops: list[tuple[str, list[tuple[int, int]]]]) -> None:
        """The copies and swaps the manager planned, in the order it planned them (a block a
        swap-out frees may be the destination of a later copy)."""
        for kind, pairs in block_ops:
            if kind == "copy":
                self.kv_cache.copy_blocks(pairs)
            elif kind == "swap_out":
                self.kv_cache.swap_out(pairs)
            else:
                self.kv_cache.swap_in(pairs)

    def metadata(self, out: SchedulerOutput) -> AttentionMetadata:
        """The AttentionMetadata of the step's packed rows: decodes first, then prompt chunks."""
        return build_metadata(out.inputs, self.device)

    def forward(self, input_ids, position_ids, metadata: AttentionMetadata, keep) -> torch.Tensor:
        """One packed forward pass (batch 1) through :class:`StepCache`; the logits of the rows
        ``keep`` (a tensor of row indices, or 0 for all)."""
        with torch.inference_mode():
            return self.logits(input_ids, position_ids, metadata, keep)

    def logits(self, input_ids, position_ids, metadata: AttentionMetadata, keep) -> torch.Tensor:
        """:meth:`forward` in the caller's grad mode (what ``torch.compile`` traces: it runs
        under ``torch.no_grad()``, as inference tensors cannot enter a compiled graph)."""
        self.cache.metadata = metadata
        try:
            return self.model(
                input_ids=input_ids,
                position_ids=position_ids,
                use_cache=True,
                logits_to_keep=keep,
                **{self._cache_argument: self.cache},
            ).logits[0]
        finally:
            self.cache.metadata = None

    def run(self, out: SchedulerOutput) -> torch.Tensor:
        """The forward pass of the step's chunks; float32 logits on the model's device, one row
        per chunk that samples (in chunk order), one more per draft of a drafting chunk (a step
        with drafts runs eagerly: its queries are several tokens long)."""
        if self.graphs is not None and not out.has_drafts and self.graphs.fits(out):
            return self.graphs.run(out)
        tokens: list[int] = []
        positions: list[int] = []
        sample_rows: list[int] = []
        prompt_rows: list[int] = []  # kept after the sampling rows (engine/logprobs.py)
        for chunk in out.chunks:
            first_row = len(tokens) - chunk.start  # the packed row of the chunk's position 0
            positions_scored = prompt_positions(chunk.request, chunk.start, chunk.end)
            prompt_rows += [first_row + p for p in positions_scored]
            tokens += chunk.fed_tokens()
            positions += range(chunk.start, chunk.end)
            sample_rows += range(len(tokens) - chunk.num_sample_rows, len(tokens))
        logits = self.forward(
            torch.tensor([tokens], device=self.device),
            torch.tensor([positions], device=self.device),
            self.metadata(out),
            torch.tensor(sample_rows + prompt_rows, dtype=torch.long, device=self.device),
        )
        return logits.float()


def _check_compilable(device: torch.device, geometry: ModelGeometry) -> None:
    if device.type != "cpu":
        raise ValueError(
            f"compiled decode steps are for a model on the CPU, not {device} (on CUDA, "
            "decode steps replay CUDA graphs: cuda_graphs=True)"
        )
    if geometry.tensor_parallel.size > 1:
        raise ValueError(
            "compiled decode steps are not supported with tensor parallelism (each rank's "
            "step calls collectives); pass compile=False"
        )


class _StaticDecode:
    """What both decode executors share: a step is copied into ``buffers`` (padded to the
    next of :attr:`sizes`), and the model runs over their first rows."""

    SIZES: tuple[int, ...] = ()

    def __init__(self, runner: ModelRunner, buffers: StaticStepBuffers) -> None:
        self.runner = runner
        self.buffers = buffers
        self.max_seq_len = buffers.max_seq_len
        self.sizes = self.sizes_for(buffers.max_batch)

    @classmethod
    def sizes_for(cls, max_num_seqs: int) -> list[int]:
        """The padded batch sizes of an engine running ``max_num_seqs`` sequences at once."""
        return [s for s in cls.SIZES if s < max_num_seqs] + [max_num_seqs]

    def fits(self, out: SchedulerOutput) -> bool:
        return not out.prefill and out.inputs is not None and self.buffers.fits(out.inputs)

    def fill(self, out: SchedulerOutput) -> int:
        """Copy the decode step into the static buffers; returns its padded batch size."""
        size = next(s for s in self.sizes if s >= len(out.decode))
        self.buffers.fill(out.inputs, [c.seq.tokens[-1] for c in out.decode], size)
        return size

    def pad(self, size: int) -> None:
        self.buffers.pad(size)

    def _inputs(self, size: int) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, int]:
        """The runner's forward arguments for the first ``size`` rows of the static buffers."""
        buffers = self.buffers
        metadata = build_metadata(None, self.runner.device, static=buffers, size=size)
        return buffers.input_ids[:, :size], buffers.positions[:, :size], metadata, 0

    def forward(self, size: int) -> torch.Tensor:
        """The model over the first ``size`` rows of the static buffers, eagerly (what a graph
        captures; the CPU tests check the padding through it)."""
        return self.runner.forward(*self._inputs(size))


class DecodeGraphs(_StaticDecode):
    """CUDA graphs of decode steps (every sequence adds one token), one per padded batch size,
    as vLLM and nano-vllm capture them: a replay runs the model's kernels without Python or
    launch overhead. Padding rows have seq_len 0 and slot -1, so they store and attend nothing
    (their logits are dropped). Every graph is captured with the buffers' ``max_seq_len`` and
    block tables that wide, so it serves every step of its batch size; a step that does not fit
    runs eagerly. A size is captured at its first step: warmed up on a side stream, then
    captured."""

    SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128)

    def __init__(self, runner: ModelRunner, buffers: StaticStepBuffers) -> None:
        super().__init__(runner, buffers)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool = None

    def run(self, out: SchedulerOutput) -> torch.Tensor:
        size = self.fill(out)
        if size not in self._graphs:
            self._graphs[size] = self._capture(size)
        graph, logits = self._graphs[size]
        graph.replay()
        return logits[: len(out.decode)].float()

    def _capture(self, size: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self.forward(size)  # rewrites this step's keys and values: the same values
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            logits = self.forward(size)
        self._pool = graph.pool()
        return graph, logits


class CompiledDecode(_StaticDecode):
    """Decode steps through ``torch.compile`` on the CPU: what :class:`DecodeGraphs` does with
    CUDA graphs, one compiled graph per padded batch size over the same kind of static buffers
    (padding rows store and attend nothing, their logits are dropped).

    Inductor's freezing turns the weights into constants, so the projections run oneDNN
    (bfloat16: AMX / AVX512-BF16) or MKL (float32) matrix products on weights packed once for
    them, the query/key/value projections as one product and the gate/up projections as
    another (``enable_concat_linear``); the norms, rotary embeddings and activations fuse into
    a few loops, and ``cpp_wrapper`` calls a step's kernels from C++ instead of Python. A size
    is compiled at its first step, or every size at once by :meth:`compile_all`; compiling takes
    long (minutes per size for a 30-layer model on two cores; docs/performance.md),
    so the sizes are few: a step pads to the next one.
    The weights are captured when a size is compiled: an engine serves the weights it first
    saw. :meth:`make_cacheable` trades freezing (the packed float weights, the concatenated
    projections) for steps compiled ahead of time that another process loads
    (:mod:`paged_attention.engine.compile_cache`): their weights are inputs, read from the
    engine's modules at every step. A quantized model's linear layers are custom ops that
    freezing neither packs nor concatenates, so for it the steps run the same kernels either
    way.

    Every size is a function with a code object of its own (dynamo keeps compiled graphs per
    code object): it holds one graph, so its later calls skip dynamo's guards (their inputs are
    the same static buffers and weights every time), and an engine's graphs, with their
    packed weights, die with it.
    """

    SIZES = (1, 8, 32)
    INDUCTOR_OPTIONS = {"freezing": True, "cpp_wrapper": True, "cpp.enable_concat_linear": True}
    CACHEABLE_OPTIONS = {"freezing": False}
    """What :meth:`make_cacheable` changes: without freezing the weights are inputs of the
    compiled graph, not constants of it, so a saved step holds no weights (nor oneDNN's packed
    ones, mkldnn tensors that cannot be saved) and serves the weights of the process that
    loads it."""

    def __init__(self, runner: ModelRunner, buffers: StaticStepBuffers) -> None:
        super().__init__(runner, buffers)
        self.inductor_options = dict(self.INDUCTOR_OPTIONS)
        self.compile_seconds: dict[int, float] = {}
        """Seconds the first step of each size took: compiling it (or, for a step loaded by
        :meth:`adopt`, loading its kernels), then running it."""
        self.ahead_steps: dict[int, AOTCompiledFunction] = {}
        """The steps compiled ahead of time (after :meth:`make_cacheable`) or adopted, by size:
        what :mod:`~paged_attention.engine.compile_cache` saves."""
        self._ahead = False
        self._steps: dict[int, Callable[[], torch.Tensor]] = {}

    def __getstate__(self) -> dict:
        # A step compiled ahead of time saves the objects its guards reach, this executor
        # among them: the steps it compiled before (their guard managers cannot be saved, and
        # a loading process has its own) stay out.
        return {**self.__dict__, "_steps": {}, "ahead_steps": {}}

    def _step(self, size: int) -> torch.Tensor:
        return self.runner.logits(*self._inputs(size))

    def run(self, out: SchedulerOutput) -> torch.Tensor:
        size = self.fill(out)
        return self._run_size(size)[: len(out.decode)].float()

    def make_cacheable(self) -> None:
        """Sizes compiled from now on are compiled ahead of time, into :attr:`ahead_steps`,
        without freezing: the float linear layers multiply unpacked weights (a quantized
        model's layers are custom ops, which nothing packs). Raises ValueError once a size has
        been compiled."""
        if self._steps:
            raise ValueError("make_cacheable must come before the first size is compiled")
        self.inductor_options.update(self.CACHEABLE_OPTIONS)
        self._ahead = True

    def adopt(self, size: int, step: AOTCompiledFunction) -> None:
        """Runs ``step``, this class's step of ``size`` compiled ahead of time by another
        process (and loaded by :mod:`~paged_attention.engine.compile_cache`), for ``size``.
        Its guards on tensors are checked once, here: they hold every input's shape, dtype and
        strides (the static buffers, the cache's blocks, the weights), which no later step
        changes. Raises ValueError, adopting nothing, when ``size`` is not one of
        :attr:`sizes`, is compiled already, or ``step`` was compiled for other tensors."""
        if size not in self.sizes or size in self._steps:
            state = "compiled already" if size in self._steps else f"not one of {self.sizes}"
            raise ValueError(f"cannot adopt a step of batch size {size}: {state}")
        with torch.no_grad():
            if not step.guard_check(self, size):
                raise ValueError(
                    f"the saved decode step of batch size {size} was compiled for other tensors "
                    "(shapes, dtypes or strides) than this engine's"
                )
        step.disable_guard_check()
        self.ahead_steps[size] = step
        self._steps[size] = functools.partial(step, self, size)

    def compile_all(self) -> dict[int, float]:
        """Compiles (or, adopted, loads) every size that has not run yet and runs it, now, on
        padding rows only (they store and attend nothing, so the cache is untouched); returns
        :attr:`compile_seconds`."""
        for size in self.sizes:
            self.ready(size)
        return dict(self.compile_seconds)

    def ready(self, size: int) -> float:
        """Compiles (or, adopted, loads) ``size`` and runs it on padding rows unless it has
        run already; returns its :attr:`compile_seconds`."""
        if size not in self.compile_seconds:
            self.pad(size)
            self._run_size(size)
        return self.compile_seconds[size]

    def _run_size(self, size: int) -> torch.Tensor:
        """The compiled step of the first ``size`` rows of the static buffers (compiled first
        if this size has not run yet)."""
        with torch.no_grad():
            if size in self.compile_seconds:
                return self._steps[size]()
            started = time.perf_counter()
            if size in self._steps:
                logits = self._steps[size]()
            else:
                self._steps[size], logits = self._compile(size)
            self.compile_seconds[size] = time.perf_counter() - started
            return logits

    def _compile(self, size: int) -> tuple[Callable[[], torch.Tensor], torch.Tensor]:
        """The compiled step of ``size`` and the logits of its first run."""
        function = types.FunctionType(CompiledDecode._step.__code__.replace(), globals())
        method = types.MethodType(function, self)
        if self._ahead:
            # Tensor guards only: the others name objects of this process (transformers'
            # local classes) that a saved step cannot hold.
            options = {"guard_filter_fn": torch.compiler.keep_tensor_guards_unsafe}
            compiled = torch.compile(
                method, fullgraph=True, dynamic=False, options={**options, **self.inductor_options}
            )
            ahead = compiled.aot_compile(((size,), {}))
            ahead.disable_guard_check()
            self.ahead_steps[size] = ahead
            step = functools.partial(ahead, self, size)
            return step, step()
        compiled = torch.compile(method, fullgraph=True, dynamic=False)
        with torch._inductor.config.patch(self.inductor_options):
            logits = compiled(size)

        def step() -> torch.Tensor:
            with torch.compiler.set_stance(skip_guard_eval_unsafe=True):
                return compiled(size)

        return step, logits
