"""Speculative decoding with a draft model (engine/draft_model.py). The reference for the drafts
is the draft model's own greedy ``generate()`` (on another instance with the same weights: the
proposer runs its model over the paged cache), one sequence at a time; the reference for the
engine's tokens is the plain engine: whatever the draft proposes, greedy and seeded sampled
requests get exactly the tokens they get without speculation."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from test_engine import BLOCK, assert_all_freed, prompts  # noqa: E402
from test_spec_decode import repetitive_prompts, results, run  # noqa: E402

from paged_attention.engine import Engine, EngineConfig, SamplingParams, SpeculativeConfig  # noqa: E402
from paged_attention.engine.draft_model import DraftModelProposer  # noqa: E402


def llama(layers=2, hidden=128, vocab=256, seed=0, heads=4):
    """test_engine's tiny Llama (with the defaults and seed 0, the same weights)."""
    config = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
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


def small_llama():
    """A smaller random model over the same vocabulary (heads of 32, a size the kernels
    serve): its drafts are mostly rejected."""
    return llama(layers=1, hidden=64, seed=5, heads=2)


@pytest.fixture(scope="module")
def small():
    return small_llama()


@pytest.fixture(scope="module")
def reference():
    """``small``'s weights in a model left on transformers' own attention, for ``generate``."""
    return small_llama()


def proposer_of(model, num_blocks=256, block_size=BLOCK):
    return DraftModelProposer(model, num_blocks, block_size)


def draft_config(draft, k=4):
    return SpeculativeConfig(method="draft_model", draft_model=draft, num_speculative_tokens=k)


def greedy_continuation(model, tokens, count):
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([tokens]), max_new_tokens=count, do_sample=False, min_new_tokens=count
        )
    return out[0, len(tokens) :].tolist()


# ------------------------------------------------------------------------------ the proposer


def test_batched_drafts_are_each_sequences_greedy_continuation(small, reference):
    proposer = proposer_of(small)
    work = [(i, tokens, 2 + i % 4) for i, tokens in enumerate(prompts(6, seed=1, low=3, high=40))]
    drafts = proposer.propose_batch(work)
    assert [len(d) for d in drafts] == [limit for _, _, limit in work]
    for (_, tokens, limit), got in zip(work, drafts):
        assert got == greedy_continuation(reference, tokens, limit)


def test_kept_caches_give_each_sequences_greedy_drafts_step_after_step(small, reference):
    """Sequences join, draft with their own limits, have their drafts accepted in part (the
    cache is cut back to the tokens the sequence kept), skip a step (their cache let go) and
    leave: every step's drafts are each sequence's greedy continuation."""
    rng = torch.Generator().manual_seed(2)
    proposer = proposer_of(small)
    waiting = [list(p) for p in prompts(6, seed=3, low=4, high=30)]
    live: dict[int, list[int]] = {}
    for step in range(10):
        if waiting and step % 2 == 0:
            live[len(live) + step] = waiting.pop()
        if step == 6:
            live.pop(min(live))  # finished: it leaves
        skipping = {s for s in live if int(torch.randint(0, 5, (1,), generator=rng)) == 0}
        work = [
            (seq_id, tokens, int(torch.randint(1, 5, (1,), generator=rng)))
            for seq_id, tokens in live.items()
            if seq_id not in skipping
        ]
        drafts = proposer.propose_batch(work)
        proposer.end_step()
        assert set(proposer.states) == {seq_id for seq_id, _, _ in work}
        for (seq_id, tokens, limit), got in zip(work, drafts):
            assert got == greedy_continuation(reference, tokens, limit)
            held = proposer.states[seq_id]
            assert held == tokens + got[:-1]  # what the cache holds: fed tokens only
            assert proposer.manager.num_tokens(seq_id) == len(held)
            accepted = int(torch.randint(0, limit + 1, (1,), generator=rng))
            extra = int(torch.randint(3, 256, (1,), generator=rng))
            live[seq_id] = tokens + got[:accepted] + [extra]
        for seq_id in skipping:
            live[seq_id] = live[seq_id] + [7]
    assert set(proposer.manager.seq_ids()) == set(proposer.states)


