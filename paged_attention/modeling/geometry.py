"""What a decoder-only model's KV cache must hold, read from the model itself.

Per layer: query heads, KV heads, head size (and the values' own head size, which multi-head latent
attention run through transformers' attention interface makes narrower), the softmax scale, a
sliding window or attention chunk, the logit soft-cap and whether the layer has attention sinks
(:class:`LayerGeometry`); for the model: those layers, its dtype, device and tensor-parallel split
(:class:`ModelGeometry`), which build the :class:`~paged_attention.kv.cache.PagedKVCache` (each
layer's own shape when layers differ) and the
:class:`~paged_attention.kv.block_manager.BlockManager` that fit it. What paged attention cannot
serve is refused here, with the reason (:class:`UnsupportedModelError`).

A layer that reads another layer's keys and values (KV sharing, Gemma 3n) has no cache of its
own: the cache holds the storing layers (:mod:`paged_attention.modeling.kv_sharing`).

The model is read by the names transformers gives its config and attention modules
(``layer_types``, ``sliding_window``, ``attention_chunk_size``, ``num_key_value_heads``,
``head_dim``, an attention module's ``layer_idx``, ``scaling`` and ``sinks``, ...), without
importing transformers: the engine builds its cache from this module alone. The transformers
attention backend (``paged_attention.modeling.transformers_backend``) checks at every
forward pass that each layer computes what was read here, so a model read wrongly raises rather
than giving wrong tokens.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace

import torch

from paged_attention.kv import cache as _cache_module
from paged_attention.kv.block_manager import BlockManager
from paged_attention.kv.cache import PagedKVCache, bytes_per_block, num_blocks_for_budget
from paged_attention.kv.state_pool import StatefulBlockManager
from paged_attention.modeling.minimax import is_minimax
from paged_attention.modeling.mla import latent_form
from paged_attention.modeling.sparse_mla import indexed_modules, sparse_form
from paged_attention.modeling.tensor_parallel import TensorParallel

# Without a size, a CPU cache takes this much of the available host memory, at most
# _CPU_DEFAULT_MAX_BYTES (vLLM's CPU backend reserves 4 GiB by default); CUDA takes 90% of the
# free device memory.
_CPU_DEFAULT_FRACTION = 0.25
_CPU_DEFAULT_MAX_BYTES = 4 << 30
_CUDA_DEFAULT_FRACTION = 0.9

FULL, SLIDING, CHUNKED = "full_attention", "sliding_attention", "chunked_attention"
_ATTENTION_LAYER_TYPES = (FULL, SLIDING, CHUNKED)
# Layers with neither attention nor state (Nemotron-H's MLP and MoE layers): nothing to cache.
_NO_CACHE_LAYER_TYPES = {"mlp", "moe"}
# Layers that keep a fixed-size state per sequence (a convolution window, a recurrent or
# linear-attention state) as transformers' LinearAttentionLayer does; "hybrid" layers (Falcon-H1,
# Zamba2) attend as well, over every position or a window.
_STATE_LAYER_TYPES = {"conv", "linear_attention", "hybrid", "hybrid_sliding"}
_ATTENTION_OF = {"hybrid": FULL, "hybrid_sliding": SLIDING}
# Layers that store no keys and values: those that keep only a state ("hybrid" layers keep a
# state and attend) and those with neither (an MLP or MoE block as a layer of its own).
_NO_KV_LAYER_TYPES = (_STATE_LAYER_TYPES - set(_ATTENTION_OF)) | _NO_CACHE_LAYER_TYPES
# DeepSeek-V3.2's layers: latent attention over the tokens a lightning indexer selects.
_SPARSE_INDEXED = "indexed_attention"


class UnsupportedModelError(ValueError):
    """A model paged attention cannot serve; the message says why."""


@dataclass(frozen=True)
class LayerGeometry:
    """One attention layer as its kernels see it. ``sliding_window`` ``W > 0``: each query reads
    the last ``W`` positions; ``attention_chunk_size`` ``C > 0``: a query at position ``p``
    reads only its own chunk, ``p - p % C .. p``; both 0: every position before it.
    ``logits_soft_cap`` 0 means none; ``sinks``: the layer adds one learned logit per head to
    its softmax's denominator (gpt-oss); ``scale`` is the module's softmax scale (None when the
    module does not name it: the scale each call passes is the one used). ``v_head_size`` is
    the values' head size (0 when built: ``head_size``); multi-head latent attention's differs
    (DeepSeek-V3: keys of 192 dims, the rotary 64 included, values of 128). ``latent_rank`` > 0:
    multi-head latent attention cached in its latent form (:mod:`paged_attention.modeling.mla`):
    one KV head whose keys are the rotary parts (``head_size``: ``qk_rope_head_dim``) and whose
    values are the compressed latents (``v_head_size``: ``kv_lora_rank``). ``kv_source``: the
    index of the layer whose keys and values this layer reads instead of storing its own (KV
    sharing, :mod:`paged_attention.modeling.kv_sharing`); None: its own. ``attends`` False: a
    hybrid model's layer that attends nothing (a conv or linear-attention layer, which keeps a
    state in a state slot, or an MLP or MoE block): the cache holds no blocks for it, and its
    head fields are the config's. ``index_topk`` > 0: DeepSeek sparse attention, a latent layer
    whose keys carry an indexer key of ``index_head_size`` dims after the rotary part, read by
    ``index_heads`` indexer heads that keep ``index_topk`` tokens per query
    (:mod:`paged_attention.modeling.sparse_mla`)."""

    num_heads: int
    num_kv_heads: int
    head_size: int
    scale: float | None = None
    sliding_window: int = 0
    attention_chunk_size: int = 0
    logits_soft_cap: float = 0.0
    sinks: bool = False
    v_head_size: int = 0
    latent_rank: int = 0
    kv_source: int | None = None
    attends: bool = True
    index_topk: int = 0
    index_heads: int = 0
    index_head_size: int = 0

    def __post_init__(self) -> None:
        if not self.v_head_size:
            object.__setattr__(self, "v_head_size", self.head_size)

    @property
    def attends_everything(self) -> bool:
        return not self.sliding_window and not self.attention_chunk_size

    def describe(self) -> str:
        """What the layer attends, in words."""
        return describe_attention(self.sliding_window, self.attention_chunk_size)


def describe_attention(sliding_window: int, attention_chunk_size: int) -> str:
    """A sliding window or chunks (0: none), in words."""
    if sliding_window:
        return f"a sliding window of {sliding_window}"
    if attention_chunk_size:
        return f"chunks of {attention_chunk_size}"
    return "full attention"


@dataclass(frozen=True)
class ModelGeometry:
    """The shape of a decoder-only model's KV cache and how each layer attends. On a
    tensor-parallel model (``tensor_parallel.size > 1``) the head counts are this rank's, the
    ones its cache holds."""

    layers: tuple[LayerGeometry, ...]
    dtype: torch.dtype
    device: torch.device
    tensor_parallel: TensorParallel = TensorParallel()
    # Hybrid models: the layers that keep a conv or recurrent state (kv/state_pool.py).
    state_layers: tuple[int, ...] = ()

    @classmethod
    def of(cls, model: torch.nn.Module, mla: str | None = None) -> ModelGeometry:
        """Read ``model`` (a transformers causal LM, or anything with its config and attention
        module attributes). Raises :class:`UnsupportedModelError` naming the reason for what
        paged attention cannot serve, and ValueError for a tensor-parallel split it cannot.
        ``mla``: how multi-head latent attention is cached, ``"latent"``, ``"expanded"`` or
        None (latent where the model supports it), as
        :func:`~paged_attention.modeling.mla.latent_form` reads it."""
        config = text_config(model)
        configs = layer_configs(config)
        refuse_unsupported(model, configs)
        kinds = layer_types(configs)
        modules = attention_modules(model)
        layers = [
            _read_layer(
                index,
                _ATTENTION_OF.get(kinds[index], kinds[index]),
                configs[index],
                modules.get(index),
            )
            for index in range(len(configs))
        ]
        layers = [
            replace(layer, attends=False) if kinds[index] in _NO_KV_LAYER_TYPES else layer
            for index, layer in enumerate(layers)
        ]
        # kv_sharing reads geometry's types, so it is imported where it is used
        from paged_attention.modeling.kv_sharing import with_kv_sources

        layers = with_kv_sources(model, config, kinds, layers)
        parameter = next(model.parameters())
        first = layers[0]
        split = TensorParallel.of(model, first.num_heads, first.num_kv_heads, first.head_size)
        layers = latent_form(layers, model, mla, split.size)
        layers = sparse_form(layers, model, mla, split.size)
        if split.size > 1:
            layers = [_split(layer, index, split.size) for index, layer in enumerate(layers)]
        return cls(
            layers=tuple(layers),
            dtype=parameter.dtype,
            device=parameter.device,
            tensor_parallel=split,
            state_layers=tuple(i for i, kind in enumerate(kinds) if kind in _STATE_LAYER_TYPES),
        )

    # ------------------------------------------------------------------ views

    @property
    def cached_layers(self) -> tuple[LayerGeometry, ...]:
        """The layers whose keys and values the cache holds: every layer but those that read
        another layer's (``kv_source``) and those that keep only a state (``attends`` False)."""
        return tuple(layer for layer in self.layers if layer.attends and layer.kv_source is None)

    @property
    def num_layers(self) -> int:
        """Layers of the KV cache (:attr:`cached_layers`); ``len(layers)`` counts the model's."""
        return len(self.cached_layers)

    @property
    def num_kv_heads(self) -> int | tuple[int, ...]:
        """KV heads of every cached layer, or each one's when they differ (as PagedKVCache
        takes)."""
        return _one_or_each(layer.num_kv_heads for layer in self.cached_layers)

    @property
    def head_size(self) -> int | tuple[int, ...]:
        """Head size of every cached layer, or each one's when they differ."""
        return _one_or_each(layer.head_size for layer in self.cached_layers)

    @property
    def v_head_size(self) -> int | tuple[int, ...]:
        """The values' head size of every cached layer (``head_size`` but for multi-head latent
        attention), or each one's when they differ."""
        return _one_or_each(layer.v_head_size for layer in self.cached_layers)

    @property
    def latent(self) -> bool:
        """Whether the layers are cached in multi-head latent attention's latent form."""
        return any(layer.latent_rank for layer in self.layers)

    def released_reach(self) -> tuple[int | None, int | None]:
        """``(sliding_window, attention_chunk_size)`` a block manager may release blocks by, so
        that no layer reads a released block: the widest window when every layer slides, the
        chunk size when every layer attends in chunks of one size; ``(None, None)`` (release
        nothing) when some layer attends every position, or layers mix windows and chunks."""
        windows = {layer.sliding_window for layer in self.cached_layers}
        chunks = {layer.attention_chunk_size for layer in self.cached_layers}
        if 0 not in windows:
            return max(windows), None
        if 0 not in chunks and len(chunks) == 1:
            return None, chunks.pop()
        return None, None

    # ------------------------------------------------------------------ what it builds

    def kv_cache(
        self,
        block_size: int,
        num_blocks: int | None,
        max_memory: int | float | None,
        *,
        num_host_blocks: int = 0,
        kv_cache_dtype: str = "auto",
        k_scale: float | None = None,
        v_scale: float | None = None,
        reserved_bytes: int = 0,
    ) -> PagedKVCache:
        """The model's :class:`PagedKVCache`: ``num_blocks``, or as many as ``max_memory``
        allows (bytes, or a fraction of free CUDA / available host memory), or by default 90% of
        free CUDA memory, or on CPU a quarter of the available host memory, at most 4 GiB.
        ``reserved_bytes`` (a hybrid model's conv and recurrent states) come out of that budget
        before it is filled with blocks; they do not change an explicit ``num_blocks``.
        An fp8 ``kv_cache_dtype`` takes fixed ``k_scale``/``v_scale`` or, without them,
        calibrates each layer's scales from the first keys and values it stores.

        Tensor parallel: the cache holds this rank's KV heads, so a block takes ``1 / size`` of
        the bytes and a budget (``max_memory`` is per rank) holds ``size`` times the blocks. The
        CPU default is shared by the ranks (they run on one host). Every rank gets the same
        number of blocks, the smallest any rank's budget allows, so that their block managers
        decide alike; ranks given different explicit sizes raise ValueError."""
        if self.latent and kv_cache_dtype != "auto":
            raise ValueError(
                f"the latent form of multi-head latent attention (mla='latent') stores the model's "
                f"dtype, not kv_cache_dtype={kv_cache_dtype!r}: read the model with mla='expanded'"
            )
        split = self.tensor_parallel
        memory_budget = memory_fraction = None
        if isinstance(max_memory, float):
            memory_fraction = max_memory
        elif max_memory is not None:
            memory_budget = int(max_memory)
        elif num_blocks is None:
            if self.device.type == "cuda":
                memory_fraction = _CUDA_DEFAULT_FRACTION
            else:
                available = _cache_module._host_available_bytes()
                memory_budget = min(int(_CPU_DEFAULT_FRACTION * available), _CPU_DEFAULT_MAX_BYTES)
                memory_budget //= split.size
        if reserved_bytes and num_blocks is None:
            memory_budget = self._budget_left(memory_budget, memory_fraction, reserved_bytes)
            memory_fraction = None
        if split.size > 1 and num_blocks is None:
            num_blocks = self._blocks_for_budget_on_every_rank(
                block_size, kv_cache_dtype, memory_budget, memory_fraction
            )
            memory_budget = memory_fraction = None
        if split.size > 1:
            low, high = split.min_max([num_blocks, num_host_blocks, block_size])
            if low != high:
                raise ValueError(
                    "the tensor-parallel ranks were given different cache sizes (num_blocks "
                    f"{low[0]}..{high[0]}, num_host_blocks {low[1]}..{high[1]}, block_size "
                    f"{low[2]}..{high[2]}): every rank must build its cache with the same "
                    "arguments"
                )
        return PagedKVCache(
            self.num_layers,
            self.num_kv_heads,
            self.head_size,
            block_size,
            num_blocks,
            dtype=self.dtype,
            device=self.device,
            kv_cache_dtype=kv_cache_dtype,
            k_scale=k_scale,
            v_scale=v_scale,
            num_host_blocks=num_host_blocks,
            memory_budget=memory_budget,
            memory_fraction=memory_fraction,
            v_head_size=self.v_head_size,
            kernels_read=not self.latent,
        )

    def _budget_left(self, budget: int | None, fraction: float | None, reserved: int) -> int:
        """Bytes of a budget (``budget`` bytes, or ``fraction`` of free CUDA / available host
        memory, or of ``budget`` when both are given) left once ``reserved`` bytes are taken."""
        if fraction is not None:
            if not 0.0 < fraction <= 1.0:
                raise ValueError(f"memory_fraction must be in (0, 1], got {fraction}")
            if budget is None:
                cuda = self.device.type == "cuda"
                free = torch.cuda.mem_get_info(self.device)[0] if cuda else None
                budget = free if cuda else _cache_module._host_available_bytes()
            budget = int(budget * fraction)
        if budget - reserved <= 0:
            raise ValueError(
                f"a memory budget of {budget} bytes holds the states ({reserved} bytes) and no "
                "KV block"
            )
        return budget - reserved

    def _blocks_for_budget_on_every_rank(
        self, block_size, kv_cache_dtype, memory_budget, memory_fraction
    ) -> int:
        """The most blocks every tensor-parallel rank's budget holds (one all-reduce)."""
        error, count = None, 0
        try:
            block_bytes = bytes_per_block(
                self.num_layers,
                self.num_kv_heads,
                self.head_size,
                block_size,
                self.dtype,
                kv_cache_dtype,
                self.v_head_size,
            )
            count = num_blocks_for_budget(block_bytes, self.device, memory_budget, memory_fraction)
        except ValueError as raised:  # raised after the all-reduce, so on every rank
            error = raised
        (fewest,), _ = self.tensor_parallel.min_max([count])
        if fewest <= 0:
            raise error or ValueError(
                "another tensor-parallel rank's memory budget holds no KV block"
            )
        return fewest

    def block_manager(
        self, kv: PagedKVCache, enable_prefix_caching: bool, num_state_slots: int = 256
    ) -> BlockManager:
        """A manager over ``kv``'s blocks. When no layer attends every position (all slide over
        windows, or attend in chunks of one size) it releases the blocks no layer reads any
        more; not with prefix caching, whose cached blocks other sequences may still need. A
        hybrid model's manager also gives each sequence one of ``num_state_slots`` state slots
        (:class:`~paged_attention.kv.state_pool.StatefulBlockManager`, which refuses prefix
        caching)."""
        window, chunk = (None, None) if enable_prefix_caching else self.released_reach()
        kwargs = dict(
            enable_prefix_caching=enable_prefix_caching,
            sliding_window=window,
            attention_chunk_size=chunk,
        )
        if not self.state_layers:
            return kv.make_manager(**kwargs)
        return StatefulBlockManager(
            kv.num_blocks,
            kv.block_size,
            kv.num_host_blocks,
            num_state_slots=num_state_slots,
            **kwargs,
        )


