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
        max_position_embeddings=2048,
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


def hf_greedy(model, prompt, max_new_tokens, eos_token_id=2):
    """transformers' own greedy generate() with its default cache and attention."""
    model.set_attn_implementation("sdpa")
    try:
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=eos_token_id,
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
    tight, got = serve(model, work, num_blocks=28, num_host_blocks=4 * 28)
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


def test_request_that_can_never_fit_is_refused_when_added(model):
    engine = Engine(model, num_blocks=8, block_size=BLOCK)
    with pytest.raises(ValueError, match="needs 12 blocks of 8; the pool has 8"):
        engine.add_request(prompts(1, low=60, high=61)[0], SamplingParams(30))
    with pytest.raises(ValueError, match="needs 12 blocks of 8"):
        engine.generate([prompts(1)[0], prompts(1, low=60, high=61)[0]], SamplingParams(30))
    assert not engine.has_unfinished()
    (fine,) = engine.generate([prompts(1)[0]], SamplingParams(4))
    assert fine.rejected is None and len(fine.outputs[0]) == 4


def test_request_beyond_the_models_context_is_refused(model):
    engine = Engine(model, num_blocks=512, block_size=BLOCK)
    assert engine.max_model_len == 2048
    with pytest.raises(ValueError, match="need 2049 positions; the model's context holds 2048"):
        engine.add_request([5] * 2000, SamplingParams(49))
    engine.add_request([5] * 2000, SamplingParams(48))


def test_samples_that_together_outgrow_the_pool_are_refused_up_front(model):
    # The prompt fits, but four samples growing private blocks cannot: 3 shared prompt blocks
    # plus 5 own blocks per sample need 23 of 8 blocks.
    engine = Engine(model, num_blocks=8, block_size=BLOCK)
    prompt = prompts(1, low=30, high=31)[0]
    with pytest.raises(ValueError, match="4 sequences of up to 59 tokens need 23 blocks of 8"):
        engine.add_request(prompt, SamplingParams(30, temperature=1.0, n=4))
    assert engine.stats.prompt_tokens_computed == 0 and not engine.has_unfinished()


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
    # With 200 blocks the same request can never run: refused with the reason.
    engine = Engine(model, num_blocks=200, block_size=BLOCK, eos_token_id=[])
    with pytest.raises(ValueError, match="need 207 blocks of 8 together"):
        engine.add_request(*work[1])


def test_a_cpu_engine_holds_the_kv_budget_and_no_swap_space_by_default(model):
    # Issue 34, item 5: "host" blocks on a CPU would be more of the same RAM.
    engine = Engine(model, num_blocks=40, block_size=BLOCK)
    kv = engine.kv_cache
    assert kv.num_host_blocks == engine.block_manager.num_host_blocks == 0
    held = sum(t.numel() * t.element_size() for t in (*kv._key_groups, *kv._value_groups))
    assert held == kv.device_bytes == 40 * kv.bytes_per_block
    assert not kv.host_key_caches or all(t.numel() == 0 for t in kv.host_key_caches)
    asked = Engine(model, num_blocks=40, block_size=BLOCK, num_host_blocks=8)
    assert asked.block_manager.num_host_blocks == 8


def test_default_swap_space_is_host_memory_beside_a_gpu():
    from paged_attention.kv.cache import default_num_host_blocks

    assert default_num_host_blocks(10, "cuda") == 40
    assert default_num_host_blocks(10, torch.device("cpu")) == 0


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
        ({"seed": 2**64}, "seed must fit in 64 bits"),
        ({"seed": -(2**63) - 1}, "seed must fit in 64 bits"),
        ({"stop": ["ok", ""]}, "stop entries must be non-empty strings"),
        ({"stop": [3]}, "stop entries must be non-empty strings"),
        ({"stop": ["x"], "beam_width": 2}, "stop strings are not supported with beam search"),
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


