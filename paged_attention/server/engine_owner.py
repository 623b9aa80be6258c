"""Who steps the engine: one owner takes requests and aborts from the HTTP handlers, steps the
engine while any request is unfinished (every request queued by then shares the step:
continuous batching across HTTP requests), and hands each output to the asyncio queue of the
request it belongs to.

``EngineOwner(engine, on_step)`` picks where the engine runs:

* an :class:`~paged_attention.engine.Engine` object: in a thread of this process
  (:class:`ThreadEngineOwner`), the split of vLLM's ``AsyncLLMEngine``. Simple, and what tests
  that patch the engine use; but the engine's Python and torch's intra-op threads then share
  the interpreter and the cores with the event loop, which costs a single request about half
  of the engine's offline speed on a 2-core machine (docs/performance.md);
* an :class:`~paged_attention.server.engine_process.EngineProcess`: in a process of its own
  (:class:`~paged_attention.server.process_owner.ProcessEngineOwner`), as vLLM's EngineCore
  runs. ``paged-attention serve`` does this.

Either way the engine's :class:`~paged_attention.engine.output_processor.OutputProcessor` routes
each output to its request's owner: in a thread, the request's :class:`ServerStream` owns it
there; in the engine's process, the worker's key for it does (the server's side then only maps
the pipe's keys back to streams). The HTTP handlers run on the event loop and meet the owner
through :meth:`EngineOwner.submit` (which returns the request's :class:`ServerStream`) and
:meth:`EngineOwner.abort`. A stream's outputs that its reader has not taken yet are merged
into one (:class:`OutputQueue`), so a slow reader holds at most one pending output per request
however far it falls behind.
"""

from __future__ import annotations

import abc
import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from paged_attention.engine import RequestOutput, SamplingParams
from paged_attention.engine.output_processor import merge_outputs

logger = logging.getLogger("paged_attention.server")


class EngineClosedError(RuntimeError):
    """The owner stopped taking requests (the server is shutting down)."""


class EngineStepError(RuntimeError):
    """A step of the engine raised (the requests of that moment were aborted), or the engine's
    process died."""


class OutputQueue(asyncio.Queue):
    """A stream's queue whose pending outputs merge: an output put behind another output of
    the same request joins it (:func:`merge_outputs`), so the queue holds at most one output
    (plus the admission marker or an error) however slowly it is read, and what the reader
    gets adds up to the same tokens and text."""

    def __init__(self, beams: bool = False) -> None:
        super().__init__()
        self.beams = beams

    def _put(self, item) -> None:
        pending = self._queue  # asyncio.Queue's deque (its _put/_get are the subclass hooks)
        if isinstance(item, RequestOutput) and pending and isinstance(pending[-1], RequestOutput):
            pending[-1] = merge_outputs(pending[-1], item, self.beams)
        else:
            super()._put(item)


@dataclass(eq=False)
class ServerStream:
    """The outputs of one request, in the order the engine produced them. The last one is
    finished; an ``EngineStepError`` in their place means the engine failed under it."""

    prompt: list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    # first None (admitted) or the exception that refused it, then RequestOutputs (merged
    # while unread)
    outputs: OutputQueue = field(init=False)
    request_id: int | None = None  # set by the owner when the engine queued it
    finished: bool = False  # set by the owner when it delivered the final output

    def __post_init__(self) -> None:
        self.outputs = OutputQueue(beams=self.params.is_beam_search)

    def deliver(self, item: RequestOutput | Exception | None) -> None:
        """From the owner's thread: hand ``item`` to the event loop."""
        try:
            self.loop.call_soon_threadsafe(self.outputs.put_nowait, item)
        except RuntimeError:  # the loop is closed: nobody is left to read it
            pass


