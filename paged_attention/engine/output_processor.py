"""The way out: what the engine core's requests did in a step becomes
:class:`~paged_attention.engine.request.RequestOutput` objects (text detokenized incrementally,
stop strings, finish reasons), each delivered exactly once to whoever owns its request.

An owner is the :class:`RequestStream` or ``generate`` call that consumes a request's outputs,
held by a weak reference: a stream dropped unfinished no longer consumes its request. Outputs
of a request that wait for delivery are merged into one (their new tokens, text and logprobs
joined; :func:`merge_outputs`), so a consumer that falls behind loses nothing; outputs of
requests nobody owns wait for ``Engine.step()``.
"""

from __future__ import annotations

import copy
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING

from paged_attention.engine.detokenizer import IncrementalDetokenizer, backend_of
from paged_attention.engine.logprobs import output_logprobs
from paged_attention.engine.request import Request, RequestOutput
from paged_attention.engine.request import Sequence as EngineSequence

if TYPE_CHECKING:
    from paged_attention.engine.engine import Engine


def merge_outputs(earlier: RequestOutput, later: RequestOutput, beams: bool) -> RequestOutput:
    """One output standing for two consecutive outputs of the same request: the later state,
    with the new tokens, new text and new logprobs of both, entry by entry (an entry the
    earlier output lacks is a sample forked since: it adds nothing). Beam search reorders its
    entries, so its later output stands alone (a beam reader reads ``outputs``). Neither
    argument is changed."""
    if beams:
        return later
    merged = copy.copy(later)
    merged.new_tokens = [
        (earlier.new_tokens[i] if i < len(earlier.new_tokens) else []) + tokens
        for i, tokens in enumerate(later.new_tokens)
    ]
    if later.new_texts is not None:
        before = earlier.new_texts or []
        merged.new_texts = [
            (before[i] if i < len(before) else "") + text for i, text in enumerate(later.new_texts)
        ]
    if later.new_logprobs is not None:
        before = earlier.new_logprobs or []
        merged.new_logprobs = [
            (before[i] if i < len(before) else []) + entries
            for i, entries in enumerate(later.new_logprobs)
        ]
    return merged