def run_through_one_failure(engine, model, work, fail_at: int) -> list:
    """Every (prompt, params) of ``work`` through ``engine`` while the model's second MLP fails
    once, at its ``fail_at``-th call; the failed step is retried. The outputs, in ``work``'s
    order (the failure happened exactly once)."""
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
    return [results[i].outputs for i in ids]


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
    assert run_through_one_failure(engine, model, work, fail_at) == [o.outputs for o in expected]
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
    swap = 4 * num_blocks  # asked for: a CPU engine reserves no swap space by default
    off, expected = serve(
        model, work, num_blocks, enable_prefix_caching=False, num_host_blocks=swap
    )
    on, got = serve(model, work, num_blocks, enable_prefix_caching=True, num_host_blocks=swap)
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
    engine = Engine(model, num_blocks=24, block_size=BLOCK, num_host_blocks=96)
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


# ------------------------------------------------------------- issue 28: streams, sampling, faults


def no_eos_greedy(model, prompt, max_new_tokens):
    """Greedy tokens of a fresh engine that ignores EOS (the engine's greedy decoding equals
    transformers', which test_greedy_matches_transformers_generate checks)."""
    engine = Engine(model, num_blocks=64, block_size=BLOCK, eos_token_id=[])
    return engine.generate([prompt], SamplingParams(max_new_tokens))[0].outputs[0]


def bounded(iterator, limit=500):
    """The items of ``iterator``, failing the test instead of hanging past ``limit``."""
    items = []
    for item in iterator:
        items.append(item)
        assert len(items) < limit, "the iterator did not end"
    return items


def drain(engine, max_steps=500):
    """step() until nothing is unfinished (bounded); the outputs by request id, merged."""
    got = {}
    for _ in range(max_steps):
        if not engine.has_unfinished():
            return got
        for out in engine.step():
            got.setdefault(out.request_id, []).append(out)
    raise AssertionError(f"not done after {max_steps} steps")


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(10, temperature=1e-300),
        SamplingParams(10, temperature=1e-6, seed=4),
        SamplingParams(10, temperature=1.0, top_p=1e-300, seed=5),
    ],
    ids=["temperature-1e-300", "temperature-1e-6", "top_p-1e-300"],
)
def test_values_that_cannot_be_sampled_decode_greedily(model, params):
    # Issue 28, defect 1: these wedged the engine (inf logits, or every token masked).
    greedy_prompt, prompt = prompts(2, seed=20)
    engine = Engine(model, num_blocks=64, block_size=BLOCK)
    ids = [engine.add_request(greedy_prompt, SamplingParams(10))]
    ids.append(engine.add_request(prompt, params))
    got = drain(engine)
    assert got[ids[0]][-1].outputs == [hf_greedy(model, greedy_prompt, 10)]
    assert got[ids[1]][-1].outputs == [hf_greedy(model, prompt, 10)]
    assert_all_freed(engine)


class FailingDraw:
    """Stands in for the sampler's ``draw``: raises at its ``fail_at``-th call."""

    def __init__(self, draw, fail_at):
        self.draw, self.fail_at, self.calls = draw, fail_at, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("injected sampling failure")
        return self.draw(*args, **kwargs)


@pytest.mark.parametrize("fail_at", [1, 3, 8])
def test_a_failed_sampling_rolls_the_step_back(model, monkeypatch, fail_at):
    # Issue 28, defect 1: an exception in sampling (after the forward pass) is rolled back like
    # a failed forward; the generators are restored, so even sampled tokens come out the same.
    from paged_attention.engine import core as engine_module

    work = mixed_workload()[:6]
    _, expected = serve(model, work, num_blocks=40)
    engine = Engine(model, num_blocks=40, block_size=BLOCK)
    monkeypatch.setattr(engine_module, "draw", FailingDraw(engine_module.draw, fail_at))
    ids = [engine.add_request(p, s) for p, s in work]
    results, failures = {}, 0
    for _ in range(500):
        if not engine.has_unfinished():
            break
        try:
            results.update((o.request_id, o) for o in engine.step() if o.finished)
        except RuntimeError as error:
            assert "injected sampling failure" in str(error)
            failures += 1
    assert failures == 1
    assert [results[i].outputs for i in ids] == [o.outputs for o in expected]
    assert_all_freed(engine)


