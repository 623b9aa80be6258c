"""The CPU kernels' bf16 matrix products (csrc/cpu/bf16_dot.h, amx.h) and the run-time choice of
kernel variants (csrc/cpu/variants.h), through the private ops that expose them.

Every product variant is checked on any machine that runs its instructions; a variant this CPU
lacks is skipped with the reason (the portable "reference" runs everywhere).
"""

from __future__ import annotations

import pytest
import torch

import paged_attention.ops.bindings  # noqa: F401  (registers torch.ops.paged_attention)

ops = torch.ops.paged_attention
VARIANTS = ("amx", "avx512bf16", "reference")
VARIABLE = "PAGED_ATTENTION_CPU_BF16_MATMUL"
MISSING = {
    "amx": "this CPU or OS does not run AMX (amx_tile, amx_bf16)",
    "avx512bf16": "this CPU does not run AVX512-BF16",
}


def require(variant: str) -> None:
    if variant not in ops._cpu_bf16_matmuls():
        pytest.skip(MISSING[variant])


def expected_product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """float64 sums of the bf16 operands' products (b rounded to bf16 as the packing does)."""
    return a.double() @ b.to(torch.bfloat16).double()


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize(
    "m, k, n",
    [(1, 1, 1), (16, 32, 16), (17, 33, 45), (64, 128, 256), (48, 80, 32), (5, 300, 7)],
)
def test_products_match_float64(variant, m, k, n):
    """Shapes that need every padding and every register/tile block shape of the kernels."""
    require(variant)
    generator = torch.Generator().manual_seed(m * 1000 + k * 10 + n)
    a = torch.randn(m, k, generator=generator).to(torch.bfloat16)
    b = torch.randn(k, n, generator=generator).to(torch.bfloat16)
    got = ops._cpu_bf16_matmul(a, b, variant)
    assert got.dtype == torch.float32 and got.shape == (m, n)
    expected = expected_product(a, b)
    # float32 sums of exact products: the error is rounding of partial sums only
    bound = 2**-22 * k * (a.double().abs() @ b.double().abs())
    assert ((got.double() - expected).abs() <= bound + 1e-30).all()


@pytest.mark.parametrize("variant", VARIANTS)
def test_float32_operand_is_rounded_to_nearest_even(variant):
    """The packing of float32 rows (the probabilities) rounds as torch's bf16 conversion does,
    ties to even, and keeps NaN and infinities."""
    require(variant)
    # 1 + 2^-8 is a tie between two bf16 values: it rounds to 1 (even); 1 + 3 * 2^-8 rounds up
    b = torch.tensor(
        [[1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 3.0e38, 1e-40, 0.0, float("inf"), 2.0]]
        + [[0.0] * 8]
    )
    a = torch.zeros(3, 2, dtype=torch.bfloat16)
    a[0, 0] = 1.0
    a[1, 0] = 1.0
    a[2, 1] = 1.0
    got = ops._cpu_bf16_matmul(a, b, variant)
    expected = b[0].to(torch.bfloat16).float()
    if variant != "reference" and got[0, 4] == 0:
        expected[4] = 0.0  # the bf16 instructions may read and write subnormals as zero
    assert torch.equal(got[0], expected)
    assert torch.equal(got[2, :6], torch.zeros(6))  # 0 x inf in column 6 is NaN
    b[0, 0] = float("nan")
    got = ops._cpu_bf16_matmul(a, b, variant)
    assert got[0, 0].isnan() and got[1, 0].isnan() and not got[2, 1:6].isnan().any()


@pytest.mark.parametrize("variant", VARIANTS)
def test_operands_with_strides(variant):
    require(variant)
    generator = torch.Generator().manual_seed(3)
    a = torch.randn(40, 70, generator=generator).to(torch.bfloat16)[::2, 3:67]  # [20, 64]
    b = torch.randn(50, 64, generator=generator).to(torch.bfloat16).t()[:, ::3]  # [64, 17]
    got = ops._cpu_bf16_matmul(a, b, variant)
    torch.testing.assert_close(got.double(), expected_product(a, b), rtol=1e-5, atol=1e-5)


def test_usable_variants_are_listed_best_first():
    usable = ops._cpu_bf16_matmuls()
    assert usable[-1] == "reference"
    assert [v for v in VARIANTS if v in usable] == list(usable)


def test_bad_product_arguments_raise():
    a = torch.zeros(4, 8, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="a must be \\[M, K\\] and b \\[K, N\\]"):
        ops._cpu_bf16_matmul(a, torch.zeros(9, 4, dtype=torch.bfloat16), "reference")
    with pytest.raises(RuntimeError, match="a must be bfloat16"):
        ops._cpu_bf16_matmul(a.float(), torch.zeros(8, 4), "reference")
    with pytest.raises(RuntimeError, match="not a bf16 product variant"):
        ops._cpu_bf16_matmul(a, torch.zeros(8, 4), "avx9000")
    with pytest.raises(RuntimeError, match="'none' has no bf16 product"):
        ops._cpu_bf16_matmul(a, torch.zeros(8, 4), "none")


def test_the_switch_picks_the_product(monkeypatch):
    vector = torch.backends.cpu.get_cpu_capability()
    usable = ops._cpu_bf16_matmuls()
    monkeypatch.delenv(VARIABLE, raising=False)
    isa, auto = ops._cpu_kernel_variants()
    assert isa == {"AVX512": "avx512", "AVX2": "avx2"}.get(vector, "baseline")
    # auto: the best hardware product, with the AVX-512 kernels only
    hardware = [v for v in usable if v != "reference"]
    assert auto == (hardware[0] if hardware and isa == "avx512" else "none")
    for name in ("none", *usable):
        monkeypatch.setenv(VARIABLE, name)
        assert ops._cpu_kernel_variants() == [isa, name]
    monkeypatch.setenv(VARIABLE, "auto")
    assert ops._cpu_kernel_variants() == [isa, auto]
    monkeypatch.setenv(VARIABLE, "fast")
    with pytest.raises(RuntimeError, match=f"{VARIABLE}=fast is not a bf16 product variant"):
        ops._cpu_kernel_variants()
    for missing in set(VARIANTS) - set(usable):
        monkeypatch.setenv(VARIABLE, missing)
        with pytest.raises(RuntimeError, match=f"{VARIABLE}={missing}: this CPU does not run"):
            ops._cpu_kernel_variants()
