"""``python -m paged_attention serve``: an OpenAI-compatible HTTP server over the engine:
``POST /v1/chat/completions`` and ``/v1/completions`` (whole or streamed), ``GET /v1/models``,
``/health`` and ``/metrics`` (Prometheus).

Every request shares the engine's steps with the others in flight (continuous batching across
HTTP requests) in a KV cache of ``--num-blocks`` blocks (or ``--kv-memory`` GiB). SIGINT or
SIGTERM shuts it down gracefully: no new requests, the running ones get ``--shutdown-timeout``
seconds to finish and are then aborted (their streams end with finish reason ``abort``), and
the process exits 0. Needs the ``serve`` extra (installed from source:
``pip install --no-build-isolation '.[serve]'``).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import socket
import sys
import threading
from dataclasses import dataclass

from paged_attention.cli.arguments import (
    add_compile_argument,
    add_speculative_argument,
    decode_compile_cache,
    non_negative_float,
    non_negative_int,
    positive_float,
    positive_int,
    speculative_config,
)
from paged_attention.errors import UsageError

HELP = "an OpenAI-compatible HTTP server over the engine"
API_KEY_VARIABLE = "PAGED_ATTENTION_API_KEY"
# the server's defaults, here too so that --help needs no server dependency
DEFAULT_MAX_REQUEST_BYTES = 4 * 2**20
DEFAULT_MAX_WAITING_REQUESTS = 256
DEFAULT_KV_MEMORY_GIB = 1.0
TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral", "auto")  # the server's registry's
EXIT_STATUS = """exit status: 0 after a graceful shutdown (SIGINT, SIGTERM); 1 when the
address cannot be bound; 2 for bad arguments (including a --model that cannot be loaded)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from paged_attention.modeling.models import add_model_arguments, add_weights_argument

    parser.epilog = EXIT_STATUS
    add_model_arguments(parser)
    add_weights_argument(parser)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument(
        "--port", type=_port, default=8000, help="TCP port (0: any free port, printed)"
    )
    parser.add_argument(
        "--served-model-name",
        help="the model's name in the API (the 'model' field; default: --model's value)",
    )
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--num-blocks", type=positive_int, help="device KV-cache blocks")
    size.add_argument(
        "--kv-memory",
        type=positive_float,
        help=f"device KV-cache memory in GiB (default {DEFAULT_KV_MEMORY_GIB:g})",
    )
    parser.add_argument("--block-size", type=int, default=16, choices=(8, 16, 32))
    parser.add_argument(
        "--num-host-blocks",
        type=non_negative_int,
        help="host swap-space blocks for preempted requests (default: four times the device's; "
        "0: preemption recomputes)",
    )
    parser.add_argument(
        "--max-num-seqs", type=positive_int, default=64, help="sequences running at once"
    )
    parser.add_argument(
        "--max-num-batched-tokens",
        type=positive_int,
        help="tokens one step computes (default no limit; longer prompts prefill in chunks)",
    )
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument(
        "--max-model-len",
        type=positive_int,
        help="the context (prompt + completion tokens) one request may fill (default: the model's)",
    )
    parser.add_argument(
        "--max-n", type=positive_int, default=8, help="the most samples (n) one request may ask"
    )
    parser.add_argument("--threads", type=positive_int, help="CPU threads for torch")
    add_compile_argument(parser)
    add_speculative_argument(parser)
    parser.add_argument(
        "--tool-call-parser",
        choices=TOOL_CALL_PARSERS,
        default=TOOL_CALL_PARSERS[0],
        help="how the model writes tool calls: hermes (<tool_call>{...}</tool_call>), "
        'llama3_json ({"name", "parameters"} opening the answer or after <|python_tag|>; '
        "several separated by ;), mistral ([TOOL_CALLS][{...}]) or auto (the chat template's; "
        "hermes when it shows none); calls forced by tool_choice are written in the same "
        "format (default hermes)",
    )
    parser.add_argument(
        "--shutdown-timeout",
        type=non_negative_float,
        default=30.0,
        help="seconds in-flight requests get to finish after SIGINT/SIGTERM before they are "
        "aborted (default 30)",
    )
    _add_security_arguments(parser.add_argument_group("security and load"))
    parser.add_argument(
        "--log-level", choices=("critical", "error", "warning", "info", "debug"), default="info"
    )


