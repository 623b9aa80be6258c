"""Speculative decoding (engine/spec_decode.py): n-gram drafts, their slots, and verification.
The reference is the plain engine: greedy requests must give exactly its tokens (and seeded
sampled ones too, since a draft is checked against the token the plain sampler would draw);
the verification rule alone is checked against the target distribution statistically."""

import types

import pytest
import test_engine
import test_engine_delivery
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import rule

transformers = pytest.importorskip("transformers")

from test_engine import (  # noqa: E402
    BLOCK,
    assert_all_freed,
    prompts,
    run_through_one_failure,
)

from paged_attention.engine import (  # noqa: E402
    Engine,
    EngineConfig,
    SamplingParams,
    SpeculativeConfig,
)
from paged_attention.engine import core as core_module  # noqa: E402
from paged_attention.engine.plan import ScheduledChunk  # noqa: E402
from paged_attention.engine.request import Request, RequestMetrics, Sequence  # noqa: E402
from paged_attention.engine.scheduler import Scheduler  # noqa: E402
from paged_attention.engine.spec_decode import NgramProposer, verify_drafts  # noqa: E402
from paged_attention.kv.block_manager import BlockManager  # noqa: E402

model = test_engine.model  # the fixture: test_engine's tiny Llama
text_model = test_engine.text_model


def repetitive_prompts(count, seed=0, length=40):
    """Prompts that repeat a short random phrase: their continuations repeat it too, so n-gram
    drafts are accepted."""
    rng = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        phrase = torch.randint(
            3, 256, (int(torch.randint(3, 12, (1,), generator=rng)),), generator=rng
        )
        out.append((phrase.tolist() * length)[:length])
    return out


def run(model, prompts_, params, speculative=None, **kwargs):
    """Every prompt to the end on a fresh engine; returns (engine, outputs)."""
    options = {"num_blocks": 200, "block_size": BLOCK, **kwargs}
    engine = Engine(model, speculative=speculative, **options)
    outputs = engine.generate(prompts_, params)
    assert_all_freed(engine)
    return engine, outputs


def results(outputs):
    return [(o.outputs, o.finish_reasons) for o in outputs]


NGRAM = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=3)


# ------------------------------------------------------------------------------ the proposer


@pytest.mark.parametrize(
    ("tokens", "lookup", "limit", "expected"),
    [
        ([1, 2, 3, 4, 2, 3], (2, 3), 4, [4, 2, 3]),  # [4, 2, 3] not found; [2, 3] is
        ([1, 2, 3, 4, 2, 3], (2, 3), 1, [4]),
        ([5, 1, 2, 9, 7, 1, 2, 8, 1, 2], (1, 2), 3, [9, 7, 1]),  # the earliest occurrence
        ([5, 1, 2, 9, 7, 3, 1, 2, 8, 3, 1, 2], (1, 3), 2, [8, 3]),  # the longest n-gram wins
        ([1, 2, 3, 4], (1, 3), 3, []),  # nothing repeats
        ([7, 7], (1, 1), 5, [7]),
        ([7], (1, 1), 5, []),
        ([4, 4, 4, 4], (2, 2), 8, [4, 4]),  # a match may overlap the suffix
    ],
)
def test_ngram_proposer_finds_the_longest_earliest_match(tokens, lookup, limit, expected):
    config = SpeculativeConfig(prompt_lookup_min=lookup[0], prompt_lookup_max=lookup[1])
    assert NgramProposer(config).propose(tokens, limit) == expected


def test_ngram_proposer_matches_a_brute_force_search():
    rng = torch.Generator().manual_seed(3)
    proposer = NgramProposer(SpeculativeConfig(prompt_lookup_min=2, prompt_lookup_max=4))
    for _ in range(300):
        tokens = torch.randint(
            0, 4, (int(torch.randint(1, 30, (1,), generator=rng)),), generator=rng
        )
        tokens = tokens.tolist()
        expected = []
        for n in range(4, 1, -1):
            starts = [
                i for i in range(len(tokens) - n) if tokens[i : i + n] == tokens[len(tokens) - n :]
            ]
            if starts:
                expected = tokens[starts[0] + n : starts[0] + n + 3]
                break
        assert proposer.propose(tokens, 3) == expected, tokens


