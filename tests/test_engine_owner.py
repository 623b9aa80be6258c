"""The engine's owner in a thread, and what both owners share: a stream's pending outputs
merge into one (bounded memory for a reader that pauses), adding up to the same tokens and
text; ``EngineOwner(engine)`` picks the owner by the engine it is given."""

from __future__ import annotations

import asyncio

import pytest

from paged_attention.engine import Engine, Logprob, RequestOutput, SamplingParams
from paged_attention.modeling.models import load_model
from paged_attention.server.engine_owner import (
    EngineOwner,
    OutputQueue,
    ThreadEngineOwner,
    merge_outputs,
)


def output(new_tokens, new_texts, finished=False, reasons=None) -> RequestOutput:
    return RequestOutput(
        request_id=0,
        prompt=[1],
        outputs=[list(t) for t in new_tokens],
        finish_reasons=reasons or [None] * len(new_tokens),
        new_tokens=new_tokens,
        finished=finished,
        texts=list(new_texts),
        new_texts=new_texts,
    )


def test_merge_joins_new_tokens_and_text_entry_by_entry_and_keeps_the_later_state():
    earlier = output([[1], [2]], ["a", "b"])
    later = output([[3], [4]], ["c", "d"], finished=True, reasons=["stop", "length"])
    merged = merge_outputs(earlier, later, beams=False)
    assert merged.new_tokens == [[1, 3], [2, 4]]
    assert merged.new_texts == ["ac", "bd"]
    assert merged.finished and merged.finish_reasons == ["stop", "length"]
    assert merged.outputs is later.outputs
    assert later.new_tokens == [[3], [4]] and later.new_texts == ["c", "d"]  # unchanged
    # a sample forked since the earlier output adds nothing of its own
    forked = merge_outputs(output([[1]], ["a"]), later, beams=False)
    assert forked.new_tokens == [[1, 3], [4]] and forked.new_texts == ["ac", "d"]
    # beams reorder: the later output stands alone
    assert merge_outputs(earlier, later, beams=True) is later


def test_merge_joins_each_tokens_logprobs_once():
    earlier, later = output([[1], [2]], ["a", "b"]), output([[3], [4]], ["c", "d"])
    earlier.new_logprobs = [[{1: Logprob(-0.1, 1)}], [{2: Logprob(-0.2, 1)}]]
    later.new_logprobs = [[{3: Logprob(-0.3, 2)}], [{4: Logprob(-0.4, 1)}]]
    merged = merge_outputs(earlier, later, beams=False)
    assert merged.new_logprobs == [
        [{1: Logprob(-0.1, 1)}, {3: Logprob(-0.3, 2)}],
        [{2: Logprob(-0.2, 1)}, {4: Logprob(-0.4, 1)}],
    ]
    assert later.new_logprobs == [[{3: Logprob(-0.3, 2)}], [{4: Logprob(-0.4, 1)}]]


def test_an_unread_queue_holds_one_output_after_its_admission():
    async def scenario():
        queue = OutputQueue()
        queue.put_nowait(None)
        for i in range(1000):
            queue.put_nowait(output([[i]], [str(i % 10)], finished=i == 999))
        assert queue.qsize() == 2
        assert queue.get_nowait() is None
        merged = queue.get_nowait()
        assert merged.new_tokens == [list(range(1000))]
        assert merged.new_texts == ["".join(str(i % 10) for i in range(1000))]
        assert merged.finished
        error = RuntimeError("failed")
        queue.put_nowait(output([[1]], ["x"]))
        queue.put_nowait(error)  # an error is never merged away
        queue.put_nowait(output([[2]], ["y"]))
        assert [queue.get_nowait() for _ in range(3)][1] is error

    asyncio.run(scenario())


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny")


def test_engine_owner_of_an_engine_is_the_thread_owner(tiny):
    model, tokenizer = tiny
    engine = Engine(model, tokenizer=tokenizer, num_blocks=64, block_size=16)
    owner = EngineOwner(engine)
    assert isinstance(owner, ThreadEngineOwner) and owner.engine is engine


def test_a_paused_reader_gets_every_token_once_in_one_merged_output(tiny):
    """The reader takes the admission, then pauses while the whole answer is generated: the
    stream's queue holds one output, which has every token and all the text."""
    model, tokenizer = tiny
    params = SamplingParams(max_new_tokens=120)
    engine = Engine(model, tokenizer=tokenizer, num_blocks=64, block_size=16)
    reference = Engine(model, tokenizer=tokenizer, num_blocks=64, block_size=16)
    (expected,) = reference.generate(["pause"], params)
    finals = []
    owner = ThreadEngineOwner(
        engine, on_step=lambda e, o: finals.extend(x for x in o if x.finished)
    )

    async def scenario():
        owner.start()
        stream = owner.submit(expected.prompt, params)
        assert await stream.outputs.get() is None
        while not finals:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)  # the last call_soon_threadsafe ran
        assert stream.outputs.qsize() == 1
        merged = stream.outputs.get_nowait()
        await asyncio.to_thread(owner.stop)
        return merged

    merged = asyncio.run(scenario())
    assert merged.finished
    assert merged.new_tokens == expected.outputs == merged.outputs
    assert merged.new_texts == expected.texts == merged.texts
