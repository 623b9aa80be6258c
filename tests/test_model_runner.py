"""The ModelRunner and its StepCache: packed steps that mix prompt chunks and decodes of several
sequences in one row give the logits of a per-sequence transformers forward, on tiny Llama,
Mistral (sliding window) and Qwen2 (mixed layers) models."""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("transformers")

from test_engine import hf_greedy  # noqa: E402
from test_transformers import BLOCK, build  # noqa: E402

from paged_attention.engine.model_runner import ModelRunner  # noqa: E402
from paged_attention.engine.request import Request, RequestMetrics, SamplingParams  # noqa: E402
from paged_attention.engine.request import Sequence as EngineSequence  # noqa: E402
from paged_attention.engine.scheduler import ScheduledChunk, SchedulerOutput  # noqa: E402
from paged_attention.integrations.transformers import ATTN_IMPLEMENTATION  # noqa: E402
from paged_attention.kv.step_inputs import StaticStepBuffers, StepInputs  # noqa: E402
from paged_attention.modeling.geometry import ModelGeometry  # noqa: E402


@pytest.fixture(scope="module", params=["llama", "mistral", "qwen2"])
def model(request):
    return build(request.param)


def reference_last_logits(model, tokens):
    model.set_attn_implementation("sdpa")
    try:
        with torch.no_grad():
            return model(input_ids=torch.tensor([tokens])).logits[0, -1]
    finally:
        model.set_attn_implementation(ATTN_IMPLEMENTATION)


def make_runner(model, num_blocks=64):
    geometry = ModelGeometry.of(model)
    kv = geometry.kv_cache(BLOCK, num_blocks, None)
    manager = geometry.block_manager(kv, enable_prefix_caching=False)
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    released = (manager.sliding_window, manager.attention_chunk_size)
    return ModelRunner(model, geometry, kv, released=released), manager


def plan_inputs(out, manager, decode_arrays=None):
    """What the scheduler records in ``out.inputs``: the decode rows as ``decode_step``
    returned them, then the prompt chunks' rows read from the manager."""
    parts = [] if decode_arrays is None else [StepInputs.decode(manager, *decode_arrays)]
    if out.prefill:
        ids, counts = [c.seq.seq_id for c in out.prefill], [c.count for c in out.prefill]
        parts.append(StepInputs.from_manager(manager, ids, counts))
    out.inputs = StepInputs.concat(parts)


def sequence_request(seq_id):
    """A request whose "prompt" is the sequence's whole token list, so every chunk that ends
    at its last token samples."""
    return Request(seq_id, [], SamplingParams(), torch.Generator(), RequestMetrics(0.0)), (
        EngineSequence(seq_id)
    )


def test_packed_steps_match_per_sequence_forward(model):
    runner, manager = make_runner(model)
    gen = torch.Generator().manual_seed(6)
    seqs = {s: sequence_request(s) for s in range(3)}
    prompts = {
        s: torch.randint(3, 96, (n,), generator=gen).tolist() for s, n in enumerate([23, 9, 6])
    }

    def step(plan):
        out = SchedulerOutput()
        decodes = [(s, new) for s, new in plan if manager.has_seq(s) and len(new) == 1]
        arrays = None
        if decodes:
            pairs, *arrays = manager.decode_step([s for s, _ in decodes])
            out.block_ops.append(("copy", pairs))
        for seq_id, new in plan:
            request, seq = seqs[seq_id]
            start = len(request.prompt)
            request.prompt += new
            chunk = ScheduledChunk(request, seq, start, len(new))
            if (seq_id, new) in decodes:
                out.decode.append(chunk)
                continue
            if manager.has_seq(seq_id):
                out.block_ops.append(("copy", manager.append_slots(seq_id, len(new))))
            else:
                manager.allocate(seq_id, len(new))
                chunk.allocated = True
            out.prefill.append(chunk)
        plan_inputs(out, manager, arrays)
        runner.execute_block_ops(out.block_ops)
        logits = runner.run(out)
        assert logits.shape[0] == len(plan)
        for chunk, got in zip(out.chunks, logits):
            want = reference_last_logits(model, chunk.request.prompt)
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)

    step([(0, prompts[0][:15]), (1, prompts[1])])
    step([(0, prompts[0][15:]), (1, [5])])  # chunked prefill after context + decode
    step([(0, [7]), (2, prompts[2]), (1, [9])])  # decode + fresh prefill + decode
    manager.fork(1, 3)  # a parallel sample of sequence 1 shares its blocks
    seqs[3] = sequence_request(3)
    seqs[3][0].prompt = list(seqs[1][0].prompt)
    step([(1, [11]), (3, [12])])  # copy-on-write of their shared partial block
    step([(3, [13, 14, 15])])
    model.set_attn_implementation("sdpa")


