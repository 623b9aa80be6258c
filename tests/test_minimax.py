"""MiniMax (lightning attention) on the paged cache (paged_attention/modeling/minimax.py).

The model takes only a ``MiniMaxCache``: ``PagedCache`` and the engine's step cache become one
for a MiniMax model, and each lightning layer's ``[batch, heads, d, d]`` state lives in the
sequence's state slot. Here on a MiniMax laid out as MiniMax-Text-01 is (a lightning layer
first), three layers, lightning blocks of 4 tokens so that prompts run as several blocks:
greedy, seeded sampling with forks and beams through ``generate()`` give the tokens of
transformers' own cache (for beams, one that also reorders the lightning states, which
transformers' ``MiniMaxCache`` leaves behind); a left-padded batch gives each prompt's tokens
alone; a prompt fed in two forward passes continues its state as transformers' cache does; the
engine's samples, beams and greedy requests under chunked prefill and preemption by recompute
are exact. (tests/test_model_zoo.py runs the zoo's MiniMax, attention layer first, through the
hybrid families' tests.)"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from test_hybrid_runner import (  # noqa: E402
    full_logits,
    reference_beam_search,
    serve_recording,
    several_sequences,
)
from test_model_zoo import (  # noqa: E402
    BLOCK,
    VOCAB,
    BeamReorderingMiniMaxCache,
    Zoo,
    build,
    left_padded,
)
from transformers.models.minimax.modeling_minimax import MiniMaxCache  # noqa: E402

from paged_attention.engine import Engine  # noqa: E402
from paged_attention.engine.hybrid_runner import (  # noqa: E402
    HybridRunner,
    HybridStepCache,
    state_bytes_per_sequence,
)
from paged_attention.integrations.transformers import ATTN_IMPLEMENTATION, PagedCache  # noqa: E402
from paged_attention.modeling.geometry import ModelGeometry, UnsupportedModelError  # noqa: E402
from paged_attention.modeling.minimax import (  # noqa: E402
    LinearStateCache,
    cache_class,
    is_minimax,
)
from paged_attention.modeling.transformers_backend import cache_argument_name  # noqa: E402

LIGHTNING_FIRST = dict(
    num_hidden_layers=3,
    layer_types=["linear_attention", "full_attention", "linear_attention"],
    block_size=4,
)


@pytest.fixture(scope="module")
def minimax() -> Zoo:
    torch.set_num_threads(1)
    return Zoo("minimax", **LIGHTNING_FIRST)


def paged_generate(zoo: Zoo, seed: int = 7, **kwargs) -> tuple[torch.Tensor, PagedCache]:
    zoo.model.set_attn_implementation(ATTN_IMPLEMENTATION)
    cache = PagedCache(zoo.model, block_size=BLOCK, num_blocks=96, num_state_slots=8)
    try:
        torch.manual_seed(seed)
        out = zoo.model.generate(**kwargs, cache=cache, pad_token_id=0, eos_token_id=None)
    finally:
        zoo.model.set_attn_implementation(zoo.default)
    return out, cache


def reference_generate(zoo: Zoo, seed: int = 7, **kwargs) -> torch.Tensor:
    torch.manual_seed(seed)
    cache = BeamReorderingMiniMaxCache()
    return zoo.model.generate(**kwargs, cache=cache, pad_token_id=0, eos_token_id=None)


def test_a_paged_cache_for_minimax_is_also_its_minimax_cache(minimax):
    cache = PagedCache(minimax.model, block_size=BLOCK, num_blocks=8)
    assert isinstance(cache, PagedCache) and isinstance(cache, MiniMaxCache)
    assert type(cache) is cache_class(PagedCache, minimax.model)  # one class, made once
    assert cache_class(type(cache), minimax.model) is type(cache)
    step_class = cache_class(HybridStepCache, minimax.model)
    assert issubclass(step_class, HybridStepCache) and issubclass(step_class, MiniMaxCache)
    other = Zoo("lfm2").model
    assert not is_minimax(other) and is_minimax(minimax.model)
    assert type(PagedCache(other, block_size=BLOCK, num_blocks=8)) is PagedCache
    assert cache_class(HybridStepCache, other) is HybridStepCache
    # the lightning layers keep states, the attention layer alone is paged
    geometry = ModelGeometry.of(minimax.model)
    assert geometry.state_layers == (0, 2) and geometry.num_layers == 1
    # the paged cache's own crop wins over MiniMaxCache's: refused, naming why
    assert not cache.is_croppable
    with pytest.raises(ValueError, match="cannot roll it back to an earlier token"):
        cache.crop(-1)


def test_a_lightning_layers_state_is_none_before_its_first_pass_then_transformers_state(minimax):
    ids = torch.randint(3, VOCAB, (2, 11), generator=torch.Generator().manual_seed(1))
    model = minimax.model
    cache = PagedCache(model, block_size=BLOCK, num_blocks=16)
    assert cache.get_linear_cache(0) is None and cache.get_linear_cache(2) is None
    reference = MiniMaxCache()
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    try:
        with torch.inference_mode():
            model(input_ids=ids, use_cache=True, **{cache_argument_name(model): cache})
    finally:
        model.set_attn_implementation(minimax.default)
    with torch.inference_mode():
        model(input_ids=ids, use_cache=True, **{cache_argument_name(model): reference})
    heads, size = model.config.num_attention_heads, model.config.head_dim
    for layer in (0, 2):
        state = cache.get_linear_cache(layer)
        assert state.shape == (2, heads, size, size)
        torch.testing.assert_close(state, reference.get_linear_cache(layer))
    assert torch.equal(cache.get_linear_cache(0), reference.get_linear_cache(0))  # same inputs
    with pytest.raises(ValueError, match="layer 1 keeps no conv or recurrent state"):
        cache.get_linear_cache(1)  # the attention layer
    with pytest.raises(TypeError, match="takes layer 0's state as a tensor, got list"):
        cache.set_linear_cache(0, [])


def test_greedy_sampling_forks_and_beams_match_transformers_cache(minimax):
    ids, _ = left_padded([13])
    calls = {
        "greedy": dict(max_new_tokens=12, do_sample=False),
        "sampling, forks": dict(
            max_new_tokens=10, do_sample=True, top_k=20, num_return_sequences=3
        ),
        "beams": dict(max_new_tokens=10, num_beams=3, num_return_sequences=2),
    }
    for name, call in calls.items():
        expected = reference_generate(minimax, input_ids=ids, **call)
        got, cache = paged_generate(minimax, input_ids=ids, **call)
        assert torch.equal(got, expected), name
        if name == "sampling, forks":
            assert len({tuple(row) for row in got.tolist()}) == 3  # the samples differ
            assert cache.state_stats().used_slots == 3  # one slot a sequence, forked
    # the states matter: a cache that forgot them between steps gives other tokens
    greedy = dict(input_ids=ids, **calls["greedy"])
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(LinearStateCache, "get_linear_cache", lambda self, layer: None)
        forgot, _ = paged_generate(minimax, **greedy)
    assert not torch.equal(forgot, reference_generate(minimax, **greedy))


def test_a_slot_holds_every_lightning_layers_state(minimax):
    ids, _ = left_padded([9])
    # beam search moves the states to the slots (its reordering), where the stats count them
    _, cache = paged_generate(minimax, input_ids=ids, max_new_tokens=3, num_beams=2)
    config = minimax.model.config
    one_layer = config.num_attention_heads * config.head_dim**2 * 4  # float32
    assert cache.state_stats().bytes_per_slot == 2 * one_layer
    try:
        measured = state_bytes_per_sequence(minimax.model, ModelGeometry.of(minimax.model))
    finally:
        minimax.model.set_attn_implementation(minimax.default)
    assert measured == 2 * one_layer


def test_a_left_padded_batch_gives_each_prompts_own_tokens(minimax):
    """The padding's queries, keys and values are zeroed before the lightning layer's sums (its
    2D mask), and the attention layer never stores them: every row generates what its prompt
    does alone."""
    lengths = [5, 11, 19]
    ids, mask = left_padded(lengths)
    got, _ = paged_generate(minimax, input_ids=ids, attention_mask=mask, max_new_tokens=12)
    for row, length in enumerate(lengths):
        prompt = ids[row, -length:].tolist()
        assert got[row, ids.shape[1] :].tolist() == minimax.greedy(prompt, 12), row


def two_passes(zoo: Zoo, ids: torch.Tensor, cache) -> torch.Tensor:
    """The logits of the second pass, ``ids[:, 10:]``, after a first of ``ids[:, :10]``."""
    model, arg = zoo.model, cache_argument_name(zoo.model)
    if isinstance(cache, PagedCache):
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
    try:
        with torch.inference_mode():
            model(input_ids=ids[:, :10], use_cache=True, **{arg: cache})
            positions = torch.arange(10, ids.shape[1]).unsqueeze(0)
            return model(
                input_ids=ids[:, 10:], position_ids=positions, use_cache=True, **{arg: cache}
            ).logits
    finally:
        model.set_attn_implementation(zoo.default)


@pytest.mark.parametrize("layout", ["attention first", "lightning first"])
def test_a_prompt_in_two_passes_continues_the_state(minimax, layout):
    """A later pass finds the state and runs the lightning layer token by token from it (the
    first ran blocks from zero): the logits of one pass over the whole prompt, and, where
    transformers' own cache sizes its attention mask right (an attention layer first: it takes
    the sizes from layer 0), that cache's."""
    zoo = minimax if layout == "lightning first" else Zoo("minimax")
    ids = torch.randint(3, VOCAB, (1, 19), generator=torch.Generator().manual_seed(2))
    paged = two_passes(zoo, ids, PagedCache(zoo.model, block_size=BLOCK, num_blocks=16))
    with torch.inference_mode():
        whole = zoo.model(input_ids=ids, use_cache=False).logits[:, 10:]
    torch.testing.assert_close(paged, whole, rtol=1e-4, atol=1e-4)
    if layout == "attention first":
        reference = two_passes(zoo, ids, MiniMaxCache())
        torch.testing.assert_close(paged, reference, rtol=1e-5, atol=1e-5)
    # the state matters: from a zero state the second pass gives other logits
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(LinearStateCache, "get_linear_cache", lambda self, layer: None)
        forgot = two_passes(zoo, ids, PagedCache(zoo.model, block_size=BLOCK, num_blocks=16))
    assert not torch.allclose(forgot, whole, rtol=1e-2, atol=1e-2)