# ------------------------------------------------------------------------------ configuration


@pytest.mark.parametrize(
    ("kwargs", "error", "field"),
    [
        ({"method": "eagle"}, ValueError, "method"),
        ({"num_speculative_tokens": 0}, ValueError, "num_speculative_tokens"),
        ({"num_speculative_tokens": 2.0}, TypeError, "num_speculative_tokens"),
        ({"prompt_lookup_min": 0}, ValueError, "prompt_lookup_min"),
        ({"prompt_lookup_max": True}, TypeError, "prompt_lookup_max"),
        ({"prompt_lookup_min": 3, "prompt_lookup_max": 2}, ValueError, "prompt_lookup_max"),
    ],
)
def test_speculative_config_names_the_bad_field(kwargs, error, field):
    with pytest.raises(error, match=field):
        SpeculativeConfig(**kwargs)


def test_engine_config_takes_a_speculative_config_or_its_fields(model):
    config = EngineConfig.from_kwargs(
        num_blocks=8, speculative={"num_speculative_tokens": 5, "prompt_lookup_max": 2}
    )
    assert config.speculative == SpeculativeConfig(num_speculative_tokens=5, prompt_lookup_max=2)
    with pytest.raises(TypeError, match="speculative"):
        EngineConfig.from_kwargs(num_blocks=8, speculative=3)
    with pytest.raises(TypeError, match="speculative"):
        EngineConfig.from_kwargs(num_blocks=8, speculative={"k": 3})
    engine = Engine(model, num_blocks=8, block_size=BLOCK, speculative=NGRAM)
    assert engine.config.speculative is NGRAM


def test_the_servers_metrics_count_drafted_and_accepted_tokens(model):
    from paged_attention.server.metrics import ServerMetrics

    engine = Engine(model, num_blocks=64, block_size=BLOCK, speculative=NGRAM)
    engine.add_request(repetitive_prompts(1, seed=14)[0], SamplingParams(24))
    metrics = ServerMetrics()
    while engine.has_unfinished():
        metrics.on_step(engine, engine.step())
    text = metrics.render().decode()
    drafted = f"paged_attention_spec_decode_num_draft_tokens_total {engine.stats.draft_tokens}.0"
    accepted = engine.stats.accepted_draft_tokens
    assert drafted in text and accepted > 0
    assert f"paged_attention_spec_decode_num_accepted_tokens_total {accepted}.0" in text


def test_tensor_parallel_engines_refuse_speculation(model, monkeypatch):
    split = types.SimpleNamespace(tensor_parallel=types.SimpleNamespace(size=2), state_layers=())
    monkeypatch.setattr(core_module.ModelGeometry, "of", classmethod(lambda cls, m, **kw: split))
    with pytest.raises(ValueError, match="speculative=None"):
        Engine(model, num_blocks=8, block_size=BLOCK, speculative=NGRAM)


# ------------------------------------------------------------------------------ greedy exactness


def test_greedy_tokens_equal_the_plain_engines_and_drafts_are_accepted(model):
    work = repetitive_prompts(10) + prompts(6, seed=4)
    params = SamplingParams(48)
    _, plain = run(model, work, params)
    engine, spec = run(model, work, params, NGRAM)
    assert results(spec) == results(plain)
    stats = engine.stats
    assert stats.accepted_draft_tokens > 0
    assert 0 < stats.draft_acceptance_rate <= 1
    assert stats.generated_tokens == sum(len(o.outputs[0]) for o in plain)
    # Accepted drafts save steps: fewer steps than tokens of the longest request.
    assert stats.steps < 48