class EngineOwner(abc.ABC):
    """Steps an engine for the event loop's handlers (``start``/``stop``);
    ``EngineOwner(engine, on_step)`` builds the owner that fits ``engine`` (module docstring).

    ``on_step(engine, outputs)`` (optional) runs in the owner's thread after every step and
    after every abort, with the outputs just produced: the place to read the engine's state
    for metrics (for an engine in its own process, ``engine`` is the
    :class:`~paged_attention.server.engine_process.EngineProcess`, which mirrors the state the
    metrics read).
    """

    def __new__(cls, engine=None, on_step=None):
        if cls is EngineOwner:
            from paged_attention.server.engine_process import EngineProcess
            from paged_attention.server.process_owner import ProcessEngineOwner

            cls = ProcessEngineOwner if isinstance(engine, EngineProcess) else ThreadEngineOwner
        return super().__new__(cls)

    @property
    @abc.abstractmethod
    def alive(self) -> bool:
        """Whether the engine is being stepped (the server's /health)."""

    @abc.abstractmethod
    def start(self) -> None:
        """Start stepping (the server's startup)."""

    @abc.abstractmethod
    def submit(self, prompt: list[int], params: SamplingParams) -> ServerStream:
        """Queue a request; returns its stream at once. The stream's first item is None once
        the engine queued the request, or the ValueError of an engine that refused it
        (EngineClosedError when the owner stopped first). Raises EngineClosedError when the
        owner takes no more requests."""

    @abc.abstractmethod
    def abort(self, stream: ServerStream) -> None:
        """End ``stream``'s request now (at the owner's next turn) and free its blocks; what it
        produces from then on (its final, aborted output included) is not delivered to it, though
        outputs already on their way may still arrive. Harmless when it already finished."""

    @abc.abstractmethod
    def drain(self, grace_seconds: float) -> None:
        """Refuse new requests; abort every request still unfinished ``grace_seconds`` from now.
        Safe to call from a signal handler."""

    @abc.abstractmethod
    def stop(self, timeout: float | None = None) -> None:
        """Abort what is left, stop stepping and wait for it."""


@dataclass
class _Add:
    stream: ServerStream


@dataclass
class _Abort:
    stream: ServerStream


class ThreadEngineOwner(EngineOwner):
    """Steps ``engine`` (an :class:`~paged_attention.engine.Engine`) in a thread of this
    process. The engine is not thread-safe and need not be: only this thread calls it; outputs
    cross back to the event loop with ``loop.call_soon_threadsafe``."""

    def __init__(
        self, engine, on_step: Callable[[object, list[RequestOutput]], None] | None = None
    ) -> None:
        self.engine = engine
        self.on_step = on_step
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        # The streams whose requests are in the engine, until finished: the engine's output
        # processor routes their outputs (each stream owns its request there); this is what
        # an abort of them all, or a failure, reaches.
        self._streams: dict[int, ServerStream] = {}
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

    def submit(self, prompt: list[int], params: SamplingParams) -> ServerStream:
        """Queue a request; returns its stream at once. The request reaches the engine at the
        owner's next turn; the stream's first item is then None (queued), or the ValueError of
        an engine that refused it (EngineClosedError when the owner stopped first)."""
        if self._closed:
            raise EngineClosedError("the server is shutting down")
        stream = ServerStream(prompt, params, asyncio.get_running_loop())
        self._commands.put(_Add(stream))
        return stream

    def abort(self, stream: ServerStream) -> None:
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
            self.engine.output_processor.own(stream.request_id, stream)
            stream.deliver(None)  # admitted
            return
        if stream.request_id is None or stream.finished:  # refused, or ended meanwhile
            return
        self._notify([self._end(stream.request_id)])

    def _end(self, request_id: int) -> RequestOutput:
        """Abort ``request_id`` without delivering its final output to its stream."""
        stream = self._streams.pop(request_id)
        stream.finished = True
        self.engine.output_processor.release(request_id)
        output = self.engine.abort(request_id)
        self.engine.output_processor.discard(request_id)
        return output

    def _abort_all(self, error: EngineStepError | None = None) -> None:
        outputs = []
        for request_id, stream in list(self._streams.items()):
            outputs.append(self._end(request_id))
            stream.deliver(error or outputs[-1])
        self._notify(outputs)

    def _deliver(self, unowned: list[RequestOutput]) -> None:
        """Hand the step's outputs to their streams, as the engine's output processor routed
        them (``unowned``: outputs of requests queued around the owner, for the metrics)."""
        outputs = list(unowned)
        for stream, output in self.engine.output_processor.take_owned():
            if output.finished:
                del self._streams[output.request_id]
                stream.finished = True
            stream.deliver(output)
            outputs.append(output)
        self._notify(outputs)

    def _notify(self, outputs: list[RequestOutput]) -> None:
        if self.on_step is not None:
            self.on_step(self.engine, outputs)