# ------------------------------------------------------------------------------------------
# Reading a model


def text_config(model: torch.nn.Module):
    """The config of the model's text decoder (the model's own for a causal LM)."""
    config = model.config
    getter = getattr(config, "get_text_config", None)
    if getter is None:
        return config
    try:
        return getter(decoder=True)
    except TypeError:  # releases without the keyword
        return getter()


def layer_configs(config) -> list:
    """Each decoder layer's config: transformers' per-layer view of a heterogeneous config
    (layers that differ in heads, head size or window), else the one config for every layer.
    Per-layer settings are read from these: a heterogeneous config refuses to give one value
    for all layers."""
    if getattr(config, "is_heterogeneous", False):
        return list(config.per_layer_config)
    return [config] * config.num_hidden_layers


def layer_types(configs: list) -> list[str]:
    """Each layer's kind as transformers names it (``"full_attention"``,
    ``"sliding_attention"``, ``"chunked_attention"``, or a non-attention kind such as
    ``"linear_attention"``): ``config.layer_types``, else, as transformers' own caches infer it,
    sliding where the layer's config sets a ``sliding_window``, chunked where it sets an
    ``attention_chunk_size``."""
    kinds = getattr(configs[0], "layer_types", None)
    if kinds is None:
        kinds = [_inferred_layer_type(config) for config in configs]
    kinds = [str(kind) for kind in kinds]
    if len(kinds) != len(configs):
        raise UnsupportedModelError(
            f"the model's config lists {len(kinds)} layer_types for its {len(configs)} layers"
        )
    return kinds


