"""The CUDA varlen attention kernels, run on the CPU by the host emulation of their primitives,
against reference.paged_attention_varlen.

tests/cuda_emulator.py runs the op as the CUDA glue launches it: the same kernel variant (tensor
cores with one or four warps of rows for fp16/bf16, CUDA cores for fp32), the schedule kernel of
queries longer than a CTA, the split plan of an H200 and the reduce kernel; every global access
is checked against the tensors' memory. The grid covers query lengths 0, 1, 2-16 and up to a few
hundred mixed in one batch, every head size (and values of a head size of their own), block
size, query dtype, fp8 format and several GQA groups, with sliding windows, attention chunks,
ALiBi, soft-cap and sinks, on caches whose slots outside the stored tokens are NaN. Rows of
`out` that belong to no sequence must keep what they held.
"""

from __future__ import annotations

import math

import cuda_emulator as emu
import pytest
import torch
from conftest import make_paged_kv, make_paged_kv_of_value_size

from paged_attention.ops import reference

HEAD_SIZES = [32, 64, 80, 96, 112, 120, 128, 192, 256]
BLOCK_SIZES = [8, 16, 32]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TOLERANCES = {
    torch.float32: dict(atol=5e-5, rtol=1e-4),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2),
}
UNTOUCHED = 7.0  # what out holds before the call
# (new query rows, cached context) per sequence: decode, a chunk after a context, a whole
# prompt, a sequence without new rows, a few rows (speculative decoding), a long chunk.
MIXED = [(1, 60), (37, 20), (70, 0), (0, 9), (4, 33), (130, 150)]


