"""Shared test helpers: the random paged KV caches of paged_attention.testing."""

from paged_attention.testing import FP8_NAN_BITS, make_paged_kv

__all__ = ["FP8_NAN_BITS", "make_paged_kv"]
