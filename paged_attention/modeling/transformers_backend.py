"""The ``"paged_attention"`` attention implementation of Hugging Face transformers, and the
``transformers.Cache`` base its caches share.

Importing this module registers an attention implementation named ``"paged_attention"``
(``transformers.AttentionInterface``) and a matching mask function
(``transformers.AttentionMaskInterface``, which hands the 2D padding mask through instead of
building a dense ``[batch, 1, q, kv]`` mask). Two caches attend through it: ``PagedCache``, for
``generate()`` (paged_attention.integrations.transformers), and the engine's packed steps
(``paged_attention.engine.model_runner.StepCache``).

How it fits transformers' call order: every attention layer calls ``cache.update(key, value,
layer_idx)`` and then the attention function. ``update`` only hands the new keys and values on; the
attention function stores them in the paged cache (``reshape_and_cache``, pad tokens skipped) and
attends over each sequence's paged context. Multi-head latent attention (DeepSeek-V2/V3,
LongCat-Flash) hands ``update`` its compressed latents instead, and expands them into keys and
values (of different head sizes, e.g. 192 and 128) after ``update`` returns: ``update`` returns
this step's latents only, so the attention function receives this step's expanded keys and values,
which the paged cache stores as any other layer's. In the latent form (the default where the
model supports it) the cache holds the latents themselves and attends in the absorbed form
(:mod:`paged_attention.modeling.mla`); DeepSeek sparse attention runs a forward of its own in
that form, which hands the indexer's inputs along (:mod:`paged_attention.modeling.sparse_mla`).
A layer that reuses an earlier layer's keys
and values (KV sharing, Gemma 3n) calls no ``update``: its attention call is recognised by the
key tensor its source layer's ``update`` returned, and attends over that layer's cache without
storing anything (:mod:`paged_attention.modeling.kv_sharing`).

Every call is checked against the :class:`~paged_attention.modeling.geometry.ModelGeometry` the
cache was built from: the layer's head counts and sizes, its logit soft-cap, its attention sinks,
and what its attention mask lets a query see. The mask function tags the padding mask it returns
with the mask transformers would have built (:class:`MaskPattern`); the first call of each layer
probes it (causal, a sliding window, or chunks). A layer that attends otherwise than its config
said raises, naming both, so a model read wrongly never gives wrong tokens.
"""

from __future__ import annotations

import importlib
import inspect
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from paged_attention.attention import AttentionMetadata, PagedAttention
from paged_attention.kv.cache import PagedKVCache
from paged_attention.modeling import kv_sharing, mla, sparse_mla
from paged_attention.modeling.geometry import LayerGeometry, ModelGeometry, describe_attention

try:
    import transformers
    from transformers.cache_utils import Cache
except ImportError as error:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "paged_attention.integrations needs transformers 5.x: install paged_attention from "
        "source with the hf extra (pip install --no-build-isolation '.[hf]' in its checkout)"
    ) from error

ATTN_IMPLEMENTATION = "paged_attention"

# A query this far into a sequence tells full attention from a window or chunks when the mask
# function does not say its local size (transformers passes it for windows and chunks).
_PROBE_SPAN = 4096


def cache_argument_name(model: torch.nn.Module) -> str:
    """The keyword under which ``model``'s forward takes a cache: ``"cache"`` in transformers
    releases that renamed it (passing ``past_key_values`` there warns that it is deprecated),
    else ``"past_key_values"``."""
    try:
        parameters = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):  # pragma: no cover - a forward without a signature
        return "past_key_values"
    return "cache" if "cache" in parameters else "past_key_values"


def _interface(name: str, module_name: str):
    """``transformers.<name>``, or from the module that defined it in releases that did not
    export it at the top level."""
    found = getattr(transformers, name, None)
    if found is None:
        found = getattr(importlib.import_module(module_name), name)
    return found


AttentionInterface = _interface("AttentionInterface", "transformers.modeling_utils")
AttentionMaskInterface = _interface("AttentionMaskInterface", "transformers.masking_utils")

# The cache whose ``update`` ran last in this thread, and the key tensor it returned: the
# attention function that follows in the same layer reads it (transformers does not pass the
# cache to attention functions).
_active = threading.local()


