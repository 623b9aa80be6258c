"""Hugging Face transformers ``generate()`` on a paged KV cache::

    import paged_attention.integrations.transformers  # registers "paged_attention"
    from paged_attention.integrations.transformers import PagedCache

    model.set_attn_implementation("paged_attention")
    out = model.generate(**inputs, cache=PagedCache(model, num_blocks=1024))

(``past_key_values=`` in transformers releases before the ``cache`` keyword.) The attention
implementation and the cache base live in
:mod:`paged_attention.modeling.transformers_backend`; the model is read by
:class:`~paged_attention.modeling.geometry.ModelGeometry` (docs/models.md lists the supported
families). The first layer of a forward pass does the step's bookkeeping in the block manager:

* the first forward of a ``generate`` call allocates one sequence per batch row; rows that are
  exact copies of the previous row (``num_return_sequences``, beams) *fork* its blocks instead;
* later forwards append slots and run the copy-on-write copies the manager asks for, for all
  layers in one ``copy_blocks`` call;
* ``reorder_cache`` (beam search), ``batch_select_indices`` and ``batch_repeat_interleave``
  become forks and frees of block tables: no key or value is copied, and the next step copies at
  most the one partly filled last block of a beam that shares it.
"""

from __future__ import annotations

import functools
import itertools

import torch

from paged_attention.attention import AttentionMetadata
from paged_attention.kv.block_manager import OutOfBlocksError, reassign
from paged_attention.kv.state_pool import OutOfStateSlotsError, StateStore
from paged_attention.kv.step_inputs import StepInputs, build_metadata
from paged_attention.modeling.geometry import ModelGeometry
from paged_attention.modeling.hybrid import BatchStates, StateCacheInterface, reassign_with_states
from paged_attention.modeling.mla import resolve as resolve_mla
from paged_attention.modeling.transformers_backend import (
    ATTN_IMPLEMENTATION,
    PagedCacheBase,
    cache_argument_name,
)

__all__ = ["ATTN_IMPLEMENTATION", "PagedCache", "cache_argument_name"]


