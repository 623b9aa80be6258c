"""PagedAttention for PyTorch: a KV cache kept in fixed-size blocks addressed by block tables.

``torch.ops.paged_attention.*`` are the raw ops (loaded on import); the functions below wrap them.
"""

from paged_attention.attention import AttentionMetadata, PagedAttention
from paged_attention.kv.block_manager import (
    AllocStatus,
    BlockManager,
    BlockManagerError,
    BlockManagerStats,
    DoubleFreeError,
    DuplicateSequenceError,
    OutOfBlocksError,
    SwapError,
    UnknownSequenceError,
)
from paged_attention.kv.cache import PagedKVCache
from paged_attention.ops.bindings import (
    copy_blocks,
    num_partitions,
    paged_attention,
    paged_attention_varlen,
    reshape_and_cache,
    swap_blocks,
    use_v2,
)

__version__ = "0.1.0"

__all__ = [
    "AttentionMetadata",
    "PagedAttention",
    "PagedKVCache",
    "AllocStatus",
    "BlockManager",
    "BlockManagerError",
    "BlockManagerStats",
    "DoubleFreeError",
    "DuplicateSequenceError",
    "OutOfBlocksError",
    "SwapError",
    "UnknownSequenceError",
    "copy_blocks",
    "num_partitions",
    "paged_attention",
    "paged_attention_varlen",
    "reshape_and_cache",
    "swap_blocks",
    "use_v2",
]
