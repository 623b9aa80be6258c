"""The model runner: carries out a step's block copies and swaps, packs its chunks into one
forward pass of a transformers causal LM over the paged cache, and returns the logits it samples
from.

A step's tokens, decodes first and then prompt chunks, are packed into one row (batch 1) with
their positions; :class:`StepCache` is the ``transformers.Cache`` the model's attention layers
call, and it attends every sequence over its own paged context with one
:class:`~paged_attention.attention.AttentionMetadata` for the whole step. The decode rows' block
tables, seq lens and slots are the ones ``BlockManager.decode_step`` returned when the scheduler
reserved them.
"""

from __future__ import annotations

import math
import time
import types
from collections.abc import Callable

import torch
import torch._inductor.config

from paged_attention.attention import AttentionMetadata
from paged_attention.block_manager import BlockManager
from paged_attention.cache import PagedKVCache
from paged_attention.engine.logprobs import prompt_positions
from paged_attention.engine.scheduler import SchedulerOutput
from paged_attention.geometry import ModelGeometry
from paged_attention.integrations.transformers_backend import (
    ATTN_IMPLEMENTATION,
    PagedCacheBase,
    cache_argument_name,
)


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
        batch, num_heads, q_len, head_size = query.shape
        metadata = self.metadata
        if metadata is None:
            raise ValueError("StepCache.metadata must describe the step before the forward pass")
        if batch != 1 or q_len != metadata.num_tokens:
            raise ValueError(
                f"the step packs {metadata.num_tokens} tokens in one row; the forward got input "
                f"of shape [{batch}, {q_len}]"
            )
        packed = [
            t[0].transpose(0, 1).reshape(q_len, t.shape[1], head_size) for t in (query, key, value)
        ]
        out = self._packed_attention(layer_idx, *packed, metadata, scale, sinks)
        return out.view(1, q_len, num_heads, head_size)


class ModelRunner:
    """Runs ``model`` over the paged cache ``kv``, one scheduler step at a time; switches the
    model to the ``"paged_attention"`` attention implementation. ``block_manager``: the manager
    that plans the steps (what it releases bounds what a layer may attend; None: it releases
    nothing). With ``decode_graphs`` (CUDA), decode steps of up to ``max_num_seqs`` sequences
    replay CUDA graphs instead (:class:`DecodeGraphs`); with ``compile_decode`` (CPU),
    they run through ``torch.compile`` (:class:`CompiledDecode`). Prompt chunks, and steps
    that mix them with decodes, always run eagerly."""

    def __init__(
        self,
        model: torch.nn.Module,
        geometry: ModelGeometry,
        kv: PagedKVCache,
        *,
        decode_graphs: bool = False,
        max_num_seqs: int = 64,
        block_manager: BlockManager | None = None,
        compile_decode: bool = False,
    ) -> None:
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
        self.model = model
        self.kv_cache = kv
        self.device = geometry.device
        self.cache = StepCache(model, geometry, kv)
        self._cache_argument = cache_argument_name(model)
        self.graphs: DecodeGraphs | None = None
        if decode_graphs:
            if self.device.type != "cuda":
                raise ValueError(f"CUDA graphs need a model on a CUDA device, not {self.device}")
            positions = getattr(model.config, "max_position_embeddings", None) or math.inf
            max_seq_len = int(min(positions, kv.num_blocks * kv.block_size))
            self.graphs = DecodeGraphs(self, max_num_seqs, max_seq_len, block_manager)
        if compile_decode:
            self.graphs = self._compiled_decode(geometry, max_num_seqs, block_manager)

    def _compiled_decode(
        self, geometry: ModelGeometry, max_num_seqs: int, block_manager: BlockManager | None
    ) -> CompiledDecode:
        if self.device.type != "cpu":
            raise ValueError(
                f"compiled decode steps are for a model on the CPU, not {self.device} (on CUDA, "
                "decode steps replay CUDA graphs: cuda_graphs=True)"
            )
        if geometry.tensor_parallel.size > 1:
            raise ValueError(
                "compiled decode steps are not supported with tensor parallelism (each rank's "
                "step calls collectives); pass compile=False"
            )
        positions = getattr(self.model.config, "max_position_embeddings", None) or math.inf
        max_seq_len = int(min(positions, self.kv_cache.num_blocks * self.kv_cache.block_size))
        return CompiledDecode(self, max_num_seqs, max_seq_len, block_manager)

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

    def metadata(self, out: SchedulerOutput, manager: BlockManager) -> AttentionMetadata:
        """One AttentionMetadata for the step's packed rows: the decode rows first, as
        ``decode_step`` described them, then the prompt chunks."""
        query_lens = [1] * len(out.decode) + [c.count for c in out.prefill]
        parts = []  # (block tables, seq lens, slots)
        if out.decode:
            parts.append(out.decode_tensors)
        if out.prefill:
            ids = [c.seq.seq_id for c in out.prefill]
            parts.append(
                (
                    manager.block_tables_tensor(ids),
                    manager.seq_lens_tensor(ids),
                    manager.slot_mapping_tensor(ids, [c.count for c in out.prefill]),
                )
            )
        if len(parts) == 1:
            tables, seq_lens, slots = parts[0]
        else:
            width = max(p[0].shape[1] for p in parts)
            tables = torch.cat(
                [torch.nn.functional.pad(p[0], (0, width - p[0].shape[1])) for p in parts]
            )
            seq_lens = torch.cat([p[1] for p in parts])
            slots = torch.cat([p[2] for p in parts])
        return AttentionMetadata.build(
            query_lens,
            seq_lens.tolist(),
            tables,
            slots,
            self.device,
            seq_lens,
            manager.sliding_window,
            manager.attention_chunk_size,
        )

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

    def run(self, out: SchedulerOutput, manager: BlockManager) -> torch.Tensor:
        """The forward pass of the step's chunks; float32 logits on the model's device, one row
        per chunk that samples (in chunk order)."""
        if self.graphs is not None and self.graphs.fits(out):
            return self.graphs.run(out)
        tokens: list[int] = []
        positions: list[int] = []
        sample_rows: list[int] = []
        prompt_rows: list[int] = []  # kept after the sampling rows (engine/logprobs.py)
        for chunk in out.chunks:
            first_row = len(tokens) - chunk.start  # the packed row of the chunk's position 0
            positions_scored = prompt_positions(chunk.request, chunk.start, chunk.end)
            prompt_rows += [first_row + p for p in positions_scored]
            tokens += chunk.request.token_slice(chunk.seq, chunk.start, chunk.end)
            positions += range(chunk.start, chunk.end)
            if chunk.samples:
                sample_rows.append(len(tokens) - 1)
        logits = self.forward(
            torch.tensor([tokens], device=self.device),
            torch.tensor([positions], device=self.device),
            self.metadata(out, manager),
            torch.tensor(sample_rows + prompt_rows, dtype=torch.long, device=self.device),
        )
        return logits.float()


