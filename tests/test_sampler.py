"""The sampling controls (paged_attention/engine/logits_processors.py, sampler.py): every
control applied to a whole batch of random logits with mixed parameters, checked row by row
against a plain reference written here; then end to end through the Engine on a tiny model."""

from __future__ import annotations

import collections
import math

import pytest
import test_engine
import torch

from paged_attention.engine import Engine, RequestError, SamplingParams
from paged_attention.engine.logits_processors import RowState, StepControls, sampling_probabilities
from paged_attention.engine.request import Request, RequestMetrics, Sequence
from paged_attention.engine.sampler import draw

VOCAB = 64
EOS = 2


# ------------------------------------------------------------------ a per-row reference


def reference_controls(logits, params, prompt, output, end_tokens=(EOS,)):
    """One row, the plain way: min_tokens, logit_bias, then the penalties (vLLM's rules)."""
    x = logits.clone().tolist()
    if len(output) < params.min_tokens:
        masked = set(params.stop_token_ids) | (set() if params.ignore_eos else set(end_tokens))
        for token in masked:
            x[token] = -math.inf
    for token, bias in (params.logit_bias or {}).items():
        x[token] += bias
    counts = collections.Counter(output)
    for token in range(len(x)):
        if token in counts or token in prompt:
            r = params.repetition_penalty
            x[token] = x[token] / r if x[token] > 0 else x[token] * r
        if token in counts:
            x[token] -= params.frequency_penalty * counts[token] + params.presence_penalty
    return torch.tensor(x)


def reference_probabilities(logits, params):
    """One row's sampling distribution: temperature, min_p, top_k, softmax, top_p."""
    x = logits / params.temperature
    if params.min_p > 0:
        p = x.softmax(-1)
        x = torch.where(p < params.min_p * p.max(), -math.inf, x)
    if 0 < params.top_k < len(x):
        kth = sorted(x.tolist(), reverse=True)[params.top_k - 1]
        x = torch.where(x < kth, -math.inf, x)
    probs = x.softmax(-1)
    if params.top_p < 1:
        kept, mass = torch.zeros_like(probs), 0.0
        for token in probs.argsort(descending=True).tolist():
            if mass >= params.top_p and kept.any():
                break
            kept[token] = probs[token]
            mass += probs[token].item()
        probs = kept
    return probs


# A batch with every control, alone and mixed, greedy and sampled.
MIXED = [
    SamplingParams(8),
    SamplingParams(8, temperature=0.7, top_k=5, seed=1),
    SamplingParams(8, temperature=1.3, min_p=0.2, seed=2),
    SamplingParams(8, temperature=1.0, top_p=0.6, top_k=10, min_p=0.05, seed=3),
    SamplingParams(8, presence_penalty=1.5, frequency_penalty=-0.5),
    SamplingParams(8, repetition_penalty=1.8, temperature=0.9, seed=4),
    SamplingParams(8, repetition_penalty=0.6, frequency_penalty=2.0),
    SamplingParams(8, logit_bias={7: 5.0, 9: -100.0, 40: 3.5}, temperature=1.0, seed=5),
    SamplingParams(8, min_tokens=5, stop_token_ids=(11, 12)),
    SamplingParams(8, min_tokens=5, ignore_eos=True, stop_token_ids=(13,), temperature=1.0),
    SamplingParams(8, min_tokens=2, stop_token_ids=(14,)),  # already past its min_tokens
    SamplingParams(8, top_k=-1, temperature=0.5, presence_penalty=-2.0, seed=6),
]


def mixed_rows(seed=0):
    rng = torch.Generator().manual_seed(seed)
    logits = torch.randn(len(MIXED), VOCAB, generator=rng) * 3
    prompts = [torch.randint(0, VOCAB, (5 + i,), generator=rng).tolist() for i in range(len(MIXED))]
    outputs = [torch.randint(0, VOCAB, (i % 4,), generator=rng).tolist() for i in range(len(MIXED))]
    outputs[-2] = [20, 21, 20]  # the min_tokens=2 request has generated 3 tokens
    return logits, prompts, outputs


def test_every_control_matches_a_per_row_reference():
    logits, prompts, outputs = mixed_rows()
    states = [RowState(p, prompt, out) for p, prompt, out in zip(MIXED, prompts, outputs)]
    processed = logits.clone()
    StepControls(states, {EOS}, VOCAB, logits.device).apply(processed)
    for row, (params, prompt, out) in enumerate(zip(MIXED, prompts, outputs)):
        expected = reference_controls(logits[row], params, prompt, out)
        torch.testing.assert_close(processed[row], expected, rtol=1e-6, atol=1e-6)
    sampled = [i for i, p in enumerate(MIXED) if not p.is_greedy]
    probs = sampling_probabilities(processed[sampled], [MIXED[i] for i in sampled])
    for got, row in zip(probs, sampled):
        torch.testing.assert_close(got, reference_probabilities(processed[row], MIXED[row]))