def _inferred_layer_type(config) -> str:
    if getattr(config, "sliding_window", None):
        return SLIDING
    if getattr(config, "attention_chunk_size", None):
        return CHUNKED
    return FULL


def attention_modules(model: torch.nn.Module) -> dict[int, torch.nn.Module]:
    """The self-attention module of each layer index of the model's text decoder (transformers'
    ``get_decoder()``: not a vision tower's): a module with an integer ``layer_idx`` whose class
    is an attention (transformers' convention), the first one per index."""
    get_decoder = getattr(model, "get_decoder", None)
    decoder = get_decoder() if callable(get_decoder) else None
    found: dict[int, torch.nn.Module] = {}
    for module in (decoder if isinstance(decoder, torch.nn.Module) else model).modules():
        index = getattr(module, "layer_idx", None)
        if (
            isinstance(index, int)
            and not isinstance(index, bool)
            and "attention" in type(module).__name__.lower()
            and not getattr(module, "is_cross_attention", False)
        ):
            found.setdefault(index, module)
    return found


def refuse_unsupported(model: torch.nn.Module, configs: list) -> None:
    """Raise :class:`UnsupportedModelError` with the reason when paged attention cannot serve
    ``model``: an encoder-decoder, a model whose attention bypasses transformers' attention
    interface, or layers with a state other than transformers' conv and recurrent states
    (hybrid models whose states go through that interface are served). ``configs``: each
    layer's. (Multi-head latent attention is served: its keys and values reach the attention
    interface expanded, each of its own head size; so are layers that reuse another layer's
    keys and values, :mod:`paged_attention.modeling.kv_sharing`.)"""
    name = type(model).__name__
    config = configs[0]
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedModelError(
            f"{name} is an encoder-decoder model; paged attention serves decoder-only models "
            "(the cross-attention's keys and values are not a growing sequence)"
        )
    kinds = {str(kind) for kind in getattr(config, "layer_types", None) or []}
    if _SPARSE_INDEXED in kinds and not indexed_modules(model):
        raise UnsupportedModelError(
            f"{name} uses sparse attention: a lightning indexer chooses the cached tokens each "
            "query reads, which the paged cache computes only for transformers' "
            "DeepseekV32Attention (DeepSeek-V3.2), not for this model's attention modules"
        )
    served = {*_ATTENTION_LAYER_TYPES, _SPARSE_INDEXED}
    unknown = sorted(kinds - served - _NO_CACHE_LAYER_TYPES - _STATE_LAYER_TYPES)
    if unknown or getattr(model, "_is_stateful", False):
        what = ", ".join(repr(kind) for kind in unknown) or "recurrent"
        raise UnsupportedModelError(
            f"{name}'s {what} layers keep a state that transformers' cache interface for "
            "conv and recurrent states (get_conv_state, update_recurrent_state, ...) does not "
            "carry, which the paged cache's state slots hold"
        )
    if kinds & _STATE_LAYER_TYPES:
        _refuse_unsupported_hybrid(model, name, kinds)
    can_switch = getattr(type(model), "_can_set_attn_implementation", None)
    if callable(can_switch) and not can_switch():
        raise UnsupportedModelError(
            f"{name} computes attention in its own code instead of calling transformers' "
            "attention interface (its attention implementation cannot be switched, so "
            'set_attn_implementation("paged_attention") would leave it unchanged): its keys and '
            "values never reach a paged cache"
        )
    if getattr(config, "alibi", False) is True:
        raise UnsupportedModelError(
            f"{name} with ALiBi (config.alibi=True) adds its position bias to a 4D attention "
            "mask, while paged attention takes a 2D padding mask and builds the causal mask from "
            "the block tables; the rotary variants of the family are served"
        )


