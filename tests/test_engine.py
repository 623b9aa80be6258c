"""The continuous-batching engine on a tiny random Llama, checked against transformers."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from paged_attention.engine import Engine, SamplingParams  # noqa: E402

BLOCK = 8


@pytest.fixture(scope="module")
def model():
    config = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        eos_token_id=2,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def prompts(count, seed=0, low=3, high=40):
    rng = torch.Generator().manual_seed(seed)
    lengths = torch.randint(low, high, (count,), generator=rng).tolist()
    return [torch.randint(3, 256, (n,), generator=rng).tolist() for n in lengths]


def full_logits(model, tokens):
    """Last-position logits recomputed from scratch, without any cache."""
    model.set_attn_implementation("sdpa")
    try:
        with torch.inference_mode():
            return model(torch.tensor([tokens]), use_cache=False).logits[0, -1].float()
    finally:
        model.set_attn_implementation("paged_attention")


def hf_greedy(model, prompt, max_new_tokens):
    """transformers' own greedy generate() with its default cache and attention."""
    model.set_attn_implementation("sdpa")
    try:
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=2,
            pad_token_id=0,
        )
    finally:
        model.set_attn_implementation("paged_attention")
    return out[0, len(prompt) :].tolist()


def mixed_workload():
    work = []
    for i, prompt in enumerate(prompts(12, seed=1)):
        if i % 3 == 1:
            params = SamplingParams(12 + i, temperature=0.9, top_p=0.9, n=3, seed=i)
        elif i % 3 == 2:
            params = SamplingParams(10 + i, beam_width=3)
        else:
            params = SamplingParams(14 + i)
        work.append((prompt, params))
    return work


def assert_all_freed(engine):
    assert not engine.has_unfinished()
    assert engine.block_manager.seq_ids() == []  # every sequence freed
    assert engine.block_manager.num_free_device_blocks() == engine.block_manager.num_device_blocks
    assert engine.block_manager.num_free_host_blocks() == engine.block_manager.num_host_blocks


def serve(model, work, num_blocks, **kwargs):
    engine = Engine(model, num_blocks=num_blocks, block_size=BLOCK, **kwargs)
    outputs = engine.generate([p for p, _ in work], [s for _, s in work])
    assert_all_freed(engine)
    return engine, outputs


def serve_stepwise(engine, work, max_steps=2000):
    """Add every request, then step at most ``max_steps`` times (a hang fails instead of
    blocking the test run); returns the final outputs in request order."""
    ids = [engine.add_request(p, s) for p, s in work]
    results = {}
    for _ in range(max_steps):
        if not engine.has_unfinished():
            break
        results.update((o.request_id, o) for o in engine.step() if o.finished)
    assert not engine.has_unfinished(), f"not done after {max_steps} steps"
    return [results[i] for i in ids]


def test_greedy_matches_transformers_generate(model):
    work = [(p, SamplingParams(max_new_tokens=10 + 3 * i)) for i, p in enumerate(prompts(6))]
    engine, outputs = serve(model, work, num_blocks=64)
    for (prompt, params), out in zip(work, outputs):
        assert out.rejected is None
        assert out.outputs == [hf_greedy(model, prompt, params.max_new_tokens)]
        assert out.finish_reasons == ["eos" if out.outputs[0][-1] == 2 else "length"]
    assert engine.stats.swaps_out == 0


def test_results_do_not_depend_on_kv_budget_or_swapping(model):
    work = mixed_workload()
    roomy, expected = serve(model, work, num_blocks=512)
    tight, got = serve(model, work, num_blocks=28)
    assert roomy.stats.swaps_out == 0
    assert tight.stats.swaps_out > 0
    assert tight.stats.swaps_in == tight.stats.swaps_out
    assert tight.stats.peak_contiguous_blocks > 28  # a contiguous cache could not run it
    assert [o.outputs for o in got] == [o.outputs for o in expected]
    assert [o.rejected for o in got] == [None] * len(work)
    assert roomy.stats.cow_copies > 0 and roomy.stats.peak_blocks_saved_by_sharing > 0
    assert tight.stats.generated_tokens == roomy.stats.generated_tokens