class OutputProcessor:
    """Builds and routes one engine's outputs; ``tokenizer`` (or None: token ids only) gives
    them text and makes ``SamplingParams.stop`` strings apply."""

    def __init__(self, tokenizer=None) -> None:
        self.tokenizer = tokenizer
        self._backend = None if tokenizer is None else backend_of(tokenizer)
        # Outputs not delivered yet, one (merged) per request, in the order they were produced.
        self._undelivered: dict[int, RequestOutput] = {}
        self._owners: dict[int, weakref.ref] = {}

    # ------------------------------------------------------------------ text

    def stop_string_hit(self, request: Request, seq: EngineSequence) -> bool:
        """Detokenize ``seq``'s newest token; whether its text now ends in one of the request's
        stop strings (never before ``min_tokens``). False without a tokenizer."""
        if self._backend is None:
            return False
        text = request.detokenizers.get(seq.seq_id)
        if text is None:
            text = IncrementalDetokenizer(self._backend, request.params.stop)
            request.detokenizers[seq.seq_id] = text
        return text.append(seq.tokens[-1], len(seq.tokens) >= request.params.min_tokens)

    def output(self, request: Request, finished: bool) -> RequestOutput:
        """``request``'s output now: every entry's tokens, this step's new ones, and with a
        tokenizer their text (a sample's text held back while it may still become a stop
        string; a stop string the final text completes ends it as ``"stop"``)."""
        if request.params.is_beam_search:
            entries = request.done if finished else sorted(request.seqs, key=lambda b: -b.score)
        else:
            entries = sorted(request.seqs + request.done, key=lambda s: s.seq_id)  # sample order
        new_tokens = [request.new_tokens.get(s.seq_id, []) for s in entries]
        texts = new_texts = None
        if self._backend is not None:
            texts, new_texts = self._texts(request, entries, new_tokens)
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            outputs=[list(s.tokens) for s in entries],
            finish_reasons=[s.finish_reason for s in entries],
            new_tokens=new_tokens,
            finished=finished,
            metrics=request.metrics,
            texts=texts,
            new_texts=new_texts,
            **output_logprobs(request, entries, new_tokens),
        )

    def _texts(self, request: Request, entries, new_tokens) -> tuple[list[str], list[str]]:
        if request.params.is_beam_search:  # beams reorder: each output has whole texts
            decode = self._backend.decode
            texts = [decode(s.tokens, skip_special_tokens=True) for s in entries]
            return texts, [decode(t, skip_special_tokens=True) for t in new_tokens]
        texts, new_texts = [], []
        for seq in entries:
            text = request.detokenizers.get(seq.seq_id)
            if text is None:  # aborted before its first token
                texts.append("")
                new_texts.append("")
                continue
            stopped = text.stopped
            new_texts.append(text.take_new(final=seq.finish_reason is not None))
            texts.append(text.handed_out)
            if text.stopped and not stopped and seq.finish_reason != "abort":
                seq.finish_reason = "stop"  # the final text completed a stop string
        return texts, new_texts

    def rejection(self, request: Request, reason: str) -> RequestOutput:
        """The final output of a request the scheduler refused."""
        text = None if self._backend is None else []
        return RequestOutput(
            request.request_id,
            request.prompt,
            [],
            [],
            finished=True,
            rejected=reason,
            metrics=request.metrics,
            texts=text,
            new_texts=None if text is None else [],
        )

    # ------------------------------------------------------------------ routing

    def own(self, request_id: int, owner) -> None:
        """``owner`` (a stream or a ``generate`` call) consumes ``request_id``'s outputs."""
        self._owners[request_id] = weakref.ref(owner)

    def owner(self, request_id: int):
        ref = self._owners.get(request_id)
        return None if ref is None else ref()

    def deliver(self, output: RequestOutput, beams: bool) -> None:
        """Queue ``output`` for its consumer, merged with one of its request still waiting."""
        pending = self._undelivered.pop(output.request_id, None)
        self._undelivered[output.request_id] = (
            output if pending is None else merge_outputs(pending, output, beams)
        )

    def deliver_final(self, output: RequestOutput, beams: bool) -> RequestOutput:
        """An aborted request's final ``output``, merged with what it had not delivered yet:
        kept for its owner, if it has one, and returned."""
        pending = self._undelivered.pop(output.request_id, None)
        if pending is not None:
            output = merge_outputs(pending, output, beams)
        if self.owner(output.request_id) is not None:
            self._undelivered[output.request_id] = output
        else:
            self.release(output.request_id)
        return output

    def take(self, request_id: int) -> RequestOutput | None:
        """The output waiting for ``request_id``'s owner, if any (its owner is released with
        the final one)."""
        output = self._undelivered.pop(request_id, None)
        if output is not None and output.finished:
            self.release(request_id)
        return output

    def peek(self, request_id: int) -> RequestOutput | None:
        return self._undelivered.get(request_id)

    def take_unowned(self) -> list[RequestOutput]:
        """The waiting outputs of the requests no stream or ``generate`` call owns."""
        outputs = []
        for request_id in list(self._undelivered):
            if self.owner(request_id) is None:
                outputs.append(self._undelivered.pop(request_id))
                self.release(request_id)
        return outputs

    def take_owned(self) -> list[tuple[object, RequestOutput]]:
        """Every waiting output of an owned request, with its owner, in the order produced
        (owners that route further themselves, as the server does, take them all at once);
        an owner is released with its request's final output."""
        taken = []
        for request_id in list(self._undelivered):
            owner = self.owner(request_id)
            if owner is not None:
                taken.append((owner, self.take(request_id)))
        return taken

    def has_unowned(self) -> bool:
        return any(self.owner(request_id) is None for request_id in self._undelivered)

    def release(self, request_id: int) -> None:
        """``request_id`` has no owner any more."""
        self._owners.pop(request_id, None)

    def discard(self, request_id: int) -> None:
        """Drop what waits for ``request_id`` (its consumer is gone)."""
        self._undelivered.pop(request_id, None)

    def dropped(self) -> Iterator[int]:
        """The requests whose owner was garbage-collected, each released and its waiting
        output dropped as it is yielded."""
        for request_id, ref in list(self._owners.items()):
            if ref() is None:
                self.release(request_id)
                self.discard(request_id)
                yield request_id


class RequestStream:
    """The outputs of one request, as ``Engine.stream`` returns them: iterating drives the
    engine's steps until the request's next output is there. ``close()`` (or leaving a ``with``
    block) aborts the request if it has not finished."""

    def __init__(self, engine: Engine, request_id: int) -> None:
        self._engine = engine
        self.request_id = request_id
        self._done = False

    def __iter__(self) -> RequestStream:
        return self

    def __next__(self) -> RequestOutput:
        engine = self._engine
        while not self._done:
            output = engine.output_processor.take(self.request_id)
            if output is not None:
                self._done = output.finished
                return output
            if self.request_id not in engine.core.requests:
                break  # ended by a path that delivered elsewhere
            engine._run_step()
        self._done = True
        raise StopIteration

    def close(self) -> None:
        if self._done:
            return
        self._done = True
        engine = self._engine
        engine.output_processor.release(self.request_id)
        if self.request_id in engine.core.requests:
            engine.abort(self.request_id)
        engine.output_processor.discard(self.request_id)

    def __enter__(self) -> RequestStream:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
