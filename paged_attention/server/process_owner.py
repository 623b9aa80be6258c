"""The owner of an engine in a process of its own (the server's side of
:mod:`~paged_attention.server.engine_process`, whose module docstring describes both):
:class:`ProcessEngineOwner` forwards the handlers' commands to the child and turns each turn's
compact deltas back into whole outputs (:class:`OutputAssembler`).

Apart from :mod:`~paged_attention.server.engine_process`, whose launcher needs neither the
engine's modules nor torch (a spawned child imports only what its ``build()`` needs).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
from collections.abc import Callable

from paged_attention.engine import RequestOutput, SamplingParams
from paged_attention.engine.request import RequestError
from paged_attention.server.engine_owner import (
    EngineClosedError,
    EngineOwner,
    EngineStepError,
    ServerStream,
)
from paged_attention.server.engine_process import EngineProcess
from paged_attention.server.engine_worker import STOPPED, Delivery, Turn

logger = logging.getLogger("paged_attention.server")


class OutputAssembler:
    """Rebuilds whole outputs from the engine process's deltas: per request, the tokens, text
    and token times so far. Each output it returns has lists of its own (a snapshot), as an
    engine's outputs do."""

    def __init__(self) -> None:
        self._progress: dict[int, RequestOutput] = {}  # key -> the last whole output

    def admit(self, key: int, prompt: list[int]) -> None:
        self._progress[key] = RequestOutput(-1, prompt, [], [], texts=None)

    def assemble(self, delivery: Delivery) -> RequestOutput:
        output = delivery.output
        last = self._progress.get(delivery.key) or RequestOutput(-1, [], [], [])
        output.prompt = last.prompt
        if not delivery.whole:
            output.outputs = [a + n for a, n in zip(last.outputs, output.new_tokens)]
            if output.new_texts is not None:
                output.texts = [a + n for a, n in zip(last.texts or (), output.new_texts)]
            if output.new_logprobs is not None and last.logprobs is not None:
                output.logprobs = [a + n for a, n in zip(last.logprobs, output.new_logprobs)]
            if output.metrics is not None and last.metrics is not None:
                output.metrics.token_times = last.metrics.token_times + output.metrics.token_times
        if output.finished:
            self._progress.pop(delivery.key, None)
        else:
            self._progress[delivery.key] = output
        return output