def _refuse_unsupported_hybrid(model: torch.nn.Module, name: str, kinds: set[str]) -> None:
    """A hybrid model's state layers go through transformers' cache interface for conv and
    recurrent states (or, for MiniMax, its ``MiniMaxCache`` calls), and its attention layers
    through the attention interface."""
    own_cache = callable(getattr(model, "get_linear_cache", None)) or "MiniMax" in name
    if own_cache and not is_minimax(model):  # MiniMax's own cache: paged_attention.modeling.minimax
        raise UnsupportedModelError(
            f"{name} is a hybrid model whose linear-attention layers keep their state in a cache "
            "class of its own (get_linear_cache / set_linear_cache), not through transformers' "
            "conv and recurrent state interface, which the paged cache's state slots serve"
        )
    if not kinds & (set(_ATTENTION_LAYER_TYPES) | {"hybrid", "hybrid_sliding"}):
        raise UnsupportedModelError(
            f"{name} has no attention layer (its layers are {sorted(kinds)}): it keeps only "
            "fixed-size states, with no keys and values to page; use transformers' own cache"
        )


def _latent_head_sizes(owner) -> tuple[int | None, int | None]:
    """Key and value head sizes of a multi-head latent attention module or config (``(None,
    None)`` when it does not describe one): keys of ``qk_nope_head_dim + qk_rope_head_dim``
    (``qk_head_dim``), values of ``v_head_dim``."""
    value_size = _int_attribute(owner, ("v_head_dim",))
    key_size = _int_attribute(owner, ("qk_head_dim",))
    if key_size is None:
        parts = [getattr(owner, name, None) for name in ("qk_nope_head_dim", "qk_rope_head_dim")]
        if all(isinstance(part, int) for part in parts):
            key_size = sum(parts)
    if key_size is None or value_size is None:
        return None, None
    return key_size, value_size


