"""Speculative decoding with a draft model (engine/draft_model.py). The reference for the drafts
is the draft model's own greedy ``generate()``; the reference for the engine's tokens is the
plain engine: whatever the draft proposes, greedy and seeded sampled requests get exactly the
tokens they get without speculation."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from test_engine import BLOCK, assert_all_freed, prompts  # noqa: E402
from test_spec_decode import repetitive_prompts, results, run  # noqa: E402

from paged_attention.engine import Engine, EngineConfig, SamplingParams, SpeculativeConfig  # noqa: E402
from paged_attention.engine.draft_model import DraftModelProposer  # noqa: E402


def llama(layers=2, hidden=128, vocab=256, seed=0):
    """test_engine's tiny Llama (with the defaults and seed 0, the same weights)."""
    config = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        eos_token_id=2,
        pad_token_id=0,
    )
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def target():
    return llama()


@pytest.fixture(scope="module")
def twin():
    """A separate model with the target's weights: its drafts are always accepted."""
    return llama()


@pytest.fixture(scope="module")
def small():
    """A smaller random model over the same vocabulary: its drafts are mostly rejected."""
    return llama(layers=1, hidden=64, seed=5)


def draft_config(draft, k=4):
    return SpeculativeConfig(method="draft_model", draft_model=draft, num_speculative_tokens=k)


def greedy_continuation(model, tokens, count):
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([tokens]), max_new_tokens=count, do_sample=False, min_new_tokens=count
        )
    return out[0, len(tokens) :].tolist()


# ------------------------------------------------------------------------------ the proposer


def test_drafts_are_the_draft_models_greedy_continuation(small):
    proposer = DraftModelProposer(small)
    for i, tokens in enumerate(prompts(4, seed=1)):
        assert proposer.propose(tokens, 5, seq_id=i) == greedy_continuation(small, tokens, 5)


def test_a_kept_cache_gives_the_drafts_of_a_fresh_one(small):
    """Step after step, with drafts accepted in part and another token after them (the cache
    is cut back to the tokens the sequence kept), and a sequence that lost its cache: every
    proposal equals a fresh proposer's."""
    rng = torch.Generator().manual_seed(2)
    kept = DraftModelProposer(small)
    (tokens,) = prompts(1, seed=3)
    for _ in range(12):
        limit = int(torch.randint(1, 5, (1,), generator=rng))
        drafts = kept.propose(tokens, limit, seq_id=7)
        assert drafts == DraftModelProposer(small).propose(tokens, limit)
        accepted = int(torch.randint(0, limit + 1, (1,), generator=rng))
        tokens = tokens + drafts[:accepted] + [int(torch.randint(3, 256, (1,), generator=rng))]
        kept.end_step()
    state = kept.states[7]
    assert state.cache.get_seq_length() == len(state.tokens)  # the tokens it says it holds


def test_caches_of_sequences_that_stop_drafting_are_let_go(small):
    proposer = DraftModelProposer(small)
    first, second = prompts(2, seed=4)
    proposer.propose(first, 2, seq_id=1)
    proposer.propose(second, 2, seq_id=2)
    proposer.end_step()
    assert set(proposer.states) == {1, 2}
    proposer.propose(first + [5], 2, seq_id=1)
    proposer.end_step()
    assert set(proposer.states) == {1}
    proposer.end_step(keep=[1])
    assert set(proposer.states) == {1}
    proposer.end_step()
    assert proposer.states == {}


def test_nothing_to_propose(small):
    proposer = DraftModelProposer(small)
    assert proposer.propose([], 3, seq_id=1) == []
    assert proposer.propose([4, 5], 0, seq_id=1) == []
    assert proposer.states == {}


# ------------------------------------------------------------------------------ configuration


def test_the_config_names_a_missing_or_misplaced_draft_model(small):
    with pytest.raises(TypeError, match="draft_model"):
        SpeculativeConfig(method="draft_model")
    with pytest.raises(TypeError, match="draft_model"):
        SpeculativeConfig(method="draft_model", draft_model="tiny")
    with pytest.raises(ValueError, match="draft_model"):
        SpeculativeConfig(draft_model=small)
    config = EngineConfig.from_kwargs(
        num_blocks=8, speculative={"method": "draft_model", "draft_model": small}
    )
    assert config.speculative.draft_model is small


