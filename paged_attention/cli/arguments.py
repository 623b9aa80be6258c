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
        "the result in ~/.cache/paged_attention; later starts load the compiled steps "
        "instead of compiling them again (seconds; docs/performance.md). Default: "
        "compiled when that cache is warm, else eager (with a line saying so); --no-compile: "
        "eager",
    )


def add_speculative_argument(parser: argparse.ArgumentParser) -> None:
    """``--speculative-ngram K`` or ``--speculative-model MODEL`` (with
    ``--num-speculative-tokens K``), as ``serve`` and ``chat`` take them (default: off)."""
    methods = parser.add_mutually_exclusive_group()
    methods.add_argument(
        "--speculative-ngram",
        type=positive_int,
        metavar="K",
        help="speculative decoding: up to K tokens per step drafted by prompt lookup (n-grams "
        "of the prompt and answer) and verified by the model; greedy answers are the plain "
        "ones up to rounding (in bfloat16 a near-tie may go the other way)",
    )
    methods.add_argument(
        "--speculative-model",
        metavar="MODEL",
        help="speculative decoding with a draft model: MODEL (as --model takes it, loaded in "
        "the model's dtype with its weights as shipped) over the same vocabulary proposes its "
        "greedy continuation, --num-speculative-tokens tokens per step, verified by the model. "
        "It drafts one sequence at a time: it speeds up one user, not a batch "
        "(docs/engine.md)",
    )
    parser.add_argument(
        "--num-speculative-tokens",
        type=positive_int,
        metavar="K",
        help="tokens --speculative-model drafts per step (default 3)",
    )


def speculative_config(args: argparse.Namespace, model):
    """The engine's speculative decoding from ``--speculative-ngram`` or
    ``--speculative-model`` (loaded here, like ``model``), or None (off). Raises
    :class:`UsageError` naming the option when the draft model cannot be loaded or serve."""
    from paged_attention.engine import SpeculativeConfig

    if args.num_speculative_tokens is not None and not args.speculative_model:
        raise UsageError("--num-speculative-tokens: it is the draft of --speculative-model")
    if args.speculative_ngram:
        return SpeculativeConfig(num_speculative_tokens=args.speculative_ngram)
    if not args.speculative_model:
        return None
    from paged_attention.engine.draft_model import check_draft_model
    from paged_attention.modeling.models import ModelLoadError, load_model

    name = args.speculative_model
    try:
        draft, _ = load_model(name, dtype=model.dtype, device=args.device, weights="auto")
        check_draft_model(model, draft)
    except (ModelLoadError, ValueError) as error:
        raise UsageError(f"--speculative-model {name}: {error}") from None
    tokens = args.num_speculative_tokens or 3
    return SpeculativeConfig("draft_model", num_speculative_tokens=tokens, draft_model=draft)


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
