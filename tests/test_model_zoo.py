"""Every supported decoder-only architecture, token for token against transformers' default cache.

Each model type gets a tiny random model built from transformers' own config class (two layers,
a mix of full and windowed or chunked layers where the family has one, fixed seeds) with weights
large enough (``initializer_range=0.1``) that attention is far from uniform: for every type a
25% error in the softmax scale changes the tokens, and for each attention feature (window,
chunks, soft-cap, sinks) ignoring it does. Through ``generate()`` (greedy, sampling, beams on a
left-padded batch, prompt-lookup decoding, which crops rejected drafts) and through the Engine
(prefix caching, chunked prefill, swap and recompute preemption, released blocks), a model on a
:class:`PagedCache` gives exactly the tokens of the same model on its default cache and attention
implementation. Hybrid families (attention layers beside convolution, Mamba or linear-attention
layers with a fixed-size state per sequence) give the default cache's tokens through
``generate()`` (greedy, sampling, beams) and through the Engine (continuous batching with a
step's decodes in one batched pass, chunked prefill, recompute preemption), their states in
per-sequence slots. The families paged attention cannot serve are
refused at construction, each with its reason."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers import AutoConfig  # noqa: E402
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING  # noqa: E402
from transformers.models.minimax.modeling_minimax import MiniMaxCache  # noqa: E402

from paged_attention.engine import Engine, SamplingParams  # noqa: E402
from paged_attention.engine.hybrid_runner import HybridRunner  # noqa: E402
from paged_attention.integrations.transformers import (  # noqa: E402
    ATTN_IMPLEMENTATION,
    PagedCache,
)
from paged_attention.kv.block_manager import RELEASED, OutOfBlocksError  # noqa: E402
from paged_attention.modeling.geometry import ModelGeometry, UnsupportedModelError  # noqa: E402
from paged_attention.modeling.hybrid import BatchStates  # noqa: E402
from paged_attention.modeling.transformers_backend import cache_argument_name  # noqa: E402

VOCAB = 128
BLOCK = 8
WINDOW = 12  # shorter than the prompts: windowed layers really slide
CHUNK = 16
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=128,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,  # GQA where the family has it
    head_dim=32,
    max_position_embeddings=256,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    initializer_range=0.1,
    tie_word_embeddings=False,
)
SLIDE, FULL = "sliding_attention", "full_attention"
MIXED = dict(layer_types=[SLIDE, FULL], sliding_window=WINDOW)
MOE = dict(num_local_experts=4, num_experts_per_tok=2)
# Multi-head latent attention: the cache gets the compressed latents, the attention interface
# keys of qk_nope + qk_rope dims and values of v_head_dim (DeepSeek-V3's 128 + 64 and 128), one
# head each per query head; rotary embeddings on the rope part only (head_dim is its size).
LATENT = dict(
    head_dim=64,
    num_key_value_heads=4,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    kv_lora_rank=32,
    q_lora_rank=48,
    n_routed_experts=4,
)
# Per model type: what its tiny config sets besides COMMON (the keys its class knows).
DEEPSEEK_V3 = dict(
    LATENT,
    num_experts_per_tok=2,
    n_group=1,
    topk_group=1,
    first_k_dense_replace=1,
    moe_intermediate_size=64,
)
ZOO = {
    "llama": {},
    "mistral": dict(sliding_window=WINDOW),
    "ministral": MIXED,
    "mixtral": dict(MOE, sliding_window=WINDOW),
    "qwen2": dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),
    "qwen2_moe": dict(
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=64,
    ),
    "qwen3": dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64),
    "gemma": {},
    "gemma2": dict(MIXED, attn_logit_softcapping=2.0, query_pre_attn_scalar=32),
    "gemma3_text": dict(MIXED, query_pre_attn_scalar=32),
    # layers of two head sizes (the full-attention layer's heads are wider)
    "gemma4_text": dict(
        MIXED,
        per_layer_config={1: {"head_dim": 64}},
        vocab_size_per_layer_input=VOCAB,
        hidden_size_per_layer_input=16,
    ),
    # KV sharing: the last two layers (sliding, full) attend over the keys and values layers 1
    # and 2 store, and hold no cache of their own; AltUp, laurel, per-layer inputs, and
    # activation sparsity on the first layer
    "gemma3n_text": dict(
        num_hidden_layers=5,
        layer_types=[SLIDE, SLIDE, FULL, SLIDE, FULL],
        sliding_window=WINDOW,
        num_kv_shared_layers=2,
        vocab_size_per_layer_input=VOCAB,
        hidden_size_per_layer_input=16,
        laurel_rank=8,
        activation_sparsity_pattern=[0.95, 0.0, 0.0, 0.0, 0.0],
    ),
    "phi": {},
    "phi3": dict(sliding_window=WINDOW),
    "phimoe": dict(MOE, sliding_window=WINDOW),
    "gpt2": {},
    "gpt_neox": {},
    "gptj": dict(rotary_dim=16),
    "codegen": dict(rotary_dim=16),
    "opt": dict(ffn_dim=128, word_embed_proj_dim=128, init_std=0.1),
    "starcoder2": dict(sliding_window=WINDOW),
    "gpt_bigcode": {},  # multi-query: one KV head
    "falcon": {},  # multi-query, fused q/k/v
    "stablelm": {},
    "persimmon": {},
    "cohere": {},
    "cohere2": MIXED,
    "granite": {},
    "granitemoe": MOE,
    "olmo": {},
    "olmo2": {},
    "olmo3": MIXED,
    "olmoe": dict(num_experts=4, num_experts_per_tok=2),
    "glm": {},
    "glm4": {},
    "helium": {},
    "smollm3": {},
    "gpt_oss": dict(MIXED, **MOE),
    "exaone4": MIXED,
    "ernie4_5": {},
    "internlm3": {},
    "nemotron": {},
    "apertus": {},
    "arcee": {},
    "seed_oss": {},
    "hunyuan_v1_dense": {},
    "hunyuan_v1_moe": dict(num_experts=4, moe_topk=2),
    "glm4_moe": dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=64),
    "minimax_m2": dict(num_local_experts=4, num_experts_per_tok=2),
    "dots1": dict(
        n_routed_experts=4,
        n_shared_experts=1,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        first_k_dense_replace=1,  # a dense layer, then an MoE one
    ),
    # a chunked layer (with rotary embeddings) and a full one (without: NoPE)
    "llama4_text": dict(
        MOE,
        attention_chunk_size=CHUNK,
        layer_types=["chunked_attention", "full_attention"],
        no_rope_layers=[1, 0],
        intermediate_size_mlp=128,
    ),
    "deepseek_v3": DEEPSEEK_V3,
    # DeepSeek-V2-Lite's form: no query compression; keys of 64 + 64, values of 64
    "deepseek_v2": dict(
        LATENT,
        qk_nope_head_dim=64,
        v_head_dim=64,
        q_lora_rank=None,
        num_experts_per_tok=2,
        first_k_dense_replace=1,
        moe_intermediate_size=64,
    ),
    # DeepSeek sparse attention: each query reads the 8 cached tokens its indexer scores highest
    "deepseek_v32": dict(DEEPSEEK_V3, index_topk=8),
    # one decoder layer of two latent attention sublayers (layer indices 0 and 1), zero experts
    "longcat_flash": dict(
        LATENT,
        num_layers=1,
        zero_expert_num=2,
        moe_topk=2,
        ffn_hidden_size=128,
        expert_ffn_hidden_size=64,
    ),
}
# Hybrid families (a full-attention layer and a layer with a conv or recurrent state, or one
# layer of both): served by generate() on a PagedCache and by the engine, states in slots.
HYBRID = {
    "lfm2": dict(full_attn_idxs=[1]),
    "lfm2_moe": dict(layer_types=["conv", "full_attention"]),
    "qwen3_next": dict(
        num_experts=4, num_experts_per_tok=2, layer_types=["linear_attention", "full_attention"]
    ),
    "qwen3_5_text": dict(layer_types=["linear_attention", "full_attention"]),
    "granitemoehybrid": dict(layer_types=["mamba", "attention"]),
    "bamba": dict(attn_layer_indices=[1]),
    "jamba": dict(attn_layer_period=2, attn_layer_offset=1),
    "falcon_h1": {},  # every layer attends and runs a Mamba mixer beside
    "nemotron_h": {},  # Mamba, MoE, attention and MLP layers
    "zamba2": dict(layers_block_type=["mamba", "hybrid"]),
    "kimi_linear": dict(layer_types=["linear_attention", "full_attention"], num_key_value_heads=4),
    "olmo_hybrid": {},
    "zamba": dict(num_hidden_layers=3),
    # lightning attention (state in MiniMaxCache's get/set_linear_cache) in blocks of 8 tokens,
    # so prompts run as several blocks
    "minimax": dict(MOE, layer_types=["full_attention", "linear_attention"], block_size=8),
}
# Per refused family: its tiny config and the reason the refusal must name.
REFUSED = {
    "bloom": ({}, "computes attention in its own code"),
    "mpt": ({}, "computes attention in its own code"),
    "glm_moe_dsa": ({}, "sparse attention: a lightning indexer"),  # DeepSeek-V3.2's is served
    "kimi_linear": ({}, "has no attention layer"),  # its default: linear-attention layers only
}


def build(
    model_type: str, device: str = "cpu", family: dict | None = None, **overrides
) -> torch.nn.Module:
    """A tiny random ``model_type`` causal LM: COMMON's keys its config class knows, then the
    family's own settings (``family``, else its ZOO or HYBRID entry), then ``overrides``. On
    the meta device it holds no weights."""
    default = AutoConfig.for_model(model_type)
    known = {*default.to_dict(), *getattr(default, "attribute_map", {})}
    derived = {
        key for key in known if getattr(getattr(type(default), key, None), "fset", 0) is None
    }
    common = {key: value for key, value in COMMON.items() if key in known - derived}
    if family is None:
        family = ZOO[model_type] if model_type in ZOO else HYBRID[model_type]
    config = AutoConfig.for_model(model_type, **{**common, **family, **overrides})
    torch.manual_seed(0)
    with torch.device(device):
        return MODEL_FOR_CAUSAL_LM_MAPPING[type(config)](config).eval()


class BeamReorderingMiniMaxCache(MiniMaxCache):
    """transformers' MiniMaxCache, whose beam search reorders the key/value layers but leaves
    the lightning-attention states with the beams they were computed for: the reference cache
    reorders both."""

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        self.linear_cache = [
            state if isinstance(state, list) else state.index_select(0, beam_idx.to(state.device))
            for state in self.linear_cache
        ]


def left_padded(lengths, seed=0, repeat=None):
    """A left-padded batch of random prompts (``repeat``: each prompt is that phrase three
    times and a tail, so prompt lookup finds drafts)."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for n in lengths:
        if repeat:
            phrase = torch.randint(3, VOCAB, (repeat,), generator=gen).tolist()
            rows.append(phrase * 3 + torch.randint(3, VOCAB, (n,), generator=gen).tolist())
        else:
            rows.append(torch.randint(3, VOCAB, (n,), generator=gen).tolist())
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, tokens in enumerate(rows):
        ids[row, width - len(tokens) :] = torch.tensor(tokens)
        mask[row, width - len(tokens) :] = 1
    return ids, mask


