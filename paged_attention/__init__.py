"""PagedAttention for PyTorch: a KV cache kept in fixed-size blocks addressed by block tables.

The names below are imported when first used (PEP 562), so that ``import paged_attention`` and
the command line (``python -m paged_attention serve`` answers before torch is imported) stay
cheap. ``torch.ops.paged_attention.*`` are the raw ops: they are registered by
:mod:`paged_attention.ops.bindings`, which any of the names below imports (or
``import paged_attention.ops.bindings`` directly).
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "AttentionMetadata": "paged_attention.attention",
    "PagedAttention": "paged_attention.attention",
    "PagedKVCache": "paged_attention.kv.cache",
    "AllocStatus": "paged_attention.kv.block_manager",
    "BlockManager": "paged_attention.kv.block_manager",
    "BlockManagerError": "paged_attention.kv.block_manager",
    "BlockManagerStats": "paged_attention.kv.block_manager",
    "DoubleFreeError": "paged_attention.kv.block_manager",
    "DuplicateSequenceError": "paged_attention.kv.block_manager",
    "OutOfBlocksError": "paged_attention.kv.block_manager",
    "SwapError": "paged_attention.kv.block_manager",
    "UnknownSequenceError": "paged_attention.kv.block_manager",
    "copy_blocks": "paged_attention.ops.bindings",
    "num_partitions": "paged_attention.ops.bindings",
    "paged_attention": "paged_attention.ops.bindings",
    "paged_attention_varlen": "paged_attention.ops.bindings",
    "reshape_and_cache": "paged_attention.ops.bindings",
    "swap_blocks": "paged_attention.ops.bindings",
    "use_v2": "paged_attention.ops.bindings",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'paged_attention' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