class DecodeGraphs:
    """CUDA graphs of decode steps (every sequence adds one token), one per padded batch size,
    as vLLM and nano-vllm capture them: a replay runs the model's kernels without Python or
    launch overhead. The step is copied into static buffers first; padding rows have seq_len 0
    and slot -1, so they store and attend nothing (their logits are dropped). Every graph is
    captured with ``max_seq_len`` (the longest context the cache and the model allow) and block
    tables that wide, so it serves every step of its batch size; a step that does not fit runs
    eagerly. A size is captured at its first step: warmed up on a side stream, then captured.
    ``block_manager``: the manager that plans the steps (what it releases, None: nothing)."""

    def __init__(
        self,
        runner: ModelRunner,
        max_batch: int,
        max_seq_len: int,
        block_manager: BlockManager | None,
    ) -> None:
        device = runner.device
        self.runner = runner
        self.max_seq_len = max_seq_len
        # What the manager releases bounds what a layer may attend (AttentionMetadata).
        self.manager_window = None if block_manager is None else block_manager.sliding_window
        self.manager_chunk = None if block_manager is None else block_manager.attention_chunk_size
        self.sizes = [s for s in (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128) if s < max_batch]
        self.sizes.append(max_batch)
        self.max_blocks = -(-max_seq_len // runner.kv_cache.block_size)
        self.input_ids = torch.zeros(1, max_batch, dtype=torch.long, device=device)
        self.positions = torch.zeros(1, max_batch, dtype=torch.long, device=device)
        self.block_tables = torch.zeros(
            max_batch, self.max_blocks, dtype=torch.int32, device=device
        )
        self.seq_lens = torch.zeros(max_batch, dtype=torch.int32, device=device)
        self.slots = torch.full((max_batch,), -1, dtype=torch.int64, device=device)
        self.query_start_loc = torch.arange(max_batch + 1, dtype=torch.int32, device=device)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool = None

    def fits(self, out: SchedulerOutput) -> bool:
        if out.prefill or not out.decode or len(out.decode) > self.sizes[-1]:
            return False
        tables, seq_lens, _ = out.decode_tensors
        return tables.shape[1] <= self.max_blocks and int(seq_lens.max()) <= self.max_seq_len

    def fill(self, out: SchedulerOutput) -> int:
        """Copy the decode step into the static buffers; returns its padded batch size."""
        batch = len(out.decode)
        size = next(s for s in self.sizes if s >= batch)
        tables, seq_lens, slots = out.decode_tensors
        tokens = torch.tensor([c.seq.tokens[-1] for c in out.decode])
        positions = torch.tensor([c.start for c in out.decode])
        self.pad(size, start=batch)
        self.input_ids[0, :batch].copy_(tokens, non_blocking=True)
        self.positions[0, :batch].copy_(positions, non_blocking=True)
        self.block_tables[:batch, : tables.shape[1]].copy_(tables, non_blocking=True)
        self.seq_lens[:batch].copy_(seq_lens, non_blocking=True)
        self.slots[:batch].copy_(slots, non_blocking=True)
        return size

    def pad(self, size: int, start: int = 0) -> None:
        """Rows ``start`` to ``size`` of the static buffers become padding (seq_len 0, slot -1:
        they store and attend nothing); the block tables of all ``size`` rows are cleared."""
        self.input_ids[0, start:size] = 0
        self.positions[0, start:size] = 0
        self.block_tables[:size].zero_()
        self.seq_lens[start:size] = 0
        self.slots[start:size] = -1

    def forward(self, size: int) -> torch.Tensor:
        """The model over the first ``size`` rows of the static buffers (what a graph captures;
        eager, it serves the warm-up, and the CPU tests of the padding)."""
        return self.runner.forward(*self._inputs(size))

    def _inputs(self, size: int) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, int]:
        """The runner's forward arguments for the first ``size`` rows of the static buffers."""
        metadata = AttentionMetadata(
            query_lens=[1] * size,
            seq_lens=[self.max_seq_len] * size,
            block_tables=self.block_tables[:size],
            seq_lens_tensor=self.seq_lens[:size],
            slot_mapping=self.slots[:size],
            max_seq_len=self.max_seq_len,
            query_start_loc=self.query_start_loc[: size + 1],
            max_query_len=1,
            manager_window=self.manager_window,
            manager_chunk=self.manager_chunk,
        )
        return self.input_ids[:, :size], self.positions[:, :size], metadata, 0

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