class PagedCache(StateCacheInterface, PagedCacheBase):
    """A ``transformers.Cache`` for ``generate()`` whose keys and values live in a
    :class:`PagedKVCache`, managed by a :class:`~paged_attention.kv.block_manager.BlockManager`.

    ``num_blocks`` blocks of ``block_size`` tokens, or as many as ``max_memory`` allows: bytes
    (int) or a fraction (float) of free CUDA memory (of available host memory on CPU). With
    neither: 90% of free memory on CUDA; on CPU a quarter of the available host memory, at most
    4 GiB. ``num_host_blocks`` adds host swap space, ``kv_cache_dtype`` is ``"auto"`` or an fp8
    format (with fixed ``k_scale``/``v_scale``, or without them each layer's scales calibrated
    from the prompt's keys and values: :class:`~paged_attention.kv.cache.PagedKVCache`), and
    ``enable_prefix_caching`` lets sequences allocated with their token ids share cached prompt
    blocks. ``mla``: how multi-head latent attention (DeepSeek, LongCat-Flash) is cached:
    ``"latent"`` (one vector per token and layer: :mod:`paged_attention.modeling.mla`),
    ``"expanded"`` (every head's key and value), or None: latent unless the cache is fp8.

    Supports decoder-only models whose attention goes through transformers' attention
    interface (docs/models.md: GQA/MQA, sliding windows, soft-caps, sinks, per-layer shapes),
    with ``attn_implementation="paged_attention"`` and the head sizes the kernels are built for;
    what it cannot serve raises :class:`~paged_attention.modeling.geometry.UnsupportedModelError`
    here, naming the reason. One ``PagedCache`` serves the model it was built for, one ``generate``
    call at a time; :meth:`reset` frees every block for the next one. A later ``generate`` on
    the same cache must continue what it holds (its ``input_ids`` start with the tokens already
    cached, as with transformers' own caches); a new prompt without ``reset()`` raises. To see
    those ``input_ids``, the first ``PagedCache`` of a model wraps the model's
    ``prepare_inputs_for_generation`` once (the wrapper only compares, at the first step of a
    ``generate`` call).

    Hybrid models (docs/models.md) keep conv and recurrent states in one slot per sequence
    (:mod:`paged_attention.kv.state_pool`), at most ``num_state_slots`` at once (beam search
    needs one per beam); when the blocks are sized by a budget (``max_memory`` or the default
    one), the states of ``num_state_slots`` sequences come out of it first, measured with one
    forward pass of one token at construction. States cannot roll back, so ``crop`` and prefix
    caching are refused.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        block_size: int = 16,
        num_blocks: int | None = None,
        max_memory: int | float | None = None,
        *,
        num_host_blocks: int = 0,
        kv_cache_dtype: str = "auto",
        k_scale: float | None = None,
        v_scale: float | None = None,
        enable_prefix_caching: bool = False,
        mla: str | None = None,
        num_state_slots: int = 64,
    ) -> None:
        geometry = ModelGeometry.of(model, mla=resolve_mla(mla, kv_cache_dtype=kv_cache_dtype))
        kv_options = {"kv_cache_dtype": kv_cache_dtype, "k_scale": k_scale, "v_scale": v_scale}
        kv_options["num_host_blocks"] = num_host_blocks
        sizes = (block_size, num_blocks, max_memory)
        kv = _kv_cache(model, geometry, sizes, num_state_slots, mla, kv_options)
        super().__init__(model, geometry, kv)
        self.block_manager = geometry.block_manager(kv, enable_prefix_caching, num_state_slots)
        self._states = None
        if geometry.state_layers:
            store = StateStore(num_state_slots, kv.device)
            self._states = BatchStates(geometry.state_layers, store)
        self._ids = itertools.count()
        self._rows: list[int | None] = []  # the sequence of each batch row
        self._seen = 0  # tokens per row so far, padding included
        self._metadata: AttentionMetadata | None = None
        self._token_index: torch.Tensor | None = None
        self._last_layer = self.num_layers
        self._step_open = False
        self._fed_ids: torch.Tensor | None = None  # input_ids fed so far
        self.peak_blocks_in_use = 0
        _check_generation_inputs(model)

    # ------------------------------------------------------------------ Cache API

    def _begin_layer(self, layer_idx: int) -> None:
        if layer_idx <= self._last_layer:
            self._step_open = True  # the first layer of a new forward pass
        self._last_layer = layer_idx

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._seen

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return self._seen

    def get_mask_sizes(self, query_length, layer_idx: int = 0) -> tuple[int, int]:
        # transformers passed cache_position (a tensor) before it passed the query length.
        if isinstance(query_length, torch.Tensor):
            query_length = query_length.shape[0]
        return self._seen + int(query_length), 0

    @property
    def batch_size(self) -> int:
        return len(self._rows) if self._rows else -1

    def reset(self) -> None:
        """Free every sequence (all blocks return to the pool) and forget the batch."""
        self.block_manager.free_many(self.block_manager.seq_ids())
        if self._states is not None:
            self._states.clear()
            self.block_manager.states.drain_copies()  # of sequences now freed
        self._rows = []
        self._seen = 0
        self._fed_ids = None
        self._last_layer = self.num_layers

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: row ``i`` continues old row ``beam_idx[i]``, by forks and frees."""
        self._remap_rows(beam_idx.tolist())

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._remap_rows(torch.as_tensor(indices).tolist())

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Each row becomes ``repeats`` rows sharing its blocks (forks, no copy)."""
        self._remap_rows([row for row in range(len(self._rows)) for _ in range(repeats)])

    @property
    def is_croppable(self) -> bool:
        return self._states is None

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last tokens of every row (assisted generation and prompt lookup reject draft
        tokens this way): a negative argument removes that many, a positive one is the number
        of tokens to keep (the meaning older transformers releases give it), and 0 keeps
        everything. Blocks wholly past
        the cut return to the pool; a kept block that other rows share is copied before it is
        written again (``BlockManager.truncate``)."""
        if isinstance(tokens_to_remove, bool) or not isinstance(tokens_to_remove, int):
            raise ValueError(f"crop takes an int, got {tokens_to_remove!r}")
        if self._states is not None:
            self.activate_past_recording()  # raises: a hybrid model's states are not cut back
        if tokens_to_remove == 0 or not self._rows:
            return  # transformers calls crop(0) to mean "keep everything"
        keep = self._seen + tokens_to_remove if tokens_to_remove < 0 else tokens_to_remove
        if keep >= self._seen:
            return
        cut = self._seen - keep
        held = [(s, self.block_manager.num_tokens(s)) for s in self._rows if s is not None]
        if keep < 0 or any(length < cut for _, length in held):
            raise ValueError(
                f"cannot crop {cut} tokens: this PagedCache holds {self._seen} per row, some "
                "of them padding"
            )
        pairs = []
        for seq_id, length in dict(held).items():  # forked rows may repeat a sequence
            pairs += self.block_manager.truncate(seq_id, length - cut)
        self.kv_cache.copy_blocks(pairs)
        self._seen = keep
        if self._fed_ids is not None:
            self._fed_ids = self._fed_ids[:, :keep]

    # ------------------------------------------------------------------ stats

    def blocks_in_use(self) -> int:
        return self.block_manager.num_device_blocks - self.block_manager.num_free_device_blocks()

    def stats(self):
        """The block manager's stats, bytes counted with this cache's bytes per block."""
        return self.block_manager.stats(self.kv_cache.bytes_per_block)

    def state_stats(self):
        """A hybrid model's state slots (used, free, bytes per slot), or None for others."""
        if self._states is None:
            return None
        return self.block_manager.state_stats(self._states.store.bytes_per_slot)

    # ------------------------------------------------------------------ attention

    def _attend_layer(self, layer_idx, query, key, value, padding, scale, sinks):
        batch, num_heads, q_len, _ = query.shape
        v_head_size = value.shape[3]  # the keys' but for multi-head latent attention
        if self._step_open:
            self._begin_step(batch, q_len, key, value, padding)
            self._step_open = False
        packed = [
            t.transpose(1, 2).reshape(batch * q_len, t.shape[1], t.shape[3])
            for t in (query, key, value)
        ]
        if self._token_index is not None:
            packed = [t[self._token_index] for t in packed]
        out = self._packed_attention(layer_idx, *packed, self._metadata, scale, sinks)
        if self._token_index is not None:
            full = out.new_zeros(batch * q_len, num_heads, v_head_size)
            full[self._token_index] = out
            out = full
        return out.view(batch, q_len, num_heads, v_head_size)

    def _begin_step(self, batch, q_len, key, value, attention_mask) -> None:
        """Bookkeeping once per forward pass, before the first layer stores anything."""
        real = _real_tokens(batch, q_len, attention_mask)
        counts = [q_len] * batch if real is None else real.sum(dim=1).tolist()
        if not self._rows:
            self._rows = [None] * batch
            # Each rank compares its own heads; and-ed, every rank forks the same rows.
            duplicates = self.tensor_parallel.all_ranks(_duplicate_rows(key, value, real))
        elif batch != len(self._rows):
            raise ValueError(
                f"this PagedCache holds a batch of {len(self._rows)} rows but the input has "
                f"{batch}; call cache.reset() before generating for a new batch"
            )
        else:
            duplicates = [False] * batch

        try:
            if all(n == 1 for n in counts) and None not in self._rows:
                pairs, *arrays = self.block_manager.decode_step(self._rows)
                self.kv_cache.copy_blocks(pairs)
                inputs = StepInputs.decode(self.block_manager, *arrays)
                metadata = build_metadata(inputs, self.kv_cache.device)
            else:
                metadata = self._grow_rows(counts, duplicates)
        except OutOfBlocksError as error:
            if self._seen == 0:
                self._rows = []
                if self._states is not None:  # the layers before the first attention one ran
                    self._states.clear()
            raise _out_of_room(error, self.kv_cache) from error
        self._metadata = metadata
        self._token_index = (
            None if real is None else real.flatten().nonzero().squeeze(1).to(self.kv_cache.device)
        )
        self._seen += q_len
        self.peak_blocks_in_use = max(self.peak_blocks_in_use, self.blocks_in_use())

    def _grow_rows(self, counts: list[int], duplicates: list[bool]) -> AttentionMetadata:
        pairs, active, dropped, created, appended = [], [], [], [], []
        try:
            for row, count in enumerate(counts):
                if count == 0:
                    continue
                seq_id = self._rows[row]
                if seq_id is None:
                    seq_id = next(self._ids)
                    if duplicates[row]:
                        self.block_manager.fork(self._rows[row - 1], seq_id)
                        dropped.append(len(active))
                    else:
                        self.block_manager.allocate(seq_id, count)
                    self._rows[row] = seq_id
                    created.append(row)
                else:
                    pairs += self.block_manager.append_slots(seq_id, count)
                    appended.append((seq_id, count))
                active.append((seq_id, count))
        except OutOfBlocksError:
            self.block_manager.free_many([self._rows[row] for row in created], cache=False)
            for row in created:
                self._rows[row] = None
            for seq_id, count in reversed(appended):
                length = self.block_manager.num_tokens(seq_id)
                pairs += self.block_manager.truncate(seq_id, length - count, cache=False)
            self.kv_cache.copy_blocks(pairs)
            raise
        self.kv_cache.copy_blocks(pairs)
        seq_ids, query_lens = [s for s, _ in active], [n for _, n in active]
        inputs = StepInputs.from_manager(self.block_manager, seq_ids, query_lens)
        starts = [0, *itertools.accumulate(query_lens)]
        for index in dropped:  # a forked copy reads its parent's slots and writes none
            inputs.slot_mapping[starts[index] : starts[index + 1]] = -1
        return build_metadata(inputs, self.kv_cache.device)

    def _check_input_ids(self, input_ids: torch.Tensor, first_iteration: bool | None) -> None:
        """At the first step of a ``generate`` call on a cache that holds tokens, its
        ``input_ids`` must start with them (a continuation); anything else is a new prompt."""
        if first_iteration is None:  # releases without the flag: a step feeding one token
            first_iteration = input_ids.shape[1] != self._seen + 1
        held = self._fed_ids
        if first_iteration and self._seen and held is not None:
            continues = (
                input_ids.shape[0] == held.shape[0]
                and input_ids.shape[1] > self._seen
                and torch.equal(input_ids[:, : self._seen], held[:, : self._seen].to(input_ids))
            )
            if not continues:
                raise ValueError(
                    f"this PagedCache holds {self._seen} tokens per row from an earlier "
                    "generate() call, and the new input_ids do not start with them: call "
                    "cache.reset() before generating for new prompts (to continue, pass the "
                    "cached tokens first, as with transformers' own caches)"
                )
        self._fed_ids = input_ids

    def _remap_rows(self, sources: list[int]) -> None:
        """New row ``i`` continues old row ``sources[i]`` (``block_manager.reassign``)."""
        if not self._rows:
            return
        new_id = functools.partial(next, self._ids)
        if self._states is None:
            self._rows = reassign(self.block_manager, self._rows, sources, new_id)
        else:
            self._rows = reassign_with_states(
                self._states, self.block_manager, self._rows, sources, new_id
            )
        if self._fed_ids is not None:
            self._fed_ids = self._fed_ids[torch.tensor(sources, device=self._fed_ids.device)]
        self.peak_blocks_in_use = max(self.peak_blocks_in_use, self.blocks_in_use())