def test_mixed_batches_with_and_without_drafts(model):
    """Drafting requests in the same steps as parallel samples, beam search, sampled and
    prefilling requests, which all decode as without speculation."""
    work = [(p, SamplingParams(30)) for p in repetitive_prompts(5, seed=2)]
    work += test_engine.mixed_workload()[:6]
    work += [(p, SamplingParams(20, temperature=0.8, seed=i)) for i, p in enumerate(prompts(3))]
    _, plain = run(model, [p for p, _ in work], [s for _, s in work], max_num_seqs=8)
    engine, spec = run(model, [p for p, _ in work], [s for _, s in work], NGRAM, max_num_seqs=8)
    assert results(spec) == results(plain)
    assert engine.stats.accepted_draft_tokens > 0


def test_chunked_prefill_and_a_token_budget_with_drafts(model):
    work = repetitive_prompts(6, seed=5, length=60) + prompts(4, seed=6, low=30, high=60)
    params = SamplingParams(30)
    _, plain = run(model, work, params)
    engine = Engine(
        model,
        num_blocks=200,
        block_size=BLOCK,
        speculative=NGRAM,
        max_num_batched_tokens=24,
        max_num_seqs=8,
    )
    ids = [engine.add_request(p, params) for p in work]
    finished, drafted_steps = {}, 0
    while engine.has_unfinished():
        out = engine.scheduler.schedule()
        assert out.num_tokens <= 24  # drafts stay within the budget
        drafted_steps += out.has_drafts
        engine.scheduler.rollback(out)  # only looked at: the real step schedules it again
        finished.update((o.request_id, o) for o in engine.step() if o.finished)
    assert [(finished[i].outputs, finished[i].finish_reasons) for i in ids] == results(plain)
    assert drafted_steps and engine.stats.accepted_draft_tokens > 0
    assert_all_freed(engine)


@pytest.mark.parametrize("num_host_blocks", [0, 64])
def test_preemption_by_recompute_or_swap_with_drafts(model, num_host_blocks):
    work = repetitive_prompts(8, seed=7, length=30)
    params = SamplingParams(40)
    _, plain = run(model, work, params)
    engine, spec = run(model, work, params, NGRAM, num_blocks=24, num_host_blocks=num_host_blocks)
    assert results(spec) == results(plain)
    preempted = engine.stats.preemptions_by_recompute + engine.stats.swaps_out
    assert preempted > 0 and engine.stats.accepted_draft_tokens > 0


def test_every_length_and_stop_token_inside_an_accepted_run(model):
    """max_new_tokens and stop tokens at every position of a repetitive output: the ones inside
    a run of accepted drafts end the request there, as the plain engine does."""
    (prompt,) = repetitive_prompts(1, seed=8)
    _, (long,) = run(model, [prompt], SamplingParams(40))
    output = long.outputs[0]
    work = [SamplingParams(n) for n in range(1, 40)]
    work += [SamplingParams(40, stop_token_ids=(t,)) for t in sorted(set(output))]
    work += [SamplingParams(40, stop_token_ids=(t,), min_tokens=10) for t in sorted(set(output))]
    _, plain = run(model, [prompt] * len(work), work)
    engine, spec = run(model, [prompt] * len(work), work, NGRAM)
    assert results(spec) == results(plain)
    assert engine.stats.accepted_draft_tokens > 0
    assert {r for o in spec for r in o.finish_reasons} == {"length", "stop"}


def test_eos_inside_an_accepted_run(model):
    (prompt,) = repetitive_prompts(1, seed=8)
    _, (long,) = run(model, [prompt], SamplingParams(40))
    output = long.outputs[0]
    for eos in sorted(set(output[5:]))[:4]:
        _, plain = run(model, [prompt], SamplingParams(40), eos_token_id=eos)
        engine, spec = run(model, [prompt], SamplingParams(40), NGRAM, eos_token_id=eos)
        assert results(spec) == results(plain)
        assert spec[0].finish_reasons == ["eos"]
        assert spec[0].outputs[0][-1] == eos


