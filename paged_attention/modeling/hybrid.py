"""The conv and recurrent states of a hybrid model's non-attention layers, as transformers' cache
interface hands them over (``get_conv_state``, ``update_conv_state``, ``get_recurrent_state``,
``update_recurrent_state``, ``has_previous_state``).

transformers keeps these states batch-wise, in ``LinearAttentionLayer``: one ``[batch, ...]``
tensor per layer and state, updated by every forward pass. :class:`BatchStates` does the same for
the rows of the batch a cache serves now (so a model computes exactly what it computes on its
default cache), and moves them to and from the sequences' state slots
(:class:`~paged_attention.kv.state_pool.StateStore`, indexed by the slots the
:class:`~paged_attention.kv.state_pool.StatefulBlockManager` gives each sequence) whenever the
rows change: beam search's reordering, a batch repeated or selected. The engine's hybrid runner
(:mod:`paged_attention.engine.hybrid_runner`) uses it the same way for the rows of each of its
passes: a step's decoding sequences, or one prompt chunk. Rolling a state back (``crop``, which
assisted generation and prompt lookup need) is refused.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from paged_attention.kv.block_manager import reassign
from paged_attention.kv.state_pool import StatefulBlockManager, StateStore

CONV, RECURRENT = "conv", "recurrent"


class BatchStates:
    """The states of ``state_layers`` for the batch being generated: ``[batch, ...]`` tensors
    keyed ``(layer, kind, state_idx)``, and whether each layer's state has seen a forward pass
    (transformers' ``has_previous_state``, the same for every row)."""

    def __init__(self, state_layers: Sequence[int], store: StateStore) -> None:
        self.state_layers = frozenset(state_layers)
        self.store = store
        self.tensors: dict[tuple[int, str, int], torch.Tensor] = {}
        self.kernel_sizes: dict[tuple[int, int], int] = {}
        self.previous: dict[tuple[int, str, int], bool] = {}

    # ------------------------------------------------------------------ transformers' calls

    def has_previous_state(self, layer_idx: int | None, state_idx: int | None) -> bool:
        if layer_idx is None:
            layer_idx = max(self.state_layers)
        self._check_layer(layer_idx)
        seen = [
            value
            for (layer, _, index), value in self.previous.items()
            if layer == layer_idx and state_idx in (None, index)
        ]
        return bool(seen) and all(seen)

    def get(self, layer_idx: int, kind: str, state_idx: int) -> torch.Tensor | None:
        """The layer's state for every row, or None before its first forward pass."""
        self._check_layer(layer_idx)
        key = (layer_idx, kind, state_idx)
        return self.tensors[key] if self.previous.get(key) else None

    def update_conv(
        self, states: torch.Tensor, layer_idx: int, state_idx: int, kernel_size: int | None
    ) -> torch.Tensor:
        """Store the last ``kernel_size`` positions of the convolution's input and return the
        input the convolution reads: the new positions after the stored ones (or, on the first
        pass, left-padded with zeros to a whole kernel), as transformers' linear-attention layer
        does."""
        self._check_layer(layer_idx)
        key = (layer_idx, CONV, state_idx)
        stored = self.tensors.get(key)
        if stored is None:
            size = states.shape[-1] if kernel_size is None else kernel_size
            self.kernel_sizes[(layer_idx, state_idx)] = size
            stored = states.new_zeros((*states.shape[:-1], size))
            self.tensors[key] = stored
        size = self.kernel_sizes[(layer_idx, state_idx)]
        if self.previous.get(key):
            full = torch.cat([stored, states], dim=-1)
        else:
            full = states
            if full.shape[-1] < size:
                full = torch.nn.functional.pad(full, (size - full.shape[-1], 0), value=0)
            self.previous[key] = True
        stored.copy_(full[..., -size:])
        return full

    def update_recurrent(
        self, states: torch.Tensor | list[torch.Tensor], layer_idx: int, state_idx: int
    ) -> torch.Tensor:
        """Store the layer's new recurrent state (the last one of a list) and return it."""
        self._check_layer(layer_idx)
        last = states if isinstance(states, torch.Tensor) else states[-1]
        key = (layer_idx, RECURRENT, state_idx)
        stored = self.tensors.get(key)
        if stored is None:
            stored = torch.zeros_like(last)
            self.tensors[key] = stored
        stored.copy_(last)
        self.previous[key] = True
        return stored

    # ------------------------------------------------------------------ rows and slots

    def save(self, slots: Sequence[int | None]) -> None:
        """Write row ``i``'s states into slot ``slots[i]`` (rows without a sequence, None, hold
        nothing), after the copies forks asked for."""
        rows = [row for row, slot in enumerate(slots) if slot is not None]
        if not rows:
            return
        index = torch.tensor(rows, dtype=torch.long)
        for key, tensor in self.tensors.items():
            self.store.scatter(key, [slots[row] for row in rows], tensor[index.to(tensor.device)])

    def load(self, slots: Sequence[int]) -> None:
        """Make the batch the states of ``slots``, row by row: every state the store holds,
        each as seen by an earlier forward pass."""
        for key in self.store.tensors:
            tensor = self.store.gather(key, slots)
            self.tensors[key] = tensor
            self.previous[key] = True
            layer, kind, index = key
            if kind == CONV:
                self.kernel_sizes[(layer, index)] = tensor.shape[-1]

    def clear(self) -> None:
        self.tensors.clear()
        self.kernel_sizes.clear()
        self.previous.clear()

    def _check_layer(self, layer_idx: int) -> None:
        if layer_idx not in self.state_layers:
            raise ValueError(
                f"layer {layer_idx} keeps no conv or recurrent state in this model (its state "
                f"layers are {sorted(self.state_layers)}): the model using this cache is not "
                "the one it was built for"
            )


class StateCacheInterface:
    """transformers' cache methods for conv and recurrent states, on a cache whose
    ``_states`` is a :class:`BatchStates` (None for a model without state layers, where each
    raises as transformers' own caches do for an attention layer). Mixed into ``PagedCache``
    ahead of ``transformers.Cache``, whose versions read per-layer objects this cache does not
    hold."""

    _states: BatchStates | None

    def _batch_states(self, layer_idx) -> BatchStates:
        if self._states is None:
            raise ValueError(
                f"layer {layer_idx} asked for a conv or recurrent state, but the model this "
                "cache was built for has no layer that keeps one"
            )
        return self._states

    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        return self._batch_states(layer_idx).get(layer_idx, CONV, state_idx)

    def update_conv_state(
        self,
        conv_states: torch.Tensor,
        layer_idx: int,
        state_idx: int = 0,
        conv_kernel_size: int | None = None,
        **kwargs,
    ) -> torch.Tensor:
        states = self._batch_states(layer_idx)
        return states.update_conv(conv_states, layer_idx, state_idx, conv_kernel_size)

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        return self._batch_states(layer_idx).get(layer_idx, RECURRENT, state_idx)

    def update_recurrent_state(
        self, recurrent_states, layer_idx: int, state_idx: int = 0, **kwargs
    ) -> torch.Tensor:
        return self._batch_states(layer_idx).update_recurrent(
            recurrent_states, layer_idx, state_idx
        )

    def has_previous_state(self, layer_idx: int | None = None, state_idx: int | None = None):
        return self._batch_states(layer_idx).has_previous_state(layer_idx, state_idx)

    def increase_count(self, layer_idx: int, state_idx: int) -> None:
        """A decode step updated a conv state in place; tokens are counted per forward pass."""
        self._batch_states(layer_idx)._check_layer(layer_idx)

    def is_recording_past(self, layer_idx: int) -> bool:
        return False

    def get_recurrent_states_to_keep(self, layer_idx: int | None = None) -> int:
        return 0

    def activate_past_recording(self, **kwargs) -> None:
        """Assisted generation and prompt lookup roll states back after rejected drafts: a
        paged cache keeps one state per sequence, so a hybrid model's is refused."""
        if self._states is not None:
            raise ValueError(
                "a PagedCache for a hybrid model keeps one conv and recurrent state per "
                "sequence and cannot roll it back to an earlier token, which assisted "
                "generation and prompt lookup decoding (prompt_lookup_num_tokens, "
                "assistant_model) need to reject draft tokens: generate without them"
            )


def reassign_with_states(
    states: BatchStates,
    manager: StatefulBlockManager,
    rows: list[int | None],
    sources: Sequence[int],
    new_id: Callable[[], int],
) -> list[int | None]:
    """:func:`~paged_attention.kv.block_manager.reassign` for a batch whose states are
    ``states``: every row's states go to its sequence's slot (after the copies earlier forks
    queued, which read slots the rows have not written yet), the rows are reassigned (forks
    queue copies of their parents' slots, carried out now), and the new rows' states are read
    back. A row without a sequence (all padding so far) reads any slot: it stores nothing."""
    states.store.copy(manager.states.drain_copies())
    states.save([None if s is None else manager.state_slot(s) for s in rows])
    new = reassign(manager, rows, sources, new_id)
    states.store.copy(manager.states.drain_copies())
    slots = [manager.state_slot(s) for s in new if s is not None]
    states.load([slots[0] if s is None else manager.state_slot(s) for s in new])
    return new