class Zoo:
    """A model and the attention implementation it came with (transformers' default)."""

    def __init__(self, model_type: str, **overrides) -> None:
        self.model_type = model_type
        self.model = build(model_type, **overrides)
        self.default = self.model.config._attn_implementation

    def generate(self, paged: bool, seed: int = 7, **kwargs) -> torch.Tensor:
        """``generate`` on the default cache, or on a fresh PagedCache."""
        model = self.model
        extra = {}
        if paged:
            model.set_attn_implementation(ATTN_IMPLEMENTATION)
            extra["cache"] = PagedCache(model, block_size=BLOCK, num_blocks=96)
        elif self.model_type == "minimax":
            extra["cache"] = BeamReorderingMiniMaxCache()
        try:
            torch.manual_seed(seed)
            return model.generate(**kwargs, **extra, pad_token_id=0)
        finally:
            model.set_attn_implementation(self.default)

    def greedy(self, prompt: list[int], max_new_tokens: int) -> list[int]:
        ids = torch.tensor([prompt])
        out = self.generate(
            False,
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=None,
        )
        return out[0, len(prompt) :].tolist()


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models run fastest on one thread; more only wait for each other (and, on a busy
    machine, for cores)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module", params=sorted(ZOO))
def zoo(request) -> Zoo:
    return Zoo(request.param)


