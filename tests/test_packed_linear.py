"""paged_attention.modeling.packed_linear: packed layers against F.linear over a grid of shapes,
dtypes, biases and input ranks; a model's greedy tokens through the Engine with and without
packing (eager and compiled); bad input; one copy of each weight (a tied head counted); the
switch off; load_model's hook."""

from __future__ import annotations

import gc
import logging
import os
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

pytest.importorskip("transformers")

from paged_attention.engine import Engine, SamplingParams  # noqa: E402
from paged_attention.modeling import packed_linear  # noqa: E402
from paged_attention.modeling.models import load_model  # noqa: E402
from paged_attention.modeling.packed_linear import (  # noqa: E402
    PACK_ENV,
    PackedLinear,
    load_packed_dtypes,
    pack_model,
    packing_enabled,
    why_not_packable,
)
from paged_attention.modeling.tiny import tiny_llama  # noqa: E402

DTYPES = [torch.float32]
if torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported():
    DTYPES.append(torch.bfloat16)
# float32: oneDNN sums in another order than MKL's sgemm; bfloat16: both round the float32 sums
# to bfloat16 (one ulp apart at most).
TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=1e-2, atol=1e-2)}
ROOT = Path(__file__).resolve().parents[1]
SHAPES = [(576, 576), (576, 192), (576, 1536), (1536, 576), (64, 1000)]

pytestmark = pytest.mark.skipif(
    not torch.backends.mkldnn.is_available(), reason="this torch has no oneDNN to pack for"
)


def linear(in_features, out_features, dtype, bias=True, seed=0) -> nn.Linear:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return nn.Linear(in_features, out_features, bias=bias, dtype=dtype)


def resident_bytes(model: nn.Module) -> int:
    """The bytes of the model's parameters and buffers (each storage once) and packed weights."""
    storages = {}
    for tensor in [*model.parameters(), *model.buffers()]:
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    packed = sum(m.packed_bytes for m in model.modules() if isinstance(m, PackedLinear))
    return sum(storages.values()) + packed


# ------------------------------------------------------------------------- one layer


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("bias", [True, False])
def test_a_packed_layer_computes_what_f_linear_does(dtype, shape, bias):
    plain = linear(*shape, dtype, bias)
    packed = PackedLinear.from_linear(plain)
    assert (packed.in_features, packed.out_features, packed.dtype) == (*shape, dtype)
    gen = torch.Generator().manual_seed(1)
    for rows in [(1,), (7,), (64,), (300,), (2, 5), (1, 1), (0,)]:
        x = torch.randn(*rows, shape[0], generator=gen).to(dtype)
        with torch.no_grad():
            expected = F.linear(x, plain.weight, plain.bias)
            got = packed(x)
        assert got.shape == expected.shape and got.dtype == dtype
        torch.testing.assert_close(got, expected, **TOLERANCE[dtype])


def test_a_packed_layer_takes_a_strided_input():
    plain = linear(64, 32, torch.float32)
    packed = PackedLinear.from_linear(plain)
    x = torch.randn(64, 9).T  # not contiguous
    with torch.no_grad():
        torch.testing.assert_close(packed(x), F.linear(x, plain.weight, plain.bias))


def test_the_weight_unpacks_to_the_plain_one_and_the_state_dict_is_the_linear_layers():
    plain = linear(96, 48, DTYPES[-1])
    packed = PackedLinear.from_linear(plain)
    assert torch.equal(packed.weight, plain.weight)
    state = packed.state_dict()
    assert list(state) == ["weight", "bias"]
    assert torch.equal(state["weight"], plain.weight) and torch.equal(state["bias"], plain.bias)

    other = linear(96, 48, DTYPES[-1], seed=5)
    packed.load_state_dict(other.state_dict())
    x = torch.randn(3, 96).to(DTYPES[-1])
    with torch.no_grad():
        torch.testing.assert_close(packed(x), other(x), **TOLERANCE[DTYPES[-1]])
    with pytest.raises(RuntimeError, match=r"weight: expected shape \(48, 96\), got \(48, 95\)"):
        packed.load_state_dict({"weight": torch.zeros(48, 95), "bias": torch.zeros(48)})


