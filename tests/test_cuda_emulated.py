"""The CUDA attention kernels as the decode ops run them, on the CPU under the host emulation of
their primitives (tests/test_cuda_emulated_varlen.py: as the varlen op runs them).

The kernel bodies in csrc/cuda/attention/ are compiled by the host C++ compiler against
csrc/cuda/primitives/emulated.h (tests/cuda_emulator.py builds the library): every thread of a
CTA runs the body, mma.sync/ldmatrix move elements as the PTX ISA's fragment layouts say, and
cp.async lands only at its wait (NaN before). These tests need no GPU: they check the
primitives against the PTX ISA's tables (restated here independently of the C++), then the
kernels against reference.py over head sizes (values of their own head size included), block
sizes, dtypes, GQA groups, fp8, ALiBi, sliding windows, attention chunks, soft-cap, NaN-filled
caches, v1 (with and without splits) and v2.
"""

from __future__ import annotations

import ctypes
import math

import cuda_emulator as emu
import pytest
import torch
from conftest import make_paged_kv, make_paged_kv_of_value_size

from paged_attention.ops import reference
from paged_attention.ops.supported import PARTITION_SIZE

HEAD_SIZES = [32, 64, 80, 96, 112, 120, 128, 192, 256]
BLOCK_SIZES = [8, 16, 32]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TOLERANCES = {
    torch.float32: dict(atol=5e-5, rtol=1e-4),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2),
}


@pytest.fixture(scope="module")
def lib():
    return emu.library()


def error_text(buffer) -> str:
    return buffer.value.decode()


# --------------------------------------------------------------------------------------------
# The primitives against the PTX ISA


