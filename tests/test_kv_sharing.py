"""KV sharing (Gemma 3n): which layer each reusing layer reads, a paged cache that holds the
storing layers only, reusing layers that attend over their source layer's blocks and write
nothing, and the models refused. The tokens of the tiny Gemma 3n against transformers' default
cache, through generate() and the Engine: tests/test_model_zoo.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

transformers = pytest.importorskip("transformers")

from test_model_zoo import BLOCK, FULL, SLIDE, VOCAB, Zoo, build, left_padded  # noqa: E402

from paged_attention.attention import PagedAttention  # noqa: E402
from paged_attention.engine import Engine, SamplingParams  # noqa: E402
from paged_attention.engine.config import CacheConfig  # noqa: E402
from paged_attention.integrations.transformers import ATTN_IMPLEMENTATION, PagedCache  # noqa: E402
from paged_attention.kv.cache import bytes_per_block  # noqa: E402
from paged_attention.modeling.geometry import (  # noqa: E402
    LayerGeometry,
    ModelGeometry,
    UnsupportedModelError,
)
from paged_attention.modeling.kv_sharing import (  # noqa: E402
    cache_indices,
    kv_sources,
    with_kv_sources,
)
from paged_attention.modeling.transformers_backend import paged_attention_forward  # noqa: E402

# The zoo's Gemma 3n: layers 0-2 store (1 is the last sliding, 2 the last full one before the
# shared ones), 3 (sliding) reads layer 1's keys and values and 4 (full) layer 2's.
SOURCES = [None, None, None, 1, 2]


@pytest.fixture(scope="module")
def gemma3n() -> Zoo:
    return Zoo("gemma3n_text")


def test_a_reusing_layer_reads_the_last_earlier_storing_layer_of_its_kind(gemma3n):
    geometry = ModelGeometry.of(gemma3n.model)
    assert gemma3n.model.config.kv_sharing_modes == [None, "store", "store", "reuse", "reuse"]
    assert [layer.kv_source for layer in geometry.layers] == SOURCES
    assert cache_indices(geometry.layers) == (0, 1, 2, 1, 2)
    # Two stores of one kind: the later one is read; layers without a mode store their own.
    config = SimpleNamespace(kv_sharing_modes=["store", "store", None, "reuse", "reuse"])
    assert kv_sources(config, [SLIDE, SLIDE, FULL, SLIDE, SLIDE]) == [None, None, None, 1, 1]
    assert kv_sources(SimpleNamespace(), [SLIDE, FULL]) == [None, None]
    assert kv_sources(SimpleNamespace(kv_sharing_modes=[None, None]), [SLIDE, FULL]) == [None] * 2


def test_layers_that_attend_nothing_have_no_place_in_the_cache():
    full = LayerGeometry(num_heads=2, num_kv_heads=1, head_size=8)
    state = LayerGeometry(num_heads=2, num_kv_heads=1, head_size=8, attends=False)
    layers = [state, full, state, full, LayerGeometry(2, 1, 8, kv_source=3)]
    assert cache_indices(layers) == (None, 0, None, 1, 1)


def test_a_reusing_layer_with_nothing_to_read_is_refused():
    config = SimpleNamespace(kv_sharing_modes=["store", "reuse"])
    with pytest.raises(UnsupportedModelError, match="no earlier layer of the model stores them"):
        kv_sources(config, [SLIDE, FULL])  # a full layer reading a sliding one's: not transformers'
    with pytest.raises(UnsupportedModelError, match="lists 2 kv_sharing_modes for its 3 layers"):
        kv_sources(config, [SLIDE, SLIDE, SLIDE])
    # Gemma 4 with every layer shared reads the keys of another model (an assistant's target).
    model = build("gemma4_text", device="meta", num_kv_shared_layers=2)
    with pytest.raises(UnsupportedModelError, match="layer 0 reuses the keys and values"):
        PagedCache(model, block_size=BLOCK, num_blocks=8)


def test_a_reusing_layer_must_read_keys_of_its_sources_shape():
    config = SimpleNamespace(kv_sharing_modes=["store", "reuse"])
    layers = [LayerGeometry(4, 2, 32), LayerGeometry(4, 2, 64)]
    with pytest.raises(UnsupportedModelError, match="reads 2 KV heads of sizes 64/64, where"):
        with_kv_sources(torch.nn.Module(), config, [SLIDE, SLIDE], layers)


def test_gemma4_sharing_keys_is_refused_for_slicing_its_queries():
    """Gemma 4 runs its reusing layers on the kept logits' tokens only, slicing 4D masks."""
    model = build(
        "gemma4_text",
        device="meta",
        num_hidden_layers=4,
        layer_types=[SLIDE, FULL, SLIDE, FULL],
        per_layer_config={1: {"head_dim": 64}, 3: {"head_dim": 64}},
        num_kv_shared_layers=2,
    )
    assert model.config.kv_sharing_modes == ["store", "store", "reuse", "reuse"]
    for make in (
        lambda: PagedCache(model, block_size=BLOCK, num_blocks=8),
        lambda: Engine(model, num_blocks=8, block_size=BLOCK),
    ):
        with pytest.raises(UnsupportedModelError, match="kept logits' tokens only"):
            make()


