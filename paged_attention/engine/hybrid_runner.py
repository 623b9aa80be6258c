"""The engine's steps for hybrid models: attention over the paged blocks, conv and recurrent
states in the sequences' state slots.

The model runner packs a step's sequences into one row of tokens; a hybrid model's conv and
recurrent layers would read that row as one sequence. :class:`HybridRunner` runs each chunk of a
step (a decode token, a prompt chunk) as a forward pass of its own, batch 1: its attention reads
the sequence's paged context as every step's does, and its state layers start from the state the
sequence's slot holds (a chunk at position 0 from none), so a prompt computed over several steps
carries its state from chunk to chunk (for Jamba and Zamba, whose several-token Mamba scan starts
from a zero state in transformers, a chunk that continues a state runs token by token). The new
states are staged, and written to the slots only
when the step succeeded (:meth:`HybridRunner.commit_states`, after the scheduler's update): a
step that raises leaves every slot as it was, as it leaves the blocks
(:meth:`HybridRunner.discard_states`). Copies that forks queued run after the staged states are
written (a fork made while its parent's prompt is computed copies the state after it).

:func:`check_hybrid_engine` sizes the cache for the states too (a ``max_memory`` budget holds
``max_num_seqs`` sequences' states, measured by :func:`state_bytes_per_sequence`, and blocks
for the rest) and refuses what a state cannot do: prefix caching (turned off, with a warning),
compiled and CUDA-graph decode steps (one batch-1 pass per chunk), and requests of several
sequences (``n > 1``, beam search: a request preempted by recompute forks its samples from the
prompt, a state the first sample has moved past).
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import torch

from paged_attention.engine.config import EngineConfig
from paged_attention.engine.logprobs import prompt_positions
from paged_attention.engine.model_runner import ModelRunner, StepCache
from paged_attention.engine.plan import SchedulerOutput
from paged_attention.engine.request import Request
from paged_attention.kv.cache import PagedKVCache
from paged_attention.kv.state_pool import StateSlots, StateStore
from paged_attention.kv.step_inputs import StepInputs, build_metadata
from paged_attention.modeling.geometry import ModelGeometry
from paged_attention.modeling.hybrid import BatchStates, StateCacheInterface
from paged_attention.modeling.transformers_backend import ATTN_IMPLEMENTATION, cache_argument_name

logger = logging.getLogger(__name__)

# Model types whose multi-token Mamba scan ignores the state it continues (transformers' own
# note in Jamba's mamba_scan_forward: its selective scan takes no past state).
_SCAN_IGNORES_STATE = frozenset({"jamba", "zamba"})


class HybridStepCache(StateCacheInterface, StepCache):
    """The cache of one chunk's forward pass: paged attention as :class:`StepCache`, the conv
    and recurrent states of one sequence in ``_states``."""

    def __init__(self, model, geometry: ModelGeometry, kv: PagedKVCache, states: BatchStates):
        super().__init__(model, geometry, kv)
        self._states = states


class HybridRunner(ModelRunner):
    """A :class:`ModelRunner` for hybrid models (the module docstring). ``slots``: the state
    slot of every sequence, as the block manager keeps them (read here; the copies forks queue
    there are carried out here)."""

    def __init__(self, model, geometry: ModelGeometry, kv: PagedKVCache, slots: StateSlots) -> None:
        super().__init__(model, geometry, kv)
        self.slots = slots
        self.states = BatchStates(geometry.state_layers, StateStore(slots.num_slots, kv.device))
        self.cache = HybridStepCache(model, geometry, kv, self.states)
        self._staged: list[tuple[int, dict]] = []
        self._inputs: StepInputs | None = None
        # transformers' Mamba (v1) scan of several tokens starts from a zero state, whatever the
        # cache holds: a prompt chunk that continues a state runs token by token there.
        self.token_by_token = getattr(model.config, "model_type", None) in _SCAN_IGNORES_STATE

    def run(self, out: SchedulerOutput) -> torch.Tensor:
        """The step's chunks one by one; float32 logits of the sampling rows, then of the
        prompt rows scored for logprobs, in chunk order (as :meth:`ModelRunner.run`)."""
        inputs = self._inputs = out.inputs
        ends = np.cumsum(inputs.query_lens)
        sampled, scored, staged = [], [], []
        for index, chunk in enumerate(out.chunks):
            slot = self.slots.slot(chunk.seq.seq_id)
            self.states.clear()
            if chunk.start:
                self.states.load([slot])
            first = int(ends[index] - inputs.query_lens[index])
            keep = [chunk.count - 1] if chunk.samples else []
            keep += [
                p - chunk.start for p in prompt_positions(chunk.request, chunk.start, chunk.end)
            ]
            if chunk.start and chunk.count > 1 and self.token_by_token:
                passes = [(chunk.start + i, 1, first + i) for i in range(chunk.count)]
            else:
                passes = [(chunk.start, chunk.count, first)]
            logits = torch.cat(
                [self._pass(chunk, index, start, count, row) for start, count, row in passes]
            )[keep]
            sampled.append(logits[: int(chunk.samples)])
            scored.append(logits[int(chunk.samples) :])
            staged.append((slot, dict(self.states.tensors)))
        self.states.clear()
        self._staged = staged
        return torch.cat(sampled + scored).float()

    def _pass(self, chunk, index: int, start: int, count: int, row: int) -> torch.Tensor:
        """One forward pass over tokens ``start .. start + count`` of the ``index``-th chunk of
        the step (its rows from ``row`` in the step's inputs); the logits of every token."""
        inputs = self._inputs
        seq_len = int(inputs.seq_lens[index]) - (chunk.end - start - count)
        one = StepInputs(
            np.array([count], dtype=np.int32),
            np.array([seq_len], dtype=np.int32),
            inputs.block_tables[index : index + 1],
            inputs.slot_mapping[row : row + count],
            inputs.sliding_window,
            inputs.attention_chunk_size,
        )
        tokens = chunk.request.token_slice(chunk.seq, start, start + count)
        return self.forward(
            torch.tensor([tokens], device=self.device),
            torch.tensor([list(range(start, start + count))], device=self.device),
            build_metadata(one, self.device),
            0,
        )

    def commit_states(self) -> None:
        """The step succeeded: its chunks' states go to their slots, then the queued copies."""
        store = self.states.store
        for slot, tensors in self._staged:
            for key, tensor in tensors.items():
                store.scatter(key, [slot], tensor)
        self._staged = []
        store.copy(self.slots.drain_copies())

    def discard_states(self) -> None:
        """The step failed: no slot changes, and the forks it made are undone."""
        self._staged = []
        self.slots.drain_copies()


def check_hybrid_engine(model, config: EngineConfig, geometry: ModelGeometry) -> EngineConfig:
    """``config`` as a hybrid model's engine can run it: prefix caching off (with a warning);
    compiled or CUDA-graph decode steps and speculative decoding refused with ValueError; a
    ``max_memory`` budget holds the state slots of ``max_num_seqs`` sequences, and the KV
    blocks what is left."""
    name = type(model).__name__
    if config.compile or config.cuda_graphs:
        raise ValueError(
            f"{name} is a hybrid model: the engine runs each of its chunks as a forward pass of "
            "its own, which compile=True and cuda_graphs=True do not capture; pass them False"
        )
    if config.speculative is not None:
        raise ValueError(
            f"{name} is a hybrid model: its conv and recurrent states cannot be cut back past "
            "rejected draft tokens, so speculative decoding is refused; pass speculative=None"
        )
    cache = config.cache
    if cache.enable_prefix_caching:
        logger.warning(
            "prefix caching is off for %s: a cached prefix's blocks hold its keys and values, "
            "not the state its conv and recurrent layers reach after it",
            name,
        )
        cache = dataclasses.replace(cache, enable_prefix_caching=False)
    if cache.max_memory is not None:
        num_blocks, _ = cache.sizes(geometry)
        slots = config.scheduler.max_num_seqs
        slot_bytes = state_bytes_per_sequence(model, geometry)
        kept = num_blocks - -(-slots * slot_bytes // cache.block_bytes(geometry))
        if kept < 1:
            raise ValueError(
                f"max_memory={cache.max_memory!r} holds {num_blocks} KV blocks, but the conv and "
                f"recurrent states of max_num_seqs={slots} sequences ({slot_bytes} bytes each) "
                "leave none: give more memory or fewer sequences"
            )
        cache = dataclasses.replace(cache, num_blocks=kept, max_memory=None)
    return dataclasses.replace(config, cache=cache, cuda_graphs=False)


def state_bytes_per_sequence(model, geometry: ModelGeometry) -> int:
    """Bytes of one sequence's conv and recurrent states: read from one forward pass of one
    token over a one-block cache (the states' shapes and dtypes are the model's own)."""
    kv = geometry.kv_cache(8, 1, None)
    states = BatchStates(geometry.state_layers, StateStore(1, kv.device))
    cache = HybridStepCache(model, geometry, kv, states)
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    one = StepInputs(
        np.ones(1, dtype=np.int32),
        np.ones(1, dtype=np.int32),
        np.zeros((1, 1), dtype=np.int32),
        np.zeros(1, dtype=np.int64),
    )
    cache.metadata = build_metadata(one, geometry.device)
    with torch.inference_mode():
        model(
            input_ids=torch.zeros((1, 1), dtype=torch.long, device=geometry.device),
            position_ids=torch.zeros((1, 1), dtype=torch.long, device=geometry.device),
            use_cache=True,
            **{cache_argument_name(model): cache},
        )
    return sum(t[0].numel() * t.element_size() for t in states.tensors.values())


def check_hybrid_request(request: Request) -> None:
    """A hybrid model's engine serves requests of one sequence (the module docstring)."""
    params = request.params
    if params.num_seqs > 1:
        how = f"a beam width of {params.beam_width}" if params.is_beam_search else f"n={params.n}"
        raise ValueError(
            f"request {request.request_id} runs {params.num_seqs} sequences ({how}): the engine "
            "serves a hybrid model's requests one sequence each (n=1, no beam search), since a "
            "request preempted by recompute forks its samples from the prompt, whose state the "
            "first sample has moved past; generate() on a PagedCache serves n > 1 and beams"
        )