def test_controls_and_logprobs_see_the_drafts_as_generated(model):
    """Penalties, bias, min_tokens and logprobs: each verified row is processed as if the drafts
    before it were already generated."""
    work = repetitive_prompts(4, seed=9)
    controls = [
        SamplingParams(30, repetition_penalty=1.3),
        SamplingParams(30, frequency_penalty=0.5, presence_penalty=0.3),
        SamplingParams(30, logit_bias={7: 5.0}, min_tokens=20, stop_token_ids=(7,)),
        SamplingParams(30, logprobs=3),
    ]
    _, plain = run(model, work, controls)
    engine, spec = run(model, work, controls, NGRAM)
    assert results(spec) == results(plain)
    assert engine.stats.draft_tokens > 0
    for ours, theirs in zip(spec[3].logprobs[0], plain[3].logprobs[0]):
        assert ours.keys() == theirs.keys()
        for token in ours:
            assert ours[token].rank == theirs[token].rank
            assert ours[token].logprob == pytest.approx(theirs[token].logprob, abs=1e-4)


def test_stop_strings_inside_an_accepted_run(text_model):
    model, tokenizer = text_model
    prompt = "abc abc abc abc abc abc abc abc abc abc abc"
    plain_engine = Engine(
        model, num_blocks=128, block_size=BLOCK, tokenizer=tokenizer, eos_token_id=[]
    )
    (free,) = plain_engine.generate([prompt], SamplingParams(30))
    text = free.text
    stops = sorted({text[i : i + 2] for i in range(1, len(text) - 2) if text[i : i + 2].strip()})
    assert stops
    for stop in stops[:3]:
        params = SamplingParams(30, stop=(stop,))
        (expected,) = plain_engine.generate([prompt], params)
        engine = Engine(
            model,
            num_blocks=128,
            block_size=BLOCK,
            tokenizer=tokenizer,
            eos_token_id=[],
            speculative=NGRAM,
        )
        (out,) = engine.generate([prompt], params)
        assert (out.outputs, out.text, out.finish_reasons) == (
            expected.outputs,
            expected.text,
            expected.finish_reasons,
        )
        assert_all_freed(engine)


# ------------------------------------------------------------------------------ sampling


def test_seeded_sampling_equals_the_plain_engine_and_repeats(model):
    work = repetitive_prompts(3, seed=10)
    params = [
        SamplingParams(24, temperature=t, top_k=k, top_p=p, seed=s)
        for s, (t, k, p) in enumerate([(0.3, 0, 1.0), (0.5, 5, 0.9), (0.2, 0, 0.8)])
    ]
    _, plain = run(model, work, params)
    first_engine, first = run(model, work, params, NGRAM)
    _, second = run(model, work, params, NGRAM, max_num_seqs=2, num_blocks=40)
    assert results(first) == results(plain)
    assert results(second) == results(first)  # batch and pool size change nothing
    assert first_engine.stats.accepted_draft_tokens > 0


def test_verification_keeps_the_target_distribution():
    """Draft d0 = 3 at row 0, d1 = 0 at row 1, over a vocabulary of 6: the first token must
    follow p0 (d0 accepted with probability p0(d0), else a token of p0 without d0,
    renormalised), the second, after an accepted d0, p1. Chi-square over 20000 requests, each
    with its own seed, verified 500 at a time."""
    p0 = torch.tensor([0.05, 0.30, 0.10, 0.25, 0.20, 0.10])
    p1 = torch.tensor([0.40, 0.05, 0.05, 0.20, 0.10, 0.20])
    params = SamplingParams(10, temperature=1.0)
    batch, runs = 500, 20000
    logits = torch.stack([p0.log(), p1.log(), torch.zeros(6)] * batch)
    first, second, accepted = torch.zeros(6), torch.zeros(6), 0
    for start in range(0, runs, batch):
        groups = []
        for i in range(batch):
            seq = Sequence(0, [5])
            generator = torch.Generator().manual_seed(start + i)
            request = Request(0, [1, 2], params, generator, RequestMetrics(0.0), seqs=[seq])
            chunk = ScheduledChunk(request, seq, 2, 3, drafts=[3, 0])
            groups.append((request, chunk, [3 * i, 3 * i + 1, 3 * i + 2]))
        for result in verify_drafts(logits, groups):
            assert result.accepted == len(result.tokens) - 1 and result.drafted == 2
            first[result.tokens[0]] += 1
            if result.tokens[0] == 3:
                second[result.tokens[1]] += 1
            accepted += result.accepted
    assert chi_square(first, p0) < 20.5  # 5 degrees of freedom, p = 0.001
    assert chi_square(second, p1) < 20.5
    assert accepted / runs == pytest.approx(float(p0[3] + p0[3] * p1[0]), abs=0.02)


