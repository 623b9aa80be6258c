"""Command line: ``python -m paged_attention demo|chat|serve [options]`` (also the
``paged-attention`` console script)."""

from __future__ import annotations

import argparse
import importlib
import signal
import sys

from paged_attention.errors import UsageError

COMMANDS = ("demo", "chat", "serve")
DEMO_HELP = "serve a seeded workload with continuous batching in a small KV budget"


INTERRUPTED = 130
"""The exit status of a command stopped by Ctrl+C (128 + SIGINT, as a shell reports it);
``serve`` exits 0 instead, Ctrl+C being how it is stopped."""


def main(argv: list[str] | None = None) -> int:
    words = sys.argv[1:] if argv is None else argv
    try:
        _ctrl_c_raises_from_here()
        return _run(words, argv)
    except KeyboardInterrupt:  # one line, not a traceback from wherever it was
        program = " ".join(["paged-attention", *(w for w in words[:1] if w in COMMANDS)])
        print(f"{program}: interrupted", file=sys.stderr)
        return INTERRUPTED


def _ctrl_c_raises_from_here() -> None:
    """Until main, the package itself ends the command line's process on Ctrl+C
    (:func:`paged_attention.end_on_ctrl_c_before_main`); from here on Ctrl+C is a
    KeyboardInterrupt, which the command may handle and main turns into its line."""
    import paged_attention

    if signal.getsignal(signal.SIGINT) is paged_attention.end_on_ctrl_c_before_main:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def _run(words: list[str], argv: list[str] | None) -> int:
    parser = argparse.ArgumentParser(prog="paged-attention", description="PagedAttention tools")
    commands = parser.add_subparsers(dest="command", required=True)
    # Only the command asked for is imported (serve answers /health before torch is imported;
    # demo imports the whole engine); without one (--help, a typo) every command is, so that
    # argparse lists them all.
    asked = words[0] if words and words[0] in COMMANDS else None
    for name in COMMANDS:
        if asked is not None and name != asked:
            commands.add_parser(name)  # never parsed: the command line names another
            continue
        module = importlib.import_module(f"paged_attention.cli.{name}")
        if name == "demo":
            help_text, description = DEMO_HELP, module.__doc__.split("\n\n")[0]
        else:
            help_text, description = module.HELP, module.__doc__
        command = commands.add_parser(name, help=help_text, description=description)
        module.add_arguments(command)
        command.set_defaults(run=module.main, parser=command)
    args = parser.parse_args(argv)
    # a process of its own (the command line): serve may fork its engine process from it
    args.fresh_process = argv is None
    try:
        return args.run(args)
    except UsageError as error:
        args.parser.error(str(error))  # one line on stderr, exit status 2, as argparse's own


if __name__ == "__main__":
    sys.exit(main())