class CompiledDecode(DecodeGraphs):
    """Decode steps through ``torch.compile`` on the CPU: what :class:`DecodeGraphs` does with
    CUDA graphs, one compiled graph per padded batch size over the same static buffers
    (padding rows store and attend nothing, their logits are dropped).

    Inductor's freezing turns the weights into constants, so the projections run oneDNN
    (bfloat16: AMX / AVX512-BF16) or MKL (float32) matrix products on weights packed once for
    them, the query/key/value projections as one product and the gate/up projections as
    another (``enable_concat_linear``); the norms, rotary embeddings and activations fuse into
    a few loops, and ``cpp_wrapper`` calls a step's kernels from C++ instead of Python. A size
    is compiled at its first step, or every size at once by :meth:`compile_all`; compiling takes
    long (one to two minutes per size for a 30-layer model on two cores; docs/performance.md),
    so the sizes are few: a step pads to the next one.
    The weights are captured when a size is compiled: an engine serves the weights it first
    saw.

    Every size is a function with a code object of its own (dynamo keeps compiled graphs per
    code object): it holds one graph, so its later calls skip dynamo's guards (their inputs are
    the same static buffers and frozen weights every time), and an engine's graphs, with their
    packed weights, die with it.
    """

    SIZES = (1, 8, 32)
    INDUCTOR_OPTIONS = {"freezing": True, "cpp_wrapper": True, "cpp.enable_concat_linear": True}

    def __init__(
        self,
        runner: ModelRunner,
        max_batch: int,
        max_seq_len: int,
        block_manager: BlockManager | None,
    ) -> None:
        super().__init__(runner, max_batch, max_seq_len, block_manager)
        self.sizes = [s for s in self.SIZES if s < max_batch] + [max_batch]
        self.compile_seconds: dict[int, float] = {}
        """Seconds the first step of each size took (compiling it, then running it)."""
        self._steps: dict[int, Callable[[int], torch.Tensor]] = {}

    def _step(self, size: int) -> torch.Tensor:
        return self.runner.logits(*self._inputs(size))

    def run(self, out: SchedulerOutput) -> torch.Tensor:
        size = self.fill(out)
        return self._run_size(size)[: len(out.decode)].float()

    def compile_all(self) -> dict[int, float]:
        """Compiles every size not compiled yet, now, on padding rows only (they store and
        attend nothing, so the cache is untouched); returns :attr:`compile_seconds`."""
        for size in self.sizes:
            if size not in self._steps:
                self.pad(size)
                self._run_size(size)
        return dict(self.compile_seconds)

    def _run_size(self, size: int) -> torch.Tensor:
        """The compiled step of the first ``size`` rows of the static buffers (compiled first
        if this size has not run yet)."""
        step = self._steps.get(size)
        with torch.no_grad():
            if step is not None:
                with torch.compiler.set_stance(skip_guard_eval_unsafe=True):
                    return step(size)
            started = time.perf_counter()
            function = types.FunctionType(CompiledDecode._step.__code__.replace(), globals())
            step = torch.compile(types.MethodType(function, self), fullgraph=True, dynamic=False)
            with torch._inductor.config.patch(self.INDUCTOR_OPTIONS):
                logits = step(size)
            self._steps[size] = step
            self.compile_seconds[size] = time.perf_counter() - started
            return logits
