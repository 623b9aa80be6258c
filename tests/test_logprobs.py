"""Log-probabilities (paged_attention/engine/logprobs.py): of sampled and of prompt tokens,
checked against transformers' own float32 logits of the same tokens, and kept exact through
chunked prefill, the prefix cache, preemption, streams and a failed step."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from test_engine import FailingDraw, assert_all_freed, prompts  # noqa: E402

from paged_attention.engine import Engine, RequestError, SamplingParams  # noqa: E402
from paged_attention.engine.logprobs import token_logprobs  # noqa: E402
from paged_attention.engine.request import Logprob  # noqa: E402

TOLERANCE = 2e-3


@pytest.fixture(scope="module")
def model():
    from paged_attention.modeling.tiny import tiny_llama

    return tiny_llama(vocab_size=256, max_position_embeddings=512)


def reference_logprobs(model, tokens):
    """transformers' float32 log-softmax at every position of ``tokens`` (sdpa, no cache)."""
    model.set_attn_implementation("sdpa")
    try:
        with torch.inference_mode():
            logits = model(torch.tensor([tokens]), use_cache=False).logits[0]
    finally:
        model.set_attn_implementation("paged_attention")
    return logits.float().log_softmax(-1)


def assert_entry_matches(entry, token, reference_row, count):
    """``entry`` holds ``token`` first, then the ``count`` most likely tokens, with the
    reference's log-probabilities and ranks (up to near-ties)."""
    assert next(iter(entry)) == token and len(entry) in (max(count, 1), count + 1)
    for alternative, logprob in entry.items():
        assert logprob.logprob == pytest.approx(reference_row[alternative].item(), abs=TOLERANCE)
    value = reference_row[token].item()
    ahead_surely = int((reference_row > value + TOLERANCE).sum())
    ahead_maybe = int((reference_row >= value - TOLERANCE).sum())
    assert ahead_surely < entry[token].rank <= ahead_maybe
    if count:
        kth = reference_row.topk(count).values[-1].item()
        assert all(reference_row[t].item() >= kth - TOLERANCE for t in list(entry)[1:])


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(10, logprobs=5, prompt_logprobs=3),
        SamplingParams(10, temperature=1.0, seed=3, logprobs=20, prompt_logprobs=0, n=2),
        SamplingParams(10, temperature=0.7, top_k=4, repetition_penalty=1.5, logprobs=0),
    ],
    ids=["greedy", "sampled-n2", "controls"],
)
def test_logprobs_equal_transformers_fp32_log_softmax(model, params):
    prompt = prompts(1, seed=4, low=20, high=21)[0]
    engine = Engine(model, num_blocks=64, block_size=8, eos_token_id=[])
    (out,) = engine.generate([prompt], params)
    for tokens, entries in zip(out.outputs, out.logprobs):
        assert len(entries) == len(tokens) == 10
        reference = reference_logprobs(model, prompt + tokens)
        for j, (token, entry) in enumerate(zip(tokens, entries)):
            # raw logprobs: the model's distribution, before penalties and temperature
            assert_entry_matches(entry, token, reference[len(prompt) - 1 + j], params.logprobs)
    if params.prompt_logprobs is None:
        assert out.prompt_logprobs is None
        return
    assert len(out.prompt_logprobs) == len(prompt) and out.prompt_logprobs[0] is None
    reference = reference_logprobs(model, prompt)
    for i, entry in enumerate(out.prompt_logprobs[1:], start=1):
        assert_entry_matches(entry, prompt[i], reference[i - 1], params.prompt_logprobs)


def test_greedy_tokens_rank_first(model):
    engine = Engine(model, num_blocks=64, block_size=8)
    (out,) = engine.generate([[9, 8, 7, 6]], SamplingParams(8, logprobs=1))
    for token, entry in zip(out.outputs[0], out.logprobs[0]):
        assert list(entry) == [token] and entry[token].rank == 1
    (top_k_1,) = engine.generate(
        [[9, 8, 7, 6]], SamplingParams(8, temperature=2.0, top_k=1, logprobs=1)
    )
    assert top_k_1.outputs == out.outputs and top_k_1.logprobs == out.logprobs
    assert out.prompt_logprobs is None and out.new_logprobs == out.logprobs  # one output