def test_two_streams_consumed_in_turn_both_finish(model):
    # Issue 28, defect 2: both requests finish in the same step; the one that drove it used to
    # drop the other's final output, whose stream then stepped an idle engine forever.
    p1, p2 = prompts(2, seed=21)
    engine = Engine(model, num_blocks=64, block_size=BLOCK, eos_token_id=[])
    a = engine.stream(p1, SamplingParams(6))
    b = engine.stream(p2, SamplingParams(6))
    seen = {a.request_id: [], b.request_id: []}
    live = [a, b]
    for _ in range(100):
        if not live:
            break
        for stream in list(live):
            try:
                seen[stream.request_id].append(next(stream))
            except StopIteration:
                live.remove(stream)
    assert not live
    for stream, prompt in ((a, p1), (b, p2)):
        outs = seen[stream.request_id]
        assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
        assert [t for o in outs for t in o.new_tokens[0]] == no_eos_greedy(model, prompt, 6)
    assert_all_freed(engine)


def test_a_stream_that_aborts_its_own_request_ends(model):
    # Issue 28, defect 3.
    engine = Engine(model, num_blocks=64, block_size=BLOCK, eos_token_id=[])
    outs = []
    for out in engine.stream(prompts(1, seed=22)[0], SamplingParams(50)):
        outs.append(out)
        assert len(outs) < 10, "the stream did not end"
        if len(outs) == 3:
            aborted = engine.abort(out.request_id)
            assert aborted.finish_reasons == ["abort"]
    assert len(outs) == 4 and outs[-1].finished and outs[-1].finish_reasons == ["abort"]
    assert outs[-1].outputs[0] == outs[2].outputs[0]
    assert_all_freed(engine)


def test_a_request_finishing_in_a_streams_last_step_reaches_step(model):
    # Issue 28, defect 4.
    p1, p2 = prompts(2, seed=23)
    engine = Engine(model, num_blocks=64, block_size=BLOCK, eos_token_id=[])
    stream = engine.stream(p1, SamplingParams(5))
    next(stream)
    other = engine.add_request(p2, SamplingParams(4))  # its last token comes in stream's last step
    rest = bounded(stream)
    assert rest[-1].finished
    assert engine.has_unfinished()  # B's outputs wait for step()
    outs = drain(engine)[other]
    assert [o.finished for o in outs] == [True]  # merged: one output with every token
    assert outs[0].new_tokens[0] == outs[0].outputs[0] == no_eos_greedy(model, p2, 4)
    assert_all_freed(engine)


def test_a_failed_step_keeps_the_outputs_it_had_taken(model):
    # Issue 28, defect 5: outputs waiting for step() survive a step whose forward pass raises.
    p1, p2 = prompts(2, seed=24)
    engine = Engine(model, num_blocks=64, block_size=BLOCK, eos_token_id=[])
    other = engine.add_request(p2, SamplingParams(2))
    bounded(engine.stream(p1, SamplingParams(3)))  # drives the steps that finish ``other``
    mlp = model.model.layers[1].mlp
    later = engine.add_request(p1, SamplingParams(2))
    mlp.forward = FailOnce(mlp, 1)
    try:
        with pytest.raises(RuntimeError, match="injected failure"):
            engine.step()
    finally:
        del mlp.forward
    got = drain(engine)
    assert got[other][0].finished and got[other][0].outputs == [no_eos_greedy(model, p2, 2)]
    assert got[later][-1].outputs == [no_eos_greedy(model, p1, 2)]
    assert_all_freed(engine)


