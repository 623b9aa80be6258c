"""Hugging Face transformers generate() on PagedCache: token-for-token equality with transformers'
default cache on tiny Llama, Mistral (sliding window) and Qwen2 (mixed full/sliding layers)
models built from fixed configs and seeds, block accounting, forks instead of copies, and the
checks that every attention call computes what the cache was built for (every other supported
family: tests/test_model_zoo.py)."""

from __future__ import annotations

import dataclasses
import math
import warnings

import pytest
import torch
from transformers import (
    DynamicCache,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    masking_utils,
)

from paged_attention.integrations.transformers import (
    ATTN_IMPLEMENTATION,
    PagedCache,
    cache_argument_name,
)
from paged_attention.kv.block_manager import OutOfBlocksError
from paged_attention.modeling.tiny import tiny_llama_config
from paged_attention.modeling.transformers_backend import MaskPattern, paged_attention_mask

BLOCK = 8
COMMON = tiny_llama_config(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    head_dim=32,  # GQA: 4 query heads over 2 KV heads
    max_position_embeddings=512,
)
WINDOW = 12


def build(kind: str, sliding_window: int | None = WINDOW):
    if kind == "llama":
        cls, config = LlamaForCausalLM, LlamaConfig(**COMMON)
    elif kind == "mistral":
        cls, config = MistralForCausalLM, MistralConfig(**COMMON, sliding_window=sliding_window)
    else:  # layer 0 full attention, layer 1 sliding
        config = Qwen2Config(
            **COMMON, use_sliding_window=True, sliding_window=sliding_window, max_window_layers=1
        )
        cls = Qwen2ForCausalLM
    torch.manual_seed(1234)
    return cls(config).eval()


@pytest.fixture(scope="module", params=["llama", "mistral", "qwen2"])
def model(request):
    return build(request.param)


@pytest.fixture(scope="module")
def llama():
    return build("llama")


def left_padded(lengths, seed=0):
    gen = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        ids[row, width - n :] = torch.randint(3, COMMON["vocab_size"], (n,), generator=gen)
        mask[row, width - n :] = 1
    return ids, mask


def generate_both(model, cache_kwargs=None, **kwargs):
    """The same generate() call with transformers' default cache (sdpa) and with PagedCache."""
    model.set_attn_implementation("sdpa")
    torch.manual_seed(7)
    expected = model.generate(**kwargs)
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    cache = PagedCache(model, **{"block_size": BLOCK, "num_blocks": 512, **(cache_kwargs or {})})
    torch.manual_seed(7)
    got = model.generate(**kwargs, cache=cache)
    model.set_attn_implementation("sdpa")
    return expected, got, cache


def test_greedy_left_padded_batch_matches_default_cache(model):
    lengths = [5, 11, 17]
    ids, mask = left_padded(lengths)
    new = 40
    expected, got, cache = generate_both(
        model, input_ids=ids, attention_mask=mask, max_new_tokens=new, do_sample=False
    )
    assert torch.equal(got, expected)
    assert cache.get_seq_length() == ids.shape[1] + new - 1
    stats = cache.stats()
    assert stats.device.used_blocks == cache.blocks_in_use() > 0
    stored = [n + new - 1 for n in lengths]  # pads never stored; the last token is never fed
    if cache.block_manager.sliding_window is None:
        assert stats.device.tokens_stored == sum(stored)
        assert stats.device.used_blocks == sum(math.ceil(n / BLOCK) for n in stored)
    else:  # blocks that left the window went back to the pool
        assert stats.device.used_blocks <= len(lengths) * (math.ceil(WINDOW / BLOCK) + 1)
    assert stats.bytes_per_block == cache.kv_cache.bytes_per_block
    cache.reset()
    assert (
        cache.blocks_in_use() == 0 and cache.stats().device.free_blocks == cache.kv_cache.num_blocks
    )
    assert cache.stats().num_seqs == 0


def test_sliding_window_changes_the_output():
    """Without this the window equality tests above could pass with the window ignored."""
    ids, mask = left_padded([17])
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=40, do_sample=False)
    windowed = generate_both(build("mistral"), **kwargs)[1]
    full = generate_both(build("mistral", sliding_window=None), **kwargs)[1]
    assert not torch.equal(windowed, full)