def test_step_cache_needs_the_steps_metadata():
    model = build("llama")
    runner, manager = make_runner(model, num_blocks=16)
    manager.allocate(0, 3)
    with torch.no_grad():
        with pytest.raises(ValueError, match="metadata must describe the step"):
            model(
                input_ids=torch.tensor([[4, 5, 6]]),
                position_ids=torch.tensor([[0, 1, 2]]),
                cache=runner.cache,
            )
        request, seq = sequence_request(0)
        request.prompt = [4, 5, 6]
        out = SchedulerOutput(prefill=[ScheduledChunk(request, seq, 0, 3, allocated=True)])
        plan_inputs(out, manager)
        runner.cache.metadata = runner.metadata(out)
        with pytest.raises(ValueError, match="packs 3 tokens in one row"):
            model(
                input_ids=torch.tensor([[4, 5]]),
                position_ids=torch.tensor([[0, 1]]),
                cache=runner.cache,
            )
    model.set_attn_implementation("sdpa")


def test_a_padded_decode_step_on_the_static_buffers_equals_the_eager_step():
    # What a CUDA graph captures is DecodeGraphs.forward over the padded static buffers; on the
    # CPU it runs eagerly, so the padding (seq_len 0, slot -1 rows) is checked here.
    from paged_attention.engine import Engine, SamplingParams
    from paged_attention.engine.model_runner import DecodeGraphs

    model = build("qwen2")  # a sliding window on one layer, full attention on the other
    engine = Engine(model, num_blocks=64, block_size=BLOCK, max_num_seqs=8)
    for i, prompt in enumerate([[5, 6, 7, 8, 9], list(range(10, 33)), [40, 41]]):
        engine.add_request(prompt, SamplingParams(20, temperature=1.0, n=1 + i % 2, seed=i))
    engine.step()  # the prompts; decode steps from here on
    buffers = StaticStepBuffers(8, 256, BLOCK, "cpu")  # prefix caching: nothing released
    graphs = DecodeGraphs(engine.runner, buffers)
    for _ in range(3):
        out = engine.scheduler.schedule()
        assert out.decode and not out.prefill and graphs.fits(out)
        engine.runner.execute_block_ops(out.block_ops)
        eager = engine.runner.run(out)
        size = graphs.fill(out)
        assert size == 4 and len(out.decode) == 4
        padded = graphs.forward(size).float()
        torch.testing.assert_close(padded[: len(out.decode)], eager, atol=1e-5, rtol=1e-5)
        engine.scheduler.rollback(out)
        engine.step()
    model.set_attn_implementation("sdpa")


def test_cuda_graphs_need_a_cuda_model():
    from paged_attention.engine import Engine

    with pytest.raises(ValueError, match="CUDA graphs need a model on a CUDA device"):
        Engine(build("llama"), num_blocks=16, block_size=BLOCK, cuda_graphs=True)


