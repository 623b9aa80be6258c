"""CUDA kernels of every op against reference.py (and against the CPU kernels).

Every test is marked ``cuda`` and skipped when no GPU is visible. The cache builder is local so
this file does not depend on conftest.py.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch

import paged_attention.ops.bindings as pa_ops
from paged_attention.ops import reference
from paged_attention.ops.supported import is_fp8

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

ops = torch.ops.paged_attention
HEAD_SIZES = [32, 64, 80, 96, 112, 120, 128, 192, 256]
BLOCK_SIZES = [8, 16, 32]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
FP8 = ["fp8", "fp8_e4m3", "fp8_e5m2"]
# Output tolerances: about two units in the last place of the output dtype.
TOLERANCES = {
    torch.float32: dict(atol=5e-5, rtol=1e-4),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2),
}


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


class PagedKV:
    """A random paged cache with scattered, shuffled blocks and its attention inputs; values of
    head size ``v_head_size`` (multi-head latent attention; by default ``head_size``)."""

    def __init__(
        self,
        *,
        seq_lens: list[int],
        num_heads: int = 8,
        num_kv_heads: int = 2,
        head_size: int = 128,
        v_head_size: int | None = None,
        block_size: int = 16,
        dtype: torch.dtype = torch.float16,
        kv_cache_dtype: str = "auto",
        extra_blocks: int = 7,
        fill_nan: bool = False,
        seed: int = 0,
        device: torch.device | None = None,
    ) -> None:
        device = device or _device()
        gen = torch.Generator(device="cpu").manual_seed(seed)
        self.dtype, self.kv_cache_dtype = dtype, kv_cache_dtype
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.head_size, self.block_size = head_size, block_size
        self.v_head_size = v_head_size or head_size
        max_len = max(seq_lens) if seq_lens else 0
        max_blocks = max(1, math.ceil(max_len / block_size))
        needed = sum(math.ceil(n / block_size) for n in seq_lens)
        num_blocks = needed + extra_blocks
        fp8 = is_fp8(kv_cache_dtype)
        cache_dtype = torch.uint8 if fp8 else dtype
        x = 16 // torch.empty((), dtype=cache_dtype).element_size()
        self.k_scale = torch.tensor([0.5 if fp8 else 1.0], device=device)
        self.v_scale = torch.tensor([0.25 if fp8 else 1.0], device=device)

        def random_cache(shape, scale):
            values = torch.randn(shape, generator=gen).to(device)
            if fp8:
                return reference.quantize(values, kv_cache_dtype, scale)
            values = values.to(dtype)
            if fill_nan:
                values.fill_(math.nan)
            return values

        self.key_cache = random_cache(
            (num_blocks, num_kv_heads, head_size // x, block_size, x), self.k_scale
        )
        self.value_cache = random_cache(
            (num_blocks, num_kv_heads, self.v_head_size, block_size), self.v_scale
        )
        if fill_nan and fp8:
            self.key_cache.fill_(0x7F)  # NaN in both fp8 formats
            self.value_cache.fill_(0x7F)
        perm = torch.randperm(num_blocks, generator=gen)
        tables = torch.full((len(seq_lens), max_blocks), -1, dtype=torch.int32)
        used = 0
        for s, n in enumerate(seq_lens):
            count = math.ceil(n / block_size)
            tables[s, :count] = perm[used : used + count].to(torch.int32)
            used += count
        # Unused table entries point at a valid block too, as allocators leave them.
        tables[tables < 0] = int(perm[-1])
        self.block_tables = tables.to(device)
        self.seq_lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
        self.max_seq_len = max_len
        self.query = torch.randn(len(seq_lens), num_heads, head_size, generator=gen).to(
            device, dtype
        )
        if fill_nan:
            self._write_tokens(gen)

    def _write_tokens(self, gen: torch.Generator) -> None:
        """Write valid tokens into a NaN-filled cache with reshape_and_cache (CUDA kernel)."""
        device = self.query.device
        slots = []
        for s, n in enumerate(self.seq_lens.tolist()):
            for pos in range(n):
                block = int(self.block_tables[s, pos // self.block_size])
                slots.append(block * self.block_size + pos % self.block_size)
        shape = (len(slots), self.num_kv_heads, self.head_size)
        key = torch.randn(shape, generator=gen).to(device, self.dtype)
        shape = (len(slots), self.num_kv_heads, self.v_head_size)
        value = torch.randn(shape, generator=gen).to(device, self.dtype)
        ops.reshape_and_cache(
            key,
            value,
            self.key_cache,
            self.value_cache,
            torch.tensor(slots, dtype=torch.int64, device=device),
            self.kv_cache_dtype,
            self.k_scale,
            self.v_scale,
        )

    def attention_args(self, **overrides):
        args = dict(
            num_kv_heads=self.num_kv_heads,
            scale=self.head_size**-0.5,
            block_tables=self.block_tables,
            seq_lens=self.seq_lens,
            block_size=self.block_size,
            max_seq_len=self.max_seq_len,
            alibi_slopes=None,
            kv_cache_dtype=self.kv_cache_dtype,
            k_scale=self.k_scale,
            v_scale=self.v_scale,
            sliding_window=0,
            logits_soft_cap=0.0,
            attention_chunk_size=0,
        )
        args.update(overrides)
        return args


def _positional(kv: PagedKV, query: torch.Tensor, args: dict) -> tuple:
    return (
        query,
        kv.key_cache,
        kv.value_cache,
        args["num_kv_heads"],
        args["scale"],
        args["block_tables"],
        args["seq_lens"],
        args["block_size"],
        args["max_seq_len"],
        args["alibi_slopes"],
        args["kv_cache_dtype"],
        args["k_scale"],
        args["v_scale"],
        args["sliding_window"],
        args["logits_soft_cap"],
        args["attention_chunk_size"],
    )


def _v2_scratch(
    query: torch.Tensor, max_seq_len: int, extra_partitions: int = 0, v_head_size: int = 0
):
    num_seqs, num_heads, head_size = query.shape
    head_size = v_head_size or head_size
    partitions = pa_ops.num_partitions(max_seq_len) + extra_partitions
    exp_sums = torch.full((num_seqs, num_heads, partitions), 7.0, device=query.device)
    max_logits = torch.full_like(exp_sums, 7.0)
    tmp_out = torch.full(
        (num_seqs, num_heads, partitions, head_size), 7.0, dtype=query.dtype, device=query.device
    )
    return exp_sums, max_logits, tmp_out


def run_attention(kv: PagedKV, version: int, query: torch.Tensor | None = None, **overrides):
    """Runs the CUDA op and the reference; returns (out, expected) and for v2 also checks the
    partition outputs against the reference's."""
    query = kv.query if query is None else query
    args = kv.attention_args(**overrides)
    pos = _positional(kv, query, args)
    out = query.new_full((*query.shape[:2], kv.v_head_size), math.nan)
    expected = torch.empty_like(out)
    if version == 1:
        ops.paged_attention_v1(out, *pos)
        reference.paged_attention_v1(expected, *pos)
        return out, expected
    scratch = _v2_scratch(query, args["max_seq_len"], 1, kv.v_head_size)
    ref_scratch = [t.clone() for t in scratch]
    ops.paged_attention_v2(out, *scratch, *pos)
    reference.paged_attention_v2(expected, *ref_scratch, *pos)
    exp_sums, max_logits, tmp_out = scratch
    ref_exp_sums, ref_max_logits, ref_tmp_out = ref_scratch
    torch.testing.assert_close(max_logits, ref_max_logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(exp_sums, ref_exp_sums, atol=1e-3, rtol=1e-4)
    torch.testing.assert_close(tmp_out, ref_tmp_out, **TOLERANCES[query.dtype])
    return out, expected


def assert_attention(kv: PagedKV, version: int, **overrides):
    out, expected = run_attention(kv, version, **overrides)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, expected, **TOLERANCES[kv.dtype])
    return out


