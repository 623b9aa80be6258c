"""PagedKVCache: layout, sizing, and execution of the block manager's copy and swap plans."""

from __future__ import annotations

import os

import pytest
import torch

from paged_attention.kv.block_manager import BlockManager
from paged_attention.kv.cache import PagedKVCache, advise_huge_pages, bytes_per_block
from paged_attention.ops import bindings as _ops
from paged_attention.ops import reference

LAYERS, KV_HEADS, HEAD, BLOCK = 3, 2, 32, 8


def make_cache(**kwargs) -> PagedKVCache:
    args = dict(num_blocks=12, dtype=torch.float32, num_host_blocks=6)
    args.update(kwargs)
    return PagedKVCache(LAYERS, KV_HEADS, HEAD, BLOCK, **args)


def fill_random(cache: PagedKVCache, generator_seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(generator_seed)
    for tensor in (*cache.key_caches, *cache.value_caches):
        tensor.copy_(torch.randn(tensor.shape, generator=gen).to(tensor.dtype))


@pytest.mark.parametrize(
    "dtype, kv_cache_dtype, x, storage",
    [
        (torch.float32, "auto", 4, torch.float32),
        (torch.float16, "auto", 8, torch.float16),
        (torch.bfloat16, "auto", 8, torch.bfloat16),
        (torch.float16, "fp8", 16, torch.uint8),
        (torch.float32, "fp8_e5m2", 16, torch.uint8),
    ],
)
def test_layout_matches_design(dtype, kv_cache_dtype, x, storage):
    cache = make_cache(dtype=dtype, kv_cache_dtype=kv_cache_dtype, num_blocks=5)
    assert len(cache.key_caches) == len(cache.value_caches) == LAYERS
    for key_cache, value_cache in (cache.layer(i) for i in range(LAYERS)):
        assert key_cache.shape == (5, KV_HEADS, HEAD // x, BLOCK, x)
        assert value_cache.shape == (5, KV_HEADS, HEAD, BLOCK)
        assert key_cache.dtype == value_cache.dtype == storage
        assert key_cache.is_contiguous() and value_cache.is_contiguous()
    element = torch.empty((), dtype=storage).element_size()
    assert cache.bytes_per_block == 2 * LAYERS * KV_HEADS * HEAD * BLOCK * element
    held = sum(t.numel() * t.element_size() for t in (*cache.key_caches, *cache.value_caches))
    assert held == cache.device_bytes == 5 * cache.bytes_per_block
    for scale in cache.scales(LAYERS - 1):
        assert scale.dtype == torch.float32 and scale.shape == (1,)


def test_fp8_scales_are_given_or_calibrated_per_layer():
    fixed = make_cache(kv_cache_dtype="fp8", k_scale=0.5, v_scale=0.25)
    assert [s.item() for s in fixed.scales(1)] == [0.5, 0.25]
    fixed.calibrate(1, torch.full((3, KV_HEADS, HEAD), 100.0), torch.ones(3, KV_HEADS, HEAD))
    assert [s.item() for s in fixed.scales(1)] == [0.5, 0.25]  # given scales stay
    calibrated = make_cache(kv_cache_dtype="fp8_e4m3")
    key = torch.randn(5, KV_HEADS, HEAD) * 30
    value = torch.randn(5, KV_HEADS, HEAD)
    calibrated.calibrate(0, key, value)
    k_scale, v_scale = calibrated.scales(0)
    assert k_scale.item() == pytest.approx(key.abs().max().item() * 4 / 448)
    assert v_scale.item() == pytest.approx(value.abs().max().item() * 4 / 448)
    assert [s.item() for s in calibrated.scales(1)] == [1.0, 1.0]  # not calibrated yet
    calibrated.calibrate(0, key * 10, value * 10)  # only the first keys and values count
    assert calibrated.scales(0)[0].item() == k_scale.item()
    auto = make_cache()
    auto.calibrate(0, key, value)
    assert [s.item() for s in auto.scales(0)] == [1.0, 1.0]
    with pytest.raises(ValueError, match="give both k_scale and v_scale"):
        make_cache(kv_cache_dtype="fp8", k_scale=0.5)
    with pytest.raises(ValueError, match="k_scale must be a positive finite number"):
        make_cache(kv_cache_dtype="fp8", k_scale=0.0, v_scale=1.0)


def test_layers_are_views_of_one_allocation():
    cache = make_cache()
    (keys,) = cache._key_groups
    keys.zero_()
    cache.key_caches[1][3].fill_(7.0)
    assert keys[1, 3].eq(7.0).all() and not keys[0].any()


def test_layers_of_different_shapes_each_get_their_own():
    # Layers 0 and 2: 2 KV heads of 32; layer 1: 1 KV head of 64 (per-layer shapes).
    cache = PagedKVCache(
        3, [2, 1, 2], [32, 64, 32], BLOCK, 6, dtype=torch.float32, num_host_blocks=3
    )
    assert cache.layer_shapes == ((2, 32, 32), (1, 64, 64), (2, 32, 32))
    assert cache.num_kv_heads == (2, 1, 2) and cache.head_size == (32, 64, 32)
    assert [tuple(k.shape) for k in cache.key_caches] == [
        (6, 2, 8, BLOCK, 4),
        (6, 1, 16, BLOCK, 4),
        (6, 2, 8, BLOCK, 4),
    ]
    assert cache.value_caches[1].shape == (6, 1, 64, BLOCK)
    assert len(cache._key_groups) == 2  # one allocation per shape
    assert cache.bytes_per_block == 2 * (2 * 32 + 64 + 2 * 32) * BLOCK * 4
    assert cache.bytes_per_block == bytes_per_block(
        3, [2, 1, 2], [32, 64, 32], BLOCK, torch.float32
    )
    fill_random(cache, 4)
    expected = [t[2].clone() for t in (*cache.key_caches, *cache.value_caches)]
    cache.copy_blocks([(2, 5)])
    assert all(
        torch.equal(t[5], want)
        for t, want in zip((*cache.key_caches, *cache.value_caches), expected)
    )
    cache.swap_out([(5, 1)])
    for layer in range(3):
        cache.key_caches[layer][5] = 0
    cache.swap_in([(1, 0)])
    assert all(torch.equal(t[0], want) for t, want in zip(cache.key_caches, expected))
    with pytest.raises(ValueError, match="one per layer"):
        PagedKVCache(3, [2, 1], 32, BLOCK, 4)
    with pytest.raises(ValueError, match="head_size 48 is not supported"):
        PagedKVCache(2, 1, [32, 48], BLOCK, 4)


def test_values_of_their_own_head_size():
    """Multi-head latent attention through the attention interface: keys of 192 dims (128 +
    the rotary 64), values of 128, per layer; copy-on-write and swaps move both."""
    cache = PagedKVCache(
        3, 4, [192, 192, 64], BLOCK, 6, dtype=torch.bfloat16, num_host_blocks=3,
        v_head_size=[128, 128, 64],
    )  # fmt: skip
    assert cache.layer_shapes == ((4, 192, 128), (4, 192, 128), (4, 64, 64))
    assert cache.head_size == (192, 192, 64) and cache.v_head_size == (128, 128, 64)
    assert cache.key_caches[0].shape == (6, 4, 24, BLOCK, 8)
    assert cache.value_caches[0].shape == (6, 4, 128, BLOCK)
    assert cache.value_caches[2].shape == (6, 4, 64, BLOCK)
    assert len(cache._value_groups) == 2
    # KV bytes per token: (192 + 128) x 4 heads x 2 bytes in each latent layer.
    per_token = 2 * 4 * (192 + 128) * 2 + 4 * (64 + 64) * 2
    assert cache.bytes_per_block == per_token * BLOCK
    assert cache.bytes_per_block == bytes_per_block(
        3, 4, [192, 192, 64], BLOCK, torch.bfloat16, v_head_size=[128, 128, 64]
    )
    fill_random(cache, 4)
    expected = [t[2].clone() for t in (*cache.key_caches, *cache.value_caches)]
    cache.copy_blocks([(2, 5)])
    both = (*cache.key_caches, *cache.value_caches)
    assert all(torch.equal(t[5], want) for t, want in zip(both, expected))
    cache.swap_out([(5, 1)])
    for t in both:
        t[0] = 0
    cache.swap_in([(1, 0)])
    assert all(torch.equal(t[0], want) for t, want in zip(both, expected))
    one = PagedKVCache(1, 2, 192, BLOCK, 4, v_head_size=128)
    assert one.v_head_size == 128 and one.value_caches[0].shape == (4, 2, 128, BLOCK)
    assert PagedKVCache(1, 2, 64, BLOCK, 4).v_head_size == 64  # default: the keys' size
    with pytest.raises(ValueError, match="v_head_size 48 is not supported"):
        PagedKVCache(1, 1, 192, BLOCK, 4, v_head_size=48)
    with pytest.raises(ValueError, match="needs a v_head_size divisible by 16, got 120"):
        PagedKVCache(1, 1, 192, BLOCK, 4, kv_cache_dtype="fp8", v_head_size=120)
    with pytest.raises(ValueError, match="v_head_size must be one value or one per layer"):
        PagedKVCache(2, 1, 192, BLOCK, 4, v_head_size=[128])


def vma_flags(address: int) -> list[str]:
    """The VmFlags of the mapping of this process that holds ``address`` (Linux)."""
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            first = line.split()[0]
            if "-" in first and ":" not in first:
                low, high = (int(part, 16) for part in first.split("-"))
                inside = low <= address < high
            elif inside and first == "VmFlags:":
                return line.split()[1:]
    raise LookupError(f"no mapping holds {address:#x}")


@pytest.mark.skipif(
    not os.path.exists("/sys/kernel/mm/transparent_hugepage/enabled"),
    reason="needs Linux with transparent huge pages",
)
def test_cpu_caches_are_advised_to_use_huge_pages():
    cache = make_cache(num_blocks=2048)  # 3 layers x 2048 blocks x 2 KiB: 12 MiB per kind
    for tensor in (*cache._key_groups, *cache._value_groups):
        huge = 2 << 20
        first_huge_page = -(-tensor.data_ptr() // huge) * huge
        assert "hg" in vma_flags(first_huge_page)  # MADV_HUGEPAGE is set on the mapping
    small = torch.empty(1024)
    assert not advise_huge_pages(small)  # spans no whole 2 MiB page
    assert not advise_huge_pages(torch.empty(0))


def _resident_bytes() -> int:
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs Linux's /proc")
def test_a_cpu_cache_touches_no_memory_before_tokens_are_stored():
    """The budget is reserved, not written: resident memory grows with the tokens stored."""
    before = _resident_bytes()
    cache = make_cache(num_blocks=16384, num_host_blocks=0)  # 3 layers x 2 KiB x 16384: 192 MiB
    assert cache.device_bytes == 192 * 2**20
    assert _resident_bytes() - before < 32 * 2**20
    cache.key_caches[0][:4096].fill_(1.0)  # a quarter of one layer's keys: 8 MiB
    assert _resident_bytes() - before >= 6 * 2**20


def test_sized_from_memory_budget():
    per_block = bytes_per_block(LAYERS, KV_HEADS, HEAD, BLOCK, torch.float16)
    cache = PagedKVCache(LAYERS, KV_HEADS, HEAD, BLOCK, memory_budget=10 * per_block + 5)
    assert cache.num_blocks == 10 and cache.device_bytes <= 10 * per_block + 5
    half = PagedKVCache(
        LAYERS, KV_HEADS, HEAD, BLOCK, memory_budget=10 * per_block, memory_fraction=0.5
    )
    assert half.num_blocks == 5


def test_sized_from_fraction_of_host_memory(monkeypatch):
    per_block = bytes_per_block(LAYERS, KV_HEADS, HEAD, BLOCK, torch.float32)
    monkeypatch.setattr("paged_attention.kv.cache._host_available_bytes", lambda: 40 * per_block)
    cache = PagedKVCache(LAYERS, KV_HEADS, HEAD, BLOCK, dtype=torch.float32, memory_fraction=0.25)
    assert cache.num_blocks == 10


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(), "num_blocks, memory_budget"),
        (dict(num_blocks=4, memory_budget=1 << 20), "not both"),
        (dict(memory_budget=100), "holds no KV block"),
        (dict(memory_fraction=1.5, memory_budget=1 << 20), "memory_fraction"),
        (dict(num_blocks=0), "num_blocks must be positive"),
        (dict(num_blocks=4, num_host_blocks=-1), "num_host_blocks"),
        (dict(num_blocks=4, kv_cache_dtype="int4"), "kv_cache_dtype"),
        (dict(num_blocks=4, dtype=torch.int32), "dtype"),
    ],
)
def test_bad_sizes_raise(kwargs, message):
    with pytest.raises(ValueError, match=message):
        PagedKVCache(LAYERS, KV_HEADS, HEAD, BLOCK, **kwargs)


