"""DeepSeek sparse attention on the latent paged cache (paged_attention.modeling.sparse_mla): the
indexer's selection against transformers' ``DeepseekV32Indexer`` on the same inputs, the indexer
keys the blocks hold against those transformers' cache holds, generate() and the Engine against
the default cache at a sparser top-k than the zoo's (tests/test_model_zoo.py runs the zoo's
deepseek_v32 through every generate() mode and the Engine's preemptions), that the selection
changes the tokens, that every block comes back, and the refusals."""

from __future__ import annotations

import inspect

import pytest
import torch

pytest.importorskip("transformers")

from test_mla import logits_in_pieces  # noqa: E402
from test_model_zoo import BLOCK, VOCAB, ZOO, Zoo, build, left_padded  # noqa: E402

from paged_attention.engine import Engine, SamplingParams  # noqa: E402
from paged_attention.integrations.transformers import ATTN_IMPLEMENTATION, PagedCache  # noqa: E402
from paged_attention.modeling import mla, sparse_mla  # noqa: E402
from paged_attention.modeling.geometry import ModelGeometry  # noqa: E402
from paged_attention.modeling.transformers_backend import cache_argument_name  # noqa: E402

ROPE, INDEX_DIM = 64, 128  # the zoo's qk_rope_head_dim and the config's default index_head_dim
TOPK = 4  # sparser than the zoo's 8: most positions of the prompts are left out


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def sparse() -> Zoo:
    return Zoo("deepseek_v32", index_topk=TOPK)


def test_the_indexer_selects_what_transformers_indexer_selects(sparse):
    model = sparse.model
    attention = sparse_mla.indexed_modules(model)[1]
    gen = torch.Generator().manual_seed(3)
    hidden = torch.randn(2, 20, model.config.hidden_size, generator=gen)
    positions = torch.arange(20).unsqueeze(0).expand(2, -1)
    embeddings = model.model.rotary_emb(hidden, positions)
    causal = torch.ones(20, 20, dtype=torch.bool).tril().expand(2, -1, -1)
    with torch.no_grad():
        q_resid = attention.q_a_layernorm(attention.q_a_proj(hidden))
        theirs = attention.indexer(hidden, q_resid, embeddings, causal, positions, cache=None)
        rotation = inspect.getmodule(type(attention)).apply_rotary_pos_emb
        query, keys, weights = sparse_mla.indexer_inputs(
            attention.indexer, hidden, q_resid, embeddings, rotation
        )
    narrower = 0
    for row in range(2):
        ours = sparse_mla.select(query[row], weights[row], keys[row], torch.arange(20), TOPK)
        for position in range(20):
            picked = {int(t) for t in theirs[row, position] if t <= position}
            assert set(ours[position].nonzero().flatten().tolist()) == picked, (row, position)
            narrower += len(picked) < position + 1
    assert narrower == 2 * (20 - TOPK)  # every query past the first TOPK reads TOPK tokens


def test_logits_match_transformers_over_prefill_chunk_and_decode(sparse):
    """A prompt, a chunk of 3 tokens over the cached context, then single-token steps: the
    logits of every position within float rounding of transformers' own forward, the indexer
    selecting 4 of up to 20 tokens."""
    model = sparse.model
    ids = torch.randint(3, VOCAB, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = model(input_ids=ids).logits
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
        try:
            cache = PagedCache(model, block_size=BLOCK, num_blocks=16)
            pieces = [(0, 9), (9, 12), *((i, i + 1) for i in range(12, 20))]
            got = logits_in_pieces(model, ids, cache, pieces)
        finally:
            model.set_attn_implementation(sparse.default)
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-5)