def test_long_generation_crosses_many_blocks(llama):
    ids, mask = left_padded([7, 13], seed=1)
    new = 150
    expected, got, cache = generate_both(
        llama, input_ids=ids, attention_mask=mask, max_new_tokens=new, do_sample=False
    )
    assert torch.equal(got, expected)
    assert cache.stats().device.used_blocks == math.ceil((7 + new - 1) / BLOCK) + math.ceil(
        (13 + new - 1) / BLOCK
    )


def test_beam_search_matches_and_copies_at_most_one_block_per_beam(model, monkeypatch):
    ids, mask = left_padded([6, 14], seed=2)
    num_beams = 4
    copies = []
    real = PagedCache.__init__

    def spying_init(self, *args, **kwargs):
        real(self, *args, **kwargs)
        copy = self.kv_cache.copy_blocks
        self.kv_cache.copy_blocks = lambda pairs: copies.append(len(pairs)) or copy(pairs)

    monkeypatch.setattr(PagedCache, "__init__", spying_init)
    expected, got, cache = generate_both(
        model,
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=30,
        num_beams=num_beams,
        num_return_sequences=2,
        do_sample=False,
    )
    assert torch.equal(got, expected)
    rows = ids.shape[0] * num_beams
    assert max(copies) <= rows  # each step copies at most each beam's partial last block
    assert sum(copies) > 0  # beams did share a partial block and copy it on write
    stats = cache.stats()
    assert stats.device.blocks_saved_by_sharing > 0  # beams still share their prompt blocks
    assert cache.peak_blocks_in_use < rows * math.ceil((14 + 30) / BLOCK)


def test_sampling_with_several_return_sequences_forks_the_prompt(llama):
    ids, mask = left_padded([9, 20], seed=3)
    n = 4
    expected, got, cache = generate_both(
        llama,
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=25,
        do_sample=True,
        top_k=20,
        num_return_sequences=n,
    )
    assert torch.equal(got, expected)
    # The copies forked the prompt: its full blocks are held once per prompt, not per copy.
    full_prompt_blocks = 9 // BLOCK + 20 // BLOCK
    private = sum(math.ceil((p + 24) / BLOCK) - p // BLOCK for p in (9, 20)) * n
    assert cache.stats().device.used_blocks == full_prompt_blocks + private


def test_prefill_of_expanded_copies_shares_every_block(llama):
    ids, _ = left_padded([21], seed=4)
    llama.set_attn_implementation(ATTN_IMPLEMENTATION)
    cache = PagedCache(llama, block_size=BLOCK, num_blocks=64)
    llama.generate(
        input_ids=ids,
        max_new_tokens=1,
        do_sample=True,
        num_return_sequences=4,
        cache=cache,
    )
    assert cache.blocks_in_use() == math.ceil(21 / BLOCK)
    assert cache.stats().num_seqs == 4
    llama.set_attn_implementation("sdpa")


def step_logits(model, cache, ids, mask):
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask, cache=cache).logits[:, -1]


def test_repeat_select_and_reorder_match_dynamic_cache(llama):
    """The batch-reshaping Cache methods against DynamicCache's, step by step."""
    ids, mask = left_padded([5, 12], seed=5)
    paged = PagedCache(llama, block_size=BLOCK, num_blocks=64)
    dense = DynamicCache(config=llama.config)

    def both(ids, mask):
        llama.set_attn_implementation("sdpa")
        want = step_logits(llama, dense, ids, mask)
        llama.set_attn_implementation(ATTN_IMPLEMENTATION)
        got = step_logits(llama, paged, ids, mask)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        return got

    logits = both(ids, mask)
    used = paged.blocks_in_use()
    for cache in (paged, dense):
        cache.batch_repeat_interleave(2)
    assert paged.blocks_in_use() == used  # forks, no copies
    mask = torch.cat([mask.repeat_interleave(2, 0), torch.ones(4, 1, dtype=torch.long)], 1)
    logits = both(logits.argmax(-1).repeat_interleave(2)[:, None], mask)
    beam_idx = torch.tensor([1, 1, 0, 3])
    for cache in (paged, dense):
        cache.reorder_cache(beam_idx)
    mask = torch.cat([mask[beam_idx], torch.ones(4, 1, dtype=torch.long)], 1)
    logits = both(logits.argmax(-1)[beam_idx][:, None], mask)
    keep = torch.tensor([3, 0])
    for cache in (paged, dense):
        cache.batch_select_indices(keep)
    mask = torch.cat([mask[keep], torch.ones(2, 1, dtype=torch.long)], 1)
    both(logits.argmax(-1)[keep][:, None], mask)
    assert paged.stats().num_seqs == 2
    paged.reset()
    assert paged.blocks_in_use() == 0
    llama.set_attn_implementation("sdpa")


