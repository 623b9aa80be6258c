"""PagedAttention: decode against reference.py's paged attention, prefill (fresh, chunked after a
cached context, after a prefix-cache hit, mixed with decode) against a dense per-token oracle
built on reference.attention_logits and against SDPA on the whole unpaged sequence."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from paged_attention.attention import AttentionMetadata, PagedAttention
from paged_attention.kv.cache import PagedKVCache
from paged_attention.ops import reference

BLOCK = 8
HEAD = 32
TOL = {
    torch.float32: dict(atol=2e-5, rtol=1e-5),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
}

OPTIONS = {
    "plain": dict(),
    "alibi": dict(alibi=True),
    "window": dict(sliding_window=11),
    "softcap": dict(logits_soft_cap=2.0),
    "all": dict(alibi=True, sliding_window=11, logits_soft_cap=2.0),
    "chunk": dict(attention_chunk_size=6),  # chunks cutting blocks of 8
    "chunk+all": dict(alibi=True, sliding_window=11, logits_soft_cap=2.0, attention_chunk_size=16),
}


def alibi_slopes(num_heads: int) -> torch.Tensor:
    return torch.tensor([2.0 ** (-8.0 * (h + 1) / num_heads) for h in range(num_heads)])


def make_module(num_heads=4, num_kv_heads=2, alibi=False, kv_cache_dtype="auto", **kwargs):
    scale = 0.7 / math.sqrt(HEAD)  # not the default, so a wrong scale shows
    return PagedAttention(
        num_heads,
        HEAD,
        num_kv_heads,
        scale=scale,
        alibi_slopes=alibi_slopes(num_heads) if alibi else None,
        kv_cache_dtype=kv_cache_dtype,
        **kwargs,
    )


def make_cache(num_kv_heads=2, dtype=torch.float32, kv_cache_dtype="auto", num_blocks=40):
    cache = PagedKVCache(
        1,
        num_kv_heads,
        HEAD,
        BLOCK,
        num_blocks,
        dtype=dtype,
        kv_cache_dtype=kv_cache_dtype,
        k_scale=0.05 if kv_cache_dtype != "auto" else None,
        v_scale=0.04 if kv_cache_dtype != "auto" else None,
    )
    if kv_cache_dtype == "auto":
        # Unwritten slots are NaN: attention that reads one fails loudly.
        for t in (*cache.key_caches, *cache.value_caches):
            t.fill_(math.nan)
    return cache


def random_seq(length, num_heads, num_kv_heads, dtype, gen):
    def rand(h):
        return torch.randn(length, h, HEAD, generator=gen).to(dtype)

    return rand(num_heads), rand(num_kv_heads), rand(num_kv_heads)


def oracle(module, q, k, v, query_positions, kv_cache_dtype="auto", cache=None):
    """Dense reference: query token at position p attends keys 0..p with reference semantics
    (reference.attention_logits), in float32. q: [n, H, D], k/v: [L, Hkv, D] unpaged."""
    if kv_cache_dtype != "auto":  # what the cache can hold
        k_scale, v_scale = cache.scales(0)
        k = reference.dequantize(
            reference.quantize(k, kv_cache_dtype, k_scale), kv_cache_dtype, k_scale
        )
        v = reference.dequantize(
            reference.quantize(v, kv_cache_dtype, v_scale), kv_cache_dtype, v_scale
        )
    out = []
    for i, p in enumerate(query_positions):
        logits = reference.attention_logits(
            q[i].float(),
            k[: p + 1].float(),
            module.scale,
            module.alibi_slopes,
            module.sliding_window,
            module.logits_soft_cap,
            module.attention_chunk_size,
        )
        weights = torch.softmax(logits, dim=-1)
        values = v[: p + 1].float().repeat_interleave(q.shape[1] // v.shape[1], dim=1)
        out.append(torch.einsum("hl,lhd->hd", weights, values))
    return torch.stack(out)


def run_step(module, cache, manager, chunks, kv_cache_dtype="auto"):
    """One packed step. chunks: list of (seq_id, q, k, v) new tokens per sequence (slots
    reserved here). Returns the per-sequence outputs."""
    for seq_id, q, _, _ in chunks:
        if manager.has_seq(seq_id):
            cache.copy_blocks(manager.append_slots(seq_id, q.shape[0]))
        else:
            manager.allocate(seq_id, q.shape[0])
    seq_ids = [c[0] for c in chunks]
    lens = [c[1].shape[0] for c in chunks]
    meta = cache.metadata(manager, seq_ids, lens)
    out = module(
        torch.cat([c[1] for c in chunks]),
        torch.cat([c[2] for c in chunks]),
        torch.cat([c[3] for c in chunks]),
        cache.layer(0),
        meta,
        k_scale=cache.scales(0)[0],
        v_scale=cache.scales(0)[1],
    )
    return out.split(lens)


@pytest.mark.parametrize("option", list(OPTIONS))
@pytest.mark.parametrize(
    "dtype, heads", [(torch.float32, (4, 2)), (torch.float32, (4, 4)), (torch.bfloat16, (8, 1))]
)
def test_chunked_prefill_then_decode_match_dense_oracle(option, dtype, heads):
    num_heads, num_kv_heads = heads
    gen = torch.Generator().manual_seed(0)
    module = make_module(num_heads, num_kv_heads, **OPTIONS[option])
    cache = make_cache(num_kv_heads, dtype)
    manager = cache.make_manager(watermark=0.0)
    lengths = {0: 29, 1: 13, 2: 20}
    data = {s: random_seq(n, num_heads, num_kv_heads, dtype, gen) for s, n in lengths.items()}

    def chunk(s, a, b):
        return (s, *(t[a:b] for t in data[s]))

    # Step 1: fresh prefills. Step 2: chunked prefill after cached context, a fresh prefill and
    # (implicitly none yet) decode. Step 3: decode of two sequences plus a final chunk.
    steps = [
        [chunk(0, 0, 9), chunk(1, 0, 12)],
        [chunk(0, 9, 27), chunk(1, 12, 13), chunk(2, 0, 19)],
        [chunk(0, 27, 29), chunk(2, 19, 20)],
    ]
    done = {s: 0 for s in lengths}
    for step in steps:
        outs = run_step(module, cache, manager, step)
        for (s, q, _, _), out in zip(step, outs):
            positions = range(done[s], done[s] + q.shape[0])
            want = oracle(module, data[s][0][list(positions)], data[s][1], data[s][2], positions)
            torch.testing.assert_close(out.float(), want, **TOL[dtype])
            done[s] += q.shape[0]


@pytest.mark.parametrize("option", ["plain", "all", "chunk+all"])
@pytest.mark.parametrize("sizes", [(192, 128), (64, 128), (128, 64)], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_values_of_their_own_head_size_match_dense_oracle(option, sizes, dtype):
    """Multi-head latent attention through the attention interface (keys of 192 = 128 + 64
    rotary dims, values of 128 in DeepSeek-V3): prefill, chunked prefill with decode rows mixed
    in, then decode steps (the decode op), each against the dense oracle; the output has the
    values' head size, in the query's layout (flat or per head)."""
    head_size, v_head_size = sizes
    gen = torch.Generator().manual_seed(1)
    options = dict(OPTIONS[option])
    slopes = alibi_slopes(4) if options.pop("alibi", False) else None
    module = PagedAttention(4, head_size, 2, scale=0.1, alibi_slopes=slopes,
                            v_head_size=v_head_size, **options)  # fmt: skip
    assert module.v_head_size == v_head_size and "v_head_size" in repr(module)
    cache = PagedKVCache(1, 2, head_size, BLOCK, 40, dtype=dtype, v_head_size=v_head_size)
    for t in (*cache.key_caches, *cache.value_caches):
        t.fill_(math.nan)
    manager = cache.make_manager(watermark=0.0)
    data = {}
    for s, n in {0: 30, 1: 14}.items():
        q, k = (torch.randn(n, h, head_size, generator=gen).to(dtype) for h in (4, 2))
        data[s] = (q, k, torch.randn(n, 2, v_head_size, generator=gen).to(dtype))

    def chunk(s, a, b):
        return (s, *(t[a:b] for t in data[s]))

    # A prompt; a decode row beside a whole prompt (varlen); decode only (the decode op), twice.
    steps = [[chunk(0, 0, 20)], [chunk(0, 20, 21), chunk(1, 0, 14)], [chunk(0, 21, 22)],
             [chunk(0, 22, 23)]]  # fmt: skip
    done = {0: 0, 1: 0}
    for step in steps:
        outs = run_step(module, cache, manager, step)
        for (s, q, _, _), out in zip(step, outs):
            assert out.shape == (q.shape[0], 4, v_head_size)
            positions = range(done[s], done[s] + q.shape[0])
            want = oracle(module, data[s][0][list(positions)], data[s][1], data[s][2], positions)
            torch.testing.assert_close(out.float(), want, **TOL[dtype])
            done[s] += q.shape[0]
    # A flat query [tokens, heads * head_size] gives a flat output of heads * v_head_size.
    cache.copy_blocks(manager.append_slots(0, 1))
    meta = cache.metadata(manager, [0], [1])
    q, k, v = (t[23:24] for t in data[0])
    flat = module(q.flatten(1), k.flatten(1), v.flatten(1), cache.layer(0), meta)
    assert flat.shape == (1, 4 * v_head_size)
    want = oracle(module, q, data[0][1][:24], data[0][2][:24], [23])
    torch.testing.assert_close(flat.view(1, 4, v_head_size).float(), want, **TOL[dtype])


def test_an_unsupported_value_head_size_is_refused_at_construction():
    with pytest.raises(ValueError, match="v_head_size 48 is not supported"):
        PagedAttention(4, 64, 2, v_head_size=48)


@pytest.mark.parametrize("option", ["plain", "alibi", "window", "softcap", "chunk", "chunk+all"])
def test_decode_matches_reference_paged_attention(option):
    gen = torch.Generator().manual_seed(1)
    module = make_module(8, 2, **OPTIONS[option])
    cache = make_cache(2)
    manager = cache.make_manager(watermark=0.0)
    prompts = [random_seq(n, 8, 2, torch.float32, gen) for n in (5, 17, 40)]
    run_step(module, cache, manager, [(s, *p) for s, p in enumerate(prompts)])
    q, k, v = random_seq(3, 8, 2, torch.float32, gen)
    meta = cache.decode_metadata(manager, [0, 1, 2])
    assert meta.is_decode
    out = module(q, k, v, cache.layer(0), meta)
    want = torch.empty_like(q)
    reference.paged_attention_v1(
        want,
        q,
        *cache.layer(0),
        2,
        module.scale,
        meta.block_tables,
        meta.seq_lens_tensor,
        BLOCK,
        meta.max_seq_len,
        module.alibi_slopes,
        "auto",
        *cache.scales(0),
        module.sliding_window,
        module.logits_soft_cap,
        module.attention_chunk_size,
    )
    torch.testing.assert_close(out, want, **TOL[torch.float32])


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e5m2"])
def test_fp8_cache_prefill_and_decode(kv_cache_dtype):
    gen = torch.Generator().manual_seed(2)
    module = make_module(4, 2, kv_cache_dtype=kv_cache_dtype)
    cache = make_cache(2, torch.float32, kv_cache_dtype)
    assert cache.key_caches[0].dtype == torch.uint8
    manager = cache.make_manager(watermark=0.0)
    q, k, v = random_seq(21, 4, 2, torch.float32, gen)
    (out,) = run_step(module, cache, manager, [(0, q[:20], k[:20], v[:20])])
    want = oracle(module, q[:20], k, v, range(20), kv_cache_dtype, cache)
    torch.testing.assert_close(out, want, atol=2e-4, rtol=1e-4)
    (out,) = run_step(module, cache, manager, [(0, q[20:], k[20:], v[20:])])
    want = oracle(module, q[20:], k, v, [20], kv_cache_dtype, cache)
    torch.testing.assert_close(out, want, atol=2e-4, rtol=1e-4)


def test_prefill_equals_unpaged_sdpa_on_the_whole_sequence():
    gen = torch.Generator().manual_seed(3)
    module = PagedAttention(4, HEAD, 2)
    cache = make_cache(2)
    manager = cache.make_manager(watermark=0.0)
    q, k, v = random_seq(37, 4, 2, torch.float32, gen)
    outs = [
        run_step(module, cache, manager, [(0, q[a:b], k[a:b], v[a:b])])[0]
        for a, b in [(0, 10), (10, 11), (11, 37)]
    ]
    dense = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, enable_gqa=True
    ).transpose(0, 1)
    torch.testing.assert_close(torch.cat(outs), dense, **TOL[torch.float32])


def test_prefix_cache_hit_computes_only_the_suffix():
    gen = torch.Generator().manual_seed(4)
    module = make_module(4, 2)
    cache = make_cache(2)
    manager = cache.make_manager(watermark=0.0, enable_prefix_caching=True)
    prefix = list(range(100, 100 + 2 * BLOCK))
    tokens_a, tokens_b = prefix + [1, 2, 3], prefix + [7, 8, 9, 10, 11]
    qa, ka, va = random_seq(len(tokens_a), 4, 2, torch.float32, gen)
    qb, kb, vb = random_seq(len(tokens_b), 4, 2, torch.float32, gen)
    kb[: len(prefix)], vb[: len(prefix)] = ka[: len(prefix)], va[: len(prefix)]  # same tokens
    manager.allocate(0, tokens_a)
    module(qa, ka, va, cache.layer(0), cache.metadata(manager, [0], [len(tokens_a)]))
    manager.allocate(1, tokens_b)
    cached = manager.num_cached_tokens(1)
    assert cached == len(prefix)
    suffix = slice(cached, None)
    meta = cache.metadata(manager, [1], [len(tokens_b) - cached])
    assert meta.context_lens == [cached]
    out = module(qb[suffix], kb[suffix], vb[suffix], cache.layer(0), meta)
    want = oracle(module, qb[suffix], kb, vb, range(cached, len(tokens_b)))
    torch.testing.assert_close(out, want, **TOL[torch.float32])


def test_window_skips_released_blocks():
    gen = torch.Generator().manual_seed(5)
    window = 10
    module = make_module(4, 2, sliding_window=window)
    cache = make_cache(2, num_blocks=12)
    manager = cache.make_manager(watermark=0.0, sliding_window=window)
    q, k, v = random_seq(60, 4, 2, torch.float32, gen)
    done = 0
    for n in (12, 1, 20, 1, 1, 25):
        (out,) = run_step(
            module,
            cache,
            manager,
            [(0, q[done : done + n], k[done : done + n], v[done : done + n])],
        )
        want = oracle(module, q[done : done + n], k, v, range(done, done + n))
        torch.testing.assert_close(out, want, **TOL[torch.float32])
        done += n
    assert manager.stats().device.used_blocks <= math.ceil(window / BLOCK) + 4


def test_flat_query_layout_and_cached_only_forward():
    gen = torch.Generator().manual_seed(6)
    module = make_module(4, 2)
    cache = make_cache(2)
    manager = cache.make_manager(watermark=0.0)
    q, k, v = random_seq(9, 4, 2, torch.float32, gen)
    manager.allocate(0, 9)
    meta = cache.metadata(manager, [0], [9])
    out = module(q.flatten(1), k.flatten(1), v.flatten(1), cache.layer(0), meta)
    assert out.shape == (9, 4 * HEAD)
    again = module(q, None, None, cache.layer(0), meta)  # keys/values already cached
    torch.testing.assert_close(out.view(9, 4, HEAD), again, atol=0, rtol=0)


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="num_kv_heads"):
        PagedAttention(6, HEAD, 4)
    with pytest.raises(ValueError, match="sliding_window"):
        PagedAttention(4, HEAD, sliding_window=-1)
    with pytest.raises(ValueError, match="logits_soft_cap"):
        PagedAttention(4, HEAD, logits_soft_cap=-1.0)
    with pytest.raises(ValueError, match=r"attention_chunk_size must be >= 0 \(0 = none\)"):
        PagedAttention(4, HEAD, attention_chunk_size=-1)
    assert "attention_chunk_size=8192" in repr(PagedAttention(4, HEAD, attention_chunk_size=8192))
    with pytest.raises(ValueError, match="alibi_slopes"):
        PagedAttention(4, HEAD, alibi_slopes=[0.5, 0.25])
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        PagedAttention(4, HEAD, kv_cache_dtype="int8")
    module = make_module(4, 2)
    cache = make_cache(2)
    manager = cache.make_manager(watermark=0.0)
    manager.allocate(0, 3)
    meta = cache.metadata(manager, [0], [3])
    q, k, v = random_seq(4, 4, 2, torch.float32, torch.Generator().manual_seed(7))
    with pytest.raises(ValueError, match="metadata expects 3"):
        module(q, k, v, cache.layer(0), meta)
    with pytest.raises(ValueError, match="both key and value"):
        module(q[:3], k[:3], None, cache.layer(0), meta)


def test_metadata_validation():
    tables = torch.zeros(2, 3, dtype=torch.int32)
    with pytest.raises(ValueError, match="one entry per sequence"):
        AttentionMetadata.build([1], [4, 5], tables, torch.zeros(1, dtype=torch.int64))
    with pytest.raises(ValueError, match="query_len"):
        AttentionMetadata.build([6, 1], [4, 5], tables, torch.zeros(7, dtype=torch.int64))
    with pytest.raises(ValueError, match="one slot per new token"):
        AttentionMetadata.build([2, 1], [4, 5], tables, torch.zeros(2, dtype=torch.int64))
    meta = AttentionMetadata.build([2, 1], [4, 5], tables, torch.zeros(3, dtype=torch.int64))
    assert meta.num_seqs == 2 and meta.num_tokens == 3 and meta.max_seq_len == 5
    assert meta.context_lens == [2, 4] and not meta.is_decode


class TinySelfAttention(torch.nn.Module):
    """A user's own attention layer on PagedAttention (the example of docs/integration.md)."""

    def __init__(self, hidden: int, num_heads: int, num_kv_heads: int):
        super().__init__()
        self.q_proj = torch.nn.Linear(hidden, num_heads * HEAD, bias=False)
        self.kv_proj = torch.nn.Linear(hidden, 2 * num_kv_heads * HEAD, bias=False)
        self.o_proj = torch.nn.Linear(num_heads * HEAD, hidden, bias=False)
        self.attn = PagedAttention(num_heads, HEAD, num_kv_heads)

    def forward(self, x, kv_cache, metadata):  # x: [num_tokens, hidden], packed
        k, v = self.kv_proj(x).chunk(2, dim=-1)
        return self.o_proj(self.attn(self.q_proj(x), k, v, kv_cache, metadata))