def _add_security_arguments(security) -> None:
    security.add_argument(
        "--api-key",
        type=_api_key,
        default=os.environ.get(API_KEY_VARIABLE) or None,
        help="require 'Authorization: Bearer KEY' on every route but /health (default: the "
        f"environment variable {API_KEY_VARIABLE}; unset: no key)",
    )
    security.add_argument(
        "--allowed-origins",
        type=_origins,
        help="comma-separated web origins whose pages may call the server (CORS), or '*' "
        "(default: none)",
    )
    security.add_argument(
        "--max-request-bytes",
        type=positive_int,
        default=DEFAULT_MAX_REQUEST_BYTES,
        help=f"the largest request body; larger ones get 413 (default {DEFAULT_MAX_REQUEST_BYTES})",
    )
    security.add_argument(
        "--max-waiting-requests",
        type=positive_int,
        default=DEFAULT_MAX_WAITING_REQUESTS,
        help="requests that may wait to start (to their first token) before the next ones get "
        f"429 with Retry-After (default {DEFAULT_MAX_WAITING_REQUESTS})",
    )


SERVE_MODULES = ("transformers", "starlette", "uvicorn", "pydantic", "prometheus_client")


def main(args: argparse.Namespace) -> int:
    """Load the model, build the engine, serve until SIGINT/SIGTERM; returns the exit status.
    Raises UsageError for a bad argument."""
    import importlib.util

    # found, not imported: importing the server takes seconds, done while the model loads
    missing = [name for name in SERVE_MODULES if importlib.util.find_spec(name) is None]
    if missing:
        raise UsageError(
            f"serve needs the 'serve' extra ({missing[0]} is missing): "
            "install paged_attention from source with the serve extra (pip install "
            "--no-build-isolation '.[serve]' in its checkout)"
        )
    if args.max_n > args.max_num_seqs:
        raise UsageError(
            f"--max-n {args.max_n}: a request's samples run at once, so it may not exceed "
            f"--max-num-seqs ({args.max_num_seqs})"
        )
    # The address first: a port in use is told at once, not after the model has loaded.
    try:
        sock = listening_socket(args.host, args.port)
    except BindError as error:
        print(f"paged-attention serve: error: {error}", file=sys.stderr)
        return 1
    with sock:
        try:
            serve(args, sock)
        except KeyboardInterrupt:  # before the server ran: no request to finish
            print(STOPPED_WHILE_LOADING, file=sys.stderr)
    return 0


STOPPED_WHILE_LOADING = "paged-attention serve: stopped while loading the model"