def test_wrong_attention_implementation_raises(llama):
    llama.set_attn_implementation("sdpa")
    cache = PagedCache(llama, block_size=BLOCK, num_blocks=16)
    with pytest.raises(ValueError, match='set_attn_implementation\\("paged_attention"\\)'):
        llama.generate(input_ids=torch.tensor([[5, 6, 7]]), max_new_tokens=2, cache=cache)


def test_attention_without_paged_cache_raises(llama):
    llama.set_attn_implementation(ATTN_IMPLEMENTATION)
    try:
        with pytest.raises(RuntimeError, match="PagedCache"):
            llama(input_ids=torch.tensor([[5, 6, 7]]), use_cache=False)
    finally:
        llama.set_attn_implementation("sdpa")


def test_sized_from_a_memory_budget(llama):
    cache = PagedCache(llama, block_size=BLOCK, num_blocks=16)
    budget = 20 * cache.kv_cache.bytes_per_block
    assert PagedCache(llama, BLOCK, max_memory=budget).kv_cache.num_blocks == 20


def test_cpu_cache_without_a_size_takes_a_quarter_of_host_memory_up_to_4_gib(llama, monkeypatch):
    per_block = PagedCache(llama, BLOCK, num_blocks=1).kv_cache.bytes_per_block
    monkeypatch.setattr("paged_attention.kv.cache._host_available_bytes", lambda: 400 * per_block)
    assert PagedCache(llama, BLOCK).kv_cache.num_blocks == 100
    monkeypatch.setattr("paged_attention.kv.cache._host_available_bytes", lambda: 1 << 50)
    assert PagedCache(llama, BLOCK).kv_cache.num_blocks == (4 << 30) // per_block


def test_new_batch_needs_reset(llama):
    llama.set_attn_implementation(ATTN_IMPLEMENTATION)
    cache = PagedCache(llama, block_size=BLOCK, num_blocks=32)
    llama.generate(input_ids=torch.tensor([[5, 6, 7]]), max_new_tokens=2, cache=cache)
    with pytest.raises(ValueError, match="reset"):
        llama.generate(
            input_ids=torch.tensor([[5, 6, 7, 8], [1, 2, 3, 4]]),
            max_new_tokens=2,
            cache=cache,
        )
    cache.reset()
    out = llama.generate(input_ids=torch.tensor([[5, 6, 7]]), max_new_tokens=2, cache=cache)
    assert out.shape == (1, 5)
    llama.set_attn_implementation("sdpa")


def test_new_prompt_of_the_same_batch_size_needs_reset(llama):
    llama.set_attn_implementation(ATTN_IMPLEMENTATION)
    try:
        cache = PagedCache(llama, block_size=BLOCK, num_blocks=32)
        first = torch.tensor([[5, 6, 7, 8, 9]])
        llama.generate(input_ids=first, max_new_tokens=3, do_sample=False, cache=cache)
        held = cache.block_manager.stats().device.used_blocks
        other = torch.tensor([[11, 12, 13, 14, 15, 16, 17, 18, 19, 20]])  # longer, unrelated
        with pytest.raises(ValueError, match="do not start with them"):
            llama.generate(input_ids=other, max_new_tokens=3, do_sample=False, cache=cache)
        assert cache.block_manager.stats().device.used_blocks == held  # nothing was reserved
        cache.reset()
        out = llama.generate(input_ids=other, max_new_tokens=3, do_sample=False, cache=cache)
        llama.set_attn_implementation("sdpa")
        assert torch.equal(out, llama.generate(input_ids=other, max_new_tokens=3, do_sample=False))
    finally:
        llama.set_attn_implementation("sdpa")


def test_continuation_of_the_cached_tokens_matches_the_default_cache(llama):
    prompt = torch.tensor([[5, 6, 7, 8, 9, 10, 11]])

    def two_turns(cache):
        out = llama.generate(input_ids=prompt, max_new_tokens=6, do_sample=False, **cache)
        follow_up = torch.cat([out, torch.tensor([[21, 22, 23]])], dim=1)
        return llama.generate(input_ids=follow_up, max_new_tokens=6, do_sample=False, **cache)

    llama.set_attn_implementation("sdpa")
    want = two_turns(dict(cache=DynamicCache(config=llama.config)))
    llama.set_attn_implementation(ATTN_IMPLEMENTATION)
    try:
        got = two_turns(dict(cache=PagedCache(llama, block_size=BLOCK, num_blocks=32)))
    finally:
        llama.set_attn_implementation("sdpa")
    assert torch.equal(got, want)