def test_without_logprobs_the_fields_are_none(model):
    engine = Engine(model, num_blocks=64, block_size=8)
    (out,) = engine.generate([[9, 8, 7]], SamplingParams(4))
    assert out.logprobs is None and out.new_logprobs is None and out.prompt_logprobs is None


def test_prompt_logprobs_are_the_same_chunked_cached_or_recomputed(model):
    prompt = prompts(1, seed=5, low=70, high=71)[0]
    params = SamplingParams(6, prompt_logprobs=4, logprobs=2)
    (whole,) = Engine(model, num_blocks=64, block_size=8).generate([prompt], params)
    chunked_engine = Engine(
        model, num_blocks=64, block_size=8, max_num_batched_tokens=16, max_num_seqs=4
    )
    (chunked,) = chunked_engine.generate([prompt], params)
    assert chunked_engine.stats.steps > 5  # the prompt took several steps
    # The prefix cache holds the prompt now; a prompt_logprobs request computes it all again.
    (again,) = chunked_engine.generate([prompt], params)
    assert chunked_engine.stats.prompt_tokens_cached == 0
    for out in (chunked, again):
        assert out.outputs == whole.outputs
        assert len(out.prompt_logprobs) == len(prompt)
        for mine, theirs in zip(out.prompt_logprobs[1:], whole.prompt_logprobs[1:]):
            assert list(mine) == list(theirs)
            for token in mine:
                assert mine[token].logprob == pytest.approx(theirs[token].logprob, abs=1e-4)


def test_logprobs_survive_preemption_by_recompute(model):
    work = [(p, SamplingParams(24, logprobs=1, prompt_logprobs=1)) for p in prompts(6, seed=8)]
    roomy = Engine(model, num_blocks=200, block_size=8, eos_token_id=[])
    expected = roomy.generate([p for p, _ in work], [s for _, s in work])
    tight = Engine(model, num_blocks=14, block_size=8, num_host_blocks=0, eos_token_id=[])
    got = tight.generate([p for p, _ in work], [s for _, s in work])
    assert tight.stats.preemptions_by_recompute > 0
    for mine, theirs in zip(got, expected):
        assert mine.outputs == theirs.outputs
        assert [list(e) for e in mine.logprobs[0]] == [list(e) for e in theirs.logprobs[0]]
        assert len(mine.prompt_logprobs) == len(theirs.prompt_logprobs) == len(mine.prompt)
    assert_all_freed(tight)


def test_a_stream_delivers_each_tokens_logprobs_once(model):
    engine = Engine(model, num_blocks=64, block_size=8, eos_token_id=[])
    params = SamplingParams(7, temperature=1.0, seed=2, n=2, logprobs=3, prompt_logprobs=2)
    a = engine.stream([4, 5, 6, 7, 8], params)
    b = engine.stream([9, 10, 11], params)
    first_a = next(a)  # b's first outputs wait for its reader, merged
    assert len(first_a.prompt_logprobs) == 5
    outputs_a, outputs_b = [first_a, *a], list(b)
    assert len(outputs_b) < len(outputs_a)  # b's outputs were merged while a was read
    for outputs in (outputs_a, outputs_b):
        final = outputs[-1]
        for sample in range(2):
            pieces = [e for o in outputs for e in o.new_logprobs[sample]]
            assert pieces == final.logprobs[sample]
            lengths = [len(o.new_logprobs[sample]) for o in outputs]
            assert lengths == [len(o.new_tokens[sample]) for o in outputs]
            assert [next(iter(e)) for e in final.logprobs[sample]] == final.outputs[sample]
        assert final.prompt_logprobs[0] is None and len(final.prompt_logprobs) == len(final.prompt)
    assert_all_freed(engine)