def _kv_cache(model, geometry: ModelGeometry, sizes, num_state_slots, mla, kv_options):
    """``geometry.kv_cache`` for ``sizes`` = ``(block_size, num_blocks, max_memory)``; for a
    hybrid model sized by a budget, the states of ``num_state_slots`` sequences first."""
    block_size, num_blocks, max_memory = sizes
    reserved = 0
    if geometry.state_layers and num_blocks is None:
        _check_slots(num_state_slots)
        reserved = num_state_slots * _state_bytes_per_sequence(model, block_size, mla)
    try:
        return geometry.kv_cache(*sizes, reserved_bytes=reserved, **kv_options)
    except ValueError as error:
        if not reserved:
            raise
        raise ValueError(
            f"max_memory={max_memory!r}: the conv and recurrent states of "
            f"num_state_slots={num_state_slots} sequences ({reserved} bytes) come first, "
            f"and {error}: give more memory or fewer state slots"
        ) from None


def _check_slots(num_state_slots) -> None:
    if isinstance(num_state_slots, bool) or not isinstance(num_state_slots, int):
        raise TypeError(f"num_state_slots must be an int, got {num_state_slots!r}")
    if num_state_slots < 1:
        raise ValueError(f"num_state_slots must be at least 1, got {num_state_slots}")


