"""What the server answers while its engine loads (paged_attention.cli.loading.py): 503 with
Retry-After, /health {"status": "loading"}, other routes an OpenAI-style error; after stop the
socket is left to the server, with the connections that arrived meanwhile in its backlog. And
``serve`` from the command line: it binds before importing torch, answers 503 then 200."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from paged_attention.cli.loading import LoadingResponder, loading_response
from paged_attention.cli.serve import listening_socket

ROOT = Path(__file__).resolve().parents[1]


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


HEAVY_MODULES = ("torch", "transformers", "starlette", "uvicorn", "paged_attention.engine.engine")

ORDER = """
import gc, importlib, json, sys, threading
sys.argv = ["paged-attention", "serve", "--model", "tiny", "--port", "0"]
from paged_attention.cli import loading, main as command_line, serve

events = []
real_start = loading.LoadingResponder.start

def start(self):  # the loading answers start
    events.append(["answering", [name for name in {heavy!r} if name in sys.modules]])
    real_start(self)

def start_engine_process(args, start_method, wait, send_tokenizer):  # stands for the fork
    modules = [name for name in {heavy!r} if name in sys.modules]
    threads, collector = threading.active_count(), [gc.get_freeze_count() > 0, gc.isenabled()]
    events.append(["engine", start_method, modules, threads, send_tokenizer, *collector])
    raise SystemExit(0)

real_import = importlib.import_module

def import_module(name, *args, **kwargs):  # the engine's modules, imported before the fork
    if name == "torch" and name not in sys.modules:
        events.append(["importing torch", gc.isenabled()])
    return real_import(name, *args, **kwargs)

loading.LoadingResponder.start = start
serve.start_engine_process = start_engine_process
importlib.import_module = import_module
sys.argv = ["paged-attention", "serve", "--model", "tiny", "--port", "0"]
try:
    command_line.main()
finally:
    print(json.dumps(events))
"""


def run_python(code: str, **kwargs) -> subprocess.CompletedProcess:
    environment = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-c", code], env=environment, capture_output=True, text=True, **kwargs
    )


def test_serve_answers_before_importing_torch_and_forks_after():
    """The command line's serve process answers 503 before it imports torch, transformers or
    the engine; it imports what the engine's process needs before forking it (so the child
    does not import it again), with the garbage collector off while it imports, no other
    thread running at the fork and what it imported frozen (``gc.freeze``: the child's
    collections do not copy the pages those objects lie on), the collector on again; it reads
    the tokenizer itself, so the engine's process is not asked to send it."""
    run = run_python(ORDER.format(heavy=HEAVY_MODULES), timeout=180)
    assert run.returncode == 0, run.stderr
    answering, importing, engine = json.loads(run.stdout)
    assert answering == ["answering", []]
    assert importing == ["importing torch", False]  # the collector off while it imports
    expected = ["torch", "transformers", "paged_attention.engine.engine"]
    assert engine == ["engine", "fork", expected, 1, False, True, True]