def test_bad_input_is_a_clear_error_naming_x():
    packed = PackedLinear.from_linear(linear(16, 8, torch.float32))
    expected = r"x: .* takes torch.float32 on the CPU, got torch.bfloat16"
    with pytest.raises(TypeError, match=expected):
        packed(torch.randn(2, 16, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match=r"x: .* got torch.float64 on cpu"):
        packed(torch.randn(2, 16, dtype=torch.float64))
    with pytest.raises(TypeError, match=r"x: .* got torch.float32 on meta"):  # not the CPU
        packed(torch.randn(2, 16, device="meta"))
    with pytest.raises(RuntimeError):  # the wrong width, as F.linear says it
        packed(torch.randn(2, 15))


@pytest.mark.parametrize(
    ("layer", "reason"),
    [
        (nn.Linear(8, 4, dtype=torch.float16), "its weight is torch.float16"),
        (nn.Linear(8, 4, dtype=torch.float64), "its weight is torch.float64"),
        (nn.Linear(8, 4, device="meta"), "its weight is on meta, not the CPU"),
        (nn.Conv1d(8, 4, 1), "Conv1d is not a torch.nn.Linear"),
    ],
    ids=["float16", "float64", "meta", "conv"],
)
def test_what_cannot_be_packed_says_why_and_from_linear_raises(layer, reason):
    assert reason in why_not_packable(layer)
    with pytest.raises(ValueError, match=f"linear: cannot pack it: {reason}"):
        PackedLinear.from_linear(layer)


def test_without_onednn_nothing_is_packed_and_the_reason_is_logged_once(monkeypatch, caplog):
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
    packed_linear._log_once.cache_clear()
    model = tiny_llama()
    with caplog.at_level(logging.INFO, logger=packed_linear.__name__):
        report = pack_model(model)
    assert report.packed == [] and not any(isinstance(m, PackedLinear) for m in model.modules())
    assert set(report.skipped.values()) == {packed_linear.NO_ONEDNN}
    assert len(report.skipped) == 2 * 7 + 1
    assert [r.levelname for r in caplog.records] == ["WARNING"]
    assert packed_linear.NO_ONEDNN in caplog.records[0].getMessage()
    packed_linear._log_once.cache_clear()


# ------------------------------------------------------------------------- a model


def greedy(model, prompts, n=12, **options):
    engine = Engine(model, num_blocks=64, eos_token_id=[], **options)
    params = SamplingParams(max_new_tokens=n, temperature=0.0)
    return [out.outputs for out in engine.generate(prompts, params)]


PROMPTS = [[5, 6, 7, 8], list(range(30, 70)), [100, 3]]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_packed_model_gives_the_plain_models_greedy_tokens(dtype):
    plain = tiny_llama().to(dtype)
    packed = tiny_llama().to(dtype)
    report = pack_model(packed)
    names = [f"model.layers.{i}.{p}" for i in range(2) for p in packed_linear_projections()]
    assert sorted(report.packed) == sorted([*names, "lm_head"]) and report.skipped == {}
    with torch.no_grad():  # before an engine makes them attend through its paged cache
        ids = torch.tensor([PROMPTS[1]])
        logits = packed(ids).logits
        torch.testing.assert_close(logits, plain(ids).logits, **TOLERANCE[dtype])
    assert greedy(packed, PROMPTS) == greedy(plain, PROMPTS)


def packed_linear_projections():
    attention = [f"self_attn.{p}_proj" for p in "qkvo"]
    return [*attention, "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]


def test_packing_keeps_one_copy_of_each_weight():
    model = tiny_llama()
    before = resident_bytes(model)
    weights = [weakref.ref(m.weight) for m in model.modules() if type(m) is nn.Linear]
    report = pack_model(model)
    gc.collect()
    assert all(ref() is None for ref in weights)  # the plain weights are gone
    assert report.added_bytes == 0
    assert resident_bytes(model) == before


# A process loading a checkpoint of float32 weights into bfloat16 (as the CPU commands load
# SmolLM2), then printing how many bytes of anonymous memory loading took.
LOAD = """
import gc, sys
import torch, transformers  # imported before measuring: they are not the model
from paged_attention.modeling.models import load_model
from transformers import LlamaForCausalLM

def anonymous():
    with open("/proc/self/status") as status:
        return int(next(line for line in status if line.startswith("RssAnon:")).split()[1]) * 1024

before = anonymous()
model, _ = load_model(sys.argv[1], dtype="bfloat16", weights="bf16")
gc.collect()
print(anonymous() - before)
"""


@pytest.mark.skipif(not Path("/proc/self/status").is_file(), reason="reads Linux's /proc")
def test_the_loading_process_does_not_keep_the_plain_weights_memory(tmp_path):
    # What the process holds, not only what the model references: freed weights (and the
    # float32 copies loading made) that the allocator keeps would be a second copy all the
    # same. 96 MiB of weights in bfloat16.
    options = dict(hidden_size=1024, intermediate_size=4096, num_key_value_heads=8)
    tiny_llama(vocab_size=8192, **options).save_pretrained(tmp_path)
    environment = dict(os.environ, PYTHONPATH=str(ROOT))
    environment.pop(PACK_ENV, None)
    result = subprocess.run(
        [sys.executable, "-c", LOAD, str(tmp_path)],
        capture_output=True,
        text=True,
        env=environment,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    weights = (2 * (4 * 1024 * 1024 + 3 * 1024 * 4096) + 2 * 8192 * 1024) * 2
    assert int(result.stdout.split()[-1]) < 1.5 * weights


def test_a_tied_head_is_packed_as_a_copy_that_is_counted():
    model = tiny_llama(tie_word_embeddings=True)
    embedding = model.get_input_embeddings().weight
    assert model.lm_head.weight is embedding
    before = resident_bytes(model)
    report = pack_model(model)
    assert report.added_bytes == embedding.numel() * embedding.element_size()
    assert resident_bytes(model) == before + report.added_bytes
    assert model.get_input_embeddings().weight is embedding  # the embedding keeps its table
    assert torch.equal(model.lm_head.weight, embedding)


def test_a_checkpoint_loaded_in_place_is_let_go(tmp_path):
    # float32 weights loaded in float32 are views of the memory-mapped safetensors file: once
    # the layers are packed, what is left on it (the embedding, the norms) is copied out, so
    # that the mapping, and the pages packing read through it, go.
    tiny_llama().save_pretrained(tmp_path)
    plain, _ = load_model(str(tmp_path), dtype="float32")  # transformers' modules, unpacked
    mapped = [n for n, p in plain.named_parameters() if not p.untyped_storage().resizable()]
    assert "model.embed_tokens.weight" in mapped  # what the copy is for
    model = tiny_llama()
    model.load_state_dict(plain.state_dict())  # torch's own memory: nothing to copy
    assert pack_model(model).copied == []
    report = pack_model(plain)
    assert "model.embed_tokens.weight" in report.copied and "model.norm.weight" in report.copied
    assert all(p.untyped_storage().resizable() for p in plain.parameters())


def test_pack_model_packs_only_the_dtypes_asked_for():
    model = tiny_llama()  # float32
    report = pack_model(model, dtypes=(torch.bfloat16,))
    assert report.packed == [] and type(model.lm_head) is nn.Linear
    assert report.skipped["lm_head"] == "torch.float32 is not packed here (packed: bfloat16)"


def test_kv_b_proj_is_left_for_latent_attention_to_read():
    model = nn.Module()
    model.kv_b_proj, model.q_proj = nn.Linear(8, 16), nn.Linear(8, 8)
    report = pack_model(model)
    assert report.packed == ["q_proj"] and type(model.kv_b_proj) is nn.Linear
    assert report.skipped == {"kv_b_proj": "other code reads its plain weight"}


@pytest.mark.parametrize("cacheable", [False, True], ids=["freezing", "cacheable"])
def test_compiled_decode_steps_of_a_packed_model_give_the_eager_tokens(cacheable):
    # Both ways the engine compiles: freezing (Engine(compile=True)) and without it (what the
    # commands' compile cache runs); one decode size, a few tokens: compiling costs seconds.
    from torch._dynamo.utils import counters

    model = tiny_llama()
    pack_model(model)
    eager = greedy(model, PROMPTS[:1], n=6)
    engine = Engine(model, num_blocks=16, max_num_seqs=1, eos_token_id=[], compile=True)
    if cacheable:
        engine.runner.graphs.make_cacheable()
    counters.clear()
    params = SamplingParams(max_new_tokens=6, temperature=0.0)
    assert [out.outputs for out in engine.generate(PROMPTS[:1], params)] == eager
    assert list(engine.runner.graphs.compile_seconds) == [1]
    if cacheable:  # the graph names packed weights by number: inductor's caches can keep it
        assert counters["inductor"]["fxgraph_cache_bypass"] == 0
        assert counters["aot_autograd"]["autograd_cache_bypass"] == 0


def test_the_compiled_op_names_a_live_layers_weight():
    layer = PackedLinear.from_linear(linear(16, 8, torch.float32))
    x = torch.randn(3, 16)
    with torch.no_grad():
        expected = layer(x)
        got = torch.ops.paged_attention.packed_linear(x, layer.handle, 8, layer.bias)
    assert torch.equal(got, expected)
    handle = layer.handle
    del layer
    gc.collect()
    with pytest.raises(ValueError, match=f"handle: no packed weight {handle}"):
        torch.ops.paged_attention.packed_linear(x, handle, 8, None)


# ------------------------------------------------------------------------- load_model


@pytest.mark.parametrize(
    ("value", "enabled"), [(None, True), ("1", True), ("0", False), ("off", False)]
)
def test_the_switch(monkeypatch, value, enabled):
    if value is None:
        monkeypatch.delenv(PACK_ENV, raising=False)
    else:
        monkeypatch.setenv(PACK_ENV, value)
    assert packing_enabled() is enabled


@pytest.mark.parametrize(
    ("dtype", "weights", "env", "packed"),
    [
        ("bfloat16", "bf16", None, True),
        ("bfloat16", "auto", None, True),
        ("bfloat16", "bf16", "0", False),
        ("bfloat16", None, None, False),
        # float32 is packed on an AMD CPU only (load_packed_dtypes)
        ("float32", "fp32", None, torch.float32 in load_packed_dtypes()),
    ],
)
def test_load_model_packs_bfloat16_models_given_weights_unless_switched_off(
    monkeypatch, dtype, weights, env, packed
):
    if env is None:
        monkeypatch.delenv(PACK_ENV, raising=False)
    else:
        monkeypatch.setenv(PACK_ENV, env)
    model, _ = load_model("tiny", dtype=dtype, weights=weights)
    if dtype == "bfloat16":
        packed = packed and torch.bfloat16 in DTYPES  # else oneDNN cannot run bfloat16 here
    assert isinstance(model.lm_head, PackedLinear) is packed
    assert isinstance(model.model.layers[0].mlp.down_proj, PackedLinear) is packed


@pytest.mark.parametrize(
    ("vendor", "float32"),
    [("AuthenticAMD", True), ("GenuineIntel", False), ("HygonGenuine", False), (None, False)],
)
def test_float32_is_packed_on_an_amd_cpu_only(tmp_path, vendor, float32):
    """MKL's float32 product, measured the slower on an AMD EPYC and the faster on an Intel
    Xeon (FLOAT32_PACKED_VENDORS); a CPU without a vendor line (or no cpuinfo) packs bfloat16
    only."""
    cpuinfo = tmp_path / "cpuinfo"
    lines = ["processor\t: 0", "flags\t\t: fpu avx2"]
    if vendor is not None:
        lines.insert(1, f"vendor_id\t: {vendor}")
    cpuinfo.write_text("\n".join(lines) + "\n")
    expected = (torch.float32, torch.bfloat16) if float32 else (torch.bfloat16,)
    assert load_packed_dtypes(str(cpuinfo)) == expected
    assert load_packed_dtypes(str(tmp_path / "absent")) == (torch.bfloat16,)
