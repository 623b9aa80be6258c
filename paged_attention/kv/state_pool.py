"""State slots for hybrid models: the fixed-size state of their non-attention layers.

A hybrid model (LFM2, Qwen3-Next, Jamba, ...) mixes attention layers, whose keys and values grow
with the sequence and live in the paged KV cache, with layers that keep a state of fixed size per
sequence instead: a convolution window, a recurrent (SSM or linear-attention) matrix. Such a state
cannot be paged: every new token rewrites all of it. So each sequence holds one *state slot*, an
index into per-layer tensors of ``[num_slots, *state shape]`` (vLLM v1's hybrid KV-cache manager
keeps a Mamba state per request beside its block pool the same way).

Three parts, as for the blocks (the manager plans, the cache executes):

* :class:`StateSlots` (no tensors): which slot each sequence holds, the free slots (the lowest
  first, so that the storage stays compact), and the copies a fork asks for.
* :class:`StatefulBlockManager`: a :class:`~paged_attention.kv.block_manager.BlockManager` that
  owns a :class:`StateSlots`: a slot is taken with the sequence (``allocate``, ``fork``: the
  child's slot gets a copy of the parent's state), released with it (``free``), and counted by
  ``can_allocate``. What a recurrent state cannot do is refused, naming the reason: prefix
  caching (a cached prefix's blocks do not give the state after it), swapping and cutting
  computed tokens off (``truncate`` but with ``cache=False``, which releases slots reserved
  for tokens no forward pass computed, or to the sequence's own length, which cuts nothing: a
  state cannot be cut back; preempt by recompute instead). Every call validates before it
  changes anything, blocks or slots.
* :class:`StateStore`: the tensors the slots index, one per (layer, kind, index) state a layer
  keeps, allocated from the first state a layer writes (shape and dtype taken from the model)
  and grown by doubling up to ``num_slots`` rows as higher slots are used; it executes the
  manager's copies (:meth:`StateStore.copy`) and moves a batch's states in and out
  (:meth:`StateStore.gather`, :meth:`StateStore.scatter`).
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from paged_attention.kv.block_errors import OutOfBlocksError, SwapError, UnknownSequenceError
from paged_attention.kv.block_manager import AllocStatus, BlockManager, _as_int

__all__ = [
    "OutOfStateSlotsError",
    "StateSlotStats",
    "StateSlots",
    "StateStore",
    "StatefulBlockManager",
]


class OutOfStateSlotsError(OutOfBlocksError):
    """Every state slot is held: no sequence can start until one is freed."""


@dataclass(frozen=True)
class StateSlotStats:
    num_slots: int
    used_slots: int
    free_slots: int
    bytes_per_slot: int  # every state layer's state of one sequence (0 before the first write)
    bytes_in_use: int  # used_slots * bytes_per_slot


class StateSlots:
    """The state slot of every live sequence (bookkeeping only). A fork takes a slot for the
    child and records the ``(parent slot, child slot)`` copy, which :meth:`drain_copies` hands to
    the :class:`StateStore` before the next forward pass writes any state."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = _as_int(num_slots, "num_state_slots", 1)
        self._free = list(range(self.num_slots))  # a heap: the lowest slot is taken first
        self.slot_of: dict[int, int] = {}
        self._copies: list[tuple[int, int]] = []

    def num_free(self) -> int:
        return len(self._free)

    def slot(self, seq_id: int) -> int:
        try:
            return self.slot_of[seq_id]
        except KeyError:
            raise UnknownSequenceError(f"sequence {seq_id} holds no state slot") from None

    def slots(self, seq_ids: Iterable[int]) -> list[int]:
        return [self.slot(seq_id) for seq_id in seq_ids]

    def check_room(self, needed: int, what: str) -> None:
        if needed > len(self._free):
            raise OutOfStateSlotsError(
                f"{what} needs {needed} state slots, {len(self._free)} of {self.num_slots} are "
                "free (one per sequence for the state of the model's non-attention layers)"
            )

    def take(self, seq_ids: Sequence[int]) -> None:
        """Slots for new sequences (the caller checked room and that they are new)."""
        for seq_id in seq_ids:
            self.slot_of[seq_id] = heapq.heappop(self._free)

    def fork(self, parent_ids: Sequence[int], child_ids: Sequence[int]) -> None:
        """Slots for ``child_ids``, each to receive a copy of its parent's state."""
        self.take(child_ids)
        for parent_id, child_id in zip(parent_ids, child_ids):
            self._copies.append((self.slot_of[parent_id], self.slot_of[child_id]))

    def free(self, seq_ids: Iterable[int]) -> None:
        for seq_id in seq_ids:
            heapq.heappush(self._free, self.slot_of.pop(seq_id))

    def drain_copies(self) -> list[tuple[int, int]]:
        """The ``(src, dst)`` slot copies forks asked for since the last drain, in order (a
        slot freed and taken again in between is copied in the order that gives every sequence
        its parent's state: no forward pass writes a state between two drains)."""
        copies, self._copies = self._copies, []
        return copies

    def stats(self, bytes_per_slot: int = 0) -> StateSlotStats:
        used = len(self.slot_of)
        return StateSlotStats(
            num_slots=self.num_slots,
            used_slots=used,
            free_slots=len(self._free),
            bytes_per_slot=bytes_per_slot,
            bytes_in_use=used * bytes_per_slot,
        )