@dataclass(frozen=True)
class LayerCall:
    """What one attention call says about its layer besides the tensors: the softmax scale,
    the sliding window and soft-cap it passes (transformers' ``sliding_window`` and ``softcap``
    keywords), its sinks (``s_aux``, gpt-oss) and the mask transformers made for it."""

    scale: float
    sliding_window: int | None
    soft_cap: float | None
    sinks: torch.Tensor | None
    mask: MaskPattern | None


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    s_aux: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """The ``"paged_attention"`` attention function: query ``[batch, heads, q, dim]``, key and
    value ``[batch, kv_heads, q, dim]`` (this step's only); returns ``([batch, q, heads, dim],
    None)``."""
    state = getattr(_active, "value", None)
    if state is None and (shared := kv_sharing.cache_shared_with(module, key)) is not None:
        state = (shared, key)  # a layer reading its source layer's keys calls no update
    if state is None or not (state[1] is key or _expanded(module, state[1], key)):
        raise RuntimeError(
            f'attn_implementation="{ATTN_IMPLEMENTATION}" needs a PagedCache as the model\'s '
            "cache (generate(..., cache=PagedCache(model, ...))) and use_cache=True: the keys "
            "and values live in the paged cache"
        )
    _active.value = None
    if dropout and module.training:
        raise ValueError(
            f'attn_implementation="{ATTN_IMPLEMENTATION}" is for inference; got attention '
            f"dropout {dropout} in training mode (call model.eval())"
        )
    if torch.is_grad_enabled() and (query.requires_grad or key.requires_grad):
        raise RuntimeError(
            f'attn_implementation="{ATTN_IMPLEMENTATION}" is inference-only: the paged KV cache '
            "has no autograd, so key and value gradients would be lost. Run the model under "
            "torch.no_grad() or torch.inference_mode() (generate() does)"
        )
    pattern = getattr(attention_mask, "paged_attention_pattern", None)
    padding = attention_mask if pattern is None else pattern.padding
    call = LayerCall(
        scale=float(module.scaling if scaling is None else scaling),
        sliding_window=sliding_window,
        soft_cap=softcap,
        sinks=s_aux,
        mask=pattern,
    )
    cache: PagedCacheBase = state[0]
    return cache.attend(module, query, key, value, padding, call), None


def _expanded(module: torch.nn.Module, latent: torch.Tensor, key: torch.Tensor) -> bool:
    """Whether ``key`` is what a multi-head latent attention module (one with transformers'
    ``expand_kv``) made of the ``latent`` its cache's ``update`` returned: the same batch rows
    and tokens."""
    return (
        callable(getattr(module, "expand_kv", None))
        and key.dim() == latent.dim() == 4
        and key.shape[0] == latent.shape[0]
        and key.shape[2] == latent.shape[2]
    )


def _runs_paged(module: torch.nn.Module) -> bool:
    """Whether ``module``'s model runs with the ``"paged_attention"`` implementation."""
    config = getattr(module, "config", None)
    return getattr(config, "_attn_implementation", None) == ATTN_IMPLEMENTATION


def _hands_latents(module: torch.nn.Module, latent: torch.Tensor) -> bool:
    """Whether ``latent`` is what a latent-form cache's ``update`` just returned for
    ``module``'s layer (its ``expand_kv`` then hands it through unexpanded)."""
    state = getattr(_active, "value", None)
    if state is None or state[1] is not latent:
        return False
    layers = state[0].geometry.layers
    return 0 <= module.layer_idx < len(layers) and bool(layers[module.layer_idx].latent_rank)


