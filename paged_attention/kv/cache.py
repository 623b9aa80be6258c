"""PagedKVCache: every layer's key/value cache tensors, and the execution of a manager's plans.

The :class:`~paged_attention.kv.block_manager.BlockManager` decides which block and slot holds every
token; this class owns the memory those block ids index and carries out what the manager asks
for: copy-on-write copies (``copy_blocks``, all layers of one shape in one call) and swaps between
the device and host (``swap_blocks``). One block id addresses the same block in every layer, so
:attr:`PagedKVCache.bytes_per_block` counts keys and values of all layers.

Layout (docs/design.md): per layer ``key_cache [num_blocks, num_kv_heads, head_size // x,
block_size, x]`` with ``x = 16 // element_size`` and ``value_cache [num_blocks, num_kv_heads,
v_head_size, block_size]``, where the values' head size ``v_head_size`` is ``head_size`` unless
given (multi-head latent attention through transformers' attention interface: DeepSeek-V3's keys
hold 192 dims, its values 128). Layers may differ in KV heads and head sizes (each layer's cache
has its own shape; the layers of one shape share one allocation). An fp8 cache stores ``uint8`` and
carries ``k_scale``/``v_scale``.
"""

from __future__ import annotations

import ctypes
import os
import sys
from collections.abc import Sequence
from itertools import groupby
from math import inf

import torch

from paged_attention.attention import AttentionMetadata
from paged_attention.kv.step_inputs import StepInputs, build_metadata
from paged_attention.ops import bindings as _ops
from paged_attention.ops.supported import FP8_FORMATS, check_block_size, check_head_size, is_fp8


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


FP8_SCALE_HEADROOM = 4.0
"""A calibrated fp8 scale maps the first keys' (values') largest magnitude to this fraction of
the format's largest value: later tokens up to this many times larger still fit."""
_SMALLEST_SCALE = 1e-8  # a first prompt of all-zero keys still gets a usable scale
_HUGE_PAGE_BYTES = 2 << 20
_MADV_HUGEPAGE = 14  # <sys/mman.h>


def advise_huge_pages(tensor: torch.Tensor) -> bool:
    """Ask Linux to back a CPU tensor's memory with transparent huge pages; call it before the
    memory is first written. Returns whether the advice was given (Linux, CPU, a tensor spanning
    at least one aligned 2 MiB page).

    A decode step reads blocks scattered over the whole cache, each in a different 4 KiB page:
    with 2 MiB pages fewer of those reads miss the TLB (measured: docs/cpu_kernels.md,
    huge pages). Whether the pages are huge is up to the kernel: the advice takes
    effect when ``/sys/kernel/mm/transparent_hugepage/enabled`` is ``madvise`` or ``always``.
    """
    if not sys.platform.startswith("linux") or tensor.device.type != "cpu":
        return False
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    aligned_start = -(-start // _HUGE_PAGE_BYTES) * _HUGE_PAGE_BYTES
    aligned_end = end // _HUGE_PAGE_BYTES * _HUGE_PAGE_BYTES
    if aligned_end <= aligned_start:
        return False
    madvise = ctypes.CDLL(None, use_errno=True).madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise(aligned_start, aligned_end - aligned_start, _MADV_HUGEPAGE) == 0


def cache_dtype_for(dtype: torch.dtype, kv_cache_dtype: str) -> torch.dtype:
    """The tensor dtype of a cache holding values of ``dtype`` stored as ``kv_cache_dtype``."""
    if is_fp8(kv_cache_dtype):
        return torch.uint8
    if dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"dtype must be float32, float16 or bfloat16, got {dtype}")
    return dtype