def test_a_users_own_model_decodes_like_full_recompute():
    torch.manual_seed(8)
    hidden, layer = 48, TinySelfAttention(48, 4, 2)
    cache = PagedKVCache(1, 2, HEAD, BLOCK, num_blocks=32, dtype=torch.float32)
    manager = cache.make_manager(watermark=0.0)
    xs = {0: torch.randn(13, hidden), 1: torch.randn(4, hidden)}
    with torch.no_grad():
        for seq_id, x in xs.items():  # prefill each prompt
            manager.allocate(seq_id, x.shape[0])
            layer(x, cache.layer(0), cache.metadata(manager, [seq_id], x.shape[0]))
        for _ in range(12):  # decode both sequences together
            new = torch.randn(2, hidden)
            out = layer(new, cache.layer(0), cache.decode_metadata(manager, [0, 1]))
            for i, seq_id in enumerate(xs):
                xs[seq_id] = torch.cat([xs[seq_id], new[i : i + 1]])
                q = layer.q_proj(xs[seq_id]).view(-1, 4, HEAD).transpose(0, 1)
                k, v = (
                    t.view(-1, 2, HEAD).transpose(0, 1)
                    for t in layer.kv_proj(xs[seq_id]).chunk(2, dim=-1)
                )
                full = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
                want = layer.o_proj(full.transpose(0, 1).reshape(-1, 4 * HEAD))[-1]
                torch.testing.assert_close(out[i], want, **TOL[torch.float32])