@dataclass(frozen=True)
class MaskPattern:
    """The mask transformers would build for a layer, as its mask function describes it:
    ``mask_function(batch, head, q_idx, kv_idx)`` over the padded layout (padding excluded),
    ``local_size`` the window or chunk size transformers names for it, ``padding`` the 2D
    padding mask ``[batch, past + q]`` (None: no padding)."""

    mask_function: Callable | None
    local_size: int | None
    padding: torch.Tensor | None
    device: torch.device | None

    def attended(self) -> tuple[int, int] | None:
        """``(sliding_window, attention_chunk_size)`` of the mask (0, 0: causal, every earlier
        position), probed at two query positions; None when it cannot be probed now (while a
        CUDA graph is captured, which allows no device-to-host copy, or ``torch.compile``
        traces, where the probe's result would be data-dependent; an engine's first steps, its
        prompts', run eagerly and probe it). Raises ValueError for a mask that is none of the
        three."""
        if self.mask_function is None:
            return 0, 0
        device = self.device or torch.device("cpu")
        if torch.compiler.is_compiling() or (
            device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        ):
            return None
        size = self.local_size or _PROBE_SPAN
        first = 2 * size + (size - 1) // 2  # and first + 1 share a chunk of `size` (size > 1)
        left = 0  # chunked masks count positions from the first real token of the row
        if self.padding is not None and self.padding.numel():
            left = int((self.padding[0].cumsum(0) == 0).sum())
        zero = torch.zeros((), dtype=torch.long, device=device)
        kv = torch.arange(first + 2, device=device)
        starts = []
        for position in (first, first + 1):
            allowed = self.mask_function(zero, zero, zero + left + position, kv + left)
            seen = torch.as_tensor(allowed).to("cpu").reshape(-1).nonzero().flatten().tolist()
            if not seen or seen != list(range(seen[0], position + 1)):
                raise ValueError(
                    "the model's attention mask lets a query see positions that are not one run "
                    "ending at the query (not causal, a sliding window or chunks: e.g. "
                    "bidirectional image tokens), which paged attention does not compute"
                )
            starts.append(seen[0])
        if starts == [0, 0]:
            return 0, 0
        if starts[1] == starts[0] + 1:
            return first - starts[0] + 1, 0
        if self.local_size and starts[0] == starts[1] == first - first % self.local_size:
            return 0, self.local_size
        raise ValueError(
            f"the model's attention mask reads from position {starts[0]} for a query at "
            f"{first}: not causal, a sliding window or chunks of {self.local_size}"
        )


def paged_attention_mask(
    *args,
    attention_mask: torch.Tensor | None = None,
    mask_function: Callable | None = None,
    local_size: int | None = None,
    device: torch.device | str | None = None,
    **kwargs,
):
    """Mask function of ``"paged_attention"``: causality, windows and chunks are the attention's
    job, so only the 2D padding mask ``[batch, past + q]`` goes on, in a new tensor object that
    carries the :class:`MaskPattern` transformers described (an empty tensor when there is no
    padding)."""
    carrier = torch.empty(0, dtype=torch.bool) if attention_mask is None else attention_mask[:]
    carrier.paged_attention_pattern = MaskPattern(
        mask_function,
        local_size,
        attention_mask,
        None if device is None else torch.device(device),
    )
    return carrier


AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
AttentionMaskInterface.register(ATTN_IMPLEMENTATION, paged_attention_mask)