def test_unsupported_head_size_is_refused_at_construction():
    config = LlamaConfig(**{**COMMON, "head_dim": 16})
    model = LlamaForCausalLM(config).eval()
    with pytest.raises(ValueError, match="head_size 16 is not supported"):
        PagedCache(model, block_size=BLOCK, num_blocks=8)


def test_cache_built_for_another_model_is_refused(llama):
    deeper = LlamaForCausalLM(LlamaConfig(**{**COMMON, "num_hidden_layers": 3})).eval()
    wider = LlamaForCausalLM(LlamaConfig(**{**COMMON, "head_dim": 64})).eval()
    llama.set_attn_implementation(ATTN_IMPLEMENTATION)
    ids = torch.tensor([[5, 6, 7]])
    try:
        for other, message in [(deeper, "3 layers|2 layers"), (wider, "KV heads of size 32")]:
            other.set_attn_implementation(ATTN_IMPLEMENTATION)
            cache = PagedCache(llama, block_size=BLOCK, num_blocks=16)
            with pytest.raises(ValueError, match=message):
                other.generate(input_ids=ids, max_new_tokens=2, cache=cache)
            assert cache.block_manager.seq_ids() == []
        # The cache's own model switched to paged attention, the model using it not.
        cache = PagedCache(llama, block_size=BLOCK, num_blocks=16)
        with pytest.raises(ValueError, match="did not run through"):
            deeper.set_attn_implementation("sdpa")
            deeper.generate(input_ids=ids, max_new_tokens=2, cache=cache)
    finally:
        llama.set_attn_implementation("sdpa")


def test_training_mode_raises_instead_of_dropping_key_value_gradients(llama):
    llama.set_attn_implementation(ATTN_IMPLEMENTATION)
    cache = PagedCache(llama, block_size=BLOCK, num_blocks=16)
    llama.train()
    try:
        with pytest.raises(RuntimeError, match="inference-only"):
            llama(input_ids=torch.tensor([[5, 6, 7]]), cache=cache)
        assert cache.block_manager.seq_ids() == []  # refused before any block was reserved
    finally:
        llama.eval()
        llama.set_attn_implementation("sdpa")


def test_out_of_blocks_says_what_to_change(llama):
    llama.set_attn_implementation(ATTN_IMPLEMENTATION)
    cache = PagedCache(llama, block_size=BLOCK, num_blocks=2)
    try:
        with pytest.raises(OutOfBlocksError, match="num_blocks=.*reset"):
            llama.generate(input_ids=torch.tensor([[5, 6, 7]] * 2), max_new_tokens=20, cache=cache)
        cache.reset()
        assert cache.block_manager.num_free_device_blocks() == 2
    finally:
        llama.set_attn_implementation("sdpa")


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e5m2"])
def test_fp8_kv_cache_stays_close_to_the_default_cache(llama, kv_cache_dtype):
    ids, mask = left_padded([9, 14], seed=9)
    step_mask = torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], 1)
    new = torch.tensor([[17], [42]])
    dense = DynamicCache(config=llama.config)
    llama.set_attn_implementation("sdpa")
    with torch.no_grad():
        want = [
            llama(input_ids=ids, attention_mask=mask, cache=dense).logits,
            llama(input_ids=new, attention_mask=step_mask, cache=dense).logits,
        ]
        llama.set_attn_implementation(ATTN_IMPLEMENTATION)
        cache = PagedCache(llama, BLOCK, 32, kv_cache_dtype=kv_cache_dtype)
        got = [
            llama(input_ids=ids, attention_mask=mask, cache=cache).logits,
            llama(input_ids=new, attention_mask=step_mask, cache=cache).logits,
        ]
    llama.set_attn_implementation("sdpa")
    assert cache.kv_cache.key_caches[0].dtype == torch.uint8
    assert (
        cache.kv_cache.bytes_per_block * 4 == PagedCache(llama, BLOCK, 1).kv_cache.bytes_per_block
    )
    real = mask.bool()
    torch.testing.assert_close(got[0][real], want[0][real], atol=0.06, rtol=0)
    torch.testing.assert_close(got[1], want[1], atol=0.06, rtol=0)
    assert not torch.equal(got[0][real], want[0][real])  # the values really were quantised


