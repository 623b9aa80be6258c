"""ModelGeometry: each layer read from the config and the attention modules, the cache and block
manager built from it, and what it refuses (the refusal of every unsupported family, and the
equality of every supported one with transformers: tests/test_model_zoo.py)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from test_model_zoo import BLOCK, CHUNK, WINDOW, build  # noqa: E402

from paged_attention.modeling.geometry import (  # noqa: E402
    LayerGeometry,
    ModelGeometry,
    UnsupportedModelError,
)


def layers(model_type: str, **overrides) -> tuple[LayerGeometry, ...]:
    return ModelGeometry.of(build(model_type, **overrides)).layers


def test_each_layer_is_read_with_its_own_window_heads_and_scale():
    gemma2 = layers("gemma2")
    assert [layer.sliding_window for layer in gemma2] == [WINDOW, 0]
    assert {layer.logits_soft_cap for layer in gemma2} == {2.0}
    assert {layer.scale for layer in gemma2} == {32**-0.5}  # query_pre_attn_scalar
    assert {(layer.num_heads, layer.num_kv_heads, layer.head_size) for layer in gemma2} == {
        (4, 2, 32)
    }
    qwen2 = layers("qwen2")  # sliding from max_window_layers on
    assert [layer.sliding_window for layer in qwen2] == [0, WINDOW]
    assert [layer.sliding_window for layer in layers("mistral")] == [WINDOW, WINDOW]
    assert [layer.sliding_window for layer in layers("phimoe")] == [WINDOW, WINDOW]
    assert {layer.num_kv_heads for layer in layers("gpt_bigcode")} == {1}  # multi-query
    assert {layer.num_kv_heads for layer in layers("gpt2")} == {4}  # fused projections
    assert {layer.num_kv_heads for layer in layers("opt")} == {4}  # read from k_proj
    assert [layer.sinks for layer in layers("gpt_oss")] == [True, True]
    assert not any(layer.sinks for layer in layers("llama"))
    assert {layer.scale for layer in layers("granite")} == {1.0}  # attention_multiplier
    assert [layer.head_size for layer in layers("gemma4_text")] == [32, 64]


def test_what_a_block_manager_may_release():
    def geometry(*pairs):
        return ModelGeometry(
            tuple(
                LayerGeometry(4, 2, 32, sliding_window=w, attention_chunk_size=c) for w, c in pairs
            ),
            torch.float32,
            torch.device("cpu"),
        )

    assert geometry((8, 0), (16, 0)).released_reach() == (16, None)  # the widest window
    assert geometry((0, 8), (0, 8)).released_reach() == (None, 8)
    assert geometry((8, 0), (0, 0)).released_reach() == (None, None)  # a full layer
    assert geometry((0, 8), (0, 16)).released_reach() == (None, None)  # chunks differ
    assert geometry((8, 0), (0, 8)).released_reach() == (None, None)  # windows and chunks
    windowed = geometry((8, 0), (16, 0))
    kv = windowed.kv_cache(BLOCK, 16, None)
    assert windowed.block_manager(kv, enable_prefix_caching=False).sliding_window == 16
    # Prefix caching keeps every block: other sequences may hit them later.
    cached = windowed.block_manager(kv, enable_prefix_caching=True)
    assert not cached.reach.releases and cached.enable_prefix_caching


def test_layers_of_different_shapes_get_a_cache_of_each_shape():
    geometry = ModelGeometry.of(build("gemma4_text"))
    assert geometry.head_size == (32, 64) and geometry.num_kv_heads == 2
    kv = geometry.kv_cache(BLOCK, 8, None)
    assert kv.value_caches[0].shape == (8, 2, 32, BLOCK)
    assert kv.value_caches[1].shape == (8, 2, 64, BLOCK)


@pytest.mark.parametrize(
    "model_type, sizes", [("deepseek_v3", (192, 128)), ("deepseek_v2", (128, 64)),
                          ("longcat_flash", (192, 128))],
)  # fmt: skip
def test_latent_attention_is_read_with_keys_and_values_of_their_own_head_sizes(model_type, sizes):
    """In the expanded form, multi-head latent attention reaches the attention interface as one
    key head (nope + rope dims) and one value head (v_head_dim) per query head; the cache
    stores them so."""
    head_size, v_head_size = sizes
    geometry = ModelGeometry.of(build(model_type), mla="expanded")
    assert not geometry.latent
    assert {(layer.num_heads, layer.num_kv_heads) for layer in geometry.layers} == {(4, 4)}
    assert geometry.head_size == head_size and geometry.v_head_size == v_head_size
    kv = geometry.kv_cache(BLOCK, 8, None)
    assert kv.key_caches[0].shape == (8, 4, head_size // 4, BLOCK, 4)  # float32: x = 4
    assert kv.value_caches[0].shape == (8, 4, v_head_size, BLOCK)
    # KV bytes per token of this form: every head's key and value, in every layer.
    assert kv.bytes_per_block == 2 * 4 * (head_size + v_head_size) * 4 * BLOCK
    assert LayerGeometry(4, 2, 64).v_head_size == 64  # default: the keys' head size


@pytest.mark.parametrize("model_type", ["deepseek_v3", "deepseek_v2", "longcat_flash"])
def test_latent_attention_is_cached_as_one_latent_head_by_default(model_type):
    """The latent form (the default): one KV head per layer whose key is the rotary part
    (qk_rope_head_dim 64) and whose value is the compressed latent (kv_lora_rank 32)."""
    geometry = ModelGeometry.of(build(model_type))
    assert geometry.latent and ModelGeometry.of(build(model_type), mla="latent") == geometry
    assert {(layer.num_heads, layer.num_kv_heads) for layer in geometry.layers} == {(4, 1)}
    assert {layer.latent_rank for layer in geometry.layers} == {32}
    assert geometry.head_size == 64 and geometry.v_head_size == 32
    kv = geometry.kv_cache(BLOCK, 8, None)
    assert kv.key_caches[0].shape == (8, 1, 64 // 4, BLOCK, 4)  # float32: x = 4
    assert kv.value_caches[0].shape == (8, 1, 32, BLOCK)
    assert kv.bytes_per_block == 2 * (64 + 32) * 4 * BLOCK  # each token once per layer
    with pytest.raises(ValueError, match="mla='latent'.*not kv_cache_dtype='fp8'"):
        geometry.kv_cache(BLOCK, 8, None, kv_cache_dtype="fp8")


def test_the_latent_form_is_refused_where_it_cannot_serve():
    with pytest.raises(ValueError, match="mla='latent' is for models with multi-head latent"):
        ModelGeometry.of(build("llama"), mla="latent")
    assert not ModelGeometry.of(build("llama")).latent  # the default reads it as before
    with pytest.raises(ValueError, match="mla must be None .*got 'absorbed'"):
        ModelGeometry.of(build("deepseek_v3"), mla="absorbed")
    model = build("deepseek_v3")
    model.model.layers[1].self_attn.kv_b_proj.bias = torch.nn.Parameter(torch.zeros(4 * 256))
    with pytest.raises(ValueError, match="layer 1's kv_b_proj is not a plain linear map"):
        ModelGeometry.of(model, mla="latent")
    assert not ModelGeometry.of(model).latent  # the default falls back to the expanded form


def test_layer_types_that_do_not_match_the_layers_are_refused():
    model = build("llama")
    model.config.layer_types = ["sliding_attention", "full_attention"]
    with pytest.raises(UnsupportedModelError, match="config sets no sliding_window"):
        ModelGeometry.of(model)
    model.config.layer_types = ["full_attention"] * 3
    with pytest.raises(UnsupportedModelError, match="3 layer_types for its 2 layers"):
        ModelGeometry.of(model)


def test_chunked_layers_are_read_with_their_chunk_size():
    llama4 = layers("llama4_text")
    assert [(layer.attention_chunk_size, layer.sliding_window) for layer in llama4] == [
        (CHUNK, 0),
        (0, 0),
    ]
    only_chunks = ModelGeometry.of(build("llama4_text", layer_types=["chunked_attention"] * 2))
    assert only_chunks.released_reach() == (None, CHUNK)


@pytest.mark.parametrize(
    "model_type, state_layers, attends",
    [
        ("lfm2", (0,), [False, True]),  # a conv layer, then attention
        ("nemotron_h", (0,), [False, False, True, False]),  # Mamba, MoE, attention, MLP
        ("falcon_h1", (0, 1), [True, True]),  # "hybrid" layers: a Mamba mixer and attention
    ],
)
def test_a_hybrid_model_is_read_with_its_state_layers(model_type, state_layers, attends):
    model = build(model_type, device="meta")
    geometry = ModelGeometry.of(model)
    assert geometry.state_layers == state_layers
    kinds = model.config.layer_types
    assert [kind in ("full_attention", "hybrid") for kind in kinds] == attends
    assert all(layer.attends_everything for layer in geometry.layers)  # "hybrid": full
    # the cache holds keys and values for the attention layers only
    assert [layer.attends for layer in geometry.layers] == attends
    assert geometry.num_layers == sum(attends)
    assert geometry.kv_cache(BLOCK, 8, None).num_layers == sum(attends)
    manager = geometry.block_manager(geometry.kv_cache(BLOCK, 8, None), False, 5)
    assert manager.state_stats().num_slots == 5
    with pytest.raises(ValueError, match="prefix caching cannot serve a hybrid model"):
        geometry.block_manager(geometry.kv_cache(BLOCK, 8, None), True)
