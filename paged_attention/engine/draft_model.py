"""Drafts from a smaller model: speculative decoding's ``draft_model`` method.

The draft model proposes its greedy continuation of a sequence; the target model verifies it in
one forward pass (:func:`~paged_attention.engine.spec_decode.verify_drafts`), so the engine's
tokens are the target's whatever the draft says: a better draft only means more accepted
tokens per step. Greedy drafts are deterministic (a one-hot draft distribution), which is what
makes the verification's rejection rule exact for sampled requests too.

Drafting is batched: every sequence drafting in a step goes through the draft model together
(:meth:`DraftModelProposer.propose_batch`), ``k`` forward passes (one per draft position),
however many sequences draft. The
draft model runs the way the engine runs the model, over a paged KV cache of its own (its own
:class:`~paged_attention.kv.block_manager.BlockManager` and
:class:`~paged_attention.kv.cache.PagedKVCache`, the model switched to the ``paged_attention``
attention implementation): a forward pass packs the sequences' tokens into one row and the
varlen attention reads each sequence's own block table, so sequences of different lengths, fed
different numbers of tokens, share a pass with no padding and no mask. The first pass of a step
feeds each sequence the tokens its draft cache has not seen (one or two after a step whose
drafts were accepted, the whole prompt the first time) and keeps the logits of each sequence's
last token; each later pass feeds every sequence still drafting its newest draft. A sequence
whose ``limit`` is reached leaves the later passes, so the cache never holds a draft past it.

Each drafting sequence keeps its draft cache from one step to the next, with the tokens it
holds: a step first cuts it back to the longest prefix those tokens share with the sequence
(dropping the drafts the target rejected: ``BlockManager.truncate``), then feeds the rest. Only
sequences that drafted in the last step keep theirs (:meth:`DraftModelProposer.end_step`), so a
sequence that pauses (preempted, or no room for drafts) rebuilds it from its tokens the next
time it drafts. The draft pool has as many blocks, of the same size, as the engine's pool,
and the engine's memory budget pays for both: a drafting sequence needs no more draft slots
than it holds slots there (its tokens and drafts), so the draft pool runs short only when the
engine's sequences share cached prefix blocks; a sequence it has no room for drafts nothing
that step, or fewer drafts. Losing a cache costs time, never tokens.
"""

from __future__ import annotations

import itertools
from collections.abc import Collection, Sequence

import torch

from paged_attention.engine.config import CacheConfig
from paged_attention.engine.model_runner import StepCache
from paged_attention.kv.block_manager import OutOfBlocksError
from paged_attention.kv.step_inputs import StepInputs, build_metadata
from paged_attention.modeling.geometry import ModelGeometry, UnsupportedModelError
from paged_attention.modeling.transformers_backend import ATTN_IMPLEMENTATION, cache_argument_name


def _vocab_size(model: torch.nn.Module) -> int | None:
    config = getattr(model, "config", None)
    if config is None:
        return None
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return getattr(text, "vocab_size", None)


def _device(model: torch.nn.Module) -> torch.device:
    parameter = next(model.parameters(), None)
    return torch.device("cpu") if parameter is None else parameter.device


def check_draft_model(target: torch.nn.Module, draft: torch.nn.Module) -> None:
    """ValueError naming ``draft_model`` unless ``draft`` can draft for ``target``: a
    transformers causal LM over the same vocabulary, on the same device, that the paged cache
    serves (docs/models.md) with attention layers only (rejected drafts are cut off the cache,
    which a recurrent or linear-attention state cannot be)."""
    if draft is target:
        raise ValueError("draft_model must be another model than the one it drafts for")
    vocab, target_vocab = _vocab_size(draft), _vocab_size(target)
    if vocab is None:
        raise ValueError("draft_model must be a transformers causal LM (it has no config)")
    if vocab != target_vocab:
        raise ValueError(
            f"draft_model has a vocabulary of {vocab} tokens, the model {target_vocab}: the "
            "draft must share the model's tokenizer"
        )
    if _device(draft) != _device(target):
        raise ValueError(
            f"draft_model is on {_device(draft)}, the model on {_device(target)}: put both on "
            "one device"
        )
    supports = getattr(draft, "_supports_default_dynamic_cache", None)
    if supports is not None and not supports():
        raise ValueError(
            f"draft_model ({type(draft).__name__}) needs a cache class of its own (states "
            "beside its keys and values), which the draft's paged cache cannot cut back"
        )
    geometry = _geometry(draft)
    if geometry.state_layers:
        raise ValueError(
            "draft_model keeps states its cache cannot cut back (a recurrent or linear-attention "
            "layer), which dropping rejected drafts needs: choose an attention-only draft model"
        )
    try:  # the cache's own checks (head sizes the kernels serve), on a one-block cache
        geometry.kv_cache(16, 1, None)
    except ValueError as error:
        raise ValueError(f"draft_model: the paged cache cannot serve it: {error}") from None


def _geometry(draft: torch.nn.Module) -> ModelGeometry:
    try:
        return ModelGeometry.of(draft)
    except UnsupportedModelError as error:
        raise ValueError(f"draft_model: the paged cache cannot serve it: {error}") from None


def draft_block_bytes(draft: torch.nn.Module, block_size: int) -> int:
    """Bytes one block of ``block_size`` tokens takes in ``draft``'s pool (its keys and values
    in its own dtype, over all its layers): what a memory budget sets aside per engine block."""
    return CacheConfig(block_size=block_size, num_blocks=1).block_bytes(_geometry(draft))


