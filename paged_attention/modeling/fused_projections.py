"""Sibling projections of a Llama layer run as one product: the attention's query, key and value
projections, and the MLP's gate and up projections.

Siblings multiply the same input, so one product over their weights laid one after the other
replaces two or three. A decode step is a chain of a few hundred small products, each paying for
a call, a parallel region and the start of a read from memory: SmolLM2 goes from 211 products
per token to 121. Fusing the float layers, measured on the offline workload on a 2-vCPU AMD
EPYC (``benchmarks/bench_offline.py``'s ``ours-unfused``, docs/results/bench_offline_fusion.json):
272.0 and 274.8 tok/s fused against 255.7 and 221.1 in float32; in bfloat16 within the rounds'
spread (461.5 and 463.8 against 475.3 and 428.8).

* Quantized siblings (``gguf``-kernel :class:`~paged_attention.modeling.quantized.QuantizedLinear`
  layers of one format): one ``gguf_linear`` call rounds the input to int8 once and computes
  each output row from its own blocks, so the fused layer's outputs are bitwise those of the
  separate layers.
* Float siblings (plain ``torch.nn.Linear`` layers of one dtype on the CPU, whose weights are
  plain tensors): one ``nn.Linear`` over the concatenated weights, packed afterwards like any
  other (:mod:`paged_attention.modeling.packed_linear`). Each output is the same dot product,
  but the matrix library may split the sum over the input features differently for a wider
  matrix, so the outputs equal the separate layers' within the dtype's rounding
  (tests/test_fused_projections.py), as inductor's ``enable_concat_linear`` does when it
  freezes a model.

:func:`fuse_projections` applies to transformers' ``LlamaAttention`` and ``LlamaMLP`` exactly
(not subclasses, whose forward may differ) whose siblings are of one of those kinds, all with a
bias or none; it leaves any other module as it is. The fused attention's forward is
transformers' ``LlamaAttention.forward`` with the three projections read from one product.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from paged_attention.modeling.packed_linear import switched_on
from paged_attention.modeling.quantized import QuantizedLinear

FUSE_ENV = "PAGED_ATTENTION_FUSE_PROJECTIONS"
"""``0`` (or ``false``, ``no``, ``off``) leaves ``load_model``'s siblings separate: the A/B of
fusing (``benchmarks/bench_offline.py``'s ``ours-unfused``)."""


def fusing_enabled() -> bool:
    """Whether :data:`FUSE_ENV` leaves fusing at load on (the default)."""
    return switched_on(FUSE_ENV)


def fused_layer(layers: list[nn.Module]) -> nn.Module | None:
    """One layer computing ``layers`` (same input, of one kind: ``gguf``-kernel quantized layers
    of one format, or plain float ``nn.Linear`` layers of one dtype on the CPU; a bias on all
    or none) side by side: their output features concatenated in order. None when they
    differ."""
    first = layers[0]
    same = all(
        type(layer) is type(first)
        and layer.in_features == first.in_features
        and (layer.bias is None) == (first.bias is None)
        for layer in layers
    )
    if not same:
        return None
    if isinstance(first, QuantizedLinear):
        return _fused_quantized(layers)
    if type(first) is nn.Linear:
        return _fused_float(layers)
    return None


def _fused_quantized(layers: list[QuantizedLinear]) -> QuantizedLinear | None:
    first = layers[0]
    if any(layer.kernel != "gguf" or layer.format != first.format for layer in layers):
        return None
    tensors = {
        "qs": torch.cat([layer.qs for layer in layers]),
        "scales": torch.cat([layer.scales for layer in layers]),
    }
    bias = None if first.bias is None else torch.cat([layer.bias.data for layer in layers])
    out_features = sum(layer.out_features for layer in layers)
    return QuantizedLinear(tensors, first.in_features, out_features, first.format, "gguf", bias)


def _fused_float(layers: list[nn.Linear]) -> nn.Linear | None:
    weights = [layer.weight for layer in layers]
    first = weights[0]
    plain = all(
        type(weight.data) is torch.Tensor
        and weight.layout == torch.strided
        and weight.device.type == "cpu"
        and weight.dtype == first.dtype
        and weight.dtype.is_floating_point
        for weight in weights
    )
    if not plain:
        return None
    out_features = sum(layer.out_features for layer in layers)
    has_bias = layers[0].bias is not None
    fused = nn.Linear(
        layers[0].in_features, out_features, bias=has_bias, device="meta", dtype=first.dtype
    )
    fused.weight = nn.Parameter(torch.cat([w.detach() for w in weights]), requires_grad=False)
    if has_bias:
        bias = torch.cat([layer.bias.detach() for layer in layers])
        fused.bias = nn.Parameter(bias, requires_grad=False)
    return fused


class FusedGatedMLP(nn.Module):
    """``LlamaMLP`` with its gate and up projections in one layer: ``down(act(gate) * up)``."""

    def __init__(self, gate_up_proj: nn.Module, down_proj: nn.Module, act_fn) -> None:
        super().__init__()
        self.gate_up_proj = gate_up_proj
        self.down_proj = down_proj
        self.act_fn = act_fn
        self.intermediate_size = gate_up_proj.out_features // 2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(self.act_fn(gate) * up)


@functools.cache
def _fused_attention_class():
    from transformers.models.llama.modeling_llama import (
        ALL_ATTENTION_FUNCTIONS,
        LlamaAttention,
        apply_rotary_pos_emb,
        eager_attention_forward,
    )

    class FusedQKVLlamaAttention(LlamaAttention):
        """``LlamaAttention`` whose query, key and value projections are one layer,
        ``qkv_proj`` (set by :func:`fuse_projections`, which also sets ``qkv_sizes``)."""

        def forward(
            self, hidden_states, position_embeddings=None, attention_mask=None, cache=None, **kwargs
        ):
            input_shape = hidden_states.shape[:-1]
            hidden_shape = (*input_shape, -1, self.head_dim)
            query, key, value = self.qkv_proj(hidden_states).split(self.qkv_sizes, dim=-1)
            query_states = query.view(hidden_shape).transpose(1, 2)
            key_states = key.view(hidden_shape).transpose(1, 2)
            value_states = value.view(hidden_shape).transpose(1, 2)
            cos, sin = position_embeddings
            query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)
            if cache is not None:
                key_states, value_states = cache.update(
                    key_states, value_states, self.layer_idx, kwargs=kwargs
                )
            attention_interface = ALL_ATTENTION_FUNCTIONS.get_interface(
                self.config._attn_implementation, eager_attention_forward
            )
            attn_output, attn_weights = attention_interface(
                self,
                query_states,
                key_states,
                value_states,
                attention_mask,
                dropout=0.0 if not self.training else self.attention_dropout,
                scaling=self.scaling,
                **kwargs,
            )
            attn_output = attn_output.reshape(*input_shape, -1).contiguous()
            return self.o_proj(attn_output), attn_weights

    return LlamaAttention, FusedQKVLlamaAttention


def fuse_projections(model: nn.Module) -> int:
    """Fuses the sibling projections of ``model``'s Llama attention and MLP modules (see the
    module docstring); returns how many products per token it removed."""
    from transformers.models.llama.modeling_llama import LlamaMLP

    attention_class, fused_class = _fused_attention_class()
    removed = 0
    for parent in list(model.modules()):
        for name, module in list(parent.named_children()):
            if type(module) is LlamaMLP:
                fused = fused_layer([module.gate_proj, module.up_proj])
                if fused is not None:
                    setattr(parent, name, FusedGatedMLP(fused, module.down_proj, module.act_fn))
                    removed += 1
            elif type(module) is attention_class:
                siblings = [module.q_proj, module.k_proj, module.v_proj]
                fused = fused_layer(siblings)
                if fused is not None:
                    module.qkv_sizes = [layer.out_features for layer in siblings]
                    del module.q_proj, module.k_proj, module.v_proj
                    module.qkv_proj = fused
                    module.__class__ = fused_class
                    removed += 2
    return removed