@contextlib.contextmanager
def _ended_by_a_signal_while_loading(command_line: bool, engine_pid):
    """Within it, in the command line's own process, SIGINT or SIGTERM ends the process at
    once, exit status 0, with one line (the engine's process, ``engine_pid()`` once forked,
    killed first); once it serves, the server's own handlers take both. A KeyboardInterrupt
    raised inside a module's import can come out as another error (numpy's "cannot load module
    more than once per process", transformers' ModuleNotFoundError) or leave CPython's mark
    that kills the process with SIGINT at its exit; nothing done while loading needs undoing."""
    if not command_line or threading.current_thread() is not threading.main_thread():
        yield
        return

    def end(signum, frame):
        pid = engine_pid()
        if pid is not None:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        # written past sys.stderr, whose buffer the interrupted code may be writing through
        os.write(2, f"{STOPPED_WHILE_LOADING}\n".encode())
        os._exit(0)

    previous = {sig: signal.signal(sig, end) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def serve(args: argparse.Namespace, sock: socket.socket) -> None:
    """Load the model and serve on ``sock`` until SIGINT/SIGTERM. Until the engine is ready,
    every request gets 503 (``/health``: ``{"status": "loading"}``;
    :mod:`paged_attention.cli.loading`): from the command line that starts before torch is
    imported, so the first answer comes at once. The model loads in the engine's process
    while this one imports the HTTP server."""
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s: %(message)s")
    started = []  # the engine's process, once there is one

    def engine_pid():
        return started[0].process.pid if started else None

    with _ended_by_a_signal_while_loading(getattr(args, "fresh_process", False), engine_pid):
        engine, tokenizer = _load(args, sock, started)
    import uvicorn

    from paged_attention.server import create_app
    from paged_attention.server.graceful import GracefulServer

    name = args.served_model_name or args.model
    try:
        app = create_app(
            engine,
            tokenizer,
            name,
            max_n=args.max_n,
            max_model_len=args.max_model_len,
            api_key=args.api_key,
            allowed_origins=args.allowed_origins,
            max_request_bytes=args.max_request_bytes,
            max_waiting_requests=args.max_waiting_requests,
            tool_call_parser=args.tool_call_parser,
        )
    except ValueError as error:  # beyond the engine's context
        raise UsageError(f"--max-model-len: {error}") from None
    config = uvicorn.Config(
        app,
        log_level=args.log_level,
        # uvicorn's own wait for open responses outlasts the engine's: the engine aborts the
        # requests at --shutdown-timeout, so their streams end properly before uvicorn gives up
        timeout_graceful_shutdown=args.shutdown_timeout + 5,
    )
    host, port = sock.getsockname()[:2]
    url = f"http://{_url_host(host)}:{port}"

    def listening() -> None:
        print(f"serving {name!r} on {url}", flush=True)

    server = GracefulServer(config, app.state.owner, args.shutdown_timeout, on_started=listening)
    server.run(sockets=[sock])


def _load(args: argparse.Namespace, sock: socket.socket, started: list):
    """``(the engine's process, ready; the tokenizer)``, loaded while ``sock`` answers 503;
    the engine's process is appended to ``started`` as soon as it exists."""
    from paged_attention.cli.loading import LoadingResponder

    loading = LoadingResponder(sock)
    loading.start()
    engine = None
    try:
        own_tokenizer = _tokenizer_readable_here(args.model)
        # the model loads and the engine runs in a process of its own (ServeSpec builds it
        # there); forked from the command line's fresh process, spawned inside another program
        if getattr(args, "fresh_process", False):
            loading, engine = _fork_after_imports(args, sock, loading, own_tokenizer)
        else:
            engine = start_engine_process(
                args, "spawn", wait=False, send_tokenizer=not own_tokenizer
            )
        started.append(engine)
        # imported now, while the engine's process loads
        import uvicorn  # noqa: F401

        import paged_attention.server.graceful  # noqa: F401
        from paged_attention.server import create_app  # noqa: F401

        # read here while the engine's process loads the model (on another core), rather than
        # pickled by that process once it is built and rebuilt here, after it
        tokenizer = _read_tokenizer(args.model, engine) if own_tokenizer else None
        engine.wait_until_ready()
    except KeyboardInterrupt:
        if engine is not None:  # stopped at once, not left to finish loading
            engine.close(timeout=0)
        raise
    finally:
        loading.stop()
    return engine, tokenizer if own_tokenizer else engine.tokenizer


ENGINE_MODULES = (
    "torch",
    "transformers",
    "paged_attention.engine.engine",
    "paged_attention.engine.compile_cache",
    "paged_attention.modeling.models",
    "paged_attention.modeling.quantized_cache",
)
"""What the engine's process imports before it loads a model: imported by ``serve``'s own
process before it forks the engine's, so that the two do not import them twice (on a busy
2-core machine the second import cost more than running both in parallel gained)."""


def _tokenizer_readable_here(model: str) -> bool:
    """Whether ``serve``'s own process can read ``model``'s tokenizer while the engine's
    process loads the model: not when a GGUF file is still to be converted (the model load's
    work), nor when ``model`` names no model (the engine's process says why)."""
    from pathlib import Path

    from paged_attention.modeling.models import (
        ModelLoadError,
        converted_gguf_directory,
        model_source,
    )

    try:
        source = model_source(model)
    except ModelLoadError:
        return False
    if isinstance(source, Path) and source.is_file():
        return (converted_gguf_directory(source) / "config.json").is_file()
    return True


def _read_tokenizer(model: str, engine):
    """``model``'s tokenizer (:func:`~paged_attention.modeling.models.load_tokenizer`); on a
    failure the engine's process is stopped at once (not left to finish loading a model nobody
    will serve) and the failure is a ``UsageError``, as the engine's own would be."""
    from paged_attention.modeling.models import ModelLoadError, load_tokenizer

    try:
        tokenizer = load_tokenizer(model)
    except ModelLoadError as error:
        engine.close(timeout=0)
        raise UsageError(str(error)) from None
    if tokenizer is None:
        engine.close(timeout=0)
        raise UsageError(f"--model {model}: it has no tokenizer, which the server needs")
    return tokenizer


def _fork_after_imports(
    args: argparse.Namespace, sock: socket.socket, loading, own_tokenizer: bool = False
):
    """Import :data:`ENGINE_MODULES` while ``loading`` answers, then fork the engine's process
    with no other thread running (``loading`` stops for the fork: connections wait in the
    socket's backlog) and the objects that exist then frozen (``gc.freeze``), and answer again;
    ``own_tokenizer``: this process reads the tokenizer itself (the engine's process does not
    send it). Returns ``(the new responder, the engine's process)``."""
    import gc
    import importlib

    from paged_attention.cli.loading import LoadingResponder

    # What is imported lives as long as the process: the collector's passes while it is
    # imported walk its hundreds of thousands of objects to free a few MB of cycles, and
    # frozen, the child's first full collection does not write to (copy) every page those
    # objects lie on (the pattern of gc.freeze's manual; docs/performance.md, the start)
    gc.disable()
    try:
        for name in ENGINE_MODULES:
            importlib.import_module(name)
    finally:
        gc.freeze()
        gc.enable()
    loading.stop()
    engine = start_engine_process(args, "fork", wait=False, send_tokenizer=not own_tokenizer)
    loading = LoadingResponder(sock)
    loading.start()
    return loading, engine


class BindError(OSError):
    """The address to listen on cannot be had (a port in use, an unknown host)."""


def listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host``:``port`` (port 0: a free one) and listening; BindError
    with a one-line reason otherwise."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    except (socket.gaierror, UnicodeError) as error:
        reason = getattr(error, "strerror", None) or str(error)
        raise BindError(f"--host {host}: not an address of this machine ({reason})") from None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(2048)
    except OSError as error:
        sock.close()
        raise BindError(
            f"cannot listen on {_url_host(host)}:{port}: {error.strerror or error}"
        ) from None
    sock.set_inheritable(True)
    return sock


def build_engine(model, tokenizer, args: argparse.Namespace):
    """The engine the server drives, configured by the arguments: ``--num-blocks``, else a KV
    cache of ``--kv-memory`` GiB (the engine sizes it from the model's geometry)."""
    from paged_attention.engine import CacheConfig, Engine, EngineConfig, SchedulerConfig
    from paged_attention.engine.compile_cache import compile_decode_steps

    memory = None
    if args.num_blocks is None:
        memory = int((args.kv_memory or DEFAULT_KV_MEMORY_GIB) * 2**30)
    compiled = decode_compile_cache(model, args, args.max_num_seqs, logging.info)
    try:
        config = EngineConfig(
            CacheConfig(
                block_size=args.block_size,
                num_blocks=args.num_blocks,
                max_memory=memory,
                num_host_blocks=args.num_host_blocks,
                enable_prefix_caching=not args.no_prefix_caching,
            ),
            SchedulerConfig(
                max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens,
            ),
            compile=compiled is not None,
            speculative=speculative_config(args, model),
        )
        engine = Engine(model, config, tokenizer=tokenizer)
    except ValueError as error:  # sizes the engine refuses, or a model it cannot serve
        message = str(error)
        if message.startswith("max_memory"):
            message = f"--kv-memory {args.kv_memory or DEFAULT_KV_MEMORY_GIB:g}: {message}"
        raise UsageError(message) from None
    if compiled is not None:
        compile_decode_steps(engine, compiled, logging.info)
    logging.info("engine warmed up in %.1f s", engine.warm_up())
    return engine


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be in 0..65535, got {value}")
    return value


def _api_key(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("an API key must not be empty")
    return text


def _origins(text: str) -> list[str]:
    origins = [origin.strip() for origin in text.split(",") if origin.strip()]
    if not origins:
        raise argparse.ArgumentTypeError("expected one or more origins (https://host:port) or '*'")
    for origin in origins:
        if origin != "*" and not origin.startswith(("http://", "https://")):
            raise argparse.ArgumentTypeError(
                f"an origin is a scheme and a host (https://example.com), got {origin!r}"
            )
    return origins


@dataclass(frozen=True)
class ServeSpec:
    """The engine ``paged-attention serve`` builds from its parsed arguments; its usage errors
    (a model that cannot be loaded, sizes the engine refuses) are ``UsageError``."""

    args: argparse.Namespace
    send_tokenizer: bool = True
    """False: ``build`` returns no tokenizer (the server's process reads its own)."""

    def build(self):
        import torch

        from paged_attention.errors import UsageError
        from paged_attention.modeling.models import load_model

        args = self.args
        if args.device == "cuda" and not torch.cuda.is_available():
            raise UsageError("--device cuda was given but no CUDA device is available")
        if args.threads:
            torch.set_num_threads(args.threads)
        logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s: %(message)s")
        try:
            model, tokenizer = load_model(
                args.model, dtype=args.dtype, device=args.device, weights=args.weights
            )
        except ValueError as error:  # models.ModelLoadError: one line naming the problem
            raise UsageError(str(error)) from None
        if tokenizer is None:
            raise UsageError(f"--model {args.model}: it has no tokenizer, which the server needs")
        engine = build_engine(model, tokenizer, args)
        return engine, tokenizer if self.send_tokenizer else None


def start_engine_process(
    args: argparse.Namespace, start_method: str = "spawn", wait=True, send_tokenizer=True
):
    """``serve``'s engine in its own process, an ``EngineProcess`` (with ``wait=False`` not
    built yet: call its ``wait_until_ready()``). Raises ``UsageError`` for what the arguments
    got wrong (when it waits). ``fork`` skips the child's second import of torch and the engine
    (seconds of the start), and is safe only from a process that has run no torch or
    tokenizer threads yet: the command line's own ``serve`` process. ``send_tokenizer=False``:
    its ``tokenizer`` is None (the caller reads its own)."""
    from paged_attention.server.engine_process import EngineProcess

    # the parsed values only: the namespace also holds the command's parser and function
    plain = (str, int, float, bool, type(None))
    values = {name: value for name, value in vars(args).items() if isinstance(value, plain)}
    spec = ServeSpec(argparse.Namespace(**values), send_tokenizer)
    return EngineProcess(spec, start_method=start_method, wait=wait)
