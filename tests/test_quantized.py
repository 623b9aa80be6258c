"""paged_attention.modeling.quantized and paged_attention.modeling.gguf_file: each quantized layer,
through each kernel, against the de-quantized weights (the gguf package's own dequantizer) times the
input, the shapes and formats refused, the kernel's choice, a model's projections replaced,
torch.compile, and a GGUF file's tensors read as the gguf package reads them."""

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from gguf import GGMLQuantizationType, quants  # noqa: E402

from paged_attention.modeling.gguf_file import GGUFFile  # noqa: E402
from paged_attention.modeling.quantized import (  # noqa: E402
    FORMATS,
    QuantizedLinear,
    quantize_model,
    selected_kernel,
)
from paged_attention.ops import gguf_linear  # noqa: E402

SHAPES = [(16, 32), (48, 96), (192, 576), (64, 1536)]
KERNELS = ["gguf", "int4pack"]


def blocks_of(weight: torch.Tensor, fmt: str) -> np.ndarray:
    return quants.quantize(weight.numpy(), GGMLQuantizationType[fmt])


def dequantized(blocks: np.ndarray, fmt: str) -> torch.Tensor:
    return torch.from_numpy(quants.dequantize(blocks, GGMLQuantizationType[fmt]).copy())


def random_weight(shape, seed=0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    # rows of different ranges and offsets, so Q4_1's minimum matters
    scale = torch.rand(shape[0], 1, generator=generator) * 0.2 + 0.01
    offset = torch.randn(shape[0], 1, generator=generator) * 0.05
    return torch.randn(shape, generator=generator) * scale + offset


def bf16_bound(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """What rounding the input, the scales and zeros and the output to bfloat16 can cost: a few
    units in bfloat16's last place of |x| @ |W|.T."""
    return 4 * 2.0**-8 * (x.abs().float() @ weight.abs().T) + 1e-6


def kernel_bound(kernel: str, x: torch.Tensor, weight: torch.Tensor, y: torch.Tensor):
    """int4pack: :func:`bf16_bound`; gguf: the op's bound for its int8 activations, plus the
    output's rounding to ``y``'s dtype."""
    if kernel == "int4pack":
        return bf16_bound(x, weight)
    rounding = 2.0**-8 * y.abs().float() if y.dtype == torch.bfloat16 else 0
    return gguf_linear.error_bound(x.float(), weight).float() + rounding


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layer_is_the_dequantized_weight_times_the_input(kernel, fmt, shape, dtype):
    weight = random_weight(shape)
    blocks = blocks_of(weight, fmt)
    reference = dequantized(blocks, fmt)
    layer = QuantizedLinear.from_blocks(blocks, fmt, shape, kernel=kernel)
    assert layer.kernel == kernel
    x = torch.randn(5, 3, shape[1], generator=torch.Generator().manual_seed(1)).to(dtype)
    y = layer(x)
    assert y.shape == (5, 3, shape[0]) and y.dtype == dtype
    expected = x.double() @ reference.double().T
    error = (y.double() - expected).abs()
    assert (error <= kernel_bound(kernel, x, reference, y)).all(), error.max()


@pytest.mark.parametrize("fmt", FORMATS)
def test_each_weight_is_the_formats_value_through_gguf(fmt):
    """One-hot float32 inputs round to int8 exactly (127 steps of 1/127), so they read the
    weights one column at a time: every weight equals the format's ``d * q + m`` (Q4_1),
    ``d * (q - 8)`` (Q4_0), ``d * q`` (Q8_0) up to float32's rounding (for Q8_0, that of
    cancelling the unsigned activations' offset, 128 d |sum q|: under 1e-6 at these scales);
    a wrong zero-point, nibble order or row order would be off by whole steps."""
    shape = (32, 64)
    blocks = blocks_of(random_weight(shape, seed=2), fmt)
    layer = QuantizedLinear.from_blocks(blocks, fmt, shape, kernel="gguf")
    columns = layer(torch.eye(shape[1])).T
    atol = 1e-6 if fmt == "Q8_0" else 1e-7
    torch.testing.assert_close(columns, dequantized(blocks, fmt), rtol=1e-6, atol=atol)


@pytest.mark.parametrize("fmt", FORMATS)
def test_each_weight_is_the_formats_value(fmt):
    """int4pack: with scales (and minimums) that bfloat16 holds exactly, one-hot inputs read
    the weights one column at a time: every weight equals the format's value up to the
    output's rounding to bfloat16; a wrong zero-point or nibble order would be off by whole
    steps."""
    shape = (32, 64)
    blocks = blocks_of(random_weight(shape, seed=2), fmt).copy()
    per_block = blocks.reshape(shape[0], -1, {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}[fmt])
    halves = 2 if fmt == "Q4_1" else 1
    for half in range(halves):  # round d (and m) to values bfloat16 holds
        field = per_block[..., 2 * half : 2 * half + 2].copy().view(np.float16)
        rounded = torch.from_numpy(field.astype(np.float32)).bfloat16().float().numpy()
        per_block[..., 2 * half : 2 * half + 2] = rounded.astype(np.float16).view(np.uint8)
    reference = dequantized(blocks, fmt)
    layer = QuantizedLinear.from_blocks(blocks, fmt, shape, kernel="int4pack")
    columns = layer(torch.eye(shape[1], dtype=torch.bfloat16)).float().T
    torch.testing.assert_close(columns, reference.bfloat16().float(), rtol=2**-8, atol=1e-7)


def test_bias_is_added():
    weight = random_weight((16, 32))
    bias = torch.randn(16)
    layer = QuantizedLinear.from_float(weight, "Q8_0", bias=bias)
    x = torch.randn(2, 32)
    reference = dequantized(blocks_of(weight, "Q8_0"), "Q8_0")
    torch.testing.assert_close(layer(x), x @ reference.T + bias, rtol=0.02, atol=0.02)


@pytest.mark.parametrize("kernel", KERNELS)
def test_from_float_is_the_gguf_quantizer(kernel):
    weight = random_weight((48, 64))
    for fmt in FORMATS:
        ours = QuantizedLinear.from_float(weight, fmt, kernel=kernel)
        theirs = QuantizedLinear.from_blocks(blocks_of(weight, fmt), fmt, (48, 64), kernel=kernel)
        buffers = dict(theirs.named_buffers())
        assert len(buffers) == 2
        for name, buffer in ours.named_buffers():
            assert torch.equal(buffer, buffers[name])


def test_kernel_is_chosen_by_argument_then_environment(monkeypatch):
    monkeypatch.delenv("PAGED_ATTENTION_QUANTIZED_KERNEL", raising=False)
    auto = "int4pack" if gguf_linear.usable_variants() == ["reference"] else "gguf"
    assert selected_kernel() == auto == selected_kernel("auto")
    monkeypatch.setenv("PAGED_ATTENTION_QUANTIZED_KERNEL", "int4pack")
    assert selected_kernel() == "int4pack" and selected_kernel("gguf") == "gguf"
    assert QuantizedLinear.from_float(random_weight((16, 32)), "Q4_1").kernel == "int4pack"
    monkeypatch.setenv("PAGED_ATTENTION_QUANTIZED_KERNEL", "fast")
    with pytest.raises(ValueError, match="PAGED_ATTENTION_QUANTIZED_KERNEL: expected one of"):
        selected_kernel()
    with pytest.raises(ValueError, match="kernel: expected one of auto, gguf, int4pack, got 'x'"):
        selected_kernel("x")


@pytest.mark.parametrize(
    ("fmt", "shape", "message"),
    [
        ("Q4_1", (20, 32), "proj: 20 output features is not a multiple of 16"),
        ("Q4_0", (16, 48), "proj: 48 input features is not a multiple of 32"),
        ("Q4_K", (16, 256), "proj: GGUF type Q4_K is not one the quantized layers read"),
        ("Q8_0", (16, 32, 1), "proj: expected a 2-d weight"),
    ],
)
def test_shapes_and_formats_it_cannot_take_are_refused(fmt, shape, message):
    with pytest.raises(ValueError, match=message):
        QuantizedLinear.from_blocks(np.zeros((16, 18), np.uint8), fmt, shape, name="proj")


def test_blocks_of_the_wrong_size_are_refused():
    blocks = blocks_of(random_weight((16, 64)), "Q4_1")
    with pytest.raises(ValueError, match=r"w: expected Q4_0 blocks as uint8 of shape \(16, 36\)"):
        QuantizedLinear.from_blocks(blocks, "Q4_0", (16, 64), name="w")
    with pytest.raises(ValueError, match="expected Q4_1 blocks as uint8"):
        QuantizedLinear.from_blocks(blocks.view(np.int8), "Q4_1", (16, 64), name="w")


def small_llama(tie_word_embeddings: bool = False):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=tie_word_embeddings,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


@pytest.mark.parametrize(("weights", "fmt"), [("q4", "Q4_1"), ("q8", "Q8_0")])
def test_quantize_model_replaces_every_projection(weights, fmt):
    model = small_llama()
    reference = small_llama()
    for module in reference.model.layers.modules():
        if isinstance(module, torch.nn.Linear):
            blocks = blocks_of(module.weight.detach(), fmt)
            module.weight.data = dequantized(blocks, fmt)
    assert quantize_model(model, weights) == {fmt: 14}
    projections = [m for m in model.model.layers.modules() if isinstance(m, QuantizedLinear)]
    assert len(projections) == 14 and not any(
        isinstance(m, torch.nn.Linear) for m in model.model.layers.modules()
    )
    ids = torch.randint(0, 96, (2, 7), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ours, theirs = model(ids).logits, reference(ids).logits
    torch.testing.assert_close(ours, theirs, rtol=0.02, atol=0.02)


def test_quantize_model_without_a_file_leaves_auto_alone_and_names_a_layer_it_cannot_take():
    model = small_llama()
    assert quantize_model(model, "auto") == {}
    model.model.layers[1].mlp.down_proj = torch.nn.Linear(120, 64, bias=False)
    with pytest.raises(ValueError, match="model.layers.1.mlp.down_proj: 120 input features"):
        quantize_model(model, "q4")
    with pytest.raises(ValueError, match="weights: expected auto, q4 or q8, got 'bf16'"):
        quantize_model(small_llama(), "bf16")


@pytest.mark.parametrize("kernel", KERNELS)
def test_compiles(kernel):
    layer = QuantizedLinear.from_float(random_weight((64, 96)), "Q4_1", kernel=kernel)
    x = torch.randn(4, 96)
    compiled = torch.compile(layer, fullgraph=True, dynamic=False)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), layer(x), rtol=1e-2, atol=1e-2)


def test_gguf_file_reads_tensors_as_the_gguf_package_does(tmp_path):
    path = tmp_path / "small.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_token_list(["a", "bb", "ccc"])  # a string array, skipped
    writer.add_array("test.numbers", [1, 2, 3])
    tensors = {"blk.0.attn_q.weight": ("Q4_1", (32, 64)), "blk.0.ffn_up.weight": ("Q8_0", (16, 96))}
    for name, (fmt, shape) in tensors.items():
        blocks = blocks_of(random_weight(shape), fmt)
        writer.add_tensor(name, blocks, raw_dtype=GGMLQuantizationType[fmt])
    writer.add_tensor("blk.0.attn_norm.weight", np.ones(64, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    ours = GGUFFile(path)
    assert ours.architecture == "llama"
    reader = gguf.GGUFReader(path)
    assert [t.name for t in reader.tensors] == list(ours.tensors)
    for tensor in reader.tensors:
        mine = ours.tensors[tensor.name]
        assert mine.type == tensor.tensor_type.name
        assert mine.shape == tuple(int(n) for n in tensor.shape)
        assert np.array_equal(
            mine.data.reshape(-1), np.asarray(tensor.data).view(np.uint8).reshape(-1)
        )


def test_gguf_file_refuses_what_is_not_one(tmp_path):
    path = tmp_path / "not.gguf"
    path.write_bytes(b"GGML" + bytes(40))
    with pytest.raises(ValueError, match="not a GGUF file"):
        GGUFFile(path)


@pytest.mark.parametrize("kernel", KERNELS)
def test_weight_is_the_dequantized_weight(kernel):
    weight = random_weight((32, 64))
    layer = QuantizedLinear.from_float(weight, "Q4_0", bias=torch.ones(32), kernel=kernel)
    reference = dequantized(blocks_of(weight, "Q4_0"), "Q4_0")
    assert layer.weight.shape == (32, 64) and layer.bias is not None
    torch.testing.assert_close(layer.weight.float(), reference, rtol=2**-7, atol=1e-3)
