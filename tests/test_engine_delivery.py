"""Every output of the engine is delivered exactly once, whoever drives the step (docs/design.md,
"Engine outputs"): a hypothesis state machine interleaves streams, step(), add_request, abort,
closed and dropped streams, and injected faults in the forward pass and in sampling, and checks
that no output is lost or duplicated, nothing hangs (every loop is bounded), no block leaks, and
every request that finished normally has exactly the tokens of a run without faults."""

import gc

import pytest

transformers = pytest.importorskip("transformers")

import torch  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.stateful import (  # noqa: E402
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
)

from paged_attention.engine import Engine, SamplingParams  # noqa: E402
from paged_attention.engine import core as engine_module  # noqa: E402

BLOCK = 8
MAX_STEPS = 400
_MODEL = []


def tiny_model():
    if not _MODEL:
        config = transformers.LlamaConfig(
            vocab_size=128,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=512,
            eos_token_id=2,
            pad_token_id=0,
        )
        torch.manual_seed(0)
        _MODEL.append(transformers.LlamaForCausalLM(config).eval())
    return _MODEL[0]


class Faults:
    """Raises in the model's forward pass or in sampling when armed, once."""

    def __init__(self, model):
        self.mlp = model.model.layers[0].mlp
        self.forward = self.mlp.forward
        self.draw = engine_module.draw
        self.armed = None
        self.mlp.forward = self._forward
        engine_module.draw = self._draw

    def _forward(self, *args, **kwargs):
        if self.armed == "forward":
            self.armed = None
            raise RuntimeError("injected forward failure")
        return self.forward(*args, **kwargs)

    def _draw(self, *args, **kwargs):
        if self.armed == "sampling":
            self.armed = None
            raise RuntimeError("injected sampling failure")
        return self.draw(*args, **kwargs)

    def remove(self):
        del self.mlp.forward
        engine_module.draw = self.draw


prompt_strategy = st.lists(st.integers(3, 127), min_size=1, max_size=30)
params_strategy = st.one_of(
    st.builds(SamplingParams, max_new_tokens=st.integers(1, 12)),
    st.builds(
        SamplingParams,
        max_new_tokens=st.integers(1, 12),
        temperature=st.just(1.0),
        n=st.integers(1, 3),
        seed=st.integers(0, 5),
    ),
    st.builds(SamplingParams, max_new_tokens=st.integers(1, 8), beam_width=st.just(2)),
)