def test_closing_or_dropping_a_stream_aborts_its_request(model):
    # Issue 28, defect 6: a closed stream's request used to keep its blocks and run on.
    engine = Engine(model, num_blocks=64, block_size=BLOCK, eos_token_id=[])
    stream = engine.stream(prompts(1, seed=25)[0], SamplingParams(200))
    next(stream)
    assert engine.block_manager.num_free_device_blocks() < 64
    stream.close()
    assert_all_freed(engine)
    assert list(stream) == []
    with engine.stream(prompts(1, seed=26)[0], SamplingParams(200)) as stream:
        next(stream)
    assert_all_freed(engine)
    stream = engine.stream(prompts(1, seed=27)[0], SamplingParams(200))
    next(stream)
    del stream  # dropped unfinished: aborted at the next step
    assert engine.step() == []
    assert_all_freed(engine)


def test_stream_validates_when_called(model):
    engine = Engine(model, num_blocks=64, block_size=BLOCK)
    with pytest.raises(ValueError, match="prompt must hold at least one token"):
        engine.stream([], SamplingParams())
    assert not engine.has_unfinished()


def test_generate_aborts_its_requests_when_a_step_raises(model):
    engine = Engine(model, num_blocks=64, block_size=BLOCK)
    mlp = model.model.layers[1].mlp
    mlp.forward = FailOnce(mlp, 2)
    try:
        with pytest.raises(RuntimeError, match="injected failure"):
            engine.generate(prompts(3, seed=28), SamplingParams(5))
    finally:
        del mlp.forward
    assert_all_freed(engine)
    assert engine.step() == []


# ------------------------------------------------------------------------ text in, text out


@pytest.fixture(scope="module")
def text_model():
    """A tiny random Llama over the test tokenizer's vocabulary, and the tokenizer."""
    from text_tokenizer import byte_level_test_tokenizer

    tokenizer = byte_level_test_tokenizer()
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=0,
    )
    torch.manual_seed(1)
    return transformers.LlamaForCausalLM(config).eval(), tokenizer


def test_text_and_chat_prompts(text_model):
    model, tokenizer = text_model
    engine = Engine(model, num_blocks=64, block_size=BLOCK, tokenizer=tokenizer)
    chat = [{"role": "user", "content": "The capital of France?"}]
    text_out, chat_out, ids_out = engine.generate(
        ["hello wörld", chat, tokenizer("hello wörld")["input_ids"]], SamplingParams(12)
    )
    assert text_out.prompt == tokenizer("hello wörld")["input_ids"]
    formatted = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert formatted.endswith("<|im_start|>assistant\n")
    assert chat_out.prompt == tokenizer(formatted, add_special_tokens=False)["input_ids"]
    assert ids_out.outputs == text_out.outputs
    for out in (text_out, chat_out):
        assert out.text == tokenizer.decode(out.outputs[0], skip_special_tokens=True)
        assert out.texts == [out.text]


def test_text_outputs_equal_decoding_the_ids_and_stream_pieces_add_up(text_model):
    model, tokenizer = text_model
    engine = Engine(model, num_blocks=128, block_size=BLOCK, tokenizer=tokenizer)
    params = SamplingParams(40, temperature=1.0, n=3, seed=3)
    pieces, last = ["", "", ""], None
    for out in bounded(engine.stream("naïve 日本", params)):
        pieces = [a + b for a, b in zip(pieces, out.new_texts)]
        assert out.texts == pieces
        last = out
    assert len(last.outputs) == 3
    for ids, text in zip(last.outputs, last.texts):
        assert text == tokenizer.decode(ids, skip_special_tokens=True)
    (beams,) = engine.generate(["café"], SamplingParams(10, beam_width=2))
    assert beams.texts == [tokenizer.decode(o, skip_special_tokens=True) for o in beams.outputs]


