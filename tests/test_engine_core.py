"""The engine core without the input and output processors: requests in, each step's
rejections and updated requests out, every block back when they end."""

import pytest
import test_engine
import torch

transformers = pytest.importorskip("transformers")

from paged_attention.engine import Engine, EngineConfig, SamplingParams  # noqa: E402
from paged_attention.engine.core import EngineCore  # noqa: E402
from paged_attention.engine.request import Request, RequestMetrics  # noqa: E402

model = test_engine.model  # the fixture: test_engine's tiny Llama


def make_request(request_id, prompt, params) -> Request:
    generator = torch.Generator().manual_seed(params.seed)
    return Request(request_id, list(prompt), params, generator, RequestMetrics(0.0))


def config(**kwargs) -> EngineConfig:
    return EngineConfig.from_kwargs(**{"num_blocks": 32, "block_size": 8, **kwargs})


def run_to_end(core: EngineCore) -> tuple[dict, list]:
    finished, rejected = {}, []
    for _ in range(200):
        if not core.has_unfinished():
            break
        result = core.step()
        rejected += [(r.request_id, reason) for r, reason in result.rejected]
        finished.update({r.request_id: r for r in result.updated if not r.seqs})
    assert not core.has_unfinished()
    return finished, rejected


def test_the_core_gives_the_tokens_the_engine_gives(model):
    work = [
        ([5, 6, 7, 8, 9] * 3, SamplingParams(max_new_tokens=6)),
        ([11, 12, 13], SamplingParams(max_new_tokens=5, n=2, temperature=1.0, seed=4)),
        ([20, 21, 22, 23], SamplingParams(max_new_tokens=4, beam_width=2)),
    ]
    core = EngineCore(model, config(max_num_seqs=8))
    for request_id, (prompt, params) in enumerate(work):
        core.add_request(make_request(request_id, prompt, params))
    finished, rejected = run_to_end(core)
    assert rejected == [] and sorted(finished) == [0, 1, 2]
    expected = Engine(model, config(max_num_seqs=8)).generate(
        [p for p, _ in work], [s for _, s in work]
    )
    sample_order = [sorted(finished[i].done, key=lambda s: s.seq_id) for i in (0, 1)]
    assert [[s.tokens for s in done] for done in sample_order] == [
        expected[0].outputs,
        expected[1].outputs,
    ]
    assert [b.tokens for b in finished[2].done] == expected[2].outputs
    manager = core.block_manager
    assert manager.num_free_device_blocks() == manager.num_device_blocks
    assert core.requests == {} and core.stats.steps > 0


def test_the_core_rejects_what_can_never_fit_and_aborts_what_runs(model):
    core = EngineCore(model, config(num_blocks=4))
    too_long = make_request(0, list(range(3, 40)), SamplingParams(max_new_tokens=8))
    running = make_request(1, [5, 6, 7], SamplingParams(max_new_tokens=20))
    core.add_request(too_long)
    core.add_request(running)
    result = core.step()
    assert [(r.request_id, "the pool has 4" in why) for r, why in result.rejected] == [(0, True)]
    assert [r.request_id for r in result.updated] == [1]
    aborted = core.abort(1)
    assert [s.finish_reason for s in aborted.done] == ["abort"]
    assert core.block_manager.num_free_device_blocks() == 4 and not core.has_unfinished()
    with pytest.raises(ValueError, match="unknown or finished request 1"):
        core.abort(1)


def test_a_failed_forward_pass_leaves_the_core_as_it_was(model, monkeypatch):
    core = EngineCore(model, config())
    core.add_request(make_request(0, [5, 6, 7, 8], SamplingParams(max_new_tokens=3)))
    free = core.block_manager.num_free_device_blocks()

    def failing_run(out):
        raise RuntimeError("device lost")

    monkeypatch.setattr(core.runner, "run", failing_run)
    with pytest.raises(RuntimeError, match="device lost"):
        core.step()
    assert core.block_manager.num_free_device_blocks() == free
    assert [r.request_id for r in core.scheduler.waiting] == [0]
    monkeypatch.undo()
    finished, _ = run_to_end(core)
    assert len(finished[0].done[0].tokens) == 3


def test_a_stop_string_check_ends_a_sequence_in_the_step_it_completes(model):
    calls = []

    def stop_at_second_token(request, seq):
        calls.append(len(seq.tokens))
        return len(seq.tokens) == 2

    core = EngineCore(model, config(eos_token_id=()), stop_string_hit=stop_at_second_token)
    core.add_request(make_request(0, [5, 6, 7], SamplingParams(max_new_tokens=10)))
    finished, _ = run_to_end(core)
    assert calls == [1, 2]
    (seq,) = finished[0].done
    assert len(seq.tokens) == 2 and seq.finish_reason == "stop"
