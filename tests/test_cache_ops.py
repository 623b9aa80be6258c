"""CPU cache ops (reshape_and_cache, copy_blocks, swap_blocks) against reference.py, bit for bit,
and their argument checks."""

import pytest
import torch

import paged_attention.ops.bindings  # registers torch.ops.paged_attention
from paged_attention.ops import reference

ops = torch.ops.paged_attention
CACHE_DTYPES = [
    (torch.float32, "auto"),
    (torch.float16, "auto"),
    (torch.bfloat16, "auto"),
    (torch.bfloat16, "fp8_e4m3"),
    (torch.float16, "fp8_e5m2"),
    (torch.float32, "fp8"),
]


def _caches(
    num_blocks, num_kv_heads, head_size, block_size, dtype, kv_cache_dtype, seed=0, v_head_size=None
):
    """Random key and value caches; values of ``v_head_size`` dims where given."""
    v_head_size = v_head_size or head_size
    cache_dtype = dtype if kv_cache_dtype == "auto" else torch.uint8
    x = 16 // torch.empty((), dtype=cache_dtype).element_size()
    gen = torch.Generator().manual_seed(seed)
    key_cache = torch.randint(0, 100, (num_blocks, num_kv_heads, head_size // x, block_size, x),
                              generator=gen).to(cache_dtype)  # fmt: skip
    value_cache = torch.randint(0, 100, (num_blocks, num_kv_heads, v_head_size, block_size),
                                generator=gen).to(cache_dtype)  # fmt: skip
    return key_cache, value_cache


def _assert_same_bits(actual, expected):
    assert actual.dtype == expected.dtype
    assert torch.equal(actual.view(torch.uint8), expected.view(torch.uint8))


@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("dtype,kv_cache_dtype", CACHE_DTYPES)
@pytest.mark.parametrize("num_blocks", [1, 10000])
def test_reshape_and_cache_matches_reference(block_size, dtype, kv_cache_dtype, num_blocks):
    num_kv_heads, head_size = (2, 64) if num_blocks < 100 else (1, 32)
    num_tokens = min(num_blocks * block_size, 200)
    key_cache, value_cache = _caches(
        num_blocks, num_kv_heads, head_size, block_size, dtype, kv_cache_dtype
    )
    # Keys and values are slices of one fused QKV tensor, so they are not contiguous.
    qkv = torch.randn(num_tokens, 3, num_kv_heads, head_size).to(dtype) * 40
    key, value = qkv[:, 1], qkv[:, 2]
    slots = torch.randperm(num_blocks * block_size)[:num_tokens]
    slots[::7] = -1  # padding tokens are skipped
    k_scale, v_scale = torch.tensor([0.7]), torch.tensor([1.3])

    expected_k, expected_v = key_cache.clone(), value_cache.clone()
    reference.reshape_and_cache(
        key, value, expected_k, expected_v, slots, kv_cache_dtype, k_scale, v_scale
    )
    ops.reshape_and_cache(key, value, key_cache, value_cache, slots, kv_cache_dtype, k_scale,
                          v_scale)  # fmt: skip
    _assert_same_bits(key_cache, expected_k)
    _assert_same_bits(value_cache, expected_v)


@pytest.mark.parametrize(
    "head_size, v_head_size", [(192, 128), (128, 192), (64, 128), (128, 64), (192, 64)], ids=str
)
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("dtype,kv_cache_dtype", CACHE_DTYPES[1:5])
def test_reshape_and_cache_of_values_of_their_own_head_size(
    head_size, v_head_size, block_size, dtype, kv_cache_dtype
):
    """Multi-head latent attention stores keys and values of different head sizes (192 and 128
    in DeepSeek-V3), each in its own layout, as the reference does, bit for bit."""
    key_cache, value_cache = _caches(12, 2, head_size, block_size, dtype, kv_cache_dtype,
                                     v_head_size=v_head_size)  # fmt: skip
    key = (torch.randn(40, 2, head_size) * 30).to(dtype)
    value = (torch.randn(40, 2, v_head_size) * 30).to(dtype)
    slots = torch.randperm(12 * block_size)[:40]
    slots[::5] = -1
    k_scale, v_scale = torch.tensor([0.7]), torch.tensor([1.3])
    expected_k, expected_v = key_cache.clone(), value_cache.clone()
    reference.reshape_and_cache(
        key, value, expected_k, expected_v, slots, kv_cache_dtype, k_scale, v_scale
    )
    paged_attention.reshape_and_cache(
        key, value, key_cache, value_cache, slots, kv_cache_dtype, k_scale, v_scale
    )
    _assert_same_bits(key_cache, expected_k)
    _assert_same_bits(value_cache, expected_v)


def test_values_of_their_own_head_size_round_trip_and_copy_and_swap():
    key_cache, value_cache = _caches(8, 2, 192, 16, torch.bfloat16, "auto", v_head_size=128)
    key = torch.randn(20, 2, 192, dtype=torch.bfloat16)
    value = torch.randn(20, 2, 128, dtype=torch.bfloat16)
    block_table = torch.tensor([5, 2], dtype=torch.int32)
    positions = torch.arange(20)
    slots = block_table[positions // 16].long() * 16 + positions % 16
    paged_attention.reshape_and_cache(key, value, key_cache, value_cache, slots)
    keys, values = reference.gather_kv(key_cache, value_cache, block_table, 20, start=3)
    assert torch.equal(keys[3:], key[3:].float()) and torch.equal(values[3:], value[3:].float())
    assert values.shape == (20, 2, 128) and not values[:3].any()
    # copy_blocks: every layer's keys and values, of their own sizes, in one call.
    layers = [_caches(8, 2, 192, 16, torch.bfloat16, "auto", i, 128) for i in range(2)]
    expected = [[t.clone() for t in layer] for layer in layers]
    mapping = torch.tensor([[5, 0], [5, 1], [2, 7]])
    reference.copy_blocks(*zip(*expected), mapping)
    paged_attention.copy_blocks([k for k, _ in layers], [v for _, v in layers], mapping)
    for layer, wanted in zip(layers, expected):
        for actual, want in zip(layer, wanted):
            _assert_same_bits(actual, want)
    host = torch.zeros(3, 2, 128, 16, dtype=torch.bfloat16)
    paged_attention.swap_blocks(value_cache, host, torch.tensor([[5, 2]]))
    assert torch.equal(host[2], value_cache[5])


def test_reshape_and_cache_then_gather_returns_the_tokens():
    key_cache, value_cache = _caches(8, 2, 64, 16, torch.float16, "auto")
    key = torch.randn(20, 2, 64, dtype=torch.float16)
    value = torch.randn(20, 2, 64, dtype=torch.float16)
    block_table = torch.tensor([5, 2], dtype=torch.int32)
    positions = torch.arange(20)
    slots = block_table[positions // 16].long() * 16 + positions % 16
    paged_attention.reshape_and_cache(key, value, key_cache, value_cache, slots)
    keys, values = reference.gather_kv(key_cache, value_cache, block_table, 20)
    assert torch.equal(keys, key.float()) and torch.equal(values, value.float())


@pytest.mark.parametrize("dtype,kv_cache_dtype", CACHE_DTYPES[:2] + CACHE_DTYPES[3:4])
def test_copy_blocks_fans_out_across_layers(dtype, kv_cache_dtype):
    layers = [_caches(12, 2, 32, 16, dtype, kv_cache_dtype, seed=i) for i in range(3)]
    key_caches = [k for k, _ in layers]
    value_caches = [v for _, v in layers]
    # One source copied to several destinations, as a fork followed by writes does.
    mapping = torch.tensor([[3, 7], [3, 8], [3, 9], [0, 11]], dtype=torch.int64)
    expected_k = [k.clone() for k in key_caches]
    expected_v = [v.clone() for v in value_caches]
    reference.copy_blocks(expected_k, expected_v, mapping)
    paged_attention.copy_blocks(key_caches, value_caches, mapping)
    for actual, expected in zip(key_caches + value_caches, expected_k + expected_v):
        _assert_same_bits(actual, expected)
    assert torch.equal(key_caches[1][7], key_caches[1][3])


def test_copy_blocks_with_no_layers_or_pairs_is_a_no_op():
    key_cache, value_cache = _caches(4, 1, 32, 8, torch.float32, "auto")
    before = key_cache.clone()
    paged_attention.copy_blocks([], [], torch.zeros(0, 2, dtype=torch.int64))
    paged_attention.copy_blocks([key_cache], [value_cache], torch.zeros(0, 2, dtype=torch.int64))
    assert torch.equal(key_cache, before)


def test_swap_blocks_between_pools_of_different_sizes():
    host = torch.randn(10, 2, 64, 16)
    device = torch.zeros(4, 2, 64, 16)
    mapping = torch.tensor([[9, 0], [2, 3]])
    expected = device.clone()
    reference.swap_blocks(host, expected, mapping)
    paged_attention.swap_blocks(host, device, mapping)
    assert torch.equal(device, expected)
    back = torch.zeros_like(host)
    paged_attention.swap_blocks(device, back, torch.tensor([[0, 9], [3, 2]]))
    assert torch.equal(back[9], host[9]) and torch.equal(back[2], host[2])


def test_swap_blocks_of_a_strided_cache_view():
    # key and value caches of one layer stored as one tensor [num_blocks, 2, ...]
    kv = torch.randn(6, 2, 4, 16)
    dst = torch.zeros(6, 4, 16)
    paged_attention.swap_blocks(kv[:, 1], dst, torch.tensor([[5, 0]]))
    assert torch.equal(dst[0], kv[5, 1])


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e5m2"])
def test_opcheck_cache_ops(kv_cache_dtype):
    key_cache, value_cache = _caches(8, 2, 64, 16, torch.float16, kv_cache_dtype)
    key = torch.randn(5, 2, 64, dtype=torch.float16)
    value = torch.randn(5, 2, 64, dtype=torch.float16)
    slots = torch.tensor([0, 17, -1, 40, 127])
    scale = torch.ones(1)
    torch.library.opcheck(
        ops.reshape_and_cache,
        (key, value, key_cache, value_cache, slots, kv_cache_dtype, scale, scale),
    )
    mapping = torch.tensor([[1, 2], [1, 3]])
    torch.library.opcheck(ops.copy_blocks, ([key_cache], [value_cache], mapping))
    torch.library.opcheck(ops.swap_blocks, (key_cache, key_cache.clone(), mapping))
    key_cache, value_cache = _caches(8, 2, 192, 16, torch.float16, kv_cache_dtype, v_head_size=128)
    value = torch.randn(5, 2, 128, dtype=torch.float16)
    key = torch.randn(5, 2, 192, dtype=torch.float16)
    torch.library.opcheck(
        ops.reshape_and_cache,
        (key, value, key_cache, value_cache, slots, kv_cache_dtype, scale, scale),
    )
    torch.library.opcheck(ops.copy_blocks, ([key_cache], [value_cache], mapping))


# --------------------------------------------------------------------------------------------
# Bad input: a clear error naming the argument, and the cache left untouched.


def _reshape_args(**overrides):
    key_cache, value_cache = _caches(4, 2, 64, 16, torch.float16, "auto")
    args = dict(
        key=torch.randn(3, 2, 64, dtype=torch.float16),
        value=torch.randn(3, 2, 64, dtype=torch.float16),
        key_cache=key_cache,
        value_cache=value_cache,
        slot_mapping=torch.tensor([0, 1, 2]),
        kv_cache_dtype="auto",
        k_scale=torch.ones(1),
        v_scale=torch.ones(1),
    )
    args.update(overrides)
    return args


@pytest.mark.parametrize(
    "overrides,message",
    [
        ({"key": torch.randn(3, 2, 64)}, "value must have the dtype of key"),
        ({"key": torch.randn(3, 128, dtype=torch.float16)}, "key must be 3-D"),
        ({"key": torch.randint(0, 3, (3, 2, 64))}, "key must be float32, float16 or bfloat16"),
        ({"value": torch.randn(3, 2, 32, dtype=torch.float16)},
         r"value_cache must have shape \[num_blocks, num_kv_heads, v_head_size, block_size\] = "
         r"\[4, 2, 32, 16\]"),
        ({"value": torch.randn(2, 2, 64, dtype=torch.float16)},
         "value must have key's tokens and heads"),
        ({"value": torch.randn(3, 2, 36, dtype=torch.float16),
          "value_cache": torch.zeros(4, 2, 36, 16, dtype=torch.float16)},
         r"v_head_size \(value_cache.size\(2\) = 36\) must be a multiple of x"),
        ({"slot_mapping": torch.tensor([0, 1, 64])}, r"slot_mapping\[2\] = 64 is out of range"),
        ({"slot_mapping": torch.tensor([5, -1, 5])}, r"slot_mapping\[2\] = 5 repeats"),
        ({"slot_mapping": torch.tensor([0, 1], dtype=torch.int64)}, "slot_mapping must have"),
        ({"slot_mapping": torch.tensor([0, 1, 2], dtype=torch.int32)}, "slot_mapping must be Long"),
        ({"kv_cache_dtype": "fp4"}, "kv_cache_dtype must be one of"),
        ({"kv_cache_dtype": "fp8"}, "key_cache must be Byte"),
        ({"key_cache": torch.zeros(4, 2, 8, 8, 8, dtype=torch.float16)}, "key_cache must be 5-D"),
        ({"key_cache": torch.zeros(4, 3, 8, 16, 8, dtype=torch.float16)}, "key_cache must have"),
        ({"value_cache": torch.zeros(4, 2, 64, 16, dtype=torch.float32)}, "same dtype"),
        ({"value_cache": torch.zeros(5, 2, 64, 16, dtype=torch.float16)}, "value_cache must have"),
        ({"key_cache": torch.zeros(4, 2, 8, 16, 8, dtype=torch.float16)[:, :, :, :, :4]},
         "key_cache must have shape"),
        ({"key": torch.randn(3, 2, 36, dtype=torch.float16),
          "value": torch.randn(3, 2, 36, dtype=torch.float16)}, "must be a multiple of x"),
    ],
)  # fmt: skip
def test_reshape_and_cache_rejects_bad_input(overrides, message):
    args = _reshape_args(**overrides)
    before_k, before_v = args["key_cache"].clone(), args["value_cache"].clone()
    with pytest.raises((RuntimeError, ValueError), match=message):
        ops.reshape_and_cache(*args.values())
    assert torch.equal(args["key_cache"], before_k) and torch.equal(args["value_cache"], before_v)


def test_reshape_and_cache_names_a_missing_cache():
    args = _reshape_args()
    value_cache = args["value_cache"].clone()
    args["key_cache"] = None
    with pytest.raises(RuntimeError, match="key_cache must be a tensor, got None"):
        ops.reshape_and_cache(*args.values())
    assert torch.equal(args["value_cache"], value_cache)


def test_reshape_and_cache_rejects_bad_fp8_scale():
    key_cache, value_cache = _caches(4, 2, 64, 16, torch.float16, "fp8")
    args = _reshape_args(key_cache=key_cache, value_cache=value_cache, kv_cache_dtype="fp8",
                         k_scale=torch.ones(2))  # fmt: skip
    with pytest.raises(ValueError, match="k_scale must hold exactly one element"):
        ops.reshape_and_cache(*args.values())
    args["k_scale"] = torch.ones(1, dtype=torch.float16)
    with pytest.raises(RuntimeError, match="k_scale must be Float"):
        ops.reshape_and_cache(*args.values())


@pytest.mark.parametrize(
    "mapping,message",
    [
        (torch.tensor([[0, 1, 2]]), r"block_mapping must have shape \[n, 2\]"),
        (torch.tensor([0, 1]), r"block_mapping must have shape \[n, 2\]"),
        (torch.tensor([[0, 1]], dtype=torch.int32), "block_mapping must be Long"),
        (torch.tensor([[0, 1], [4, 2]]), r"block_mapping\[1, 0\] = 4 is out of range"),
        (torch.tensor([[0, -1]]), r"block_mapping\[0, 1\] = -1 is out of range"),
    ],
)
def test_copy_and_swap_reject_bad_mappings(mapping, message):
    key_cache, value_cache = _caches(4, 2, 64, 16, torch.float16, "auto")
    before = key_cache.clone()
    with pytest.raises((RuntimeError, ValueError), match=message):
        ops.copy_blocks([key_cache], [value_cache], mapping)
    with pytest.raises((RuntimeError, ValueError), match=message):
        ops.swap_blocks(key_cache.clone(), key_cache, mapping)
    assert torch.equal(key_cache, before)


def test_copy_blocks_rejects_mismatched_layers():
    k0, v0 = _caches(4, 2, 64, 16, torch.float16, "auto")
    k1, v1 = _caches(5, 2, 64, 16, torch.float16, "auto")
    mapping = torch.tensor([[0, 1]])
    with pytest.raises(ValueError, match="one entry per layer"):
        ops.copy_blocks([k0, k1], [v0], mapping)
    with pytest.raises(RuntimeError, match=r"key_caches\[1\] must have as many blocks"):
        ops.copy_blocks([k0, k1], [v0, v1], mapping)
    with pytest.raises(RuntimeError, match=r"value_caches\[0\] must have the dtype"):
        ops.copy_blocks([k0], [v0.float()], mapping)


def test_swap_blocks_rejects_mismatched_tensors():
    mapping = torch.tensor([[0, 1]])
    with pytest.raises(RuntimeError, match="same dtype"):
        ops.swap_blocks(torch.zeros(4, 8), torch.zeros(4, 8, dtype=torch.float16), mapping)
    with pytest.raises(ValueError, match="same shape after the block dim"):
        ops.swap_blocks(torch.zeros(4, 8), torch.zeros(4, 9), mapping)
    with pytest.raises(RuntimeError, match="same rank"):
        ops.swap_blocks(torch.zeros(4, 8), torch.zeros(4, 8, 1), mapping)
    with pytest.raises(RuntimeError, match="dst must be contiguous"):
        ops.swap_blocks(torch.zeros(4, 8), torch.zeros(4, 16)[:, ::2], mapping)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_device_mismatch_is_rejected():
    key_cache, value_cache = _caches(4, 2, 64, 16, torch.float16, "auto")
    args = _reshape_args(key_cache=key_cache.cuda(), value_cache=value_cache.cuda())
    with pytest.raises(RuntimeError, match="key_cache must be on the same device as key"):
        ops.reshape_and_cache(*args.values())


# --------------------------------------------------------------------------------------------
# Mappings the parallel copies cannot order: rejected before anything is written.


@pytest.mark.parametrize(
    "mapping,message",
    [
        ([[0, 1], [1, 2]], r"block_mapping\[0, 1\] = 1 overwrites the block that block_mapping"),
        ([[0, 1], [1, 0]], "a destination may not also be a source"),
        ([[2, 2]], "a destination may not also be a source"),
        ([[0, 3], [1, 3]], r"block_mapping\[1, 1\] = 3 writes the block that block_mapping\[0"),
    ],
    ids=["chain", "swap", "self", "duplicate destination"],
)
@pytest.mark.parametrize("threads", [1, 2])
def test_chained_swapped_or_repeated_pairs_are_rejected(mapping, message, threads):
    """The kernels copy pairs in parallel, so these results would depend on the order (and the
    thread count); the oracle rejects them too."""
    key_cache, value_cache = _caches(4, 2, 64, 16, torch.float16, "auto")
    mapping = torch.tensor(mapping)
    before_k, before_v = key_cache.clone(), value_cache.clone()
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        with pytest.raises(ValueError, match=message):
            paged_attention.copy_blocks([key_cache], [value_cache], mapping)
        with pytest.raises(ValueError, match=message):
            paged_attention.swap_blocks(key_cache, key_cache, mapping)
    finally:
        torch.set_num_threads(previous)
    with pytest.raises(ValueError, match="block_mapping"):
        reference.copy_blocks([key_cache.clone()], [value_cache.clone()], mapping)
    assert torch.equal(key_cache, before_k) and torch.equal(value_cache, before_v)


def test_swap_blocks_between_pools_may_reuse_ids():
    """Between two tensors, ids index two pools: (0, 1) and (1, 0) swap nothing into a source."""
    src = torch.randn(4, 2, 8)
    dst = torch.zeros(4, 2, 8)
    mapping = torch.tensor([[0, 1], [1, 0], [3, 3]])
    expected = dst.clone()
    reference.swap_blocks(src, expected, mapping)
    paged_attention.swap_blocks(src, dst, mapping)
    assert torch.equal(dst, expected)
    with pytest.raises(ValueError, match="each destination may appear once"):
        paged_attention.swap_blocks(src, dst, torch.tensor([[0, 2], [1, 2]]))


def test_swap_blocks_between_views_of_one_storage_compares_addresses():
    big = torch.randn(6, 2, 8)
    src, dst = big[:4], big[2:]  # src block i + 2 is dst block i
    expected = big.clone()
    expected[2 + 3] = expected[0]
    paged_attention.swap_blocks(src, dst, torch.tensor([[0, 3]]))
    assert torch.equal(big, expected)
    with pytest.raises(ValueError, match="a destination may not also be a source"):
        paged_attention.swap_blocks(src, dst, torch.tensor([[2, 0]]))  # the same block
    with pytest.raises(ValueError, match="a destination may not also be a source"):
        paged_attention.swap_blocks(src, dst, torch.tensor([[0, 1], [3, 2]]))  # dst 1 = src 3
    assert torch.equal(big, expected)


def test_fan_out_with_many_pairs_still_copies():
    key_cache, value_cache = _caches(64, 1, 32, 8, torch.float32, "auto")
    mapping = torch.stack([torch.full((40,), 5), torch.arange(10, 50)], dim=1)
    expected_k, expected_v = key_cache.clone(), value_cache.clone()
    reference.copy_blocks([expected_k], [expected_v], mapping)
    paged_attention.copy_blocks([key_cache], [value_cache], mapping)
    assert torch.equal(key_cache, expected_k) and torch.equal(value_cache, expected_v)


# --------------------------------------------------------------------------------------------
# Outputs that overlap themselves or an input, as torch's in-place ops refuse them.


def test_reshape_and_cache_rejects_inputs_that_alias_the_caches():
    key_cache, value_cache = _caches(4, 2, 64, 16, torch.float16, "auto")
    inside_key_cache = key_cache.view(-1)[: 3 * 2 * 64].view(3, 2, 64)
    inside_value_cache = value_cache.view(-1)[-3 * 2 * 64 :].view(3, 2, 64)
    for overrides, message in (
        (dict(key=inside_key_cache), "key_cache must not share memory with key"),
        (dict(value=inside_value_cache), "value_cache must not share memory with value"),
        (dict(key=inside_value_cache), "value_cache must not share memory with key"),
    ):
        args = _reshape_args(key_cache=key_cache, value_cache=value_cache, **overrides)
        before_k, before_v = key_cache.clone(), value_cache.clone()
        with pytest.raises(RuntimeError, match=message):
            paged_attention.reshape_and_cache(*list(args.values())[:5])
        assert torch.equal(key_cache, before_k) and torch.equal(value_cache, before_v)


def test_reshape_and_cache_rejects_an_expanded_cache():
    key_cache, value_cache = _caches(1, 2, 64, 16, torch.float16, "auto")
    args = _reshape_args(key_cache=key_cache.expand(4, -1, -1, -1, -1),
                         value_cache=value_cache.expand(4, -1, -1, -1))  # fmt: skip
    with pytest.raises(RuntimeError, match="key_cache must not overlap itself"):
        ops.reshape_and_cache(*args.values())


def test_swap_and_copy_reject_destinations_that_overlap_themselves():
    src = torch.randn(4, 2, 8)
    expanded = torch.zeros(1, 2, 8).expand(4, -1, -1)
    with pytest.raises(RuntimeError, match="dst must not overlap itself"):
        paged_attention.swap_blocks(src, expanded, torch.tensor([[0, 1], [1, 2]]))
    assert torch.equal(expanded, torch.zeros_like(expanded))
    overlapping = torch.zeros(20).as_strided((4, 2, 4), (3, 4, 1))  # blocks 3 apart, 8 long
    with pytest.raises(RuntimeError, match="dst must not overlap itself"):
        paged_attention.swap_blocks(torch.randn(4, 2, 4), overlapping, torch.tensor([[0, 1]]))
    with pytest.raises(RuntimeError, match=r"key_caches must not overlap itself"):
        paged_attention.copy_blocks([expanded], [torch.zeros(4, 2, 8)], torch.tensor([[0, 1]]))


def test_mapping_that_aliases_a_destination_is_rejected():
    dst = torch.zeros(4, 2, dtype=torch.int64)
    with pytest.raises(RuntimeError, match="dst must not share memory with block_mapping"):
        paged_attention.swap_blocks(torch.ones(4, 2, dtype=torch.int64), dst, dst[:1])


# --------------------------------------------------------------------------------------------
# A meta tensor among real ones: the device error of torch's own ops, not a silent fake call.


@pytest.mark.parametrize("meta_arg", ["slot_mapping", "k_scale", "key"])
def test_reshape_and_cache_with_a_meta_argument_raises(meta_arg):
    args = _reshape_args()
    args[meta_arg] = args[meta_arg].to("meta")
    before = args["key_cache"].clone()
    with pytest.raises(RuntimeError, match=f"same device.*{meta_arg} is on meta"):
        ops.reshape_and_cache(*args.values())
    assert torch.equal(args["key_cache"], before)


def test_copy_and_swap_with_a_meta_argument_raise():
    key_cache, value_cache = _caches(4, 2, 64, 16, torch.float16, "auto")
    meta_mapping = torch.tensor([[0, 1]], device="meta")
    with pytest.raises(RuntimeError, match="block_mapping is on meta"):
        ops.copy_blocks([key_cache], [value_cache], meta_mapping)
    with pytest.raises(RuntimeError, match=r"value_caches\[0\] is on meta"):
        ops.copy_blocks([key_cache], [value_cache.to("meta")], torch.tensor([[0, 1]]))
    with pytest.raises(RuntimeError, match="dst is on meta"):
        ops.swap_blocks(key_cache, key_cache.to("meta"), torch.tensor([[0, 1]]))


def test_all_meta_calls_still_trace():
    args = {
        k: v.to("meta") if isinstance(v, torch.Tensor) else v for k, v in _reshape_args().items()
    }
    ops.reshape_and_cache(*args.values())
    ops.copy_blocks(
        [args["key_cache"]],
        [args["value_cache"]],
        torch.zeros(1, 2, dtype=torch.int64, device="meta"),
    )
    ops.swap_blocks(
        args["key_cache"], args["key_cache"], torch.zeros(1, 2, dtype=torch.int64, device="meta")
    )


# --------------------------------------------------------------------------------------------
# fp8 needs its scales


def test_fp8_reshape_and_cache_requires_scales():
    key_cache, value_cache = _caches(4, 2, 64, 16, torch.float16, "fp8")
    key = torch.randn(3, 2, 64, dtype=torch.float16)
    slots = torch.tensor([0, 1, 2])
    with pytest.raises(ValueError, match="needs k_scale and v_scale.*missing: k_scale, v_scale"):
        paged_attention.reshape_and_cache(key, key, key_cache, value_cache, slots, "fp8")
    with pytest.raises(ValueError, match="missing: v_scale"):
        paged_attention.reshape_and_cache(
            key, key, key_cache, value_cache, slots, "fp8", k_scale=torch.ones(1)
        )
    paged_attention.reshape_and_cache(key, key, key_cache, value_cache, slots, "fp8",
                                      torch.ones(1), torch.ones(1))  # fmt: skip