def test_generate_matches_the_default_cache(zoo):
    ids, mask = left_padded([5, 11, 19])
    batch = dict(input_ids=ids, attention_mask=mask, eos_token_id=None)
    greedy = dict(batch, max_new_tokens=12, do_sample=False)
    expected = zoo.generate(False, **greedy)
    assert torch.equal(zoo.generate(True, **greedy), expected), f"{zoo.model_type}: greedy"
    # The weights make attention matter: 25% off in the softmax scale changes the tokens.
    modules = [m for m in zoo.model.modules() if isinstance(getattr(m, "scaling", None), float)]
    assert modules
    for module in modules:
        module.scaling *= 1.25
    try:
        assert not torch.equal(zoo.generate(False, **greedy), expected)
    finally:
        for module in modules:
            module.scaling /= 1.25
    lookup_ids, _ = left_padded([5], seed=1, repeat=6)
    calls = {
        "sampling": dict(batch, max_new_tokens=8, do_sample=True, top_k=20, num_return_sequences=2),
        "beams": dict(batch, max_new_tokens=8, num_beams=2, num_return_sequences=2),
        "prompt lookup": dict(input_ids=lookup_ids, max_new_tokens=12, prompt_lookup_num_tokens=3),
    }
    for name, kwargs in calls.items():
        expected = zoo.generate(False, **kwargs)
        assert torch.equal(zoo.generate(True, **kwargs), expected), f"{zoo.model_type}: {name}"


