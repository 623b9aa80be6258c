"""Hugging Face transformers on a paged KV cache.

Importing this module registers an attention implementation named ``"paged_attention"``
(``transformers.AttentionInterface``) and a matching mask function
(``transformers.AttentionMaskInterface``, which hands the 2D padding mask through instead of
building a dense ``[batch, 1, q, kv]`` mask)::

    import paged_attention.integrations.transformers  # registers "paged_attention"
    from paged_attention.integrations.transformers import PagedCache

    model.set_attn_implementation("paged_attention")
    out = model.generate(**inputs, past_key_values=PagedCache(model, num_blocks=1024))

How it fits transformers' call order: every attention layer calls
``past_key_values.update(key, value, layer_idx)`` and then the attention function. ``update``
only hands the new keys and values on; the attention function stores them in the paged cache
(``reshape_and_cache``, pad tokens skipped) and attends over each sequence's paged context. The
first layer of a forward pass also does the step's bookkeeping in the block manager:

* the first forward of a ``generate`` call allocates one sequence per batch row; rows that are
  exact copies of the previous row (``num_return_sequences``, beams) *fork* its blocks instead;
* later forwards append slots and run the copy-on-write copies the manager asks for, for all
  layers in one ``copy_blocks`` call;
* ``reorder_cache`` (beam search), ``batch_select_indices`` and ``batch_repeat_interleave``
  become forks and frees of block tables: no key or value is copied, and the next step copies at
  most the one partly filled last block of a beam that shares it.

:class:`PagedCacheBase` is what both caches of this project share with transformers: the engine's
packed steps (``paged_attention.engine.model_runner.StepCache``) subclass it too.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import threading
from dataclasses import dataclass

import torch

from paged_attention import cache as _cache_module
from paged_attention.attention import AttentionMetadata, PagedAttention
from paged_attention.block_manager import BlockManager, OutOfBlocksError, reassign
from paged_attention.cache import PagedKVCache, bytes_per_block, num_blocks_for_budget
from paged_attention.integrations.tensor_parallel import TensorParallel

try:
    import transformers
    from transformers.cache_utils import Cache
except ImportError as error:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "paged_attention.integrations.transformers needs transformers 5.x: "
        "pip install 'paged_attention[hf]'"
    ) from error

ATTN_IMPLEMENTATION = "paged_attention"
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
# Without a size, a CPU cache takes this much of the available host memory, at most
# _CPU_DEFAULT_MAX_BYTES (vLLM's CPU backend reserves 4 GiB by default); CUDA takes 90% of the
# free device memory.
_CPU_DEFAULT_FRACTION = 0.25
_CPU_DEFAULT_MAX_BYTES = 4 << 30
_CUDA_DEFAULT_FRACTION = 0.9


def cache_argument_name(model: torch.nn.Module) -> str:
    """The keyword under which ``model``'s forward takes a cache: ``"cache"`` in transformers
    releases that renamed it (passing ``past_key_values`` there logs a deprecation warning), else
    ``"past_key_values"``."""
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
        import importlib

        found = getattr(importlib.import_module(module_name), name)
    return found


AttentionInterface = _interface("AttentionInterface", "transformers.modeling_utils")
AttentionMaskInterface = _interface("AttentionMaskInterface", "transformers.masking_utils")

# The cache whose ``update`` ran last in this thread, and the key tensor it returned: the
# attention function that follows in the same layer reads it (transformers does not pass the
# cache to attention functions).
_active = threading.local()


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
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """The ``"paged_attention"`` attention function: query ``[batch, heads, q, dim]``, key and
    value ``[batch, kv_heads, q, dim]`` (this step's only); returns ``([batch, q, heads, dim],
    None)``."""
    state = getattr(_active, "value", None)
    if state is None or state[1] is not key:
        raise RuntimeError(
            f'attn_implementation="{ATTN_IMPLEMENTATION}" needs past_key_values=PagedCache(model, '
            "...) and use_cache=True: the keys and values live in the paged cache"
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
    cache: PagedCacheBase = state[0]
    out = cache.attend(
        module,
        query,
        key,
        value,
        attention_mask,
        module.scaling if scaling is None else scaling,
        sliding_window or 0,
        softcap or 0.0,
    )
    return out, None


def paged_attention_mask(*args, attention_mask: torch.Tensor | None = None, **kwargs):
    """Mask function of ``"paged_attention"``: causality and windows are the attention's job,
    so only the 2D padding mask ``[batch, past + q]`` (or ``None``) is passed on."""
    return attention_mask


AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
AttentionMaskInterface.register(ATTN_IMPLEMENTATION, paged_attention_mask)


# ------------------------------------------------------------------------------------------
# What a model's KV cache must hold


@dataclass(frozen=True)
class ModelGeometry:
    """The shape of a decoder-only model's KV cache, read from its config. On a
    tensor-parallel model (``tensor_parallel.size > 1``) ``num_heads`` and ``num_kv_heads``
    count this rank's heads, the ones its cache holds."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    layer_windows: tuple[int, ...]  # sliding window of each layer (0 = full attention)
    dtype: torch.dtype
    device: torch.device
    tensor_parallel: TensorParallel = TensorParallel()

    @classmethod
    def of(cls, model: torch.nn.Module) -> ModelGeometry:
        config = _text_config(model)
        model_type = getattr(config, "model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES or getattr(config, "is_encoder_decoder", False):
            raise ValueError(
                f"PagedCache supports decoder-only models with model_type in "
                f"{SUPPORTED_MODEL_TYPES} (Llama-, Mistral- and Qwen2-style); got {model_type!r}"
            )
        parameter = next(model.parameters())
        num_heads = config.num_attention_heads
        num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
        head_size = getattr(config, "head_dim", None) or config.hidden_size // num_heads
        split = TensorParallel.of(model, num_heads, num_kv_heads, head_size)
        return cls(
            num_layers=config.num_hidden_layers,
            num_heads=num_heads // split.size,
            num_kv_heads=num_kv_heads // split.size,
            head_size=head_size,
            layer_windows=tuple(_layer_windows(config)),
            dtype=parameter.dtype,
            device=parameter.device,
            tensor_parallel=split,
        )

    @property
    def shared_window(self) -> int:
        """The window every layer slides over, or 0 when some layer attends everything (or the
        layers differ): only then may a block manager release blocks that left the window."""
        windows = set(self.layer_windows)
        return windows.pop() if len(windows) == 1 else 0

    def kv_cache(
        self,
        block_size: int,
        num_blocks: int | None,
        max_memory: int | float | None,
        *,
        num_host_blocks: int = 0,
        kv_cache_dtype: str = "auto",
    ) -> PagedKVCache:
        """The model's :class:`PagedKVCache`: ``num_blocks``, or as many as ``max_memory``
        allows (bytes, or a fraction of free CUDA / available host memory), or by default 90% of
        free CUDA memory, or on CPU a quarter of the available host memory, at most 4 GiB.

        Tensor parallel: the cache holds this rank's KV heads, so a block takes ``1 / size`` of
        the bytes and a budget (``max_memory`` is per rank) holds ``size`` times the blocks. The
        CPU default is shared by the ranks (they run on one host). Every rank gets the same
        number of blocks, the smallest any rank's budget allows, so that their block managers
        decide alike; ranks given different explicit sizes raise ValueError."""
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
            num_host_blocks=num_host_blocks,
            memory_budget=memory_budget,
            memory_fraction=memory_fraction,
        )

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

    def block_manager(self, kv: PagedKVCache, enable_prefix_caching: bool) -> BlockManager:
        """A manager over ``kv``'s blocks. When every layer slides over the same window it
        releases the blocks that left it (not with prefix caching, whose cached blocks other
        sequences may still need)."""
        window = self.shared_window
        return kv.make_manager(
            enable_prefix_caching=enable_prefix_caching,
            sliding_window=window if window and not enable_prefix_caching else None,
        )


