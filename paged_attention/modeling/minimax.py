"""MiniMax (transformers' ``MiniMaxForCausalLM``, ``model_type`` ``"minimax"``) on the paged cache.

MiniMax mixes softmax attention layers with *lightning attention* layers: linear attention whose
state is one ``[batch, heads, head_dim, head_dim]`` matrix per layer (the decayed sum of
``k^T v``). The model hands that state to its cache through a cache class of its own,
``MiniMaxCache`` (``get_linear_cache`` / ``set_linear_cache``), and refuses any cache that is not
an instance of it. So a cache serving MiniMax is a ``MiniMaxCache`` too: :func:`cache_class`
gives, for a paged cache class (``PagedCache``, the engine's ``HybridStepCache``) and a MiniMax
model, a subclass of both (made once per class) in which :class:`LinearStateCache` keeps each
lightning layer's state as that layer's recurrent state in
:class:`~paged_attention.modeling.hybrid.BatchStates`. Both paged cache classes pick the subclass
in ``__new__``, so ``PagedCache(model)`` and the engine need nothing else. From there the state
is any hybrid model's recurrent state: it lives in the sequence's state slot, is forked with
``num_return_sequences`` and beams, reordered by beam search, recomputed on preemption, freed
with the sequence and counted in the memory budget.

The layer picks its path from ``get_linear_cache``: ``None`` (no forward pass of the batch
through it yet) runs the input as blocks of ``config.block_size`` tokens from a zero state; a
state runs the tokens one by one from it, as on transformers' own cache. So an engine prompt
chunk at position 0 runs blocks, and a later chunk continues its sequence's state. A
left-padded batch reaches the layer with its 2D padding mask, which zeroes the padding's
queries, keys and values. What a state cannot do is refused as for every hybrid model: ``crop``
(the paged cache's own, which wins over ``MiniMaxCache``'s and raises a ``ValueError`` naming
assisted generation and prompt lookup) and prefix caching.

geometry imports :func:`is_minimax` and must not import transformers, so this module imports
transformers' classes only once a MiniMax model asks for them.
"""

from __future__ import annotations

import functools

import torch

from paged_attention.modeling.hybrid import RECURRENT, BatchStates

MODEL_TYPE = "minimax"
_STATE_INDEX = 0  # the one state a lightning layer keeps


def is_minimax(model) -> bool:
    """Whether ``model`` is transformers' MiniMax (lightning attention, ``MiniMaxCache``)."""
    return getattr(getattr(model, "config", None), "model_type", None) == MODEL_TYPE


class LinearStateCache:
    """transformers' ``MiniMaxCache`` calls over a paged cache's :class:`BatchStates`
    (``_states``): each lightning layer's state is that layer's recurrent state. Mixed in after
    the paged cache class and before ``MiniMaxCache`` (:func:`cache_class`), so the paged
    cache's own methods (``crop``, ``reorder_cache``, ``batch_select_indices``, ...) win over
    ``MiniMaxCache``'s."""

    _states: BatchStates | None

    def __init__(self, *args, **kwargs) -> None:
        # The paged cache holds no transformers layer objects: skip DynamicCache's set-up (and
        # MiniMaxCache's list of states, which live in ``_states`` here).
        from transformers.cache_utils import Cache

        Cache.__init__(self, *args, **kwargs)

    def __len__(self) -> int:
        return len(self.layers)  # transformers' Cache.__len__ (MiniMaxCache's reads its list)

    def get_linear_cache(self, layer_idx: int) -> torch.Tensor | None:
        """The layer's state for every row, or None before the batch's first forward pass
        through it (the layer then computes its input from a zero state)."""
        return self._linear_states(layer_idx).get(layer_idx, RECURRENT, _STATE_INDEX)

    def set_linear_cache(self, layer_idx: int, linear_cache: torch.Tensor) -> None:
        if not isinstance(linear_cache, torch.Tensor):
            raise TypeError(
                f"set_linear_cache takes layer {layer_idx}'s state as a tensor, got "
                f"{type(linear_cache).__name__}"
            )
        self._linear_states(layer_idx).update_recurrent(linear_cache, layer_idx, _STATE_INDEX)

    def _linear_states(self, layer_idx: int) -> BatchStates:
        if self._states is None:
            raise ValueError(
                f"layer {layer_idx} asked for a lightning-attention state, but the model this "
                "cache was built for has no linear-attention layer"
            )
        return self._states


def cache_class(base: type, model) -> type:
    """``base`` for most models; for a MiniMax model, the subclass of ``base`` that is also a
    ``MiniMaxCache`` (the model refuses any other cache), the same class every time."""
    if not is_minimax(model):
        return base
    from transformers.models.minimax.modeling_minimax import MiniMaxCache

    if issubclass(base, MiniMaxCache):
        return base
    return _minimax_subclass(base)


@functools.cache
def _minimax_subclass(base: type) -> type:
    from transformers.models.minimax.modeling_minimax import MiniMaxCache

    namespace = {
        "__module__": __name__,
        "__qualname__": f"MiniMax{base.__name__}",
        "__doc__": (
            f"A {base.__name__} for transformers' MiniMax: also a MiniMaxCache, each lightning "
            "layer's state kept as a hybrid model's recurrent state (paged_attention.modeling."
            "minimax)."
        ),
    }
    return type(f"MiniMax{base.__name__}", (base, LinearStateCache, MiniMaxCache), namespace)