def test_engine_matches_the_default_cache(zoo):
    gen = torch.Generator().manual_seed(2)
    system = torch.randint(3, VOCAB, (2 * BLOCK + 3,), generator=gen).tolist()
    prompts = [system + torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in (2, 7)]
    prompts += [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in (13, 20)]
    new = 10
    expected = [zoo.greedy(prompt, new) for prompt in prompts]
    setups = {  # 12 blocks of 8 are too few for the four at once: requests are preempted
        "prefix caching, chunked prefill, swap": dict(
            max_num_batched_tokens=12, max_num_seqs=4, num_host_blocks=48
        ),
        "prefix caching, recompute": dict(num_host_blocks=0),
    }
    window, chunk = ModelGeometry.of(zoo.model).released_reach()
    if window or chunk:  # without prefix caching, blocks no layer reads are released
        setups["releasing blocks"] = dict(enable_prefix_caching=False)
    for name, setup in setups.items():
        engine = Engine(zoo.model, num_blocks=12, block_size=BLOCK, eos_token_id=[], **setup)
        try:
            outputs = engine.generate(prompts, SamplingParams(new))
        finally:
            zoo.model.set_attn_implementation(zoo.default)
        assert [o.outputs[0] for o in outputs] == expected, f"{zoo.model_type}: {name}"
        stats = engine.stats
        if name == "releasing blocks":
            assert engine.block_manager.reach.releases
        else:
            assert stats.prompt_tokens_cached > 0, name
            preempted = stats.swaps_out if "swap" in name else stats.preemptions_by_recompute
            assert preempted > 0, name


@pytest.fixture(scope="module", params=sorted(HYBRID))
def hybrid(request) -> Zoo:
    return Zoo(request.param)


