"""CPU paged_attention_varlen against reference.py.

The grid covers every head size, block size, query dtype, fp8 format, GQA ratio and feature at
least once, with query lengths 0, 1, 2-16, 17-200 and whole prompts, mixed in one batch. Caches
are NaN-filled outside the stored tokens and their block tables are scattered with unused
trailing entries (tests/conftest.py), so any read of a slot that holds no token shows up as NaN;
rows of out that belong to no sequence must keep what they held.
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

import paged_attention.ops.bindings  # registers torch.ops.paged_attention
from paged_attention.ops import reference

ops = torch.ops.paged_attention

TOLERANCES = {
    torch.float32: dict(rtol=1e-5, atol=2e-6),
    torch.float16: dict(rtol=2**-10, atol=2**-12),
    torch.bfloat16: dict(rtol=2**-7, atol=2**-9),
}
HEAD_SIZES = [32, 64, 80, 96, 112, 120, 128, 192, 256]
UNTOUCHED = 7.0  # what out holds before the call


def make_case(
    seq_lens,
    query_lens,
    num_heads,
    num_kv_heads,
    head_size,
    block_size=16,
    dtype=torch.float32,
    kv_cache_dtype="auto",
    *,
    fused_qkv=False,
    spare_rows=2,
    seed=0,
    v_head_size=None,
):
    """A paged cache holding the sequences and a query of their new rows (the last q_len tokens
    of each), plus `spare_rows` rows that belong to no sequence; values of `v_head_size` dims
    (multi-head latent attention) where given."""
    if v_head_size is None:
        kv = make_paged_kv(len(seq_lens), seq_lens, num_kv_heads, head_size, block_size, dtype,
                           kv_cache_dtype, seed=seed)  # fmt: skip
    else:
        kv = make_paged_kv_of_value_size(len(seq_lens), seq_lens, num_kv_heads, head_size,
                                         v_head_size, block_size, dtype, kv_cache_dtype,
                                         seed=seed)  # fmt: skip
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    rows = starts[-1] + spare_rows
    generator = torch.Generator().manual_seed(seed + 1)
    if fused_qkv:  # a slice of a fused QKV projection: strided in the token and head dims
        qkv = torch.randn(rows, 3 * num_heads, head_size, generator=generator).to(dtype)
        query = qkv[:, num_heads : 2 * num_heads]
    else:
        query = torch.randn(rows, num_heads, head_size, generator=generator).to(dtype)
    kv.query = query
    kv.query_start_loc = torch.tensor(starts, dtype=torch.int32)
    kv.max_query_len = max(query_lens, default=0)
    kv.num_heads = num_heads
    return kv


def features(kv, *, alibi=False, sinks=False, sliding_window=0, soft_cap=0.0, scale=None, chunk=0):
    h = kv.num_heads
    return dict(
        scale=kv.head_size**-0.5 if scale is None else scale,
        alibi_slopes=torch.tensor([2.0 ** (-8 * (i + 1) / h) for i in range(h)]) if alibi else None,
        sinks=torch.linspace(-2.0, 3.0, h) if sinks else None,
        sliding_window=sliding_window,
        logits_soft_cap=soft_cap,
        attention_chunk_size=chunk,
    )  # fmt: skip


def op_args(kv, options):
    return (
        kv.query, kv.key_cache, kv.value_cache, kv.num_kv_heads, options["scale"],
        kv.block_tables, kv.seq_lens, kv.query_start_loc, kv.max_query_len, kv.max_seq_len,
        options["alibi_slopes"], kv.kv_cache_dtype, kv.k_scale, kv.v_scale,
        options["sliding_window"], options["logits_soft_cap"], options["sinks"],
        options["attention_chunk_size"],
    )  # fmt: skip


def out_shape(kv):
    """Query's rows and heads, the values' head size (the keys' but for latent attention)."""
    return (*kv.query.shape[:2], kv.value_cache.shape[2])


def run_op(kv, options):
    out = torch.full(out_shape(kv), UNTOUCHED, dtype=kv.query.dtype)
    ops.paged_attention_varlen(out, *op_args(kv, options))
    return out


def run_reference(kv, options):
    out = torch.full(out_shape(kv), UNTOUCHED, dtype=kv.query.dtype)
    reference.paged_attention_varlen(out, *op_args(kv, options))
    return out


def check(kv, tolerance=None, **feature_flags):
    options = features(kv, **feature_flags)
    expected = run_reference(kv, options)
    assert not expected.isnan().any()
    out = run_op(kv, options)
    torch.testing.assert_close(out, expected, **(tolerance or TOLERANCES[kv.query.dtype]))
    rows = int(kv.query_start_loc[-1])
    assert (out[rows:] == UNTOUCHED).all()
    return out


# --------------------------------------------------------------------------------------------
# Coverage grid

MIXED = ([1, 70, 50, 9, 300], [1, 5, 50, 0, 40])  # decode, short, whole prompt, none, chunk


@pytest.mark.parametrize("head_size", HEAD_SIZES)
def test_head_sizes(head_size):
    check(make_case(*MIXED, 8, 2, head_size, seed=head_size))


@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_block_sizes_and_dtypes(block_size, dtype):
    check(make_case(*MIXED, 8, 2, 64, block_size, dtype, seed=block_size))


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads"), [(4, 4), (8, 2), (16, 2), (8, 1), (6, 1), (12, 4)]
)
def test_gqa_ratios(num_heads, num_kv_heads):
    check(make_case(*MIXED, num_heads, num_kv_heads, 128, 16, torch.bfloat16))


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize(
    ("dtype", "block_size"), [(torch.bfloat16, 16), (torch.float16, 8), (torch.float32, 32)]
)
def test_fp8_cache(kv_cache_dtype, dtype, block_size):
    kv = make_case(*MIXED, 8, 2, 128, block_size, dtype, kv_cache_dtype)
    assert kv.key_cache.dtype == torch.uint8
    check(kv)


