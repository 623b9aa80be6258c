"""Errors every layer may raise or catch; this module imports nothing of the package."""

from __future__ import annotations


class UsageError(ValueError):
    """A bad command-line argument, found after argparse (the entry point reports it as
    argparse does: one line, exit status 2)."""
