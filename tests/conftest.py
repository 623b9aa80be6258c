"""Shared test helpers: the random paged KV caches of paged_attention.testing, and the real
model, loaded once per session."""

import pytest

from paged_attention.testing import FP8_NAN_BITS, make_paged_kv

__all__ = ["FP8_NAN_BITS", "make_paged_kv"]


@pytest.fixture(scope="session")
def smollm2():
    """``(model, tokenizer)`` of SmolLM2-135M-Instruct in the default dtype (``make setup``
    installs it; the first load converts it into the model cache). Tests that switch its
    attention implementation switch it back to sdpa."""
    from paged_attention.models import load_model

    return load_model("smollm2")