@pytest.mark.parametrize(
    "flags",
    [
        dict(alibi=True),
        dict(sinks=True),
        dict(sliding_window=1),
        dict(sliding_window=37),
        dict(sliding_window=600),
        dict(soft_cap=5.0),
        dict(scale=0.5),
        dict(soft_cap=30.0, alibi=True, sliding_window=20, sinks=True),
        dict(chunk=1),
        dict(chunk=5),  # chunks cutting blocks
        dict(chunk=16),  # at block edges
        dict(chunk=100),
        dict(chunk=1000),  # longer than every context
        dict(chunk=50, sliding_window=37),  # the window inside the chunk
        dict(chunk=24, sliding_window=40, soft_cap=30.0, alibi=True, sinks=True),
    ],
    ids=str,
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_features(flags, dtype):
    tolerance = None
    if flags.get("scale") == 0.5 and dtype == torch.float32:
        # Logits up to ~15 carry float32 rounding of ~1e-6 into exp(): outputs move by a few ulps
        tolerance = dict(rtol=1e-5, atol=1e-5)
    check(make_case(*MIXED, 8, 2, 64, 16, dtype, seed=3), tolerance, **flags)


@pytest.mark.parametrize(
    "query_lens",
    [[1, 1, 1, 1], [2, 3, 8, 16], [17, 64, 100, 200], [0, 0, 5, 0], [40, 90, 200, 300]],
    ids=["decode", "2-16", "17-200", "some empty", "whole prompts"],
)
def test_query_lengths(query_lens):
    seq_lens = [max(q, 1) + extra for q, extra in zip(query_lens, [0, 33, 100, 0])]
    if query_lens[-1] == 300:
        seq_lens = query_lens  # every row of every sequence is new: whole prompts
    check(make_case(seq_lens, query_lens, 8, 2, 64, 16, torch.float32, seed=sum(query_lens)))


@pytest.mark.parametrize("chunk", [7, 64, 100, 256, 300])
@pytest.mark.parametrize("block_size", [8, 32])
def test_chunked_prompts(chunk, block_size):
    """Whole prompts and prompt chunks whose rows span several chunks and several of the tiled
    kernel's key tiles, and short queries across a chunk boundary (the decode kernel's rows)."""
    seq_lens, query_lens = [600, 300, 130, 70], [600, 170, 3, 8]
    kv = make_case(seq_lens, query_lens, 8, 2, 64, block_size, seed=chunk)
    check(kv, chunk=chunk, alibi=True)
    check(kv, chunk=chunk, sliding_window=90)


VALUE_HEAD_SIZES = [(192, 128), (128, 192), (64, 128), (128, 64), (192, 64), (64, 192)]


@pytest.mark.parametrize("head_size, v_head_size", VALUE_HEAD_SIZES, ids=str)
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_values_of_their_own_head_size(head_size, v_head_size, block_size, dtype):
    """Multi-head latent attention's keys and values of different head sizes (DeepSeek-V3: 192
    and 128), GQA, decode rows and prompts of several key tiles in one batch."""
    kv = make_case([1, 70, 300, 9, 600], [1, 5, 300, 0, 40], 8, 2, head_size, block_size, dtype,
                   seed=head_size, v_head_size=v_head_size)  # fmt: skip
    assert check(kv).shape[2] == v_head_size


@pytest.mark.parametrize("variant", ["none", "reference", "avx512bf16", "amx"])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
def test_values_of_their_own_head_size_with_features(variant, kv_cache_dtype, monkeypatch):
    """Every bf16 product variant of the tiled kernel (bf16 cache), fp8 caches, sinks, windows,
    chunks, soft-cap and ALiBi, with MHA as DeepSeek's expanded heads are."""
    if variant != "none" and variant not in ops._cpu_bf16_matmuls():
        pytest.skip(f"this CPU does not run the {variant} products")
    monkeypatch.setenv(BF16_MATMUL, variant)
    kv = make_case([300, 70, 9], [300, 40, 9], 4, 4, 192, 16, torch.bfloat16, kv_cache_dtype,
                   v_head_size=128)  # fmt: skip
    check(kv, sinks=True, sliding_window=200, soft_cap=30.0, scale=0.1)
    check(kv, alibi=True, chunk=64)


def test_a_query_group_larger_than_a_tile():
    """264 query heads on one KV head: one query position's rows fill more than the tiled
    kernel's 256-row unit, so a unit takes a single position."""
    check(make_case([40, 9], [3, 9], 264, 1, 32, seed=5))


BF16_MATMUL = "PAGED_ATTENTION_CPU_BF16_MATMUL"


@pytest.mark.parametrize("variant", ["none", "reference", "avx512bf16", "amx"])
@pytest.mark.parametrize(
    ("head_size", "flags"),
    [
        (80, dict(alibi=True, sinks=True)),
        (120, dict(soft_cap=30.0, sliding_window=200)),
        (64, dict(chunk=96)),
    ],
    ids=["80-alibi-sinks", "120-softcap-window", "64-chunks"],
)
def test_bf16_products(variant, head_size, flags, monkeypatch):
    """Every bf16 product variant of the tiled kernel, forced (csrc/cpu/variants.h): a whole
    prompt of two key tiles (the second partial), a chunk, and a short run, with head sizes that
    pad the products' depth (80) and rows (120)."""
    if variant != "none" and variant not in ops._cpu_bf16_matmuls():
        pytest.skip(f"this CPU does not run the {variant} products")
    monkeypatch.setenv(BF16_MATMUL, variant)
    kv = make_case([300, 70, 9], [300, 40, 9], 8, 2, head_size, 16, torch.bfloat16, seed=head_size)
    check(kv, **flags)


def test_a_bad_bf16_product_switch_raises_and_leaves_out(monkeypatch):
    kv = make_case([40, 5], [40, 1], 8, 2, 64, 16, torch.bfloat16)
    monkeypatch.setenv(BF16_MATMUL, "fastest")
    out = torch.full(kv.query.shape, UNTOUCHED, dtype=kv.query.dtype)
    with pytest.raises(RuntimeError, match=f"{BF16_MATMUL}=fastest is not a bf16 product variant"):
        ops.paged_attention_varlen(out, *op_args(kv, features(kv)))
    assert (out == UNTOUCHED).all()
    # float32 operands never use the bf16 products, so the switch is not read
    kv = make_case([40, 5], [40, 1], 8, 2, 64, 16, torch.float32)
    check(kv)


@pytest.mark.parametrize("chunk", [0, 48])
def test_one_row_per_sequence_equals_v1(chunk):
    kv = make_case([1, 37, 300, 513], [1, 1, 1, 1], 8, 2, 64, spare_rows=0)
    options = features(kv, alibi=True, sliding_window=100, soft_cap=20.0, chunk=chunk)
    v1 = torch.empty_like(kv.query)
    ops.paged_attention_v1(
        v1, kv.query, kv.key_cache, kv.value_cache, 2, options["scale"], kv.block_tables,
        kv.seq_lens, 16, kv.max_seq_len, options["alibi_slopes"], "auto", kv.k_scale, kv.v_scale,
        100, 20.0, chunk,
    )  # fmt: skip
    assert torch.equal(run_op(kv, options), v1)


def test_blocks_before_the_first_rows_chunk_are_never_read():
    """The block manager may release the blocks before the chunk of a sequence's first new row:
    their table entries are not checked or read, and the blocks may hold anything."""
    kv = make_case([300, 90], [100, 4], 4, 2, 64, 16)  # rows at 200 .. 299 and 86 .. 89
    expected = run_reference(kv, features(kv, chunk=64))  # rows attend from 192 and 64
    released = kv.block_tables.clone()
    released[0, :12] = -1
    released[1, :4] = 10**6
    for seq, blocks in ((0, 12), (1, 4)):
        for cache in (kv.key_cache, kv.value_cache):
            cache[kv.block_tables[seq, :blocks].long()] = math.nan
    kv.block_tables = released
    torch.testing.assert_close(run_op(kv, features(kv, chunk=64)), expected)


def test_sinks_take_weight_from_every_token():
    """A sink far above every logit leaves almost no weight for the values: out -> 0."""
    kv = make_case([30], [4], 4, 4, 64, spare_rows=0)
    options = features(kv)
    plain = run_op(kv, options)
    options["sinks"] = torch.full((4,), 50.0)
    sunk = run_op(kv, options)
    assert plain.abs().max() > 0.1 and sunk.abs().max() < 1e-6
    torch.testing.assert_close(sunk, run_reference(kv, options), rtol=1e-5, atol=1e-12)


def test_strided_query_from_fused_qkv():
    kv = make_case(*MIXED, 8, 2, 128, 16, torch.bfloat16, fused_qkv=True)
    assert not kv.query.is_contiguous()
    check(kv)


def test_nan_slots_never_reach_the_output():
    """Partial last blocks and windows starting mid-block put NaN-filled slots in the tiles the
    kernel reads, for short and long query rows."""
    kv = make_case([7, 45, 520, 100], [3, 45, 20, 100], 8, 2, 64, 32)
    assert kv.value_cache.isnan().any()
    for window, chunk in ((0, 0), (11, 0), (0, 13), (11, 20)):
        out = run_op(kv, features(kv, sliding_window=window, chunk=chunk))
        assert not out.isnan().any()


def test_no_sequences_and_no_rows():
    kv = make_case([5, 9], [0, 0], 4, 2, 64)
    assert (run_op(kv, features(kv)) == UNTOUCHED).all()
    empty = make_case([], [], 4, 2, 64, spare_rows=3)
    assert (run_op(empty, features(empty)) == UNTOUCHED).all()


def test_thread_count_does_not_change_the_result():
    kv = make_case([100, 2000, 1, 600, 900], [3, 200, 1, 17, 0], 8, 2, 64)
    options = features(kv)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = run_op(kv, options)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(run_op(kv, options), single)


@pytest.mark.slow
def test_long_prompt():
    kv = make_case([3000, 2500], [3000, 700], 8, 2, 64, 16, torch.bfloat16, seed=9)
    check(kv, sliding_window=1000)


# --------------------------------------------------------------------------------------------
# Every instruction-set variant of the kernels


def test_narrower_instruction_sets_agree():
    """Each variant forced through ATEN_CPU_CAPABILITY, in a fresh interpreter, against the
    reference: cache dtypes, block sizes, short and long query rows, every feature."""
    script = textwrap.dedent(
        """
        import sys
        import torch
        sys.path.insert(0, "tests")
        from test_varlen_cpu import make_case, check, MIXED
        for dtype, cache, head_size, block_size in (
            (torch.float32, "auto", 80, 8), (torch.bfloat16, "auto", 128, 16),
            (torch.float16, "fp8_e5m2", 64, 32), (torch.bfloat16, "fp8_e4m3", 128, 16),
        ):
            kv = make_case(*MIXED, 6, 2, head_size, block_size, dtype, cache)
            check(kv, alibi=True, soft_cap=20.0, sinks=True)
            check(kv, sliding_window=30)
            check(kv, chunk=24, sliding_window=30, alibi=True, sinks=True)
            check(make_case([600, 130], [600, 8], 6, 2, head_size, block_size, dtype, cache),
                  chunk=100)
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


# --------------------------------------------------------------------------------------------
# The Python wrapper and tracing


def test_wrapper_defaults_and_zeroed_spare_rows():
    kv = make_case(*MIXED, 8, 2, 64)
    out = paged_attention.paged_attention_varlen(
        kv.query, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens, kv.query_start_loc
    )
    expected = run_reference(kv, features(kv))
    rows = int(kv.query_start_loc[-1])
    torch.testing.assert_close(out[:rows], expected[:rows], **TOLERANCES[torch.float32])
    assert (out[rows:] == 0).all()


def test_wrapper_passes_the_chunk():
    kv = make_case(*MIXED, 8, 2, 64)
    out = paged_attention.paged_attention_varlen(
        kv.query, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens, kv.query_start_loc,
        attention_chunk_size=16, sliding_window=30,
    )  # fmt: skip
    expected = run_reference(kv, features(kv, chunk=16, sliding_window=30))
    rows = int(kv.query_start_loc[-1])
    torch.testing.assert_close(out[:rows], expected[:rows], **TOLERANCES[torch.float32])


def test_wrapper_requires_fp8_scales():
    kv = make_case(*MIXED, 8, 2, 64, 16, torch.bfloat16, "fp8_e5m2")
    with pytest.raises(ValueError, match="needs k_scale and v_scale"):
        paged_attention.paged_attention_varlen(
            kv.query, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens,
            kv.query_start_loc, kv_cache_dtype="fp8_e5m2",
        )  # fmt: skip


def test_wrapper_passes_a_cuda_query_to_the_op():
    """A CUDA query goes to the op (its CUDA kernel: tests/test_cuda_varlen.py); fake CUDA
    tensors stand in for real ones on a machine without a GPU and trace through the fake kernel."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        query = torch.empty(3, 4, 64, device="cuda")
        key_cache = torch.empty(8, 2, 16, 16, 4, device="cuda")
        value_cache = torch.empty(8, 2, 64, 16, device="cuda")
        tables = torch.zeros(1, 2, dtype=torch.int32, device="cuda")
        lens = torch.tensor([3], dtype=torch.int32, device="cuda")
        starts = torch.tensor([0, 3], dtype=torch.int32, device="cuda")
        out = paged_attention.paged_attention_varlen(
            query, key_cache, value_cache, tables, lens, starts, max_query_len=3, max_seq_len=3
        )
        assert out.shape == query.shape and out.device.type == "cuda"


def test_wrapper_returns_the_value_head_size():
    kv = make_case(*MIXED, 8, 2, 192, v_head_size=128)
    out = paged_attention.paged_attention_varlen(
        kv.query, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens, kv.query_start_loc
    )
    rows = int(kv.query_start_loc[-1])
    assert out.shape == (kv.query.shape[0], 8, 128) and (out[rows:] == 0).all()
    expected = run_reference(kv, features(kv))
    torch.testing.assert_close(out[:rows], expected[:rows], **TOLERANCES[torch.float32])


def test_opcheck_with_values_of_their_own_head_size():
    kv = make_case([20, 600, 9], [1, 40, 9], 4, 2, 192, 16, torch.bfloat16, v_head_size=128)
    out = torch.empty(out_shape(kv), dtype=kv.query.dtype)
    options = features(kv, sinks=True, sliding_window=30, chunk=16)
    torch.library.opcheck(ops.paged_attention_varlen, (out, *op_args(kv, options)))


@pytest.mark.parametrize("chunk", [0, 16])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e5m2"])
def test_opcheck(chunk, kv_cache_dtype):
    """Schema, fake kernel and the op agree (torch.library.opcheck), with and without chunks."""
    kv = make_case([20, 600, 9], [1, 40, 9], 4, 2, 64, 16, torch.bfloat16, kv_cache_dtype)
    out = torch.empty_like(kv.query)
    options = features(kv, alibi=True, sinks=True, sliding_window=30, soft_cap=10.0, chunk=chunk)
    torch.library.opcheck(ops.paged_attention_varlen, (out, *op_args(kv, options)))


def test_torch_compile_fullgraph():
    kv = make_case([30, 1500, 9], [1, 30, 9], 8, 2, 64, 16, torch.bfloat16)
    sinks = torch.randn(8)

    def step(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc):
        out = paged_attention.paged_attention_varlen(
            query, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
            max_query_len=30, max_seq_len=1500, sinks=sinks,
        )  # fmt: skip
        return out * 2

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    inputs = (kv.query, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens,
              kv.query_start_loc)  # fmt: skip
    options = features(kv)
    options["sinks"] = sinks
    expected = run_reference(kv, options)
    expected[int(kv.query_start_loc[-1]) :] = 0
    torch.testing.assert_close(compiled(*inputs), expected * 2, **TOLERANCES[torch.bfloat16])


# --------------------------------------------------------------------------------------------
# Bad input: a clear error naming the argument, and out left as it was


def bad_call(**changes):
    kv = make_case([10, 40, 20], [2, 40, 1], 4, 2, 64)
    options = features(kv, sinks=True)
    names = ["query", "key_cache", "value_cache", "num_kv_heads", "scale", "block_tables",
             "seq_lens", "query_start_loc", "max_query_len", "max_seq_len", "alibi_slopes",
             "kv_cache_dtype", "k_scale", "v_scale", "sliding_window", "logits_soft_cap",
             "sinks", "attention_chunk_size"]  # fmt: skip
    args = list(op_args(kv, options))
    out = torch.full(kv.query.shape, UNTOUCHED)
    for name, change in changes.items():
        if name == "out":
            out = change(out)
        else:
            args[names.index(name)] = change(args[names.index(name)])
    try:
        ops.paged_attention_varlen(out, *args)
    finally:
        assert (out == UNTOUCHED).all()


def _starts(*values):
    return lambda _: torch.tensor(values, dtype=torch.int32)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (dict(query_start_loc=_starts(0, 2, 42, 43, 50)), "block_tables must have num_seqs"),
        (dict(query_start_loc=_starts(0, 2, 42, 46)), r"query_start_loc\[3\] = 46 exceeds the 45"),
        (dict(query_start_loc=_starts(0, 30, 12, 13)), "query_start_loc must be non-decreasing"),
        (dict(query_start_loc=_starts(1, 2, 42, 43)), r"query_start_loc\[0\] must be 0"),
        (dict(query_start_loc=lambda q: q.long()), "query_start_loc must be Int"),
        (dict(query_start_loc=lambda q: q[None]), "query_start_loc must be 1-D"),
        (dict(query_start_loc=_starts(0, 12, 42, 43)), r"seq_lens\[0\] = 10 is less than the 12"),
        (dict(max_query_len=lambda m: 39), "more than max_query_len = 39"),
        (dict(max_query_len=lambda m: -1), "max_query_len must be >= 0"),
        (dict(seq_lens=lambda s: torch.tensor([10, 40, 90], dtype=torch.int32)), "max_seq_len"),
        (dict(sinks=lambda s: s[:3]), r"sinks must have shape \[num_heads\] = \[4\]"),
        (dict(sinks=lambda s: s.double()), "sinks must be Float"),
        (dict(sinks=lambda s: s.to("meta")), "sinks is on meta"),
        (dict(sinks=lambda s: torch.ones(8)[::2]), "sinks must be contiguous"),
        (dict(block_tables=lambda t: t.index_fill(1, torch.tensor([1]), 10**6)), "out of range"),
        (dict(query=lambda q: q[:, :, :48].contiguous()), "head_size 48 is not supported"),
        (dict(query=lambda q: q[0]), "query must be 3-D"),
        (dict(out=lambda o: o[:-1]), r"out must have shape \[query.size\(0\), num_heads, v_head"),
        (
            dict(value_cache=lambda v: torch.zeros(v.shape[0], 2, 128, 16)),
            r"out must have shape \[query.size\(0\), num_heads, v_head_size\] = \[45, 4, 128\]",
        ),
        (
            dict(value_cache=lambda v: torch.zeros(v.shape[0], 2, 40, 16)),
            r"v_head_size 40 is not supported \(value_cache.size\(2\)",
        ),
        (dict(kv_cache_dtype=lambda d: "fp8"), "key_cache must be Byte"),
        (dict(logits_soft_cap=lambda c: 1e-50), "underflows to 0 in float32"),
        (dict(num_kv_heads=lambda n: 3), "positive multiple of num_kv_heads"),
        (dict(attention_chunk_size=lambda c: -1), r"attention_chunk_size must be >= 0 \(0 = none"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_bad_inputs_raise(changes, message):
    with pytest.raises((RuntimeError, ValueError), match=message):
        bad_call(**changes)


def test_out_sharing_memory_with_an_input_is_rejected():
    kv = make_case([10, 40], [2, 40], 4, 2, 64)
    options = features(kv, sinks=True)
    out = torch.zeros(kv.query.shape)
    args = list(op_args(kv, options))
    args[7] = out.view(-1)[:3].view(torch.int32)  # query_start_loc inside out
    args[7].copy_(kv.query_start_loc)
    with pytest.raises(RuntimeError, match="out must not share memory with query_start_loc"):
        ops.paged_attention_varlen(out, *args)
    args = list(op_args(kv, options))
    args[16] = out.view(-1)[:4]
    args[16].copy_(options["sinks"])
    with pytest.raises(RuntimeError, match="out must not share memory with sinks"):
        ops.paged_attention_varlen(out, *args)


def test_seq_len_beyond_block_table_raises():
    kv = make_case([16], [3], 1, 1, 64)
    args = list(op_args(kv, features(kv)))
    args[5] = kv.block_tables[:, :1].contiguous()  # one block = 16 tokens
    args[6] = torch.tensor([17], dtype=torch.int32)
    args[9] = 16
    with pytest.raises(ValueError, match="seq_lens"):
        ops.paged_attention_varlen(torch.empty_like(kv.query), *args)
    assert math.isfinite(float(run_op(kv, features(kv))[:3].sum()))
