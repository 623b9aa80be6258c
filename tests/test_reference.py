"""The oracle itself: reference.py against dense attention on contiguous K/V."""

import math

import pytest
import torch
import torch.nn.functional as F

from paged_attention.ops import reference


def _paged_from_dense(keys, values, block_size, num_blocks, x, seed):
    """Scatter per-sequence dense K/V into a paged cache with a random, scattered block table."""
    gen = torch.Generator().manual_seed(seed)
    num_kv_heads, head_size = keys[0].shape[1:]
    v_head_size = values[0].shape[2]  # the keys' but for multi-head latent attention
    key_cache = torch.full((num_blocks, num_kv_heads, head_size // x, block_size, x), math.nan)
    value_cache = torch.full((num_blocks, num_kv_heads, v_head_size, block_size), math.nan)
    max_blocks = max(math.ceil(k.shape[0] / block_size) for k in keys) + 2  # unused trailing
    pool = torch.randperm(num_blocks, generator=gen)
    block_tables = torch.zeros(len(keys), max_blocks, dtype=torch.int32)
    used = 0
    for s, k in enumerate(keys):
        n = math.ceil(k.shape[0] / block_size)
        block_tables[s, :n] = pool[used : used + n].int()
        used += n
        positions = torch.arange(k.shape[0])
        slots = (
            block_tables[s, positions // block_size].long() * block_size + positions % block_size
        )
        unit = torch.ones(1)
        reference.reshape_and_cache(k, values[s], key_cache, value_cache, slots, "auto", unit, unit)
    return key_cache, value_cache, block_tables


def _dense_attention(q, k, v, scale, slopes, window, soft_cap, chunk=0):
    """q [H, D], k [L, Hkv, D], v [L, Hkv, Dv] -> [H, Dv] with plain SDPA (or explicit math for
    soft-cap)."""
    seq_len = k.shape[0]
    positions = torch.arange(seq_len)
    bias = torch.zeros(q.shape[0], 1, seq_len)
    if slopes is not None:
        bias += slopes[:, None, None] * (positions - seq_len + 1)
    if window:
        bias[..., positions < seq_len - window] = -math.inf
    if chunk:  # the query's own chunk: positions in the chunk of seq_len - 1
        bias[..., positions // chunk != (seq_len - 1) // chunk] = -math.inf
    q4 = q[None, :, None, :]  # [1, H, 1, D]
    k4, v4 = k.transpose(0, 1)[None], v.transpose(0, 1)[None]  # [1, Hkv, L, D]
    if soft_cap == 0:
        out = F.scaled_dot_product_attention(
            q4, k4, v4, attn_mask=bias[None], scale=scale, enable_gqa=True
        )
        return out[0, :, 0]
    group = q.shape[0] // k.shape[1]
    k4, v4 = k4.repeat_interleave(group, 1), v4.repeat_interleave(group, 1)
    logits = soft_cap * torch.tanh(scale * (q4 @ k4.transpose(-1, -2)) / soft_cap) + bias[None]
    return (torch.softmax(logits, -1) @ v4)[0, :, 0]


@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_size,block_size,alibi,window,soft_cap,chunk",
    [
        (4, 4, 64, 16, False, 0, 0.0, 0),
        (8, 2, 128, 8, False, 0, 0.0, 0),  # GQA
        (8, 1, 32, 32, True, 0, 0.0, 0),  # MQA + ALiBi
        (4, 2, 80, 16, False, 37, 0.0, 0),  # sliding window
        (4, 4, 96, 16, True, 100, 30.0, 0),  # all three
        (4, 2, 64, 16, False, 0, 0.0, 24),  # chunks cutting blocks
        (8, 2, 128, 8, True, 0, 0.0, 512),  # chunks of a v2 partition, ALiBi
        (4, 4, 96, 16, True, 100, 30.0, 64),  # chunks inside a window, and the rest
        (4, 4, 64, 32, False, 300, 0.0, 256),  # chunks and a longer window
        (4, 1, 64, 32, False, 0, 0.0, 5000),  # one chunk longer than every context
    ],
)
@pytest.mark.parametrize("v_head_size", [None, 192])  # 192: values of their own size (MLA)
def test_reference_matches_dense_attention(
    num_heads, num_kv_heads, head_size, block_size, alibi, window, soft_cap, chunk, v_head_size
):
    torch.manual_seed(0)
    seq_lens = [1, block_size, 3 * block_size + 5, 700, 1200]
    v_head_size = v_head_size or head_size
    keys = [torch.randn(n, num_kv_heads, head_size) for n in seq_lens]
    values = [torch.randn(n, num_kv_heads, v_head_size) for n in seq_lens]
    key_cache, value_cache, block_tables = _paged_from_dense(
        keys, values, block_size, num_blocks=256, x=4, seed=1
    )
    query = torch.randn(len(seq_lens), num_heads, head_size)
    slopes = torch.rand(num_heads) if alibi else None
    scale = head_size**-0.5
    unit = torch.ones(1)
    args = (
        query,
        key_cache,
        value_cache,
        num_kv_heads,
        scale,
        block_tables,
        torch.tensor(seq_lens, dtype=torch.int32),
        block_size,
        max(seq_lens),
        slopes,
        "auto",
        unit,
        unit,
        window,
        soft_cap,
        chunk,
    )
    out_v1 = query.new_empty(len(seq_lens), num_heads, v_head_size)
    reference.paged_attention_v1(out_v1, *args)
    partitions = math.ceil(max(seq_lens) / reference.PARTITION_SIZE)
    exp_sums = torch.empty(len(seq_lens), num_heads, partitions)
    max_logits = torch.empty_like(exp_sums)
    tmp_out = torch.empty(len(seq_lens), num_heads, partitions, v_head_size)
    out_v2 = torch.empty_like(out_v1)
    reference.paged_attention_v2(out_v2, exp_sums, max_logits, tmp_out, *args)

    for s, seq_len in enumerate(seq_lens):
        expected = _dense_attention(
            query[s], keys[s], values[s], scale, slopes, window, soft_cap, chunk
        )
        torch.testing.assert_close(out_v1[s], expected, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out_v2[s], expected, atol=1e-5, rtol=1e-5)
        # Partitions past the sequence's end, or wholly before its window or chunk, hold no
        # token; the others some.
        first = reference.first_attended_position(seq_len - 1, window, chunk)
        for j in range(partitions):
            size = reference.PARTITION_SIZE
            if j * size >= seq_len or (j + 1) * size <= first:
                assert torch.isneginf(max_logits[s, :, j]).all()
                assert (exp_sums[s, :, j] == 0).all() and (tmp_out[s, :, j] == 0).all()
            else:
                assert torch.isfinite(max_logits[s, :, j]).all() and (exp_sums[s, :, j] > 0).all()


def test_reference_zero_length_sequence_gives_zeros():
    key_cache = torch.randn(4, 1, 8, 16, 4)
    value_cache = torch.randn(4, 1, 32, 16)
    query = torch.randn(1, 2, 32)
    out = torch.full_like(query, math.nan)
    unit = torch.ones(1)
    reference.paged_attention_v1(
        out, query, key_cache, value_cache, 1, 1.0, torch.zeros(1, 1, dtype=torch.int32),
        torch.zeros(1, dtype=torch.int32), 16, 0, None, "auto", unit, unit,
    )  # fmt: skip
    assert (out == 0).all()


@pytest.mark.parametrize("fmt,fp8_dtype,fp8_max", [
    ("fp8_e4m3", torch.float8_e4m3fn, 448.0),
    ("fp8", torch.float8_e4m3fn, 448.0),
    ("fp8_e5m2", torch.float8_e5m2, 57344.0),
])  # fmt: skip
def test_fp8_quantize_saturates_rounds_and_keeps_nan(fmt, fp8_dtype, fp8_max):
    scale = torch.tensor([0.5])
    x = torch.tensor([0.0, 1.0, -3.3, 1e9, -1e9, math.nan])
    bits = reference.quantize(x, fmt, scale)
    assert bits.dtype == torch.uint8
    decoded = reference.dequantize(bits, fmt, scale)
    assert decoded[0] == 0 and decoded[1] == 1.0
    assert decoded[3] == fp8_max * 0.5 and decoded[4] == -fp8_max * 0.5  # saturated, not inf/NaN
    assert torch.isnan(decoded[5])
    # Round to nearest even, as torch's own cast.
    assert decoded[2] == (torch.tensor([-3.3]) / 0.5).to(fp8_dtype).float() * 0.5


def test_unknown_kv_cache_dtype_is_rejected():
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        reference.quantize(torch.zeros(1), "int4", 1.0)


def _dense_varlen_row(q, k, v, position, scale, slopes, window, soft_cap, sinks, chunk=0):
    """One query row [H, D] at `position` over dense k [L, Hkv, D] and v [L, Hkv, Dv], written
    out per head."""
    group = q.shape[0] // k.shape[1]
    out = q.new_empty(q.shape[0], v.shape[2])
    for h in range(q.shape[0]):
        kh, vh = k[: position + 1, h // group], v[: position + 1, h // group]
        logits = scale * (kh @ q[h])
        if soft_cap:
            logits = soft_cap * torch.tanh(logits / soft_cap)
        positions = torch.arange(position + 1)
        if slopes is not None:
            logits = logits + slopes[h] * (positions - position)
        if window:
            logits = logits.masked_fill(positions <= position - window, -math.inf)
        if chunk:
            logits = logits.masked_fill(positions // chunk != position // chunk, -math.inf)
        weights = torch.exp(logits - logits.max())
        denominator = weights.sum()
        if sinks is not None:
            top = torch.maximum(logits.max(), sinks[h])
            weights = torch.exp(logits - top)
            denominator = weights.sum() + torch.exp(sinks[h] - top)
        out[h] = (weights[:, None] * vh).sum(0) / denominator
    return out


@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_size,block_size,alibi,window,soft_cap,with_sinks,chunk",
    [
        (4, 4, 64, 16, False, 0, 0.0, False, 0),
        (8, 2, 128, 8, False, 0, 0.0, True, 0),  # GQA + sinks
        (8, 1, 32, 32, True, 0, 0.0, False, 0),  # MQA + ALiBi
        (4, 2, 80, 16, False, 37, 0.0, False, 0),  # sliding window
        (4, 4, 96, 16, True, 20, 30.0, True, 0),  # all of them
        (4, 2, 64, 16, False, 0, 0.0, False, 24),  # chunks cutting blocks
        (8, 2, 128, 8, True, 0, 0.0, True, 32),  # chunks at block edges, ALiBi, sinks
        (4, 4, 96, 16, True, 20, 30.0, True, 48),  # chunks and a window, and the rest
        (4, 1, 64, 32, False, 0, 0.0, False, 1000),  # one chunk longer than every context
    ],
)
@pytest.mark.parametrize("v_head_size", [None, 192])  # 192: values of their own size (MLA)
def test_varlen_reference_matches_dense_attention(
    num_heads, num_kv_heads, head_size, block_size, alibi, window, soft_cap, with_sinks, chunk,
    v_head_size,
):  # fmt: skip
    torch.manual_seed(0)
    seq_lens = [1, block_size, 3 * block_size + 5, 130, 200, 9]
    query_lens = [1, 3, 3 * block_size + 5, 0, 40, 1]  # a whole prompt, none, a chunk
    v_head_size = v_head_size or head_size
    keys = [torch.randn(n, num_kv_heads, head_size) for n in seq_lens]
    values = [torch.randn(n, num_kv_heads, v_head_size) for n in seq_lens]
    key_cache, value_cache, block_tables = _paged_from_dense(
        keys, values, block_size, num_blocks=64, x=4, seed=2
    )
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    query = torch.randn(starts[-1] + 2, num_heads, head_size)  # 2 rows of no sequence
    slopes = torch.rand(num_heads) if alibi else None
    sinks = torch.randn(num_heads) * 2 if with_sinks else None
    scale = head_size**-0.5
    out = torch.full((query.shape[0], num_heads, v_head_size), 5.0)
    unit = torch.ones(1)
    reference.paged_attention_varlen(
        out, query, key_cache, value_cache, num_kv_heads, scale, block_tables,
        torch.tensor(seq_lens, dtype=torch.int32), torch.tensor(starts, dtype=torch.int32),
        max(query_lens), max(seq_lens), slopes, "auto", unit, unit, window, soft_cap, sinks,
        chunk,
    )  # fmt: skip
    for s, (seq_len, q_len) in enumerate(zip(seq_lens, query_lens)):
        for i in range(q_len):
            expected = _dense_varlen_row(
                query[starts[s] + i], keys[s], values[s], seq_len - q_len + i, scale, slopes,
                window, soft_cap, sinks, chunk,
            )  # fmt: skip
            torch.testing.assert_close(out[starts[s] + i], expected, atol=1e-5, rtol=1e-5)
    assert (out[starts[-1] :] == 5.0).all()  # rows of no sequence are left as they were


@pytest.mark.parametrize("chunk", [0, 5, 16])
def test_varlen_reference_with_one_row_per_sequence_is_v1(chunk):
    torch.manual_seed(1)
    seq_lens = [1, 17, 100]
    keys = [torch.randn(n, 2, 64) for n in seq_lens]
    key_cache, value_cache, block_tables = _paged_from_dense(
        keys, [torch.randn_like(k) for k in keys], 16, num_blocks=32, x=4, seed=3
    )
    query = torch.randn(3, 8, 64)
    unit = torch.ones(1)
    slopes = torch.rand(8)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    args = (key_cache, value_cache, 2, 0.2, block_tables, lens)
    v1, varlen = torch.empty_like(query), torch.empty_like(query)
    reference.paged_attention_v1(
        v1, query, *args, 16, 100, slopes, "auto", unit, unit, 7, 3.0, chunk
    )
    reference.paged_attention_varlen(
        varlen, query, *args, torch.arange(4, dtype=torch.int32), 1, 100, slopes, "auto", unit,
        unit, 7, 3.0, None, chunk,
    )  # fmt: skip
    torch.testing.assert_close(varlen, v1, atol=1e-6, rtol=1e-6)


def test_reference_reads_no_block_before_the_chunk():
    """Blocks wholly before the first attended position may be released: their table entries
    are never read (an out-of-range id there would raise)."""
    torch.manual_seed(2)
    seq_lens, chunk, block_size = [70, 45], 32, 8  # decode rows at 69 and 44
    keys = [torch.randn(n, 1, 32) for n in seq_lens]
    key_cache, value_cache, block_tables = _paged_from_dense(
        keys, [torch.randn_like(k) for k in keys], block_size, num_blocks=32, x=4, seed=4
    )
    released = block_tables.clone()
    released[0, : 64 // block_size] = 10**6  # row 69 attends 64 .. 69
    released[1, : 32 // block_size] = 10**6  # rows 35 .. 44 (varlen) and 44 attend from 32
    query = torch.randn(11, 2, 32)
    unit = torch.ones(1)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    starts = torch.tensor([0, 1, 11], dtype=torch.int32)
    outputs = []
    for tables in (block_tables, released):
        v1, varlen = torch.empty(2, 2, 32), torch.empty(11, 2, 32)
        common = (key_cache, value_cache, 1, 0.3, tables, lens)
        reference.paged_attention_v1(
            v1, query[[0, 10]], *common, block_size, 70, None, "auto", unit, unit, 0, 0.0, chunk
        )
        reference.paged_attention_varlen(
            varlen, query, *common, starts, 10, 70, None, "auto", unit, unit, 0, 0.0, None, chunk
        )
        outputs.append((v1, varlen))
    torch.testing.assert_close(outputs[1], outputs[0], atol=0, rtol=0)
    torch.testing.assert_close(outputs[0][1][[0, 10]], outputs[0][0], atol=1e-6, rtol=1e-6)