def test_serve_answers_loading_then_ready_then_stops():
    """From the command line: /health answers 503 {"status": "loading"} while the engine's
    process loads, then 200; Ctrl-C then stops it with exit status 0."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [sys.executable, "-m", "paged_attention", "serve", "--model", "tiny"]
    command += ["--port", str(port), "--num-blocks", "64", "--log-level", "warning"]
    environment = {**os.environ, "PYTHONPATH": str(ROOT)}
    server = subprocess.Popen(command, env=environment, start_new_session=True)
    answers = []
    try:
        deadline = time.monotonic() + 180
        while not answers or answers[-1][0] != 200:
            assert server.poll() is None, "the server exited"
            assert time.monotonic() < deadline, f"not ready: {answers[-3:]}"
            answer = health(port)
            if answer is not None and (not answers or answers[-1] != answer):
                answers.append(answer)
            time.sleep(0.02)
        assert answers == [(503, {"status": "loading"}), (200, {"status": "ok"})]
        os.killpg(server.pid, signal.SIGINT)
        assert server.wait(60) == 0
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
@pytest.mark.parametrize("phase", ["importing", "engine loading"])
def test_serve_stopped_while_loading_exits_cleanly(sig, phase):
    """Ctrl-C (or SIGTERM) while /health still answers "loading", while the command imports
    (the tiny model) or once the engine's process loads the model (SmolLM2, which takes a
    second or more): one line saying so, no traceback, exit status 0, and no process of the
    server's left."""
    import psutil

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    model = "tiny" if phase == "importing" else "smollm2"
    command = [sys.executable, "-m", "paged_attention", "serve", "--model", model]
    command += ["--port", str(port), "--num-blocks", "64", "--log-level", "warning"]
    command += ["--no-compile"]
    environment = {**os.environ, "PYTHONPATH": str(ROOT)}
    server = subprocess.Popen(
        command, env=environment, start_new_session=True, stderr=subprocess.PIPE, text=True
    )
    try:
        deadline = time.monotonic() + 300
        while health(port) is None or (phase == "engine loading" and not engines(server)):
            assert server.poll() is None and time.monotonic() < deadline
            time.sleep(0.02)
        assert health(port) == (503, {"status": "loading"})
        children = engines(server)
        assert bool(children) == (phase == "engine loading")
        os.killpg(server.pid, sig)
        assert server.wait(30) == 0
        errors = server.stderr.read()
        assert "stopped while loading the model" in errors and "Traceback" not in errors
        deadline = time.monotonic() + 30
        while any(psutil.pid_exists(c.pid) and c.status() != "zombie" for c in children):
            assert time.monotonic() < deadline, "a process of the server's was left"
            time.sleep(0.1)
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)


SIGNAL_INSIDE_AN_IMPORT = """
import os, signal, subprocess, sys, time
from paged_attention.cli.serve import _ended_by_a_signal_while_loading

engine = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
print(engine.pid, flush=True)
with _ended_by_a_signal_while_loading(True, lambda: engine.pid):
    try:  # as numpy's import does: what stops it comes out as another error
        os.kill(os.getpid(), signal.SIG{name})
        time.sleep(5)
    except BaseException as error:
        raise ImportError("cannot load module more than once per process") from None
print("not ended", flush=True)
"""


@pytest.mark.parametrize("name", ["INT", "TERM"])
def test_a_signal_while_loading_ends_serve_even_inside_an_import(name):
    """In the command line's process, SIGINT or SIGTERM while loading ends it at once with
    one line and status 0, and kills the engine's process, even where the KeyboardInterrupt it
    would raise inside a module's import would come out as another error."""
    import psutil

    done = subprocess.run(
        [sys.executable, "-c", SIGNAL_INSIDE_AN_IMPORT.format(name=name)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert done.returncode == 0 and "not ended" not in done.stdout
    assert done.stderr == "paged-attention serve: stopped while loading the model\n"
    engine = int(done.stdout.split()[0])
    deadline = time.monotonic() + 10
    while psutil.pid_exists(engine) and psutil.Process(engine).status() != "zombie":
        assert time.monotonic() < deadline, "the engine's process was left"
        time.sleep(0.05)


def engines(server: subprocess.Popen) -> list:
    """The engine's process of ``server`` once it is forked: a child with the same command
    line for more than a tenth of a second (other children come and go while it imports, each
    with that command line too between its fork and its exec)."""
    import psutil

    try:
        parent = psutil.Process(server.pid)
        command = parent.cmdline()
        now = time.time()
        return [
            c for c in parent.children() if c.cmdline() == command and now - c.create_time() > 0.1
        ]
    except psutil.NoSuchProcess:  # a short-lived child (or the server) ended meanwhile
        return []


def health(port: int) -> tuple[int, dict] | None:
    """``/health``'s status and body; None while nothing answers."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return None


def test_importing_the_package_registers_the_ops_but_not_the_engine():
    """``import paged_attention`` is enough for ``torch.ops.paged_attention.*`` (the README's
    example); transformers and the engine wait for the names that need them."""
    code = (
        "import sys, paged_attention, torch\n"
        "print(torch.ops.paged_attention.reshape_and_cache.default.name())\n"
        "print(sorted(m for m in ('transformers', 'paged_attention.engine') if m in sys.modules))"
    )
    run = run_python(code, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split("\n")[:2] == ["paged_attention::reshape_and_cache", "[]"]
