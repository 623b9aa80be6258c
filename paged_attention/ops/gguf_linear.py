"""The CPU op ``torch.ops.paged_attention.gguf_linear``: ``y = x @ W.T`` with ``W`` held as GGUF
blocks (``Q4_0``, ``Q4_1``, ``Q8_0``), computed the way llama.cpp computes it.

Each block of 32 inputs of each row of ``x`` is rounded to int8 with its own float32 scale
``dx = max|x| / 127`` (llama.cpp rounds its activations the same way, to its Q8_0/Q8_1
blocks), so each block's product is an integer dot product of the weight's quants with the
activations' (AVX512-VNNI's ``vpdpbusd``, or AVX2's ``vpmaddubsw``), scaled in float32. The
weights are exact; the activations' rounding costs at most ``dx / 2`` per input, so an output
is off by at most ``sum over blocks of (max|x| of the block / 254) * sum |w| of the block``
(plus float32's rounding): :func:`error_bound`.

The op reads the weights in its own layout, built once per weight by :func:`kernel_layout`
from the file's blocks (the C++ source, ``csrc/cpu/gguf_linear.cpp``, describes it): per
group of 16 output rows, each block's quants interleaved four inputs per row, and the rows'
scales as the file's float16 fields. Its variants: ``"vnni"`` (AVX-512 with VNNI),
``"avx2"`` (AVX2 with FMA and F16C), ``"reference"`` (a portable scalar loop of the same
arithmetic, slow) and ``"auto"``, which runs the first of :func:`usable_variants`.
"""

from __future__ import annotations

import importlib

import numpy as np
import torch

# Loading the library registers the op; by name, so that this low layer does not import the
# package root (which imports every layer).
importlib.import_module("paged_attention._C")

GROUP_ROWS = 16
"""Output rows per group of the op's layout: a weight's rows must be a multiple of it."""
BLOCK = 32
"""Inputs per GGUF block."""
VARIANTS = ("auto", "vnni", "avx2", "reference")


@torch.library.register_fake("paged_attention::gguf_linear")
def _gguf_linear_fake(x, qs, scales, format, variant="auto"):  # noqa: A002  (the op's name)
    return x.new_empty((x.shape[0], qs.shape[0] * GROUP_ROWS))


def usable_variants() -> list[str]:
    """The op's variants this CPU (and torch's chosen capability, which
    ``ATEN_CPU_CAPABILITY`` narrows) runs, best first: ``"auto"`` runs the first, and
    ``"reference"`` is always last."""
    return list(torch.ops.paged_attention._gguf_linear_usable_variants())


def gguf_linear(x, qs, scales, fmt: str, variant: str = "auto") -> torch.Tensor:
    """``x`` (rows, in features; float32 or bfloat16) times the weight in :func:`kernel_layout`'s
    ``qs`` and ``scales`` of format ``fmt``, transposed: (rows, out features) in ``x``'s dtype."""
    return torch.ops.paged_attention.gguf_linear(x, qs, scales, fmt, variant)


def kernel_layout(blocks: np.ndarray, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The op's ``(qs, scales)`` from a weight's GGUF ``blocks``, a uint8 array (rows, blocks,
    bytes per block) with rows a multiple of :data:`GROUP_ROWS`: ``qs`` uint8 (groups, blocks,
    256 or 512 for Q8_0), ``scales`` int16 (groups, blocks, 2, 16): the rows' ``d`` (the
    file's float16 bits), then a second field per row: ``m`` (Q4_1, float16 bits), ``d`` again
    (Q4_0, whose ``-8`` the kernel applies to the activations' side) or the block's quants
    summed (Q8_0, an integer), from which the kernel takes each block's offset term. Two bytes
    per row and block beside the quants, as in the file (four for Q8_0)."""
    rows, count, _ = blocks.shape
    if rows % GROUP_ROWS:
        raise ValueError(f"blocks: {rows} rows is not a multiple of {GROUP_ROWS}")
    groups = rows // GROUP_ROWS
    d = _halves(blocks, 0)
    if fmt == "Q8_0":
        q = np.ascontiguousarray(blocks[..., 2:]).view(np.int8)
        # byte 64 i + 4 r + t: input 4 i + t of row r
        qs = q.reshape(groups, GROUP_ROWS, count, 8, 4).transpose(0, 2, 3, 1, 4)
        second = q.astype(np.int16).sum(-1, dtype=np.int16).view(np.uint16)
    elif fmt in ("Q4_0", "Q4_1"):
        # byte j of a block holds input j (low nibble) and j + 16 (high): byte 64 i + 4 r + t
        # of the layout is byte 4 i + t of row r's block
        packed = blocks[..., 2 if fmt == "Q4_0" else 4 :]
        qs = packed.reshape(groups, GROUP_ROWS, count, 4, 4).transpose(0, 2, 3, 1, 4)
        second = d if fmt == "Q4_0" else _halves(blocks, 2)
    else:
        raise ValueError(f"fmt: expected Q4_0, Q4_1 or Q8_0, got {fmt!r}")
    qs = np.ascontiguousarray(qs).reshape(groups, count, -1).view(np.uint8)
    scales = np.stack([d, second]).reshape(2, groups, GROUP_ROWS, count)
    scales = np.ascontiguousarray(scales.transpose(1, 3, 0, 2)).view(np.int16)
    return torch.from_numpy(qs), torch.from_numpy(scales)


def error_bound(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The most the op's output can differ from ``x @ weight.T`` (``weight`` the de-quantized
    float weight): each input off by at most half its block's step ``max|x| / 127``, plus a
    float32 rounding margin."""
    x = x.double()
    weight = weight.double()
    steps = x.abs().reshape(*x.shape[:-1], -1, BLOCK).amax(-1) / 127
    per_input = (steps / 2).repeat_interleave(BLOCK, dim=-1)
    float32 = 2.0**-20 * (x.abs() @ weight.abs().T)
    return per_input @ weight.abs().T + float32 + 1e-6


def _halves(blocks: np.ndarray, offset: int) -> np.ndarray:
    """The bits of the float16 field at byte ``offset`` of each block, as uint16."""
    return np.ascontiguousarray(blocks[..., offset : offset + 2]).view(np.uint16)[..., 0]
