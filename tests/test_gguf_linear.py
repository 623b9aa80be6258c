"""paged_attention.ops.gguf_linear: the op against the de-quantized weight times the input (float64)
over a grid of shapes and row counts, for each format and variant; exact where the activations
are already int8 steps; the variants against each other; bad arguments refused; opcheck."""

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from gguf import GGMLQuantizationType, quants  # noqa: E402

from paged_attention.ops.gguf_linear import (  # noqa: E402
    error_bound,
    gguf_linear,
    kernel_layout,
    usable_variants,
)

FORMATS = ("Q4_0", "Q4_1", "Q8_0")
BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}
VARIANTS = usable_variants()
SIMD_VARIANTS = [variant for variant in VARIANTS if variant != "reference"]


def weight_blocks(shape, fmt, seed=0):
    """(blocks as (rows, blocks, bytes), the de-quantized float64 weight)."""
    generator = torch.Generator().manual_seed(seed)
    scale = torch.rand(shape[0], 1, generator=generator) * 0.2 + 0.01
    offset = torch.randn(shape[0], 1, generator=generator) * 0.05
    weight = torch.randn(shape, generator=generator) * scale + offset
    blocks = quants.quantize(weight.numpy(), GGMLQuantizationType[fmt])
    exact = quants.dequantize(blocks, GGMLQuantizationType[fmt])
    return blocks.reshape(shape[0], -1, BYTES[fmt]), torch.from_numpy(exact).double()


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("shape", [(16, 32), (48, 96), (192, 576), (64, 1536)])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 33])
def test_op_is_the_weight_times_the_input_within_the_int8_bound(variant, fmt, shape, rows):
    blocks, weight = weight_blocks(shape, fmt)
    qs, scales = kernel_layout(blocks, fmt)
    x = torch.randn(rows, shape[1], generator=torch.Generator().manual_seed(rows)) * 2
    y = gguf_linear(x, qs, scales, fmt, variant)
    assert y.shape == (rows, shape[0]) and y.dtype == torch.float32
    error = (y.double() - x.double() @ weight.T).abs()
    assert (error <= error_bound(x, weight)).all(), error.max()


@pytest.mark.parametrize("fmt", FORMATS)
def test_inputs_on_int8_steps_are_exact(fmt):
    """Activations that are already int8 steps of their block's max / 127 round to themselves:
    the product is then the exact one up to float32's rounding."""
    blocks, weight = weight_blocks((32, 128), fmt, seed=3)
    qs, scales = kernel_layout(blocks, fmt)
    generator = torch.Generator().manual_seed(4)
    steps = torch.randint(-127, 128, (3, 128), generator=generator).double()
    steps[:, ::32] = 127  # every block's max is 127 steps
    x = (steps * 2.0**-6).float()
    expected = x.double() @ weight.T
    for variant in VARIANTS:
        y = gguf_linear(x, qs, scales, fmt, variant).double()
        margin = 2.0**-20 * (x.double().abs() @ weight.abs().T) * (130 if fmt == "Q8_0" else 9)
        assert ((y - expected).abs() <= margin + 1e-7).all(), variant