class ProcessEngineOwner(EngineOwner):
    """The owner of an engine in its own process (see the module docstring): the stream of
    a request submitted here is keyed by ``request_id``, the owner's own number for it."""

    def __init__(
        self,
        engine: EngineProcess,
        on_step: Callable[[object, list[RequestOutput]], None] | None = None,
    ) -> None:
        self.engine = engine
        self.on_step = on_step
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._keys = itertools.count()
        self._lock = threading.Lock()  # guards _streams and _ended
        self._streams: dict[int, ServerStream] = {}  # key -> its stream, until it ends
        self._admitted: set[int] = set()  # receiver thread only
        self._assembler = OutputAssembler()  # receiver thread only
        self._ended = False  # the receiver ended: the engine's process is gone
        # set from other threads, a signal handler among them
        self._closed = False
        self._stopping = False
        self._sender: threading.Thread | None = None
        self._receiver: threading.Thread | None = None

    # ------------------------------------------------------------------ any thread

    def start(self) -> None:
        self._notify([])  # the metrics' first snapshot
        self._sender = threading.Thread(target=self._send, name="engine-sender", daemon=True)
        self._receiver = threading.Thread(target=self._receive, name="engine-receiver", daemon=True)
        self._sender.start()
        self._receiver.start()

    @property
    def alive(self) -> bool:
        receiving = self._receiver is not None and self._receiver.is_alive()
        return receiving and self.engine.alive

    def submit(self, prompt: list[int], params: SamplingParams) -> ServerStream:
        if self._closed:
            raise EngineClosedError("the server is shutting down")
        stream = ServerStream(prompt, params, asyncio.get_running_loop())
        stream.request_id = next(self._keys)
        with self._lock:
            if self._ended:
                raise EngineClosedError(
                    f"the engine's process is not running (exit status {self.engine.exitcode})"
                )
            self._streams[stream.request_id] = stream
        self._commands.put(("add", stream.request_id, prompt, params))
        return stream

    def abort(self, stream: ServerStream) -> None:
        if stream.finished:
            return
        with self._lock:
            ours = self._streams.pop(stream.request_id, None) is stream
        stream.finished = True
        if ours:
            self._commands.put(("abort", stream.request_id))

    def drain(self, grace_seconds: float) -> None:
        self._closed = True
        self._commands.put(("drain", grace_seconds))  # SimpleQueue.put is reentrant

    def stop(self, timeout: float | None = None) -> None:
        """Abort what is left, stop the engine's process and the owner's threads."""
        self._closed = self._stopping = True
        self._commands.put(("stop",))
        if self._receiver is not None:
            self._receiver.join(timeout)
        self._commands.put(None)  # ends the sender
        if self._sender is not None:
            self._sender.join(timeout)
        self.engine.close()

    # ------------------------------------------------------------------ the owner's threads

    def _send(self) -> None:
        while (command := self._commands.get()) is not None:
            try:
                self.engine.commands.send(command)
            except (OSError, ValueError):  # the child is gone: the receiver fails the streams
                return

    def _receive(self) -> None:
        try:
            while (message := self.engine.results.recv()) != STOPPED:
                self._take(message)
        except (EOFError, OSError):  # the child died, or stop() closed the pipe
            logger.debug("the engine's process closed its pipe")
        except BaseException:  # a bug: fail every waiting handler rather than hang it
            logger.exception("the engine owner's receiver failed")
        finally:
            self._end_streams()

    def _take(self, turn: Turn) -> None:
        outputs, deliveries = [], []
        with self._lock:
            for event in turn.events:
                if isinstance(event, Delivery):
                    output = self._assembler.assemble(event)
                    outputs.append(output)
                    stream = self._streams.get(event.key) if event.to_stream else None
                    if stream is not None:
                        deliveries.append((stream, output))
                    if output.finished:
                        self._end(event.key)
                    continue
                stream = self._streams.get(event[1])
                if event[0] == "admitted":
                    self._admitted.add(event[1])
                    self._assembler.admit(event[1], stream.prompt if stream else [])
                    item = None
                else:
                    item = _refusal(event)
                    self._end(event[1])
                if stream is not None:
                    deliveries.append((stream, item))
        _deliver_all(deliveries)
        self.engine.update(turn.state)
        self._notify(outputs)

    def _end(self, key: int) -> None:
        stream = self._streams.pop(key, None)
        if stream is not None:
            stream.finished = True
        self._admitted.discard(key)

    def _end_streams(self) -> None:
        """The engine's process is gone: end every stream still open."""
        self.engine.process.join(5)
        status = self.engine.exitcode
        with self._lock:
            self._ended = True
            streams, self._streams = self._streams, {}
        if streams and not self._stopping:
            logger.error(
                "the engine's process died (exit status %s): failing %d open requests",
                status,
                len(streams),
            )
        deliveries = []
        for key, stream in streams.items():
            stream.finished = True
            if self._stopping and key not in self._admitted:
                deliveries.append((stream, EngineClosedError("the server is shutting down")))
            else:
                message = f"the engine's process died (exit status {status})"
                deliveries.append((stream, EngineStepError(message)))
        _deliver_all(deliveries)

    def _notify(self, outputs: list[RequestOutput]) -> None:
        if self.on_step is not None:
            try:
                self.on_step(self.engine, outputs)
            except Exception:  # metrics must not stop the deliveries
                logger.exception("on_step failed")


def _refusal(event: tuple) -> Exception:
    kind, key = event[0], event[1]
    if kind == "closed":
        return EngineClosedError("the server is shutting down")
    if kind == "failed":
        return EngineStepError(event[2])
    if kind == "refused":
        refusal = event[2]
        if refusal.argument is None:
            return ValueError(refusal.message)
        return RequestError(refusal.message, refusal.argument, refusal.limit)
    raise ValueError(f"unknown engine event {kind!r} for request {key}")


def _deliver_all(deliveries: list[tuple[ServerStream, object]]) -> None:
    """Hand each item to its stream's event loop: one wake-up per loop, in order."""
    by_loop: dict[asyncio.AbstractEventLoop, list] = {}
    for stream, item in deliveries:
        by_loop.setdefault(stream.loop, []).append((stream.outputs, item))
    for loop, items in by_loop.items():
        try:
            loop.call_soon_threadsafe(_put_all, items)
        except RuntimeError:  # the loop is closed: nobody is left to read them
            pass


def _put_all(items: list) -> None:
    for outputs, item in items:
        outputs.put_nowait(item)


__all__ = ["OutputAssembler", "ProcessEngineOwner"]