def test_stop_strings_end_outputs_where_they_appear(text_model):
    model, tokenizer = text_model
    engine = Engine(model, num_blocks=128, block_size=BLOCK, tokenizer=tokenizer, eos_token_id=[])
    (free,) = engine.generate(["hello"], SamplingParams(30))
    ids, text = free.outputs[0], free.text

    # A stop string across a token boundary: the last character of token i's text and the
    # first of token i + 1's, at a boundary where both decode to whole characters.
    def decoded(count):
        return tokenizer.decode(ids[:count], skip_special_tokens=True)

    def clean_boundary(i):
        before, after = decoded(i), decoded(i + 1)
        return (
            before
            and after.startswith(before)
            and len(after) > len(before)
            and "\ufffd" not in (before[-1], after[len(before)])
        )

    boundary = next(i for i in range(2, 29) if clean_boundary(i))
    cut = len(decoded(boundary))
    stop = decoded(boundary + 1)[cut - 1 : cut + 1]
    where = text.index(stop)
    for params in (SamplingParams(30, stop=(stop,)), SamplingParams(30, stop=stop)):
        (out,) = engine.generate(["hello"], params)
        assert out.finish_reasons == ["stop"] and out.text == text[:where]
        ended = next(i for i in range(1, 31) if stop in decoded(i))
        assert out.outputs[0] == ids[:ended]  # the token that completed the stop string is kept
    streamed = "".join(o.new_texts[0] for o in bounded(engine.stream("hello", params)))
    assert streamed == text[:where]


def test_text_needs_a_tokenizer(model):
    engine = Engine(model, num_blocks=64, block_size=BLOCK)
    with pytest.raises(ValueError, match="a prompt of text needs an engine with a tokenizer"):
        engine.add_request("hello", SamplingParams())
    with pytest.raises(ValueError, match="chat messages needs an engine with a tokenizer"):
        engine.add_request([{"role": "user", "content": "hi"}], SamplingParams())
    with pytest.raises(ValueError, match="stop strings need an engine with a tokenizer"):
        engine.add_request([5, 6], SamplingParams(stop=("x",)))
    (out,) = engine.generate([[5, 6]], SamplingParams(2))
    assert out.texts is None and out.text is None


def test_chat_messages_are_checked(text_model):
    model, tokenizer = text_model
    engine = Engine(model, num_blocks=64, block_size=BLOCK, tokenizer=tokenizer)
    with pytest.raises(ValueError, match="string 'role' and 'content'"):
        engine.add_request([{"role": "user", "content": 5}], SamplingParams())
    with pytest.raises(ValueError, match="string 'role' and 'content'"):  # issue 36, defect 11
        engine.add_request([{"role": "user", "content": "hi"}, "hello"], SamplingParams())
    with pytest.raises(ValueError, match="prompt must hold at least one token"):
        engine.add_request("", SamplingParams())
    assert not engine.has_unfinished()


def test_fp8_kv_cache_calibrates_like_paged_cache(model):
    from paged_attention.integrations.transformers import PagedCache

    prompt = prompts(1, seed=30)[0]
    engine = Engine(model, num_blocks=64, block_size=BLOCK, kv_cache_dtype="fp8")
    (out,) = engine.generate([prompt], SamplingParams(10))
    cache = PagedCache(model, BLOCK, 64, kv_cache_dtype="fp8")
    ids = torch.tensor([prompt])
    want = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=10, do_sample=False, cache=cache
    )[0, len(prompt) :].tolist()
    assert out.outputs == [want]
    for layer in range(2):
        assert engine.kv_cache.scales(layer)[0].item() == cache.kv_cache.scales(layer)[0].item()
        assert engine.kv_cache.scales(layer)[0].item() != 1.0


def test_text_that_is_not_valid_unicode_is_refused_naming_the_prompt(text_model):
    # Issue 36, defect 6: a lone surrogate (what surrogateescape makes of undecodable bytes)
    # raised TypeError inside the tokenizer.
    model, tokenizer = text_model
    engine = Engine(model, num_blocks=64, block_size=BLOCK, tokenizer=tokenizer)
    for prompt in ("caf\udce9", [{"role": "user", "content": "caf\udce9"}]):
        with pytest.raises(ValueError, match="prompt: .* not valid Unicode") as raised:
            engine.add_request(prompt, SamplingParams())
        assert raised.value.argument == "prompt"
    assert not engine.has_unfinished()