def count_varlen_rows(monkeypatch):
    """Spy on the varlen op: the longest query of each call."""
    from paged_attention.ops import bindings as _ops

    calls = []
    original = _ops.paged_attention_varlen

    def spy(*args, **kwargs):
        calls.append(kwargs["max_query_len"])
        return original(*args, **kwargs)

    monkeypatch.setattr(_ops, "paged_attention_varlen", spy)
    return calls


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize("mode", ["assistant", "prompt lookup"])
def test_assisted_generation_matches_the_default_cache(kind, mode, monkeypatch):
    target = build(kind)
    torch.manual_seed(99)
    assistant = LlamaForCausalLM(LlamaConfig(**{**COMMON, "num_hidden_layers": 1})).eval()
    gen = torch.Generator().manual_seed(3)
    phrase = torch.randint(3, 96, (6,), generator=gen).tolist()
    ids = torch.tensor([phrase * 3 + torch.randint(3, 96, (5,), generator=gen).tolist()])
    extra = (
        dict(assistant_model=assistant) if mode == "assistant" else dict(prompt_lookup_num_tokens=4)
    )
    kwargs = dict(input_ids=ids, max_new_tokens=30, do_sample=False, **extra)
    expected, got, cache = generate_both(target, **kwargs)
    calls = count_varlen_rows(monkeypatch)
    target.set_attn_implementation(ATTN_IMPLEMENTATION)
    cache.reset()
    again = target.generate(**kwargs, cache=cache)
    target.set_attn_implementation("sdpa")
    assert torch.equal(got, expected) and torch.equal(again, expected)
    # Draft tokens were verified several at a time (the prefill is the first call).
    assert max(calls[1:], default=0) > 1
    assert cache.block_manager.stats().device.used_blocks <= math.ceil(again.shape[1] / BLOCK)


def test_crop_drops_the_last_tokens_of_every_row(llama):
    llama.set_attn_implementation(ATTN_IMPLEMENTATION)
    try:
        cache = PagedCache(llama, block_size=BLOCK, num_blocks=32)
        ids, mask = left_padded([9, 11, 17], seed=4)
        with torch.no_grad():
            llama(input_ids=ids, attention_mask=mask, cache=cache)
        rows = list(cache._rows)
        lengths = [cache.block_manager.num_tokens(s) for s in rows]
        cache.crop(-4)
        assert [cache.block_manager.num_tokens(s) for s in rows] == [n - 4 for n in lengths]
        assert cache.get_seq_length() == 17 - 4
        cache.crop(10)  # a positive argument is the length to keep
        assert cache.get_seq_length() == 10
        assert [cache.block_manager.num_tokens(s) for s in rows] == [n - 7 for n in lengths]
        with pytest.raises(ValueError, match="cannot crop 3 tokens"):
            cache.crop(-3)  # the shortest row holds only 2 real tokens
        assert [cache.block_manager.num_tokens(s) for s in rows] == [n - 7 for n in lengths]
        cache.crop(0)  # keeps everything
        assert cache.get_seq_length() == 10
    finally:
        llama.set_attn_implementation("sdpa")


# ------------------------------------------------------------------------------------------
# Every call is checked against what the cache was built for


def read_as(cache, **changes):
    """Make ``cache`` believe layer 0 reads otherwise (as a model read wrongly would)."""
    layers = list(cache.geometry.layers)
    layers[0] = dataclasses.replace(layers[0], **changes)
    cache.geometry = dataclasses.replace(cache.geometry, layers=tuple(layers))


@pytest.mark.parametrize(
    "kind, changes, message",
    [
        ("mistral", dict(sliding_window=0), "attends with a sliding window of 12, but its config"),
        ("llama", dict(sliding_window=5), "attends with full attention, but its config reads"),
        ("llama", dict(logits_soft_cap=5.0), "no logit soft-cap, but its config reads as a logit"),
        ("llama", dict(sinks=True), "has no attention sinks"),
    ],
)
def test_a_layer_read_wrongly_raises_before_anything_is_computed(kind, changes, message):
    model = build(kind)
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    cache = PagedCache(model, block_size=BLOCK, num_blocks=16)
    read_as(cache, **changes)
    ids, mask = left_padded([9, 14])
    with pytest.raises(ValueError, match=message):
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=2, cache=cache)
    assert cache.block_manager.seq_ids() == []


