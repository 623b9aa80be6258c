"""The engine's runner for hybrid models: a step that fails after its forward passes (here, in
sampling) writes no state, so the retried step gives the tokens of an engine that never failed;
the state slots are the engine's ``max_num_seqs``, and a memory budget holds their states (measured
from the model) before its KV blocks; prefix caching is turned off with a warning."""

from __future__ import annotations

import logging

import pytest
import torch

pytest.importorskip("transformers")

from test_model_zoo import BLOCK, VOCAB, Zoo  # noqa: E402

from paged_attention.engine import Engine, SamplingParams  # noqa: E402
from paged_attention.engine.config import CacheConfig  # noqa: E402
from paged_attention.engine.core import EngineCore  # noqa: E402
from paged_attention.engine.hybrid_runner import (  # noqa: E402
    HybridRunner,
    state_bytes_per_sequence,
)
from paged_attention.engine.scheduler import Scheduler  # noqa: E402
from paged_attention.modeling.geometry import ModelGeometry  # noqa: E402


@pytest.fixture(scope="module")
def lfm2() -> Zoo:
    torch.set_num_threads(1)
    return Zoo("lfm2")


def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(5)
    return [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in (9, 17)]


def run(zoo: Zoo, fail_at_step: int | None = None) -> list[list[int]]:
    """Greedy tokens of an engine (chunked prefill); sampling raises once at ``fail_at_step``
    and the step is retried."""
    engine = Engine(
        zoo.model,
        num_blocks=16,
        block_size=BLOCK,
        eos_token_id=[],
        max_num_batched_tokens=8,
        max_num_seqs=2,
    )
    try:
        for prompt in prompts():
            engine.add_request(prompt, SamplingParams(6))
        choose, steps, failed = EngineCore._choose_tokens, [0], []

        def failing_once(core, out, logits):
            steps[0] += 1
            if steps[0] == fail_at_step and not failed:
                failed.append(steps[0])
                raise RuntimeError("sampling failed")
            return choose(core, out, logits)

        outputs = {}
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(EngineCore, "_choose_tokens", failing_once)
            while engine.has_unfinished():
                try:
                    for output in engine.step():
                        outputs[output.request_id] = output
                except RuntimeError as error:
                    assert str(error) == "sampling failed"
        assert bool(failed) == (fail_at_step is not None)
        return [outputs[key].outputs[0] for key in sorted(outputs)]
    finally:
        zoo.model.set_attn_implementation(zoo.default)


@pytest.mark.parametrize("fail_at_step", [2, 4])  # a prompt chunk continuing a state; a decode
def test_a_failed_step_writes_no_state(lfm2, fail_at_step):
    expected = [lfm2.greedy(prompt, 6) for prompt in prompts()]
    assert run(lfm2) == expected
    assert run(lfm2, fail_at_step) == expected


def test_a_steps_decodes_run_as_one_batched_pass(lfm2):
    """Sequences of different lengths decode together in one pass of one token per row (their
    states gathered from their slots); prompt chunks run a pass each; the tokens stay exact."""
    gen = torch.Generator().manual_seed(6)
    work = [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in (5, 12, 21)]
    steps: list[list[tuple[int, int]]] = []  # per step: (rows, tokens a row) of each pass
    run_step, forward_rows = HybridRunner.run, HybridRunner._forward_rows

    def recording_run(runner, out):
        steps.append([])
        return run_step(runner, out)

    def recording_forward(runner, tokens, positions, inputs):
        steps[-1].append((len(tokens), len(tokens[0])))
        return forward_rows(runner, tokens, positions, inputs)

    engine = Engine(lfm2.model, num_blocks=16, block_size=BLOCK, eos_token_id=[])
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(HybridRunner, "run", recording_run)
            patch.setattr(HybridRunner, "_forward_rows", recording_forward)
            outputs = engine.generate(work, SamplingParams(6))
    finally:
        lfm2.model.set_attn_implementation(lfm2.default)
    assert [o.outputs[0] for o in outputs] == [lfm2.greedy(p, 6) for p in work]
    assert steps[0] == [(1, 5), (1, 12), (1, 21)]  # the prompts: a pass each
    assert steps[1:] == [[(3, 1)]] * 5  # then every step decodes all three in one pass


