"""The output processor on its own, without a model: outputs built from requests (text, stop
strings, finish reasons), routed to owners, merged while waiting, each delivered once."""

import gc

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from paged_attention.engine.output_processor import OutputProcessor  # noqa: E402
from paged_attention.engine.request import (  # noqa: E402
    Request,
    RequestMetrics,
    RequestOutput,
    SamplingParams,
    Sequence,
)
from tests.text_tokenizer import byte_level_test_tokenizer  # noqa: E402


def request(request_id=0, params=None, seqs=None) -> Request:
    return Request(
        request_id,
        [5, 6, 7],
        params or SamplingParams(max_new_tokens=8),
        torch.Generator(),
        RequestMetrics(0.0),
        seqs=seqs if seqs is not None else [Sequence(0)],
    )


def output(request_id, new, finished=False) -> RequestOutput:
    return RequestOutput(request_id, [1], [list(new)], [None], [list(new)], finished=finished)


class Owner:
    pass


def test_outputs_wait_merged_for_their_owner_and_unowned_ones_go_to_step():
    processor = OutputProcessor()
    owner = Owner()
    processor.own(0, owner)
    processor.deliver(output(0, [1]), beams=False)
    processor.deliver(output(0, [2]), beams=False)
    processor.deliver(output(1, [9]), beams=False)
    (unowned,) = processor.take_unowned()
    assert unowned.request_id == 1
    assert processor.take_unowned() == []
    assert not processor.has_unowned()
    merged = processor.take(0)
    assert merged.new_tokens == [[1, 2]]  # both waiting outputs' new tokens, once
    assert processor.take(0) is None
    processor.deliver(output(0, [3], finished=True), beams=False)
    ((taken_by, final),) = processor.take_owned()
    assert taken_by is owner and final.finished and final.new_tokens == [[3]]
    assert processor.owner(0) is None  # released with its final output


def test_take_owned_hands_each_owned_output_once_with_its_owner():
    processor = OutputProcessor()
    first, second = Owner(), Owner()
    processor.own(0, first)
    processor.own(1, second)
    processor.deliver(output(0, [1]), beams=False)
    processor.deliver(output(1, [2], finished=True), beams=False)
    processor.deliver(output(2, [3]), beams=False)  # nobody owns it
    taken = processor.take_owned()
    assert [(owner, o.request_id, o.new_tokens) for owner, o in taken] == [
        (first, 0, [[1]]),
        (second, 1, [[2]]),
    ]
    assert processor.owner(0) is first and processor.owner(1) is None
    assert processor.take_owned() == []
    assert [o.request_id for o in processor.take_unowned()] == [2]


def test_a_dropped_owner_is_reported_once_and_its_outputs_dropped():
    processor = OutputProcessor()
    owner = Owner()
    processor.own(4, owner)
    processor.deliver(output(4, [1]), beams=False)
    del owner
    gc.collect()
    assert list(processor.dropped()) == [4]
    assert list(processor.dropped()) == []
    assert processor.take_unowned() == []  # its output went with it, not to step()


def test_a_final_output_joins_what_was_not_delivered_and_stays_for_its_owner():
    processor = OutputProcessor()
    owner = Owner()
    processor.own(0, owner)
    processor.deliver(output(0, [1]), beams=False)
    final = processor.deliver_final(output(0, [2], finished=True), beams=False)
    assert final.new_tokens == [[1, 2]]
    assert processor.take(0) is final  # the stream ends with it
    loose = processor.deliver_final(output(1, [3], finished=True), beams=False)
    assert loose.new_tokens == [[3]] and processor.take_unowned() == []  # the caller's alone


def test_text_stop_strings_and_the_final_text():
    tokenizer = byte_level_test_tokenizer()
    processor = OutputProcessor(tokenizer)
    ids = tokenizer("hello wörld", add_special_tokens=False)["input_ids"]
    params = SamplingParams(max_new_tokens=32, stop=["wörld"])
    req = request(params=params)
    seq = req.seqs[0]
    hits = []
    for token in ids:
        seq.tokens.append(token)
        hits.append(processor.stop_string_hit(req, seq))
    assert hits[-1] and not any(hits[:-1])  # the stop string completes at the last token
    seq.finish_reason = "stop"
    req.new_tokens = {seq.seq_id: list(ids)}
    out = processor.output(req, finished=False)
    assert out.texts == ["hello "] and out.new_texts == ["hello "]  # the stop string is cut
    assert out.outputs == [ids] and out.finish_reasons == ["stop"]


def test_without_a_tokenizer_there_is_no_text():
    processor = OutputProcessor()
    req = request()
    req.seqs[0].tokens.append(9)
    assert not processor.stop_string_hit(req, req.seqs[0])
    out = processor.output(req, finished=False)
    assert out.texts is None and out.outputs == [[9]]
    rejected = processor.rejection(req, "too long")
    assert rejected.finished and rejected.rejected == "too long" and rejected.texts is None


def test_beams_are_reported_best_first_and_their_outputs_stand_alone():
    processor = OutputProcessor()
    params = SamplingParams(max_new_tokens=4, beam_width=2)
    beams = [Sequence(0, [1], score=-2.0), Sequence(1, [2], score=-1.0)]
    req = request(params=params, seqs=beams)
    out = processor.output(req, finished=False)
    assert out.outputs == [[2], [1]]
    owner = Owner()
    processor.own(0, owner)
    processor.deliver(out, beams=True)
    later = processor.output(req, finished=False)
    processor.deliver(later, beams=True)
    assert processor.take(0) is later