def layer_shapes(
    num_layers: int,
    num_kv_heads: int | Sequence[int],
    head_size: int | Sequence[int],
    v_head_size: int | Sequence[int] | None = None,
) -> list[tuple[int, int, int]]:
    """``(num_kv_heads, head_size, v_head_size)`` of each layer, each from one value for every
    layer or a sequence of ``num_layers`` values (``v_head_size`` None: ``head_size``)."""

    def per_layer(value, name: str) -> list[int]:
        if isinstance(value, Sequence):
            if len(value) != num_layers:
                raise ValueError(
                    f"{name} must be one value or one per layer ({num_layers}), got {len(value)}"
                )
            return [int(v) for v in value]
        return [int(value)] * num_layers

    if num_layers <= 0:
        raise ValueError(f"num_layers must be positive, got {num_layers}")
    sizes = per_layer(head_size, "head_size")
    v_sizes = sizes if v_head_size is None else per_layer(v_head_size, "v_head_size")
    shapes = list(zip(per_layer(num_kv_heads, "num_kv_heads"), sizes, v_sizes))
    for layer, shape in enumerate(shapes):
        if min(shape) <= 0:
            raise ValueError(
                "num_kv_heads, head_size and v_head_size must be positive, got "
                f"{', '.join(map(str, shape))} (layer {layer})"
            )
    return shapes


def bytes_per_block(
    num_layers: int,
    num_kv_heads: int | Sequence[int],
    head_size: int | Sequence[int],
    block_size: int,
    dtype: torch.dtype,
    kv_cache_dtype: str = "auto",
    v_head_size: int | Sequence[int] | None = None,
) -> int:
    """Bytes one block id occupies over all layers, keys and values together (``num_kv_heads``,
    ``head_size`` and ``v_head_size``: one value, or one per layer; ``v_head_size`` None: the
    values have ``head_size`` too)."""
    element = _element_size(cache_dtype_for(dtype, kv_cache_dtype))
    shapes = layer_shapes(num_layers, num_kv_heads, head_size, v_head_size)
    return sum(heads * (size + v_size) for heads, size, v_size in shapes) * block_size * element


HOST_SWAP_FACTOR = 4
"""Host swap blocks per device block an engine reserves by default on a GPU."""


def default_num_host_blocks(num_blocks: int, device: torch.device | str) -> int:
    """The host swap space an engine reserves unless told: ``HOST_SWAP_FACTOR`` times the
    device blocks when the device is a GPU (host memory beside device memory); none on a CPU,
    where "host" blocks would be more of the same RAM: a preempted request is recomputed."""
    return HOST_SWAP_FACTOR * num_blocks if torch.device(device).type == "cuda" else 0


def _host_available_bytes() -> int:
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def num_blocks_for_budget(
    block_bytes: int,
    device: torch.device,
    memory_budget: int | None = None,
    memory_fraction: float | None = None,
) -> int:
    """How many blocks of ``block_bytes`` fit a budget: ``memory_budget`` bytes, or
    ``memory_fraction`` of the device's free memory (CUDA) or of ``memory_budget`` when given
    (any device), or of the host's available memory (CPU without a budget)."""
    if memory_fraction is not None:
        if not 0.0 < memory_fraction <= 1.0:
            raise ValueError(f"memory_fraction must be in (0, 1], got {memory_fraction}")
        if memory_budget is not None:
            total = memory_budget
        elif device.type == "cuda":
            total = torch.cuda.mem_get_info(device)[0]
        else:
            total = _host_available_bytes()
        budget = int(total * memory_fraction)
    elif memory_budget is not None:
        budget = memory_budget
    else:
        raise ValueError("give num_blocks, memory_budget (bytes) or memory_fraction")
    if budget < block_bytes:
        raise ValueError(
            f"a memory budget of {budget} bytes holds no KV block of {block_bytes} bytes"
        )
    return budget // block_bytes


