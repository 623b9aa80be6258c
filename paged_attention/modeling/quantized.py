"""Weight-only quantized linear layers for the CPU, read from GGUF's blocks as shipped.

A GGUF file stores a weight row by row in blocks of 32 weights. The formats read here:

* ``Q4_0``: a float16 scale ``d`` and 32 4-bit ``q`` in 0..15: ``w = d * (q - 8)``;
* ``Q4_1``: a float16 scale ``d``, a float16 minimum ``m`` and 32 4-bit ``q``: ``w = d * q + m``;
* ``Q8_0``: a float16 scale ``d`` and 32 int8 ``q``: ``w = d * q``.

(In a 4-bit block byte ``j`` holds weight ``j`` in its low nibble and weight ``j + 16`` in its
high nibble.)

Two kernels compute :class:`QuantizedLinear` (``PAGED_ATTENTION_QUANTIZED_KERNEL``, read when a
layer is built: ``auto``, the default, ``gguf`` or ``int4pack``):

* ``gguf``, where the CPU has AVX512-VNNI or AVX2 (``auto`` picks it there): the op of
  :mod:`paged_attention.ops.gguf_linear`, llama.cpp's arithmetic: the activations rounded to int8
  per block of 32, integer dot products with the blocks' quants, scaled in float32. On a CPU
  with neither it runs a portable scalar loop (correct, slow): ``auto`` does not pick it there.
* ``int4pack``: torch's CPU int4 kernel ``torch.ops.aten._weight_int4pack_mm_for_cpu``: 4-bit
  weights packed by ``_convert_weight_to_int4pack_for_cpu``, and per group of 32 weights of a
  row a scale and a zero, the kernel computing ``w = (q - 8) * scale + zero``. So ``Q4_0`` is
  ``scale = d, zero = 0``; ``Q4_1`` is ``scale = d, zero = m + 8 d``; ``Q8_0`` is two 4-bit
  planes of the same row, ``q = 16 h + l`` with ``h = q >> 4`` in -8..7 and ``l = q & 15`` in
  0..15: the high plane is ``q' = h + 8, scale = 16 d, zero = 0``, the low plane ``q' = l,
  scale = d, zero = 8 d``, laid side by side as one weight twice as wide that multiplies the
  input laid twice side by side (exact: every block keeps its own scale). The kernel computes
  in bfloat16 (its float32 path is about 20 times slower): the input and the scales and zeros
  are rounded to bfloat16 (a relative error of at most 2^-9), the products accumulate in
  float32.

Either way the 4-bit (or 8-bit) ``q`` are exact; the output returns in the input's dtype.

:func:`quantize_model` puts these layers in place of a Llama-family model's attention and MLP
projections (and of its LM head when the GGUF file quantizes it in one of these formats).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch
from torch import nn

from paged_attention.ops import gguf_linear

GROUP_SIZE = 32
"""Weights per GGUF block, and per scale and zero of the int4 kernel."""
FORMATS = ("Q4_0", "Q4_1", "Q8_0")
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}
ROWS_MULTIPLE = 16
"""The int4 packing takes a number of output rows that is a multiple of 16."""
FLOAT_TYPES = ("F32", "F16", "BF16")
KERNEL_DTYPE = torch.bfloat16
"""The int4pack kernel's dtype."""
KERNELS = ("auto", "gguf", "int4pack")
KERNEL_VARIABLE = "PAGED_ATTENTION_QUANTIZED_KERNEL"

LLAMA_PROJECTIONS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
"""GGUF's names of a Llama layer's projections, and transformers' names of the same modules."""
GGUF_ARCHITECTURES = ("llama",)
"""The GGUF architectures whose tensors :func:`quantize_model` maps onto transformers' modules."""


