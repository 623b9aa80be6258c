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
  (a fresh interpreter) by default. ``fork`` skips the fresh interpreter's start and its
  imports of what the parent already imported, but it is only safe from a process that has not
  yet run torch's OpenMP pool, the tokenizers' thread pool or CUDA: a child forked after them
  can hang in its first parallel region, and a server started inside a larger program (the
  tests run ``serve`` in their own process) cannot promise that, so ``fork`` is an option for
  a caller that can: ``serve`` run from the command line forks it once it has imported what
  the engine needs, with no other thread running;
* :class:`~paged_attention.server.process_owner.ProcessEngineOwner` (in a module of its own,
  since it needs the engine's modules and starting the child does not): the
  :class:`~paged_attention.server.engine_owner.EngineOwner`
  of such an engine: a sender thread forwards the handlers' commands (add, abort, drain, stop;
  from a queue, so that a signal handler may drain), a receiver thread turns each step's
  compact deltas back into whole :class:`~paged_attention.engine.RequestOutput` objects
  (:class:`~paged_attention.server.process_owner.OutputAssembler`) and hands them to the
  streams, once each and in order.

A child that dies (killed, out of memory) fails every open stream with an
``EngineStepError`` naming its exit status and turns ``/health`` to 503; stopping the owner (the
server's shutdown) stops the child; a child whose server process is gone exits at its next
turn (its command pipe closes), and one left running when its :class:`EngineProcess` is
garbage-collected or the interpreter exits is terminated.
"""

from __future__ import annotations

import importlib
import multiprocessing
import weakref
from dataclasses import dataclass, field
from types import SimpleNamespace

from paged_attention.server import engine_worker
from paged_attention.server.engine_worker import Failed, Ready

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


# The owner's side lives in process_owner (it imports the engine's modules, and with them
# torch, which starting the child must not wait for); its names are found here too.
_OWNER_NAMES = ("OutputAssembler", "ProcessEngineOwner")


def __getattr__(name: str):
    if name in _OWNER_NAMES:
        return getattr(importlib.import_module("paged_attention.server.process_owner"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["EngineProcess", "EngineSpec", *_OWNER_NAMES]