def test_parallel_samples_are_seeded_and_distinct(model):
    prompt = prompts(1, seed=2)[0]
    params = SamplingParams(16, temperature=1.0, n=4, seed=7)
    (first,) = serve(model, [(prompt, params)], num_blocks=64)[1]
    (again,) = serve(model, [(prompt, params)], num_blocks=64)[1]
    (other,) = serve(model, [(prompt, SamplingParams(16, temperature=1.0, n=4, seed=8))], 64)[1]
    assert first.outputs == again.outputs
    assert first.outputs != other.outputs
    assert len(first.outputs) == 4 and len({tuple(o) for o in first.outputs}) > 1


def test_tiny_top_p_is_greedy(model):
    work = [(p, SamplingParams(12, temperature=1.0, top_p=1e-6, seed=3)) for p in prompts(3)]
    greedy = [(p, SamplingParams(12)) for p, _ in work]
    assert [o.outputs for o in serve(model, work, 64)[1]] == [
        o.outputs for o in serve(model, greedy, 64)[1]
    ]


def reference_beam_search(model, prompt, width, max_new_tokens, eos=2):
    """The engine's beam rules, recomputing every beam's logits without a cache."""
    beams, done = [([], 0.0)], []
    while True:
        candidates = []
        for tokens, score in beams:
            logprobs = full_logits(model, prompt + tokens).log_softmax(-1)
            candidates += [(score + lp, tokens + [t]) for t, lp in enumerate(logprobs.tolist())]
        candidates.sort(key=lambda c: -c[0])
        beams = []
        for rank, (score, tokens) in enumerate(candidates[: 2 * width]):
            if tokens[-1] == eos:
                if rank < width:
                    done.append((tokens, score))
            elif len(beams) < width:
                beams.append((tokens, score))
        if len(done) >= width or len(beams[0][0]) == max_new_tokens:
            if len(done) < width:  # out of length: the live beams compete too
                done += beams
            done.sort(key=lambda d: -d[1] / len(d[0]))
            return [tokens for tokens, _ in done[:width]]


def test_beam_search_matches_a_cacheless_reference(model):
    work = [(p, SamplingParams(8, beam_width=w)) for p, w in zip(prompts(2, seed=3), (2, 4))]
    engine, outputs = serve(model, work, num_blocks=64)
    for (prompt, params), out in zip(work, outputs):
        expected = reference_beam_search(model, prompt, params.beam_width, 8)
        assert out.outputs == expected
    assert engine.stats.cow_copies > 0


def test_eos_ends_samples_and_beams(model):
    # Make the prompt's most likely next token the EOS token: greedy stops at once, beams
    # collect EOS hypotheses and stop early.
    prompt = prompts(1, seed=4)[0]
    eos = int(full_logits(model, prompt).argmax())
    engine = Engine(model, num_blocks=64, block_size=BLOCK, eos_token_id=eos)
    greedy, beams = engine.generate(
        [prompt, prompt], [SamplingParams(10), SamplingParams(10, beam_width=3)]
    )
    assert greedy.outputs == [[eos]] and greedy.finish_reasons == ["eos"]
    assert beams.outputs == reference_beam_search(model, prompt, 3, 10, eos=eos)
    assert "eos" in beams.finish_reasons
    assert engine.block_manager.seq_ids() == []


def test_requests_wait_when_the_pool_is_full(model):
    # Room for one request at a time (a prompt takes 5 of the 9 blocks, 6 at full length):
    # each later request is first scheduled only after the one before it finished.
    work = [(p, SamplingParams(8)) for p in prompts(4, low=33, high=40)]
    _, expected = serve(model, work, num_blocks=64)
    engine, got = serve(model, work, num_blocks=9, enable_prefix_caching=False)
    assert [o.outputs for o in got] == [o.outputs for o in expected]
    assert engine.stats.peak_running_requests == 1
    for before, after in zip(got, got[1:]):
        assert after.metrics.first_scheduled_step > before.metrics.finished_step