def test_unsupported_head_size_is_refused_at_construction():
    with pytest.raises(ValueError, match="head_size 48 is not supported"):
        PagedAttention(4, 48)
    with pytest.raises(ValueError, match="divisible by 16"):
        PagedAttention(4, 120, kv_cache_dtype="fp8")


def test_prefill_path_checks_block_tables_like_the_decode_path():
    module = make_module(4, 2)
    cache = make_cache(2, num_blocks=8)
    q, k, v = random_seq(5, 4, 2, torch.float32, torch.Generator().manual_seed(9))
    slots = torch.arange(5, dtype=torch.int64)
    for table, seq_len, message in [
        ([[-1, 0]], 5, r"block_tables\[0, 0\] = -1 is out of range"),
        ([[0, 8]], 12, r"block_tables\[0, 1\] = 8 is out of range"),
        ([[0]], 12, r"12\) exceeds what block_tables can address"),
    ]:
        meta = AttentionMetadata.build(
            [5], [seq_len], torch.tensor(table, dtype=torch.int32), slots
        )
        with pytest.raises(ValueError, match=message):
            module(q, k, v, cache.layer(0), meta)
        decode_meta = AttentionMetadata.build(
            [1], [seq_len], torch.tensor(table, dtype=torch.int32), slots[:1]
        )
        with pytest.raises((ValueError, RuntimeError)):  # the kernel's own checks
            module(q[:1], k[:1], v[:1], cache.layer(0), decode_meta)