def test_the_engine_refuses_a_draft_model_that_cannot_draft(target):
    with pytest.raises(ValueError, match="vocabulary of 300"):
        Engine(target, num_blocks=8, block_size=BLOCK, speculative=draft_config(llama(vocab=300)))
    with pytest.raises(ValueError, match="another model"):
        Engine(target, num_blocks=8, block_size=BLOCK, speculative=draft_config(target))
    with pytest.raises(ValueError, match="no config"):
        linear = torch.nn.Linear(2, 2)
        Engine(target, num_blocks=8, block_size=BLOCK, speculative=draft_config(linear))


def test_the_engine_refuses_a_recurrent_draft_model(target):
    from test_model_zoo import build

    hybrid = build("bamba", vocab_size=256)
    with pytest.raises(ValueError, match="cannot cut back|cache class of its own"):
        Engine(target, num_blocks=8, block_size=BLOCK, speculative=draft_config(hybrid))
    minimax = build("minimax", vocab_size=256)
    with pytest.raises(ValueError, match="cache class of its own"):
        Engine(target, num_blocks=8, block_size=BLOCK, speculative=draft_config(minimax))


# ------------------------------------------------------------------------------ the engine


def test_a_perfect_draft_is_always_accepted(target, twin):
    work = prompts(5, seed=6)
    params = SamplingParams(24)
    _, plain = run(target, work, params)
    engine, spec = run(target, work, params, draft_config(twin))
    assert results(spec) == results(plain)
    stats = engine.stats
    assert stats.draft_tokens > 0 and stats.accepted_draft_tokens == stats.draft_tokens
    assert stats.steps < 24  # up to 5 tokens per step


def test_a_poor_draft_changes_no_token(target, small):
    work = prompts(5, seed=7) + repetitive_prompts(3, seed=8)
    params = SamplingParams(24)
    _, plain = run(target, work, params)
    engine, spec = run(target, work, params, draft_config(small, k=3))
    assert results(spec) == results(plain)
    assert engine.stats.draft_tokens > 0
    assert engine.stats.accepted_draft_tokens < engine.stats.draft_tokens


def test_seeded_sampling_and_mixed_requests_equal_the_plain_engine(target, twin):
    work = [(p, SamplingParams(20, temperature=0.9, seed=i)) for i, p in enumerate(prompts(4))]
    work += [(p, SamplingParams(16)) for p in prompts(3, seed=9)]
    work += [(prompts(1, seed=10)[0], SamplingParams(12, n=2, temperature=1.0, seed=3))]
    texts, params = [p for p, _ in work], [s for _, s in work]
    _, plain = run(target, texts, params, max_num_seqs=4)
    engine, spec = run(target, texts, params, draft_config(twin), max_num_seqs=4)
    assert results(spec) == results(plain)
    assert engine.stats.accepted_draft_tokens > 0


@pytest.mark.parametrize("num_host_blocks", [0, 64])
def test_preemption_with_a_draft_model(target, twin, num_host_blocks):
    work = prompts(8, seed=11, low=20, high=30)
    params = SamplingParams(30)
    _, plain = run(target, work, params)
    engine, spec = run(
        target, work, params, draft_config(twin), num_blocks=24, num_host_blocks=num_host_blocks
    )
    assert results(spec) == results(plain)
    stats = engine.stats
    assert stats.preemptions_by_recompute + stats.swaps_out > 0
    assert stats.accepted_draft_tokens > 0
    assert engine.core.scheduler.drafts.proposer.states == {}  # nothing kept once all finished


def test_an_aborted_request_leaves_no_draft_cache(target, twin):
    engine = Engine(target, num_blocks=64, block_size=BLOCK, speculative=draft_config(twin))
    first, second = prompts(2, seed=12)
    kept = engine.add_request(first, SamplingParams(30))
    dropped = engine.add_request(second, SamplingParams(30))
    for _ in range(3):
        engine.step()
    engine.abort(dropped)
    while engine.has_unfinished():
        engine.step()
    assert_all_freed(engine)
    assert engine.core.scheduler.drafts.proposer.states == {}
    assert kept != dropped