def test_the_engine_serves_samples_beams_and_greedy_under_chunked_prefill_and_preemption(minimax):
    """Prompt chunks of 12 tokens carry the lightning state from chunk to chunk; requests of
    several sequences are preempted and recomputed: seeded samples are those of a run never
    preempted, every logits row sampled from is the cacheless model's, beams are a cacheless
    reference's and greedy tokens generate()'s."""
    work = several_sequences()
    roomy, _, unpreempted = serve_recording(minimax, work, num_blocks=64)
    assert unpreempted == []
    tight = dict(num_blocks=10, max_num_batched_tokens=12, max_num_seqs=8)
    got, rows, preempted = serve_recording(minimax, work, **tight)
    assert got == roomy
    assert any(seqs > 1 and tokens > 1 for _, seqs, tokens in preempted), preempted
    for tokens, row in rows:
        torch.testing.assert_close(row, full_logits(minimax, tokens), rtol=1e-4, atol=1e-4)
    assert got[1] == reference_beam_search(minimax, work[1][0], 2, 8)
    assert got[3] == [minimax.greedy(work[3][0], 8)]
    assert len({tuple(s) for s in got[0]}) > 1


def test_the_engine_runs_minimax_on_its_minimax_step_cache(minimax):
    engine = Engine(minimax.model, num_blocks=8, block_size=BLOCK, enable_prefix_caching=True)
    minimax.model.set_attn_implementation(minimax.default)
    runner = engine.core.runner
    assert isinstance(runner, HybridRunner)
    assert isinstance(runner.cache, HybridStepCache) and isinstance(runner.cache, MiniMaxCache)
    assert not engine.block_manager.enable_prefix_caching  # turned off, with a warning
    with pytest.raises(ValueError, match="speculative decoding is refused"):
        Engine(minimax.model, num_blocks=8, block_size=BLOCK, speculative={})
    lookup_ids, _ = left_padded([5], seed=1, repeat=6)
    with pytest.raises(ValueError, match="cannot roll it back to an earlier token"):
        paged_generate(minimax, input_ids=lookup_ids, max_new_tokens=4, prompt_lookup_num_tokens=3)


def test_what_minimax_cannot_be_served_with_is_refused_with_the_reason():
    """Lightning layers only: nothing to page. A model of another type whose class says MiniMax
    (a fork with a cache class of its own) is refused as before: only transformers' MiniMax is
    known to keep its states through MiniMaxCache's two calls."""
    lightning_only = build("minimax", device="meta", layer_types=["linear_attention"] * 2)
    with pytest.raises(UnsupportedModelError, match="has no attention layer"):
        PagedCache(lightning_only, block_size=BLOCK, num_blocks=8)
    fork = build("minimax", device="meta")
    fork.config.model_type = "minimax_fork"
    assert not is_minimax(fork)
    with pytest.raises(UnsupportedModelError, match="a cache class of its own"):
        PagedCache(fork, block_size=BLOCK, num_blocks=8)
    with pytest.raises(UnsupportedModelError, match="a cache class of its own"):
        Engine(fork, num_blocks=8, block_size=BLOCK)