@pytest.mark.parametrize("variant", SIMD_VARIANTS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_a_simd_variant_is_the_reference(variant, fmt):
    blocks, _ = weight_blocks((64, 160), fmt, seed=5)
    qs, scales = kernel_layout(blocks, fmt)
    x = torch.randn(6, 160, generator=torch.Generator().manual_seed(6)).bfloat16()
    simd = gguf_linear(x, qs, scales, fmt, variant).float()
    reference = gguf_linear(x, qs, scales, fmt, "reference").float()
    torch.testing.assert_close(simd, reference, rtol=2**-7, atol=1e-3)  # bf16 outputs
    assert gguf_linear(x, qs, scales, fmt).dtype == torch.bfloat16


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_largest_quants_and_activations_do_not_saturate(fmt):
    """Every weight at its format's extreme quant and every activation at +-127 steps: the
    products the SIMD variants add in int16 pairs (AVX2's vpmaddubsw saturates) are at their
    largest, so a saturating sum shows as a wrong output."""
    rows, inputs = 16, 64
    blocks, _ = weight_blocks((rows, inputs), fmt, seed=7)
    quants_at = 4 if fmt == "Q4_1" else 2  # after d (and Q4_1's m)
    extreme = blocks.copy()
    extreme[..., :2] = np.array([1.0], np.float16).view(np.uint8)  # d = 1
    if fmt == "Q4_1":
        extreme[..., 2:4] = 0  # m = 0
    extreme[..., quants_at:] = 0xFF if fmt != "Q8_0" else 0x80  # q = 15 (Q4) or -128 (Q8_0)
    weight = torch.from_numpy(
        quants.dequantize(extreme.reshape(rows, -1), GGMLQuantizationType[fmt])
    ).double()
    qs, scales = kernel_layout(extreme, fmt)
    signs = torch.tensor([1.0, -1.0]).repeat(inputs // 2)
    for x in (torch.full((1, inputs), 127.0), torch.full((1, inputs), -127.0), 127 * signs[None]):
        expected = x.double() @ weight.T
        for variant in VARIANTS:
            y = gguf_linear(x, qs, scales, fmt, variant).double()
            torch.testing.assert_close(y, expected, rtol=2**-20, atol=0, msg=variant)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_a_nan_or_an_infinity_in_a_row_makes_that_rows_outputs_nan(variant, fmt):
    """As a float product's would be non-finite; the other rows are untouched."""
    blocks, weight = weight_blocks((32, 96), fmt, seed=8)
    qs, scales = kernel_layout(blocks, fmt)
    x = torch.randn(3, 96, generator=torch.Generator().manual_seed(9))
    x[0, 40] = float("nan")
    x[2, 5] = float("-inf")
    y = gguf_linear(x, qs, scales, fmt, variant)
    assert y[0].isnan().all() and y[2].isnan().all()
    error = (y[1].double() - x[1].double() @ weight.T).abs()
    assert (error <= error_bound(x[1:2], weight)[0]).all()


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_block_too_small_for_int8_steps_counts_as_zero(variant):
    """127 / 1e-38 overflows float32: such a block adds nothing, within the bound."""
    blocks, weight = weight_blocks((16, 64), "Q4_1", seed=10)
    qs, scales = kernel_layout(blocks, "Q4_1")
    x = torch.randn(1, 64, generator=torch.Generator().manual_seed(11))
    x[0, :32] = 1e-38
    y = gguf_linear(x, qs, scales, "Q4_1", variant)
    error = (y.double() - x.double() @ weight.T).abs()
    assert y.isfinite().all() and (error <= error_bound(x, weight)).all()


def test_zero_rows_and_zero_inputs():
    blocks, _ = weight_blocks((16, 64), "Q4_1")
    qs, scales = kernel_layout(blocks, "Q4_1")
    assert gguf_linear(torch.zeros(0, 64), qs, scales, "Q4_1").shape == (0, 16)
    assert torch.equal(gguf_linear(torch.zeros(2, 64), qs, scales, "Q4_1"), torch.zeros(2, 16))


def test_bad_arguments_are_refused():
    blocks, _ = weight_blocks((16, 64), "Q4_1")
    qs, scales = kernel_layout(blocks, "Q4_1")
    x = torch.randn(2, 64)
    with pytest.raises(ValueError, match="format must be Q4_0, Q4_1 or Q8_0, got Q4_K"):
        gguf_linear(x, qs, scales, "Q4_K")
    with pytest.raises(ValueError, match="qs must be a contiguous \\(groups, blocks, 512\\)"):
        gguf_linear(x, qs, scales, "Q8_0")
    with pytest.raises(TypeError, match="x must be float32 or bfloat16, got Half"):
        gguf_linear(x.half(), qs, scales, "Q4_1")
    with pytest.raises(TypeError, match="scales must be int16, got Float"):
        gguf_linear(x, qs, scales.float(), "Q4_1")
    with pytest.raises(TypeError, match="qs must be uint8"):
        gguf_linear(x, qs.to(torch.int8), scales, "Q4_1")
    with pytest.raises(ValueError, match="x has 96 input features, the weight 64"):
        gguf_linear(torch.randn(2, 96), qs, scales, "Q4_1")
    with pytest.raises(ValueError, match="x must be 2-d"):
        gguf_linear(torch.randn(64), qs, scales, "Q4_1")
    with pytest.raises(ValueError, match="variant must be auto, vnni, avx2 or reference, got fast"):
        gguf_linear(x, qs, scales, "Q4_1", "fast")
    with pytest.raises(ValueError, match="scales must be a contiguous"):
        gguf_linear(x, qs, scales[:, :1].contiguous(), "Q4_1")


def test_layout_refuses_what_it_cannot_lay_out():
    blocks, _ = weight_blocks((16, 64), "Q4_1")
    with pytest.raises(ValueError, match="blocks: 8 rows is not a multiple of 16"):
        kernel_layout(blocks[:8], "Q4_1")
    with pytest.raises(ValueError, match="fmt: expected Q4_0, Q4_1 or Q8_0, got 'Q5_0'"):
        kernel_layout(blocks, "Q5_0")


@pytest.mark.parametrize("fmt", FORMATS)
def test_opcheck(fmt):
    blocks, _ = weight_blocks((32, 64), fmt)
    qs, scales = kernel_layout(blocks, fmt)
    for x in (torch.randn(3, 64), torch.randn(1, 64).bfloat16()):
        torch.library.opcheck(torch.ops.paged_attention.gguf_linear, (x, qs, scales, fmt, "auto"))


def test_layout_matches_the_op_documented_bytes():
    """Byte 64 i + 4 r + t of a Q4 block's layout holds input 4 i + t of row r (low nibble)
    and input 16 + 4 i + t (high nibble)."""
    blocks, _ = weight_blocks((16, 32), "Q4_1", seed=7)
    qs, _ = kernel_layout(blocks, "Q4_1")
    nibbles = blocks[..., 4:]
    q = np.concatenate([nibbles & 15, nibbles >> 4], axis=-1)[:, 0]  # (rows, 32)
    laid = qs.numpy()[0, 0]
    for i in range(4):
        for r in range(16):
            for t in range(4):
                assert laid[64 * i + 4 * r + t] & 15 == q[r, 4 * i + t]
                assert laid[64 * i + 4 * r + t] >> 4 == q[r, 16 + 4 * i + t]


@pytest.mark.parametrize("fmt", FORMATS)
def test_scales_are_the_file_fields(fmt):
    """Per block and row the layout keeps the file's float16 d (bits unchanged), then m (Q4_1),
    d again (Q4_0) or the row's quants summed (Q8_0): 2 bytes per row and block beside the
    quants for the 4-bit formats, as the file has, 4 for Q8_0."""
    blocks, _ = weight_blocks((32, 96), fmt, seed=8)
    _, scales = kernel_layout(blocks, fmt)
    assert scales.dtype == torch.int16 and scales.shape == (2, 3, 2, 16)
    fields = scales.numpy().view(np.uint16)  # (groups, blocks, field, row in group)
    halves = blocks.view(np.uint16)  # (rows, blocks, bytes / 2)
    for g in range(2):
        for b in range(3):
            rows = slice(16 * g, 16 * g + 16)
            assert (fields[g, b, 0] == halves[rows, b, 0]).all()
            if fmt == "Q4_1":
                second = halves[rows, b, 1]
            elif fmt == "Q4_0":
                second = halves[rows, b, 0]
            else:
                quants = blocks[rows, b, 2:].view(np.int8)
                second = quants.sum(-1, dtype=np.int16).view(np.uint16)
            assert (fields[g, b, 1] == second).all()