def test_the_key_cache_holds_transformers_indexer_keys(sparse):
    model = sparse.model
    ids = torch.randint(3, VOCAB, (1, 13), generator=torch.Generator().manual_seed(4))
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    cache = PagedCache(model, block_size=BLOCK, num_blocks=16)
    try:
        out = model.generate(input_ids=ids, max_new_tokens=6, do_sample=False, cache=cache)
    finally:
        model.set_attn_implementation(sparse.default)
    layer = ModelGeometry.of(model).layers[0]
    assert (layer.head_size, layer.v_head_size, layer.latent_rank) == (ROPE + INDEX_DIM, 32, 32)
    assert (layer.index_topk, layer.index_heads, layer.index_head_size) == (TOPK, 64, INDEX_DIM)
    assert cache.kv_cache.key_caches[0].shape == (16, 1, (ROPE + INDEX_DIM) // 4, BLOCK, 4)
    seen = out.shape[1] - 1  # the last token was sampled, never fed
    with torch.no_grad():
        reference = model(input_ids=out[:, :seen], use_cache=True)
    table = torch.tensor(cache.block_manager.block_table(cache._rows[0]))
    for index, key_cache in enumerate(cache.kv_cache.key_caches):
        rows = mla.token_rows(key_cache)[table].reshape(-1, ROPE + INDEX_DIM)[:seen]
        expected = reference[cache_argument_name(model)].layers[index].indexer_keys[0]
        torch.testing.assert_close(rows[:, ROPE:], expected, rtol=1e-5, atol=1e-5)
    cache.reset()
    assert cache.blocks_in_use() == 0


def test_generate_matches_the_default_cache_at_a_sparser_top_k(sparse, monkeypatch):
    ids, mask = left_padded([5, 11, 19])
    batch = dict(input_ids=ids, attention_mask=mask, eos_token_id=None)
    calls = {
        "greedy": dict(batch, max_new_tokens=12, do_sample=False),
        "sampling": dict(batch, max_new_tokens=8, do_sample=True, top_k=20, num_return_sequences=2),
        "beams": dict(batch, max_new_tokens=8, num_beams=2, num_return_sequences=2),
    }
    for name, kwargs in calls.items():
        expected = sparse.generate(False, seed=11, **kwargs)
        assert torch.equal(sparse.generate(True, seed=11, **kwargs), expected), name
    greedy = calls["greedy"]
    expected = sparse.generate(False, **greedy)

    def every_visible_token(index_query, weights, index_keys, positions, topk, width):
        tokens = torch.arange(index_keys.shape[0])
        return tokens.unsqueeze(0) <= positions.unsqueeze(1)

    with monkeypatch.context() as patch:  # dense attention: the selection is what differs
        patch.setattr(sparse_mla, "select", every_visible_token)
        assert not torch.equal(sparse.generate(True, **greedy), expected)


def test_tied_scores_are_searched_in_transformers_layout(monkeypatch):
    """With one indexer head, most scores are exactly zero (the head's ReLU), so the top-k
    boundary ties and torch.topk's pick among the tied tokens depends on the row it searches:
    transformers' own tokens for a prompt change with its left padding. Laid out as
    transformers lays them out (padding first), a left-padded batch and whole prompts through
    the Engine (prefix hits included) give its tokens; scoring each sequence alone does not."""
    tied = Zoo("deepseek_v32", index_topk=TOPK, index_n_heads=1)
    ids, mask = left_padded([5, 11, 19])
    greedy = dict(input_ids=ids, attention_mask=mask, eos_token_id=None, max_new_tokens=12)
    expected = tied.generate(False, **greedy, do_sample=False)
    assert torch.equal(tied.generate(True, **greedy, do_sample=False), expected)
    alone = tied.greedy(ids[0, mask[0].bool()].tolist(), 12)
    assert expected[0, -12:].tolist() != alone  # transformers' tokens depend on the padding
    select = sparse_mla.select

    def each_sequence_alone(*args):
        return select(*args[:-1], 0)

    with monkeypatch.context() as patch:
        patch.setattr(sparse_mla, "select", each_sequence_alone)
        assert not torch.equal(tied.generate(True, **greedy, do_sample=False), expected)
    gen = torch.Generator().manual_seed(2)
    system = torch.randint(3, VOCAB, (2 * BLOCK + 3,), generator=gen).tolist()
    prompts = [system + torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in (2, 7)]
    engine = Engine(tied.model, num_blocks=16, block_size=BLOCK, eos_token_id=[])
    try:
        outputs = engine.generate(prompts, SamplingParams(10))
    finally:
        tied.model.set_attn_implementation(tied.default)
    assert [o.outputs[0] for o in outputs] == [tied.greedy(p, 10) for p in prompts]
    assert engine.stats.prompt_tokens_cached > 0


def test_the_engine_matches_and_gives_every_block_back(sparse):
    """Continuous batching with chunked prefill, prefix hits and swaps, then recompute: the
    default cache's greedy tokens, and afterwards no block held on the device or the host."""
    gen = torch.Generator().manual_seed(5)
    system = torch.randint(3, VOCAB, (2 * BLOCK + 3,), generator=gen).tolist()
    prompts = [system + torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in (2, 7)]
    prompts += [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in (13, 20)]
    expected = [sparse.greedy(prompt, 10) for prompt in prompts]
    setups = {
        "chunked prefill, swap": dict(
            max_num_batched_tokens=12, max_num_seqs=4, num_host_blocks=48
        ),
        "recompute": dict(num_host_blocks=0, enable_prefix_caching=False),
    }
    for name, setup in setups.items():
        engine = Engine(sparse.model, num_blocks=12, block_size=BLOCK, eos_token_id=[], **setup)
        try:
            outputs = engine.generate(prompts, SamplingParams(10))
        finally:
            sparse.model.set_attn_implementation(sparse.default)
        assert [o.outputs[0] for o in outputs] == expected, name
        manager = engine.block_manager
        assert engine.stats.swaps_out + engine.stats.preemptions_by_recompute > 0, name
        assert not manager.seq_ids(), name
        assert manager.num_free_device_blocks() == 12, name
        assert manager.num_free_host_blocks() == setup["num_host_blocks"], name


def test_beams_fork_and_free_the_indexer_blocks_with_the_sequence(sparse):
    ids, mask = left_padded([5, 11])
    model = sparse.model
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    cache = PagedCache(model, block_size=BLOCK, num_blocks=40)
    try:
        model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=6, num_beams=3, cache=cache
        )
    finally:
        model.set_attn_implementation(sparse.default)
    assert cache.stats().bytes_saved_by_sharing > 0  # beams share their prompt's blocks
    cache.reset()
    assert cache.blocks_in_use() == 0 and not cache.block_manager.seq_ids()