def test_head_size_must_fit_the_key_tiling():
    with pytest.raises(ValueError, match="divisible by 16"):
        PagedKVCache(1, 1, 120, BLOCK, 4, kv_cache_dtype="fp8")


def test_a_cache_read_without_the_kernels_takes_other_head_sizes():
    """Multi-head latent attention's latent form (rotary keys of 64, latents of 512) reads its
    cache with PyTorch: any head size whose keys fill 16-byte chunks."""
    with pytest.raises(ValueError, match="v_head_size 512 is not supported"):
        PagedKVCache(1, 1, 64, BLOCK, 4, v_head_size=512)
    kv = PagedKVCache(1, 1, 64, BLOCK, 4, v_head_size=512, kernels_read=False)
    assert kv.value_caches[0].shape == (4, 1, 512, BLOCK)
    with pytest.raises(ValueError, match="head_size 6 does not fill"):
        PagedKVCache(1, 1, 6, BLOCK, 4, dtype=torch.float32, kernels_read=False)


@pytest.mark.parametrize(
    "head_size, block_size, message",
    [
        (48, BLOCK, "head_size 48 is not supported"),
        (20, BLOCK, "head_size 20"),
        (HEAD, 7, "block_size 7 is not supported"),
        (HEAD, 64, "supported: 8, 16, 32"),
    ],
)
def test_configurations_the_kernels_cannot_serve_are_refused_at_construction(
    head_size, block_size, message
):
    with pytest.raises(ValueError, match=message):
        PagedKVCache(1, 1, head_size, block_size, 4, dtype=torch.float32)


