"""The engine's own process (the child side of
:mod:`~paged_attention.server.engine_process`): it builds the engine from a picklable
``build()`` (:class:`~paged_attention.server.engine_process.EngineSpec`), then steps it,
reading commands from one pipe and writing what each turn produced to another.

Commands (tuples, from the server's process): ``("add", key, prompt, params)``,
``("abort", key)``, ``("drain", grace_seconds)``, ``("stop",)``. The server names each
request by its own ``key``, so an abort can follow an add without waiting for an answer.

Answers: first :class:`Ready` (the engine's sizes, its state and the tokenizer the server
tokenizes with) or :class:`Failed`; then one :class:`Turn` per turn that produced something
(admissions, refusals, outputs, the engine's state after the step), in the order produced;
:data:`STOPPED` last. A turn's outputs are compact: a request's output carries the tokens and
text added since its previous output (:class:`DeltaEncoder`), never its whole text again, so
what crosses the pipe per step does not grow with the length of the answers.

The process ignores SIGINT and SIGTERM: a Ctrl-C in a terminal reaches every process of the
group, and the server's process decides how its requests end (the graceful shutdown). It ends
on ``stop``, or when the server's process is gone (its pipe closes).
"""

from __future__ import annotations

import contextlib
import copy
import logging
import signal
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported by the engine's process only, by building the engine
    from paged_attention.engine import RequestOutput

logger = logging.getLogger("paged_attention.server")


@dataclass
class Ready:
    """The engine is built: its fixed sizes (what ``create_app`` reads), its state, and the
    tokenizer."""

    sizes: dict
    state: dict
    tokenizer: object


@dataclass
class Failed:
    """The engine could not be built. ``usage``: a bad argument (the command's usage error),
    else a failure with its traceback logged by the engine's process."""

    message: str
    usage: bool


@dataclass
class Refusal:
    """An engine's ValueError refusing a request, as data (a ``RequestError`` does not
    survive pickling: its constructor takes more than its message)."""

    message: str
    argument: str | None
    limit: str | None


@dataclass
class Delivery:
    """One output of the request ``key``. ``whole``: ``output`` holds the request's whole state
    (``outputs`` and ``texts``), else only what was added since the previous delivery (its
    ``outputs``/``texts`` are None, its ``metrics.token_times`` the new times). ``to_stream``:
    False for the final output of a request the server aborted (only its metrics read it)."""

    key: int
    output: RequestOutput
    whole: bool
    to_stream: bool = True


@dataclass
class Turn:
    """What one turn produced: ``("admitted", key)``, ``("refused", key, Refusal)``,
    ``("closed", key)`` (refused because the engine is shutting down), ``("failed", key,
    message)`` (its step raised), :class:`Delivery`; and the engine's state after it."""

    events: list = field(default_factory=list)
    state: dict | None = None


STOPPED = "stopped"


@dataclass(eq=False)
class _Key:
    """What owns a request of the server's key ``key`` in the engine's output processor."""

    key: int


def engine_state(engine) -> dict:
    """The engine's state that the server's metrics read, small and picklable: request counts,
    free device blocks, and the scalar counters of ``engine.stats``."""
    scheduler = engine.scheduler
    stats = {k: v for k, v in vars(engine.stats).items() if isinstance(v, (int, float))}
    return {
        "running": len(scheduler.running),
        "waiting": len(scheduler.waiting),
        "swapped": len(scheduler.swapped),
        "free_blocks": engine.block_manager.num_free_device_blocks(),
        "stats": stats,
    }


def engine_sizes(engine) -> dict:
    return {
        "max_num_seqs": engine.max_num_seqs,
        "max_model_len": engine.max_model_len,
        "block_size": engine.block_size,
        "num_device_blocks": engine.block_manager.num_device_blocks,
    }


class DeltaEncoder:
    """Turns a request's successive outputs into deltas. It keeps, per request, the lengths of
    the tokens and text already delivered per entry; an output whose entries grew by exactly
    its ``new_tokens``/``new_texts`` is sent as those alone, any other (the first one, beam
    search, an entry count that changed) whole."""

    def __init__(self) -> None:
        self._sent: dict[int, tuple[list[int], list[int] | None, int]] = {}

    def encode(self, key: int, output: RequestOutput, to_stream: bool = True) -> Delivery:
        sent = self._sent.pop(key, None) if output.finished else self._sent.get(key)
        token_lengths = [len(tokens) for tokens in output.outputs]
        text_lengths = None if output.texts is None else [len(text) for text in output.texts]
        times = output.metrics.token_times if output.metrics is not None else []
        if not output.finished:
            self._sent[key] = (token_lengths, text_lengths, len(times))
        delta = copy.copy(output)
        delta.prompt = []  # the server knows it
        whole = sent is None or not self._extends(sent, output, token_lengths, text_lengths)
        if output.metrics is not None:
            delta.metrics = copy.copy(output.metrics)
            delta.metrics.token_times = times[0 if whole else sent[2] :]
        if not whole:
            delta.outputs = None
            delta.texts = None
            delta.logprobs = None  # the server joins new_logprobs onto what it has
        return Delivery(key, delta, whole, to_stream)

    @staticmethod
    def _extends(sent, output: RequestOutput, token_lengths, text_lengths) -> bool:
        before_tokens, before_texts, _ = sent
        if len(before_tokens) != len(token_lengths) or len(output.new_tokens) != len(token_lengths):
            return False
        if any(b + len(n) != a for b, n, a in zip(before_tokens, output.new_tokens, token_lengths)):
            return False
        if text_lengths is None or before_texts is None:
            return text_lengths is None and before_texts is None
        new_texts = output.new_texts or []
        if len(new_texts) != len(text_lengths):
            return False
        return all(b + len(n) == a for b, n, a in zip(before_texts, new_texts, text_lengths))