def test_a_sliding_window_draft_model_keeps_its_caches_too():
    """A Mistral with a 16-token window: its draft pool lets go of the blocks no layer reads,
    and cutting back rejected drafts still gives each sequence its greedy drafts."""

    def mistral():
        torch.manual_seed(3)
        config = transformers.MistralConfig(
            vocab_size=256,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            sliding_window=16,
            max_position_embeddings=512,
        )
        return transformers.MistralForCausalLM(config).eval()

    proposer, windowed = proposer_of(mistral(), num_blocks=64), mistral()
    assert proposer.manager.sliding_window == 16
    rng = torch.Generator().manual_seed(1)
    live = dict(enumerate(prompts(3, seed=5, low=20, high=40)))
    for _ in range(6):
        work = [(seq_id, tokens, 4) for seq_id, tokens in live.items()]
        drafts = proposer.propose_batch(work)
        proposer.end_step()
        for (seq_id, tokens, limit), got in zip(work, drafts):
            assert got == greedy_continuation(windowed, tokens, limit)
            accepted = int(torch.randint(0, limit + 1, (1,), generator=rng))
            live[seq_id] = (
                tokens + got[:accepted] + [int(torch.randint(3, 256, (1,), generator=rng))]
            )
    manager = proposer.manager
    used = manager.num_device_blocks - manager.num_free_device_blocks()
    assert used < sum(-(-len(held) // BLOCK) for held in proposer.states.values())
    # Cut back far behind the window (blocks the kept tokens read were let go): built anew.
    changed = proposer.states[0][:20] + [9, 9, 9]
    (drafts,) = proposer.propose_batch([(0, changed, 3)])
    assert drafts == greedy_continuation(windowed, changed, 3)


def test_one_forward_pass_per_draft_position_for_the_whole_batch(small):
    proposer = proposer_of(small)
    calls = []
    hook = small.register_forward_hook(
        lambda module, args, kwargs, out: calls.append(1), with_kwargs=True
    )
    try:
        work = [(i, tokens, 4) for i, tokens in enumerate(prompts(5, seed=13))]
        proposer.propose_batch(work)
        assert len(calls) == 4  # not 5 x 4
        proposer.end_step()
        calls.clear()
        work = [(i, tokens + [9], 1 + i) for i, (_, tokens, _) in enumerate(work)]
        drafts = proposer.propose_batch(work)
        assert [len(d) for d in drafts] == [1, 2, 3, 4, 5]
        assert len(calls) == 5  # the longest limit
    finally:
        hook.remove()


def test_a_sequence_the_pool_has_no_room_for_drafts_less(small, reference):
    """A pool of 3 blocks of 8 slots: a 25-token prompt does not fit and drafts nothing; a
    14-token one drafts until its cache fills the pool (its drafts still the greedy ones)."""
    proposer = proposer_of(small, num_blocks=3, block_size=8)
    (long,), (short,) = prompts(1, seed=16, low=25, high=26), prompts(1, seed=17, low=14, high=15)
    drafts = proposer.propose_batch([(1, long, 4), (2, short, 20)])
    assert drafts[0] == [] and 1 not in proposer.states
    assert len(drafts[1]) == 24 - len(short) + 1  # the last draft needs no slot
    assert drafts[1] == greedy_continuation(reference, short, len(drafts[1]))
    proposer.end_step()
    assert set(proposer.manager.seq_ids()) == {2}


def test_caches_of_sequences_that_stop_drafting_are_let_go(small):
    proposer = proposer_of(small)
    first, second = prompts(2, seed=4)
    proposer.propose_batch([(1, first, 2), (2, second, 2)])
    proposer.end_step()
    assert set(proposer.states) == {1, 2}
    proposer.propose_batch([(1, first + [5], 2)])
    proposer.end_step()
    assert set(proposer.states) == {1}
    proposer.end_step(keep=[1])
    assert set(proposer.states) == {1}
    proposer.end_step()
    assert proposer.states == {} and proposer.manager.seq_ids() == []
    assert proposer.manager.num_free_device_blocks() == proposer.manager.num_device_blocks


def test_nothing_to_propose(small):
    proposer = proposer_of(small)
    assert proposer.propose_batch([(1, [], 3), (2, [4, 5], 0)]) == [[], []]
    assert proposer.propose_batch([]) == []
    assert proposer.states == {}
    with pytest.raises(ValueError, match="work names a sequence more than once"):
        proposer.propose_batch([(1, [4, 5], 2), (1, [4, 5], 2)])


def test_a_failed_forward_lets_the_batchs_caches_go(small, reference):
    proposer = proposer_of(small)
    first, second = prompts(2, seed=14)
    proposer.propose_batch([(1, first, 2), (2, second, 2)])
    proposer.end_step()

    def fail(module, args, kwargs):
        raise RuntimeError("device lost")

    hook = small.register_forward_pre_hook(fail, with_kwargs=True)
    try:
        with pytest.raises(RuntimeError, match="device lost"):
            proposer.propose_batch([(1, first + [4], 3)])
    finally:
        hook.remove()
    assert set(proposer.states) == {2} and proposer.manager.seq_ids() == [2]
    again = proposer.propose_batch([(1, first + [4], 3)])
    assert again == [greedy_continuation(reference, first + [4], 3)]


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
    heads_of_16 = llama(layers=1, hidden=64, heads=4)  # a head size the kernels lack
    with pytest.raises(ValueError, match="draft_model: the paged cache cannot serve it"):
        Engine(target, num_blocks=8, block_size=BLOCK, speculative=draft_config(heads_of_16))


def test_a_memory_budget_pays_for_the_draft_pool(target, small):
    """The draft pool has a block for each of the model's, and ``max_memory`` holds both."""
    from paged_attention.engine.draft_model import draft_block_bytes

    budget = 1 << 20
    plain = Engine(target, max_memory=budget, block_size=BLOCK)
    spec = Engine(target, max_memory=budget, block_size=BLOCK, speculative=draft_config(small))
    model_bytes, draft_bytes = plain.core.kv_cache.bytes_per_block, draft_block_bytes(small, BLOCK)
    assert plain.core.kv_cache.num_blocks == budget // model_bytes
    assert spec.core.kv_cache.num_blocks == budget // (model_bytes + draft_bytes)
    pool = spec.core.scheduler.drafts.proposer.kv_cache
    assert pool.num_blocks == spec.core.kv_cache.num_blocks and pool.block_size == BLOCK
    assert pool.bytes_per_block == draft_bytes


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


def test_the_draft_model_runs_k_passes_a_step_for_all_drafting_sequences(target, small):
    k = 3
    engine = Engine(target, num_blocks=128, block_size=BLOCK, speculative=draft_config(small, k))
    assert engine.core.scheduler.drafts.proposer.kv_cache.num_blocks == 128  # on top of num_blocks
    calls = []
    hook = small.register_forward_hook(lambda *args: calls.append(1))
    try:
        for tokens in prompts(5, seed=15):
            engine.add_request(tokens, SamplingParams(16))
        widest = 0
        while engine.has_unfinished():
            calls.clear()
            before = engine.stats.draft_tokens
            engine.step()
            assert len(calls) <= k
            widest = max(widest, engine.stats.draft_tokens - before)
    finally:
        hook.remove()
    assert widest > k  # a step drafted for several sequences, still in k passes


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