def test_metadata_from_a_manager_of_another_geometry_is_refused():
    cache = PagedKVCache(1, KV_HEADS, HEAD, BLOCK, 8, dtype=torch.float32)
    other = BlockManager(8, 2 * BLOCK)
    other.allocate(0, 5)
    with pytest.raises(ValueError, match="make_manager"):
        cache.metadata(other, [0], 5)
    with pytest.raises(ValueError, match="make_manager"):
        cache.decode_metadata(other, [0])
    assert other.num_tokens(0) == 5  # refused before the decode step reserved anything


def test_copy_blocks_copies_every_layer_in_one_call(monkeypatch):
    cache = make_cache()
    fill_random(cache)
    expected_k = [t.clone() for t in cache.key_caches]
    expected_v = [t.clone() for t in cache.value_caches]
    pairs = [(0, 5), (0, 6), (3, 1)]  # fan-out of one source to two destinations
    reference.copy_blocks(expected_k, expected_v, BlockManager.mapping_tensor(pairs))
    calls = []
    real = _ops.copy_blocks
    monkeypatch.setattr(_ops, "copy_blocks", lambda *a: calls.append(a) or real(*a))
    cache.copy_blocks(pairs)
    assert len(calls) == 1
    for got, want in zip((*cache.key_caches, *cache.value_caches), (*expected_k, *expected_v)):
        assert torch.equal(got, want)
    cache.copy_blocks([])
    assert len(calls) == 1  # nothing to copy, no call