def test_a_stop_string_with_a_replacement_character_never_survives_in_a_finished_text(
    text_model,
):
    # Issue 36, defect 5: a sequence that ends (here by length) inside a multi-byte character
    # gets U+FFFD only in its final text; a stop string holding it must still cut the text.
    model, tokenizer = text_model
    engine = Engine(model, num_blocks=128, block_size=BLOCK, tokenizer=tokenizer, eos_token_id=[])
    (free,) = engine.generate(["hello"], SamplingParams(30, temperature=1.0, seed=0))
    ids = free.outputs[0]

    def decoded(count):
        return tokenizer.decode(ids[:count], skip_special_tokens=True)

    ends = [k for k in range(1, 31) if decoded(k).endswith("\ufffd")]
    k = next(k for k in ends if "\ufffd" not in decoded(k)[:-1])
    for stop in ("\ufffd", decoded(k)[-2:]):
        params = SamplingParams(k, temperature=1.0, seed=0, stop=(stop,))
        (out,) = engine.generate(["hello"], params)
        assert out.outputs[0] == ids[:k]  # the same draws: a stop string changes no sampling
        assert out.finish_reasons == ["stop"]
        assert stop not in out.text and out.text == decoded(k)[: decoded(k).index(stop)]
        streamed = "".join(o.new_texts[0] for o in engine.stream("hello", params))
        assert streamed == out.text


# -------------------------------------------------------------------------------- warm-up


def test_warm_up_leaves_no_trace(model):
    from paged_attention.engine.stats import EngineStats

    work = mixed_workload()
    _, expected = serve(model, work, num_blocks=256)
    engine = Engine(model, num_blocks=256, block_size=BLOCK)
    assert engine.warm_up() > 0
    assert_all_freed(engine)
    assert engine.stats == EngineStats()  # the counters start from zero
    # its prompt (token 0, less than a block) left no block in the prefix cache
    (first,) = engine.generate([[0] * 20], SamplingParams(2))
    assert first.metrics.num_cached_prompt_tokens == 0
    outputs = engine.generate([p for p, _ in work], [s for _, s in work])
    assert [o.outputs for o in outputs] == [o.outputs for o in expected]


def test_warm_up_runs_on_one_thread_and_restores_the_count(model):
    """The warm-up's steps run on one CPU thread; the count is restored afterwards, also when a
    step fails."""
    threads = torch.get_num_threads()
    seen = []

    def record(module, args):
        seen.append(torch.get_num_threads())

    hook = model.get_input_embeddings().register_forward_pre_hook(record)
    try:
        torch.set_num_threads(2)
        engine = Engine(model, num_blocks=64, block_size=BLOCK)
        engine.warm_up()
        assert len(seen) == 2 and set(seen) == {1}  # the prefill and the decode step
        assert torch.get_num_threads() == 2
        hook.remove()

        def fail(module, args):
            raise RuntimeError("step failed")

        hook = model.get_input_embeddings().register_forward_pre_hook(fail)
        with pytest.raises(RuntimeError, match="step failed"):
            engine.warm_up()
        assert torch.get_num_threads() == 2
        assert_all_freed(engine)
    finally:
        hook.remove()
        torch.set_num_threads(threads)


def test_warm_up_refuses_a_busy_engine(model):
    engine = Engine(model, num_blocks=64, block_size=BLOCK)
    request_id = engine.add_request([5, 6, 7], SamplingParams(4))
    with pytest.raises(ValueError, match="idle engine"):
        engine.warm_up()
    assert engine.stats.steps == 0  # nothing ran
    engine.abort(request_id)
    assert_all_freed(engine)
