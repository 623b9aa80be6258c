"""For the real-client tests (tests/test_clients_*.py): clients such as lm-eval-harness and
LangChain reach for the network on their own (the Hugging Face hub for a tokenizer, telemetry);
these tests must pass on a machine without one, so any connection beyond this machine fails
the test that makes it."""

from __future__ import annotations

import socket

LOCAL_HOSTS = frozenset({"127.0.0.1", "::1", "localhost"})


class RemoteConnectionRefused(AssertionError):
    """A test tried to connect to another machine."""


def refuse_remote_connections(monkeypatch) -> None:
    """Make every socket's ``connect`` / ``connect_ex`` to an address off this machine raise
    :class:`RemoteConnectionRefused` (for the rest of the test ``monkeypatch`` belongs to)."""
    connect, connect_ex = socket.socket.connect, socket.socket.connect_ex

    def checked(address) -> None:
        if isinstance(address, tuple) and address[0] not in LOCAL_HOSTS:
            raise RemoteConnectionRefused(f"a test connected to {address!r}, off this machine")

    def local_connect(self, address):
        checked(address)
        return connect(self, address)

    def local_connect_ex(self, address):
        checked(address)
        return connect_ex(self, address)

    monkeypatch.setattr(socket.socket, "connect", local_connect)
    monkeypatch.setattr(socket.socket, "connect_ex", local_connect_ex)
