"""What the server answers while its engine loads (paged_attention.cli.loading.py): 503 with
Retry-After, /health {"status": "loading"}, other routes an OpenAI-style error; after stop the
socket is left to the server, with the connections that arrived meanwhile in its backlog."""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request

import pytest

from paged_attention.cli.loading import LoadingResponder, loading_response
from paged_attention.cli.serve import listening_socket


@pytest.fixture
def responder():
    sock = listening_socket("127.0.0.1", 0)
    loading = LoadingResponder(sock)
    loading.start()
    yield sock, loading
    loading.stop()
    sock.close()


def fetch(sock: socket.socket, path: str, body: dict | None = None):
    port = sock.getsockname()[1]
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data)
    with pytest.raises(urllib.error.HTTPError) as raised:
        urllib.request.urlopen(request, timeout=10)
    error = raised.value
    return error.code, error.headers, json.loads(error.read())


def test_health_says_loading_and_other_routes_refuse_with_retry_after(responder):
    sock, _ = responder
    status, headers, body = fetch(sock, "/health")
    assert (status, body, headers["Retry-After"]) == (503, {"status": "loading"}, "1")
    chat = {"messages": [{"role": "user", "content": "x" * 100_000}]}  # a body left unread
    status, headers, body = fetch(sock, "/v1/chat/completions", chat)
    assert status == 503 and headers["Retry-After"] == "1"
    assert body["error"]["code"] == "model_loading"


def test_after_stop_connections_wait_for_the_server(responder):
    sock, loading = responder
    loading.stop()
    client = socket.create_connection(sock.getsockname()[:2], timeout=5)
    with client:
        client.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        connection, _ = sock.accept()  # what the server would accept: nothing answered it
        with connection:
            assert connection.recv(4096).startswith(b"GET /health")


def test_a_response_is_whole_http():
    head, _, body = loading_response("/health?x=1").partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 503 ") and json.loads(body) == {"status": "loading"}
    assert f"Content-Length: {len(body)}".encode() in head