def test_request_that_can_never_fit_is_rejected(model):
    work = [
        (prompts(1, low=60, high=61)[0], SamplingParams(30)),
        (prompts(1)[0], SamplingParams(4)),
    ]
    _, (too_long, fine) = serve(model, work, num_blocks=8)
    assert too_long.outputs == [] and "need 12 blocks of 8" in too_long.rejected
    assert fine.rejected is None and len(fine.outputs[0]) == 4


def test_samples_that_together_outgrow_the_pool_are_rejected_up_front(model):
    # The prompt fits, but four samples growing private blocks cannot: 3 shared prompt blocks
    # plus 5 own blocks per sample need 23 of 8 blocks. Rejected at admission, nothing computed.
    work = [(prompts(1, low=30, high=31)[0], SamplingParams(30, temperature=1.0, n=4))]
    engine, (out,) = serve(model, work, num_blocks=8)
    assert "4 sequences of up to 59 tokens need 23 blocks of 8 together" in out.rejected
    assert engine.stats.prompt_tokens_computed == 0


def test_request_needing_the_whole_pool_runs_alone_without_a_watermark(model):
    # Issue 15, defect 1 (a hang): the sampling request needs every block of the pool when it
    # runs alone; the watermark held back for admissions must not stop it from resuming.
    work = [
        ([5], SamplingParams(max_new_tokens=30)),
        ([7] * 1561, SamplingParams(max_new_tokens=24, n=4, temperature=1.0)),
    ]
    pool = 207  # 195 shared prompt blocks + 4 x 3 own blocks of 8 tokens
    engine = Engine(model, num_blocks=pool, block_size=BLOCK, eos_token_id=[])
    short, wide = serve_stepwise(engine, work)
    assert short.rejected is None and len(short.outputs[0]) == 30
    assert wide.rejected is None and [len(o) for o in wide.outputs] == [24] * 4
    assert engine.stats.swaps_out + engine.stats.preemptions_by_recompute > 0
    assert_all_freed(engine)
    # With 200 blocks the same request can never run: rejected with the reason, no hang.
    engine = Engine(model, num_blocks=200, block_size=BLOCK, eos_token_id=[])
    short, wide = serve_stepwise(engine, work)
    assert short.rejected is None and "need 207 blocks of 8 together" in wide.rejected
    assert_all_freed(engine)


