"""paged_attention.modeling.fused_projections: a Llama model's sibling quantized projections fused
give bitwise the logits of the separate layers (eager, compiled and through the engine's paged
cache), and what cannot be fused is left as it is."""

import copy

import pytest
import torch

pytest.importorskip("gguf")

from transformers.models.llama.modeling_llama import LlamaMLP  # noqa: E402

from paged_attention.engine import Engine, SamplingParams  # noqa: E402
from paged_attention.modeling.fused_projections import (  # noqa: E402
    FusedGatedMLP,
    fuse_projections,
    fused_layer,
)
from paged_attention.modeling.quantized import KERNEL_VARIABLE, QuantizedLinear, quantize_model  # noqa: E402
from paged_attention.modeling.tiny import tiny_llama  # noqa: E402


@pytest.fixture
def quantized(monkeypatch):
    """A tiny Llama whose projections are gguf-kernel Q4_1 layers, and a copy of it fused."""
    monkeypatch.setenv(KERNEL_VARIABLE, "gguf")
    model = tiny_llama(intermediate_size=512)
    quantize_model(model, "q4")
    fused = copy.deepcopy(model)
    assert fuse_projections(fused) == 6  # per layer: q, k, v as one (2 fewer), gate and up (1)
    return model, fused


def ids():
    return torch.randint(0, 1000, (2, 9), generator=torch.Generator().manual_seed(1))


def test_fused_layers_replace_the_siblings(quantized):
    _, fused = quantized
    for layer in fused.model.layers:
        attention = layer.self_attn
        assert not hasattr(attention, "q_proj") and attention.qkv_proj.out_features == 256 + 2 * 64
        assert isinstance(layer.mlp, FusedGatedMLP) and layer.mlp.gate_up_proj.out_features == 1024
    assert fuse_projections(fused) == 0  # nothing left to fuse


def test_logits_are_bitwise_those_of_the_separate_layers(quantized):
    model, fused = quantized
    with torch.no_grad():
        assert torch.equal(fused(ids()).logits, model(ids()).logits)


def test_compiled_logits_are_the_eager_ones(quantized):
    _, fused = quantized
    compiled = torch.compile(fused, fullgraph=True, dynamic=False)
    with torch.no_grad():
        torch.testing.assert_close(compiled(ids()).logits, fused(ids()).logits)


def test_engine_tokens_are_those_of_the_separate_layers(quantized):
    """Through the engine's paged cache and attention (prefill, then decode steps)."""
    outputs = []
    for model in quantized:
        engine = Engine(model, num_blocks=32, block_size=16, eos_token_id=999)
        prompts = [[5, 6, 7, 8, 9], list(range(20, 53))]
        outputs.append(engine.generate(prompts, SamplingParams(max_new_tokens=12)))
    assert [o.outputs[0] for o in outputs[0]] == [o.outputs[0] for o in outputs[1]]


def test_what_cannot_be_fused_is_left_alone(monkeypatch):
    monkeypatch.setenv(KERNEL_VARIABLE, "gguf")
    model = tiny_llama(intermediate_size=512)
    quantize_model(model, "q4")
    layers = model.model.layers
    # another format for one sibling; float layers; a subclass of LlamaMLP
    layers[0].self_attn.v_proj = QuantizedLinear.from_float(
        layers[0].self_attn.v_proj.weight, "Q8_0", kernel="gguf"
    )
    layers[0].mlp.gate_proj = torch.nn.Linear(256, 512, bias=False)

    class OwnMLP(LlamaMLP):
        pass

    own = OwnMLP(model.config)
    own.load_state_dict(layers[1].mlp.state_dict(), strict=False)
    layers[1].mlp = own
    assert fuse_projections(model) == 2  # layer 1's attention only
    assert hasattr(layers[0].self_attn, "q_proj") and type(layers[0].mlp) is LlamaMLP
    assert type(layers[1].mlp) is OwnMLP and hasattr(layers[1].self_attn, "qkv_proj")


def test_fused_layer_refuses_siblings_that_differ(monkeypatch):
    weight = torch.randn(32, 64)
    gguf = QuantizedLinear.from_float(weight, "Q4_1", kernel="gguf")
    assert (
        fused_layer([gguf, QuantizedLinear.from_float(weight, "Q4_1", kernel="int4pack")]) is None
    )
    assert fused_layer([gguf, QuantizedLinear.from_float(weight, "Q4_0", kernel="gguf")]) is None
    with_bias = QuantizedLinear.from_float(weight, "Q4_1", bias=torch.ones(32), kernel="gguf")
    assert fused_layer([gguf, with_bias]) is None
    both = fused_layer([with_bias, with_bias])
    x = torch.randn(3, 64)
    torch.testing.assert_close(both(x), torch.cat([with_bias(x), with_bias(x)], -1), rtol=0, atol=0)