def test_the_cache_holds_the_storing_layers_only(gemma3n):
    geometry = ModelGeometry.of(gemma3n.model)
    assert len(geometry.layers) == 5 and geometry.num_layers == 3
    assert geometry.cached_layers == geometry.layers[:3]
    # float32 (x = 4), 2 KV heads of 32 dims: keys and values of 3 layers, not 5
    per_layer = 2 * 2 * 32 * 4 * BLOCK
    cache = PagedCache(gemma3n.model, block_size=BLOCK, num_blocks=10)
    kv = cache.kv_cache
    assert kv.num_layers == 3 and len(kv.key_caches) == len(kv.value_caches) == 3
    assert {tuple(c.shape) for c in kv.key_caches} == {(10, 2, 8, BLOCK, 4)}
    assert {tuple(c.shape) for c in kv.value_caches} == {(10, 2, 32, BLOCK)}
    assert kv.bytes_per_block == 3 * per_layer and kv.device_bytes == 10 * 3 * per_layer
    assert kv.k_scales.shape == kv.v_scales.shape == (3,)
    assert bytes_per_block(5, 2, 32, BLOCK, torch.float32) == 5 * per_layer  # without sharing
    # The Engine sizes a memory budget by the storing layers' bytes too.
    assert CacheConfig(block_size=BLOCK, num_blocks=4).block_bytes(geometry) == 3 * per_layer
    engine = Engine(gemma3n.model, max_memory=7 * 3 * per_layer, block_size=BLOCK)
    gemma3n.model.set_attn_implementation(gemma3n.default)
    assert engine.kv_cache.num_blocks == 7 and engine.kv_cache.num_layers == 3


