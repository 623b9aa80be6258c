"""What the kernels are built for: head sizes, block sizes and KV-cache formats.

The C++ checks (csrc/checks.cpp) enforce the same lists; the Python layers above the ops read them
from here so that a configuration the kernels cannot serve is refused when it is set up, not at
the first forward pass.
"""

from __future__ import annotations

import torch

HEAD_SIZES = (32, 64, 80, 96, 112, 120, 128, 192, 256)
BLOCK_SIZES = (8, 16, 32)
PARTITION_SIZE = 512
"""Tokens per partition of the v2 decode op (its ``tmp_out``/``max_logits``/``exp_sums``)."""
FP8_FORMATS = {
    "fp8": (torch.float8_e4m3fn, 448.0),
    "fp8_e4m3": (torch.float8_e4m3fn, 448.0),
    "fp8_e5m2": (torch.float8_e5m2, 57344.0),
}
"""``kv_cache_dtype`` name -> (torch dtype of the stored bits, largest finite value)."""


def is_fp8(kv_cache_dtype: str) -> bool:
    """Whether ``kv_cache_dtype`` names an fp8 format ("auto" is not); any other name raises."""
    if kv_cache_dtype == "auto":
        return False
    if kv_cache_dtype in FP8_FORMATS:
        return True
    raise ValueError(
        "kv_cache_dtype must be one of 'auto', 'fp8', 'fp8_e4m3', 'fp8_e5m2', "
        f"got {kv_cache_dtype!r}"
    )


def check_head_size(head_size: int, kv_cache_dtype: str = "auto", name: str = "head_size") -> None:
    """Raise a ValueError naming what is supported unless the kernels serve ``head_size`` with
    this cache format (fp8 chunks hold 16 elements, so fp8 needs a multiple of 16). ``name``:
    the argument checked (``v_head_size`` for the values' own head size)."""
    if head_size not in HEAD_SIZES:
        raise ValueError(
            f"{name} {head_size} is not supported by the attention kernels (supported: "
            f"{', '.join(map(str, HEAD_SIZES))})"
        )
    if is_fp8(kv_cache_dtype) and head_size % 16:
        raise ValueError(
            f"an fp8 KV cache needs a {name} divisible by 16, got {head_size} "
            f"(kv_cache_dtype={kv_cache_dtype!r})"
        )


def check_block_size(block_size: int) -> None:
    if isinstance(block_size, bool) or block_size not in BLOCK_SIZES:
        raise ValueError(
            f"block_size {block_size!r} is not supported by the kernels (supported: "
            f"{', '.join(map(str, BLOCK_SIZES))})"
        )