class StatefulBlockManager(BlockManager):
    """A :class:`BlockManager` whose sequences also hold one state slot each (the module
    docstring). ``num_state_slots``: how many sequences may live at once; the other arguments
    are the block manager's, but prefix caching, which a recurrent state cannot use, is
    refused."""

    def __init__(
        self,
        num_device_blocks: int,
        block_size: int,
        num_host_blocks: int = 0,
        *,
        num_state_slots: int,
        **kwargs,
    ) -> None:
        if kwargs.get("enable_prefix_caching"):
            raise ValueError(
                "prefix caching cannot serve a hybrid model: a cached prefix's blocks hold its "
                "keys and values, but not the state its recurrent or convolution layers reach "
                "after it (turn enable_prefix_caching off)"
            )
        super().__init__(num_device_blocks, block_size, num_host_blocks, **kwargs)
        self.states = StateSlots(num_state_slots)

    def state_slot(self, seq_id: int) -> int:
        return self.states.slot(seq_id)

    def can_allocate(self, num_tokens_or_tokens) -> AllocStatus:
        status = super().can_allocate(num_tokens_or_tokens)
        if status is AllocStatus.OK and not self.states.num_free():
            return AllocStatus.LATER
        return status

    def allocate(self, seq_id: int, tokens) -> None:
        if seq_id not in self._tables.row_of:  # a duplicate raises in allocate, unchanged
            self.states.check_room(1, f"allocating sequence {seq_id}")
        super().allocate(seq_id, tokens)
        self.states.take([seq_id])

    def fork_many(self, parent_ids: Sequence[int], child_ids: Sequence[int]) -> None:
        self.states.check_room(len(child_ids), f"forking {len(child_ids)} sequences")
        super().fork_many(parent_ids, child_ids)
        self.states.fork(list(parent_ids), list(child_ids))

    def free_many(self, seq_ids: Iterable[int], *, cache: bool = True) -> None:
        seq_ids = list(seq_ids)
        super().free_many(seq_ids, cache=cache)
        self.states.free(seq_ids)

    def truncate(self, seq_id: int, num_tokens: int, *, cache: bool = True):
        """Only ``cache=False``: release the slots reserved for tokens no forward pass computed
        (a step that failed; the state never saw them), or a cut of nothing (a fork at its
        parent's length). Cutting computed tokens off (transformers' ``crop``, rejected draft
        tokens) is refused: the state holds every token it has seen."""
        if cache and num_tokens != self.num_tokens(seq_id):
            raise ValueError(
                f"cannot cut sequence {seq_id} back to {num_tokens} tokens: the state of a "
                "hybrid model's recurrent or convolution layers holds every token it has seen "
                "and cannot be cut back (preempt by recompute instead; no speculative decoding "
                "or crop)"
            )
        return super().truncate(seq_id, num_tokens, cache=False)

    def can_swap_out(self, seq_ids: Iterable[int]) -> bool:
        return False

    def swap_out(self, seq_ids: Iterable[int]) -> list[tuple[int, int]]:
        raise SwapError(
            "a hybrid model's sequences are not swapped (their recurrent state stays in its "
            "slot): preempt them by recompute"
        )

    def state_stats(self, bytes_per_slot: int = 0) -> StateSlotStats:
        return self.states.stats(bytes_per_slot)