def _int_attribute(owner, names: Iterable[str]) -> int | None:
    for name in names:
        value = getattr(owner, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def _read_layer(index: int, kind: str, config, module) -> LayerGeometry:
    """Layer ``index`` from its attention module's attributes, then its config's."""
    num_heads = _int_attribute(module, ("num_heads", "num_attention_heads")) or _int_attribute(
        config, ("num_attention_heads",)
    )
    if num_heads is None:
        raise UnsupportedModelError(f"cannot read layer {index}'s number of attention heads")
    head_size, value_size = _latent_head_sizes(module)
    if head_size is None:
        head_size, value_size = _latent_head_sizes(config)
    if head_size is not None:
        # Multi-head latent attention: the attention interface receives the latents expanded
        # by kv_b_proj into one key and one value head per query head.
        num_kv_heads = num_heads
    else:
        head_size = _int_attribute(module, ("head_dim", "head_size")) or _int_attribute(
            config, ("head_dim",)
        )
        if head_size is None:
            head_size = config.hidden_size // num_heads
        value_size = head_size
        num_kv_heads = _kv_heads(module, config, num_heads, head_size)
    if num_heads % num_kv_heads:
        raise UnsupportedModelError(
            f"layer {index} has {num_heads} query heads over {num_kv_heads} KV heads, which do "
            "not group evenly"
        )
    window = chunk = 0
    if kind == SLIDING:
        window = getattr(config, "sliding_window", None) or 0
        if not window:
            raise UnsupportedModelError(
                f"layer {index} is a sliding-window layer but the config sets no sliding_window"
            )
    elif kind == CHUNKED:
        chunk = getattr(config, "attention_chunk_size", None) or 0
        if not chunk:
            raise UnsupportedModelError(
                f"layer {index} is a chunked-attention layer but the config sets no "
                "attention_chunk_size"
            )
    cap = getattr(module, "attn_logit_softcapping", None)
    if cap is None:
        cap = getattr(config, "attn_logit_softcapping", None)
    scale = getattr(module, "scaling", None)
    sinks = getattr(module, "sinks", None)
    return LayerGeometry(
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_size=head_size,
        scale=float(scale) if isinstance(scale, (int, float)) else None,
        sliding_window=int(window),
        attention_chunk_size=int(chunk),
        logits_soft_cap=float(cap or 0.0),
        sinks=isinstance(sinks, torch.Tensor),
        v_head_size=value_size,
    )


def _kv_heads(module, config, num_heads: int, head_size: int) -> int:
    """A layer's KV heads: as its attention module names them, or by the width of its own key
    projection, else as its config does (``multi_query``: one); none named: one per query
    head."""
    named = _int_attribute(module, ("num_key_value_heads", "num_kv_heads", "kv_heads"))
    if named is not None:
        return named
    groups = _int_attribute(module, ("num_key_value_groups",))
    if groups is not None:
        return num_heads // groups
    key_features = _int_attribute(getattr(module, "k_proj", None), ("out_features",))
    if key_features is not None:
        return key_features // head_size
    if getattr(config, "multi_query", False):
        return 1
    return _int_attribute(config, ("num_key_value_heads", "num_kv_heads")) or num_heads


def _split(layer: LayerGeometry, index: int, size: int) -> LayerGeometry:
    """This rank's share of a layer's heads."""
    if layer.num_heads % size or layer.num_kv_heads % size:
        raise ValueError(
            f"layer {index} has {layer.num_heads} query heads and {layer.num_kv_heads} KV heads, "
            f"which do not divide over a tensor-parallel size of {size}"
        )
    return replace(
        layer, num_heads=layer.num_heads // size, num_kv_heads=layer.num_kv_heads // size
    )


def _one_or_each(values: Iterable[int]) -> int | tuple[int, ...]:
    values = tuple(values)
    return values[0] if len(set(values)) == 1 else values
