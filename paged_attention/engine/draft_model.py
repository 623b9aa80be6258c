"""Drafts from a smaller model: speculative decoding's ``draft_model`` method.

The draft model proposes its greedy continuation of a sequence; the target model verifies it in
one forward pass (:func:`~paged_attention.engine.spec_decode.verify_drafts`), so the engine's
tokens are the target's whatever the draft says: a better draft only means more accepted
tokens per step. Greedy drafts are deterministic (a one-hot draft distribution), which is what
makes the verification's rejection rule exact for sampled requests too.

Each drafting sequence keeps the draft model's own cache (a transformers ``DynamicCache``) from
one step to the next, with the tokens it holds: a step feeds the draft model only the tokens it
has not seen, after cutting off the drafts the target rejected (``crop``). These caches live
outside the engine's block pool, on the draft model's device; only sequences that drafted in
the last step keep theirs, so a sequence that pauses (preempted, or no room for drafts) rebuilds
it from its tokens the next time it drafts. Losing a cache costs time, never tokens.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

import torch


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
    transformers causal LM (a ``config`` and a ``DynamicCache`` it can cut back) over the same
    vocabulary, on the same device."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer, LinearAttentionCacheLayerMixin

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
            f"draft_model ({type(draft).__name__}) needs a cache class of its own; the draft "
            "cache is transformers' DynamicCache"
        )
    try:
        cache = DynamicCache(config=draft.config)
    except Exception as error:  # a config transformers' cache cannot read
        raise ValueError(f"draft_model: transformers' DynamicCache refuses it: {error}") from None
    layers = getattr(cache, "layers", [])
    attention_only = all(
        isinstance(layer, DynamicLayer) and not isinstance(layer, LinearAttentionCacheLayerMixin)
        for layer in layers
    )
    if not attention_only:
        raise ValueError(
            "draft_model keeps states its cache cannot cut back (a recurrent or linear-attention "
            "layer), which dropping rejected drafts needs: choose an attention-only draft model"
        )


@dataclass
class _DraftState:
    """One sequence's draft cache and the tokens it holds."""

    cache: object
    tokens: list[int] = field(default_factory=list)


class DraftModelProposer:
    """Greedy drafts of ``model`` for each sequence, keeping its cache between steps."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.device = _device(model)
        self.states: dict[int, _DraftState] = {}
        self._drafted: set[int] = set()

    @torch.inference_mode()
    def propose(self, tokens: Sequence[int], limit: int, seq_id: int | None = None) -> list[int]:
        """The draft model's ``limit`` greedy tokens after ``tokens`` (prompt then output)."""
        if limit <= 0 or not tokens:
            return []
        state = self._state_for(seq_id, tokens)
        logits = self._forward(state, list(tokens[len(state.tokens) :]))
        drafts = []
        while True:
            drafts.append(int(logits.argmax()))
            if len(drafts) == limit:
                break
            logits = self._forward(state, drafts[-1:])
        if seq_id is not None:
            self.states[seq_id] = state
            self._drafted.add(seq_id)
        return drafts

    def end_step(self, keep: Collection[int] = ()) -> None:
        """A step's drafting is over: the caches of sequences that did not draft in it (and are
        not in ``keep``) are let go."""
        kept = self._drafted | set(keep)
        self.states = {seq_id: s for seq_id, s in self.states.items() if seq_id in kept}
        self._drafted = set()

    def _state_for(self, seq_id: int | None, tokens: Sequence[int]) -> _DraftState:
        """``seq_id``'s cache cut back to its longest prefix of ``tokens`` that leaves at least
        one token to feed; a fresh cache when it has none or cannot be cut."""
        from transformers import DynamicCache

        state = self.states.pop(seq_id, None) if seq_id is not None else None
        if state is not None:
            held = state.tokens
            common = 0
            limit = min(len(held), len(tokens) - 1)
            while common < limit and held[common] == tokens[common]:
                common += 1
            if common < len(held):
                if common and state.cache.is_croppable:
                    state.cache.crop(common - len(held))
                    state.tokens = held[:common]
                else:
                    state = None
        if state is None:
            state = _DraftState(DynamicCache(config=self.model.config))
        return state

    def _forward(self, state: _DraftState, new_tokens: list[int]) -> torch.Tensor:
        """Feeds ``new_tokens`` after the cache's tokens; the logits after the last one."""
        ids = torch.tensor([new_tokens], dtype=torch.long, device=self.device)
        out = self.model(input_ids=ids, cache=state.cache, use_cache=True, logits_to_keep=1)
        state.tokens.extend(new_tokens)
        return out.logits[0, -1]