def _text_config(model):
    config = model.config
    getter = getattr(config, "get_text_config", None)
    return getter() if getter is not None else config


def _layer_windows(config) -> list[int]:
    """Sliding window of each layer (0 = full attention), as the model's attention applies it."""
    window = getattr(config, "sliding_window", None) or 0
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and config.model_type != "mistral":
        return [window if kind == "sliding_attention" else 0 for kind in layer_types]
    return [window] * config.num_hidden_layers


# ------------------------------------------------------------------------------------------
# Caches


class PagedCacheBase(Cache):
    """A ``transformers.Cache`` whose layers attend through :class:`PagedAttention` over a
    :class:`PagedKVCache`, for the model it was built for. A subclass defines what a forward
    pass stores and attends: ``_attend_layer(layer_idx, query, key, value, attention_mask,
    scale, window, cap)`` (``[batch, heads, q, dim]`` in, ``[batch, q, heads, dim]`` out)."""

    def __init__(self, model: torch.nn.Module, geometry: ModelGeometry, kv: PagedKVCache) -> None:
        super().__init__(layers=[])
        self.geometry = geometry
        self.num_layers = geometry.num_layers
        self.num_kv_heads = geometry.num_kv_heads
        self.head_size = geometry.head_size
        self.layer_windows = list(geometry.layer_windows)
        self.kv_cache = kv
        self.tensor_parallel = geometry.tensor_parallel
        self._model_config = model.config
        self._modules: dict[int, PagedAttention] = {}
        self._checks_steps = geometry.tensor_parallel.checks_steps
        self._checked_metadata: AttentionMetadata | None = None

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
        _active.value = (self, key_states)
        return key_states, value_states

    def attend(self, module, query, key, value, attention_mask, scale, window, cap):
        """Called by the attention function with this layer's new query/key/value ``[batch,
        heads, q, dim]``; returns ``[batch, q, heads, dim]``."""
        layers = getattr(getattr(module, "config", None), "num_hidden_layers", None)
        if layers is not None and layers != self.num_layers:
            raise ValueError(
                f"PagedCache was built for a model with {self.num_layers} layers; the model "
                f"using it has {layers}: build a PagedCache for the model it serves"
            )
        head_size = query.shape[-1]
        if key.shape[1] != self.num_kv_heads or head_size != self.head_size:
            raise ValueError(
                f"PagedCache was built for {self.num_kv_heads} KV heads of size {self.head_size}; "
                f"layer {module.layer_idx} of the model using it has {key.shape[1]} of size "
                f"{head_size}: build a PagedCache for the model it serves"
            )
        return self._attend_layer(
            module.layer_idx, query, key, value, attention_mask, scale, window, cap
        )

    def _begin_layer(self, layer_idx: int) -> None:
        """Hook: ``update`` of layer ``layer_idx`` is about to hand its keys and values on."""

    def _packed_attention(
        self, layer_idx, query, key, value, metadata: AttentionMetadata, scale, window, cap
    ) -> torch.Tensor:
        """PagedAttention over packed ``[tokens, heads, dim]`` rows described by ``metadata``."""
        if self._checks_steps and metadata is not self._checked_metadata:
            self._check_step_on_every_rank(metadata)
        module = self._modules.get(layer_idx)
        num_heads = query.shape[1]
        if (
            module is None
            or module.num_heads != num_heads
            or module.scale != float(scale)
            or module.sliding_window != window
            or module.logits_soft_cap != cap
        ):
            module = PagedAttention(
                num_heads,
                self.head_size,
                self.num_kv_heads,
                scale=scale,
                sliding_window=window,
                logits_soft_cap=cap,
                kv_cache_dtype=self.kv_cache.kv_cache_dtype,
            )
            self._modules[layer_idx] = module
        return module(
            query,
            key,
            value,
            self.kv_cache.layer(layer_idx),
            metadata,
            k_scale=self.kv_cache.k_scale,
            v_scale=self.kv_cache.v_scale,
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
        return [window > 0 for window in self.layer_windows]

    @property
    def is_dummy(self) -> list[bool]:
        return [False] * self.num_layers


class PagedCache(PagedCacheBase):
    """A ``transformers.Cache`` for ``generate()`` whose keys and values live in a
    :class:`PagedKVCache`, managed by a :class:`~paged_attention.block_manager.BlockManager`.

    ``num_blocks`` blocks of ``block_size`` tokens, or as many as ``max_memory`` allows: bytes
    (int) or a fraction (float) of free CUDA memory (of available host memory on CPU). With
    neither: 90% of free memory on CUDA; on CPU a quarter of the available host memory, at most
    4 GiB. ``num_host_blocks`` adds host swap space, ``kv_cache_dtype`` is ``"auto"`` or an fp8
    format, and ``enable_prefix_caching`` lets sequences allocated with their token ids share
    cached prompt blocks.

    Supports decoder-only Llama-, Mistral- and Qwen2-style models (GQA and sliding windows
    included) with ``attn_implementation="paged_attention"``, with the head sizes the kernels
    are built for. One ``PagedCache`` serves the model it was built for, one ``generate`` call at
    a time; :meth:`reset` frees every block for the next one. A later ``generate`` on the same
    cache must continue what it holds (its ``input_ids`` start with the tokens already cached, as
    with transformers' own caches); a new prompt without ``reset()`` raises. To see those
    ``input_ids``, the first ``PagedCache`` of a model wraps the model's
    ``prepare_inputs_for_generation`` once (the wrapper only compares, at the first step of a
    ``generate`` call).
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
        enable_prefix_caching: bool = False,
    ) -> None:
        geometry = ModelGeometry.of(model)
        kv = geometry.kv_cache(
            block_size,
            num_blocks,
            max_memory,
            num_host_blocks=num_host_blocks,
            kv_cache_dtype=kv_cache_dtype,
        )
        super().__init__(model, geometry, kv)
        self.block_manager = geometry.block_manager(kv, enable_prefix_caching)
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
        return True

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last tokens of every row (assisted generation and prompt lookup reject draft
        tokens this way): a negative argument removes that many, a positive one is the number
        of tokens to keep (the meaning older transformers releases give it), and 0 keeps
        everything. Blocks wholly past
        the cut return to the pool; a kept block that other rows share is copied before it is
        written again (``BlockManager.truncate``)."""
        if isinstance(tokens_to_remove, bool) or not isinstance(tokens_to_remove, int):
            raise ValueError(f"crop takes an int, got {tokens_to_remove!r}")
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

    # ------------------------------------------------------------------ attention

    def _attend_layer(self, layer_idx, query, key, value, attention_mask, scale, window, cap):
        batch, num_heads, q_len, head_size = query.shape
        if self._step_open:
            self._begin_step(batch, q_len, key, value, attention_mask)
            self._step_open = False
        packed = [
            t.transpose(1, 2).reshape(batch * q_len, t.shape[1], head_size)
            for t in (query, key, value)
        ]
        if self._token_index is not None:
            packed = [t[self._token_index] for t in packed]
        out = self._packed_attention(layer_idx, *packed, self._metadata, scale, window, cap)
        if self._token_index is not None:
            full = out.new_zeros(batch * q_len, num_heads, head_size)
            full[self._token_index] = out
            out = full
        return out.view(batch, q_len, num_heads, head_size)

    def _begin_step(self, batch, q_len, key, value, attention_mask) -> None:
        """Bookkeeping once per forward pass, before the first layer stores anything."""
        real = self._real_tokens(batch, q_len, attention_mask)
        counts = [q_len] * batch if real is None else real.sum(dim=1).tolist()
        if not self._rows:
            self._rows = [None] * batch
            # Each rank compares its own heads; and-ed, every rank forks the same rows.
            duplicates = self.tensor_parallel.all_ranks(self._duplicate_rows(key, value, real))
        elif batch != len(self._rows):
            raise ValueError(
                f"this PagedCache holds a batch of {len(self._rows)} rows but the input has "
                f"{batch}; call cache.reset() before generating for a new batch"
            )
        else:
            duplicates = [False] * batch

        try:
            if all(n == 1 for n in counts) and None not in self._rows:
                pairs, block_tables, seq_lens, slots = self.block_manager.decode_step(self._rows)
                self.kv_cache.copy_blocks(pairs)
                metadata = AttentionMetadata.build(
                    [1] * batch,
                    seq_lens.tolist(),
                    block_tables,
                    slots,
                    self.kv_cache.device,
                    seq_lens,
                    self.block_manager.sliding_window,
                )
            else:
                metadata = self._grow_rows(counts, duplicates)
        except OutOfBlocksError as error:
            if self._seen == 0:
                self._rows = []
            raise OutOfBlocksError(
                f"PagedCache is out of KV blocks ({error}): it holds {self.kv_cache.num_blocks} "
                f"blocks of {self.kv_cache.block_size} tokens. Give it more (PagedCache(..., "
                "num_blocks=...) or max_memory=...) or generate fewer or shorter sequences, and "
                "call cache.reset() before the next generate()"
            ) from error
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
        slots = self.block_manager.slot_mapping_tensor(seq_ids, query_lens)
        starts = [0, *itertools.accumulate(query_lens)]
        for index in dropped:  # a forked copy reads its parent's slots and writes none
            slots[starts[index] : starts[index + 1]] = -1
        seq_lens = self.block_manager.seq_lens_tensor(seq_ids)
        return AttentionMetadata.build(
            query_lens,
            seq_lens.tolist(),
            self.block_manager.block_tables_tensor(seq_ids),
            slots,
            self.kv_cache.device,
            seq_lens,
            self.block_manager.sliding_window,
        )

    @staticmethod
    def _real_tokens(batch, q_len, attention_mask) -> torch.Tensor | None:
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

    @staticmethod
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
        self._rows = reassign(self.block_manager, self._rows, sources, lambda: next(self._ids))
        if self._fed_ids is not None:
            self._fed_ids = self._fed_ids[torch.tensor(sources, device=self._fed_ids.device)]
        self.peak_blocks_in_use = max(self.peak_blocks_in_use, self.blocks_in_use())


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