def test_reusing_layers_attend_over_their_sources_blocks_and_store_nothing(gemma3n, monkeypatch):
    model = gemma3n.model
    ids, mask = left_padded([5, 11])
    greedy = dict(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    expected = gemma3n.generate(False, **greedy)
    stores, attends = [], []
    forward = PagedAttention.forward

    def counting(self, query, key, value, kv_cache, metadata, **kwargs):
        (stores if key is not None else attends).append(kv_cache[0].data_ptr())
        return forward(self, query, key, value, kv_cache, metadata, **kwargs)

    monkeypatch.setattr(PagedAttention, "forward", counting)
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    cache = PagedCache(model, block_size=BLOCK, num_blocks=32)
    try:
        assert torch.equal(model.generate(**greedy, cache=cache, pad_token_id=0), expected)
        passes = 6
        assert len(stores) == 3 * passes and len(attends) == 2 * passes
        caches = [k.data_ptr() for k in cache.kv_cache.key_caches]
        assert attends[:2] == [caches[1], caches[2]]  # layer 3 reads 1's cache, layer 4 2's
        # Read through another storing layer's cache instead, the tokens change.
        cache = PagedCache(model, block_size=BLOCK, num_blocks=32)
        cache.kv_sharing.cache_index = (0, 1, 2, 0, 2)
        assert not torch.equal(model.generate(**greedy, cache=cache, pad_token_id=0), expected)
    finally:
        model.set_attn_implementation(gemma3n.default)


def test_a_reusing_layer_given_keys_its_source_did_not_store_raises(gemma3n):
    model = gemma3n.model
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    cache = PagedCache(model, block_size=BLOCK, num_blocks=8)
    try:
        with torch.no_grad():
            model(input_ids=torch.randint(3, VOCAB, (1, 5)), use_cache=True, cache=cache)
            reusing = model.model.layers[3].self_attn
            query, key = torch.randn(1, 4, 1, 32), torch.randn(1, 2, 1, 32)
            with pytest.raises(RuntimeError, match="needs a PagedCache"):
                paged_attention_forward(reusing, query, key, key, None)
    finally:
        model.set_attn_implementation(gemma3n.default)


def test_an_fp8_cache_reads_the_source_layers_scales(gemma3n):
    """A reusing layer dequantises its source's fp8 blocks with that layer's calibrated scales:
    greedy tokens stay those of the float cache for the first steps."""
    model = gemma3n.model
    prompt = torch.randint(3, VOCAB, (1, 9), generator=torch.Generator().manual_seed(3))
    kwargs = dict(input_ids=prompt, max_new_tokens=4, do_sample=False, eos_token_id=None)
    expected = gemma3n.generate(False, **kwargs)
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    cache = PagedCache(model, block_size=BLOCK, num_blocks=8, kv_cache_dtype="fp8")
    try:
        got = model.generate(**kwargs, cache=cache, pad_token_id=0)
    finally:
        model.set_attn_implementation(gemma3n.default)
    assert cache.kv_cache.k_scales.shape == (3,) and bool((cache.kv_cache.k_scales != 1).all())
    assert torch.equal(got, expected)


def test_the_engine_serves_gemma3n_with_the_storing_layers_blocks(gemma3n):
    prompts = [torch.randint(3, VOCAB, (n,)).tolist() for n in (4, 17)]
    expected = [gemma3n.greedy(prompt, 5) for prompt in prompts]
    engine = Engine(gemma3n.model, num_blocks=16, block_size=BLOCK, eos_token_id=[])
    try:
        outputs = engine.generate(prompts, SamplingParams(5))
    finally:
        gemma3n.model.set_attn_implementation(gemma3n.default)
    assert [o.outputs[0] for o in outputs] == expected
    assert engine.runner.cache.kv_sharing.cache_index == (0, 1, 2, 1, 2)


def test_gemma3n_at_its_released_shape_caches_20_of_its_35_layers():
    """transformers' default Gemma3nTextConfig (Gemma 3n E4B's shape): the last 15 layers read
    layer 18's keys and values (sliding) or layer 19's (full), so a block holds 20 layers."""
    config = transformers.Gemma3nTextConfig()
    with torch.device("meta"):
        model = transformers.Gemma3nForCausalLM(config)
    geometry = ModelGeometry.of(model)
    sources = [layer.kv_source for layer in geometry.layers]
    assert sources[:20] == [None] * 20 and set(sources[20:]) == {18, 19}
    assert [sources[i] for i in range(20, 35) if (i + 1) % 5 == 0] == [19, 19, 19]
    assert geometry.num_layers == 20 and geometry.head_size == 256
    shared = bytes_per_block(geometry.num_layers, 2, 256, 16, torch.bfloat16)
    assert shared * 35 == bytes_per_block(35, 2, 256, 16, torch.bfloat16) * 20
