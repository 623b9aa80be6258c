"""uvicorn's server with the engine's part of a graceful shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading
from collections.abc import Callable

import uvicorn

from paged_attention.server.engine_owner import EngineOwner


class GracefulServer(uvicorn.Server):
    """On SIGINT or SIGTERM, first tells the engine's owner: take no new request, abort what
    still runs ``grace`` seconds from now (so open streams end with finish reason ``abort``
    before uvicorn's own ``timeout_graceful_shutdown`` would cut them); then uvicorn stops
    listening and waits for the open responses. ``run()`` returns afterwards instead of
    re-raising the signal (what uvicorn does when embedded), so a command exits 0.
    ``on_started()`` runs once the server listens and serves (the moment to tell a user).

    A second SIGINT quits at once (uvicorn's forced exit): the requests still open are
    cancelled without a word, not each logged as a failure with its traceback."""

    def __init__(
        self,
        config: uvicorn.Config,
        owner: EngineOwner,
        grace: float,
        on_started: Callable[[], None] | None = None,
    ) -> None:
        super().__init__(config)
        self.owner = owner
        self.grace = grace
        self.on_started = on_started

    def run(self, sockets=None) -> None:
        # the open requests are cancelled after serve() returns, when asyncio.run ends
        errors = logging.getLogger("uvicorn.error")
        errors.addFilter(self._not_cancelled_by_a_forced_exit)
        try:
            super().run(sockets=sockets)
        finally:
            errors.removeFilter(self._not_cancelled_by_a_forced_exit)

    def _not_cancelled_by_a_forced_exit(self, record: logging.LogRecord) -> bool:
        """Whether uvicorn's ``record`` is shown: not a request's cancellation at a forced
        exit."""
        error = record.exc_info[1] if record.exc_info else None
        return not (self.force_exit and isinstance(error, asyncio.CancelledError))

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets=sockets)
        if self.started and self.on_started is not None:
            self.on_started()

    def handle_exit(self, sig, frame) -> None:
        self.owner.drain(self.grace)  # sets two attributes: safe in a signal handler
        super().handle_exit(sig, frame)

    @contextlib.contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():
            yield  # signals reach the main thread only
            return
        handled = (signal.SIGINT, signal.SIGTERM)
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