def test_swap_out_and_in_round_trip_through_the_manager():
    cache = make_cache()
    fill_random(cache, 1)
    manager = cache.make_manager(watermark=0.0)
    manager.allocate(0, 3 * BLOCK - 2)
    manager.allocate(1, BLOCK + 1)
    manager.fork(0, 2)  # shares all of seq 0's blocks: they must move once and stay shared
    before = {
        s: [
            reference.gather_kv(k, v, torch.tensor(manager.block_table(s)), manager.num_tokens(s))
            for k, v in (cache.layer(i) for i in range(LAYERS))
        ]
        for s in (0, 1, 2)
    }
    out_pairs = manager.swap_out([0, 2])
    assert len(out_pairs) == 3
    cache.swap_out(out_pairs)
    for device_block, host_block in out_pairs:
        for layer in range(LAYERS):
            assert torch.equal(
                cache.host_key_caches[layer][host_block], cache.key_caches[layer][device_block]
            )
        for layer in range(LAYERS):
            cache.key_caches[layer][device_block] = 0
            cache.value_caches[layer][device_block] = 0
    manager.allocate(3, 2 * BLOCK)  # takes freed device blocks, so swap-in lands elsewhere
    in_pairs = manager.swap_in([0, 2])
    cache.swap_in(in_pairs)
    for s in (0, 1, 2):
        table = torch.tensor(manager.block_table(s))
        for layer, (keys, values) in enumerate(before[s]):
            k, v = reference.gather_kv(*cache.layer(layer), table, manager.num_tokens(s))
            assert torch.equal(k, keys) and torch.equal(v, values)
    assert manager.block_table(0) == manager.block_table(2)