# --------------------------------------------------------------------------------------------
# Attention


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("head_size", HEAD_SIZES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_head_block_dtype_grid(version, block_size, head_size, dtype):
    kv = PagedKV(
        seq_lens=[1, 37, 600, 1100],
        head_size=head_size,
        block_size=block_size,
        dtype=dtype,
        seed=head_size + block_size,
    )
    assert_attention(kv, version)


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize(
    "num_heads,num_kv_heads",
    [(8, 8), (16, 4), (32, 4), (64, 8), (16, 1), (32, 1), (24, 2), (40, 1)],
    ids=["mha", "gqa4", "gqa8", "gqa8-64", "mqa16", "mqa32", "gqa12", "mqa40"],
)
def test_attention_gqa_and_mqa(version, num_heads, num_kv_heads):
    kv = PagedKV(seq_lens=[5, 513, 777], num_heads=num_heads, num_kv_heads=num_kv_heads)
    assert_attention(kv, version)


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kv_cache_dtype", FP8)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_attention_fp8_cache(version, dtype, kv_cache_dtype, block_size):
    kv = PagedKV(
        seq_lens=[3, 300, 1030],
        block_size=block_size,
        dtype=dtype,
        kv_cache_dtype=kv_cache_dtype,
    )
    assert_attention(kv, version)


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("head_size", [h for h in HEAD_SIZES if h % 16 == 0])
def test_attention_fp8_head_sizes(version, kv_cache_dtype, head_size):
    dtype, block_size = torch.bfloat16, 16
    kv = PagedKV(
        seq_lens=[3, 300, 1030],
        head_size=head_size,
        block_size=block_size,
        dtype=dtype,
        kv_cache_dtype=kv_cache_dtype,
    )
    assert_attention(kv, version)


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_alibi(version, dtype):
    kv = PagedKV(seq_lens=[1, 90, 1500], num_heads=8, num_kv_heads=2, dtype=dtype)
    slopes = torch.tensor([2 ** (-(i + 1)) for i in range(8)], device=kv.query.device)
    assert_attention(kv, version, alibi_slopes=slopes)


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("window", [1, 5, 16, 100, 512, 700, 5000])
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_attention_sliding_window(version, window, block_size):
    kv = PagedKV(seq_lens=[1, 20, 513, 1600], block_size=block_size, dtype=torch.float32)
    assert_attention(kv, version, sliding_window=window)


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("chunk", [1, 5, 16, 100, 512, 700, 5000])
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_chunks(version, chunk, block_size, dtype):
    kv = PagedKV(seq_lens=[1, 20, 513, 1600], block_size=block_size, dtype=dtype, seed=chunk)
    # The blocks before each query's chunk may be released: ids out of range there.
    for s, n in enumerate(kv.seq_lens.tolist()):
        first = reference.first_attended_position(n - 1, 0, chunk)
        kv.block_tables[s, : first // block_size] = 10**6
    assert_attention(kv, version, attention_chunk_size=chunk)
    assert_attention(kv, version, attention_chunk_size=chunk, sliding_window=chunk // 2 + 3)


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("cap", [5.0, 30.0])
def test_attention_soft_cap(version, cap):
    kv = PagedKV(seq_lens=[7, 800], dtype=torch.float32, seed=3)
    kv.query.mul_(8)  # logits large enough for the cap to matter
    assert_attention(kv, version, logits_soft_cap=cap)


@pytest.mark.parametrize("version", [1, 2])
def test_attention_all_options_together(version):
    kv = PagedKV(
        seq_lens=[0, 1, 33, 1500],
        num_heads=12,
        num_kv_heads=1,
        head_size=96,
        block_size=32,
        dtype=torch.bfloat16,
        kv_cache_dtype="fp8_e5m2",
    )
    slopes = torch.linspace(0.01, 0.3, 12, device=kv.query.device)
    assert_attention(kv, version, alibi_slopes=slopes, sliding_window=600, logits_soft_cap=20.0)
    assert_attention(
        kv,
        version,
        alibi_slopes=slopes,
        sliding_window=600,
        logits_soft_cap=20.0,
        attention_chunk_size=250,
    )


@pytest.mark.parametrize("version", [1, 2])
def test_seq_len_zero_and_one(version):
    kv = PagedKV(seq_lens=[0, 1, 0, 2, 1])
    out = assert_attention(kv, version)
    assert (out[0] == 0).all() and (out[2] == 0).all()


@pytest.mark.parametrize("version", [1, 2])
def test_all_sequences_empty(version):
    kv = PagedKV(seq_lens=[0, 0])
    out = assert_attention(kv, version)
    assert (out == 0).all()


@pytest.mark.parametrize("version", [1, 2])
def test_strided_query_from_fused_qkv(version):
    kv = PagedKV(seq_lens=[40, 700], num_heads=8, num_kv_heads=2, head_size=64)
    qkv = torch.randn(2, 8 + 2 * 2, 64, device=kv.query.device, dtype=kv.dtype)
    query = qkv[:, :8]
    assert not query.is_contiguous()
    out, expected = run_attention(kv, version, query=query)
    torch.testing.assert_close(out, expected, **TOLERANCES[kv.dtype])


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_nan_in_unused_cache_slots_never_reaches_output(version, kv_cache_dtype, block_size):
    # Lengths end mid-block, so the last block of each sequence holds NaN past seq_len.
    kv = PagedKV(
        seq_lens=[3, 45, 530],
        block_size=block_size,
        kv_cache_dtype=kv_cache_dtype,
        fill_nan=True,
    )
    assert_attention(kv, version)
    assert_attention(kv, version, sliding_window=7)
    assert_attention(kv, version, attention_chunk_size=13)


def test_seq_len_beyond_max_seq_len_is_clamped_not_read_out_of_bounds():
    kv = PagedKV(seq_lens=[64, 64], block_size=16)
    lying = kv.seq_lens.clone()
    lying[1] = 10_000_000  # far past the block table width
    out, _ = run_attention(kv, 1, seq_lens=lying)
    expected = torch.empty_like(out)
    reference.paged_attention_v1(expected, *_positional(kv, kv.query, kv.attention_args()))
    torch.testing.assert_close(out, expected, **TOLERANCES[kv.dtype])


@pytest.mark.parametrize("context", [513, 1024, 3000])
@pytest.mark.parametrize("dtype", DTYPES)
def test_v1_equals_v2(context, dtype):
    kv = PagedKV(seq_lens=[context, context // 2, 1], dtype=dtype, seed=context)
    out1, _ = run_attention(kv, 1)
    out2, _ = run_attention(kv, 2)
    torch.testing.assert_close(out1, out2, **TOLERANCES[dtype])


@pytest.mark.slow
@pytest.mark.parametrize("context", [8192, 32768])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_long_context(context, dtype):
    kv = PagedKV(seq_lens=[context, context - 77], num_heads=8, num_kv_heads=8, dtype=dtype)
    assert_attention(kv, 2)
    assert_attention(kv, 1)
    out = pa_ops.paged_attention(
        kv.query, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens
    )
    _, expected = run_attention(kv, 2)
    torch.testing.assert_close(out, expected, **TOLERANCES[dtype])


def test_v1_serves_long_contexts_with_few_or_no_splits():
    # A CTA reads its block ids from the block table tile by tile, so one may take a whole
    # context of tens of thousands of tokens when the batch alone fills the GPU.
    kv = PagedKV(seq_lens=[9000, 20000], num_heads=4, num_kv_heads=1, block_size=8, seed=5)
    assert_attention(kv, 1)
    assert_attention(kv, 1, sliding_window=8500)
    assert_attention(kv, 1, attention_chunk_size=8192)
    out = pa_ops.paged_attention(
        kv.query, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens
    )
    torch.testing.assert_close(out, run_attention(kv, 2)[1], **TOLERANCES[kv.dtype])


def test_paged_attention_picks_v1_on_cuda():
    # v1 splits each sequence to fill the GPU itself; v2's 512-token partitions stay available.
    for batch, context in [(1024, 2049), (2, 1024), (2, 100_000), (64, 4096)]:
        assert not pa_ops.use_v2(torch.empty(batch, 32, 128, device=_device()), 8, context)


def test_misaligned_cache_is_rejected():
    kv = PagedKV(seq_lens=[16])
    flat = torch.zeros(kv.key_cache.numel() + 1, dtype=kv.key_cache.dtype, device="cuda")
    shifted = flat[1:].view(kv.key_cache.shape)
    shifted.copy_(kv.key_cache)
    kv.key_cache = shifted
    with pytest.raises(RuntimeError, match="16-byte"):
        run_attention(kv, 1)


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
def test_cpu_and_cuda_kernels_agree(version, kv_cache_dtype):
    kv = PagedKV(seq_lens=[1, 200, 900], dtype=torch.float32, kv_cache_dtype=kv_cache_dtype)
    args = dict(
        max_seq_len=kv.max_seq_len,
        kv_cache_dtype=kv_cache_dtype,
        k_scale=kv.k_scale,
        v_scale=kv.v_scale,
        sliding_window=300,
        attention_chunk_size=200,
        version=version,
    )
    cuda_out = pa_ops.paged_attention(
        kv.query, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens, **args
    )
    args.update(k_scale=kv.k_scale.cpu(), v_scale=kv.v_scale.cpu())
    cpu_out = pa_ops.paged_attention(
        kv.query.cpu(),
        kv.key_cache.cpu(),
        kv.value_cache.cpu(),
        kv.block_tables.cpu(),
        kv.seq_lens.cpu(),
        **args,
    )
    torch.testing.assert_close(cuda_out.cpu(), cpu_out, atol=5e-5, rtol=1e-4)


@pytest.mark.parametrize("version", [1, 2])
def test_decode_step_in_cuda_graph(version):
    device = _device()
    num_seqs, num_kv_heads, num_heads, head_size, block_size = 4, 2, 8, 128, 16
    max_seq_len = 1024
    kv = PagedKV(
        seq_lens=[max_seq_len] * num_seqs,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_size=head_size,
        block_size=block_size,
    )
    static_key = torch.zeros(num_seqs, num_kv_heads, head_size, device=device, dtype=kv.dtype)
    static_value = torch.zeros_like(static_key)
    static_query = torch.zeros_like(kv.query)
    static_slots = torch.zeros(num_seqs, dtype=torch.int64, device=device)
    static_lens = torch.ones(num_seqs, dtype=torch.int32, device=device)
    static_out = torch.zeros_like(kv.query)

    def step():
        pa_ops.reshape_and_cache(
            static_key, static_value, kv.key_cache, kv.value_cache, static_slots
        )
        pa_ops.paged_attention(
            static_query,
            kv.key_cache,
            kv.value_cache,
            kv.block_tables,
            static_lens,
            max_seq_len=max_seq_len,
            out=static_out,
            version=version,
        )

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()

    for _ in range(3):
        lens = torch.randint(1, max_seq_len + 1, (num_seqs,), dtype=torch.int32)
        positions = lens.long() - 1
        blocks = kv.block_tables.cpu()[torch.arange(num_seqs), positions // block_size].long()
        static_slots.copy_((blocks * block_size + positions % block_size).to(device))
        static_lens.copy_(lens.to(device))
        static_key.normal_()
        static_value.normal_()
        static_query.normal_()
        graph.replay()

        key_cache = kv.key_cache.clone()
        value_cache = kv.value_cache.clone()
        expected = torch.empty_like(static_out)
        reference.paged_attention_v1(
            expected,
            static_query,
            key_cache,
            value_cache,
            num_kv_heads,
            head_size**-0.5,
            kv.block_tables,
            static_lens,
            block_size,
            max_seq_len,
            None,
            "auto",
            kv.k_scale,
            kv.v_scale,
        )
        torch.testing.assert_close(static_out, expected, **TOLERANCES[kv.dtype])
        # The graph wrote the new token: it is what the reference reads at the last position.
        for s in range(num_seqs):
            keys, values = reference.gather_kv(
                key_cache, value_cache, kv.block_tables[s], int(lens[s])
            )
            torch.testing.assert_close(keys[-1].to(kv.dtype), static_key[s], atol=0, rtol=0)
            torch.testing.assert_close(values[-1].to(kv.dtype), static_value[s], atol=0, rtol=0)


@pytest.mark.parametrize("chunk", [0, 64])
@pytest.mark.parametrize("version", [1, 2])
def test_opcheck_attention(version, chunk):
    kv = PagedKV(seq_lens=[5, 600], kv_cache_dtype="fp8_e4m3")
    args = kv.attention_args(sliding_window=100, logits_soft_cap=10.0, attention_chunk_size=chunk)
    pos = _positional(kv, kv.query, args)
    out = torch.empty_like(kv.query)
    if version == 1:
        torch.library.opcheck(ops.paged_attention_v1, (out, *pos))
    else:
        torch.library.opcheck(ops.paged_attention_v2, (out, *_v2_scratch(kv.query, 600), *pos))


def test_debug_checks_reject_out_of_range_block_id():
    code = (
        "import torch, paged_attention.ops.bindings as o\n"
        "q = torch.randn(1, 2, 64, device='cuda', dtype=torch.float16)\n"
        "kc = torch.zeros(4, 2, 8, 16, 8, device='cuda', dtype=torch.float16)\n"
        "vc = torch.zeros(4, 2, 64, 16, device='cuda', dtype=torch.float16)\n"
        "bt = torch.tensor([[9]], dtype=torch.int32, device='cuda')\n"
        "sl = torch.tensor([3], dtype=torch.int32, device='cuda')\n"
        "try:\n"
        "    o.paged_attention(q, kc, vc, bt, sl, max_seq_len=3)\n"
        "except ValueError as e:\n"
        "    print('raised:', e)\n"
    )
    env = dict(os.environ, PAGED_ATTENTION_DEBUG_CHECKS="1")
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert "raised:" in result.stdout and "block_tables[0, 0] = 9" in result.stdout, (
        result.stdout + result.stderr
    )


# --------------------------------------------------------------------------------------------
# Cache ops


def _new_tokens(num_tokens, num_kv_heads, head_size, dtype, strided):
    device = _device()
    if strided:  # key and value as slices of a fused [tokens, 3 * heads, head_size] QKV
        qkv = torch.randn(num_tokens, 3 * num_kv_heads, head_size, device=device).to(dtype)
        return qkv[:, num_kv_heads : 2 * num_kv_heads], qkv[:, 2 * num_kv_heads :]
    key = torch.randn(num_tokens, num_kv_heads, head_size, device=device).to(dtype)
    return key, torch.randn_like(key)


@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", *FP8])
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("head_size", [64, 256])
@pytest.mark.parametrize("dtype", DTYPES)
def test_reshape_and_cache_bit_exact(strided, kv_cache_dtype, block_size, head_size, dtype):
    kv = PagedKV(
        seq_lens=[block_size * 4],
        num_heads=4,
        num_kv_heads=4,
        head_size=head_size,
        block_size=block_size,
        dtype=dtype,
        kv_cache_dtype=kv_cache_dtype,
        extra_blocks=20,
    )
    num_tokens = 50
    key, value = _new_tokens(num_tokens, 4, head_size, dtype, strided)
    key[0, 0, 0] = 1e6  # saturates in fp8
    value[1, 1, 1] = -1e6
    num_slots = kv.key_cache.shape[0] * block_size
    slots = torch.randperm(num_slots)[:num_tokens]
    slots[::7] = -1  # padding tokens are skipped
    slots = slots.to(key.device)
    expected = (kv.key_cache.clone(), kv.value_cache.clone())
    reference.reshape_and_cache(
        key, value, *expected, slots, kv_cache_dtype, kv.k_scale, kv.v_scale
    )
    ops.reshape_and_cache(
        key, value, kv.key_cache, kv.value_cache, slots, kv_cache_dtype, kv.k_scale, kv.v_scale
    )
    assert torch.equal(kv.key_cache, expected[0])
    assert torch.equal(kv.value_cache, expected[1])

    # The CPU kernel writes the same bits.
    cpu_caches = (kv.key_cache.cpu(), kv.value_cache.cpu())
    ops.reshape_and_cache(
        key.cpu(),
        value.cpu(),
        *cpu_caches,
        slots.cpu(),
        kv_cache_dtype,
        kv.k_scale.cpu(),
        kv.v_scale.cpu(),
    )
    assert torch.equal(cpu_caches[0], kv.key_cache.cpu())
    assert torch.equal(cpu_caches[1], kv.value_cache.cpu())


def test_opcheck_cache_ops():
    device = _device()
    kv = PagedKV(seq_lens=[32], num_kv_heads=2, num_heads=2, extra_blocks=8)
    key, value = _new_tokens(5, 2, 128, kv.dtype, strided=False)
    slots = torch.tensor([3, -1, 40, 41, 100], device=device)
    torch.library.opcheck(
        ops.reshape_and_cache,
        (key, value, kv.key_cache, kv.value_cache, slots, "auto", kv.k_scale, kv.v_scale),
    )
    mapping = torch.tensor([[0, 5], [1, 6]], device=device)
    torch.library.opcheck(ops.copy_blocks, ([kv.key_cache], [kv.value_cache], mapping))
    host = torch.zeros(kv.key_cache.shape, dtype=kv.dtype).pin_memory()
    torch.library.opcheck(ops.swap_blocks, (kv.key_cache, host, mapping.cpu()))


@pytest.mark.parametrize("mapping_device", ["cuda", "cpu"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.uint8])
def test_copy_blocks_all_layers_fan_out(mapping_device, dtype):
    device = _device()
    num_layers, num_blocks = 5, 12
    key_caches, value_caches = [], []
    for _ in range(num_layers):
        for caches, shape in (
            (key_caches, (num_blocks, 2, 8, 16, 8)),
            (value_caches, (num_blocks, 2, 64, 16)),
        ):
            caches.append(torch.randint(0, 255, shape, device=device).to(dtype))
    # One source fanned out to two destinations, plus an independent pair.
    mapping = torch.tensor([[1, 4], [1, 7], [2, 9]], device=mapping_device)
    expected_k = [c.clone() for c in key_caches]
    expected_v = [c.clone() for c in value_caches]
    reference.copy_blocks(expected_k, expected_v, mapping)
    ops.copy_blocks(key_caches, value_caches, mapping)
    for got, want in zip(key_caches + value_caches, expected_k + expected_v):
        assert torch.equal(got, want)


def test_copy_blocks_many_layers_and_strided_caches():
    # More tensors than one launch carries, and caches that are views of a bigger allocation.
    device = _device()
    num_layers = 150
    big = torch.randn(num_layers, 2, 6, 2, 64, 16, device=device)
    key_caches = [big[i, 0] for i in range(num_layers)]
    value_caches = [big[i, 1] for i in range(num_layers)]
    mapping = torch.tensor([[0, 3], [5, 1], [0, 4]], device=device)
    expected = big.clone()
    reference.copy_blocks(
        [expected[i, 0] for i in range(num_layers)],
        [expected[i, 1] for i in range(num_layers)],
        mapping,
    )
    ops.copy_blocks(key_caches, value_caches, mapping)
    assert torch.equal(big, expected)


def _host(shape, dtype, pinned):
    t = torch.randn(shape).to(dtype)
    return t.pin_memory() if pinned else t


@pytest.mark.parametrize("mapping_device", ["cpu", "cuda"])
@pytest.mark.parametrize(
    "direction",
    ["d2d", "d2h-pinned", "h2d-pinned", "d2h-pageable", "h2d-pageable"],
)
@pytest.mark.parametrize(
    "block_shape", [(2, 64, 16), (3, 5), (16, 128, 256)], ids=["kv", "odd", "big"]
)
def test_swap_blocks_every_direction(mapping_device, direction, block_shape):
    device = _device()
    dtype = torch.float16
    shape_src, shape_dst = (9, *block_shape), (7, *block_shape)
    pinned = direction.endswith("pinned")
    if direction == "d2d":
        src = torch.randn(shape_src, device=device).to(dtype)
        dst = torch.zeros(shape_dst, device=device, dtype=dtype)
    elif direction.startswith("d2h"):
        src = torch.randn(shape_src, device=device).to(dtype)
        dst = _host(shape_dst, dtype, pinned)
    else:
        src = _host(shape_src, dtype, pinned)
        dst = torch.zeros(shape_dst, device=device, dtype=dtype)
    mapping = torch.tensor([[0, 6], [8, 0], [3, 3], [4, 2]], device=mapping_device)
    expected = dst.clone()
    reference.swap_blocks(src, expected, mapping)
    ops.swap_blocks(src, dst, mapping)
    torch.cuda.synchronize()
    assert torch.equal(dst, expected)


def test_swap_blocks_between_strided_views():
    device = _device()
    src = torch.randn(6, 2, 3, 32, device=device)[:, 1]  # block stride != block size
    dst = torch.zeros(6, 2, 3, 32).pin_memory()[:, 0]
    mapping = torch.tensor([[5, 0], [0, 5]])
    expected = dst.clone()
    reference.swap_blocks(src, expected, mapping)
    ops.swap_blocks(src, dst, mapping)
    torch.cuda.synchronize()
    assert torch.equal(dst, expected)


def test_out_of_range_host_mapping_is_rejected_without_debug_switch():
    # A mapping already on the host costs nothing to check, so it is always checked.
    device = _device()
    cache = torch.zeros(4, 2, 64, 16, device=device)
    for mapping in (torch.tensor([[0, 4]]), torch.tensor([[-1, 0]])):
        with pytest.raises(ValueError, match="out of range"):
            ops.copy_blocks([cache], [cache.clone()], mapping)
        for host in (torch.zeros(4, 2, 64, 16), torch.zeros(4, 2, 64, 16).pin_memory()):
            with pytest.raises(ValueError, match="out of range"):
                ops.swap_blocks(cache, host, mapping)
            with pytest.raises(ValueError, match="out of range"):
                ops.swap_blocks(host, cache, mapping)


# Values of a head size of their own (multi-head latent attention in its expanded form: keys
# 192 = 128 + 64 rotary dims and values 128 in DeepSeek-V3, 128 and 64 in a tiny DeepSeek-V2-Lite
# like model; values above the keys' too).
VALUE_HEAD_SIZES = [(192, 128), (128, 64), (256, 128), (64, 128)]


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("head_size,v_head_size", VALUE_HEAD_SIZES)
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_values_of_their_own_head_size(version, head_size, v_head_size, kv_cache_dtype, dtype):
    kv = PagedKV(seq_lens=[1, 37, 700, 2000], head_size=head_size, v_head_size=v_head_size,
                 dtype=dtype, kv_cache_dtype=kv_cache_dtype, fill_nan=True,
                 seed=v_head_size)  # fmt: skip
    out = assert_attention(kv, version)
    assert out.shape == (4, 8, v_head_size)


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_values_of_their_own_head_size_with_every_option(version, dtype):
    # MHA as DeepSeek's expanded MLA runs it, with ALiBi, a window and a soft cap.
    kv = PagedKV(seq_lens=[0, 1, 33, 1500], num_heads=16, num_kv_heads=16, head_size=192,
                 v_head_size=128, dtype=dtype, block_size=32)  # fmt: skip
    slopes = torch.linspace(0.02, 0.4, 16, device=_device())
    assert_attention(kv, version, alibi_slopes=slopes, sliding_window=300, logits_soft_cap=20.0)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", *FP8])
@pytest.mark.parametrize("dtype", DTYPES)
def test_reshape_and_cache_of_values_of_their_own_head_size(kv_cache_dtype, dtype):
    kv = PagedKV(seq_lens=[64], num_kv_heads=4, num_heads=4, head_size=192, v_head_size=128,
                 dtype=dtype, kv_cache_dtype=kv_cache_dtype, extra_blocks=8)  # fmt: skip
    device = _device()
    key = torch.randn(30, 4, 192, device=device).to(dtype)
    value = torch.randn(30, 4, 192, device=device).to(dtype)[:, :, :128]  # strided
    slots = torch.randperm(kv.key_cache.shape[0] * 16)[:30]
    slots[::5] = -1
    slots = slots.to(device)
    scales = (kv_cache_dtype, kv.k_scale, kv.v_scale)
    expected = (kv.key_cache.clone(), kv.value_cache.clone())
    reference.reshape_and_cache(key, value, *expected, slots, *scales)
    ops.reshape_and_cache(key, value, kv.key_cache, kv.value_cache, slots, *scales)
    assert torch.equal(kv.key_cache, expected[0])
    assert torch.equal(kv.value_cache, expected[1])