def test_hybrid_generate_matches_the_default_cache(hybrid, monkeypatch):
    """Keys and values in paged blocks, conv and recurrent states in state slots: greedy,
    sampling and beam search on a left-padded batch give the default cache's tokens; both the
    attention and the carried state matter to them."""
    ids, mask = left_padded([5, 11, 19])
    batch = dict(input_ids=ids, attention_mask=mask, eos_token_id=None)
    greedy = dict(batch, max_new_tokens=12, do_sample=False)
    expected = hybrid.generate(False, **greedy)
    assert torch.equal(hybrid.generate(True, **greedy), expected), hybrid.model_type
    modules = [m for m in hybrid.model.modules() if isinstance(getattr(m, "scaling", None), float)]
    assert modules and ModelGeometry.of(hybrid.model).state_layers
    for module in modules:
        module.scaling *= 1.25
    try:
        assert not torch.equal(hybrid.generate(False, **greedy), expected)
    finally:
        for module in modules:
            module.scaling /= 1.25
    update_conv = BatchStates.update_conv

    def forgetful_update_conv(self, *args):
        self.previous.clear()
        return update_conv(self, *args)

    with monkeypatch.context() as patch:  # a cache that forgot the states between steps
        patch.setattr(BatchStates, "get", lambda self, layer, kind, index: None)
        patch.setattr(BatchStates, "update_conv", forgetful_update_conv)
        assert not torch.equal(hybrid.generate(True, **greedy), expected)
    calls = {
        "sampling": dict(batch, max_new_tokens=8, do_sample=True, top_k=20, num_return_sequences=2),
        "beams": dict(batch, max_new_tokens=8, num_beams=2, num_return_sequences=2),
    }
    for name, kwargs in calls.items():
        expected = hybrid.generate(False, **kwargs)
        assert torch.equal(hybrid.generate(True, **kwargs), expected), (
            f"{hybrid.model_type}: {name}"
        )


def test_hybrid_engine_matches_the_default_cache(hybrid):
    """The Engine runs a step's decodes of a hybrid model in one batched pass and each prompt
    chunk in a pass of its own, carrying the state from chunk to chunk and from step to step in
    the sequence's slot: four requests of different lengths at once, with chunked prefill and
    preemption by recompute, give generate()'s greedy tokens on the default cache."""
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in (21, 26, 13, 20)]
    new = 10
    expected = [hybrid.greedy(prompt, new) for prompt in prompts]
    setups = {  # 12 blocks of 8 are too few for the four at once: requests are preempted
        "chunked prefill, recompute": dict(max_num_batched_tokens=12, max_num_seqs=4),
        "recompute": dict(num_host_blocks=48),  # no swapping: the states stay in their slots
    }
    forward_rows = HybridRunner._forward_rows
    for name, setup in setups.items():
        engine = Engine(hybrid.model, num_blocks=12, block_size=BLOCK, eos_token_id=[], **setup)
        rows = []  # the rows of every pass: a step's decodes are one pass

        def recording(runner, tokens, *args, rows=rows):
            rows.append(len(tokens))
            return forward_rows(runner, tokens, *args)

        try:
            with pytest.MonkeyPatch.context() as patch:
                patch.setattr(HybridRunner, "_forward_rows", recording)
                outputs = engine.generate(prompts, SamplingParams(new))
        finally:
            hybrid.model.set_attn_implementation(hybrid.default)
        assert [o.outputs[0] for o in outputs] == expected, f"{hybrid.model_type}: {name}"
        assert engine.stats.preemptions_by_recompute > 0 and engine.stats.swaps_out == 0, name
        assert engine.block_manager.state_stats().used_slots == 0  # every slot back
        assert max(rows) >= 2, name  # requests of different lengths decoded together


def test_what_a_hybrid_state_cannot_do_is_refused_with_the_reason():
    zoo = Zoo("lfm2")
    lookup_ids, _ = left_padded([5], seed=1, repeat=6)
    with pytest.raises(ValueError, match="cannot roll it back to an earlier token"):
        zoo.generate(True, input_ids=lookup_ids, max_new_tokens=4, prompt_lookup_num_tokens=3)
    cache = PagedCache(zoo.model, block_size=BLOCK, num_blocks=8)
    assert not cache.is_croppable
    with pytest.raises(ValueError, match="cannot roll it back"):
        cache.crop(-1)
    with pytest.raises(ValueError, match="prefix caching cannot serve a hybrid model"):
        PagedCache(zoo.model, block_size=BLOCK, num_blocks=8, enable_prefix_caching=True)
    with pytest.raises(ValueError, match="compile=True and cuda_graphs=True"):
        Engine(zoo.model, num_blocks=8, block_size=BLOCK, compile=True)
    with pytest.raises(ValueError, match="speculative decoding is refused"):
        Engine(zoo.model, num_blocks=8, block_size=BLOCK, speculative={})
    engine = Engine(zoo.model, num_blocks=8, block_size=BLOCK)
    zoo.model.set_attn_implementation(zoo.default)
    assert not engine.block_manager.enable_prefix_caching  # turned off, with a warning