def test_preemption_without_swap_space_recomputes_and_loses_nothing(model):
    # Issue 15, defect 8: with num_host_blocks=0, a preempted request is freed and recomputed
    # from its tokens later, with the same results.
    work = mixed_workload()
    _, expected = serve(model, work, num_blocks=512)
    for prefix_caching in (False, True):
        engine, got = serve(
            model, work, num_blocks=28, num_host_blocks=0, enable_prefix_caching=prefix_caching
        )
        assert engine.stats.preemptions_by_recompute > 0 and engine.stats.swaps_out == 0
        assert engine.stats.recomputed_tokens > 0
        assert [o.outputs for o in got] == [o.outputs for o in expected]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_new_tokens": 0},
        {"temperature": -1.0},
        {"top_p": 0.0},
        {"n": 0},
        {"beam_width": 2, "n": 2},
        {"beam_width": 2, "temperature": 0.5},
    ],
)
def test_sampling_params_are_validated(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"max_new_tokens": 2.5}, "max_new_tokens must be an integer"),
        ({"n": 2.0}, "n must be an integer"),
        ({"beam_width": True}, "beam_width must be an integer"),
        ({"seed": 1.5}, "seed must be an integer"),
        ({"temperature": float("nan")}, "temperature must be a finite number"),
        ({"top_p": "0.5"}, "top_p must be a finite number"),
        ({"stop_token_ids": [3, -1]}, "stop_token_ids entries must be >= 0"),
    ],
)
def test_sampling_params_need_integer_counts(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_add_request_validates(model):
    engine = Engine(model, num_blocks=16, block_size=BLOCK, max_num_seqs=4)
    with pytest.raises(ValueError, match="prompt"):
        engine.add_request([], SamplingParams())
    with pytest.raises(ValueError, match="max_num_seqs"):
        engine.add_request([5, 6], SamplingParams(n=5, temperature=1.0))
    with pytest.raises(ValueError, match=r"token 1000000 is outside the model's vocabulary"):
        engine.add_request([5, 10**6], SamplingParams())
    with pytest.raises(ValueError, match="vocabulary"):
        engine.add_request([5, -1], SamplingParams())
    with pytest.raises(ValueError, match="integers"):
        engine.add_request([5.0, 6.0], SamplingParams())
    assert not engine.has_unfinished()  # nothing was queued
    (out,) = engine.generate([[5, 6, 7]], SamplingParams(3))
    assert len(out.outputs[0]) == 3


def test_generate_queues_all_requests_or_none(model):
    # Issue 15, defect 10: a bad third request leaves no orphans behind for the next call.
    engine = Engine(model, num_blocks=64, block_size=BLOCK, max_num_seqs=4)
    work = [(p, SamplingParams(6)) for p in prompts(2)]
    bad = (prompts(1, seed=9)[0], SamplingParams(6, n=5, temperature=1.0))
    with pytest.raises(ValueError, match="max_num_seqs"):
        engine.generate([p for p, _ in work + [bad]], [s for _, s in work + [bad]])
    assert not engine.has_unfinished()
    got = engine.generate([p for p, _ in work], [s for _, s in work])
    assert [o.outputs[0] for o in got] == [hf_greedy(model, p, 6) for p, _ in work]


class FailOnce:
    """Wraps a module's forward to raise once, at its ``fail_at``-th call."""

    def __init__(self, module, fail_at):
        self.module, self.forward, self.calls, self.fail_at = module, module.forward, 0, fail_at

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("injected failure")
        return self.forward(*args, **kwargs)


@pytest.mark.parametrize("prefix_caching", [False, True])
@pytest.mark.parametrize("fail_at", [1, 4, 9])
def test_a_failed_forward_leaves_the_engine_consistent_and_outputs_exact(
    model, prefix_caching, fail_at
):
    # Issue 15, defect 2: the step that raised released what it reserved; retrying finishes
    # with exactly the tokens of a run that never failed.
    work = mixed_workload()[:6]
    _, expected = serve(model, work, num_blocks=40, enable_prefix_caching=prefix_caching)
    engine = Engine(model, num_blocks=40, block_size=BLOCK, enable_prefix_caching=prefix_caching)
    mlp = model.model.layers[1].mlp
    mlp.forward = FailOnce(mlp, fail_at)
    try:
        ids = [engine.add_request(p, s) for p, s in work]
        results, failures = {}, 0
        while engine.has_unfinished():
            try:
                results.update((o.request_id, o) for o in engine.step() if o.finished)
            except RuntimeError as error:
                assert "injected failure" in str(error)
                failures += 1
    finally:
        del mlp.forward
    assert failures == 1
    assert [results[i].outputs for i in ids] == [o.outputs for o in expected]
    assert_all_freed(engine)


# --------------------------------------------------------------------------------- prefix caching


def shared_prefix_workload(count=6, prefix_len=48, seed=11):
    system = prompts(1, seed=seed, low=prefix_len, high=prefix_len + 1)[0]
    questions = prompts(count, seed=seed + 1, low=5, high=20)
    work = []
    for i, question in enumerate(questions):
        if i % 3 == 1:
            params = SamplingParams(10, temperature=0.8, n=2, seed=i)
        elif i % 3 == 2:
            params = SamplingParams(8, beam_width=2)
        else:
            params = SamplingParams(12)
        work.append((system + question, params))
    return work


@pytest.mark.parametrize("num_blocks", [512, 30])
def test_prefix_caching_changes_no_output(model, num_blocks):
    work = shared_prefix_workload() + mixed_workload()[:4]
    off, expected = serve(model, work, num_blocks, enable_prefix_caching=False)
    on, got = serve(model, work, num_blocks, enable_prefix_caching=True)
    assert [o.outputs for o in got] == [o.outputs for o in expected]
    assert off.stats.prompt_tokens_cached == 0
    assert on.stats.prompt_tokens_cached > 0
    assert on.stats.prompt_tokens_computed + on.stats.prompt_tokens_cached >= on.stats.prompt_tokens
    if num_blocks == 30:
        assert on.stats.swaps_out > 0  # swapping and beams under prefix caching too


def test_a_shared_system_prompt_is_computed_once(model):
    work = shared_prefix_workload()
    engine = Engine(model, num_blocks=256, block_size=BLOCK)
    first = engine.generate([work[0][0]], work[0][1])[0]
    assert first.metrics.num_cached_prompt_tokens == 0
    rest = engine.generate([p for p, _ in work[1:]], [s for _, s in work[1:]])
    # 48 shared tokens are 6 full blocks of 8: every later request reuses them.
    assert [o.metrics.num_cached_prompt_tokens for o in rest] == [48] * len(rest)
    assert [o.metrics.num_computed_prompt_tokens for o in rest] == [
        len(p) - 48 for p, _ in work[1:]
    ]


@pytest.mark.parametrize("length", [40, 37])
def test_a_fully_cached_prompt_recomputes_only_its_last_token(model, length):
    # 40 tokens: 5 full blocks of 8, the last one copied from the cache; 37: the partly
    # filled last block is never cached, so its 5 tokens are computed.
    prompt = prompts(1, seed=12, low=length, high=length + 1)[0]
    engine = Engine(model, num_blocks=64, block_size=BLOCK)
    (first,) = engine.generate([prompt], SamplingParams(6))
    (again,) = engine.generate([prompt], SamplingParams(6))
    assert again.outputs == first.outputs
    computed = 1 if length % BLOCK == 0 else length % BLOCK
    assert again.metrics.num_cached_prompt_tokens == length - computed
    assert again.metrics.num_computed_prompt_tokens == computed
    # The same prompt twice in one step: the second cannot copy a block not computed yet.
    both = engine.generate([prompt[:-3] + [9, 9, 9]] * 2, SamplingParams(4))
    assert both[0].outputs == both[1].outputs


# -------------------------------------------------------------------------------- chunked prefill


def test_chunked_prefill_changes_no_output(model):
    work = mixed_workload() + shared_prefix_workload(3)
    _, expected = serve(model, work, num_blocks=512)
    for budget, num_blocks in [(64, 512), (16, 512), (64, 28)]:
        engine, got = serve(model, work, num_blocks, max_num_seqs=16, max_num_batched_tokens=budget)
        assert [o.outputs for o in got] == [o.outputs for o in expected], (budget, num_blocks)


def test_a_long_prompt_spreads_over_steps_while_others_decode(model):
    budget = 16
    engine = Engine(
        model, num_blocks=128, block_size=BLOCK, max_num_seqs=4, max_num_batched_tokens=budget
    )
    short = engine.add_request(prompts(1, seed=13)[0], SamplingParams(30))
    engine.step()  # the short prompt is prefilled and decodes from now on
    long_prompt = prompts(1, seed=14, low=100, high=101)[0]
    long_id = engine.add_request(long_prompt, SamplingParams(4))
    steps_until_first_token = 0
    while True:
        outputs = {o.request_id: o for o in engine.step()}
        steps_until_first_token += 1
        assert short in outputs  # the short request got a token in every step
        if long_id in outputs:
            break
    assert steps_until_first_token == -(-len(long_prompt) // (budget - 1))
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        Engine(model, num_blocks=16, block_size=BLOCK, max_num_seqs=8, max_num_batched_tokens=4)


# ------------------------------------------------------------------------------- streaming, abort


def test_stream_yields_each_steps_new_tokens(model):
    engine = Engine(model, num_blocks=64, block_size=BLOCK)
    prompt = prompts(1, seed=15)[0]
    other = engine.add_request(prompts(1, seed=16)[0], SamplingParams(3))
    deltas = list(engine.stream(prompt, SamplingParams(9)))
    assert [len(d.new_tokens[0]) for d in deltas] == [1] * 9
    assert [t for d in deltas for t in d.new_tokens[0]] == deltas[-1].outputs[0]
    assert deltas[-1].outputs[0] == hf_greedy(model, prompt, 9)
    assert [d.finished for d in deltas] == [False] * 8 + [True]
    assert deltas[-1].finish_reasons == ["length"] and deltas[0].finish_reasons == [None]
    # The other request's final output was kept for the next step(), not dropped.
    (kept,) = [o for o in engine.step() if o.request_id == other]
    assert kept.finished and len(kept.outputs[0]) == 3
    samples = list(engine.stream(prompt, SamplingParams(4, temperature=1.0, n=3, seed=1)))
    assert all(len(d.new_tokens) == 3 for d in samples)
    assert_all_freed(engine)


def test_abort_frees_a_request_wherever_it_is(model):
    engine = Engine(model, num_blocks=24, block_size=BLOCK)
    work = mixed_workload()
    ids = [engine.add_request(p, s) for p, s in work]
    waiting = engine.abort(ids[-1])  # never scheduled
    assert waiting.finished and waiting.outputs == []
    for _ in range(40):
        engine.step()
        if engine.scheduler.swapped:
            break
    swapped = engine.scheduler.swapped[0]
    out = engine.abort(swapped.request_id)
    assert out.finished and set(out.finish_reasons) <= {"abort", "eos", "length"}
    assert "abort" in out.finish_reasons
    running = engine.scheduler.running[0]
    out = engine.abort(running.request_id)
    assert "abort" in out.finish_reasons
    with pytest.raises(ValueError, match="unknown or finished request"):
        engine.abort(running.request_id)
    while engine.has_unfinished():
        engine.step()
    assert_all_freed(engine)


def test_stop_tokens_end_a_sequence(model):
    prompt = prompts(1, seed=17)[0]
    greedy = hf_greedy(model, prompt, 12)
    stop = greedy[4]
    end = greedy.index(stop) + 1
    engine = Engine(model, num_blocks=64, block_size=BLOCK)
    (out,) = engine.generate([prompt], SamplingParams(12, stop_token_ids=[stop]))
    assert out.outputs == [greedy[:end]] and out.finish_reasons == ["stop"]


def test_request_metrics(model):
    engine = Engine(model, num_blocks=64, block_size=BLOCK)
    (out,) = engine.generate([prompts(1, seed=18)[0]], SamplingParams(7))
    metrics = out.metrics
    assert metrics.time_to_first_token > 0
    assert len(metrics.inter_token_latencies) == 6
    assert all(latency > 0 for latency in metrics.inter_token_latencies)
    assert metrics.finished_time >= metrics.first_token_time >= metrics.arrival_time


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_graphs_and_device_sampling_change_no_output(model):
    gpu_model = transformers.LlamaForCausalLM(model.config).eval().cuda()
    gpu_model.load_state_dict(model.state_dict())
    work = mixed_workload()
    runs = {}
    for graphs in (False, True):
        engine = Engine(gpu_model, num_blocks=64, block_size=BLOCK, cuda_graphs=graphs)
        runs[graphs] = engine.generate([p for p, _ in work], [s for _, s in work])
        assert bool(engine.runner.graphs and engine.runner.graphs._graphs) == graphs
        assert_all_freed(engine)
    assert [o.outputs for o in runs[True]] == [o.outputs for o in runs[False]]
    greedy = [(p, s) for p, s in work if s.temperature == 0 and s.beam_width == 1]
    gpu_model.set_attn_implementation("sdpa")
    for (prompt, params), out in zip(work, runs[True]):
        if (prompt, params) in greedy:
            ids = torch.tensor([prompt], device="cuda")
            want = gpu_model.generate(
                ids,
                max_new_tokens=params.max_new_tokens,
                do_sample=False,
                eos_token_id=2,
                pad_token_id=0,
                attention_mask=torch.ones_like(ids),
            )[0, len(prompt) :].tolist()
            assert out.outputs == [want]
