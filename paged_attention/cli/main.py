"""Command line: ``python -m paged_attention demo|chat|serve [options]`` (also the
``paged-attention`` console script)."""

from __future__ import annotations

import argparse
import sys

from paged_attention.errors import UsageError


def main(argv: list[str] | None = None) -> int:
    from paged_attention.cli import chat, demo, serve

    parser = argparse.ArgumentParser(prog="paged-attention", description="PagedAttention tools")
    commands = parser.add_subparsers(dest="command", required=True)
    demo_parser = commands.add_parser(
        "demo",
        help="serve a seeded workload with continuous batching in a small KV budget",
        description=demo.__doc__.split("\n\n")[0],
    )
    demo.add_arguments(demo_parser)
    demo_parser.set_defaults(run=demo.main, parser=demo_parser)
    chat_parser = commands.add_parser("chat", help=chat.HELP, description=chat.__doc__)
    chat.add_arguments(chat_parser)
    chat_parser.set_defaults(run=chat.main, parser=chat_parser)
    serve_parser = commands.add_parser("serve", help=serve.HELP, description=serve.__doc__)
    serve.add_arguments(serve_parser)
    serve_parser.set_defaults(run=serve.main, parser=serve_parser)
    args = parser.parse_args(argv)
    # a process of its own (the command line): serve may fork its engine process from it
    args.fresh_process = argv is None
    try:
        return args.run(args)
    except UsageError as error:
        args.parser.error(str(error))  # one line on stderr, exit status 2, as argparse's own


if __name__ == "__main__":
    sys.exit(main())