class DraftModelProposer:
    """Greedy drafts of ``model`` for every drafting sequence of a step at once, over a pool of
    ``num_blocks`` blocks of ``block_size`` tokens; each sequence keeps its cache between
    steps. :attr:`states`: the tokens each kept cache holds, by sequence id."""

    def __init__(self, model: torch.nn.Module, num_blocks: int, block_size: int) -> None:
        geometry = _geometry(model)
        self.model = model
        self.device = geometry.device
        self.kv_cache = geometry.kv_cache(block_size, num_blocks, None)
        self.manager = geometry.block_manager(self.kv_cache, enable_prefix_caching=False)
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
        self.cache = StepCache(model, geometry, self.kv_cache)
        self._cache_argument = cache_argument_name(model)
        self.states: dict[int, list[int]] = {}
        self._drafted: set[int] = set()

    @torch.inference_mode()
    def propose_batch(self, work: Sequence[tuple[int, Sequence[int], int]]) -> list[list[int]]:
        """For each ``(seq_id, tokens, limit)`` of ``work``: the draft model's first ``limit``
        greedy tokens after ``tokens`` (prompt then output), or fewer where the pool runs out
        of room ([] for no tokens or a limit of 0). One forward pass per draft position, each
        over every sequence still drafting. If a pass raises, the caches of ``work``'s
        sequences are let go (they are rebuilt when they draft again)."""
        _check_work(work)
        drafts: list[list[int]] = [[] for _ in work]
        step = []  # (index in work, sequence id, tokens to feed, position of the first)
        try:
            for index, (seq_id, tokens, limit) in enumerate(work):
                if limit > 0 and len(tokens):
                    start = self._reserve(seq_id, tokens)
                    if start is not None:
                        step.append((index, seq_id, list(tokens[start:]), start))
            while step:
                later = []
                for (index, seq_id, fed, start), token in zip(step, self._forward(step)):
                    drafts[index].append(token)
                    self.states[seq_id] += fed
                    self._drafted.add(seq_id)
                    if len(drafts[index]) < work[index][2] and self._append(seq_id):
                        later.append((index, seq_id, [token], start + len(fed)))
                step = later
        except BaseException:
            self._let_go([seq_id for seq_id, _, _ in work])
            raise
        return drafts

    def end_step(self, keep: Collection[int] = ()) -> None:
        """A step's drafting is over: the caches of sequences that did not draft in it (and are
        not in ``keep``) are let go."""
        kept = self._drafted | set(keep)
        self._let_go([seq_id for seq_id in self.states if seq_id not in kept])
        self._drafted = set()

    def _reserve(self, seq_id: int, tokens: Sequence[int]) -> int | None:
        """Slots for the tokens of ``tokens`` that ``seq_id``'s cache lacks, after cutting it
        back to the longest prefix it shares with them that leaves at least one token to feed;
        the position of the first token to feed, or None when the pool has no room."""
        held = self.states.pop(seq_id, [])
        common, most = 0, min(len(held), len(tokens) - 1)
        while common < most and held[common] == tokens[common]:
            common += 1
        manager, pairs = self.manager, []
        if common and manager.has_seq(seq_id):
            try:
                pairs = manager.truncate(seq_id, common, cache=False)
            except ValueError:  # a sliding window's blocks the kept tokens read were let go
                common = 0
        if not common and manager.has_seq(seq_id):
            manager.free(seq_id, cache=False)
        try:
            if common:
                pairs += manager.append_slots(seq_id, len(tokens) - common)
            else:
                manager.allocate(seq_id, len(tokens))
        except OutOfBlocksError:
            if manager.has_seq(seq_id):
                manager.free(seq_id, cache=False)
            return None
        self.kv_cache.copy_blocks(pairs)  # none without prefix caching; the manager's contract
        self.states[seq_id] = held[:common]
        return common

    def _append(self, seq_id: int) -> bool:
        """A slot for ``seq_id``'s next draft; False when the pool has none left."""
        try:
            self.kv_cache.copy_blocks(self.manager.append_slots(seq_id, 1))
        except OutOfBlocksError:
            return False
        return True

    def _forward(self, step: list[tuple[int, int, list[int], int]]) -> list[int]:
        """One packed forward pass feeding each ``(index, seq_id, tokens, first position)`` of
        ``step`` (their slots reserved); each sequence's greedy token after its last one."""
        counts = [len(fed) for _, _, fed, _ in step]
        inputs = StepInputs.from_manager(self.manager, [row[1] for row in step], counts)
        ids = [token for _, _, fed, _ in step for token in fed]
        positions = [p for _, _, fed, start in step for p in range(start, start + len(fed))]
        last_rows = [end - 1 for end in itertools.accumulate(counts)]
        self.cache.metadata = build_metadata(inputs, self.device)
        try:
            logits = self.model(
                input_ids=torch.tensor([ids], device=self.device),
                position_ids=torch.tensor([positions], device=self.device),
                use_cache=True,
                logits_to_keep=torch.tensor(last_rows, device=self.device),
                **{self._cache_argument: self.cache},
            ).logits[0]
        finally:
            self.cache.metadata = None
        return logits.argmax(-1).tolist()

    def _let_go(self, seq_ids: Collection[int]) -> None:
        """Forget the caches of ``seq_ids`` and free their blocks."""
        for seq_id in seq_ids:
            self.states.pop(seq_id, None)
            if self.manager.has_seq(seq_id):
                self.manager.free(seq_id, cache=False)


def _check_work(work: Sequence[tuple[int, Sequence[int], int]]) -> None:
    """ValueError naming ``work`` unless each sequence id appears once."""
    seq_ids = [entry[0] for entry in work]
    if len(set(seq_ids)) != len(seq_ids):
        raise ValueError(f"work names a sequence more than once: {seq_ids}")