@pytest.mark.parametrize("module_window", [0, 16])
def test_module_attending_further_back_than_its_manager_keeps_is_refused(module_window):
    module = make_module(4, 2, sliding_window=module_window)
    cache = make_cache(2)
    manager = cache.make_manager(watermark=0.0, sliding_window=4)
    manager.allocate(0, 3)
    q, k, v = random_seq(3, 4, 2, torch.float32, torch.Generator().manual_seed(10))
    with pytest.raises(ValueError, match="keeps only the last 4"):
        module(q, k, v, cache.layer(0), cache.metadata(manager, [0], 3))
    narrower = make_module(4, 2, sliding_window=4)  # attends no further back than kept
    narrower(q, k, v, cache.layer(0), cache.metadata(manager, [0], 3))


def test_a_chunked_module_reads_within_its_managers_window():
    """A chunk of C positions reads at most C back: a manager window of at least C suffices."""
    cache = make_cache(2)
    manager = cache.make_manager(watermark=0.0, sliding_window=8)
    manager.allocate(0, 3)
    q, k, v = random_seq(3, 4, 2, torch.float32, torch.Generator().manual_seed(10))
    make_module(4, 2, attention_chunk_size=8)(
        q, k, v, cache.layer(0), cache.metadata(manager, [0], 3)
    )
    with pytest.raises(ValueError, match="attends the last 9 position"):
        make_module(4, 2, attention_chunk_size=9)(
            q, k, v, cache.layer(0), cache.metadata(manager, [0], 3)
        )