def _check_head_sizes(shapes, kv_cache_dtype: str, cache_dtype, kernels_read: bool) -> None:
    """Head sizes the kernels serve, or (``kernels_read=False``) keys that fill whole 16-byte
    chunks."""
    for _, size, v_size in sorted(set(shapes)):
        if kernels_read:
            check_head_size(size, kv_cache_dtype)
            check_head_size(v_size, kv_cache_dtype, name="v_head_size")
        elif size % (16 // _element_size(cache_dtype)):
            raise ValueError(f"head_size {size} does not fill the key cache's 16-byte chunks")


class PagedKVCache:
    """Key and value caches of ``num_layers`` layers on ``device``, plus optional host swap space.

    ``num_kv_heads`` and ``head_size`` are one value for every layer or one per layer (models
    whose layers differ); :attr:`num_kv_heads` and :attr:`head_size` hold what was given: an int
    when every layer agrees, else the tuple of each layer's. ``v_head_size`` (likewise, held in
    :attr:`v_head_size`) is the values' head size where it differs from the keys' (multi-head
    latent attention); None: ``head_size``.

    Size it with ``num_blocks`` or with a memory budget: ``memory_budget`` bytes, or
    ``memory_fraction`` of free CUDA memory (of ``memory_budget`` when both are given; of the
    host's available memory on CPU). ``dtype`` is the model's dtype; ``kv_cache_dtype`` is
    ``"auto"`` (store ``dtype``) or ``"fp8"``/``"fp8_e4m3"``/``"fp8_e5m2"``. An fp8 cache stores
    ``x / scale``, one key scale and one value scale per layer (:meth:`scales`): ``k_scale`` and
    ``v_scale`` give every layer the same fixed scales; left ``None``, each layer's scales are
    calibrated from the first keys and values it stores (:meth:`calibrate`, as vLLM's
    ``calculate_kv_scales`` does), so that their largest magnitude uses a quarter of the
    format's range. Host blocks are pinned when the device is a GPU, so swaps run asynchronously.
    Blocks start uninitialised (``torch.empty``): the ops never read a slot that holds no
    token, so nothing is touched before a token is stored, and on a CPU the resident memory
    grows with the tokens cached, up to the budget. On a CPU device the caches are allocated
    with :func:`advise_huge_pages`. ``kernels_read=False``: the layers are read with PyTorch
    rather than the attention kernels (multi-head latent attention's latent form), so the head
    sizes need not be among those the kernels are built for.
    """

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int | Sequence[int],
        head_size: int | Sequence[int],
        block_size: int = 16,
        num_blocks: int | None = None,
        *,
        dtype: torch.dtype = torch.float16,
        device: torch.device | str = "cpu",
        kv_cache_dtype: str = "auto",
        k_scale: float | None = None,
        v_scale: float | None = None,
        num_host_blocks: int = 0,
        memory_budget: int | None = None,
        memory_fraction: float | None = None,
        v_head_size: int | Sequence[int] | None = None,
        kernels_read: bool = True,
    ) -> None:
        shapes = layer_shapes(num_layers, num_kv_heads, head_size, v_head_size)
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if num_host_blocks < 0:
            raise ValueError(f"num_host_blocks must be >= 0, got {num_host_blocks}")
        self.device = torch.device(device)
        self.dtype = dtype
        self.kv_cache_dtype = kv_cache_dtype
        self.cache_dtype = cache_dtype_for(dtype, kv_cache_dtype)
        _check_head_sizes(shapes, kv_cache_dtype, self.cache_dtype, kernels_read)
        check_block_size(block_size)
        self.num_layers = num_layers
        self.layer_shapes: tuple[tuple[int, int, int], ...] = tuple(shapes)
        heads, sizes, v_sizes = zip(*shapes)
        self.num_kv_heads = heads[0] if len(set(heads)) == 1 else heads
        self.head_size = sizes[0] if len(set(sizes)) == 1 else sizes
        self.v_head_size = v_sizes[0] if len(set(v_sizes)) == 1 else v_sizes
        self.block_size = block_size
        self.bytes_per_block = bytes_per_block(
            num_layers, heads, sizes, block_size, dtype, kv_cache_dtype, v_sizes
        )
        if num_blocks is None:
            num_blocks = num_blocks_for_budget(
                self.bytes_per_block, self.device, memory_budget, memory_fraction
            )
        elif memory_budget is not None or memory_fraction is not None:
            raise ValueError("give either num_blocks or a memory budget, not both")
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.num_host_blocks = num_host_blocks

        # One allocation per kind and layer shape; a layer's cache is a contiguous view of it.
        # ``_groups`` lists the layers of each shape, in the order of the allocations.
        order = sorted(range(num_layers), key=lambda layer: shapes[layer])
        self._groups = [list(g) for _, g in groupby(order, key=lambda layer: shapes[layer])]
        self._key_groups, self.key_caches = self._allocate(num_blocks, self.device, keys=True)
        self._value_groups, self.value_caches = self._allocate(num_blocks, self.device)
        pin = self.device.type == "cuda"
        host = torch.device("cpu")
        self._host_key_groups, self.host_key_caches = self._allocate(
            num_host_blocks, host, keys=True, pin=pin
        )
        self._host_value_groups, self.host_value_caches = self._allocate(
            num_host_blocks, host, pin=pin
        )
        if (k_scale is None) != (v_scale is None):
            raise ValueError("give both k_scale and v_scale, or neither (calibrated)")
        for name, value in (("k_scale", k_scale), ("v_scale", v_scale)):
            if value is not None and not (isinstance(value, (int, float)) and 0 < value < inf):
                raise ValueError(f"{name} must be a positive finite number, got {value!r}")
        fixed = k_scale is not None
        self.k_scales = torch.full(
            (num_layers,), float(k_scale) if fixed else 1.0, dtype=torch.float32, device=self.device
        )
        self.v_scales = torch.full(
            (num_layers,), float(v_scale) if fixed else 1.0, dtype=torch.float32, device=self.device
        )
        self._calibrated = [fixed or not is_fp8(kv_cache_dtype)] * num_layers

    # ------------------------------------------------------------------ fp8 scales

    def scales(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(k_scale, v_scale)`` of one layer: one-element float32 tensors on the cache's
        device, as the ops take them (1.0 for a cache that is not fp8)."""
        return self.k_scales[layer : layer + 1], self.v_scales[layer : layer + 1]

    def calibrate(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """Set an fp8 layer's scales from the keys and values about to be stored in it, the
        first time only (and never when they were given): the largest magnitude maps to
        ``1 / FP8_SCALE_HEADROOM`` of the format's largest value, leaving room for later tokens
        (vLLM's ``calculate_kv_scales`` leaves 2-4x). Runs on the device, without a host sync."""
        if self._calibrated[layer] or key.numel() == 0:
            return
        largest = FP8_FORMATS[self.kv_cache_dtype][1]
        for scales, states in ((self.k_scales, key), (self.v_scales, value)):
            amax = states.detach().abs().amax().to(torch.float32)
            scales[layer] = (amax * FP8_SCALE_HEADROOM / largest).clamp_min(_SMALLEST_SCALE)
        self._calibrated[layer] = True

    def _allocate(
        self, blocks: int, device: torch.device, keys: bool = False, pin: bool = False
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Key (``keys``) or value caches of ``blocks`` blocks, uninitialised: one allocation per
        layer shape, and each layer's view of its allocation."""
        x = 16 // _element_size(self.cache_dtype)
        allocations, views = [], [torch.empty(0)] * self.num_layers
        for layers in self._groups:
            heads, size, v_size = self.layer_shapes[layers[0]]
            block = (
                (heads, size // x, self.block_size, x) if keys else (heads, v_size, self.block_size)
            )
            shape = (len(layers), blocks, *block)
            # Not zeroed: the kernels never read a slot no token was stored in (past a
            # sequence's length, before its window: tests/test_attention_cpu.py fills those with
            # NaN), and zeroing would touch, so hold, every page of the budget up front.
            cache = torch.empty(shape, dtype=self.cache_dtype, device=device, pin_memory=pin)
            if not pin:
                advise_huge_pages(cache)
            allocations.append(cache)
            for layer, view in zip(layers, cache.unbind(0)):
                views[layer] = view
        return allocations, views

    # ------------------------------------------------------------------ access

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(key_cache, value_cache)`` of one layer, as :class:`PagedAttention` takes them."""
        return self.key_caches[index], self.value_caches[index]

    @property
    def device_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block

    def make_manager(self, **kwargs):
        """A :class:`~paged_attention.kv.block_manager.BlockManager` over exactly this cache's
        device and host blocks (a convenience: the cache itself never consults one)."""
        from paged_attention.kv.block_manager import BlockManager  # the planner sits above

        return BlockManager(self.num_blocks, self.block_size, self.num_host_blocks, **kwargs)

    # ------------------------------------------------------------------ executing plans

    def copy_blocks(self, pairs: Sequence[tuple[int, int]] | torch.Tensor) -> None:
        """Copy-on-write: ``block[dst] = block[src]`` in every layer's keys and values, one call
        per layer shape."""
        mapping = self._mapping(pairs, self.device)
        if mapping.shape[0]:
            for layers in self._groups:
                _ops.copy_blocks(
                    [self.key_caches[layer] for layer in layers],
                    [self.value_caches[layer] for layer in layers],
                    mapping,
                )

    def swap_out(self, pairs: Sequence[tuple[int, int]] | torch.Tensor) -> None:
        """Copy ``(device block, host block)`` pairs to host memory, for every layer."""
        self._swap(pairs, self.key_caches, self.host_key_caches)
        self._swap(pairs, self.value_caches, self.host_value_caches)

    def swap_in(self, pairs: Sequence[tuple[int, int]] | torch.Tensor) -> None:
        """Copy ``(host block, device block)`` pairs back to the device, for every layer."""
        self._swap(pairs, self.host_key_caches, self.key_caches)
        self._swap(pairs, self.host_value_caches, self.value_caches)

    def _swap(self, pairs, sources: list[torch.Tensor], destinations: list[torch.Tensor]) -> None:
        if not self.num_host_blocks:
            raise ValueError("this PagedKVCache has no host blocks (num_host_blocks=0)")
        mapping = self._mapping(pairs, torch.device("cpu"))
        if mapping.shape[0]:
            for src, dst in zip(sources, destinations):
                _ops.swap_blocks(src, dst, mapping)

    @staticmethod
    def _mapping(pairs, device: torch.device) -> torch.Tensor:
        if isinstance(pairs, torch.Tensor):
            mapping = pairs.to(dtype=torch.int64).reshape(-1, 2)
        else:
            mapping = torch.tensor(list(pairs), dtype=torch.int64).reshape(-1, 2)
        return mapping.to(device, non_blocking=True)

    # ------------------------------------------------------------------ step metadata

    def metadata(
        self,
        manager,
        seq_ids: Sequence[int],
        query_lens: int | Sequence[int] = 1,
    ) -> AttentionMetadata:
        """Metadata of a step whose new tokens are the last ``query_lens`` tokens of each
        sequence of ``manager`` (a :class:`~paged_attention.kv.block_manager.BlockManager` over this
        cache); their slots must already be reserved (``allocate``/``append_slots``)."""
        self._check_manager(manager)
        return build_metadata(StepInputs.from_manager(manager, seq_ids, query_lens), self.device)

    def decode_metadata(self, manager, seq_ids: Sequence[int]) -> AttentionMetadata:
        """Reserve one slot per sequence (``manager.decode_step``), run the copy-on-write copies
        it asks for, and return the decode step's metadata."""
        self._check_manager(manager)
        pairs, *arrays = manager.decode_step(list(seq_ids))
        self.copy_blocks(pairs)
        return build_metadata(StepInputs.decode(manager, *arrays), self.device)

    def _check_manager(self, manager) -> None:
        """A manager plans block ids and slots for one cache geometry: this one's."""
        if manager.block_size != self.block_size or manager.num_device_blocks > self.num_blocks:
            raise ValueError(
                f"the block manager plans {manager.num_device_blocks} blocks of "
                f"{manager.block_size} tokens, this cache holds {self.num_blocks} blocks of "
                f"{self.block_size}: build the manager with cache.make_manager()"
            )