def test_ldmatrix_x4_hands_out_rows_as_the_ptx_isa_says(lib):
    # ldmatrix.m8n8.x4.b16: lane l gives the address of row l % 8 of matrix l // 8; every lane
    # receives, in register j, the 32-bit word at column pair l % 4 of row l // 4 of matrix j.
    gen = torch.Generator().manual_seed(1)
    smem = torch.randint(0, 256, (64 * 16,), dtype=torch.uint8, generator=gen)
    rows = (torch.randperm(64, generator=gen)[:32] * 16).to(torch.int32)
    out = torch.zeros(32, 4, dtype=torch.int32)
    error = ctypes.create_string_buffer(512)
    status = lib.pa_selftest_ldmatrix(
        ctypes.c_void_p(smem.data_ptr()),
        ctypes.c_int64(smem.numel()),
        ctypes.c_void_p(rows.data_ptr()),
        ctypes.c_void_p(out.data_ptr()),
        error,
        ctypes.c_int64(len(error)),
    )
    assert status == 0, error_text(error)
    words = smem.view(torch.int32)
    for lane in range(32):
        for j in range(4):
            row = int(rows[8 * j + lane // 4])
            assert int(out[lane, j]) == int(words[row // 4 + lane % 4]), (lane, j)


def _bits(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return values.to(dtype).view(torch.int16).to(torch.int32) & 0xFFFF


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_mma_m16n8k16_uses_the_ptx_isa_fragment_layouts(lib, dtype):
    gen = torch.Generator().manual_seed(2)
    a = torch.randn(16, 16, generator=gen).to(dtype)
    b = torch.randn(16, 8, generator=gen).to(dtype)
    c = torch.randn(16, 8, generator=gen)
    regs_a = torch.zeros(32, 4, dtype=torch.int32)
    regs_b = torch.zeros(32, 2, dtype=torch.int32)
    regs_c = torch.zeros(32, 4)
    # PTX ISA, "Matrix Fragments for mma.m16n8k16 with floating point type": groupID = lane / 4,
    # threadID_in_group = lane % 4; a_i: row groupID (+8 for i in 2,3,6,7), column
    # 2 threadID_in_group + i % 2 (+8 for i >= 4); b_i: row 2 threadID_in_group + i % 2 (+8 for
    # i >= 2), column groupID; c_i: row groupID (+8 for i >= 2), column 2 threadID + i % 2.
    # Element 2k of a register is its low half.
    for lane in range(32):
        g, t = lane // 4, lane % 4
        for i in range(8):
            row = g + (8 if i in (2, 3, 6, 7) else 0)
            col = 2 * t + i % 2 + (8 if i >= 4 else 0)
            regs_a[lane, i // 2] |= int(_bits(a[row, col], dtype)) << (16 * (i % 2))
        for i in range(4):
            row = 2 * t + i % 2 + (8 if i >= 2 else 0)
            regs_b[lane, i // 2] |= int(_bits(b[row, g], dtype)) << (16 * (i % 2))
        for i in range(4):
            regs_c[lane, i] = c[g + (8 if i >= 2 else 0), 2 * t + i % 2]
    d = torch.zeros(32, 4)
    error = ctypes.create_string_buffer(512)
    status = lib.pa_selftest_mma(
        ctypes.c_int64(dtype == torch.bfloat16),
        ctypes.c_void_p(regs_a.data_ptr()),
        ctypes.c_void_p(regs_b.data_ptr()),
        ctypes.c_void_p(regs_c.data_ptr()),
        ctypes.c_void_p(d.data_ptr()),
        error,
        ctypes.c_int64(len(error)),
    )
    assert status == 0, error_text(error)
    expected = a.double() @ b.double() + c.double()
    for lane in range(32):
        g, t = lane // 4, lane % 4
        for i in range(4):
            want = expected[g + (8 if i >= 2 else 0), 2 * t + i % 2]
            assert abs(float(d[lane, i]) - float(want)) <= 1e-6 * (1 + abs(float(want)))


def _cp_async(lib, mode: int):
    src = torch.arange(32 * 8, dtype=torch.float32)
    out = torch.zeros(32 * 8)
    error = ctypes.create_string_buffer(512)
    status = lib.pa_selftest_cp_async(
        ctypes.c_int64(mode),
        ctypes.c_void_p(src.data_ptr()),
        ctypes.c_void_p(out.data_ptr()),
        error,
        ctypes.c_int64(len(error)),
    )
    return (
        status,
        error_text(error),
        src.view(2, 32, 4).permute(1, 0, 2).reshape(32, 8),
        out.view(32, 8),
    )


def test_cp_async_lands_at_its_wait_and_is_nan_before(lib):
    status, error, src, out = _cp_async(lib, 0)  # waited for both groups
    assert status == 0, error
    assert torch.equal(out, src)
    status, error, src, out = _cp_async(lib, 1)  # read before any wait
    assert status == 0, error
    assert torch.isnan(out).all()
    status, error, src, out = _cp_async(lib, 2)  # wait_group 1: the older group only
    assert status == 0, error
    assert torch.equal(out[:, :4], src[:, :4]) and torch.isnan(out[:, 4:]).all()


def test_cp_async_never_waited_for_is_an_error(lib):
    status, error, _, _ = _cp_async(lib, 3)
    assert status == 1 and "never waited" in error


@pytest.mark.parametrize(
    "which,message",
    [
        (0, "divergent warp collective"),
        (1, "deadlock"),
        (2, "outside every registered region"),
        (3, "ldmatrix"),
        (4, "outside every writable region"),
    ],
    ids=[
        "divergent-collective",
        "syncthreads-after-exit",
        "global-out-of-bounds",
        "shared-out-of-bounds",
        "store-to-read-only",
    ],
)
def test_emulator_rejects_broken_kernels(lib, which, message):
    buffer = torch.zeros(64)
    error = ctypes.create_string_buffer(512)
    status = lib.pa_selftest_rejects(
        ctypes.c_int64(which), ctypes.c_void_p(buffer.data_ptr()), error, ctypes.c_int64(len(error))
    )
    assert status == 1 and message in error_text(error), error_text(error)


# --------------------------------------------------------------------------------------------
# The decode kernels against reference.py


def run_case(
    version: int,
    *,
    seq_lens: list[int],
    num_heads: int = 8,
    num_kv_heads: int = 2,
    head_size: int = 128,
    v_head_size: int | None = None,
    block_size: int = 16,
    dtype: torch.dtype = torch.float16,
    kv_cache_dtype: str = "auto",
    alibi: bool = False,
    sliding_window: int = 0,
    logits_soft_cap: float = 0.0,
    attention_chunk_size: int = 0,
    query_scale: float = 1.0,
    target: str = emu.DEFAULT_TARGET,
    num_sms: int | None = None,
    ctas_per_sm: int = 0,
    seed: int = 0,
    strided_query: bool = False,
    release_before_chunk: bool = False,
) -> emu.Report:
    """The emulated kernels and reference.py on one case (values of head size ``v_head_size``,
    by default ``head_size``); asserts they agree. Returns the kernels' report."""
    v_head_size = v_head_size or head_size
    kv = make_paged_kv_of_value_size(len(seq_lens), seq_lens, num_kv_heads, head_size,
                                     v_head_size, block_size, dtype, kv_cache_dtype,
                                     seed=seed)  # fmt: skip
    if release_before_chunk:
        # Blocks wholly before the query's chunk may be released: an id that is out of range
        # there makes any read of it an error under the emulation.
        for s, n in enumerate(seq_lens):
            first = reference.first_attended_position(n - 1, sliding_window, attention_chunk_size)
            kv.block_tables[s, : first // block_size] = 10**6
    gen = torch.Generator().manual_seed(seed + 1)
    if strided_query:  # the query heads of a fused [tokens, heads + 2 kv_heads, head_size] QKV
        qkv = torch.randn(len(seq_lens), num_heads + 2 * num_kv_heads, head_size, generator=gen)
        query = (qkv * query_scale).to(dtype)[:, :num_heads]
    else:
        base = torch.randn(len(seq_lens), num_heads, head_size, generator=gen)
        query = (base * query_scale).to(dtype)
    slopes = torch.linspace(0.02, 0.4, num_heads) if alibi else None
    args = (
        query,
        kv.key_cache,
        kv.value_cache,
        num_kv_heads,
        head_size**-0.5,
        kv.block_tables,
        kv.seq_lens,
        block_size,
        kv.max_seq_len,
        slopes,
        kv_cache_dtype,
        kv.k_scale,
        kv.v_scale,
        sliding_window,
        logits_soft_cap,
        attention_chunk_size,
    )
    options = dict(target=target, num_sms=num_sms, ctas_per_sm=ctas_per_sm)
    out = torch.full((len(seq_lens), num_heads, v_head_size), math.nan, dtype=dtype)
    expected = torch.empty_like(out)
    if version == 1:
        report = emu.paged_attention_v1(out, *args, **options)
        reference.paged_attention_v1(expected, *args)
    else:
        report = run_v2_against_reference(out, expected, args, options)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, expected, **TOLERANCES[dtype])
    if dtype != torch.float32 and report.ldmatrix > 0:
        assert report.ldmatrix_max_ways == 1, "an ldmatrix read had a bank conflict"
    return report


def run_v2_against_reference(out, expected, args, options) -> emu.Report:
    """v2 under the emulation and in reference.py on scratch holding 7.0 (one partition more
    than the context needs); asserts that the partial results agree too."""
    query, value_cache, max_seq_len = args[0], args[2], args[8]
    partitions = max(1, math.ceil(max_seq_len / PARTITION_SIZE)) + 1
    shape = (query.shape[0], query.shape[1], partitions)
    scratch = [
        torch.full(shape, 7.0),
        torch.full(shape, 7.0),
        torch.full((*shape, value_cache.shape[2]), 7.0, dtype=query.dtype),
    ]
    ref_scratch = [t.clone() for t in scratch]
    report = emu.paged_attention_v2(out, *scratch, *args, **options)
    reference.paged_attention_v2(expected, *ref_scratch, *args)
    exp_sums, max_logits, tmp_out = scratch
    torch.testing.assert_close(max_logits, ref_scratch[1], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(exp_sums, ref_scratch[0], atol=1e-3, rtol=1e-4)
    torch.testing.assert_close(tmp_out, ref_scratch[2], **TOLERANCES[query.dtype])
    return report


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("head_size", HEAD_SIZES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_head_block_dtype_grid(version, block_size, head_size, dtype):
    run_case(
        version,
        seq_lens=[1, 37, 300],
        head_size=head_size,
        block_size=block_size,
        dtype=dtype,
        seed=head_size + block_size,
    )


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e5m2"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_fp8_caches(version, block_size, kv_cache_dtype, dtype):
    run_case(
        version,
        seq_lens=[3, 200, 530],
        block_size=block_size,
        dtype=dtype,
        kv_cache_dtype=kv_cache_dtype,
        seed=block_size,
    )


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("head_size", [h for h in HEAD_SIZES if h % 16 == 0])
@pytest.mark.parametrize("dtype", DTYPES)
def test_fp8_head_sizes(kv_cache_dtype, head_size, dtype):
    run_case(1, seq_lens=[5, 90], head_size=head_size, dtype=dtype, kv_cache_dtype=kv_cache_dtype)


# Values of a head size of their own (multi-head latent attention in its expanded form): keys
# 192 = 128 + 64 rotary dims and values 128 (DeepSeek-V3), 128 / 64 (a tiny DeepSeek-V2-Lite
# like model), and pairs of other buckets, values above the keys' included.
VALUE_HEAD_SIZES = [(192, 128), (128, 64), (256, 128), (96, 32), (64, 128)]


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("head_size,v_head_size", VALUE_HEAD_SIZES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_values_of_their_own_head_size(version, head_size, v_head_size, dtype):
    run_case(version, seq_lens=[1, 37, 300], head_size=head_size, v_head_size=v_head_size,
             block_size=32 if head_size == 96 else 16, dtype=dtype,
             seed=head_size + v_head_size)  # fmt: skip


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("head_size,v_head_size", [(192, 128), (128, 64)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_values_of_their_own_head_size_in_fp8_caches(kv_cache_dtype, head_size, v_head_size, dtype):
    run_case(2, seq_lens=[5, 90, 600], head_size=head_size, v_head_size=v_head_size,
             block_size=8 if dtype == torch.float32 else 32, dtype=dtype,
             kv_cache_dtype=kv_cache_dtype)  # fmt: skip


@pytest.mark.parametrize("dtype", DTYPES)
def test_values_of_their_own_head_size_with_v1_splits(dtype):
    # Several splits of one sequence: partial results of v_head_size floats and the reduce.
    report = run_case(1, seq_lens=[2000, 700], head_size=192, v_head_size=128, dtype=dtype)
    assert report.splits > 1


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(16, 16), (12, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_values_of_their_own_head_size_with_every_option(version, num_heads, num_kv_heads, dtype):
    # MHA (DeepSeek's expanded MLA) and GQA, with a window, a soft cap and ALiBi.
    run_case(version, seq_lens=[0, 1, 33, 700], num_heads=num_heads, num_kv_heads=num_kv_heads,
             head_size=192, v_head_size=128, dtype=dtype, alibi=True, sliding_window=300,
             logits_soft_cap=20.0, query_scale=4.0)  # fmt: skip


def test_bf16_queries_of_any_magnitude_fit_fp16_for_fp8_caches():
    # The fp16 MMA of fp8 caches takes bf16 queries scaled by a power of two per row.
    for scale in (1e-6, 3e4):
        run_case(1, seq_lens=[40], dtype=torch.bfloat16, kv_cache_dtype="fp8", query_scale=scale)


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("group", [1, 2, 3, 4, 5, 7, 8, 12, 16, 24, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gqa_groups(version, group, dtype):
    num_kv_heads = 2 if group <= 8 else 1
    report = run_case(
        version,
        seq_lens=[5, 130, 513],
        num_heads=group * num_kv_heads,
        num_kv_heads=num_kv_heads,
        dtype=dtype,
        seed=group,
    )
    most = 16 if dtype != torch.float32 else 4
    assert report.heads_per_cta == math.ceil(group / math.ceil(group / most))


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
def test_alibi(version, dtype, kv_cache_dtype):
    run_case(version, seq_lens=[1, 90, 700], dtype=dtype, kv_cache_dtype=kv_cache_dtype, alibi=True)


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("window", [1, 5, 16, 100, 512, 5000])
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_sliding_window(version, window, block_size, dtype):
    run_case(
        version,
        seq_lens=[1, 20, 513, 1100],
        block_size=block_size,
        dtype=dtype,
        sliding_window=window,
    )


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("chunk", [1, 5, 16, 100, 512, 5000])
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_attention_chunks(version, chunk, block_size):
    """Chunks cutting blocks and 16-token tiles, at their edges, at v2's partition edges and
    longer than the context, on both kernels; the blocks before each query's chunk are
    released."""
    run_case(
        version,
        seq_lens=[1, 20, 513, 1100],
        block_size=block_size,
        dtype=torch.float32 if chunk in (5, 512) else torch.bfloat16,
        attention_chunk_size=chunk,
        release_before_chunk=True,
        seed=chunk,
    )


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("window", [7, 300])
@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_chunks_with_a_window(version, window, dtype):
    run_case(
        version,
        seq_lens=[3, 200, 700],
        dtype=dtype,
        sliding_window=window,
        attention_chunk_size=64,
        release_before_chunk=True,
        alibi=True,
    )


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("cap", [5.0, 30.0])
@pytest.mark.parametrize("dtype", DTYPES)
def test_soft_cap(version, cap, dtype):
    run_case(version, seq_lens=[7, 600], dtype=dtype, logits_soft_cap=cap, query_scale=8.0)


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("dtype", DTYPES)
def test_all_options_together(version, dtype):
    run_case(
        version,
        seq_lens=[0, 1, 33, 1500],
        num_heads=12,
        num_kv_heads=1,
        head_size=96,
        block_size=32,
        dtype=dtype,
        kv_cache_dtype="fp8_e5m2",
        alibi=True,
        sliding_window=600,
        logits_soft_cap=20.0,
    )
    run_case(
        version,
        seq_lens=[0, 1, 33, 1500],
        num_heads=12,
        num_kv_heads=1,
        head_size=96,
        block_size=32,
        dtype=dtype,
        kv_cache_dtype="fp8_e4m3",
        alibi=True,
        sliding_window=600,
        logits_soft_cap=20.0,
        attention_chunk_size=250,
        release_before_chunk=True,
    )


@pytest.mark.parametrize("version", [1, 2])
def test_empty_and_single_token_sequences(version):
    run_case(version, seq_lens=[0, 1, 0, 2, 1])
    run_case(version, seq_lens=[0, 0], dtype=torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
def test_strided_query(dtype):
    run_case(1, seq_lens=[40, 700], head_size=64, dtype=dtype, strided_query=True)


@pytest.mark.parametrize("dtype", DTYPES)
def test_v1_splits_to_fill_the_gpu_and_runs_whole_sequences_when_it_is_full(dtype):
    # 2 sequences x 2 KV heads on an H200 (132 SMs): the context is split into many CTAs.
    split = run_case(1, seq_lens=[2000, 1337], dtype=dtype)
    assert split.splits > 1
    # On a one-SM GPU the same launch takes each sequence whole: every warp's ring wraps many
    # times.
    whole = run_case(1, seq_lens=[2000, 1337], dtype=dtype, num_sms=1, ctas_per_sm=1)
    assert whole.splits == 1
    # Splits wholly before the query's chunk attend nothing.
    chunked = run_case(1, seq_lens=[2000, 1337], dtype=dtype, attention_chunk_size=300)
    assert chunked.splits > 1


def test_a_cta_takes_a_long_context_whole_when_the_gpu_is_full():
    # Block ids come from the block table tile by tile: no cap on the tokens of one CTA.
    report = run_case(1, seq_lens=[9000], num_heads=4, num_kv_heads=4, head_size=64, num_sms=1)
    assert report.splits == 1


def test_seq_len_past_max_seq_len_is_clamped_without_reading_out_of_bounds():
    kv = make_paged_kv(2, [64, 64], 2, 128, 16, torch.float16)
    lying = kv.seq_lens.clone()
    lying[1] = 10_000_000  # far past the block table
    query = torch.randn(2, 8, 128).to(torch.float16)
    common = (kv.key_cache, kv.value_cache, 2, 128**-0.5, kv.block_tables)
    tail = (16, 64, None, "auto", kv.k_scale, kv.v_scale, 0, 0.0)
    out = torch.empty_like(query)
    emu.paged_attention_v1(out, query, *common, lying, *tail)  # every access is checked
    expected = torch.empty_like(query)
    reference.paged_attention_v1(expected, query, *common, kv.seq_lens, *tail)
    torch.testing.assert_close(out, expected, **TOLERANCES[torch.float16])


def test_the_plan_fills_waves():
    """The split counts of plan_v1_splits for shapes of the decode benchmark."""

    def splits(batch, context, target="sm_90", dtype=torch.bfloat16):
        kv_heads, head_size = 8, 128
        query = torch.zeros(batch, 32, head_size, dtype=dtype)
        report = emu.paged_attention_v1(
            torch.zeros_like(query),
            query,
            torch.zeros(0, kv_heads, head_size // 8, 16, 8, dtype=dtype),
            torch.zeros(0, kv_heads, head_size, 16, dtype=dtype),
            kv_heads,
            1.0,
            torch.zeros(batch, context // 16, dtype=torch.int32),
            torch.zeros(batch, dtype=torch.int32),  # nothing attended: only the plan matters
            16,
            context,
            None,
            "auto",
            torch.ones(1),
            torch.ones(1),
            target=target,
        )
        return report.splits, report.ctas_per_sm

    # An H200: 64 x 8 = 512 (sequence, KV head) pairs already fill two waves of 2 x 132 CTAs.
    assert splits(64, 4096) == (1, 2)
    # 8 x 8 = 64 pairs: 4 splits of 1024 tokens make 256 CTAs, one wave.
    assert splits(8, 4096) == (4, 2)
    # One sequence: 256 tokens a split, 16 x 8 = 128 CTAs.
    assert splits(1, 4096)[0] * 8 <= 2 * 132
    # An A100 holds one of these CTAs per SM (100 KiB of its 164): 108 slots, which 5 splits of
    # 832 tokens fill best (320 CTAs in 3 waves of 60 tiles, where one split would take 264
    # tiles and 4 splits 3 waves of 72).
    assert splits(8, 4096, "sm_80") == (5, 1)


# --------------------------------------------------------------------------------------------
# The plan on every target GPU


def test_every_variant_fits_every_target():
    """Every compiled variant's plan on every target: within the target's shared memory per CTA,
    at least one CTA per SM, the full ring wherever it fits and a compact one only where not."""
    largest = "sm_90"
    for target, limits in emu.targets().items():
        for variant in emu.variants():
            plan = emu.plan_variant(*variant, target)
            full = emu.plan_variant(*variant, largest)
            key = (target, *variant, plan.stages, plan.shared_bytes)
            assert full.stages == full.full_stages, key
            assert plan.shared_bytes <= limits["shared_per_block_optin"], key
            assert plan.ctas_per_sm >= 1, key
            fits = full.shared_bytes <= limits["shared_per_block_optin"]
            assert (plan.stages == plan.full_stages) == fits, key


def test_the_compiled_register_budgets_follow_the_largest_gpu_each_ring_runs_on():
    # A full ring is compiled for as many CTAs as an H100/H200 holds (up to the register-bound
    # most); a compact ring, used only where 99 KiB per CTA is the limit, for one CTA per SM
    # there, which leaves it 255 registers.
    for variant in emu.variants():
        on_h200 = emu.plan_variant(*variant, "sm_90")
        assert on_h200.ctas_per_sm == on_h200.compiled_ctas_per_sm, variant
        on_l4 = emu.plan_variant(*variant, "sm_89")
        if on_l4.stages != on_l4.full_stages:
            assert (on_l4.compiled_ctas_per_sm, on_l4.register_budget) == (1, 255), variant


def test_the_plan_table_in_the_docs_is_current():
    # docs/cuda.md shows emu.plan_table(); regenerate it with
    # python tests/cuda_emulator.py --write-docs.
    text = emu.DOCS.read_text()
    begin = text.index(emu.TABLE_BEGIN) + len(emu.TABLE_BEGIN)
    assert text[begin : text.index(emu.TABLE_END)].strip() == emu.plan_table()