def test_what_sparse_attention_cannot_serve_is_refused_with_the_reason(sparse):
    model = sparse.model
    for options in (dict(mla="expanded"), dict(kv_cache_dtype="fp8_e4m3")):
        with pytest.raises(ValueError, match="latent form only"):
            PagedCache(model, block_size=BLOCK, num_blocks=8, **options)
    with pytest.raises(ValueError, match="latent form only"):
        Engine(model, num_blocks=8, block_size=BLOCK, compile=True)
    biased = build("deepseek_v32", device="meta", family=ZOO["deepseek_v32"])
    projection = sparse_mla.indexed_modules(biased)[0].kv_b_proj
    projection.bias = torch.nn.Parameter(torch.zeros(projection.out_features, device="meta"))
    with pytest.raises(ValueError, match="latent form only.*kv_b_proj is not a plain linear"):
        PagedCache(biased, block_size=BLOCK, num_blocks=8)
    narrower = build("deepseek_v32", family=ZOO["deepseek_v32"], index_head_dim=64)
    PagedCache(narrower, block_size=BLOCK, num_blocks=8)  # its forward runs paged from now on
    cache = PagedCache(model, block_size=BLOCK, num_blocks=8)
    ids = torch.randint(3, VOCAB, (1, 5))
    for each in (model, narrower):  # the cache checks the model it was built for is paged
        each.set_attn_implementation(ATTN_IMPLEMENTATION)
    try:
        with torch.no_grad(), pytest.raises(ValueError, match="keys of 192.*keys of 128"):
            narrower(input_ids=ids, use_cache=True, **{cache_argument_name(narrower): cache})
        with torch.no_grad(), pytest.raises(ValueError, match="needs a PagedCache"):
            narrower(input_ids=ids, use_cache=False)
    finally:
        model.set_attn_implementation(sparse.default)
