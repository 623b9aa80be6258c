"""The engine's steps for hybrid models: attention over the paged blocks, conv and recurrent
states in the sequences' state slots.

The model runner packs a step's sequences into one row of tokens; a hybrid model's conv and
recurrent layers would read that row as one sequence. :class:`HybridRunner` runs a step as
passes whose rows are sequences: all its decodes in one pass of batch ``B``, one token a row
(each row's states gathered from its sequence's slot into the ``[B, ...]`` tensors the model's
layers update, as transformers' own cache keeps a batch), then each prompt chunk in a pass of
its own, batch 1 (prompt chunks of different lengths in one batch would need padding, which
the state layers would read). Attention reads each sequence's paged context as every step's
does; a prompt chunk at position 0 starts from no state, a later one from the state its slot
holds, so a prompt computed over several steps carries its state from chunk to chunk (for Jamba
and Zamba, whose several-token Mamba scan starts from a zero state in transformers, a chunk that
continues a state runs token by token). The new states are staged, and written to the slots
only when the step succeeded (:meth:`HybridRunner.commit_states`, after the scheduler's
update): a step that raises leaves every slot as it was, as it leaves the blocks
(:meth:`HybridRunner.discard_states`).

Requests of several sequences (``n > 1``, beam search) fork state slots as they fork blocks:
the first token's samples and the beams the update reassigns copy their parent's slot after the
step's states are written (:meth:`HybridRunner.commit_states`). A request preempted by
recompute (hybrid sequences are never swapped) recomputes its first sequence to the end of the
prompt and no further until its other sequences have forked from it there (the scheduler's
:class:`~paged_attention.engine.reservations.ChunkReserver` holds it back): they copy its slot
before the step's passes run, so each starts from the prompt's state and recomputes its own
tokens.

:func:`check_hybrid_engine` sizes the cache for the states too (a ``max_memory`` budget holds
``max_num_seqs`` sequences' states, measured by :func:`state_bytes_per_sequence`, and blocks
for the rest) and refuses what a state cannot do: prefix caching (turned off, with a warning),
speculative decoding (a state cannot drop rejected drafts), and compiled and CUDA-graph decode
steps (not captured for these passes).
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
from paged_attention.kv.cache import PagedKVCache
from paged_attention.kv.state_pool import StateSlots, StateStore
from paged_attention.kv.step_inputs import StepInputs, build_metadata
from paged_attention.modeling.geometry import ModelGeometry
from paged_attention.modeling.hybrid import BatchStates, StateCacheInterface
from paged_attention.modeling.minimax import cache_class
from paged_attention.modeling.transformers_backend import ATTN_IMPLEMENTATION, cache_argument_name

logger = logging.getLogger(__name__)

# Model types whose multi-token Mamba scan ignores the state it continues (transformers' own
# note in Jamba's mamba_scan_forward: its selective scan takes no past state).
_SCAN_IGNORES_STATE = frozenset({"jamba", "zamba"})


class HybridStepCache(StateCacheInterface, StepCache):
    """The cache of one forward pass of the hybrid runner: paged attention as :class:`StepCache`,
    over ``[batch, heads, q, dim]`` queries (one prompt chunk: batch 1; a step's decodes: one
    token per row), and the conv and recurrent states of the pass's rows in ``_states``. For
    MiniMax, a subclass that is its ``MiniMaxCache`` too (:mod:`paged_attention.modeling.minimax`).
    """

    def __new__(cls, model=None, *args, **kwargs):
        return super().__new__(cache_class(cls, model))

    def __init__(self, model, geometry: ModelGeometry, kv: PagedKVCache, states: BatchStates):
        super().__init__(model, geometry, kv)
        self._states = states

    def _attend_layer(self, layer_idx, query, key, value, padding, scale, sinks):
        batch, num_heads, q_len, _ = query.shape
        metadata = self.metadata
        if metadata is None:
            raise ValueError("the cache's metadata must describe the pass before it runs")
        if batch * q_len != metadata.num_tokens or (batch > 1 and q_len != 1):
            raise ValueError(
                f"the pass holds {metadata.num_tokens} tokens, as one row of a prompt chunk or "
                f"one token per row; the forward got input of shape [{batch}, {q_len}]"
            )
        packed = [  # row after row: the metadata's sequences, in order
            t.transpose(1, 2).reshape(batch * q_len, t.shape[1], t.shape[3])
            for t in (query, key, value)
        ]
        out = self._packed_attention(layer_idx, *packed, metadata, scale, sinks)
        return out.view(batch, q_len, num_heads, value.shape[3])


class HybridRunner(ModelRunner):
    """A :class:`ModelRunner` for hybrid models (the module docstring). ``slots``: the state
    slot of every sequence, as the block manager keeps them (read here; the copies forks queue
    there are carried out here)."""

    def __init__(self, model, geometry: ModelGeometry, kv: PagedKVCache, slots: StateSlots) -> None:
        super().__init__(model, geometry, kv)
        self.slots = slots
        self.states = BatchStates(geometry.state_layers, StateStore(slots.num_slots, kv.device))
        self.cache = HybridStepCache(model, geometry, kv, self.states)
        self._staged: list[tuple[list[int], dict]] = []
        # transformers' Mamba (v1) scan of several tokens starts from a zero state, whatever the
        # cache holds: a prompt chunk that continues a state runs token by token there.
        self.token_by_token = getattr(model.config, "model_type", None) in _SCAN_IGNORES_STATE

    def run(self, out: SchedulerOutput) -> torch.Tensor:
        """The step's decodes in one pass, then its prompt chunks one by one; float32 logits of
        the sampling rows, then of the prompt rows scored for logprobs, in chunk order (as
        :meth:`ModelRunner.run`)."""
        # Forks the scheduler made for this step (the samples or beams of a recomputed request,
        # forked from its first sequence at the end of the prompt) copy the parent's state as
        # the last step left it; the child's passes below read their copy.
        self.states.store.copy(self.slots.drain_copies())
        staged, sampled, scored = [], [], []
        try:
            if out.decode:
                sampled.append(self._decode_pass(out.decode, out.inputs))
                staged.append(([self.slots.slot(c.seq.seq_id) for c in out.decode], self._taken()))
            ends = np.cumsum(out.inputs.query_lens)
            for index in range(len(out.decode), len(out.chunks)):
                chunk = out.chunks[index]
                slot = self.slots.slot(chunk.seq.seq_id)
                self.states.clear()
                if chunk.start:
                    self.states.load([slot])
                row = int(ends[index] - chunk.count)
                logits = self._chunk_passes(chunk, out.inputs, index, row)
                sampled.append(logits[: int(chunk.samples)])
                scored.append(logits[int(chunk.samples) :])
                staged.append(([slot], self._taken()))
        finally:
            self.states.clear()
        self._staged = staged
        return torch.cat(sampled + scored).float()

    def _taken(self) -> dict:
        return dict(self.states.tensors)

    def _decode_pass(self, chunks, inputs: StepInputs) -> torch.Tensor:
        """Every decoding sequence's next token in one pass of batch ``len(chunks)``, one token
        a row, the rows' states gathered from their slots; the logits of each row. The decode
        rows come first in the step's inputs."""
        count = len(chunks)
        self.states.clear()
        self.states.load(self.slots.slots(c.seq.seq_id for c in chunks))
        rows = StepInputs(
            inputs.query_lens[:count],
            inputs.seq_lens[:count],
            inputs.block_tables[:count],
            inputs.slot_mapping[:count],
            inputs.sliding_window,
            inputs.attention_chunk_size,
        )
        tokens = [chunk.fed_tokens() for chunk in chunks]
        positions = [[chunk.start] for chunk in chunks]
        return self._forward_rows(tokens, positions, rows)[:, -1]

    def _chunk_passes(self, chunk, inputs: StepInputs, index: int, row: int) -> torch.Tensor:
        """A prompt chunk (the ``index``-th chunk of the step, its rows from ``row``) in one
        pass, or token by token where a multi-token scan ignores the state it continues; the
        logits of its sampling row, then of its prompt rows scored for logprobs."""
        keep = [chunk.count - 1] if chunk.samples else []
        keep += [p - chunk.start for p in prompt_positions(chunk.request, chunk.start, chunk.end)]
        if chunk.start and chunk.count > 1 and self.token_by_token:
            passes = [(chunk.start + i, 1, row + i) for i in range(chunk.count)]
        else:
            passes = [(chunk.start, chunk.count, row)]
        logits = [self._pass(chunk, inputs, index, *one) for one in passes]
        return torch.cat(logits)[keep]

    def _pass(self, chunk, inputs: StepInputs, index, start: int, count: int, row: int):
        """One pass over tokens ``start .. start + count`` of the ``index``-th chunk of the
        step (its rows from ``row`` in the step's inputs); the logits of every token."""
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
        return self._forward_rows([tokens], [list(range(start, start + count))], one)[0]

    def _forward_rows(self, tokens: list[list[int]], positions: list[list[int]], inputs):
        """One forward pass of ``tokens`` (rows of equal length) at ``positions`` through the
        hybrid cache; the logits ``[rows, tokens, vocab]``."""
        self.cache.metadata = build_metadata(inputs, self.device)
        try:
            with torch.inference_mode():
                return self.model(
                    input_ids=torch.tensor(tokens, device=self.device),
                    position_ids=torch.tensor(positions, device=self.device),
                    use_cache=True,
                    **{self._cache_argument: self.cache},
                ).logits
        finally:
            self.cache.metadata = None

    def commit_states(self) -> None:
        """The step succeeded: its passes' states go to their slots, then the copies forks
        queued in the update (the first token's samples, beams reassigned), which read them."""
        store = self.states.store
        for slots, tensors in self._staged:
            for key, tensor in tensors.items():
                store.scatter(key, slots, tensor)
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
            f"{name} is a hybrid model: the engine runs its steps as passes whose rows are "
            "sequences (the decodes batched, each prompt chunk alone), which compile=True and "
            "cuda_graphs=True do not capture; pass them False"
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