def chi_square(counts, probs):
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def test_greedy_verification_accepts_while_drafts_equal_the_argmax():
    logits = torch.tensor([[0.0, 5.0, 1.0], [3.0, 0.0, 1.0], [0.0, 0.0, 9.0]])
    seq = Sequence(0, [1])
    request = Request(0, [0], SamplingParams(10), torch.Generator(), RequestMetrics(0.0))
    request.seqs = [seq]
    for drafts, tokens in [([1, 0], [1, 0, 2]), ([1, 2], [1, 0]), ([2, 0], [1])]:
        chunk = ScheduledChunk(request, seq, 1, 3, drafts=drafts)
        (result,) = verify_drafts(logits, [(request, chunk, [0, 1, 2])])
        assert result.tokens == tokens and result.drafted == 2


# ------------------------------------------------------------------------------ slots and failures


def test_no_drafts_beyond_the_pool_and_its_watermark():
    """Drafts take the rest of a sequence's last block, and new blocks only while the pool
    keeps its watermark: a short pool decodes plainly, with nothing preempted."""
    manager = BlockManager(8, 4, watermark=0.125)  # one block of watermark
    speculative = SpeculativeConfig(num_speculative_tokens=8)
    scheduler = Scheduler(manager, max_num_seqs=2, speculative=speculative)
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3]
    request = Request(0, prompt, SamplingParams(16), torch.Generator(), RequestMetrics(0.0))
    scheduler.add(request)
    out = scheduler.schedule()  # the prompt: 3 blocks
    scheduler.update_from_output(out, [(request, _drawn(4))], lambda r, s: None, ())
    out = scheduler.schedule()  # 13 slots in 4 blocks; 3 free blocks beyond the watermark
    (chunk,) = out.decode
    assert chunk.drafts == [5, 6, 7, 8, 9, 1, 2, 3] and out.num_tokens == 9
    assert manager.num_free_device_blocks() == 2
    scheduler.rollback(out)
    manager.allocate(99, 12)  # another sequence takes the blocks beyond the watermark
    out = scheduler.schedule()
    (chunk,) = out.decode
    assert chunk.drafts == [5, 6, 7]  # the rest of the last block only
    assert manager.num_free_device_blocks() == 1
    assert scheduler.stats.preemptions_by_recompute == 0 and scheduler.running == [request]


def test_the_step_proposes_for_all_its_drafting_sequences_in_one_call():
    """The drafting sequences of a step are gathered and proposed for together; the n-gram
    proposer's batch is its per-sequence proposals."""
    manager = BlockManager(64, 4)
    scheduler = Scheduler(manager, max_num_seqs=4, speculative=NGRAM)
    proposer = scheduler.drafts.proposer
    calls = []

    def propose_batch(work):
        calls.append([(seq_id, list(tokens), limit) for seq_id, tokens, limit in work])
        return NgramProposer.propose_batch(proposer, work)

    proposer.propose_batch = propose_batch
    requests = []
    for i, tokens in enumerate(repetitive_prompts(3, seed=20, length=14)):
        requests.append(
            Request(i, tokens, SamplingParams(16), torch.Generator(), RequestMetrics(0.0))
        )
        scheduler.add(requests[-1])
    out = scheduler.schedule()  # the prompts
    scheduler.update_from_output(out, [(r, _drawn(r.prompt[0])) for r in requests], _unfinished, ())
    out = scheduler.schedule()
    (work,) = calls
    assert [seq_id for seq_id, _, _ in work] == [c.seq.seq_id for c in out.decode]
    assert all(limit == NGRAM.num_speculative_tokens for _, _, limit in work)
    expected = [proposer.propose(tokens, limit) for _, tokens, limit in work]
    assert [c.drafts for c in out.decode] == expected and all(expected)