def run_case(
    seqs: list[tuple[int, int]],
    *,
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
    sinks: bool = False,
    attention_chunk_size: int = 0,
    release_before_chunk: bool = False,
    query_scale: float = 1.0,
    spare_rows: int = 3,
    fused_qkv: bool = False,
    target: str = emu.DEFAULT_TARGET,
    num_sms: int | None = None,
    seed: int = 0,
) -> emu.Report:
    """The emulated kernels and reference.py on one batch of (q_len, context) sequences (values
    of head size ``v_head_size``, by default ``head_size``); asserts they agree and that the
    spare rows are untouched. Returns the kernels' report."""
    query_lens = [q for q, _ in seqs]
    seq_lens = [q + c for q, c in seqs]
    v_head_size = v_head_size or head_size
    kv = make_paged_kv_of_value_size(len(seqs), seq_lens, num_kv_heads, head_size, v_head_size,
                                     block_size, dtype, kv_cache_dtype, seed=seed)  # fmt: skip
    if release_before_chunk:
        # Blocks wholly before the first new row's chunk may be released: an id that is out of
        # range there makes any read of it an error under the emulation.
        for s, (_, context) in enumerate(seqs):
            first = reference.first_attended_position(context, sliding_window, attention_chunk_size)
            kv.block_tables[s, : first // block_size] = 10**6
    rows = sum(query_lens) + spare_rows
    gen = torch.Generator().manual_seed(seed + 1)
    if fused_qkv:  # the query heads of a fused [tokens, heads + 2 kv_heads, head_size] QKV
        qkv = torch.randn(rows, num_heads + 2 * num_kv_heads, head_size, generator=gen)
        query = (qkv * query_scale).to(dtype)[:, :num_heads]
    else:
        query = (torch.randn(rows, num_heads, head_size, generator=gen) * query_scale).to(dtype)
    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    args = (
        query,
        kv.key_cache,
        kv.value_cache,
        num_kv_heads,
        head_size**-0.5,
        kv.block_tables,
        kv.seq_lens,
        starts,
        max(query_lens, default=0),
        kv.max_seq_len,
        torch.linspace(0.02, 0.4, num_heads) if alibi else None,
        kv_cache_dtype,
        kv.k_scale,
        kv.v_scale,
        sliding_window,
        logits_soft_cap,
        torch.linspace(-2.0, 3.0, num_heads) if sinks else None,
        attention_chunk_size,
    )
    out = torch.full((rows, num_heads, v_head_size), UNTOUCHED, dtype=dtype)
    report = emu.paged_attention_varlen(out, *args, target=target, num_sms=num_sms)
    expected = torch.full_like(out, UNTOUCHED)
    reference.paged_attention_varlen(expected, *args)
    torch.testing.assert_close(out, expected, **TOLERANCES[dtype])
    assert (out[sum(query_lens) :] == UNTOUCHED).all()
    if dtype != torch.float32 and report.ldmatrix > 0:
        assert report.ldmatrix_max_ways == 1, "an ldmatrix read had a bank conflict"
    return report


# --------------------------------------------------------------------------------------------
# Query lengths and row tilings


@pytest.mark.parametrize("dtype", DTYPES)
def test_mixed_batch(dtype):
    report = run_case(MIXED, dtype=dtype)
    if dtype != torch.float32:  # 130 rows x a group of 4: 64-row CTAs, listed by the scheduler
        assert report.row_warps == 4 and report.rows_per_cta == 64 and report.scheduled


@pytest.mark.parametrize("q_len", [1, 2, 3, 4, 7, 16, 17, 33, 64, 65, 250])
def test_query_lengths(q_len):
    run_case([(q_len, 45), (q_len, 0)], dtype=torch.bfloat16, seed=q_len)


def test_short_queries_take_one_cta_per_sequence_without_a_schedule():
    # 4 rows x a group of 4 heads fill one 16-row MMA tile: the decode tiling, CTA x = sequence x.
    report = run_case([(4, 300), (3, 5), (1, 17)], dtype=torch.float16)
    assert (report.row_warps, report.rows_per_cta, report.tokens_per_cta) == (1, 16, 4)
    assert not report.scheduled and report.work_items == 3


def test_long_queries_are_chunked_across_ctas():
    # 64-row CTAs of 16 tokens x 4 heads: 200 rows take 13 CTAs per KV head, 1 row 1.
    report = run_case([(200, 10), (1, 30)], dtype=torch.bfloat16)
    assert report.scheduled and report.tokens_per_cta == 16
    assert report.work_items >= 13 + 1


def test_the_schedule_spans_several_rounds_of_sequences():
    # The schedule kernel scans 256 sequences per round: 300 short ones around a long one.
    seqs = [(i % 3, 5) for i in range(300)]
    seqs[150] = (40, 10)
    report = run_case(seqs, num_heads=2, num_kv_heads=1, head_size=64, spare_rows=1)
    assert report.scheduled and report.tokens_per_cta == 32


def test_no_rows_at_all():
    report = run_case([(0, 5), (0, 0)])
    assert report.ctas == 0
    run_case([], spare_rows=2)


def test_one_row_per_sequence_equals_v1():
    kv = make_paged_kv(4, [1, 40, 300, 2], 2, 64, 16, torch.bfloat16)
    query = torch.randn(4, 8, 64).to(torch.bfloat16)
    common = (kv.key_cache, kv.value_cache, 2, 0.125, kv.block_tables, kv.seq_lens)
    tail = ("auto", kv.k_scale, kv.v_scale, 10, 0.0)
    varlen = torch.empty_like(query)
    starts = torch.arange(5, dtype=torch.int32)
    emu.paged_attention_varlen(varlen, query, *common, starts, 1, kv.max_seq_len, None, *tail)
    decode = torch.empty_like(query)
    emu.paged_attention_v1(decode, query, *common, 16, kv.max_seq_len, None, *tail)
    assert torch.equal(varlen, decode)


# --------------------------------------------------------------------------------------------
# Head sizes, block sizes, dtypes, fp8, GQA


@pytest.mark.parametrize("head_size", HEAD_SIZES)
def test_head_sizes(head_size):
    dtype = DTYPES[HEAD_SIZES.index(head_size) % 3]
    run_case([(1, 50), (9, 30), (70, 10)], head_size=head_size, dtype=dtype, seed=head_size)


# Values of a head size of their own (multi-head latent attention in its expanded form: keys
# 192 and values 128 in DeepSeek-V3, 128 and 64 in a tiny DeepSeek-V2-Lite like model).
@pytest.mark.parametrize("head_size,v_head_size", [(192, 128), (128, 64), (64, 128)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_values_of_their_own_head_size(head_size, v_head_size, dtype):
    # Decode, a chunk after its context and a long prompt (64-row CTAs, scheduled) in one batch.
    run_case([(1, 50), (9, 30), (70, 10)], head_size=head_size, v_head_size=v_head_size,
             dtype=dtype, seed=head_size + v_head_size)  # fmt: skip


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_values_of_their_own_head_size_in_fp8_caches(kv_cache_dtype, dtype):
    run_case([(3, 60), (45, 20)], head_size=192, v_head_size=128, dtype=dtype,
             kv_cache_dtype=kv_cache_dtype)  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_values_of_their_own_head_size_with_splits_and_every_option(dtype):
    # MHA as DeepSeek's expanded MLA runs it; a long context split over CTAs (partials of 128
    # floats and the reduce); a window, a soft cap and sinks.
    report = run_case([(2, 1500), (20, 40)], num_heads=4, num_kv_heads=4, head_size=192,
                      v_head_size=128, dtype=dtype, sliding_window=700, logits_soft_cap=20.0,
                      sinks=True, query_scale=4.0)  # fmt: skip
    assert report.splits > 1


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_block_sizes(block_size, dtype):
    run_case([(5, 27), (40, 41)], block_size=block_size, dtype=dtype, seed=block_size)


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_fp8_caches(kv_cache_dtype, dtype):
    block_size = {torch.float32: 8, torch.float16: 16, torch.bfloat16: 32}[dtype]
    run_case([(3, 60), (45, 20)], block_size=block_size, dtype=dtype, kv_cache_dtype=kv_cache_dtype)


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("head_size", [64, 256])
def test_fp8_head_sizes(kv_cache_dtype, head_size):
    # Head size 64 leaves some of the CTA's 128 copiers without an fp8 key chunk or value row.
    run_case([(2, 15), (30, 0)], head_size=head_size, dtype=torch.bfloat16,
             kv_cache_dtype=kv_cache_dtype)  # fmt: skip


def test_bf16_queries_of_any_magnitude_fit_fp16_for_fp8_caches():
    for scale in (1e-6, 3e4):
        run_case([(20, 20)], dtype=torch.bfloat16, kv_cache_dtype="fp8", query_scale=scale)


@pytest.mark.parametrize("group", [1, 2, 3, 5, 8, 12, 16, 24, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gqa_groups(group, dtype):
    num_kv_heads = 2 if group <= 8 else 1
    report = run_case([(1, 20), (6, 9), (23, 4)], num_heads=group * num_kv_heads,
                      num_kv_heads=num_kv_heads, dtype=dtype, seed=group)  # fmt: skip
    rows = report.rows_per_cta
    assert report.heads_per_cta == math.ceil(group / math.ceil(group / rows))
    assert report.tokens_per_cta == rows // report.heads_per_cta


# --------------------------------------------------------------------------------------------
# Masks and logit options


@pytest.mark.parametrize("window", [1, 7, 16, 100])
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_sliding_window(window, block_size):
    dtype = torch.float32 if block_size == 8 else torch.float16
    run_case([(1, 150), (20, 130), (90, 0)], block_size=block_size, dtype=dtype,
             sliding_window=window, seed=window)  # fmt: skip


@pytest.mark.parametrize("chunk", [1, 7, 16, 100, 5000])
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_attention_chunks(chunk, block_size):
    """Chunks cutting blocks and 16-token tiles, at their edges and longer than the context,
    for rows of one sequence spanning several chunks; the blocks before the first row's chunk
    are released."""
    dtype = torch.float32 if block_size == 8 else torch.bfloat16
    run_case([(1, 150), (20, 130), (90, 0), (130, 150)], block_size=block_size, dtype=dtype,
             attention_chunk_size=chunk, release_before_chunk=True, seed=chunk)  # fmt: skip


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_chunks_with_a_window(dtype):
    run_case(MIXED, dtype=dtype, sliding_window=30, attention_chunk_size=48,
             release_before_chunk=True)  # fmt: skip


@pytest.mark.parametrize("dtype", DTYPES)
def test_alibi(dtype):
    run_case([(1, 90), (30, 50)], dtype=dtype, alibi=True)


@pytest.mark.parametrize("dtype", DTYPES)
def test_soft_cap(dtype):
    run_case([(2, 70), (40, 9)], dtype=dtype, logits_soft_cap=5.0, query_scale=8.0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_sinks(dtype):
    run_case([(1, 40), (3, 3), (50, 30)], dtype=dtype, sinks=True)


def test_a_large_sink_takes_the_weight_from_every_token():
    kv = make_paged_kv(1, [34], 4, 64, 16, torch.float16)
    query = torch.randn(4, 4, 64).to(torch.float16)
    starts = torch.tensor([0, 4], dtype=torch.int32)
    args = (query, kv.key_cache, kv.value_cache, 4, 0.125, kv.block_tables, kv.seq_lens, starts,
            4, 34, None, "auto", kv.k_scale, kv.v_scale, 0, 0.0)  # fmt: skip
    plain, sunk = torch.empty_like(query), torch.empty_like(query)
    emu.paged_attention_varlen(plain, *args, None)
    emu.paged_attention_varlen(sunk, *args, torch.full((4,), 50.0))
    assert plain.abs().max() > 0.1 and sunk.abs().max() < 1e-6


@pytest.mark.parametrize("dtype", DTYPES)
def test_all_options_together(dtype):
    run_case(MIXED, num_heads=12, num_kv_heads=2, head_size=96, block_size=32, dtype=dtype,
             kv_cache_dtype="fp8_e5m2", alibi=True, sliding_window=40, logits_soft_cap=20.0,
             sinks=True)  # fmt: skip
    run_case(MIXED, num_heads=12, num_kv_heads=2, head_size=96, block_size=32, dtype=dtype,
             kv_cache_dtype="fp8_e4m3", alibi=True, sliding_window=40, logits_soft_cap=20.0,
             sinks=True, attention_chunk_size=24, release_before_chunk=True)  # fmt: skip


@pytest.mark.parametrize("dtype", DTYPES)
def test_strided_query_from_fused_qkv(dtype):
    run_case([(1, 30), (25, 5)], head_size=64, dtype=dtype, fused_qkv=True)


# --------------------------------------------------------------------------------------------
# Split-KV


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("q_len", [4, 40])
def test_small_batches_with_long_contexts_split_the_kv(dtype, q_len):
    report = run_case([(q_len, 2500)], dtype=dtype, sinks=True, sliding_window=1800, seed=q_len)
    assert report.splits > 1
    # On a one-SM GPU the same launch has fewer CTAs to fill.
    fewer = run_case([(q_len, 2500)], dtype=dtype, sinks=True, num_sms=1, seed=q_len)
    assert fewer.splits < report.splits
    # Splits wholly before the rows' chunks attend nothing.
    chunked = run_case([(q_len, 2500)], dtype=dtype, sinks=True, attention_chunk_size=700,
                       release_before_chunk=True, seed=q_len)  # fmt: skip
    assert chunked.splits > 1


# --------------------------------------------------------------------------------------------
# Inputs that break the contract never leave the tensors (every access is checked)


def test_lying_lengths_stay_inside_the_tensors():
    kv = make_paged_kv(3, [20, 50, 8], 2, 64, 16, torch.float16)
    query = torch.randn(12, 8, 64).to(torch.float16)
    common = (kv.key_cache, kv.value_cache, 2, 0.125, kv.block_tables)
    tail = (None, "auto", kv.k_scale, kv.v_scale, 0, 0.0, None)
    lying_lens = torch.tensor([20, 10_000_000, -5], dtype=torch.int32)
    unwritten_rows = 0
    for starts, max_query_len in [
        ([0, 5, 40, 99], 64),  # rows past num_tokens
        ([0, 8, 4, 12], 3),  # decreasing, and q_len past max_query_len
        ([-7, 5, 9, 12], 4),  # a negative start
    ]:
        out = torch.full_like(query, UNTOUCHED)
        qsl = torch.tensor(starts, dtype=torch.int32)
        emu.paged_attention_varlen(out, query, *common, lying_lens, qsl, max_query_len, 50, *tail)
        # The kernels clamp each sequence's rows to [0, num_tokens] and to max_query_len rows
        # (csrc/cuda/attention/plan.h): those rows get finite results, every other row keeps
        # what it held.
        written = torch.zeros(query.shape[0], dtype=torch.bool)
        for s in range(len(starts) - 1):
            start = min(max(starts[s], 0), query.shape[0])
            end = min(max(starts[s + 1], start), query.shape[0])
            written[start : start + min(end - start, max_query_len)] = True
        assert (out[~written] == UNTOUCHED).all(), starts
        assert torch.isfinite(out[written]).all(), starts
        unwritten_rows += int((~written).sum())
    assert unwritten_rows > 0  # some rows belonged to no sequence


# --------------------------------------------------------------------------------------------
# Non-finite values at positions a row does not attend


def _value_of(kv, seq: int, position: int, kv_head: int):
    """The value vector of one cached position (value_cache: [blocks, kv heads, dims, block])."""
    block = int(kv.block_tables[seq, position // kv.block_size])
    return kv.value_cache[block, kv_head, :, position % kv.block_size]


@pytest.mark.parametrize(
    "dtype,q_len,nan_token,spoiled",
    [
        # 4 rows: one 16-row tile (fp16/bf16) or one 4-row CTA (fp32); tokens 0 and 1 do not
        # attend token 2's position, tokens 2 and 3 do.
        (torch.float16, 4, 2, [0, 1]),
        (torch.bfloat16, 4, 2, [0, 1]),
        (torch.float32, 4, 2, [0, 1]),
        # 40 rows: 64-row CTAs, warp w owning tokens 16 w .. 16 w + 15. Only warp 1 shares a tile
        # of rows with token 20: tokens 16-19 are spoiled, warp 0's tokens are not.
        (torch.float16, 40, 20, [16, 17, 18, 19]),
    ],
)
def test_a_non_finite_value_spoils_the_rows_of_its_tile_that_do_not_attend_it(
    dtype, q_len, nan_token, spoiled
):
    """A row gives probability P = 0 to a cached position it does not attend (a later token of
    its own query, under the causal mask), but the rows of one MMA tile (16 rows of a warp; the
    4 rows of a CUDA-core CTA) share one P V product over the positions any of them attends, and
    0 x NaN is NaN, inside an MMA as in an FMA. So a NaN value at a position some row of the tile
    attends makes the tile's other rows NaN too, where the exact result (the same cache with a
    finite value there) is finite. Values at positions no row of the tile attends (past seq_len,
    before a window) are zeroed before the product and stay harmless (every case here runs on a
    cache whose unused slots are NaN)."""
    context = 20
    kv = make_paged_kv(1, [context + q_len], 2, 64, 16, dtype)
    query = torch.randn(q_len, 2, 64).to(dtype)
    starts = torch.tensor([0, q_len], dtype=torch.int32)
    args = (query, kv.key_cache, kv.value_cache, 2, 0.125, kv.block_tables, kv.seq_lens, starts,
            q_len, context + q_len, None, "auto", kv.k_scale, kv.v_scale, 0, 0.0, None)  # fmt: skip
    exact = torch.empty_like(query)
    reference.paged_attention_varlen(exact, *args)
    _value_of(kv, 0, context + nan_token, 0).fill_(math.nan)
    out = torch.empty_like(query)
    emu.paged_attention_varlen(out, *args)
    nan_rows = torch.isnan(out[:, 0]).any(dim=-1)
    assert nan_rows.nonzero().flatten().tolist() == spoiled + list(range(nan_token, q_len))
    finite = ~nan_rows
    torch.testing.assert_close(out[finite, 0], exact[finite, 0], **TOLERANCES[dtype])
    torch.testing.assert_close(out[:, 1], exact[:, 1], **TOLERANCES[dtype])  # other KV head


# --------------------------------------------------------------------------------------------
# Every variant within each target GPU's limits


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("target", list(emu.targets()))
def test_every_variant_runs_within_each_targets_limits(target, dtype):
    # Each compiled variant (cache format, head bucket, row tiling) as the plan for `target`
    # picks its ring: the emulator gives the kernel only the target's shared memory per CTA, and
    # the kernel must agree with the reference there.
    limit = emu.targets()[target]["shared_per_block_optin"]
    for cache in ("auto", "fp8_e4m3"):
        for head_size in (64, 96, 256):
            for q_len in (2, 20) if dtype != torch.float32 else (2,):
                report = run_case([(q_len, 40), (1, 17)], num_heads=8, num_kv_heads=2,
                                  head_size=head_size, dtype=dtype, kv_cache_dtype=cache,
                                  target=target, seed=head_size + q_len)  # fmt: skip
                bucket = 64 if head_size <= 64 else 128 if head_size <= 128 else 256
                plan = emu.plan_variant(dtype, cache, bucket, report.row_warps, target)
                assert report.stages == plan.stages and report.shared_bytes <= limit