@pytest.mark.parametrize(
    "options",
    [dict(), dict(attention_chunk_size=8), dict(attention_chunk_size=32), dict(sliding_window=4)],
    ids=str,
)
def test_module_reading_across_its_managers_chunks_is_refused(options):
    """A manager with chunks releases the blocks before the current chunk: only a module with
    the same chunk size reads nothing released."""
    cache = make_cache(2)
    manager = cache.make_manager(watermark=0.0)
    manager.allocate(0, 3)
    meta = dataclasses.replace(cache.metadata(manager, [0], 3), manager_chunk=16)
    q, k, v = random_seq(3, 4, 2, torch.float32, torch.Generator().manual_seed(10))
    with pytest.raises(ValueError, match="releases the blocks before the current chunk of 16"):
        make_module(4, 2, **options)(q, k, v, cache.layer(0), meta)
    same = make_module(4, 2, attention_chunk_size=16, sliding_window=5)
    same(q, k, v, cache.layer(0), meta)


def test_metadata_build_carries_the_managers_chunk():
    tables = torch.zeros(1, 1, dtype=torch.int32)
    meta = AttentionMetadata.build([1], [1], tables, torch.zeros(1, dtype=torch.int64))
    assert meta.manager_chunk is None
    meta = AttentionMetadata.build(
        [1], [1], tables, torch.zeros(1, dtype=torch.int64), manager_chunk=8192
    )
    assert meta.manager_chunk == 8192


