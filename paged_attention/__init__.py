"""PagedAttention for PyTorch: a KV cache kept in fixed-size blocks addressed by block tables.

``import paged_attention`` registers the raw ops, ``torch.ops.paged_attention.*``
(:mod:`paged_attention.ops.bindings`); the names below are imported when first used (PEP 562),
so that importing the package does not import transformers or the engine. A command started
from the command line (``paged-attention serve|chat|demo``, ``python -m paged_attention ...``)
defers the ops too, so that torch is imported within the command, which stops cleanly on
Ctrl+C, and so that ``serve`` binds its address and answers 503 "loading" before it imports
torch (the ops are registered when the command imports the engine, a moment later).
"""

from __future__ import annotations

import importlib
import os
import signal
import sys


def _is_command_line() -> bool:
    """Whether this process is one of the command line's commands: ``python -m`` sets
    ``sys.argv[0]`` to ``"-m"`` while it imports the package, a console script to the
    script's path."""
    argv = sys.argv
    if len(argv) < 2 or argv[1] not in ("serve", "chat", "demo"):
        return False
    return argv[0] == "-m" or os.path.basename(argv[0]) == "paged-attention"


def end_on_ctrl_c_before_main(signum, frame) -> None:
    """SIGINT's handler from the package's import until the command line's main takes Ctrl+C
    over (:func:`paged_attention.cli.main.main`): the command's one line and exit status 130
    at once, as main gives. Python's KeyboardInterrupt there, outside main's handling, would
    end the process with a traceback from wherever it landed."""
    os.write(2, f"paged-attention {sys.argv[1]}: interrupted\n".encode())
    os._exit(130)


if not _is_command_line():
    importlib.import_module("paged_attention.ops.bindings")
elif signal.getsignal(signal.SIGINT) is signal.default_int_handler:
    signal.signal(signal.SIGINT, end_on_ctrl_c_before_main)

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
