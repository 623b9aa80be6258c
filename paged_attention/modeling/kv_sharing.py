"""Layers that read another layer's keys and values instead of storing their own (KV sharing, as
in Gemma 3n and Gemma 4).

transformers names each layer's part in ``config.kv_sharing_modes``: ``"reuse"`` layers compute
no keys or values (they have no key or value projection) and attend over those of the last
earlier ``"store"`` layer of the same ``layer_types`` kind, which the model hands them in its
``shared_kv_states``; every other layer stores its own. A paged cache holds the storing layers
only: a reusing layer attends over its source layer's blocks (the same block tables, the
source's key and value caches and fp8 scales) and writes nothing, so a shared layer costs no
cache memory and no second copy of any key.

Reading: :func:`with_kv_sources` sets each layer's
:attr:`~paged_attention.modeling.geometry.LayerGeometry.kv_source`. Running:
:class:`KVSharing` maps the model's layers to the cache's, and recognises a reusing layer's
attention call by the key tensor its source layer's ``update`` returned in the same forward
pass (:func:`note_update`, :func:`cache_shared_with`): transformers calls no ``update`` for a
reusing layer, so that key is how its call finds the cache.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import replace

import torch

from paged_attention.modeling.geometry import LayerGeometry, UnsupportedModelError

REUSE, STORE = "reuse", "store"

# The cache whose ``update`` ran last in this thread (a weak reference): a reusing layer's
# attention call, which follows no ``update`` of its own, finds its cache here.
_last = threading.local()


def kv_sources(config, kinds: list[str]) -> list[int | None]:
    """For each layer, the index of the layer whose keys and values it reads (None: it stores
    its own): a ``"reuse"`` layer of ``config.kv_sharing_modes`` reads the last earlier
    ``"store"`` layer of its kind (``kinds``: each layer's ``layer_types`` entry). Raises
    :class:`UnsupportedModelError` for a reusing layer with no such layer in the model (its keys
    would come from another model, as a Gemma 4 assistant's do)."""
    modes = getattr(config, "kv_sharing_modes", None) or []
    if REUSE not in modes:
        return [None] * len(kinds)
    if len(modes) != len(kinds):
        raise UnsupportedModelError(
            f"the model's config lists {len(modes)} kv_sharing_modes for its {len(kinds)} layers"
        )
    sources: list[int | None] = []
    last_store: dict[str, int] = {}
    for index, (mode, kind) in enumerate(zip(modes, kinds)):
        if mode == REUSE:
            if kind not in last_store:
                raise UnsupportedModelError(
                    f"layer {index} reuses the keys and values of an earlier {kind!r} layer, "
                    "but no earlier layer of the model stores them (a model that reads another "
                    "model's keys and values is not served)"
                )
            sources.append(last_store[kind])
        else:
            if mode == STORE:
                last_store[kind] = index
            sources.append(None)
    return sources


def with_kv_sources(
    model: torch.nn.Module, config, kinds: list[str], layers: list[LayerGeometry]
) -> list[LayerGeometry]:
    """``layers`` of ``model`` with each reusing layer's :attr:`~LayerGeometry.kv_source` set
    (:func:`kv_sources`). A reusing layer must read keys and values of the shape its source
    stores (KV heads, head sizes), and its queries must be the step's tokens: otherwise
    :class:`UnsupportedModelError`."""
    sources = kv_sources(config, kinds)
    if any(source is not None for source in sources):
        _refuse_sliced_queries(model)
    linked = []
    for index, (layer, source) in enumerate(zip(layers, sources)):
        if source is not None:
            stored = layers[source]
            shape = (layer.num_kv_heads, layer.head_size, layer.v_head_size)
            if shape != (stored.num_kv_heads, stored.head_size, stored.v_head_size):
                raise UnsupportedModelError(
                    f"layer {index} reuses layer {source}'s keys and values but reads "
                    f"{layer.num_kv_heads} KV heads of sizes {layer.head_size}/"
                    f"{layer.v_head_size}, where layer {source} stores {stored.num_kv_heads} of "
                    f"{stored.head_size}/{stored.v_head_size}"
                )
            layer = replace(layer, kv_source=source)
        linked.append(layer)
    return linked


def _refuse_sliced_queries(model: torch.nn.Module) -> None:
    """Gemma 4's decoder computes its reusing layers for the tokens whose logits are kept only
    (``_maybe_slice_kv_shared_inputs`` slices the hidden states and the 4D masks at the first
    reusing layer): paged attention's layers take every token of the step and a 2D padding
    mask, so such a model is refused rather than attended wrongly."""
    get_decoder = getattr(model, "get_decoder", None)
    decoder = get_decoder() if callable(get_decoder) else model
    if callable(getattr(decoder, "_maybe_slice_kv_shared_inputs", None)):
        raise UnsupportedModelError(
            f"{type(model).__name__} shares keys and values between layers and computes the "
            "layers that reuse them for the kept logits' tokens only (it drops the step's other "
            "query rows and slices a 4D attention mask), while paged attention attends every "
            "token of the step over a 2D padding mask; it is served without KV sharing "
            "(num_kv_shared_layers=0)"
        )


def cache_indices(
    layers: tuple[LayerGeometry, ...] | list[LayerGeometry],
) -> tuple[int | None, ...]:
    """The index in the paged cache of the keys and values each layer attends over: the storing
    layers are the cache's layers, in order; a reusing layer gets its source's; a layer that
    keeps only a state (``attends`` False) gets None."""
    indices: list[int | None] = []
    stored = 0
    for layer in layers:
        if not layer.attends:
            indices.append(None)
        elif layer.kv_source is None:
            indices.append(stored)
            stored += 1
        else:
            indices.append(indices[layer.kv_source])
    return tuple(indices)


class KVSharing:
    """One paged cache's view of a model's KV sharing: where each layer's keys and values live
    in the cache (:attr:`cache_index`), which layers only read (:meth:`reuses`), and the key
    tensor each source layer handed on in the current forward pass (held weakly, so no step's
    keys outlive the model's use of them)."""

    def __init__(self, layers: tuple[LayerGeometry, ...]) -> None:
        self.cache_index = cache_indices(layers)
        self._sources = {layer.kv_source for layer in layers} - {None}
        self.shares = bool(self._sources)
        """Whether any layer reads another's keys and values (else nothing is tracked)."""
        self._reuses = tuple(layer.kv_source is not None for layer in layers)
        self._layers = layers
        self._handed_on: dict[int, weakref.ref] = {}

    def reuses(self, layer_idx: int) -> bool:
        """Whether layer ``layer_idx`` reads another layer's keys and values."""
        return self._reuses[layer_idx]

    def handed_on(self, layer_idx: int, key: torch.Tensor) -> None:
        """Layer ``layer_idx``'s ``update`` returned ``key`` (noted for source layers only)."""
        if layer_idx in self._sources:
            self._handed_on[layer_idx] = weakref.ref(key)

    def reads(self, layer_idx: int, key: torch.Tensor) -> bool:
        """Whether ``key`` is what layer ``layer_idx``'s source handed on in this forward pass:
        the keys a reusing layer must be given."""
        if not 0 <= layer_idx < len(self._reuses) or not self._reuses[layer_idx]:
            return False
        handed = self._handed_on.get(self._layers[layer_idx].kv_source)
        return handed is not None and handed() is key


def note_update(cache, layer_idx: int, key: torch.Tensor) -> None:
    """``cache.update`` of layer ``layer_idx`` returned ``key``: remember both for the reusing
    layers' calls (``cache.kv_sharing`` is its :class:`KVSharing`). Records nothing for a model
    without KV sharing (no weak references in its steps, nor in what ``torch.compile``
    traces)."""
    if not cache.kv_sharing.shares:
        return
    _last.cache = weakref.ref(cache)
    cache.kv_sharing.handed_on(layer_idx, key)


def cache_shared_with(module: torch.nn.Module, key: torch.Tensor):
    """The cache a reusing layer's attention call (``module``, given ``key``) reads: the last
    cache updated in this thread, when ``key`` is what the module's source layer handed on to
    it; else None."""
    ref = getattr(_last, "cache", None)
    cache = None if ref is None else ref()
    layer_idx = getattr(module, "layer_idx", None)
    if cache is None or not isinstance(layer_idx, int):
        return None
    return cache if cache.kv_sharing.reads(layer_idx, key) else None
