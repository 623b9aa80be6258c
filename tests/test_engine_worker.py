"""The engine process's compact outputs: every step's outputs of an engine, encoded as deltas
(engine_worker.DeltaEncoder) and assembled again on the server's side
(engine_process.OutputAssembler), equal the engine's own outputs, for sampling with n > 1,
stop strings and an abort; and what crosses per step does not grow with the answer."""

from __future__ import annotations

import copy
import multiprocessing
import pickle
import threading

import pytest

from paged_attention.engine import Engine, SamplingParams
from paged_attention.modeling.models import load_model
from paged_attention.server.engine_process import OutputAssembler
from paged_attention.server.engine_worker import (
    STOPPED,
    Delivery,
    DeltaEncoder,
    EngineLoop,
    engine_sizes,
    engine_state,
)


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny")


def make_engine(tiny) -> Engine:
    model, tokenizer = tiny
    return Engine(model, tokenizer=tokenizer, num_blocks=128, block_size=16, max_num_seqs=16)


def snapshot(output) -> tuple:
    metrics = output.metrics
    snapshot = (
        output.request_id,
        output.prompt,
        output.outputs,
        output.finish_reasons,
        output.new_tokens,
        output.finished,
        output.rejected,
        output.texts,
        output.new_texts,
        None if metrics is None else list(metrics.token_times),
        None if metrics is None else metrics.finished_time,
    )
    return copy.deepcopy(snapshot)


def test_deltas_assemble_into_the_engines_outputs(tiny):
    engine = make_engine(tiny)
    requests = [
        ("Hello there", SamplingParams(max_new_tokens=40)),
        ("Sampled", SamplingParams(max_new_tokens=30, n=3, temperature=1.0, seed=7)),
        ("Stop me", SamplingParams(max_new_tokens=40, temperature=1.0, seed=3, stop=("a", "e"))),
        ("Aborted", SamplingParams(max_new_tokens=200)),
    ]
    keys = {}
    encoder, assembler = DeltaEncoder(), OutputAssembler()
    for key, (prompt, params) in enumerate(requests):
        request_id = engine.add_request(prompt, params)
        keys[request_id] = key
    prompts = {}
    deltas = wholes = steps = 0
    while engine.has_unfinished():
        steps += 1
        outputs = engine.step()
        if steps == 5:
            outputs.append(engine.abort(3))
        for output in outputs:
            key = keys[output.request_id]
            expected = snapshot(output)  # before encoding, which must not change it
            if key not in prompts:
                prompts[key] = output.prompt
                assembler.admit(key, output.prompt)
            delivery = pickle.loads(pickle.dumps(encoder.encode(key, output)))
            deltas += not delivery.whole
            wholes += delivery.whole
            if not delivery.whole:
                assert delivery.output.outputs is None and delivery.output.texts is None
                assert delivery.output.prompt == []
            assert snapshot(assembler.assemble(delivery)) == expected
            assert snapshot(output) == expected
    assert wholes == len(requests)  # each request's first output only
    assert deltas > 50


def test_a_delta_does_not_grow_with_the_answer(tiny):
    engine = make_engine(tiny)
    encoder = DeltaEncoder()
    engine.add_request("Long", SamplingParams(max_new_tokens=300))
    sizes = []
    while engine.has_unfinished():
        for output in engine.step():
            sizes.append(len(pickle.dumps(encoder.encode(0, output))))
    assert len(sizes) == 300
    assert max(sizes[1:-1]) < sizes[0] + 200  # the 299th delta is as small as the second
    assert max(sizes[1:-1]) - min(sizes[1:-1]) < 64


def test_engine_state_and_sizes_are_what_the_metrics_and_app_read(tiny):
    engine = make_engine(tiny)
    engine.add_request("Hi", SamplingParams(max_new_tokens=4))
    engine.step()
    state = engine_state(engine)
    assert state["running"] == 1 and state["waiting"] == 0 and state["swapped"] == 0
    assert state["free_blocks"] == engine.block_manager.num_free_device_blocks() < 128
    assert state["stats"]["steps"] == 1 and "timeline" not in state["stats"]
    assert engine_sizes(engine) == {
        "max_num_seqs": 16,
        "max_model_len": engine.max_model_len,
        "block_size": 16,
        "num_device_blocks": 128,
    }


def test_the_loop_takes_each_requests_outputs_from_the_engines_output_processor(tiny):
    engine = make_engine(tiny)
    returned_by_step = []
    step = engine.step

    def recording_step():
        outputs = step()
        returned_by_step.extend(outputs)
        return outputs

    engine.step = recording_step
    server_commands, loop_commands = multiprocessing.Pipe()
    loop_results, server_results = multiprocessing.Pipe()
    loop = EngineLoop(engine, loop_commands, loop_results)
    thread = threading.Thread(target=loop.run)
    thread.start()
    server_commands.send(("add", 7, "Hi", SamplingParams(max_new_tokens=5)))
    server_commands.send(("add", 8, "Long one", SamplingParams(max_new_tokens=200)))
    deliveries, finished = [], set()
    while 7 not in finished:
        turn = server_results.recv()
        for event in turn.events:
            if isinstance(event, Delivery):
                deliveries.append(event)
                if event.output.finished:
                    finished.add(event.key)
    server_commands.send(("abort", 8))
    server_commands.send(("stop",))
    while server_results.recv() != STOPPED:
        pass
    thread.join(10)
    assert returned_by_step == []  # every output went to its key's owner, none to step()
    assert sum(len(d.output.new_tokens[0]) for d in deliveries if d.key == 7) == 5
    assert loop.request_ids == {} and loop.owners == {}
    assert engine.output_processor.take_owned() == [] and not engine.has_unfinished()
    manager = engine.block_manager
    assert manager.seq_ids() == []
