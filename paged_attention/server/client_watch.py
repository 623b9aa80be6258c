"""Waiting for a request's outputs while watching its HTTP connection: a client that goes away
is noticed at once, not at the next token, whatever the engine is doing."""

from __future__ import annotations

import asyncio
from collections import deque

from starlette.requests import Request

from paged_attention.server.engine_owner import ServerStream


class ClientDisconnected(Exception):
    pass


class ClientWatch:
    """Waits for the next item of one stream, or of any of several (the prompts of one
    request), and raises ClientDisconnected as soon as the client is gone. An exception
    delivered in an output's place is raised."""

    def __init__(self, request: Request) -> None:
        self._gone = asyncio.ensure_future(self._wait_disconnect(request))
        self._held: dict[int, deque] = {}  # items taken from a queue while waiting on several

    @staticmethod
    async def _wait_disconnect(request: Request) -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    async def next(self, stream: ServerStream):
        """The stream's next item."""
        if self._gone.done():
            raise ClientDisconnected
        if stream.outputs.empty():
            get = asyncio.ensure_future(stream.outputs.get())
            await asyncio.wait({get, self._gone}, return_when=asyncio.FIRST_COMPLETED)
            if not get.done():
                get.cancel()
                raise ClientDisconnected
            item = get.result()
        else:
            item = stream.outputs.get_nowait()
        return _raised(item)

    async def next_of(self, streams: dict[int, ServerStream]) -> tuple[int, object]:
        """``(key, item)``: the next item of whichever of ``streams`` has one (each stream's
        items in their order; none waits while another's are read: every step gives each
        stream at most one)."""
        while True:
            if self._gone.done():
                raise ClientDisconnected
            for key, stream in streams.items():
                held = self._held.get(key)
                if held:
                    return key, _raised(held.popleft())
                if not stream.outputs.empty():
                    return key, _raised(stream.outputs.get_nowait())
            gets = {key: asyncio.ensure_future(s.outputs.get()) for key, s in streams.items()}
            waited = {*gets.values(), self._gone}
            await asyncio.wait(waited, return_when=asyncio.FIRST_COMPLETED)
            for key, get in gets.items():
                if get.done():  # its item left the queue: keep it, in order
                    self._held.setdefault(key, deque()).append(get.result())
                else:
                    get.cancel()  # not run yet: the queue keeps its item

    def close(self) -> None:
        self._gone.cancel()


def _raised(item):
    if isinstance(item, BaseException):
        raise item
    return item
