"""Sibling quantized projections of a Llama layer run as one product: the attention's query, key
and value projections, and the MLP's gate and up projections.

Siblings multiply the same input, so one ``gguf_linear`` call over their weights laid one after
the other replaces two or three: the op rounds the input to int8 once, and each output row is
computed on its own from its own blocks, so the fused layer's outputs are bitwise those of the
separate layers (tests/test_fused_projections.py). A decode step of one sequence is a chain of
a few hundred small products, each paying for a call, a parallel region and the start of a read
from memory: SmolLM2 goes from 211 products per token to 121.

:func:`fuse_projections` applies to transformers' ``LlamaAttention`` and ``LlamaMLP`` exactly
(not subclasses, whose forward may differ) whose siblings are ``gguf``-kernel
:class:`~paged_attention.modeling.quantized.QuantizedLinear` layers of one format, all with a
bias or none; it leaves any other module as it is. The fused attention's forward is
transformers' ``LlamaAttention.forward`` with the three projections read from one product.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from paged_attention.modeling.quantized import QuantizedLinear


def fused_layer(layers: list[QuantizedLinear]) -> QuantizedLinear | None:
    """One layer computing ``layers`` (same input, ``gguf`` kernel, one format, a bias on all or
    none) side by side: their output features concatenated in order. None when they differ."""
    first = layers[0]
    same = all(
        isinstance(layer, QuantizedLinear)
        and layer.kernel == "gguf"
        and layer.format == first.format
        and layer.in_features == first.in_features
        and (layer.bias is None) == (first.bias is None)
        for layer in layers
    )
    if not same:
        return None
    tensors = {
        "qs": torch.cat([layer.qs for layer in layers]),
        "scales": torch.cat([layer.scales for layer in layers]),
    }
    bias = None if first.bias is None else torch.cat([layer.bias.data for layer in layers])
    out_features = sum(layer.out_features for layer in layers)
    return QuantizedLinear(tensors, first.in_features, out_features, first.format, "gguf", bias)


class FusedGatedMLP(nn.Module):
    """``LlamaMLP`` with its gate and up projections in one layer: ``down(act(gate) * up)``."""

    def __init__(self, gate_up_proj: QuantizedLinear, down_proj: nn.Module, act_fn) -> None:
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
