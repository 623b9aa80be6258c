"""Multi-head latent attention's latent form (paged_attention.modeling.mla): one compressed vector
per token and layer in the paged blocks, attended in the absorbed form, against the expanded keys
and values transformers computes (its own forward and the expanded form of the cache), on tiny
random DeepSeek-V2, DeepSeek-V3 and LongCat-Flash models (tests/test_model_zoo.py builds them;
its tests run the latent form, the default, through generate() and the Engine too)."""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("transformers")

from test_model_zoo import BLOCK, VOCAB, Zoo, build  # noqa: E402

from paged_attention.attention import AttentionMetadata  # noqa: E402
from paged_attention.engine import Engine, SamplingParams  # noqa: E402
from paged_attention.engine.model_runner import ModelRunner  # noqa: E402
from paged_attention.integrations.transformers import ATTN_IMPLEMENTATION, PagedCache  # noqa: E402
from paged_attention.kv.cache import PagedKVCache  # noqa: E402
from paged_attention.modeling import mla  # noqa: E402
from paged_attention.modeling.geometry import ModelGeometry  # noqa: E402
from paged_attention.modeling.transformers_backend import cache_argument_name  # noqa: E402

FAMILIES = ["deepseek_v2", "deepseek_v3", "longcat_flash"]
RANK, ROPE = 32, 64  # the zoo's kv_lora_rank and qk_rope_head_dim


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def assert_latent_shapes(kv: PagedKVCache, num_blocks: int) -> None:
    """kv_lora_rank + qk_rope_head_dim elements per token and layer, in one KV head."""
    for key_cache, value_cache in zip(kv.key_caches, kv.value_caches):
        assert key_cache.shape == (num_blocks, 1, ROPE // 4, BLOCK, 4)  # float32: x = 4
        assert value_cache.shape == (num_blocks, 1, RANK, BLOCK)
    assert kv.bytes_per_block == kv.num_layers * (RANK + ROPE) * 4 * BLOCK


# DeepSeek-V3 with yarn rotary scaling: the module's softmax scale carries yarn's mscale.
YARN = dict(
    rope_parameters=dict(
        rope_type="yarn",
        factor=4.0,
        original_max_position_embeddings=64,
        mscale=1.0,
        mscale_all_dim=1.0,
        rope_theta=10000.0,
    )
)


def logits_in_pieces(model, ids: torch.Tensor, cache, pieces) -> torch.Tensor:
    """The logits of ``ids`` fed through ``cache`` piece by piece (``(start, end)`` columns),
    concatenated: a prompt, then chunks over the cached context, then single tokens."""
    name = cache_argument_name(model)
    logits = [
        model(input_ids=ids[:, a:b], use_cache=True, **{name: cache}).logits for a, b in pieces
    ]
    return torch.cat(logits, dim=1)


@pytest.mark.parametrize(
    "model_type, settings", [*((family, {}) for family in FAMILIES), ("deepseek_v3", YARN)]
)
def test_logits_match_transformers_over_prefill_chunk_and_decode(model_type, settings):
    """Prompt, a chunk of 3 tokens over the cached context, then single-token steps: the
    logits of every position within float rounding of transformers' own forward."""
    model = build(model_type, **settings)
    if settings:
        assert model.model.layers[0].self_attn.scaling > 1.2 * (128 + 64) ** -0.5
    ids = torch.randint(3, VOCAB, (2, 13), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = model(input_ids=ids).logits
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
        cache = PagedCache(model, block_size=BLOCK, num_blocks=16)
        assert_latent_shapes(cache.kv_cache, 16)
        pieces = [(0, 6), (6, 9), *((i, i + 1) for i in range(9, 13))]
        got = logits_in_pieces(model, ids, cache, pieces)
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-5)
    # The scale matters: attention is far from uniform at these weights.
    assert (expected.softmax(-1) - got.softmax(-1)).abs().max() < 1e-5


def test_bfloat16_logits_err_as_little_as_transformers_own_bfloat16():
    """In bf16 neither form equals float32: the latent form (its absorbed products in float32)
    stays within twice the error of transformers' own bf16 forward, against the same weights in
    float32 (dense layers: a MoE router's near-ties would flip experts on any rounding)."""
    model = build("deepseek_v3", first_k_dense_replace=2).to(torch.bfloat16)
    exact = build("deepseek_v3", first_k_dense_replace=2)
    exact.load_state_dict({name: w.float() for name, w in model.state_dict().items()})
    ids = torch.randint(3, VOCAB, (2, 13), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        truth = exact(input_ids=ids).logits
        own = (model(input_ids=ids).logits.float() - truth).abs()
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
        cache = PagedCache(model, block_size=BLOCK, num_blocks=16)
        pieces = [(0, 6), (6, 9), *((i, i + 1) for i in range(9, 13))]
        got = logits_in_pieces(model, ids, cache, pieces)
    assert got.dtype == torch.bfloat16 and cache.kv_cache.key_caches[0].dtype == torch.bfloat16
    error = (got.float() - truth).abs()
    assert 0 < own.max() and error.max() < 2 * own.max() and error.mean() < 2 * own.mean()


@pytest.mark.parametrize("model_type", FAMILIES)
def test_generate_gives_the_default_caches_tokens_in_both_forms(model_type):
    zoo = Zoo(model_type)
    ids = torch.randint(3, VOCAB, (2, 11), generator=torch.Generator().manual_seed(1))
    kwargs = dict(input_ids=ids, max_new_tokens=10, do_sample=False, eos_token_id=None)
    expected = zoo.generate(False, **kwargs)
    model = zoo.model
    for form in ("latent", "expanded"):
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
        cache = PagedCache(model, block_size=BLOCK, num_blocks=32, mla=form)
        try:
            out = model.generate(**kwargs, cache=cache, pad_token_id=0)
        finally:
            model.set_attn_implementation(zoo.default)
        assert torch.equal(out, expected), form
        key_cache, value_cache = cache.kv_cache.layer(0)
        if form == "latent":
            assert_latent_shapes(cache.kv_cache, 32)
        else:  # every query head's key (nope + rope) and value
            heads, qk, v = 4, model.config.qk_nope_head_dim + ROPE, model.config.v_head_dim
            assert key_cache.shape == (32, heads, qk // 4, BLOCK, 4)
            assert value_cache.shape == (32, heads, v, BLOCK)
    # The latent form's expand_kv hands latents through only to a latent PagedCache: the model
    # still runs on its default cache afterwards.
    assert torch.equal(zoo.generate(False, **kwargs), expected)


@pytest.mark.parametrize("model_type", FAMILIES)
def test_engine_gives_the_default_caches_tokens_with_chunks_prefix_hits_and_preemption(
    model_type,
):
    zoo = Zoo(model_type)
    gen = torch.Generator().manual_seed(2)
    system = torch.randint(3, VOCAB, (2 * BLOCK + 3,), generator=gen).tolist()
    prompts = [system + torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in (2, 7)]
    prompts += [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in (13, 20)]
    expected = [zoo.greedy(prompt, 10) for prompt in prompts]
    for form in ("latent", "expanded"):
        engine = Engine(  # 12 blocks of 8 are too few for the four at once
            zoo.model,
            num_blocks=12,
            block_size=BLOCK,
            eos_token_id=[],
            max_num_batched_tokens=12,
            max_num_seqs=4,
            mla=form,
        )
        try:
            outputs = engine.generate(prompts, SamplingParams(10))
        finally:
            zoo.model.set_attn_implementation(zoo.default)
        assert [o.outputs[0] for o in outputs] == expected, form
        stats = engine.stats
        assert stats.prompt_tokens_cached > 0 and stats.preemptions_by_recompute > 0, form
        assert (engine.core.kv_cache.num_kv_heads == 1) == (form == "latent")
    assert_latent_shapes(Engine(zoo.model, num_blocks=12, block_size=BLOCK).core.kv_cache, 12)


def reference_latent_attention(query, latents, rotaries, query_lens, scale):
    """Each sequence's rows (its last query_lens positions) over its whole latent context,
    written plainly: logits of [W_UK^T q_nope, q_pe] . [c, k_pe], softmax, weighted latents."""
    out, row = [], 0
    for q_len, latent, rotary in zip(query_lens, latents, rotaries):
        seq_len = latent.shape[0]
        for i in range(q_len):
            position = seq_len - q_len + i
            keys = torch.cat([latent, rotary], dim=1)[: position + 1]
            logits = query[row] @ keys.T * scale  # [heads, position + 1]
            out.append(logits.softmax(-1) @ latent[: position + 1])
            row += 1
    return torch.stack(out)


@pytest.mark.parametrize("logits_per_product", [mla._LOGITS_PER_PRODUCT, 40])
def test_latent_paged_attention_matches_a_plain_reference_over_scattered_blocks(
    logits_per_product, monkeypatch
):
    """Decode rows (one batched product) and prompt rows with cached context (per sequence, in
    one product or, bounded, in pieces of rows), blocks in any order, never-written slots
    holding NaN."""
    monkeypatch.setattr(mla, "_LOGITS_PER_PRODUCT", logits_per_product)
    gen = torch.Generator().manual_seed(3)
    heads, num_blocks, x = 4, 12, 4
    key_cache = torch.full((num_blocks, 1, ROPE // x, BLOCK, x), math.nan)
    value_cache = torch.full((num_blocks, 1, RANK, BLOCK), math.nan)
    seq_lens, tables = [13, 5, 9], [[7, 2], [4], [10, 0]]
    latents = [torch.randn(n, RANK, generator=gen) for n in seq_lens]
    rotaries = [torch.randn(n, ROPE, generator=gen) for n in seq_lens]
    scale = 0.3

    def step(query_lens):
        slots = [
            tables[s][p // BLOCK] * BLOCK + p % BLOCK
            for s, (q, n) in enumerate(zip(query_lens, seq_lens))
            for p in range(n - q, n)
        ]
        width = max(map(len, tables))
        padded = torch.tensor([t + [-1] * (width - len(t)) for t in tables], dtype=torch.int32)
        metadata = AttentionMetadata.build(
            query_lens, seq_lens, padded, torch.tensor(slots, dtype=torch.int64)
        )
        new = [slice(n - q, n) for q, n in zip(query_lens, seq_lens)]
        rotary = torch.cat([r[s] for r, s in zip(rotaries, new)]).unsqueeze(1)
        latent = torch.cat([c[s] for c, s in zip(latents, new)]).unsqueeze(1)
        query = torch.randn(sum(query_lens), heads, RANK + ROPE, generator=gen)
        got = mla.latent_paged_attention(
            query, rotary, latent, key_cache, value_cache, metadata, scale
        )
        expected = reference_latent_attention(query, latents, rotaries, query_lens, scale)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)

    step([13, 5, 9])  # prompts from the start
    key_cache[3], value_cache[3] = 1e9, 1e9  # a block no sequence owns is never read
    step([1, 1, 1])  # decodes: one batched product over the padded block tables
    step([4, 1, 2])  # chunks over cached context mixed with a decode


def test_a_latent_cache_refuses_a_model_of_other_latent_sizes():
    built_for, other = build("deepseek_v3"), build("deepseek_v3", kv_lora_rank=48)
    cache = PagedCache(built_for, block_size=BLOCK, num_blocks=8)
    for model in (built_for, other):
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
    ids = torch.randint(3, VOCAB, (1, 5))
    with (
        torch.no_grad(),
        pytest.raises(ValueError, match="over a latent of 32 \\+ 64 rotary dims .* 4 KV heads"),
    ):  # the other model's expand_kv was not handed over: it expands its latents
        other(input_ids=ids, use_cache=True, **{cache_argument_name(other): cache})


def test_the_forms_the_latent_cache_does_not_serve_are_refused_or_fall_back():
    """fp8 caches and captured decode steps (CUDA graphs, torch.compile) take the expanded
    form by default and refuse mla='latent' by name; no kernel is involved, so a CUDA device
    needs no refusal of its own."""
    assert mla.resolve(None) is None
    assert mla.resolve(None, kv_cache_dtype="fp8") == "expanded"
    assert mla.resolve(None, graphs=True) == "expanded"
    with pytest.raises(ValueError, match="mla='latent' caches .* kv_cache_dtype='fp8'"):
        mla.resolve("latent", kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="pass cuda_graphs=False and compile=False"):
        mla.resolve("latent", graphs=True)
    with pytest.raises(ValueError, match="mla must be None"):
        Engine(build("deepseek_v3"), num_blocks=8, mla="compressed")
    model = build("deepseek_v3")
    cache = PagedCache(model, block_size=BLOCK, num_blocks=8, kv_cache_dtype="fp8")
    assert cache.kv_cache.num_kv_heads == 4  # expanded
    with pytest.raises(ValueError, match="compile=False"):
        Engine(model, num_blocks=8, block_size=BLOCK, compile=True, mla="latent")
    geometry = ModelGeometry.of(model)
    kv = geometry.kv_cache(BLOCK, 8, None)
    with pytest.raises(ValueError, match="compile=False"):
        ModelRunner(model, geometry, kv, compile_decode=True)