def test_gradients_enabled_raise_instead_of_dropping_key_and_value_gradients():
    module = make_module(4, 2)
    cache = make_cache(2)
    manager = cache.make_manager(watermark=0.0)
    manager.allocate(0, 3)
    meta = cache.metadata(manager, [0], 3)
    q, k, v = random_seq(3, 4, 2, torch.float32, torch.Generator().manual_seed(11))
    k.requires_grad_(True)
    with pytest.raises(RuntimeError, match="inference-only"):
        module(q, k, v, cache.layer(0), meta)
    with torch.no_grad():
        module(q, k, v, cache.layer(0), meta)


def test_fp8_cache_needs_its_scales():
    module = make_module(4, 2, kv_cache_dtype="fp8")
    cache = make_cache(2, kv_cache_dtype="fp8")
    manager = cache.make_manager(watermark=0.0)
    manager.allocate(0, 3)
    q, k, v = random_seq(3, 4, 2, torch.float32, torch.Generator().manual_seed(12))
    with pytest.raises(ValueError, match="needs k_scale and v_scale"):
        module(q, k, v, cache.layer(0), cache.metadata(manager, [0], 3))


@pytest.mark.parametrize("option", list(OPTIONS))
def test_a_mixed_step_is_one_varlen_call(option, monkeypatch):
    # A fresh prompt, a chunk after a cached context and a decode in one step: one op call for
    # the whole step (no per-sequence launches); a decode-only step goes to the decode op, also
    # in one call.
    from paged_attention.ops import bindings as _ops

    calls = []
    for name in ("paged_attention_varlen", "paged_attention"):
        original = getattr(_ops, name)

        def counted(*args, _name=name, _original=original, **kwargs):
            calls.append(_name)
            return _original(*args, **kwargs)

        monkeypatch.setattr(_ops, name, counted)
    module = make_module(4, 2, **OPTIONS[option])
    cache = make_cache(2)
    manager = cache.make_manager(watermark=0.0)
    gen = torch.Generator().manual_seed(13)
    data = {s: random_seq(n, 4, 2, torch.float32, gen) for s, n in {0: 15, 1: 6, 2: 12}.items()}
    run_step(
        module, cache, manager, [(0, *(t[:9] for t in data[0])), (1, *(t[:5] for t in data[1]))]
    )
    assert calls == ["paged_attention_varlen"]
    calls.clear()
    step = [(0, *(t[9:] for t in data[0])), (1, *(t[5:] for t in data[1])), (2, *data[2])]
    outs = run_step(module, cache, manager, step)
    assert calls == ["paged_attention_varlen"]
    for (s, q, _, _), out, first in zip(step, outs, (9, 5, 0)):
        positions = range(first, first + q.shape[0])
        want = oracle(module, q, data[s][1], data[s][2], positions)
        torch.testing.assert_close(out, want, **TOL[torch.float32])
    calls.clear()
    extra = random_seq(1, 4, 2, torch.float32, gen)
    run_step(module, cache, manager, [(2, *extra)])
    assert calls == ["paged_attention"]