def test_a_hybrid_cache_counts_its_state_slots():
    zoo = Zoo("qwen3_next")
    zoo.model.set_attn_implementation(ATTN_IMPLEMENTATION)
    cache = PagedCache(zoo.model, block_size=BLOCK, num_blocks=96, num_state_slots=8)
    ids, mask = left_padded([5, 11, 19])
    try:
        zoo.model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=4,
            num_beams=2,
            cache=cache,
            pad_token_id=0,
            eos_token_id=None,
        )
    finally:
        zoo.model.set_attn_implementation(zoo.default)
    stats = cache.state_stats()
    assert (stats.num_slots, stats.used_slots, stats.free_slots) == (8, 6, 2)
    # one linear-attention layer: its conv window and its recurrent state, per sequence
    conv, recurrent = (cache._states.tensors[(0, kind, 0)] for kind in ("conv", "recurrent"))
    assert stats.bytes_per_slot == (conv[0].numel() + recurrent[0].numel()) * 4
    cache.reset()
    assert cache.state_stats().used_slots == 0
    too_few = PagedCache(zoo.model, block_size=BLOCK, num_blocks=96, num_state_slots=2)
    zoo.model.set_attn_implementation(ATTN_IMPLEMENTATION)
    try:
        with pytest.raises(OutOfBlocksError, match="state slots"):
            zoo.model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=2,
                cache=too_few,
                pad_token_id=0,
            )
    finally:
        zoo.model.set_attn_implementation(zoo.default)
    assert too_few.state_stats().used_slots == 0


def test_a_hybrid_cache_budget_holds_its_state_slots_first():
    zoo = Zoo("qwen3_next")
    counted = PagedCache(zoo.model, block_size=BLOCK, num_blocks=4, num_state_slots=1)
    zoo.model.set_attn_implementation(ATTN_IMPLEMENTATION)
    try:
        zoo.model.generate(
            input_ids=left_padded([5])[0], max_new_tokens=1, cache=counted, pad_token_id=0
        )
    finally:
        zoo.model.set_attn_implementation(zoo.default)
    # one linear-attention layer's conv window and recurrent state, as generate() left them
    slot_bytes = sum(t[0].numel() * t.element_size() for t in counted._states.tensors.values())
    block_bytes = counted.kv_cache.bytes_per_block
    assert slot_bytes > 0
    budget = 3 * slot_bytes + 10 * block_bytes + block_bytes // 2
    cache = PagedCache(zoo.model, block_size=BLOCK, max_memory=budget, num_state_slots=3)
    assert cache.kv_cache.num_blocks == 10  # the states of 3 sequences came out of the budget
    assert zoo.model.config._attn_implementation == zoo.default  # the probe put it back
    assert cache.blocks_in_use() == 0 and cache.state_stats().used_slots == 0
    explicit = PagedCache(zoo.model, block_size=BLOCK, num_blocks=10, num_state_slots=300)
    assert explicit.kv_cache.num_blocks == 10  # an explicit block count is kept as given
    with pytest.raises(ValueError, match=r"max_memory=.*num_state_slots=3 .*no KV block"):
        PagedCache(zoo.model, block_size=BLOCK, max_memory=3 * slot_bytes, num_state_slots=3)
    with pytest.raises(ValueError, match="num_state_slots must be at least 1"):
        PagedCache(zoo.model, block_size=BLOCK, max_memory=budget, num_state_slots=0)
    with pytest.raises(TypeError, match="num_state_slots must be an int"):
        PagedCache(zoo.model, block_size=BLOCK, max_memory=budget, num_state_slots="3")


