"""What ``paged-attention serve`` answers while its engine loads: every request gets
``503 Service Unavailable`` with ``Retry-After: 1``; ``/health`` answers
``{"status": "loading"}``, every other route an OpenAI-style error with code
``model_loading``, as llama.cpp's server answers while it loads a model. Once the engine is
ready the server takes the same listening socket and ``/health`` answers 200.

:class:`LoadingResponder` is a thread of plain sockets, not the HTTP server itself: it starts
before the server's own modules (``paged_attention.server``, transformers, uvicorn) are
imported, which takes seconds, so that a supervisor polling ``/health`` sees the process alive
at once. It answers one short request per connection and
closes it.
"""

from __future__ import annotations

import json
import select
import socket
import threading

POLL_SECONDS = 0.05
READ_SECONDS = 1.0
HEAD_LIMIT = 16384


def loading_response(path: str) -> bytes:
    """The whole HTTP response to a request for ``path`` while the engine loads."""
    if path.split("?", 1)[0] == "/health":
        body = {"status": "loading"}
    else:
        body = {
            "error": {
                "message": "the model is loading; retry in a moment",
                "type": "service_unavailable",
                "param": None,
                "code": "model_loading",
            }
        }
    data = json.dumps(body).encode()
    head = (
        "HTTP/1.1 503 Service Unavailable\r\n"
        "Content-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n"
        "Retry-After: 1\r\n"
        "Connection: close\r\n\r\n"
    )
    return head.encode() + data


class LoadingResponder:
    """Answers the connections of the listening socket ``sock`` with :func:`loading_response`
    from :meth:`start` until :meth:`stop`; connections that arrive after stop wait in the
    socket's backlog for the server."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="loading-responder", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stopping.is_set():
            readable, _, _ = select.select([self.sock], [], [], POLL_SECONDS)
            if not readable or self._stopping.is_set():
                continue
            try:
                self.sock.setblocking(False)
                connection, _ = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                continue  # another accept took it, or the client left
            finally:
                self.sock.setblocking(True)
            with connection:
                self._answer(connection)

    def _answer(self, connection: socket.socket) -> None:
        connection.settimeout(READ_SECONDS)
        head = b""
        try:
            while b"\r\n\r\n" not in head and len(head) < HEAD_LIMIT:
                chunk = connection.recv(4096)
                if not chunk:
                    return
                head += chunk
            parts = head.split(b"\r\n", 1)[0].split()
            path = parts[1].decode("latin-1") if len(parts) >= 2 else "/"
            connection.sendall(loading_response(path))
            # a body left unread would make the close a reset, which could cost the client
            # the answer: read what is left until the client closes (or a moment passes)
            connection.shutdown(socket.SHUT_WR)
            connection.settimeout(POLL_SECONDS)
            while connection.recv(4096):
                pass
        except OSError:  # the client left or stalled: nothing more to answer
            return
