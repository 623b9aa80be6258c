"""CPU paged_attention_v1/v2 against reference.py.

The grid covers every head size, block size, query dtype and feature at least once rather than
their full product. Caches are NaN-filled outside the stored tokens and their block tables are
scattered with unused trailing entries (tests/conftest.py), so any read of a slot that holds no
token shows up as NaN.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import make_paged_kv, make_paged_kv_of_value_size
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import paged_attention.ops.bindings  # registers torch.ops.paged_attention
from paged_attention.ops import reference

ops = torch.ops.paged_attention

# Output tolerances per query dtype. The reference computes in float32 from the same cache values
# and casts once, so low-precision outputs may differ from it by one rounding step.
TOLERANCES = {
    torch.float32: dict(rtol=1e-5, atol=2e-6),
    torch.float16: dict(rtol=2**-10, atol=2**-12),
    torch.bfloat16: dict(rtol=2**-7, atol=2**-9),
}


def make_query(num_seqs, num_heads, head_size, dtype, seed=1, fused_qkv=False):
    generator = torch.Generator().manual_seed(seed)
    if not fused_qkv:
        return torch.randn(num_seqs, num_heads, head_size, generator=generator).to(dtype)
    # A slice of a fused QKV projection: strided in the sequence and head dims.
    qkv = torch.randn(num_seqs, 3 * num_heads, head_size, generator=generator).to(dtype)
    return qkv[:, num_heads : 2 * num_heads]


def attention_args(
    query, kv, num_heads, *, alibi=False, sliding_window=0, soft_cap=0.0, scale=None, chunk=0
):
    slopes = None
    if alibi:
        slopes = torch.tensor([2.0 ** (-8.0 * (h + 1) / num_heads) for h in range(num_heads)])
    return (
        query,
        kv.key_cache,
        kv.value_cache,
        kv.num_kv_heads,
        kv.head_size**-0.5 if scale is None else scale,
        kv.block_tables,
        kv.seq_lens,
        kv.block_size,
        kv.max_seq_len,
        slopes,
        kv.kv_cache_dtype,
        kv.k_scale,
        kv.v_scale,
        sliding_window,
        soft_cap,
        chunk,
    )


def out_shape(args):
    """The output of a call: query's rows and heads, the values' head size (value_cache.shape[2],
    the keys' but for multi-head latent attention)."""
    return (*args[0].shape[:2], args[2].shape[2])


def v2_scratch(query, max_seq_len, extra_partitions=0, v_head_size=None):
    num_seqs, num_heads, head_size = query.shape
    partitions = paged_attention.num_partitions(max_seq_len) + extra_partitions
    exp_sums = torch.full((num_seqs, num_heads, partitions), 123.0)
    max_logits = torch.full_like(exp_sums, 123.0)
    tmp_out = torch.full(
        (num_seqs, num_heads, partitions, v_head_size or head_size), 123.0, dtype=query.dtype
    )
    return exp_sums, max_logits, tmp_out


def run_v1(args):
    out = torch.full(out_shape(args), 7.0, dtype=args[0].dtype)
    ops.paged_attention_v1(out, *args)
    return out


def run_v2(args, extra_partitions=0):
    query = args[0]
    out = torch.full(out_shape(args), 7.0, dtype=query.dtype)
    scratch = v2_scratch(query, args[8], extra_partitions, args[2].shape[2])
    ops.paged_attention_v2(out, *scratch, *args)
    return out, scratch


def run_reference_v1(args):
    out = torch.empty(out_shape(args), dtype=args[0].dtype)
    reference.paged_attention_v1(out, *args)
    return out


def check_v1_v2(args, tolerance_dtype=None):
    """Both kernels against the reference, and the v2 partition outputs too."""
    query = args[0]
    tol = TOLERANCES[tolerance_dtype or query.dtype]
    expected = run_reference_v1(args)
    assert not expected.isnan().any()
    torch.testing.assert_close(run_v1(args), expected, **tol)
    out, (exp_sums, max_logits, tmp_out) = run_v2(args)
    torch.testing.assert_close(out, expected, **tol)
    ref_out = torch.empty_like(out)
    ref_scratch = v2_scratch(query, args[8], v_head_size=args[2].shape[2])
    reference.paged_attention_v2(ref_out, *ref_scratch, *args)
    torch.testing.assert_close(max_logits, ref_scratch[1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(exp_sums, ref_scratch[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(tmp_out, ref_scratch[2], **tol)


# --------------------------------------------------------------------------------------------
# Coverage grid


@pytest.mark.parametrize("head_size", [32, 64, 80, 96, 112, 120, 128, 192, 256])
def test_head_sizes(head_size):
    kv = make_paged_kv(3, [1, 37, 300], 2, head_size, 16, torch.float32, seed=head_size)
    query = make_query(3, 8, head_size, torch.float32)
    check_v1_v2(attention_args(query, kv, 8))


# Values of their own head size (multi-head latent attention: DeepSeek-V3's keys 192, values 128).
VALUE_HEAD_SIZES = [(192, 128), (128, 192), (64, 128), (128, 64), (192, 64), (64, 192)]


@pytest.mark.parametrize("head_size, v_head_size", VALUE_HEAD_SIZES, ids=str)
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_values_of_their_own_head_size(head_size, v_head_size, block_size, dtype):
    """v1 and v2 (three partitions) against the reference, GQA, output [.., v_head_size]."""
    kv = make_paged_kv_of_value_size(
        3, [1, 37, 1100], 2, head_size, v_head_size, block_size, dtype, seed=head_size
    )
    query = make_query(3, 8, head_size, dtype)
    args = attention_args(query, kv, 8)
    assert run_v1(args).shape == (3, 8, v_head_size)
    check_v1_v2(args)


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize(
    "features", [dict(sliding_window=30, soft_cap=10.0), dict(chunk=40, alibi=True)], ids=str
)
def test_values_of_their_own_head_size_with_features(kv_cache_dtype, features):
    kv = make_paged_kv_of_value_size(
        3, [5, 77, 600], 4, 192, 128, 16, torch.bfloat16, kv_cache_dtype
    )
    query = make_query(3, 16, 192, torch.bfloat16)
    check_v1_v2(attention_args(query, kv, 16, scale=0.07, **features))


def test_paged_attention_returns_the_value_head_size():
    kv = make_paged_kv_of_value_size(2, [20, 900], 2, 192, 128, 16, torch.float32)
    query = make_query(2, 4, 192, torch.float32)
    expected = run_reference_v1(attention_args(query, kv, 4))
    for version in (1, 2):
        out = paged_attention.paged_attention(
            query, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens, version=version
        )
        torch.testing.assert_close(out, expected, **TOLERANCES[torch.float32])


@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_block_sizes_and_dtypes(block_size, dtype):
    kv = make_paged_kv(4, [5, 16, 129, 700], 2, 64, block_size, dtype, seed=block_size)
    query = make_query(4, 8, 64, dtype)
    check_v1_v2(attention_args(query, kv, 8))


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads"), [(4, 4), (8, 2), (16, 2), (8, 1), (6, 1), (12, 4)]
)
def test_gqa_ratios(num_heads, num_kv_heads):
    """Group sizes 1, 4, 8, MQA and groups that are not a multiple of the kernel's head tile."""
    kv = make_paged_kv(3, [3, 64, 530], num_kv_heads, 128, 16, torch.bfloat16)
    query = make_query(3, num_heads, 128, torch.bfloat16)
    check_v1_v2(attention_args(query, kv, num_heads))


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize(
    ("dtype", "block_size"), [(torch.bfloat16, 16), (torch.float16, 8), (torch.float32, 32)]
)
def test_fp8_cache(kv_cache_dtype, dtype, block_size):
    kv = make_paged_kv(3, [1, 100, 600], 2, 128, block_size, dtype, kv_cache_dtype)
    assert kv.key_cache.dtype == torch.uint8
    query = make_query(3, 8, 128, dtype)
    check_v1_v2(attention_args(query, kv, 8))


@pytest.mark.parametrize(
    "features",
    [
        dict(alibi=True),
        dict(sliding_window=1),
        dict(sliding_window=37),
        dict(sliding_window=600),
        dict(soft_cap=5.0),
        dict(soft_cap=30.0, alibi=True, sliding_window=100),
        dict(scale=0.5),
        dict(chunk=1),
        dict(chunk=5),  # chunks cutting blocks
        dict(chunk=32),  # at block edges
        dict(chunk=512),  # at v2 partition edges
        dict(chunk=700),  # across partitions
        dict(chunk=5000),  # longer than every context
        dict(chunk=100, sliding_window=37),  # the window inside the chunk
        dict(chunk=40, sliding_window=600, soft_cap=30.0, alibi=True),  # the chunk inside it
    ],
    ids=str,
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_features(features, dtype):
    kv = make_paged_kv(4, [1, 40, 513, 1200], 2, 64, 16, dtype, seed=3)
    query = make_query(4, 8, 64, dtype)
    check_v1_v2(attention_args(query, kv, 8, **features))


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_chunks_with_fp8_caches(kv_cache_dtype, block_size):
    kv = make_paged_kv(3, [9, 100, 600], 2, 64, block_size, torch.bfloat16, kv_cache_dtype)
    query = make_query(3, 8, 64, torch.bfloat16)
    for chunk in (7, 64):
        check_v1_v2(attention_args(query, kv, 8, chunk=chunk, soft_cap=20.0))


def test_chunk_is_applied():
    """Guards against a chunk that is silently ignored: it must change the result, and equal
    attention over the chunk's tokens alone."""
    kv = make_paged_kv(1, 100, 1, 64, 16, torch.float32)
    query = make_query(1, 2, 64, torch.float32)
    full = run_v1(attention_args(query, kv, 2))
    chunked = run_v1(attention_args(query, kv, 2, chunk=30))  # positions 90 .. 99
    window = run_v1(attention_args(query, kv, 2, sliding_window=10))
    assert (full - chunked).abs().max() > 1e-3
    torch.testing.assert_close(chunked, window, rtol=0, atol=0)


def test_blocks_before_the_chunk_are_never_read():
    """The block manager may release the blocks before the query's chunk: their table entries
    are not checked or read, and the blocks may hold anything."""
    kv = make_paged_kv(2, [70, 200], 2, 64, 16, torch.float32)
    query = make_query(2, 4, 64, torch.float32)
    expected = run_reference_v1(attention_args(query, kv, 4, chunk=64))
    released = kv.block_tables.clone()
    released[0, :4] = -1  # row 69 attends 64 .. 69
    released[1, :12] = 10**6  # row 199 attends 192 .. 199
    for seq, blocks in ((0, 4), (1, 12)):
        for cache in (kv.key_cache, kv.value_cache):
            cache[kv.block_tables[seq, :blocks].long()] = math.nan
    kv.block_tables = released
    args = attention_args(query, kv, 4, chunk=64)
    torch.testing.assert_close(run_v1(args), expected, **TOLERANCES[torch.float32])
    torch.testing.assert_close(run_v2(args)[0], expected, **TOLERANCES[torch.float32])


def test_soft_cap_is_applied():
    """A cap far below the logits' spread must change the result (guards against a no-op)."""
    kv = make_paged_kv(1, 50, 1, 64, 16, torch.float32)
    query = make_query(1, 1, 64, torch.float32) * 20
    plain = run_v1(attention_args(query, kv, 1))
    capped = run_v1(attention_args(query, kv, 1, soft_cap=1.0))
    assert (plain - capped).abs().max() > 1e-2


def test_seq_len_zero_and_one():
    kv = make_paged_kv(3, [0, 1, 0], 2, 64, 16, torch.float32)
    query = make_query(3, 4, 64, torch.float32)
    args = attention_args(query, kv, 4)
    out = run_v1(args)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    assert torch.equal(out[2], torch.zeros_like(out[2]))
    # One token: the output is that token's value row exactly (softmax weight 1).
    _, values = reference.gather_kv(kv.key_cache, kv.value_cache, kv.block_tables[1], 1)
    torch.testing.assert_close(out[1], values[0].repeat_interleave(2, dim=0), rtol=0, atol=0)
    v2_out, (exp_sums, max_logits, tmp_out) = run_v2(args)
    torch.testing.assert_close(v2_out, out, rtol=0, atol=0)
    assert torch.equal(exp_sums[0], torch.zeros_like(exp_sums[0]))
    assert torch.isneginf(max_logits[0]).all()
    assert torch.equal(tmp_out[0], torch.zeros_like(tmp_out[0]))


def test_all_sequences_empty():
    kv = make_paged_kv(2, [0, 0], 1, 32, 8, torch.float32)
    query = make_query(2, 2, 32, torch.float32)
    args = attention_args(query, kv, 2)
    assert torch.equal(run_v1(args), torch.zeros_like(query))
    assert torch.equal(run_v2(args)[0], torch.zeros_like(query))


def test_strided_query_from_fused_qkv():
    kv = make_paged_kv(3, [9, 200, 777], 2, 128, 16, torch.bfloat16)
    query = make_query(3, 8, 128, torch.bfloat16, fused_qkv=True)
    assert not query.is_contiguous()
    check_v1_v2(attention_args(query, kv, 8))


def test_nan_slots_never_reach_the_output():
    """Partial last blocks and a window starting mid-block: the NaN-filled slots around the
    attended tokens sit in the same tiles the kernel reads."""
    kv = make_paged_kv(3, [7, 45, 520], 2, 64, 32, torch.float32)
    assert kv.value_cache.isnan().any()
    query = make_query(3, 8, 64, torch.float32)
    for window, chunk in ((0, 0), (11, 0), (0, 13), (11, 20)):
        args = attention_args(query, kv, 8, sliding_window=window, chunk=chunk)
        assert not run_v1(args).isnan().any()
        assert not run_v2(args)[0].isnan().any()


def test_extra_partitions_and_v1_v2_agreement():
    """Scratch with more partitions than needed: the spare ones hold -inf / 0 / 0."""
    kv = make_paged_kv(2, [1030, 300], 2, 64, 16, torch.float32)
    query = make_query(2, 4, 64, torch.float32)
    args = attention_args(query, kv, 4)
    out, (exp_sums, max_logits, tmp_out) = run_v2(args, extra_partitions=2)
    torch.testing.assert_close(out, run_v1(args), rtol=1e-5, atol=1e-6)
    assert torch.isneginf(max_logits[1, :, 1:]).all()
    assert torch.equal(exp_sums[1, :, 1:], torch.zeros_like(exp_sums[1, :, 1:]))
    assert torch.equal(tmp_out[0, :, 3:], torch.zeros_like(tmp_out[0, :, 3:]))


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "num_seqs", "threads"),
    [(32, 8, 4, 1), (12, 6, 2, 1), (3, 3, 4, 1), (10, 5, 4, 2)],
    ids=["4+4 heads", "4+2 heads", "3 heads, MHA", "4+1 heads"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_units_of_several_kv_heads(num_heads, num_kv_heads, num_seqs, threads, dtype):
    """With enough units per thread the kernel serves up to 4 adjacent KV heads per unit (the
    last run of a sequence may be shorter); every query head must still get its own KV head,
    ALiBi slope, window and output row. These shapes give runs of 4 + 4, 4 + 2, 3 and 4 + 1."""
    lens = [1, 37, 300, 513][:num_seqs]
    kv = make_paged_kv(num_seqs, lens, num_kv_heads, 64, 16, dtype, seed=num_heads)
    query = make_query(num_seqs, num_heads, 64, dtype, seed=num_kv_heads)
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        check_v1_v2(attention_args(query, kv, num_heads, alibi=True))
        check_v1_v2(attention_args(query, kv, num_heads, sliding_window=40, soft_cap=20.0))
        check_v1_v2(attention_args(query, kv, num_heads, chunk=24, alibi=True))
    finally:
        torch.set_num_threads(previous)


def test_block_table_order_does_not_matter():
    kv = make_paged_kv(1, 200, 1, 64, 16, torch.float32)
    query = make_query(1, 2, 64, torch.float32)
    out = run_v1(attention_args(query, kv, 2))
    # Move the blocks to reversed physical positions and remap the table.
    used = kv.block_tables[0, :13].long()
    new_ids = torch.arange(kv.num_blocks - 1, kv.num_blocks - 14, -1)
    for cache in (kv.key_cache, kv.value_cache):
        cache[new_ids] = cache[used].clone()
    kv.block_tables[0, :13] = new_ids.to(torch.int32)
    torch.testing.assert_close(run_v1(attention_args(query, kv, 2)), out, rtol=0, atol=0)


def test_thread_count_does_not_change_the_result():
    kv = make_paged_kv(5, [100, 2000, 1, 600, 900], 2, 64, 16, torch.float32)
    query = make_query(5, 8, 64, torch.float32)
    args = attention_args(query, kv, 8)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = run_v1(args), run_v2(args)[0]
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(run_v1(args), single[0])
    assert torch.equal(run_v2(args)[0], single[1])


@pytest.mark.slow
@pytest.mark.parametrize(
    ("context", "dtype", "block_size"), [(8192, torch.bfloat16, 16), (32768, torch.float32, 32)]
)
def test_long_context(context, dtype, block_size):
    kv = make_paged_kv(2, [context, context - 77], 1, 64, block_size, dtype, nan_fill=False)
    query = make_query(2, 4, 64, dtype)
    check_v1_v2(attention_args(query, kv, 4))


# --------------------------------------------------------------------------------------------
# Random shapes


@settings(
    max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)
@given(
    lens=st.lists(st.integers(0, 700), min_size=1, max_size=3),
    num_kv_heads=st.integers(1, 3),
    group=st.integers(1, 5),
    head_size=st.sampled_from([32, 64, 80, 96, 112, 120, 128, 192, 256]),
    block_size=st.sampled_from([8, 16, 32]),
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
    kv_cache_dtype=st.sampled_from(["auto", "fp8_e4m3", "fp8_e5m2"]),
    sliding_window=st.sampled_from([0, 0, 5, 300]),
    alibi=st.booleans(),
    soft_cap=st.sampled_from([0.0, 0.0, 10.0]),
    chunk=st.sampled_from([0, 0, 3, 64, 200]),
)
def test_random_shapes(
    lens,
    num_kv_heads,
    group,
    head_size,
    block_size,
    dtype,
    kv_cache_dtype,
    sliding_window,
    alibi,
    soft_cap,
    chunk,
):
    if kv_cache_dtype != "auto" and head_size % 16:
        head_size = 128  # fp8 keys come in 16-element chunks: head_size must be a multiple of 16
    num_heads = num_kv_heads * group
    kv = make_paged_kv(
        len(lens), lens, num_kv_heads, head_size, block_size, dtype, kv_cache_dtype, seed=len(lens)
    )
    query = make_query(len(lens), num_heads, head_size, dtype)
    args = attention_args(
        query,
        kv,
        num_heads,
        alibi=alibi,
        sliding_window=sliding_window,
        soft_cap=soft_cap,
        chunk=chunk,
    )
    expected = run_reference_v1(args)
    tol = TOLERANCES[dtype]
    torch.testing.assert_close(run_v1(args), expected, **tol)
    torch.testing.assert_close(run_v2(args)[0], expected, **tol)


# --------------------------------------------------------------------------------------------
# Every instruction-set variant of the kernel


def test_narrower_instruction_sets_agree():
    """The kernel is compiled for AVX-512, AVX2 (its multiply-add loops in 8-lane halves) and
    baseline x86-64 and picked at run time from torch's CPU capability; forcing each narrower
    one through ATEN_CPU_CAPABILITY must give the same result as the reference, over every
    cache dtype, chunk shape (block sizes 8-32: patterns that span one or two chunks), partial
    blocks and units of several KV heads (each variant runs in a fresh interpreter)."""
    script = textwrap.dedent(
        """
        import sys
        import torch
        sys.path.insert(0, "tests")
        from test_attention_cpu import make_paged_kv, make_query, attention_args, check_v1_v2
        for dtype, cache in ((torch.float32, "auto"), (torch.bfloat16, "auto"),
                             (torch.float16, "fp8_e5m2"), (torch.bfloat16, "fp8_e4m3")):
            kv = make_paged_kv(2, [19, 530], 2, 80, 8, dtype, cache)
            check_v1_v2(attention_args(make_query(2, 6, 80, dtype), kv, 6, alibi=True,
                                       soft_cap=20.0))
        for dtype, cache, head_size, block_size in (
            (torch.float32, "auto", 128, 32), (torch.float16, "auto", 64, 16),
            (torch.bfloat16, "auto", 128, 16), (torch.float32, "fp8_e4m3", 64, 32),
        ):
            kv = make_paged_kv(3, [1, 77, 700], 2, head_size, block_size, dtype, cache)
            check_v1_v2(attention_args(make_query(3, 8, head_size, dtype), kv, 8,
                                       sliding_window=100))
            check_v1_v2(attention_args(make_query(3, 8, head_size, dtype), kv, 8, chunk=20,
                                       sliding_window=300, alibi=True))
        torch.set_num_threads(2)  # 4 sequences x 8 KV heads: units of 4 KV heads
        for dtype in (torch.float32, torch.bfloat16):
            kv = make_paged_kv(4, [1, 37, 300, 513], 8, 64, 16, dtype)
            check_v1_v2(attention_args(make_query(4, 32, 64, dtype), kv, 32, alibi=True))
            check_v1_v2(attention_args(make_query(4, 32, 64, dtype), kv, 32, chunk=9))
        print("ok", torch.backends.cpu.get_cpu_capability())
        """
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for capability in ("avx2", "default"):
        env = dict(os.environ, ATEN_CPU_CAPABILITY=capability)
        result = subprocess.run(
            [sys.executable, "-c", script], cwd=root, env=env, capture_output=True, text=True
        )
        assert result.returncode == 0, result.stderr[-2000:]
        assert result.stdout.startswith("ok")


def test_v2_only_when_there_are_too_few_units(monkeypatch):
    """On the CPU, paged_attention() splits sequences into partitions only to occupy the threads,
    whatever the context length."""
    monkeypatch.setattr(paged_attention.ops.bindings, "_cpu_threads", lambda: 2)
    use_v2 = paged_attention.use_v2
    many = torch.empty(32, 32, 128)  # 32 sequences x 8 KV heads = 256 units
    few = torch.empty(1, 4, 128)  # 1 unit
    assert not use_v2(many, 8, 32768)
    assert not use_v2(many, 8, 1024)
    assert use_v2(few, 1, 32768) and use_v2(few, 1, 1024)
    assert not use_v2(few, 1, 512)  # one partition: nothing to split


def test_built_to_run_in_parallel():
    """ATen's parallel_for is inline in its headers; with torch's OpenMP backend an extension
    compiled without OpenMP silently runs it on one thread. The built library must therefore
    call into the OpenMP runtime (a serial build once halved the kernel's speed on 2 cores)."""
    if "parallel backend: OpenMP" not in torch.__config__.parallel_info():
        pytest.skip("torch is not built with the OpenMP parallel backend")
    from paged_attention import _C

    with open(_C.__file__, "rb") as library:
        assert b"GOMP_parallel" in library.read()


# --------------------------------------------------------------------------------------------
# Tracing


@pytest.mark.parametrize(
    "features",
    [dict(alibi=True), dict(sliding_window=300, soft_cap=10.0), dict(chunk=40, alibi=True),
     dict(chunk=40, sliding_window=300, soft_cap=10.0)],
    ids=str,
)  # fmt: skip
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
def test_opcheck(features, kv_cache_dtype):
    """Schema, fake kernel and the op agree (torch.library.opcheck), with and without chunks."""
    kv = make_paged_kv(2, [20, 600], 2, 64, 16, torch.bfloat16, kv_cache_dtype)
    query = make_query(2, 4, 64, torch.bfloat16)
    args = attention_args(query, kv, 4, **features)
    out = torch.empty_like(query)
    torch.library.opcheck(ops.paged_attention_v1, (out, *args))
    torch.library.opcheck(ops.paged_attention_v2, (out, *v2_scratch(query, args[8]), *args))


def test_opcheck_with_values_of_their_own_head_size():
    kv = make_paged_kv_of_value_size(2, [20, 600], 4, 192, 128, 16, torch.bfloat16)
    query = make_query(2, 8, 192, torch.bfloat16)
    args = attention_args(query, kv, 8)
    out = torch.empty(out_shape(args), dtype=query.dtype)
    torch.library.opcheck(ops.paged_attention_v1, (out, *args))
    scratch = v2_scratch(query, args[8], v_head_size=128)
    torch.library.opcheck(ops.paged_attention_v2, (out, *scratch, *args))


@pytest.mark.parametrize("version", [1, 2, None])  # None: paged_attention() picks while tracing
def test_torch_compile_fullgraph(version):
    kv = make_paged_kv(2, [30, 1500], 2, 64, 16, torch.bfloat16)
    query = make_query(2, 8, 64, torch.bfloat16)

    def step(q, key_cache, value_cache, block_tables, seq_lens):
        out = paged_attention.paged_attention(
            q, key_cache, value_cache, block_tables, seq_lens, max_seq_len=1500, version=version
        )
        return out * 2

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    inputs = (query, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens)
    expected = run_reference_v1(attention_args(query, kv, 8)) * 2
    torch.testing.assert_close(compiled(*inputs), expected, **TOLERANCES[torch.bfloat16])


# --------------------------------------------------------------------------------------------
# Bad input


def bad_call(version=1, **changes):
    kv = make_paged_kv(2, [10, 40], 2, 64, 16, torch.float32)
    query = make_query(2, 4, 64, torch.float32)
    args = list(attention_args(query, kv, 4))
    names = [
        "query",
        "key_cache",
        "value_cache",
        "num_kv_heads",
        "scale",
        "block_tables",
        "seq_lens",
        "block_size",
        "max_seq_len",
        "alibi_slopes",
        "kv_cache_dtype",
        "k_scale",
        "v_scale",
        "sliding_window",
        "logits_soft_cap",
        "attention_chunk_size",
    ]
    scratch = list(v2_scratch(query, 40))
    out = torch.empty_like(query)
    for name, change in changes.items():
        if name in names:
            args[names.index(name)] = change(args[names.index(name)])
        elif name == "out":
            out = change(out)
        else:
            index = ["exp_sums", "max_logits", "tmp_out"].index(name)
            scratch[index] = change(scratch[index])
    if version == 1:
        ops.paged_attention_v1(out, *args)
    else:
        ops.paged_attention_v2(out, *scratch, *args)


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (dict(query=lambda q: torch.randn(2, 4, 48)), "head_size 48 is not supported"),
        (dict(query=lambda q: q.double()), "query must be float32, float16 or bfloat16"),
        (dict(key_cache=lambda k: k.half(), value_cache=lambda v: v.half()), "key_cache must be"),
        (dict(block_size=lambda b: 64), "block_size 64 is not supported"),
        (dict(block_tables=lambda t: t.long()), "block_tables must be Int"),
        (dict(seq_lens=lambda s: s.long()), "seq_lens must be Int"),
        (dict(block_tables=lambda t: t.index_fill(1, torch.tensor([1]), 10**6)), "out of range"),
        (dict(block_tables=lambda t: t.index_fill(1, torch.tensor([0]), -1)), "out of range"),
        (dict(seq_lens=lambda s: torch.tensor([10, 41], dtype=torch.int32)), "max_seq_len"),
        (dict(max_seq_len=lambda m: 10**6), "exceeds what block_tables can address"),
        (dict(num_kv_heads=lambda n: 3), "must be a positive multiple of num_kv_heads"),
        (dict(kv_cache_dtype=lambda d: "int8"), "kv_cache_dtype must be one of"),
        (dict(out=lambda o: o.half()), "out must have the dtype of query"),
        (
            dict(value_cache=lambda v: torch.zeros(v.shape[0], 2, 48, 16)),
            r"v_head_size 48 is not supported \(value_cache.size\(2\)",
        ),
        (  # values of 128 dims make an output of 128, not query's 64
            dict(value_cache=lambda v: torch.zeros(v.shape[0], 2, 128, 16)),
            r"out must have shape \[query.size\(0\), num_heads, v_head_size\] = \[2, 4, 128\]",
        ),
        (dict(value_cache=lambda v: None), "value_cache must be a tensor, got None"),
        (dict(alibi_slopes=lambda a: torch.ones(3)), "alibi_slopes must have shape"),
        (dict(out=lambda o: None), "out must be a tensor, got None"),
        (dict(key_cache=lambda k: None), "key_cache must be a tensor, got None"),
        (dict(sliding_window=lambda w: -1), r"sliding_window must be >= 0 \(0 = none\)"),
        (
            dict(attention_chunk_size=lambda c: -1),
            r"attention_chunk_size must be >= 0 \(0 = none\)",
        ),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_bad_inputs_raise(version, changes, message):
    with pytest.raises((RuntimeError, ValueError), match=message):
        bad_call(version, **changes)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (dict(exp_sums=lambda e: e[:, :, :0]), "exp_sums must have shape"),
        (dict(max_logits=lambda m: m.double()), "max_logits must be Float"),
        (dict(tmp_out=lambda t: t[:, :, :, :32].contiguous()), "tmp_out must have shape"),
        (dict(tmp_out=lambda t: t[:, :, :, :32]), "tmp_out must be contiguous"),
        (dict(tmp_out=lambda t: t.half()), "tmp_out must have the dtype of query"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_bad_v2_scratch_raises(changes, message):
    with pytest.raises((RuntimeError, ValueError), match=message):
        bad_call(2, **changes)


def test_fp8_head_size_must_fill_key_chunks():
    query = make_query(1, 2, 120, torch.bfloat16)
    key_cache = torch.zeros(4, 1, 7, 16, 16, dtype=torch.uint8)
    value_cache = torch.zeros(4, 1, 120, 16, dtype=torch.uint8)
    scale = torch.ones(1)
    tables = torch.zeros(1, 1, dtype=torch.int32)
    lens = torch.ones(1, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"head_size \(120\) must be a multiple of x"):
        ops.paged_attention_v1(
            torch.empty_like(query),
            query,
            key_cache,
            value_cache,
            1,
            1.0,
            tables,
            lens,
            16,
            1,
            None,
            "fp8",
            scale,
            scale,
        )


def test_seq_len_beyond_block_table_raises():
    kv = make_paged_kv(1, 16, 1, 64, 16, torch.float32)
    query = make_query(1, 1, 64, torch.float32)
    args = list(attention_args(query, kv, 1))
    args[5] = kv.block_tables[:, :1].contiguous()  # one block = 16 tokens
    args[6] = torch.tensor([17], dtype=torch.int32)
    args[8] = 16
    with pytest.raises((RuntimeError, ValueError), match="seq_lens"):
        ops.paged_attention_v1(torch.empty_like(query), *args)
    assert math.isfinite(float(run_v1(attention_args(query, kv, 1)).sum()))


def _wrapper_inputs(dtype=torch.float32, kv_cache_dtype="auto"):
    kv = make_paged_kv(2, [10, 40], 2, 64, 16, dtype, kv_cache_dtype)
    return make_query(2, 4, 64, dtype), kv


@pytest.mark.parametrize(
    ("change", "error", "message"),
    [
        (dict(query=lambda q: q[:, 0]), ValueError, r"query must be 3-D .* got shape \(2, 64\)"),
        (dict(value_cache=lambda v: v[:, 0]), ValueError, "value_cache must be 4-D"),
        (dict(logits_soft_cap=1e-50), ValueError, r"logits_soft_cap \(1e-50\) underflows to 0"),
        (dict(logits_soft_cap=1e39), ValueError, "logits_soft_cap must be >= 0 and finite"),
        (dict(scale=1e39), ValueError, "scale must be finite in float32"),
        (dict(scale=math.nan), ValueError, "scale must be finite in float32"),
        (dict(attention_chunk_size=-8), ValueError, "attention_chunk_size must be >= 0"),
    ],
    ids=[
        "2-D query",
        "3-D value_cache",
        "cap underflows",
        "cap overflows",
        "scale",
        "nan scale",
        "negative chunk",
    ],
)
@pytest.mark.parametrize("version", [1, 2])
def test_wrapper_errors_name_the_argument(change, error, message, version):
    query, kv = _wrapper_inputs()
    tensors = dict(query=query, value_cache=kv.value_cache)
    options = {}
    for name, value in change.items():
        if name in tensors:
            tensors[name] = value(tensors[name])
        else:
            options[name] = value
    with pytest.raises(error, match=message):
        paged_attention.paged_attention(
            tensors["query"], kv.key_cache, tensors["value_cache"], kv.block_tables, kv.seq_lens,
            max_seq_len=kv.max_seq_len, version=version, **options,
        )  # fmt: skip


@pytest.mark.parametrize("version", [1, 2, None])
def test_wrapper_passes_the_chunk(version):
    query, kv = _wrapper_inputs()
    out = paged_attention.paged_attention(
        query, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens, max_seq_len=40,
        attention_chunk_size=16, sliding_window=30, version=version,
    )  # fmt: skip
    expected = run_reference_v1(attention_args(query, kv, 4, chunk=16, sliding_window=30))
    torch.testing.assert_close(out, expected, **TOLERANCES[torch.float32])


def test_fp8_attention_requires_scales():
    query, kv = _wrapper_inputs(torch.bfloat16, "fp8_e4m3")
    common = (query, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens)
    with pytest.raises(ValueError, match="needs k_scale and v_scale.*missing: k_scale, v_scale"):
        paged_attention.paged_attention(*common, kv_cache_dtype="fp8_e4m3")
    with pytest.raises(ValueError, match="missing: k_scale"):
        paged_attention.paged_attention(*common, kv_cache_dtype="fp8_e4m3", v_scale=kv.v_scale)
    out = paged_attention.paged_attention(
        *common, kv_cache_dtype="fp8_e4m3", k_scale=kv.k_scale, v_scale=kv.v_scale
    )
    expected = run_reference_v1(attention_args(query, kv, 4))
    torch.testing.assert_close(out, expected, **TOLERANCES[torch.bfloat16])


@pytest.mark.parametrize("meta_arg", ["alibi_slopes", "k_scale", "seq_lens", "block_tables"])
@pytest.mark.parametrize("version", [1, 2])
def test_a_meta_argument_among_cpu_ones_raises(meta_arg, version):
    """The Meta dispatch key outranks CPU, so one meta tensor used to route the whole call to the
    fake kernel: a silent no-op returning uninitialised memory."""
    query, kv = _wrapper_inputs()
    args = list(attention_args(query, kv, 4, alibi=True))
    index = {"alibi_slopes": 9, "k_scale": 11, "seq_lens": 6, "block_tables": 5}[meta_arg]
    args[index] = args[index].to("meta")
    message = f"same device, but {meta_arg} is on meta and out on cpu"
    with pytest.raises(RuntimeError, match=message):
        if version == 1:
            run_v1(args)
        else:
            run_v2(args)
    with pytest.raises(RuntimeError, match=f"{meta_arg} is on meta"):
        paged_attention.paged_attention(
            query, *args[1:3], args[5], args[6], max_seq_len=40, alibi_slopes=args[9],
            k_scale=args[11], v_scale=args[12], version=version,
        )  # fmt: skip


def test_all_meta_attention_still_runs_the_fake_kernel():
    query, kv = _wrapper_inputs()
    args = [
        a.to("meta") if isinstance(a, torch.Tensor) else a for a in attention_args(query, kv, 4)
    ]
    out = paged_attention.paged_attention(*args[:3], args[5], args[6], max_seq_len=40)
    assert out.device.type == "meta" and out.shape == query.shape


@pytest.mark.parametrize("target", ["query", "block_tables", "seq_lens", "key_cache"])
def test_out_sharing_memory_with_an_input_is_rejected(target):
    """out is written while the inputs are read: an out that overlaps the block table could turn
    block ids into garbage mid-call."""
    query, kv = _wrapper_inputs()
    args = list(attention_args(query, kv, 4))
    if target == "query":
        out = args[0] = query.clone()
    elif target == "key_cache":
        out = kv.key_cache.view(-1)[: query.numel()].view(query.shape)
    else:
        index = {"block_tables": 5, "seq_lens": 6}[target]
        out = torch.zeros(query.shape)
        args[index] = out.view(-1)[: args[index].numel()].view(torch.int32).view(args[index].shape)
        args[index].copy_(attention_args(query, kv, 4)[index])
    with pytest.raises(RuntimeError, match=f"out must not share memory with {target}"):
        ops.paged_attention_v1(out, *args)
    with pytest.raises(RuntimeError, match=f"out must not share memory with {target}"):
        ops.paged_attention_v2(out, *v2_scratch(query, 40), *args)


def test_v2_scratch_sharing_memory_is_rejected():
    query, kv = _wrapper_inputs()
    args = attention_args(query, kv, 4)
    exp_sums, max_logits, tmp_out = v2_scratch(query, 40)
    out = torch.empty_like(query)
    with pytest.raises(RuntimeError, match="max_logits must not share memory with exp_sums"):
        ops.paged_attention_v2(out, exp_sums, exp_sums, tmp_out, *args)
    with pytest.raises(RuntimeError, match="tmp_out must not share memory with out"):
        ops.paged_attention_v2(out, exp_sums, max_logits, out.view(tmp_out.shape), *args)