@pytest.mark.parametrize("model_type", sorted(REFUSED))
def test_unsupported_families_are_refused_with_the_reason(model_type):
    model = build(
        model_type, device="meta", family=REFUSED[model_type][0]
    )  # refused before any weight is read
    message = REFUSED[model_type][1]
    with pytest.raises(UnsupportedModelError, match=message):
        PagedCache(model, block_size=BLOCK, num_blocks=8)
    with pytest.raises(UnsupportedModelError, match=message):
        Engine(model, num_blocks=8, block_size=BLOCK)


def test_falcon_with_alibi_is_refused_with_the_reason():
    model = build("falcon", device="meta", alibi=True)
    with pytest.raises(UnsupportedModelError, match="ALiBi"):
        PagedCache(model, block_size=BLOCK, num_blocks=8)
    with pytest.raises(UnsupportedModelError, match="ALiBi"):
        Engine(model, num_blocks=8, block_size=BLOCK)


# Each attention feature, removed from the config: the tokens change, so a paged attention that
# ignored it would fail the equality tests above.
FEATURES = [
    pytest.param("mistral", dict(sliding_window=None), id="sliding window"),
    pytest.param("gemma2", dict(attn_logit_softcapping=None), id="logit soft-cap"),
    pytest.param("llama4_text", dict(attention_chunk_size=4 * CHUNK), id="attention chunks"),
]


@pytest.mark.parametrize("model_type, without", FEATURES)
def test_ignoring_an_attention_feature_changes_the_tokens(model_type, without):
    ids, mask = left_padded([5, 11, 19])
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=16, do_sample=False)
    with_it, without_it = Zoo(model_type), Zoo(model_type, **without)
    assert not torch.equal(with_it.generate(False, **kwargs), without_it.generate(False, **kwargs))


def test_attention_sinks_change_the_tokens():
    zoo = Zoo("gpt_oss")
    ids, mask = left_padded([5, 11, 19])
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=16, do_sample=False)
    right = zoo.generate(False, **kwargs)
    sinks = [m.sinks for m in zoo.model.modules() if hasattr(m, "sinks")]
    assert ModelGeometry.of(zoo.model).layers[0].sinks
    with torch.no_grad():
        for parameter in sinks:
            parameter.fill_(-1e4)  # a sink that takes no share of the softmax: as if absent
    assert not torch.equal(zoo.generate(False, **kwargs), right)


def test_a_model_of_chunked_layers_only_releases_what_no_chunk_reads():
    zoo = Zoo("llama4_text", layer_types=["chunked_attention"] * 2, no_rope_layers=[1, 1])
    ids, mask = left_padded([5, 11, 19])
    greedy = dict(input_ids=ids, attention_mask=mask, max_new_tokens=30, do_sample=False)
    zoo.model.set_attn_implementation(ATTN_IMPLEMENTATION)
    cache = PagedCache(zoo.model, block_size=BLOCK, num_blocks=96)
    try:
        got = zoo.model.generate(**greedy, cache=cache, pad_token_id=0, eos_token_id=None)
    finally:
        zoo.model.set_attn_implementation(zoo.default)
    assert torch.equal(got, zoo.generate(False, **greedy, eos_token_id=None))
    assert cache.block_manager.attention_chunk_size == CHUNK
    # The longest row holds 19 + 30 - 1 tokens: the blocks before its last token's chunk (from
    # position 32) went back to the pool.
    released = cache.block_manager.block_table(cache._rows[2])[: 32 // BLOCK]
    assert released == [RELEASED] * (32 // BLOCK)
    test_engine_matches_the_default_cache(zoo)  # releasing blocks there too


def test_a_latent_model_of_other_value_heads_than_its_cache_is_refused():
    """In the expanded form the attention function checks each layer's value heads against what
    the cache was built for, so a cache used by another model raises rather than storing values
    in the wrong shape (the latent form's check: tests/test_mla.py)."""
    built_for = build("deepseek_v3")
    other = build("deepseek_v3", v_head_dim=64)
    cache = PagedCache(built_for, block_size=BLOCK, num_blocks=8, mla="expanded")
    for model in (built_for, other):
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
    ids = torch.randint(3, VOCAB, (1, 5))
    with (
        torch.no_grad(),
        pytest.raises(ValueError, match="128 in layer 0; the model using it has 4 of size 64"),
    ):
        other(input_ids=ids, use_cache=True, **{cache_argument_name(other): cache})