def test_the_controls_change_what_they_should():
    # The reference above could share a mistake with the code: pin a few values by hand.
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0]])
    params = SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25)
    StepControls([RowState(params, [0], [1, 1])], (), 4, logits.device).apply(logits)
    # token 0 in the prompt: 2 / 2; token 1 twice in the output: -1 * 2 - 0.25 * 2 - 0.5
    assert logits.tolist() == [[1.0, -3.0, 0.5, 3.0]]
    probs = sampling_probabilities(
        torch.tensor([[0.0, 1.0, 2.0, 3.0]]), [SamplingParams(temperature=1.0, top_k=2)]
    )
    assert probs[0, :2].tolist() == [0.0, 0.0] and probs[0, 2:].sum().item() == pytest.approx(1)


def make_request(params, prompt, output, request_id=0):
    request = Request(
        request_id,
        prompt,
        params,
        torch.Generator().manual_seed(params.seed),
        RequestMetrics(0.0),
    )
    request.seqs = [Sequence(request_id, list(output))]
    return request


def test_draw_applies_the_controls_to_the_whole_batch():
    logits, prompts, outputs = mixed_rows(seed=1)
    requests = [
        make_request(p, prompt, out, i)
        for i, (p, prompt, out) in enumerate(zip(MIXED, prompts, outputs))
    ]
    drawn = draw(logits, [(r, [i]) for i, r in enumerate(requests)], {EOS})
    for row, (request, result) in enumerate(zip(requests, drawn)):
        params = request.params
        (token,) = result.tokens
        processed = reference_controls(logits[row], params, prompts[row], outputs[row])
        if params.is_greedy:
            assert token == processed.argmax().item()
        else:  # drawn from the reference distribution's support, with this request's seed
            reference = reference_probabilities(processed, params)
            assert reference[token] > 0
            again = torch.multinomial(
                reference[None], 1, generator=torch.Generator().manual_seed(params.seed)
            )
            assert token == again.item()
        assert result.logprobs is None


def test_a_request_draws_the_same_tokens_in_any_batch():
    logits, prompts, outputs = mixed_rows(seed=2)

    def requests():
        return [
            make_request(p, pr, o, i) for i, (p, pr, o) in enumerate(zip(MIXED, prompts, outputs))
        ]

    together = draw(logits, [(r, [i]) for i, r in enumerate(requests())], {EOS})
    for i, request in enumerate(requests()):
        (alone,) = draw(logits[i : i + 1], [(request, [0])], {EOS})
        assert alone.tokens == together[i].tokens


def test_min_tokens_masks_every_end_token_until_reached():
    logits = torch.full((3, VOCAB), -5.0)
    logits[:, [EOS, 11, 12]] = 10.0  # the end tokens are by far the most likely
    params = SamplingParams(8, min_tokens=3, stop_token_ids=(11, 12))
    requests = [make_request(params, [5], [9] * done, i) for i, done in enumerate((0, 2, 3))]
    drawn = draw(logits, [(r, [i]) for i, r in enumerate(requests)], {EOS})
    assert drawn[0].tokens[0] not in (EOS, 11, 12)
    assert drawn[1].tokens[0] not in (EOS, 11, 12)
    assert drawn[2].tokens[0] in (EOS, 11, 12)  # three tokens generated: an end may come


# ------------------------------------------------------------------ SamplingParams checks


@pytest.mark.parametrize(
    "kwargs, argument",
    [
        ({"top_k": -2}, "top_k"),
        ({"top_k": 1.5}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"min_p": float("nan")}, "min_p"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"repetition_penalty": "1"}, "repetition_penalty"),
        ({"logit_bias": [1, 2]}, "logit_bias"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias"),
        ({"logit_bias": {"5": 1.0}}, "logit_bias"),
        ({"logit_bias": {5: 101}}, "logit_bias"),
        ({"logit_bias": {5: float("inf")}}, "logit_bias"),
        ({"ignore_eos": 1}, "ignore_eos"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 20, "max_new_tokens": 10}, "min_tokens"),
        ({"logprobs": 21}, "logprobs"),
        ({"logprobs": -1}, "logprobs"),
        ({"prompt_logprobs": 2.0}, "prompt_logprobs"),
        ({"beam_width": 2, "top_k": 3}, "top_k"),
        ({"beam_width": 2, "repetition_penalty": 1.2}, "repetition_penalty"),
        ({"beam_width": 2, "ignore_eos": True}, "ignore_eos"),
        ({"beam_width": 2, "logprobs": 1}, "logprobs"),
    ],
)
def test_bad_controls_are_refused_naming_the_argument(kwargs, argument):
    with pytest.raises(RequestError, match=argument) as error:
        SamplingParams(**kwargs)
    assert error.value.argument == argument