def test_a_failed_step_records_each_logprob_once(model, monkeypatch):
    from paged_attention.engine import core as engine_module

    work = [(p, SamplingParams(5, logprobs=2, prompt_logprobs=2)) for p in prompts(3, seed=6)]
    expected = Engine(model, num_blocks=40, block_size=8).generate(
        [p for p, _ in work], [s for _, s in work]
    )
    engine = Engine(model, num_blocks=40, block_size=8)
    monkeypatch.setattr(engine_module, "draw", FailingDraw(engine_module.draw, 1))
    ids = [engine.add_request(p, s) for p, s in work]
    with pytest.raises(RuntimeError, match="injected sampling failure"):
        engine.step()
    results = {}
    while engine.has_unfinished():
        results.update((o.request_id, o) for o in engine.step() if o.finished)
    for request_id, theirs in zip(ids, expected):
        mine = results[request_id]
        assert mine.outputs == theirs.outputs and mine.logprobs == theirs.logprobs
        assert mine.prompt_logprobs == theirs.prompt_logprobs


def test_one_token_prompt_and_beam_search(model):
    engine = Engine(model, num_blocks=64, block_size=8)
    (out,) = engine.generate([[42]], SamplingParams(3, prompt_logprobs=5))
    assert out.prompt_logprobs == [None]
    prompt = [3, 4, 5, 6, 7, 8]
    (beams,) = engine.generate([prompt], SamplingParams(4, beam_width=2, prompt_logprobs=2))
    (single,) = engine.generate([prompt], SamplingParams(4, prompt_logprobs=2))
    assert beams.prompt_logprobs == single.prompt_logprobs
    with pytest.raises(RequestError, match="logprobs is not supported with beam search"):
        SamplingParams(4, beam_width=2, logprobs=1)


def test_token_logprobs_against_a_loop():
    rng = torch.Generator().manual_seed(0)
    rows = torch.randn(5, 30, generator=rng).log_softmax(-1)
    rows[2, 7] = rows[2, 3]  # a tie: both count ahead of each other
    tokens = torch.tensor([0, 29, 3, 5, 11])
    counts = [0, 3, 4, 30, 1]
    entries = token_logprobs(rows, tokens, counts)
    for row, token, count, entry in zip(rows, tokens.tolist(), counts, entries):
        value = row[token].item()
        expected = {token: Logprob(value, sum(v >= value for v in row.tolist()))}
        for place, alternative in enumerate(row.argsort(descending=True)[:count].tolist()):
            expected.setdefault(alternative, Logprob(row[alternative].item(), place + 1))
        assert entry == expected and list(entry) == list(expected)


def test_smollm2_logprobs_equal_transformers_in_float32():
    # The real model, with its tokenizer and prompts chunked over several steps.
    from paged_attention.modeling.models import load_model

    model, tokenizer = load_model("smollm2", dtype=torch.float32)
    engine = Engine(
        model,
        num_blocks=128,
        block_size=16,
        tokenizer=tokenizer,
        max_num_batched_tokens=16,
        max_num_seqs=4,
    )
    params = SamplingParams(10, logprobs=5, prompt_logprobs=5, ignore_eos=True)
    text = "The capital of France is Paris. The capital of Germany is"
    (out,) = engine.generate([text], params)
    assert out.text.startswith(" Berlin")
    tokens = out.prompt + out.outputs[0]
    reference = reference_logprobs(model, tokens)
    for i, entry in enumerate(out.prompt_logprobs[1:], start=1):
        assert_entry_matches(entry, out.prompt[i], reference[i - 1], 5)
    for j, (token, entry) in enumerate(zip(out.outputs[0], out.logprobs[0])):
        assert_entry_matches(entry, token, reference[len(out.prompt) - 1 + j], 5)
