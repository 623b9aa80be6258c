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
import logging

import torch

from paged_attention.demo import (
    UsageError,
    non_negative_float,
    non_negative_int,
    positive_float,
    positive_int,
)

HELP = "an OpenAI-compatible HTTP server over the engine"
DEFAULT_KV_MEMORY_GIB = 1.0
EXIT_STATUS = """exit status: 0 after a graceful shutdown (SIGINT, SIGTERM); 1 when the
address cannot be bound; 2 for bad arguments (including a --model that cannot be loaded)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from paged_attention.models import add_model_arguments

    parser.epilog = EXIT_STATUS
    add_model_arguments(parser)
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
    parser.add_argument(
        "--compile",
        action="store_true",
        help="CPU: run decode steps through torch.compile, one graph per padded batch size "
        "(1, 8, 32 and --max-num-seqs), all compiled before the server accepts requests (one to "
        "two minutes each for SmolLM2 on two cores); 1.2-2x the eager tokens/s afterwards in "
        "benchmarks/bench_serving.py",
    )
    parser.add_argument(
        "--shutdown-timeout",
        type=non_negative_float,
        default=30.0,
        help="seconds in-flight requests get to finish after SIGINT/SIGTERM before they are "
        "aborted (default 30)",
    )
    parser.add_argument(
        "--log-level", choices=("critical", "error", "warning", "info", "debug"), default="info"
    )


def main(args: argparse.Namespace) -> int:
    """Load the model, build the engine, serve until SIGINT/SIGTERM; returns the exit status.
    Raises UsageError for a bad argument."""
    try:
        import uvicorn

        from paged_attention.server import create_app
        from paged_attention.server.graceful import GracefulServer
    except ImportError as error:
        raise UsageError(
            f"serve needs the 'serve' extra ({error.name} is missing): "
            "install paged_attention from source with the serve extra (pip install "
            "--no-build-isolation '.[serve]' in its checkout)"
        ) from None
    from paged_attention.server.engine_process import start_engine_process

    if args.max_n > args.max_num_seqs:
        raise UsageError(
            f"--max-n {args.max_n}: a request's samples run at once, so it may not exceed "
            f"--max-num-seqs ({args.max_num_seqs})"
        )
    if args.device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda was given but no CUDA device is available")
    if args.threads:
        torch.set_num_threads(args.threads)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s: %(message)s")
    # the model loads and the engine runs in a process of its own (ServeSpec builds it there)
    engine, tokenizer = start_engine_process(args)
    name = args.served_model_name or args.model
    try:
        app = create_app(
            engine, tokenizer, name, max_n=args.max_n, max_model_len=args.max_model_len
        )
    except ValueError as error:  # beyond the engine's context
        raise UsageError(f"--max-model-len: {error}") from None
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        # uvicorn's own wait for open responses outlasts the engine's: the engine aborts the
        # requests at --shutdown-timeout, so their streams end properly before uvicorn gives up
        timeout_graceful_shutdown=args.shutdown_timeout + 5,
    )
    socket = config.bind_socket()  # exits 1 with uvicorn's message when the port is taken
    host, port = socket.getsockname()[:2]
    print(f"serving {name!r} on http://{_url_host(host)}:{port}", flush=True)
    GracefulServer(config, app.state.owner, args.shutdown_timeout).run(sockets=[socket])
    return 0


def build_engine(model, tokenizer, args: argparse.Namespace):
    """The engine the server drives, sized by the arguments."""
    from paged_attention.cache import bytes_per_block, num_blocks_for_budget
    from paged_attention.engine import Engine
    from paged_attention.geometry import ModelGeometry

    num_blocks = args.num_blocks
    if num_blocks is None:
        geometry = ModelGeometry.of(model)
        block_bytes = bytes_per_block(
            geometry.num_layers,
            geometry.num_kv_heads,
            geometry.head_size,
            args.block_size,
            geometry.dtype,
        )
        budget = int((args.kv_memory or DEFAULT_KV_MEMORY_GIB) * 2**30)
        try:
            num_blocks = num_blocks_for_budget(block_bytes, geometry.device, budget)
        except ValueError as error:
            raise UsageError(f"--kv-memory: {error}") from None
    try:
        engine = Engine(
            model,
            tokenizer=tokenizer,
            num_blocks=num_blocks,
            block_size=args.block_size,
            num_host_blocks=args.num_host_blocks,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            enable_prefix_caching=not args.no_prefix_caching,
            compile=args.compile,
        )
    except ValueError as error:  # sizes the engine refuses, or a model it cannot serve
        raise UsageError(str(error)) from None
    if args.compile:
        seconds = engine.compile_decode_steps()
        logging.info(
            "compiled decode steps for batch sizes %s in %.0f s",
            ", ".join(map(str, seconds)),
            sum(seconds.values()),
        )
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