def _state_bytes_per_sequence(model: torch.nn.Module, block_size: int, mla) -> int:
    """Bytes of one sequence's conv and recurrent states in a hybrid ``model``: one forward pass
    of one token over a one-block cache (the states take the model's own shapes and dtypes).
    The model's attention implementation is set for the pass and put back after it."""
    probe = PagedCache(model, block_size, num_blocks=1, mla=mla, num_state_slots=1)
    previous = model.config._attn_implementation
    device = probe.kv_cache.device
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    try:
        with torch.inference_mode():
            model(
                input_ids=torch.zeros((1, 1), dtype=torch.long, device=device),
                use_cache=True,
                **{cache_argument_name(model): probe},
            )
    finally:
        model.set_attn_implementation(previous)
    return sum(t[0].numel() * t.element_size() for t in probe._states.tensors.values())


def _out_of_room(error: OutOfBlocksError, kv) -> OutOfBlocksError:
    """The error a ``generate()`` step out of KV blocks or state slots raises, with what to do."""
    if isinstance(error, OutOfStateSlotsError):
        return OutOfStateSlotsError(
            f"PagedCache is out of state slots ({error}): a hybrid model's sequence holds one "
            "for its conv and recurrent states. Give it more (PagedCache(..., num_state_slots="
            "...)) or generate fewer sequences at once, and call cache.reset() before the next "
            "generate()"
        )
    return OutOfBlocksError(
        f"PagedCache is out of KV blocks ({error}): it holds {kv.num_blocks} blocks of "
        f"{kv.block_size} tokens. Give it more (PagedCache(..., num_blocks=...) or "
        "max_memory=...) or generate fewer or shorter sequences, and call cache.reset() before "
        "the next generate()"
    )


