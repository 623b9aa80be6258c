"""The argument types the commands share: each turns a command-line string into a
value or raises ``argparse.ArgumentTypeError`` naming what was wrong."""

from __future__ import annotations

import argparse

from paged_attention.errors import UsageError


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def finite_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if value != value or value in (float("inf"), float("-inf")):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def positive_float(text: str) -> float:
    value = finite_float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def non_negative_float(text: str) -> float:
    value = finite_float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def unit_interval(text: str) -> float:
    value = finite_float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def seed_int(text: str) -> int:
    """A seed: an integer in [0, 2**32), the usual range of seeds (so that the per-request
    seeds ``seed + i`` stay valid generator seeds)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if not 0 <= value < 2**32:
        raise argparse.ArgumentTypeError(f"must be in [0, 2**32), got {text}")
    return value


def add_compile_argument(parser: argparse.ArgumentParser) -> None:
    """``--compile`` / ``--no-compile``, as ``serve`` and ``chat`` take them (default: compiled
    when cached; :mod:`paged_attention.engine.compile_cache`)."""
    parser.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="CPU: run decode steps through torch.compile, one graph per padded batch size "
        "(1, 8, 32 and --max-num-seqs), compiled before the first request. The first --compile "
        "of a model takes minutes per batch size on a small CPU (building the C++) and caches "
        "the result in ~/.cache/paged_attention; later starts load it instead of compiling "
        "again (only dynamo traces the model again: tens of seconds per batch size; "
        "docs/performance.md). Default: "
        "compiled when that cache is warm, else eager (with a line saying so); --no-compile: "
        "eager",
    )


def add_speculative_argument(parser: argparse.ArgumentParser) -> None:
    """``--speculative-ngram K``, as ``serve`` and ``chat`` take it (default: off)."""
    parser.add_argument(
        "--speculative-ngram",
        type=positive_int,
        metavar="K",
        help="speculative decoding: up to K tokens per step drafted by prompt lookup (n-grams "
        "of the prompt and answer) and verified by the model; greedy answers are the plain "
        "ones up to rounding (in bfloat16 a near-tie may go the other way)",
    )


def speculative_config(args: argparse.Namespace):
    """The engine's speculative decoding from ``--speculative-ngram``, or None (off)."""
    from paged_attention.engine import SpeculativeConfig

    if not args.speculative_ngram:
        return None
    return SpeculativeConfig(num_speculative_tokens=args.speculative_ngram)


def decode_compile_cache(model, args: argparse.Namespace, max_num_seqs: int, say):
    """The compile cache of the engine's decode steps when they are to be compiled
    (``--compile``, or by default when that cache is warm), else None: eager, by default with
    a line through ``say`` saying how to compile them
    (:func:`~paged_attention.engine.compile_cache.cache_to_compile_with`)."""
    from paged_attention.engine.compile_cache import cache_to_compile_with

    try:
        return cache_to_compile_with(
            args.model,
            model,
            weights=args.weights,
            device=args.device,
            requested=args.compile,
            max_num_seqs=max_num_seqs,
            say=say,
        )
    except ValueError as error:
        raise UsageError(f"--compile: {error}") from None