class EngineLoop:
    """Steps the engine while any request is unfinished, carrying out the server's commands
    between steps; sends one :class:`Turn` per turn."""

    def __init__(self, engine, commands, results) -> None:
        self.engine = engine
        self.commands = commands  # multiprocessing Connection, read end
        self.results = results  # write end
        self.encoder = DeltaEncoder()
        # key -> engine request id, until finished (the engine's output processor routes each
        # request's outputs to its key's owner, a _Key)
        self.request_ids: dict[int, int] = {}
        self.owners: dict[int, _Key] = {}  # key -> what owns its request in the engine
        self.turn = Turn()
        self.closed = False  # new requests are refused
        self.stopping = False
        self.abort_deadline: float | None = None  # time.monotonic()

    def run(self) -> None:
        engine = self.engine
        while True:
            busy = engine.has_unfinished()
            if self.stopping and not busy:
                break
            if not self._take_commands(0.0 if busy else None):
                return  # the server's process is gone: nobody to answer
            if self.abort_deadline is not None and time.monotonic() >= self.abort_deadline:
                self._abort_all()
            stepped = engine.has_unfinished()
            if stepped:
                self._step()
            self._send_turn(stepped)
        self._send_turn(False)
        self.results.send(STOPPED)

    def _take_commands(self, timeout: float | None) -> bool:
        """Carry out every command waiting (with ``timeout`` None, first wait for one);
        False when the server's process closed the pipe."""
        try:
            if timeout is not None and not self.commands.poll(timeout):
                return True
            while True:
                self._carry_out(self.commands.recv())
                if not self.commands.poll(0):
                    return True
        except (EOFError, OSError):
            return False

    def _carry_out(self, command: tuple) -> None:
        kind = command[0]
        if kind == "add":
            self._add(*command[1:])
        elif kind == "abort":
            if command[1] in self.request_ids:  # else finished, refused, or never queued
                output = self._end(command[1])
                self.turn.events.append(self.encoder.encode(command[1], output, to_stream=False))
        elif kind == "drain":
            self.closed = True
            deadline = time.monotonic() + command[1]
            if self.abort_deadline is None or deadline < self.abort_deadline:
                self.abort_deadline = deadline
        elif kind == "stop":
            self.closed = self.stopping = True
            self.abort_deadline = time.monotonic()
        else:
            raise ValueError(f"unknown engine command {kind!r}")

    def _add(self, key: int, prompt, params) -> None:
        if self.closed:
            self.turn.events.append(("closed", key))
            return
        try:
            request_id = self.engine.add_request(prompt, params)
        except ValueError as error:  # a request the engine can never serve
            refusal = Refusal(
                str(error), getattr(error, "argument", None), getattr(error, "limit", None)
            )
            self.turn.events.append(("refused", key, refusal))
            return
        except Exception as error:
            logger.exception("the engine failed to queue a request")
            self.turn.events.append(("failed", key, f"the engine failed: {error}"))
            return
        self.request_ids[key] = request_id
        self.owners[key] = _Key(key)
        self.engine.output_processor.own(request_id, self.owners[key])
        self.turn.events.append(("admitted", key))

    def _end(self, key: int) -> RequestOutput:
        """Abort ``key``'s request; its final output is returned, not routed."""
        request_id = self.request_ids.pop(key)
        del self.owners[key]
        self.engine.output_processor.release(request_id)
        output = self.engine.abort(request_id)
        self.engine.output_processor.discard(request_id)
        return output

    def _step(self) -> None:
        try:
            self.engine.step()  # every request here is owned: nothing comes back unowned
        except Exception as error:  # the engine rolled the step back; end its requests
            logger.exception("an engine step failed; aborting the requests in flight")
            self._abort_all(f"the engine failed: {error}")
            return
        for owner, output in self.engine.output_processor.take_owned():
            if output.finished:
                del self.request_ids[owner.key]
                del self.owners[owner.key]
            self.turn.events.append(self.encoder.encode(owner.key, output))

    def _abort_all(self, failure: str | None = None) -> None:
        """End every request; their streams get the final output, or ``failure``."""
        for key in list(self.request_ids):
            output = self._end(key)
            if failure is not None:  # first: the stream ends with it, the output is for metrics
                self.turn.events.append(("failed", key, failure))
            delivery = self.encoder.encode(key, output, to_stream=failure is None)
            self.turn.events.append(delivery)

    def _send_turn(self, stepped: bool) -> None:
        """Send what this turn produced, with the engine's state after it (a step that
        produced no output still changed the state the metrics show)."""
        if not self.turn.events and not stepped:
            return
        self.turn.state = engine_state(self.engine)
        self.results.send(self.turn)
        self.turn = Turn()


def main(spec, commands, results, parent_ends=()) -> None:
    """The engine process: build the engine from ``spec``, answer :class:`Ready`, then run
    the loop until ``stop`` or until the server's process is gone. ``parent_ends``: the
    server's ends of the pipes, which a forked child inherits and closes."""
    for connection in parent_ends:
        connection.close()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    from paged_attention.errors import UsageError

    try:
        engine, tokenizer = spec.build()
    except UsageError as error:
        results.send(Failed(str(error), usage=True))
        return
    except Exception as error:
        logger.exception("the engine could not be built")
        results.send(Failed(f"{type(error).__name__}: {error}", usage=False))
        return
    results.send(Ready(engine_sizes(engine), engine_state(engine), tokenizer))
    # a broken pipe means the server's process is gone: nobody is left to answer
    with contextlib.suppress(BrokenPipeError, EOFError):
        EngineLoop(engine, commands, results).run()
