"""The command line, the top layer: ``paged-attention demo|chat|serve``
(:mod:`~paged_attention.cli.main`), the argument types they share, and the record of the
machine a measurement ran on. Nothing else in the package imports it."""
