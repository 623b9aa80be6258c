"""paged_attention.modeling.fused_projections: a Llama model's sibling quantized projections fused
give bitwise the logits of the separate layers (eager, compiled and through the engine's paged
cache), sibling float projections fused (and packed) give them within the dtype's rounding and
the same greedy tokens, load_model fuses what it loads with weights given, and what cannot be
fused is left as it is."""

import copy

import pytest
import torch

pytest.importorskip("gguf")

from transformers.models.llama.modeling_llama import LlamaMLP  # noqa: E402

from paged_attention.engine import Engine, SamplingParams  # noqa: E402
from paged_attention.modeling.fused_projections import (  # noqa: E402
    FUSE_ENV,
    FusedGatedMLP,
    fuse_projections,
    fused_layer,
    fusing_enabled,
)
from paged_attention.modeling.models import load_model  # noqa: E402
from paged_attention.modeling.packed_linear import PackedLinear, pack_model  # noqa: E402
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


FLOAT_DTYPES = [torch.float32]
if torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported():
    FLOAT_DTYPES.append(torch.bfloat16)
# The matrix library may sum a wider matrix's dot products in another order: float32 within
# its rounding, bfloat16 within one bfloat16 ulp of the logits' size.
FLOAT_TOLERANCE = {
    torch.float32: dict(rtol=1e-5, atol=1e-5),
    torch.bfloat16: dict(rtol=1.6e-2, atol=1.6e-2),
}


@pytest.fixture(params=FLOAT_DTYPES, ids=str)
def floats(request):
    """A tiny Llama in a float dtype, and a copy of it fused."""
    model = tiny_llama(intermediate_size=512).to(request.param).eval()
    fused = copy.deepcopy(model)
    assert fuse_projections(fused) == 6
    return model, fused


@pytest.mark.parametrize("packed", [False, True], ids=["linear", "packed"])
def test_float_siblings_fused_give_the_separate_layers_logits(floats, packed):
    model, fused = floats
    attention, mlp = fused.model.layers[0].self_attn, fused.model.layers[0].mlp
    assert type(attention.qkv_proj) is torch.nn.Linear and attention.qkv_sizes == [256, 64, 64]
    assert isinstance(mlp, FusedGatedMLP) and mlp.gate_up_proj.out_features == 1024
    if packed:
        for each in (model, fused):
            pack_model(each)
        assert isinstance(fused.model.layers[1].self_attn.qkv_proj, PackedLinear)
    dtype = next(model.parameters()).dtype
    with torch.no_grad():
        for rows in (ids(), torch.randint(0, 1000, (32, 1))):  # a prefill, a 32-row decode
            torch.testing.assert_close(
                fused(rows).logits, model(rows).logits, **FLOAT_TOLERANCE[dtype]
            )


def test_float_siblings_fused_give_the_engines_greedy_tokens():
    model = tiny_llama(intermediate_size=512).eval()
    fused = copy.deepcopy(model)
    fuse_projections(fused)
    outputs = []
    for each in (model, fused):
        engine = Engine(each, num_blocks=32, block_size=16, eos_token_id=999)
        prompts = [[5, 6, 7, 8, 9], list(range(20, 53))]
        outputs.append(engine.generate(prompts, SamplingParams(max_new_tokens=12)))
    assert [o.outputs[0] for o in outputs[0]] == [o.outputs[0] for o in outputs[1]]


def test_fused_float_layer_with_bias_is_the_concatenation():
    layers = [torch.nn.Linear(64, n) for n in (32, 16, 16)]
    fused = fused_layer(layers)
    assert type(fused) is torch.nn.Linear and fused.out_features == 64
    x = torch.randn(3, 64)
    with torch.no_grad():
        torch.testing.assert_close(fused(x), torch.cat([layer(x) for layer in layers], -1))


def test_fused_layer_refuses_float_siblings_that_differ():
    plain = torch.nn.Linear(64, 32, bias=False)
    assert fused_layer([plain, torch.nn.Linear(64, 32, bias=False).to(torch.float64)]) is None
    assert fused_layer([plain, torch.nn.Linear(64, 32, bias=True)]) is None
    assert fused_layer([plain, torch.nn.Linear(48, 32, bias=False)]) is None
    gguf = QuantizedLinear.from_float(plain.weight.detach(), "Q4_1", kernel="gguf")
    assert fused_layer([plain, gguf]) is None and fused_layer([gguf, plain]) is None
    assert fused_layer([plain, torch.nn.Linear(64, 32, bias=False, device="meta")]) is None


@pytest.mark.parametrize(("weights", "fused"), [("fp32", True), ("bf16", True), (None, False)])
def test_load_model_fuses_the_siblings_given_weights(weights, fused):
    """With ``weights`` given the model is the engine's (fused, then packed); without, it stays
    transformers' own model."""
    dtype = "bfloat16" if weights == "bf16" else "float32"
    model, _ = load_model("tiny", dtype=dtype, weights=weights)
    for layer in model.model.layers:
        assert hasattr(layer.self_attn, "qkv_proj") is fused
        assert hasattr(layer.self_attn, "q_proj") is not fused
        assert isinstance(layer.mlp, FusedGatedMLP) is fused


@pytest.mark.parametrize(
    ("value", "fused"), [(None, True), ("1", True), ("0", False), ("off", False)]
)
def test_the_switch(monkeypatch, value, fused):
    if value is None:
        monkeypatch.delenv(FUSE_ENV, raising=False)
    else:
        monkeypatch.setenv(FUSE_ENV, value)
    assert fusing_enabled() is fused
    model, _ = load_model("tiny", dtype="float32", weights="fp32")
    assert hasattr(model.model.layers[0].self_attn, "qkv_proj") is fused