def test_the_engine_holds_a_slot_per_running_sequence_and_no_prefix_cache(lfm2, caplog):
    with caplog.at_level(logging.WARNING):
        engine = Engine(lfm2.model, num_blocks=8, block_size=BLOCK, max_num_seqs=3)
    try:
        assert isinstance(engine.core.runner, HybridRunner)
        assert engine.block_manager.state_stats().num_slots == 3
        assert not engine.block_manager.enable_prefix_caching
        assert "prefix caching is off" in caplog.text
    finally:
        lfm2.model.set_attn_implementation(lfm2.default)


def test_a_sequences_state_is_measured_from_the_model(lfm2):
    geometry = ModelGeometry.of(lfm2.model)
    try:
        measured = state_bytes_per_sequence(lfm2.model, geometry)
    finally:
        lfm2.model.set_attn_implementation(lfm2.default)
    config = lfm2.model.config  # one conv layer: a window of conv_L_cache inputs, float32
    assert measured == config.hidden_size * config.conv_L_cache * 4


def test_a_memory_budget_holds_the_states_of_max_num_seqs_sequences(lfm2):
    geometry = ModelGeometry.of(lfm2.model)
    block = CacheConfig(block_size=BLOCK, num_blocks=1).block_bytes(geometry)
    slot = state_bytes_per_sequence(lfm2.model, geometry)
    budget = 40 * block
    try:
        engine = Engine(lfm2.model, max_memory=budget, block_size=BLOCK, max_num_seqs=8)
        assert engine.kv_cache.num_blocks == 40 - -(-8 * slot // block)
        with pytest.raises(ValueError, match="max_num_seqs=4096 sequences"):
            Engine(lfm2.model, max_memory=budget, block_size=BLOCK, max_num_seqs=4096)
    finally:
        lfm2.model.set_attn_implementation(lfm2.default)


def test_speculative_decoding_is_refused_for_hybrid_models(lfm2):
    # rejected drafts would have advanced the conv and recurrent states past the kept tokens
    try:
        with pytest.raises(ValueError, match="speculative decoding is refused"):
            Engine(lfm2.model, num_blocks=8, block_size=BLOCK, speculative={})
    finally:
        lfm2.model.set_attn_implementation(lfm2.default)


# ------------------------------------------------------------------ several sequences a request


def full_logits(zoo: Zoo, tokens: list[int]) -> torch.Tensor:
    """The last position's logits of ``tokens`` on transformers' default attention, no cache."""
    with torch.inference_mode():
        return zoo.model(torch.tensor([tokens]), use_cache=False).logits[0, -1].float()


def reference_beam_search(zoo: Zoo, prompt, width: int, max_new_tokens: int) -> list[list[int]]:
    """The engine's beam rules (no end token here), every beam's logits recomputed without a
    cache."""
    beams = [([], 0.0)]
    for _ in range(max_new_tokens):
        candidates = []
        for tokens, score in beams:
            logprobs = full_logits(zoo, prompt + tokens).log_softmax(-1)
            candidates += [(score + lp, tokens + [t]) for t, lp in enumerate(logprobs.tolist())]
        candidates.sort(key=lambda c: -c[0])
        beams = [(tokens, score) for score, tokens in candidates[:width]]
    beams.sort(key=lambda b: -b[1] / len(b[0]))
    return [tokens for tokens, _ in beams]


def several_sequences() -> list[tuple[list[int], SamplingParams]]:
    gen = torch.Generator().manual_seed(9)
    lengths = (11, 19, 6, 14)
    prompts = [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in lengths]
    return [
        (prompts[0], SamplingParams(8, n=3, temperature=1.0, seed=3)),
        (prompts[1], SamplingParams(8, beam_width=2)),
        (prompts[2], SamplingParams(8, n=2, temperature=0.8, top_k=20, seed=4)),
        (prompts[3], SamplingParams(8)),
    ]


def serve_recording(zoo: Zoo, work, fail_at_step: int | None = None, **setup):
    """The outputs of an engine serving ``work``, every logits row it sampled from with the
    tokens it followed, and the requests it preempted (id, live sequences, tokens each).
    Sampling raises once at ``fail_at_step`` and the step is retried."""
    engine = Engine(zoo.model, block_size=BLOCK, eos_token_id=[], **setup)
    rows, preempted, steps = [], [], [0]
    choose, preempt = EngineCore._choose_tokens, Scheduler._preempt

    def recording_choose(core, out, logits):
        steps[0] += 1
        if steps[0] == fail_at_step:
            raise RuntimeError("sampling failed")
        sampling = [c for c in out.chunks if c.samples]
        for chunk, row in zip(sampling, logits):
            rows.append((chunk.request.prompt + chunk.seq.tokens, row.clone()))
        return choose(core, out, logits)

    def recording_preempt(scheduler, request, out):
        preempted.append((request.request_id, len(request.seqs), len(request.seqs[0].tokens)))
        return preempt(scheduler, request, out)

    ids = [engine.add_request(prompt, params) for prompt, params in work]
    outputs = {}
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(EngineCore, "_choose_tokens", recording_choose)
            patch.setattr(Scheduler, "_preempt", recording_preempt)
            while engine.has_unfinished():
                try:
                    outputs.update((o.request_id, o.outputs) for o in engine.step())
                except RuntimeError as error:
                    assert str(error) == "sampling failed"
    finally:
        zoo.model.set_attn_implementation(zoo.default)
    assert fail_at_step is None or steps[0] > fail_at_step
    assert engine.block_manager.state_stats().used_slots == 0
    return [outputs[i] for i in ids], rows, preempted


@pytest.mark.parametrize("model_type", ["lfm2", "qwen3_next", "jamba"])
def test_samples_and_beams_are_exact_under_preemption(model_type):
    """n > 1 and beams on a hybrid model: a request preempted by recompute after its samples
    forked recomputes its first sequence to the end of the prompt, the others fork its state
    there and recompute their own tokens. Every logits row sampled from is the default cache's
    for the tokens it follows; seeded samples are those of a run never preempted, and beams
    those of a cacheless reference."""
    zoo = Zoo(model_type)
    work = several_sequences()
    roomy, _, unpreempted = serve_recording(zoo, work, num_blocks=64)
    assert unpreempted == []
    tight = dict(num_blocks=10, max_num_batched_tokens=12, max_num_seqs=8)
    got, rows, preempted = serve_recording(zoo, work, **tight)
    assert got == roomy
    # preempted with several sequences that had tokens of their own: they were recomputed
    assert any(seqs > 1 and tokens > 1 for _, seqs, tokens in preempted), preempted
    for tokens, row in rows:
        torch.testing.assert_close(row, full_logits(zoo, tokens), rtol=1e-4, atol=1e-4)
    assert got[1] == reference_beam_search(zoo, work[1][0], 2, 8)
    assert got[3] == [zoo.greedy(work[3][0], 8)]
    assert len({tuple(s) for s in got[0]}) > 1  # the samples differ


@pytest.mark.parametrize("fail_at_step", [5, 9, 14])
def test_a_failed_step_of_samples_and_beams_writes_no_state(lfm2, fail_at_step):
    """A step that raises after its forward passes, with samples and beams forked, recomputed
    and preempted around it: the retried run gives the tokens of a run that never failed."""
    tight = dict(num_blocks=10, max_num_batched_tokens=12, max_num_seqs=8)
    expected, _, _ = serve_recording(lfm2, several_sequences(), **tight)
    got, _, preempted = serve_recording(lfm2, several_sequences(), fail_at_step, **tight)
    assert got == expected and preempted
