"""paged_attention.testing: the random paged caches the tests and the benchmarks share."""

import torch

from paged_attention.ops import reference
from paged_attention.testing import make_paged_kv


def test_stored_tokens_are_readable_and_every_other_slot_is_nan():
    kv = make_paged_kv(3, [5, 16, 9], 2, 32, 8, torch.float32, seed=1)
    assert kv.num_blocks == 1 + 2 + 2 + 4  # the blocks needed plus 4 spare
    assert kv.block_tables.shape == (3, 3)  # a trailing entry that must never be read
    assert (kv.block_tables[:, -1] >= kv.num_blocks).all()
    held = 0
    for s, length in enumerate(kv.seq_lens.tolist()):
        keys, values = reference.gather_kv(kv.key_cache, kv.value_cache, kv.block_tables[s], length)
        assert keys.isfinite().all() and values.isfinite().all()
        held += length
    assert int(kv.value_cache.isnan().sum()) == (kv.num_blocks * 8 - held) * 2 * 32


def test_benchmark_caches_are_random_everywhere_with_exact_tables():
    kv = make_paged_kv(4, 100, 2, 64, 16, torch.bfloat16, tokens=False)
    assert kv.num_blocks == 4 * 7 and kv.block_tables.shape == (4, 7)
    assert sorted(kv.block_tables.flatten().tolist()) == list(range(28))
    assert kv.key_cache.isfinite().all() and kv.value_cache.float().std() > 0.5
