"""``python -m paged_attention demo|chat|serve [options]`` (also the ``paged-attention``
console script): the command line of :mod:`paged_attention.cli.main`."""

import sys

from paged_attention.cli.main import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