def test_swap_without_host_blocks_raises():
    cache = make_cache(num_host_blocks=0)
    with pytest.raises(ValueError, match="num_host_blocks"):
        cache.swap_out([(0, 0)])


def test_copy_blocks_accepts_a_mapping_tensor():
    cache = make_cache()
    fill_random(cache, 2)
    cache.copy_blocks(torch.tensor([[2, 9]]))
    assert torch.equal(cache.value_caches[2][9], cache.value_caches[2][2])


def test_metadata_from_the_manager():
    cache = make_cache()
    manager = cache.make_manager(watermark=0.0)
    manager.allocate(0, 11)
    manager.allocate(1, 4)
    manager.append_slots(1, 2)
    meta = cache.metadata(manager, [0, 1], [11, 2])
    assert meta.query_lens == [11, 2] and meta.seq_lens == [11, 6]
    assert meta.context_lens == [0, 4] and meta.max_seq_len == 11 and not meta.is_decode
    assert meta.block_tables.dtype == torch.int32 and meta.slot_mapping.dtype == torch.int64
    table0, table1 = manager.block_table(0), manager.block_table(1)
    expected = [table0[p // BLOCK] * BLOCK + p % BLOCK for p in range(11)]
    expected += [table1[0] * BLOCK + p for p in (4, 5)]
    assert meta.slot_mapping.tolist() == expected
    assert meta.block_tables[0, :2].tolist() == table0
    assert meta.seq_lens_tensor.tolist() == [11, 6]


def test_decode_metadata_runs_copy_on_write():
    cache = make_cache()
    fill_random(cache, 3)
    manager = cache.make_manager(watermark=0.0)
    manager.allocate(0, BLOCK + 3)  # last block partly filled
    manager.fork(0, 1)
    shared_last = manager.block_table(0)[-1]
    meta = cache.decode_metadata(manager, [0, 1])
    assert meta.is_decode and meta.seq_lens == [BLOCK + 4] * 2
    tables = [manager.block_table(0), manager.block_table(1)]
    assert tables[0][0] == tables[1][0]  # the full block stays shared
    copies = [t[-1] for t in tables if t[-1] != shared_last]
    assert len(copies) == 1  # exactly one of the two got a private copy
    for layer in range(LAYERS):
        assert torch.equal(cache.key_caches[layer][copies[0]], cache.key_caches[layer][shared_last])
        assert torch.equal(
            cache.value_caches[layer][copies[0]], cache.value_caches[layer][shared_last]
        )
    slots = meta.slot_mapping.tolist()
    assert slots == [t[-1] * BLOCK + 3 for t in tables]