class QuantizedLinear(nn.Module):
    """``y = x @ W.T + bias`` with ``W`` held as GGUF blocks (``Q4_0``, ``Q4_1`` or ``Q8_0``),
    through one of the two kernels of the module docstring (``kernel``)."""

    def __init__(
        self,
        tensors: dict[str, torch.Tensor],
        in_features: int,
        out_features: int,
        fmt: str,
        kernel: str,
        bias: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.format = fmt
        self.kernel = kernel
        self.planes = 2 if fmt == "Q8_0" else 1
        for name, tensor in tensors.items():
            self.register_buffer(name, tensor)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    @classmethod
    def from_blocks(
        cls, blocks, fmt: str, shape: tuple[int, int], name: str = "weight", bias=None, kernel=None
    ) -> QuantizedLinear:
        """The layer of a weight of ``shape`` (out features, in features) given as GGUF's raw
        blocks of format ``fmt``: a uint8 array of one row of blocks per output feature.
        ``kernel``: one of :data:`KERNELS`, None for ``PAGED_ATTENTION_QUANTIZED_KERNEL``'s.
        Raises ValueError naming ``name`` for a format, a shape or blocks it cannot take."""
        rows, columns = _checked_shape(name, fmt, shape)
        kernel = selected_kernel(kernel)
        blocks = np.asarray(blocks)
        expected = (rows, columns // GROUP_SIZE * BLOCK_BYTES[fmt])
        if blocks.dtype != np.uint8 or tuple(blocks.shape) != expected:
            raise ValueError(
                f"{name}: expected {fmt} blocks as uint8 of shape {expected}, got "
                f"{blocks.dtype} of shape {tuple(blocks.shape)}"
            )
        blocks = blocks.reshape(rows, columns // GROUP_SIZE, BLOCK_BYTES[fmt])
        if kernel == "gguf":
            qs, scales = gguf_linear.kernel_layout(blocks, fmt)
            return cls({"qs": qs, "scales": scales}, columns, rows, fmt, kernel, bias)
        nibbles, scales, zeros = _int4_planes(blocks, fmt)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.from_numpy(nibbles), 1)
        scales_and_zeros = np.ascontiguousarray(np.stack([scales, zeros], -1).transpose(1, 0, 2))
        tensors = {
            "packed": packed,
            "scales_and_zeros": torch.from_numpy(scales_and_zeros).to(KERNEL_DTYPE),
        }
        return cls(tensors, columns, rows, fmt, kernel, bias)

    @classmethod
    def from_float(
        cls, weight: torch.Tensor, fmt: str, name: str = "weight", bias=None, kernel=None
    ) -> QuantizedLinear:
        """``weight`` (out features, in features) quantized to ``fmt`` by the ``gguf``
        package's quantizer (the same blocks llama.cpp's converter writes)."""
        _checked_shape(name, fmt, tuple(weight.shape))
        from gguf import GGMLQuantizationType, quants

        array = weight.detach().to("cpu", torch.float32).numpy()
        blocks = quants.quantize(array, GGMLQuantizationType[fmt])
        return cls.from_blocks(blocks, fmt, tuple(weight.shape), name, bias, kernel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if self.kernel == "gguf":
            if rows.dtype not in (torch.float32, torch.bfloat16):
                rows = rows.float()
            y = torch.ops.paged_attention.gguf_linear(rows, self.qs, self.scales, self.format)
        else:
            rows = rows.to(KERNEL_DTYPE)
            if self.planes == 2:
                rows = torch.cat([rows, rows], dim=-1)
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(
                rows, self.packed, GROUP_SIZE, self.scales_and_zeros
            )
        y = y.reshape(*x.shape[:-1], self.out_features).to(x.dtype)
        return y if self.bias is None else y + self.bias.to(x.dtype)

    @property
    def weight(self) -> torch.Tensor:
        """The de-quantized weight (out features, in features) in bfloat16, computed at each
        access (the layer itself never reads it): for code that inspects a linear layer's
        weight, such as its shape or device."""
        eye = torch.eye(self.in_features)
        bias, self.bias = self.bias, None
        try:
            return self.forward(eye).T.to(KERNEL_DTYPE).contiguous()
        finally:
            self.bias = bias

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"format={self.format}, kernel={self.kernel}, bias={self.bias is not None}"
        )


def selected_kernel(kernel: str | None = None) -> str:
    """``"gguf"`` or ``"int4pack"``: ``kernel`` (one of :data:`KERNELS`), or when None the
    environment's ``PAGED_ATTENTION_QUANTIZED_KERNEL`` (unset: ``auto``); ``auto`` is ``gguf``
    where the op has a vector variant here (AVX512-VNNI or AVX2), else ``int4pack``."""
    source = "kernel" if kernel is not None else KERNEL_VARIABLE
    name = kernel if kernel is not None else os.environ.get(KERNEL_VARIABLE) or "auto"
    if name not in KERNELS:
        raise ValueError(f"{source}: expected one of {', '.join(KERNELS)}, got {name!r}")
    if name == "auto":
        return "gguf" if gguf_linear.usable_variants()[0] != "reference" else "int4pack"
    return name


def _checked_shape(name: str, fmt: str, shape: tuple) -> tuple[int, int]:
    if fmt not in FORMATS:
        raise ValueError(
            f"{name}: GGUF type {fmt} is not one the quantized layers read ({', '.join(FORMATS)})"
        )
    if len(shape) != 2:
        raise ValueError(f"{name}: expected a 2-d weight (out, in), got shape {tuple(shape)}")
    rows, columns = (int(size) for size in shape)
    if columns <= 0 or columns % GROUP_SIZE:
        raise ValueError(
            f"{name}: {columns} input features is not a multiple of {GROUP_SIZE} (a GGUF block)"
        )
    if rows <= 0 or rows % ROWS_MULTIPLE:
        raise ValueError(
            f"{name}: {rows} output features is not a multiple of {ROWS_MULTIPLE} "
            "(torch's int4 packing)"
        )
    return rows, columns


def _int4_planes(blocks: np.ndarray, fmt: str):
    """``(q, scales, zeros)`` for the int4 kernel from ``blocks`` (rows, blocks, bytes): ``q``
    int32 (rows, columns) in 0..15, ``scales`` and ``zeros`` float32 (rows, groups), as numpy
    arrays: numpy's
    its strided byte operations are several times faster than torch's here."""
    rows = blocks.shape[0]
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if fmt == "Q8_0":
        q = blocks[..., 2:].copy().view(np.int8)
        high, low = (q >> 4) + 8, q & 15
        nibbles = np.concatenate([high.reshape(rows, -1), low.reshape(rows, -1)], axis=1)
        scales = np.concatenate([16 * d, d], axis=1)
        zeros = np.concatenate([np.zeros_like(d), 8 * d], axis=1)
    else:
        packed = blocks[..., 2 if fmt == "Q4_0" else 4 :]
        nibbles = np.concatenate([packed & 15, packed >> 4], axis=-1).reshape(rows, -1)
        scales = d
        if fmt == "Q4_0":
            zeros = np.zeros_like(d)
        else:
            zeros = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32) + 8 * d
    return nibbles.astype(np.int32), scales, zeros


def quantize_model(model: nn.Module, weights: str, gguf: Path | None = None) -> dict[str, int]:
    """Puts :class:`QuantizedLinear` layers in place of ``model``'s attention and MLP
    projections (every ``nn.Linear`` of its decoder layers) and returns how many of each
    format it put in.

    ``weights``: ``"auto"`` takes the projections ``gguf`` (the file ``model`` was loaded from,
    a Llama GGUF) ships as Q4_0, Q4_1 or Q8_0 as they are and leaves the others (float tensors,
    other quantized types) in ``model``'s floats; ``"q4"`` takes the Q4_0 and Q4_1 ones as they
    are and quantizes the others to Q4_1 from ``model``'s floats; ``"q8"`` likewise to Q8_0.
    The LM head becomes quantized when the file ships it (or the tied embedding) in one of
    those formats; the embedding itself stays in floats. Raises ValueError naming the layer
    that cannot be quantized."""
    if weights not in ("auto", "q4", "q8"):
        raise ValueError(f"weights: expected auto, q4 or q8, got {weights!r}")
    shipped = ShippedTensors.read(gguf, model) if gguf is not None else None
    if shipped is None and weights == "auto":
        return {}
    target = {"q4": ("Q4_1", ("Q4_0", "Q4_1")), "q8": ("Q8_0", ("Q8_0",))}.get(weights)
    counts: dict[str, int] = {}
    for index, layer in enumerate(model.model.layers):
        for path, module in list(layer.named_modules()):
            if not isinstance(module, nn.Linear):
                continue
            name = f"model.layers.{index}.{path}"
            blocks = shipped.blocks(index, path) if shipped is not None else None
            if blocks is not None and (target is None or blocks[1] in target[1]):
                layer_ = QuantizedLinear.from_blocks(*blocks, name=name, bias=module.bias)
            elif target is not None:
                layer_ = QuantizedLinear.from_float(module.weight, target[0], name, module.bias)
            else:
                continue
            layer.set_submodule(path, layer_)
            counts[layer_.format] = counts.get(layer_.format, 0) + 1
    head = shipped.head() if shipped is not None else None
    if head is not None:
        model.lm_head = QuantizedLinear.from_blocks(*head, name="lm_head")
        counts[head[1]] = counts.get(head[1], 0) + 1
    return counts


class ShippedTensors:
    """A Llama GGUF file's quantized tensors, by transformers' module names: the raw blocks of
    those in :data:`FORMATS`, with the query and key rows in transformers' order."""

    def __init__(self, file, heads: int, kv_heads: int, tied: bool) -> None:
        self._tensors = file.tensors
        self._heads = {"attn_q": heads, "attn_k": kv_heads}
        self._tied = tied
        self._gguf_names = {module: key for key, module in LLAMA_PROJECTIONS.items()}

    @classmethod
    def read(cls, gguf: Path, model: nn.Module) -> ShippedTensors | None:
        """The file's tensors, or None when its architecture is not one mapped here."""
        from paged_attention.modeling.gguf_file import GGUFFile

        file = GGUFFile(gguf)
        if file.architecture not in GGUF_ARCHITECTURES:
            return None
        config = model.config
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        return cls(file, heads, kv_heads, bool(getattr(config, "tie_word_embeddings", False)))

    def blocks(self, layer: int, path: str):
        """``(blocks, format, shape)`` of a decoder layer's projection at ``path`` (its
        module path within the layer) when the file ships it in a format of :data:`FORMATS`,
        else None."""
        key = self._gguf_names.get(path)
        tensor = self._tensors.get(f"blk.{layer}.{key}.weight") if key else None
        if tensor is None or tensor.type not in FORMATS:
            return None
        shape = (tensor.shape[1], tensor.shape[0])  # GGUF lists the inner size first
        data = tensor.data
        if key in self._heads:
            data = data[_unpermuted_rows(shape[0], self._heads[key])]
        return data, tensor.type, shape

    def head(self):
        """``(blocks, format, shape)`` of the LM head (``output.weight``, else the embedding
        it is tied to) when the file ships it in a format of :data:`FORMATS`, else None."""
        tensor = self._tensors.get("output.weight")
        if tensor is None and self._tied:
            tensor = self._tensors.get("token_embd.weight")
        if tensor is None or tensor.type not in FORMATS:
            return None
        return tensor.data, tensor.type, (tensor.shape[1], tensor.shape[0])


def _unpermuted_rows(rows: int, heads: int) -> np.ndarray:
    """The file's row of each of transformers' query (or key) rows: llama.cpp's converter
    interleaves each head's two rotary halves; transformers' GGUF loader undoes it the same
    way."""
    half = rows // heads // 2
    return np.arange(rows).reshape(heads, half, 2).swapaxes(1, 2).reshape(rows)
