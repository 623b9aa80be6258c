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


def serve(model, work, num_blocks, **kwargs):
    engine = Engine(model, num_blocks=num_blocks, block_size=BLOCK, **kwargs)
    outputs = engine.generate([p for p, _ in work], [s for _, s in work])
    assert not engine.has_unfinished()
    assert engine.manager.seq_ids() == []  # every sequence freed
    assert engine.manager.num_free_device_blocks() == num_blocks
    return engine, outputs


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
    assert tight.stats.peak_blocks <= 28 < tight.stats.peak_contiguous_blocks
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
    assert engine.manager.seq_ids() == []


def test_requests_wait_when_the_pool_is_full(model):
    # Room for one request at a time: later ones wait (LATER), nothing is lost.
    work = [(p, SamplingParams(12)) for p in prompts(4, low=20, high=30)]
    _, expected = serve(model, work, num_blocks=64)
    engine, got = serve(model, work, num_blocks=6)
    assert [o.outputs for o in got] == [o.outputs for o in expected]
    assert engine.stats.peak_blocks <= 6


def test_request_that_can_never_fit_is_rejected(model):
    work = [
        (prompts(1, low=60, high=61)[0], SamplingParams(30)),
        (prompts(1)[0], SamplingParams(4)),
    ]
    _, (too_long, fine) = serve(model, work, num_blocks=8)
    assert too_long.outputs == [] and "needs 12 blocks" in too_long.rejected
    assert fine.rejected is None and len(fine.outputs[0]) == 4


def test_request_outgrowing_the_whole_budget_is_aborted(model):
    # The prompt fits, but four samples growing private blocks cannot.
    work = [(prompts(1, low=30, high=31)[0], SamplingParams(30, temperature=1.0, n=4))]
    _, (out,) = serve(model, work, num_blocks=8)
    assert "outgrew the whole KV budget" in out.rejected


def test_preempted_request_that_cannot_resume_is_aborted(model):
    # A (8 blocks at full length) preempts B; B's four samples then need more than the whole
    # pool (one shared prompt block + two private blocks each): swapped in, then aborted.
    a = prompts(1, seed=5, low=20, high=21)[0]
    b = prompts(1, seed=6, low=10, high=11)[0]
    work = [(a, SamplingParams(40)), (b, SamplingParams(12, temperature=1.0, n=4))]
    engine, (out_a, out_b) = serve(model, work, num_blocks=8)
    assert out_a.rejected is None and len(out_a.outputs[0]) == 40
    assert "outgrew the whole KV budget" in out_b.rejected
    assert engine.stats.swaps_out == engine.stats.swaps_in == 1


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


def test_add_request_validates(model):
    engine = Engine(model, num_blocks=16, block_size=BLOCK, max_num_seqs=4)
    with pytest.raises(ValueError, match="prompt"):
        engine.add_request([], SamplingParams())
    with pytest.raises(ValueError, match="max_num_seqs"):
        engine.add_request([5, 6], SamplingParams(n=5, temperature=1.0))