class PagedCacheBase(Cache):
    """A ``transformers.Cache`` whose layers attend through :class:`PagedAttention` over a
    :class:`PagedKVCache`, for the model it was built for (its :class:`ModelGeometry`). A
    subclass defines what a forward pass stores and attends: ``_attend_layer(layer_idx, query,
    key, value, padding, scale, sinks)`` (``[batch, heads, q, dim]`` in, ``[batch, q, heads,
    dim]`` out; ``padding`` the 2D padding mask or None)."""

    def __init__(self, model: torch.nn.Module, geometry: ModelGeometry, kv: PagedKVCache) -> None:
        super().__init__(layers=[])
        self.geometry = geometry
        self.num_layers = len(geometry.layers)
        self.kv_sharing = kv_sharing.KVSharing(geometry.layers)
        self.kv_cache = kv
        self.tensor_parallel = geometry.tensor_parallel
        self._model_config = model.config
        self._modules: dict[int, PagedAttention] = {}
        # (layer, local size) -> (window, chunk) its mask was probed to apply
        self._masks_seen: dict[tuple[int, int | None], tuple[int, int]] = {}
        self._checks_steps = geometry.tensor_parallel.checks_steps
        self._checked_metadata: AttentionMetadata | None = None
        if geometry.latent:
            mla.pass_latents_through(model, _hands_latents)
        sparse_mla.install(model, _runs_paged)
        self._last_update_layer: int | None = None

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kw
    ) -> tuple[torch.Tensor, torch.Tensor]:
        implementation = getattr(self._model_config, "_attn_implementation", None)
        if implementation != ATTN_IMPLEMENTATION:
            raise ValueError(
                f"PagedCache was built for a model whose attention implementation is "
                f'{implementation!r}, not "{ATTN_IMPLEMENTATION}": call '
                f'model.set_attn_implementation("{ATTN_IMPLEMENTATION}") on it or load it with '
                f'attn_implementation="{ATTN_IMPLEMENTATION}" (a PagedCache serves the model it '
                "was built for)"
            )
        if not 0 <= layer_idx < self.num_layers:
            raise ValueError(
                f"PagedCache was built for a model with {self.num_layers} layers, got layer_idx "
                f"{layer_idx}: build a PagedCache for the model it serves"
            )
        unconsumed = getattr(_active, "value", None)
        if unconsumed is not None and unconsumed[0] is self:
            _active.value = None
            raise ValueError(
                "the previous attention layer did not run through "
                f'attn_implementation="{ATTN_IMPLEMENTATION}": the model using this PagedCache '
                "must be the one it was built for, with that attention implementation"
            )
        self._begin_layer(layer_idx)
        self._last_update_layer = layer_idx
        _active.value = (self, key_states)
        kv_sharing.note_update(self, layer_idx, key_states)
        return key_states, value_states

    def attend(self, module, query, key, value, padding, call: LayerCall) -> torch.Tensor:
        """Called by the attention function with this layer's new query/key/value ``[batch,
        heads, q, dim]``; returns ``[batch, q, heads, dim]``."""
        layers = getattr(getattr(module, "config", None), "num_hidden_layers", None)
        if layers is not None and layers != self.num_layers:
            raise ValueError(
                f"PagedCache was built for a model with {self.num_layers} layers; the model "
                f"using it has {layers}: build a PagedCache for the model it serves"
            )
        layer_idx = module.layer_idx
        if layer_idx is None:  # an attention block shared by layers (Zamba): update named it
            layer_idx = self._last_update_layer
        layer = self.geometry.layers[layer_idx]
        if layer.index_topk:  # DeepSeek sparse attention: key the latents, value the keys
            self._check_features(layer_idx, layer, call)
            return sparse_mla.attend_sparse(
                module,
                layer_idx,
                layer,
                query,
                key,
                value,
                lambda q, k, v: self._attend_layer(layer_idx, q, k, v, padding, call.scale, None),
            )
        if layer.latent_rank:  # key, value: the latents and rotary keys update was handed
            mla.check_call(layer_idx, layer, module, query, key, value)
            self._check_features(layer_idx, layer, call)
            return mla.attend_absorbed(
                module,
                query,
                key,
                value,
                lambda q, k, v: self._attend_layer(layer_idx, q, k, v, padding, call.scale, None),
            )
        self._check_call(layer_idx, layer, query, key, value, call)
        return self._attend_layer(layer_idx, query, key, value, padding, call.scale, call.sinks)

    def _check_call(
        self, layer_idx: int, layer: LayerGeometry, query, key, value, call: LayerCall
    ) -> None:
        """Raise ValueError when layer ``layer_idx`` computes other than the geometry read."""
        head_size = query.shape[-1]
        if (
            query.shape[1] != layer.num_heads
            or key.shape[1] != layer.num_kv_heads
            or head_size != layer.head_size
            or key.shape[-1] != head_size
        ):
            raise ValueError(
                f"PagedCache was built for {layer.num_heads} query heads over "
                f"{layer.num_kv_heads} KV heads of size {layer.head_size} in layer {layer_idx}; "
                f"the model using it has {query.shape[1]} over {key.shape[1]} KV heads of size "
                f"{key.shape[-1]}: build a PagedCache for the model it serves"
            )
        if value.shape[1] != key.shape[1] or value.shape[-1] != layer.v_head_size:
            raise ValueError(
                f"PagedCache was built for {layer.num_kv_heads} value heads of size "
                f"{layer.v_head_size} in layer {layer_idx}; the model using it has "
                f"{value.shape[1]} of size {value.shape[-1]}: build a PagedCache for the model "
                "it serves"
            )
        self._check_features(layer_idx, layer, call)

    def _check_features(self, layer_idx: int, layer: LayerGeometry, call: LayerCall) -> None:
        """Raise ValueError when layer ``layer_idx`` masks, caps or sinks other than read."""
        seen = self._attended(layer_idx, call)
        if seen is not None and seen != (layer.sliding_window, layer.attention_chunk_size):
            raise ValueError(
                f"layer {layer_idx} of the model attends with {describe_attention(*seen)}, but "
                "its config "
                f"reads as {layer.describe()}, which the paged cache was built for: this model "
                "is read wrongly (please report it); nothing was computed"
            )
        if float(call.soft_cap or 0.0) != layer.logits_soft_cap:
            raise ValueError(
                f"layer {layer_idx} of the model computes {_soft_cap(call.soft_cap)}, but its "
                f"config reads as {_soft_cap(layer.logits_soft_cap)}: this model is read wrongly "
                "(please report it)"
            )
        if (call.sinks is not None) != layer.sinks:
            has = "has" if call.sinks is not None else "has no"
            raise ValueError(
                f"layer {layer_idx} of the model {has} attention sinks, which its attention "
                "module did not show: this model is read wrongly (please report it)"
            )

    def _attended(self, layer_idx: int, call: LayerCall) -> tuple[int, int] | None:
        """The (window, chunk) layer ``layer_idx`` attends with: what its mask applies (probed
        once per layer and local size), else the window the call passes."""
        mask = call.mask
        if mask is None:
            return call.sliding_window or 0, 0
        key = (layer_idx, mask.local_size)
        seen = self._masks_seen.get(key)
        if seen is None:
            seen = mask.attended()
            if seen is not None:
                self._masks_seen[key] = seen
        return seen

    def _begin_layer(self, layer_idx: int) -> None:
        """Hook: ``update`` of layer ``layer_idx`` is about to hand its keys and values on."""

    def _packed_attention(
        self, layer_idx, query, key, value, metadata: AttentionMetadata, scale, sinks
    ) -> torch.Tensor:
        """PagedAttention over packed ``[tokens, heads, dim]`` rows described by ``metadata``."""
        if self._checks_steps and metadata is not self._checked_metadata:
            self._check_step_on_every_rank(metadata)
        cached = self.kv_sharing.cache_index[layer_idx]
        if cached is None:
            raise ValueError(
                f"layer {layer_idx} attended through the paged cache, but the model's config "
                "makes it a conv or linear-attention layer, for which the cache holds no keys "
                "and values"
            )
        layer = self.geometry.layers[layer_idx]
        if layer.index_topk:
            # generate()'s rows are get_seq_length() long, padding and this step included (the
            # engine's packed steps: 0, each sequence as long as it is)
            caches = self.kv_cache.layer(cached)
            return sparse_mla.sparse_paged_attention(
                query, key, value, *caches, metadata, scale, layer, self.get_seq_length()
            )
        if layer.latent_rank:
            caches = self.kv_cache.layer(cached)
            return mla.latent_paged_attention(query, key, value, *caches, metadata, scale)
        module = self._modules.get(layer_idx)
        if module is None or module.scale != float(scale):
            layer = self.geometry.layers[layer_idx]
            module = PagedAttention(
                layer.num_heads,
                layer.head_size,
                layer.num_kv_heads,
                scale=scale,
                sliding_window=layer.sliding_window,
                attention_chunk_size=layer.attention_chunk_size,
                logits_soft_cap=layer.logits_soft_cap,
                kv_cache_dtype=self.kv_cache.kv_cache_dtype,
                sinks=None if sinks is None else sinks.detach(),
                v_head_size=layer.v_head_size,
            )
            self._modules[layer_idx] = module
        elif sinks is not None:  # the learned sinks, as they are now
            module.sinks = sinks.detach().to(torch.float32).flatten()
        if self.kv_sharing.reuses(layer_idx):
            key = value = None  # its source layer stored them: it only reads that layer's cache
        else:
            self.kv_cache.calibrate(cached, key, value)
        k_scale, v_scale = self.kv_cache.scales(cached)
        return module(
            query,
            key,
            value,
            self.kv_cache.layer(cached),
            metadata,
            k_scale=k_scale,
            v_scale=v_scale,
        )

    def _check_step_on_every_rank(self, metadata: AttentionMetadata) -> None:
        """Tensor parallel, under PAGED_ATTENTION_DEBUG_CHECKS=1: every rank's forward pass
        uses the same tables and slots. Once per forward pass (its layers share the metadata),
        and not while a CUDA graph is captured, which cannot hold the host copy (the engine's
        per-step check of its plan still runs)."""
        if self.kv_cache.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return
        self._checked_metadata = metadata
        self.tensor_parallel.check_same_on_every_rank(
            "the step's block tables, seq lens and slot mapping",
            [
                metadata.block_tables,
                metadata.seq_lens_tensor,
                metadata.query_start_loc,
                metadata.slot_mapping,
            ],
        )

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1

    @property
    def is_compileable(self) -> bool:
        return False

    @property
    def is_croppable(self) -> bool:
        return False

    # transformers' generate() reads these per-layer lists (e.g. to slice the already cached
    # tokens off a continuation's input_ids); this cache holds no transformers layer objects.
    @property
    def is_linear(self) -> list[bool]:
        return [False] * self.num_layers

    @property
    def is_sliding(self) -> list[bool]:
        return [not layer.attends_everything for layer in self.geometry.layers]

    @property
    def is_dummy(self) -> list[bool]:
        return [False] * self.num_layers


def _soft_cap(cap: float | None) -> str:
    return f"a logit soft-cap of {cap}" if cap else "no logit soft-cap"