class StateStore:
    """The state tensors the slots index: for every ``(layer, kind, index)`` state (``kind``
    ``"conv"`` or ``"recurrent"``, ``index`` transformers' ``state_idx``) one tensor
    ``[rows, *shape]``, allocated from the first state written and grown by doubling, up to
    ``num_slots`` rows."""

    def __init__(self, num_slots: int, device: torch.device | str | None = None) -> None:
        self.num_slots = _as_int(num_slots, "num_slots", 1)
        self.device = None if device is None else torch.device(device)
        self.tensors: dict[tuple[int, str, int], torch.Tensor] = {}

    @property
    def bytes_per_slot(self) -> int:
        """Bytes one sequence's states take (those written so far)."""
        return sum(t[0].numel() * t.element_size() for t in self.tensors.values())

    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def gather(self, key: tuple[int, str, int], slots: Sequence[int]) -> torch.Tensor | None:
        """The states of ``slots`` as one ``[len(slots), *shape]`` tensor (a copy), or None
        when that state was never written."""
        tensor = self.tensors.get(key)
        if tensor is None:
            return None
        self._check_slots(slots)
        return tensor[torch.tensor(list(slots), dtype=torch.long, device=tensor.device)]

    def scatter(self, key: tuple[int, str, int], slots: Sequence[int], states: torch.Tensor):
        """Store ``states`` (``[len(slots), *shape]``) into ``slots``."""
        self._check_slots(slots)
        if states.shape[0] != len(slots):
            raise ValueError(f"{states.shape[0]} states for {len(slots)} slots of {key}")
        tensor = self._ensure(key, states, max(slots, default=-1) + 1)
        if tuple(tensor.shape[1:]) != tuple(states.shape[1:]) or tensor.dtype != states.dtype:
            raise ValueError(
                f"state {key} holds {tuple(tensor.shape[1:])} {tensor.dtype} per slot, got "
                f"{tuple(states.shape[1:])} {states.dtype}"
            )
        index = torch.tensor(list(slots), dtype=torch.long, device=tensor.device)
        tensor.index_copy_(0, index, states.to(tensor.device))

    def copy(self, pairs: Sequence[tuple[int, int]]) -> None:
        """``slot[dst] = slot[src]`` in every state tensor, pair after pair (in order)."""
        self._check_slots([slot for pair in pairs for slot in pair])
        for key, tensor in self.tensors.items():
            for src, dst in pairs:
                if max(src, dst) >= tensor.shape[0]:
                    tensor = self._grow(key, max(src, dst) + 1)
                tensor[dst].copy_(tensor[src])

    def clear(self) -> None:
        self.tensors.clear()

    def _check_slots(self, slots: Iterable[int]) -> None:
        bad = [slot for slot in slots if not 0 <= slot < self.num_slots]
        if bad:
            raise ValueError(f"state slots {bad} out of range for {self.num_slots} slots")

    def _ensure(self, key, like: torch.Tensor, rows: int) -> torch.Tensor:
        tensor = self.tensors.get(key)
        if tensor is None:
            device = self.device or like.device
            tensor = torch.zeros((0, *like.shape[1:]), dtype=like.dtype, device=device)
            self.tensors[key] = tensor
        return self._grow(key, rows) if rows > tensor.shape[0] else tensor

    def _grow(self, key, rows: int) -> torch.Tensor:
        old = self.tensors[key]
        capacity = max(old.shape[0], 1)
        while capacity < rows:
            capacity *= 2
        capacity = min(capacity, self.num_slots)
        new = torch.zeros((capacity, *old.shape[1:]), dtype=old.dtype, device=old.device)
        new[: old.shape[0]] = old
        self.tensors[key] = new
        return new