def test_drafts_past_what_the_pool_has_left_are_cut_when_placed():
    """Limits are set before any drafts take slots: the pool's room is read again as each
    sequence's drafts are placed, so the first takes the blocks beyond the watermark and the
    second keeps the rest of its last block only."""
    manager = BlockManager(11, 4, watermark=0.1)  # one block of watermark
    speculative = SpeculativeConfig(num_speculative_tokens=8)
    scheduler = Scheduler(manager, max_num_seqs=2, speculative=speculative)
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3]
    requests = [
        Request(i, list(prompt), SamplingParams(16), torch.Generator(), RequestMetrics(0.0))
        for i in range(2)
    ]
    for request in requests:
        scheduler.add(request)
    out = scheduler.schedule()  # the prompts: 6 blocks
    scheduler.update_from_output(out, [(r, _drawn(4)) for r in requests], _unfinished, ())
    out = scheduler.schedule()  # 13 slots each in 8 blocks; 2 free beyond the watermark
    first, second = out.decode
    assert first.drafts == [5, 6, 7, 8, 9, 1, 2, 3] and second.drafts == [5, 6, 7]
    assert manager.num_free_device_blocks() == 1 and out.num_tokens == 2 + 8 + 3


def test_budget_the_proposals_leave_unused_goes_to_the_sequences_left_out():
    """A step with room for 5 drafts: the first sequence's limit of 4 leaves 1 for the second
    and none for the third; the first finds no n-gram, so the third gets a round of its own
    with the 4 left."""
    manager = BlockManager(64, 4)
    scheduler = Scheduler(manager, max_num_seqs=3, speculative=NGRAM)
    phrase = [20, 21, 22] * 4 + [20, 21]
    prompts_ = [list(range(3, 17)), phrase, list(phrase)]
    requests = [
        Request(i, p, SamplingParams(16), torch.Generator(), RequestMetrics(0.0))
        for i, p in enumerate(prompts_)
    ]
    for request in requests:
        scheduler.add(request)
    out = scheduler.schedule()  # the prompts
    drawn = [(requests[0], _drawn(99)), (requests[1], _drawn(22)), (requests[2], _drawn(22))]
    scheduler.update_from_output(out, drawn, _unfinished, ())
    scheduler.max_num_batched_tokens = 8  # 3 decodes and 5 drafts
    out = scheduler.schedule()
    assert [c.request for c in out.decode] == requests
    assert [c.drafts for c in out.decode] == [[], [20], [20, 21, 22, 20]]
    assert out.num_tokens == 8


def _unfinished(request, seq):
    return None


def _drawn(token):
    from paged_attention.engine.request import Drawn

    return Drawn([token])


@pytest.mark.parametrize("fail_at", [2, 5, 9])
def test_a_failed_forward_with_drafts_changes_nothing(model, fail_at):
    work = repetitive_prompts(6, seed=11)
    params = SamplingParams(30)
    _, expected = run(model, work, params, NGRAM)
    engine = Engine(model, num_blocks=200, block_size=BLOCK, speculative=NGRAM)
    outputs = run_through_one_failure(engine, model, [(p, params) for p in work], fail_at)
    assert outputs == [o.outputs for o in expected]
    assert_all_freed(engine)