def _real_tokens(batch: int, q_len: int, attention_mask) -> torch.Tensor | None:
    """Bool ``[batch, q_len]`` on the host, True for the tokens to store and attend
    (``None`` when all are)."""
    if attention_mask is None:
        return None
    if attention_mask.dim() != 2:
        raise ValueError(
            f'attn_implementation="{ATTN_IMPLEMENTATION}" takes a 2D padding mask [batch, '
            f"past + new tokens], got shape {tuple(attention_mask.shape)}"
        )
    real = attention_mask[:, -q_len:].to(device="cpu", dtype=torch.bool)
    if real.shape != (batch, q_len):
        raise ValueError(
            f"attention_mask has shape {tuple(attention_mask.shape)}, expected [{batch}, "
            f">= {q_len}]"
        )
    return None if bool(real.all()) else real


def _duplicate_rows(key, value, real) -> list[bool]:
    """Rows whose first-layer keys, values and padding equal the previous row's: copies made
    by generate's expansion, whose whole KV will be identical, so they fork instead."""
    batch = key.shape[0]
    if batch == 1:
        return [False]
    same = (key[1:] == key[:-1]).flatten(1).all(1) & (value[1:] == value[:-1]).flatten(1).all(1)
    same = same.cpu()
    if real is not None:
        same &= (real[1:] == real[:-1]).all(1)
    return [False, *same.tolist()]


def _check_generation_inputs(model: torch.nn.Module) -> None:
    """Let every PagedCache see the full ``input_ids`` of ``model.generate``'s steps (a cache
    sees only the keys and values of the tokens fed), so that a new prompt is told from a
    continuation of what the cache holds. Wraps ``prepare_inputs_for_generation`` once."""
    if getattr(model, "_paged_cache_sees_input_ids", False):
        return
    prepare = model.prepare_inputs_for_generation

    @functools.wraps(prepare)
    def prepare_checked(input_ids, *args, **kwargs):
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        if isinstance(cache, PagedCache) and isinstance(input_ids, torch.Tensor):
            cache._check_input_ids(input_ids, kwargs.get("is_first_iteration"))
        return prepare(input_ids, *args, **kwargs)

    model.prepare_inputs_for_generation = prepare_checked
    model._paged_cache_sees_input_ids = True