class EngineDelivery(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.model = tiny_model()
        self.engine = Engine(
            self.model, num_blocks=24, block_size=BLOCK, num_host_blocks=24, max_num_seqs=8
        )
        self.faults = Faults(self.model)
        self.work = {}  # request id -> (prompt, params)
        self.delivered = {}  # request id -> outputs delivered to step() or a stream
        self.aborted = {}  # request id -> what abort() returned
        self.given_up = set()  # requests whose stream was closed or dropped unfinished
        self.streams = []

    def _record(self, outputs):
        for out in outputs:
            self.delivered.setdefault(out.request_id, []).append(out)

    def _run(self, call, fault):
        """``call()``; with ``fault``, armed to raise once (a step that raises returns nothing)."""
        self.faults.armed = fault
        try:
            return call()
        except RuntimeError as error:
            assert fault is not None and "injected" in str(error), error
            return None
        finally:
            self.faults.armed = None

    @rule(prompt=prompt_strategy, params=params_strategy)
    def add_request(self, prompt, params):
        self.work[self.engine.add_request(prompt, params)] = (prompt, params)

    @rule(prompt=prompt_strategy, params=params_strategy)
    def open_stream(self, prompt, params):
        stream = self.engine.stream(prompt, params)
        self.work[stream.request_id] = (prompt, params)
        self.streams.append(stream)

    @rule(fault=st.sampled_from([None, None, "forward", "sampling"]))
    def step(self, fault):
        outputs = self._run(self.engine.step, fault)
        if outputs is not None:
            self._record(outputs)

    @precondition(lambda self: self.streams)
    @rule(index=st.integers(0, 100), fault=st.sampled_from([None, None, "forward"]))
    def advance_stream(self, index, fault):
        stream = self.streams[index % len(self.streams)]
        output = self._run(lambda: next(stream, StopIteration), fault)
        if output is StopIteration:
            self.streams.remove(stream)
        elif output is not None:
            self._record([output])

    @precondition(lambda self: self.streams)
    @rule(index=st.integers(0, 100), drop=st.booleans())
    def give_up_stream(self, index, drop):
        stream = self.streams.pop(index % len(self.streams))
        finished = any(o.finished for o in self.delivered.get(stream.request_id, []))
        if not finished:
            self.given_up.add(stream.request_id)
        if drop:
            del stream
            gc.collect()
        else:
            stream.close()

    @rule(index=st.integers(0, 100))
    def abort(self, index):
        live = sorted(self.engine.core.requests)
        if live:
            request_id = live[index % len(live)]
            self.aborted[request_id] = self.engine.abort(request_id)

    @invariant()
    def nothing_after_a_final(self):
        for outputs in self.delivered.values():
            finals = [i for i, o in enumerate(outputs) if o.finished]
            assert finals in ([], [len(outputs) - 1])

    def teardown(self):
        try:
            for stream in self.streams:
                self._record(list(stream_bounded(stream)))
            for _ in range(MAX_STEPS):
                if not self.engine.has_unfinished():
                    break
                self._record(self.engine.step())
            assert not self.engine.has_unfinished(), "the engine did not finish"
            self.check_deliveries()
            self.check_no_block_leaked()
            self.check_tokens_match_a_run_without_faults()
        finally:
            self.faults.remove()

    def check_deliveries(self):
        for request_id, (_, params) in self.work.items():
            if request_id in self.given_up:
                continue
            deliveries = list(self.delivered.get(request_id, []))
            if request_id in self.aborted and not any(o.finished for o in deliveries):
                deliveries.append(self.aborted[request_id])  # abort() delivered it to its caller
            finals = [o for o in deliveries if o.finished]
            assert len(finals) == 1, (request_id, deliveries)
            final = finals[0]
            if request_id in self.aborted:  # a stream ends with the output abort() returned
                assert final.finish_reasons == self.aborted[request_id].finish_reasons
            if not params.is_beam_search:
                joined = [[] for _ in final.outputs]
                for out in deliveries:
                    if len(out.new_tokens) == len(joined):
                        for entry, new in zip(joined, out.new_tokens):
                            entry += new
                assert joined == final.outputs, (request_id, deliveries)

    def check_no_block_leaked(self):
        manager = self.engine.block_manager
        assert manager.seq_ids() == []
        assert manager.num_free_device_blocks() == manager.num_device_blocks
        assert manager.num_free_host_blocks() == manager.num_host_blocks

    def check_tokens_match_a_run_without_faults(self):
        done = {
            request_id: finals[-1]
            for request_id, finals in self.delivered.items()
            if finals[-1].finished
            and request_id not in self.aborted
            and request_id not in self.given_up
        }
        if not done:
            return
        self.faults.armed = None
        reference = Engine(self.model, num_blocks=64, block_size=BLOCK, max_num_seqs=8)
        work = [self.work[request_id] for request_id in done]
        expected = reference.generate([p for p, _ in work], [s for _, s in work])
        assert [o.outputs for o in done.values()] == [o.outputs for o in expected]


def stream_bounded(stream):
    for count, output in enumerate(stream):
        assert count < MAX_STEPS, "a stream did not end"
        yield output


EngineDelivery.TestCase.settings = settings(
    max_examples=15,
    stateful_step_count=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
test_engine_delivers_every_output_exactly_once = EngineDelivery.TestCase
