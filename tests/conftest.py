"""Shared test helpers: the random paged KV caches of paged_attention.testing, and the real
model, loaded once per session."""

import pytest
import torch

from paged_attention.testing import FP8_NAN_BITS, make_paged_kv

__all__ = ["FP8_NAN_BITS", "make_paged_kv", "make_paged_kv_of_value_size"]


def make_paged_kv_of_value_size(
    num_seqs,
    seq_lens,
    num_kv_heads,
    head_size,
    v_head_size,
    block_size,
    dtype,
    kv_cache_dtype="auto",
    seed=0,
    **options,
):
    """make_paged_kv's cache with values of their own head size ``v_head_size`` (multi-head
    latent attention's keys and values differ: 192 and 128 in DeepSeek-V3): the keys of one
    such cache and the values of another, built with the same seed, so the same block tables
    and NaN-filled empty slots."""
    keys = make_paged_kv(
        num_seqs,
        seq_lens,
        num_kv_heads,
        head_size,
        block_size,
        dtype,
        kv_cache_dtype,
        seed=seed,
        **options,
    )
    values = make_paged_kv(
        num_seqs,
        seq_lens,
        num_kv_heads,
        v_head_size,
        block_size,
        dtype,
        kv_cache_dtype,
        seed=seed,
        **options,
    )
    assert torch.equal(keys.block_tables, values.block_tables)
    keys.value_cache = values.value_cache
    keys.v_head_size = v_head_size
    return keys


@pytest.fixture(scope="session")
def smollm2():
    """``(model, tokenizer)`` of SmolLM2-135M-Instruct in the default dtype (``make setup``
    installs it; the first load converts it into the model cache). Tests that switch its
    attention implementation switch it back to sdpa."""
    from paged_attention.modeling.models import load_model

    return load_model("smollm2")