def test_the_step_cache_checks_each_layer_against_the_geometry():
    # Mistral slides over a window in every layer; a geometry that read it as full attention
    # (the Phi-MoE mistake: a window only the mask applies) is caught at the first layer, with
    # prefix caching (no window in the manager) as without.
    model = build("mistral")
    geometry = ModelGeometry.of(model)
    misread = dataclasses.replace(
        geometry,
        layers=tuple(dataclasses.replace(layer, sliding_window=0) for layer in geometry.layers),
    )
    kv = misread.kv_cache(BLOCK, 16, None)
    manager = misread.block_manager(kv, enable_prefix_caching=True)
    runner = ModelRunner(model, misread, kv)
    request, seq = sequence_request(0)
    request.prompt = [4, 5, 6]
    manager.allocate(0, 3)
    out = SchedulerOutput(prefill=[ScheduledChunk(request, seq, 0, 3, allocated=True)])
    plan_inputs(out, manager)
    with pytest.raises(ValueError, match="attends with a sliding window of 12, but its config"):
        runner.run(out)
    model.set_attn_implementation("sdpa")


def test_compiled_decode_steps_match_generate_and_pad_to_few_sizes():
    # Compiling costs seconds even for this 2-layer model, so one test covers the compiled path:
    # a mixed-window model (qwen2), three sequences padded to the size-8 graph, then two (a
    # request finished), with the prompts' steps and a mixed step eager in between; then the
    # other size compiled ahead (compile_decode_steps, as the server does) without touching the
    # cache, and a request alone through it.
    from paged_attention.engine import Engine, SamplingParams
    from paged_attention.engine.model_runner import CompiledDecode

    model = build("qwen2")
    engine = Engine(
        model, num_blocks=64, block_size=BLOCK, max_num_seqs=8, eos_token_id=[], compile=True
    )
    compiled = engine.runner.graphs
    assert isinstance(compiled, CompiledDecode) and compiled.sizes == [1, 8]
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 96, (n,), generator=gen).tolist() for n in (5, 19, 11)]
    lengths = (12, 12, 7)
    outputs = engine.generate(prompts, [SamplingParams(n) for n in lengths])
    assert list(compiled.compile_seconds) == [8]
    for prompt, n, out in zip(prompts, lengths, outputs):
        assert out.outputs == [hf_greedy(model, prompt, n, eos_token_id=None)]

    caches = [t.clone() for t in engine.kv_cache.key_caches + engine.kv_cache.value_caches]
    seconds = engine.compile_decode_steps()
    assert sorted(seconds) == [1, 8] and seconds[8] == compiled.compile_seconds[8]
    after = engine.kv_cache.key_caches + engine.kv_cache.value_caches
    # blocks no request has written hold whatever torch.empty left there, NaN among it
    assert all(torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0)) for a, b in zip(caches, after))
    assert all(torch.equal(a.isnan(), b.isnan()) for a, b in zip(caches, after))
    assert engine.compile_decode_steps() == seconds  # nothing left to compile
    alone = engine.generate([prompts[1][:7]], SamplingParams(9))[0]
    assert alone.outputs == [hf_greedy(model, prompts[1][:7], 9, eos_token_id=None)]
    assert compiled.compile_seconds == seconds


def test_compile_is_for_cpu_models():
    from paged_attention.engine import Engine

    with pytest.raises(ValueError, match="compile must be True or False"):
        Engine(build("llama"), num_blocks=16, block_size=BLOCK, compile="yes")
    model = build("llama").to("meta")
    with pytest.raises(ValueError, match="compiled decode steps are for a model on the CPU"):
        Engine(model, num_blocks=16, block_size=BLOCK, cuda_graphs=False, compile=True)
    eager = Engine(build("llama"), num_blocks=16, block_size=BLOCK)
    with pytest.raises(ValueError, match="compile_decode_steps needs an engine built with compile"):
        eager.compile_decode_steps()


def test_a_loaded_step_is_adopted_for_one_of_the_sizes_only_and_once():
    from paged_attention.engine import Engine

    engine = Engine(build("llama"), num_blocks=16, block_size=BLOCK, max_num_seqs=2, compile=True)
    compiled = engine.runner.graphs
    with pytest.raises(ValueError, match=r"batch size 4: not one of \[1, 2\]"):
        compiled.adopt(4, object())
    compiled._steps[2] = lambda: None  # as a compiled size holds it
    with pytest.raises(ValueError, match="batch size 2: compiled already"):
        compiled.adopt(2, object())
    assert compiled.ahead_steps == {}
