"""One thread owns the engine: it takes requests and aborts from a queue, steps the engine while
any request is unfinished (every request queued by then shares the step: continuous batching
across HTTP requests), and hands each output to the asyncio queue of the request it belongs to.

The engine is not thread-safe and need not be: only this thread calls it. The HTTP handlers
run on the event loop and meet the owner through :meth:`EngineOwner.submit` (which returns the
request's :class:`RequestStream`) and :meth:`EngineOwner.abort`; outputs cross back with
``loop.call_soon_threadsafe``. The split of vLLM's ``AsyncLLMEngine`` (an engine loop
beside the API server's event loop), in one process.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from paged_attention.engine import RequestOutput, SamplingParams

logger = logging.getLogger("paged_attention.server")


class EngineClosedError(RuntimeError):
    """The owner stopped taking requests (the server is shutting down)."""


class EngineStepError(RuntimeError):
    """A step of the engine raised; the requests of that moment were aborted."""


@dataclass(eq=False)
class RequestStream:
    """The outputs of one request, in the order the engine produced them. The last one is
    finished; an ``EngineStepError`` in their place means the engine failed under it."""

    prompt: list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    # first None (admitted) or the exception that refused it, then RequestOutputs
    outputs: asyncio.Queue = field(default_factory=asyncio.Queue)
    request_id: int | None = None  # set by the owner thread when the engine queued it
    finished: bool = False  # set by the owner thread when it delivered the final output

    def deliver(self, item: RequestOutput | Exception | None) -> None:
        """From the owner thread: hand ``item`` to the event loop."""
        try:
            self.loop.call_soon_threadsafe(self.outputs.put_nowait, item)
        except RuntimeError:  # the loop is closed: nobody is left to read it
            pass


@dataclass
class _Add:
    stream: RequestStream


@dataclass
class _Abort:
    stream: RequestStream


class EngineOwner:
    """Steps ``engine`` in a thread of its own (``start``/``stop``).

    ``on_step(engine, outputs)`` (optional) runs in the owner thread after every step and after
    every abort, with the outputs just delivered: the place to read the engine's state for
    metrics, since no other thread may touch it.
    """

    def __init__(
        self, engine, on_step: Callable[[object, list[RequestOutput]], None] | None = None
    ) -> None:
        self.engine = engine
        self.on_step = on_step
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[int, RequestStream] = {}  # request_id -> its stream, until finished
        self._thread: threading.Thread | None = None
        # Plain attributes, set from other threads (a signal handler among them, where taking
        # a lock could deadlock): time.monotonic() after which every request is aborted, and
        # whether new requests are refused.
        self._abort_deadline: float | None = None
        self._closed = False
        self._stop = False

    # ------------------------------------------------------------------ any thread

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="engine-owner", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def submit(self, prompt: list[int], params: SamplingParams) -> RequestStream:
        """Queue a request; returns its stream at once. The request reaches the engine at the
        owner's next turn; the stream's first item is then None (queued), or the ValueError of
        an engine that refused it (EngineClosedError when the owner stopped first)."""
        if self._closed:
            raise EngineClosedError("the server is shutting down")
        stream = RequestStream(prompt, params, asyncio.get_running_loop())
        self._commands.put(_Add(stream))
        return stream

    def abort(self, stream: RequestStream) -> None:
        """End ``stream``'s request now (at the owner's next turn) and free its blocks; nothing
        more is delivered to it. Harmless when it already finished."""
        self._commands.put(_Abort(stream))

    def drain(self, grace_seconds: float) -> None:
        """Refuse new requests; abort every request still unfinished ``grace_seconds`` from now.
        Safe to call from a signal handler."""
        self._closed = True
        deadline = time.monotonic() + grace_seconds
        if self._abort_deadline is None or deadline < self._abort_deadline:
            self._abort_deadline = deadline
        self._commands.put(None)  # wake the owner (SimpleQueue.put is reentrant)

    def stop(self, timeout: float | None = None) -> None:
        """Abort what is left, stop the thread and wait for it."""
        self._closed = True
        self._abort_deadline = time.monotonic()
        self._stop = True
        self._commands.put(None)
        if self._thread is not None:
            self._thread.join(timeout)

    # ------------------------------------------------------------------ the owner thread

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as error:  # a bug: fail every waiting handler rather than hang it
            logger.exception("the engine owner thread failed")
            self._closed = True
            failure = EngineStepError(f"the engine owner failed: {error!r}")
            for stream in self._streams.values():
                stream.deliver(failure)
            self._streams.clear()
            while True:  # requests queued meanwhile were never admitted
                try:
                    command = self._commands.get_nowait()
                except queue.Empty:
                    break
                if isinstance(command, _Add):
                    command.stream.deliver(failure)
            raise

    def _loop(self) -> None:
        engine = self.engine
        self._notify([])  # the metrics' first snapshot
        while True:
            busy = engine.has_unfinished()
            wait = None
            if busy:
                wait = 0.0
            elif self._stop:
                break
            self._take_commands(wait)
            if self._abort_deadline is not None and time.monotonic() >= self._abort_deadline:
                self._abort_all()
            if self._stop and not engine.has_unfinished():
                break
            if not engine.has_unfinished():
                continue
            try:
                outputs = engine.step()
            except Exception as error:  # the engine rolled the step back; end its requests
                logger.exception("an engine step failed; aborting the requests in flight")
                self._abort_all(EngineStepError(f"the engine failed: {error!r}"))
                continue
            self._deliver(outputs)
        # Requests queued after the last turn never reach the engine.
        self._take_commands(0.0)
        self._notify([])

    def _take_commands(self, wait: float | None) -> None:
        """Carry out every queued command; with ``wait`` None block until one arrives."""
        try:
            command = self._commands.get(timeout=wait) if wait != 0.0 else None
        except queue.Empty:
            command = None
        while True:
            if command is not None:
                self._carry_out(command)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return

    def _carry_out(self, command: _Add | _Abort) -> None:
        stream = command.stream
        if isinstance(command, _Add):
            if self._closed:
                stream.deliver(EngineClosedError("the server is shutting down"))
                return
            try:
                stream.request_id = self.engine.add_request(stream.prompt, stream.params)
            except ValueError as error:  # a request the engine can never serve
                stream.deliver(error)
                return
            except Exception as error:
                logger.exception("the engine failed to queue a request")
                stream.deliver(EngineStepError(f"the engine failed: {error!r}"))
                return
            self._streams[stream.request_id] = stream
            stream.deliver(None)  # admitted
            return
        if stream.request_id is None or stream.finished:  # refused, or ended meanwhile
            return
        self._streams.pop(stream.request_id, None)
        stream.finished = True
        output = self.engine.abort(stream.request_id)
        self._notify([output])

    def _abort_all(self, error: EngineStepError | None = None) -> None:
        outputs = []
        for request_id, stream in list(self._streams.items()):
            outputs.append(self.engine.abort(request_id))
            del self._streams[request_id]
            stream.finished = True
            stream.deliver(error or outputs[-1])
        self._notify(outputs)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue
            if output.finished:
                del self._streams[output.request_id]
                stream.finished = True
            stream.deliver(output)
        self._notify(outputs)

    def _notify(self, outputs: list[RequestOutput]) -> None:
        if self.on_step is not None:
            self.on_step(self.engine, outputs)