def test_controls_default_to_off_and_accept_vllms_values():
    params = SamplingParams()
    assert (params.top_k, params.min_p, params.repetition_penalty) == (0, 0.0, 1.0)
    assert params.logit_bias is None and not params.ignore_eos and params.min_tokens == 0
    assert params.logprobs is None and params.prompt_logprobs is None
    assert SamplingParams(top_k=-1, logprobs=20, prompt_logprobs=0).top_k == -1
    assert SamplingParams(logit_bias={3: -100}).logit_bias == {3: -100.0}
    assert SamplingParams(beam_width=2, prompt_logprobs=2).prompt_logprobs == 2


# ------------------------------------------------------------------ through the engine


@pytest.fixture(scope="module")
def model():
    from paged_attention.modeling.tiny import tiny_llama

    return tiny_llama(vocab_size=256, max_position_embeddings=512)


PROMPT = [5, 17, 99, 3, 42, 8, 120]


def generate(model, params, prompt=PROMPT, **engine_kwargs):
    engine = Engine(model, num_blocks=64, block_size=8, **engine_kwargs)
    (out,) = engine.generate([prompt], params)
    return out


def test_top_k_1_is_greedy(model):
    greedy = generate(model, SamplingParams(12)).outputs
    for seed in range(3):
        sampled = generate(model, SamplingParams(12, temperature=1.5, top_k=1, seed=seed))
        assert sampled.outputs == greedy


def test_ignore_eos_runs_to_max_tokens(model):
    first = generate(model, SamplingParams(1)).outputs[0][0]
    stopped = generate(model, SamplingParams(10), eos_token_id=first)
    assert stopped.outputs == [[first]] and stopped.finish_reasons == ["eos"]
    out = generate(model, SamplingParams(10, ignore_eos=True), eos_token_id=first)
    assert len(out.outputs[0]) == 10 and out.finish_reasons == ["length"]
    assert out.outputs[0][0] == first  # the end token is generated, then generation goes on


def test_min_tokens_holds_back_the_end_tokens(model):
    free = generate(model, SamplingParams(12)).outputs[0]
    end = free[1]  # an end token at the second position...
    ended = generate(model, SamplingParams(12, stop_token_ids=(end,)))
    assert ended.outputs == [free[:2]] and ended.finish_reasons == ["stop"]
    for kwargs in ({"stop_token_ids": (end,)}, {}):  # ...as a stop token or the EOS token
        engine_kwargs = {} if kwargs else {"eos_token_id": end}
        out = generate(model, SamplingParams(12, min_tokens=6, **kwargs), **engine_kwargs)
        assert end not in out.outputs[0][:6]
        assert len(out.outputs[0]) >= 6


def test_logit_bias_forces_a_token(model):
    out = generate(model, SamplingParams(8, logit_bias={77: 100}, temperature=1.0, seed=1))
    assert out.outputs == [[77] * 8]
    banned = generate(model, SamplingParams(8)).outputs[0][0]
    out = generate(model, SamplingParams(8, logit_bias={banned: -100}))
    assert banned not in out.outputs[0]


def test_logit_bias_ids_are_checked_against_the_vocabulary(model):
    engine = Engine(model, num_blocks=64, block_size=8)
    with pytest.raises(RequestError, match="logit_bias token 256 is outside") as error:
        engine.add_request(PROMPT, SamplingParams(logit_bias={256: 1.0}))
    assert error.value.argument == "logit_bias"
    assert not engine.has_unfinished()


def test_repetition_penalty_stops_a_greedy_loop(model):
    free = generate(model, SamplingParams(24)).outputs[0]
    assert len(set(free)) < 12  # the tiny random model repeats itself greedily
    out = generate(model, SamplingParams(24, repetition_penalty=100.0, presence_penalty=2.0))
    assert len(set(out.outputs[0])) == 24  # every repeat is penalized away
    assert not set(out.outputs[0]) & set(PROMPT)


text_model = test_engine.text_model  # the fixture: its tiny model over the test tokenizer


def test_min_tokens_ignores_stop_strings_until_reached(text_model):
    model, tokenizer = text_model
    engine = Engine(model, num_blocks=64, block_size=8, tokenizer=tokenizer, eos_token_id=[])
    (free,) = engine.generate(["hello"], SamplingParams(20))
    ids, stop = free.outputs[0], " hello"  # the tiny model says " hello" again and again
    (early,) = engine.generate(["hello"], SamplingParams(20, stop=stop))
    assert early.finish_reasons == ["stop"] and len(early.outputs[0]) < 10
    (late,) = engine.generate(["hello"], SamplingParams(20, stop=stop, min_tokens=10))
    got = late.outputs[0]
    assert late.finish_reasons == ["stop"] and 10 <= len(got) < 20 and got == ids[: len(got)]
    whole = tokenizer.decode(got, skip_special_tokens=True)
    assert whole.endswith(stop) and late.text == whole[: -len(stop)]