def test_a_failed_verification_rolls_the_step_back(model, monkeypatch):
    work = repetitive_prompts(4, seed=12)
    params = [SamplingParams(30), SamplingParams(30, temperature=0.5, seed=1)] * 2
    _, expected = run(model, work, params, NGRAM)
    calls = {"n": 0}
    verify = core_module.verify_drafts

    def failing(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected failure")
        return verify(*args, **kwargs)

    monkeypatch.setattr(core_module, "verify_drafts", failing)
    engine = Engine(model, num_blocks=200, block_size=BLOCK, speculative=NGRAM)
    ids = [engine.add_request(p, s) for p, s in zip(work, params)]
    finished = {}
    with pytest.raises(RuntimeError, match="injected"):
        while engine.has_unfinished():
            finished.update((o.request_id, o) for o in engine.step() if o.finished)
    while engine.has_unfinished():
        finished.update((o.request_id, o) for o in engine.step() if o.finished)
    assert [finished[i].outputs for i in ids] == [o.outputs for o in expected]
    assert_all_freed(engine)


def test_decode_executors_serve_plain_steps_only(model):
    """With compiled decode steps on, a step with drafts runs eagerly; plain steps still use
    the executor (its fits() is what the runner asks)."""
    engine = Engine(model, num_blocks=200, block_size=BLOCK, speculative=NGRAM)
    calls = []

    class Recorder:
        def fits(self, out):
            calls.append(out.has_drafts)
            return False

    engine.runner.graphs = Recorder()
    engine.generate(repetitive_prompts(2, seed=13), SamplingParams(20))
    assert calls and not any(calls)  # never asked for a step with drafts
    assert engine.stats.draft_tokens > 0


DRAFTS_IN_DELIVERY = []  # accepted drafts per example (checked by hand: most accept some)


class SpeculativeDelivery(test_engine_delivery.EngineDelivery):
    """The delivery state machine (streams, step(), aborts, dropped streams, faults in the
    forward pass and in sampling or verification) on an engine with n-gram drafts; its
    reference run is the plain engine, so finished requests must have exactly its tokens."""

    def __init__(self):
        super().__init__()
        self.engine = Engine(
            self.model,
            num_blocks=24,
            block_size=BLOCK,
            num_host_blocks=24,
            max_num_seqs=8,
            speculative=NGRAM,
        )
        self.verify = core_module.verify_drafts
        core_module.verify_drafts = self._verify

    @rule(
        phrase=st.lists(st.integers(3, 127), min_size=2, max_size=5),
        repeats=st.integers(3, 6),
        params=st.sampled_from(
            [SamplingParams(12), SamplingParams(7, temperature=0.5, seed=1, logprobs=1)]
        ),
    )
    def add_repeating_request(self, phrase, repeats, params):
        """A prompt that repeats a phrase: its drafts are often accepted."""
        prompt = phrase * repeats
        self.work[self.engine.add_request(prompt, params)] = (prompt, params)

    def _verify(self, *args, **kwargs):
        if self.faults.armed == "sampling":
            self.faults.armed = None
            raise RuntimeError("injected verification failure")
        return self.verify(*args, **kwargs)

    def teardown(self):
        try:
            super().teardown()
        finally:
            core_module.verify_drafts = self.verify
            DRAFTS_IN_DELIVERY.append(self.engine.stats.accepted_draft_tokens)


SpeculativeDelivery.TestCase.settings = settings(
    max_examples=8,
    stateful_step_count=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
test_speculative_engine_delivers_every_output_exactly_once = SpeculativeDelivery.TestCase


def test_a_cut_into_a_shared_cached_block_copies_it_first_in_the_next_step():
    """Giving back rejected drafts may cut into a full block that the prefix cache holds and
    another sequence shares: the sequence gets its own copy, made at the start of the next
    step (again after a failed step), and dropped once the sequence is gone."""
    from paged_attention.engine.plan import SchedulerOutput
    from paged_attention.engine.spec_decode import DraftSlots

    manager = BlockManager(8, 4, enable_prefix_caching=True)
    manager.allocate(1, [3, 4, 5, 6, 7, 8, 9, 10])  # two full blocks, registered
    manager.fork(1, 2)
    slots = DraftSlots(manager, NGRAM)
    slots.give_back(1, 6)
    (pair,) = [p for _, p in slots._carried]
    assert manager.block_table(1)[1] == pair[1] != pair[0] == manager.block_table(2)[1]
    out = SchedulerOutput()
    assert slots.reserve(out, 10) == 0  # no decodes: nothing drafted, the copy carried
    assert out.block_ops == [("copy", [pair])]
    slots.restore(out)  # the step failed: the next one copies again
    again = SchedulerOutput()
    slots.reserve(again, 10)
    assert again.block_ops == [("copy", [pair])]
    slots.restore(again)
    manager.free(1)
    gone = SchedulerOutput()
    slots.reserve(gone, 10)
    assert gone.block_ops == [] and gone.carried_copies == []
