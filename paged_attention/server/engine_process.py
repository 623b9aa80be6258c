"""The engine in a process of its own, behind two pipes (the server's side; the engine's side
is :mod:`~paged_attention.server.engine_worker`). ``paged-attention serve`` runs its engine
this way, as vLLM runs its EngineCore: the engine's Python and torch's intra-op threads then
have the cores to themselves, instead of sharing one interpreter with the event loop, which
halved a single request's tokens/s (docs/performance.md, "The server's engine process").

* :class:`EngineSpec` / :class:`ServeSpec`: how the engine is built, as picklable arguments
  (the model's name and the engine's options; or ``serve``'s parsed arguments), since the
  engine is built in the child;
* :class:`EngineProcess`: the child itself, which reports the engine's sizes and hands back
  the tokenizer; afterwards it mirrors the engine's state after each step for the metrics
  (``block_manager``, ``scheduler``, ``stats``: the attributes
  :class:`~paged_attention.server.metrics.ServerMetrics` reads). It is started with ``spawn``
  (a fresh interpreter) by default and by ``serve``. ``fork`` starts it faster, since the
  child does not import torch and transformers again (measured in docs/performance.md), but it
  is only safe from a process that has not yet run torch's OpenMP pool, the tokenizers' thread
  pool or CUDA: a child forked after them can hang in its first parallel region, and a server
  started inside a larger program (the tests run ``serve`` in their own process) cannot promise
  that, so ``fork`` is an option for a caller that can;
* :class:`ProcessEngineOwner`: the :class:`~paged_attention.server.engine_owner.EngineOwner`
  of such an engine: a sender thread forwards the handlers' commands (add, abort, drain, stop;
  from a queue, so that a signal handler may drain), a receiver thread turns each step's
  compact deltas back into whole :class:`~paged_attention.engine.RequestOutput` objects
  (:class:`OutputAssembler`) and hands them to the streams, once each and in order.

A child that dies (killed, out of memory) fails every open stream with an
``EngineStepError`` naming its exit status and turns ``/health`` to 503; stopping the owner (the
server's shutdown) stops the child; a child whose server process is gone exits at its next
turn (its command pipe closes), and one left running when its :class:`EngineProcess` is
garbage-collected or the interpreter exits is terminated.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import queue
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace

from paged_attention.engine import RequestOutput, SamplingParams
from paged_attention.engine.request import RequestError
from paged_attention.server import engine_worker
from paged_attention.server.engine_owner import (
    EngineClosedError,
    EngineOwner,
    EngineStepError,
    ServerStream,
)
from paged_attention.server.engine_worker import STOPPED, Delivery, Failed, Ready, Turn

logger = logging.getLogger("paged_attention.server")

START_METHODS = ("spawn", "fork")


@dataclass(frozen=True)
class EngineSpec:
    """An :class:`~paged_attention.engine.Engine` over
    :func:`~paged_attention.modeling.models.load_model` ``(model, dtype, device)`` with its
    tokenizer and ``options`` (``Engine``'s keyword arguments); ``threads``: torch's intra-op
    threads in the engine's process."""

    model: str
    options: dict = field(default_factory=dict)
    dtype: str = "auto"
    device: str = "cpu"
    threads: int | None = None

    def build(self):
        import torch

        from paged_attention.engine import Engine
        from paged_attention.modeling.models import load_model

        if self.threads:
            torch.set_num_threads(self.threads)
        model, tokenizer = load_model(self.model, dtype=self.dtype, device=self.device)
        return Engine(model, tokenizer=tokenizer, **self.options), tokenizer


class _BlockPoolMirror:
    def __init__(self, num_device_blocks: int) -> None:
        self.num_device_blocks = num_device_blocks
        self.free = num_device_blocks

    def num_free_device_blocks(self) -> int:
        return self.free


class EngineProcess:
    """The engine built by ``spec.build()`` in a child process started with ``start_method``
    (see the module docstring); the constructor returns once it is built (with ``wait=False``
    at once: then :meth:`wait_until_ready` before anything else). Raises ``UsageError`` or
    ``RuntimeError`` (with the child's message) when it could not be built.

    Its sizes are read as an engine's (``max_num_seqs``, ``max_model_len``, ``block_size``,
    ``block_manager.num_device_blocks``); ``tokenizer`` is the engine's; ``block_manager``,
    ``scheduler`` (sized ``running``/``waiting``/``swapped``) and ``stats`` (its scalar
    counters) mirror the engine's state after the last turn the owner received."""

    def __init__(self, spec, *, start_method: str = "spawn", wait: bool = True) -> None:
        if start_method not in START_METHODS:
            raise ValueError(f"start_method must be one of {START_METHODS}, got {start_method!r}")
        context = multiprocessing.get_context(start_method)
        commands_read, self.commands = context.Pipe(duplex=False)
        self.results, results_write = context.Pipe(duplex=False)
        # a forked child holds copies of the parent's ends too: it closes them first, or the
        # parent's death would never reach it as the end of its command pipe
        parent_ends = (self.commands, self.results) if start_method == "fork" else ()
        self.process = context.Process(
            target=engine_worker.main,
            args=(spec, commands_read, results_write, parent_ends),
            name="paged-attention-engine",
            daemon=True,
        )
        self.process.start()
        commands_read.close()  # the child's ends: the parent keeps none, so EOF means death
        results_write.close()
        self._finalizer = weakref.finalize(
            self, _end_process, self.process, self.commands, self.results
        )
        if wait:
            self.wait_until_ready()

    def wait_until_ready(self) -> None:
        """Waits for the engine to be built (the constructor's own wait, for one built with
        ``wait=False``: the caller does something else meanwhile, such as answering that the
        server is loading)."""
        ready = self._wait_until_ready()
        sizes = ready.sizes
        self.max_num_seqs: int = sizes["max_num_seqs"]
        self.max_model_len: int | None = sizes["max_model_len"]
        self.block_size: int = sizes["block_size"]
        self.block_manager = _BlockPoolMirror(sizes["num_device_blocks"])
        self.scheduler = SimpleNamespace(running=range(0), waiting=range(0), swapped=range(0))
        self.stats = SimpleNamespace()
        self.tokenizer = ready.tokenizer
        self.update(ready.state)

    def _wait_until_ready(self) -> Ready:
        try:
            answer = self.results.recv()
        except (EOFError, OSError):
            self.process.join(5)
            self.close()
            raise RuntimeError(
                f"the engine's process exited with status {self.process.exitcode} before the "
                "engine was built"
            ) from None
        if isinstance(answer, Failed):
            self.close()
            if answer.usage:
                from paged_attention.errors import UsageError

                raise UsageError(answer.message)
            raise RuntimeError(f"the engine could not be built: {answer.message}")
        return answer

    @property
    def alive(self) -> bool:
        return self.process.is_alive()

    @property
    def exitcode(self) -> int | None:
        return self.process.exitcode

    def update(self, state: dict) -> None:
        """Mirror the engine's state (``engine_worker.engine_state``)."""
        self.block_manager.free = state["free_blocks"]
        self.scheduler = SimpleNamespace(
            running=range(state["running"]),
            waiting=range(state["waiting"]),
            swapped=range(state["swapped"]),
        )
        self.stats = SimpleNamespace(**state["stats"])

    def close(self, timeout: float = 10.0) -> None:
        """Stop the child: close its command pipe (it exits at its next turn), wait up to
        ``timeout`` seconds, then terminate it, then kill it."""
        self._finalizer.detach()
        _end_process(self.process, self.commands, self.results, timeout)


def _end_process(process, commands, results, timeout: float = 2.0) -> None:
    commands.close()
    if process.pid is not None:
        process.join(timeout)
        if process.is_alive():
            process.terminate()  # SIGTERM, which the engine's process ignores while serving
            process.join(1)
        if process.is_alive():
            process.kill()
            process.join(5)
    results.close()


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


__all__ = [
    "EngineProcess",
    "EngineSpec",
    "OutputAssembler",
    "ProcessEngineOwner",
]