def probe(mask_function, local_size=None, padding=None):
    return MaskPattern(mask_function, local_size, padding, None).attended()


def test_the_mask_probe_tells_causal_windows_and_chunks():
    assert probe(masking_utils.causal_mask_function) == (0, 0)
    window = masking_utils.sliding_window_causal_mask_function(5)
    assert probe(window, 5) == (5, 0)
    assert probe(window) == (5, 0)  # the local size not named: probed far into the sequence
    # Chunks count from a row's first real token: 3 left pads here.
    padding = torch.tensor([[False] * 3 + [True] * 40])
    chunks = masking_utils.chunked_causal_mask_function(4, torch.tensor([3]))
    assert probe(chunks, 4, padding) == (0, 4)
    with pytest.raises(ValueError, match="not one run ending at the query"):
        probe(masking_utils.bidirectional_mask_function)


def test_the_mask_function_passes_the_padding_on_with_its_pattern():
    padding = torch.tensor([[0, 1, 1], [1, 1, 1]], dtype=torch.bool)
    carried = paged_attention_mask(
        attention_mask=padding, mask_function=masking_utils.causal_mask_function
    )
    assert carried is not padding and torch.equal(carried, padding)
    assert carried.paged_attention_pattern.padding is padding
    empty = paged_attention_mask(attention_mask=None, mask_function=None, local_size=7)
    assert empty.numel() == 0 and empty.paged_attention_pattern.local_size == 7


def test_generate_takes_the_cache_under_transformers_current_keyword(llama):
    # cache=... where the installed transformers names it so, past_key_values where it does not:
    # either way no deprecation warning.
    llama.set_attn_implementation(ATTN_IMPLEMENTATION)
    try:
        cache = PagedCache(llama, block_size=BLOCK, num_blocks=16)
        with warnings.catch_warnings():
            warnings.simplefilter("error", FutureWarning)
            llama.generate(
                input_ids=torch.tensor([[5, 6, 7]]),
                max_new_tokens=3,
                **{cache_argument_name(llama): cache},
            )
    finally:
        llama.set_attn_implementation("sdpa")
    assert cache.get_seq_length() == 5


def test_fp8_generate_matches_an_fp8_reference_with_calibrated_scales(llama):
    # Issue 28: fp8 through PagedCache used scales of 1.0 with no way to pass others. Each
    # layer's scales now come from the prompt's keys and values (or are given); generate()
    # equals transformers' own attention over keys and values quantised with those scales.
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from paged_attention.ops import reference

    small = build("llama")  # keys and values far below 1: scale 1.0 leaves them subnormal
    with torch.no_grad():
        for layer in small.model.layers:
            layer.self_attn.k_proj.weight.mul_(0.01)
            layer.self_attn.v_proj.weight.mul_(0.01)
    ids, _ = left_padded([20], seed=3)
    small.set_attn_implementation("sdpa")
    with torch.no_grad():
        dense = small(ids).logits
    small.set_attn_implementation(ATTN_IMPLEMENTATION)
    calibrated = PagedCache(small, BLOCK, 32, kv_cache_dtype="fp8")
    fixed = PagedCache(small, BLOCK, 32, kv_cache_dtype="fp8", k_scale=1.0, v_scale=1.0)
    with torch.no_grad():
        errors = [(small(ids, cache=c).logits - dense).abs().max() for c in (calibrated, fixed)]
    assert errors[0] < errors[1] / 5
    scales = calibrated.kv_cache.scales
    assert all(0 < s.item() < 1e-3 for layer in range(2) for s in scales(layer))

    def fp8_reference(module, query, key, value, attention_mask, **kwargs):
        quantised = []
        for states, scale in zip((key, value), scales(module.layer_idx)):
            stored = reference.quantize(states, "fp8", scale)
            quantised.append(reference.dequantize(stored, "fp8", scale).to(states.dtype))
        return sdpa_attention_forward(module, query, *quantised, attention_mask, **kwargs)

    AttentionInterface.register("fp8_reference", fp8_reference)
    small.set_attn_implementation(ATTN_IMPLEMENTATION)
    cache = PagedCache(small, BLOCK, 32, kv_cache_dtype="fp8")
    got = small.generate(ids, max_new_tokens=12, do_sample=False, cache=cache)
    small.set_attn_implementation("fp8_reference")
    want = small.generate(ids, max_new_tokens=12, do_sample=False)
    assert got.tolist() == want.tolist()
