"""paged_attention.modeling.quantized_cache: the quantized layers saved beside a converted model
equal a fresh build from the GGUF file, are read instead of the file once saved, and a stale,
damaged or ill-fitting file is rebuilt; a cache that cannot be written still quantizes; a model
loaded with its saved layers equals from_pretrained's and never reads the weights they replace."""

import json

import pytest
import torch

gguf = pytest.importorskip("gguf")

from gguf import GGMLQuantizationType, quants  # noqa: E402
from test_quantized import small_llama  # noqa: E402

from paged_attention.modeling.quantized import (  # noqa: E402
    LLAMA_PROJECTIONS,
    QuantizedLinear,
    quantize_model,
    selected_kernel,
)
from paged_attention.modeling.quantized_cache import (  # noqa: E402
    cache_file,
    cache_key,
    load_cached,
    quantize_cached,
)

FORMAT_OF = {"attn_q": "Q4_1", "attn_k": "Q4_0", "attn_v": "Q8_0", "attn_output": "Q4_1"}


@pytest.fixture
def small_gguf(tmp_path):
    """A Llama GGUF file of small_llama()'s projections and LM head in several formats (and one
    projection in float32, which stays a float layer)."""
    path = write_gguf(small_llama(), tmp_path / "small.gguf")
    directory = tmp_path / "converted"
    directory.mkdir()
    return path, directory


def write_gguf(model, path):
    """``model``'s projections in the formats of FORMAT_OF (else Q8_0; layer 1's down
    projection in float32), and its LM head in Q8_0 unless tied to the embedding."""
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(2)
    for index, layer in enumerate(model.model.layers):
        for key, module_path in LLAMA_PROJECTIONS.items():
            weight = layer.get_submodule(module_path).weight.detach().float().numpy()
            name = f"blk.{index}.{key}.weight"
            if key == "ffn_down" and index == 1:
                writer.add_tensor(name, weight)  # float32: not quantized by "auto"
                continue
            fmt = GGMLQuantizationType[FORMAT_OF.get(key, "Q8_0")]
            writer.add_tensor(name, quants.quantize(weight, fmt), raw_dtype=fmt)
    if not model.config.tie_word_embeddings:
        head = model.lm_head.weight.detach().float().numpy()
        writer.add_tensor(
            "output.weight",
            quants.quantize(head, GGMLQuantizationType.Q8_0),
            raw_dtype=GGMLQuantizationType.Q8_0,
        )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def layers_of(model):
    return {n: m for n, m in model.named_modules() if isinstance(m, QuantizedLinear)}


def assert_same_layers(ours, fresh):
    assert list(ours) == list(fresh)
    for name, layer in ours.items():
        other = fresh[name]
        assert (layer.format, layer.kernel, layer.in_features, layer.out_features) == (
            other.format,
            other.kernel,
            other.in_features,
            other.out_features,
        )
        buffers, expected = dict(layer.named_buffers()), dict(other.named_buffers())
        assert list(buffers) == list(expected)
        for key, tensor in buffers.items():
            assert tensor.dtype == expected[key].dtype and torch.equal(tensor, expected[key]), key


def logits(model):
    ids = torch.randint(0, 96, (2, 7), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        return model(ids).logits


def test_saved_layers_equal_a_fresh_build_and_are_read_instead_of_the_file(small_gguf, monkeypatch):
    path, directory = small_gguf
    fresh = small_llama()
    counts = quantize_model(fresh, "auto", path)
    assert counts == {"Q4_1": 4, "Q4_0": 2, "Q8_0": 8}  # 13 projections and the head
    first = small_llama()
    assert quantize_cached(first, path, directory) == counts
    assert cache_file(directory, selected_kernel()).is_file()
    # beside the checkpoint, not at its top, where a loader takes every *.safetensors file
    assert not list(directory.glob("*.safetensors"))
    assert_same_layers(layers_of(first), layers_of(fresh))

    def no_file(*args, **kwargs):
        raise AssertionError("the GGUF file was read although its layers were saved")

    monkeypatch.setattr("paged_attention.modeling.gguf_file.GGUFFile", no_file)
    second = small_llama()
    assert quantize_cached(second, path, directory) == counts
    assert_same_layers(layers_of(second), layers_of(fresh))
    assert isinstance(second.model.layers[1].mlp.down_proj, torch.nn.Linear)  # float in the file
    torch.testing.assert_close(logits(second), logits(fresh), rtol=0, atol=0)


def rewrite_metadata(file, **changes):
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(file), framework="pt") as handle:
        metadata = handle.metadata()
        tensors = {name: handle.get_tensor(name) for name in handle.keys()}
    save_file(tensors, str(file), metadata={**metadata, **changes})


def built_from_the_file(path, directory, monkeypatch):
    """Quantize through the cache, counting the GGUF file's reads."""
    from paged_attention.modeling import gguf_file

    reads = []
    real = gguf_file.GGUFFile

    def counted(*args):
        reads.append(args)
        return real(*args)

    monkeypatch.setattr(gguf_file, "GGUFFile", counted)
    model = small_llama()
    quantize_cached(model, path, directory)
    monkeypatch.setattr(gguf_file, "GGUFFile", real)
    return model, len(reads)


@pytest.mark.parametrize(
    "damage",
    ["another key", "another layout", "garbage", "truncated"],
)
def test_a_stale_or_damaged_file_is_rebuilt(small_gguf, monkeypatch, damage):
    path, directory = small_gguf
    fresh = small_llama()
    quantize_model(fresh, "auto", path)
    _, reads = built_from_the_file(path, directory, monkeypatch)
    assert reads == 1
    file = cache_file(directory, selected_kernel())
    if damage == "another key":
        rewrite_metadata(file, key=json.dumps({"layout": -1}))
    elif damage == "another layout":  # layers that do not fit this model
        layout = {
            "lm_head": {"format": "Q8_0", "in": 32, "out": 96, "bias": False, "buffers": ["qs"]}
        }
        rewrite_metadata(file, layers=json.dumps(layout))
    elif damage == "garbage":
        file.write_bytes(b"not a safetensors file")
    else:
        file.write_bytes(file.read_bytes()[:1000])
    model, reads = built_from_the_file(path, directory, monkeypatch)
    assert reads == 1  # rebuilt from the GGUF file
    assert_same_layers(layers_of(model), layers_of(fresh))
    _, reads = built_from_the_file(path, directory, monkeypatch)
    assert reads == 0  # and saved again, under the running key
    from safetensors import safe_open

    with safe_open(str(file), framework="pt") as handle:
        assert handle.metadata()["key"] == cache_key(selected_kernel())


def test_the_key_names_what_the_layout_depends_on():
    key = json.loads(cache_key("gguf"))
    assert key["kernel"] == "gguf" and key["torch"] == torch.__version__
    assert {"layout", "package", "cpu"} <= set(key)
    assert cache_key("gguf") != cache_key("int4pack")


def test_each_kernel_has_its_file(small_gguf, monkeypatch):
    path, directory = small_gguf
    for kernel in ("gguf", "int4pack"):
        monkeypatch.setenv("PAGED_ATTENTION_QUANTIZED_KERNEL", kernel)
        fresh = small_llama()
        quantize_model(fresh, "auto", path)
        model = small_llama()
        quantize_cached(model, path, directory)
        assert cache_file(directory, kernel).is_file()
        assert {layer.kernel for layer in layers_of(model).values()} == {kernel}
        assert_same_layers(layers_of(model), layers_of(fresh))


def test_a_cache_that_cannot_be_written_still_quantizes(small_gguf, caplog):
    path, directory = small_gguf
    missing = directory / "gone"  # no such directory: the save fails
    model = small_llama()
    fresh = small_llama()
    assert quantize_cached(model, path, missing) == quantize_model(fresh, "auto", path)
    assert_same_layers(layers_of(model), layers_of(fresh))
    assert "cannot save the quantized layers" in caplog.text
    assert not list(directory.iterdir())


def test_every_shipped_projection_and_the_head_are_saved(small_gguf):
    from safetensors import safe_open

    path, directory = small_gguf
    quantize_cached(small_llama(), path, directory)
    with safe_open(str(cache_file(directory, selected_kernel())), framework="pt") as handle:
        saved = set(json.loads(handle.metadata()["layers"]))
    expected = {f"model.layers.{i}.{p}" for i in range(2) for p in LLAMA_PROJECTIONS.values()}
    assert saved == expected - {"model.layers.1.mlp.down_proj"} | {"lm_head"}


def from_pretrained_then_cached(path, directory, dtype):
    """What load_model did before load_cached: from_pretrained, then the saved layers."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype).eval()
    return model, quantize_cached(model, path, directory)


def recorded_reads(monkeypatch):
    """The names of the checkpoint's tensors read through safetensors.safe_open from now on."""
    import safetensors

    real = safetensors.safe_open
    names = []

    class Recorded:
        def __init__(self, *args, **kwargs):
            self.handle = real(*args, **kwargs)

        def __enter__(self):
            self.opened = self.handle.__enter__()
            return self

        def __exit__(self, *exc):
            return self.handle.__exit__(*exc)

        def keys(self):
            return self.opened.keys()

        def get_tensor(self, name):
            names.append(name)
            return self.opened.get_tensor(name)

    monkeypatch.setattr(safetensors, "safe_open", Recorded)
    return names


def assert_same_model(model, expected):
    """Equal parameters and buffers (the ones not saved too), generation settings, mode."""
    for ours, theirs in (
        (model.state_dict(), expected.state_dict()),
        (dict(model.named_buffers()), dict(expected.named_buffers())),
    ):
        assert list(ours) == list(theirs)
        for name, tensor in ours.items():
            assert tensor.dtype == theirs[name].dtype and torch.equal(tensor, theirs[name]), name
    assert model.generation_config.to_dict() == expected.generation_config.to_dict()
    assert not model.training
    torch.testing.assert_close(logits(model), logits(expected), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_load_with_the_saved_layers_equals_from_pretrained_then_the_layers(
    small_gguf, dtype, monkeypatch
):
    path, directory = small_gguf
    small_llama().save_pretrained(directory)  # the float32 checkpoint of a converted model
    assert load_cached(directory, dtype) is None  # no saved layers yet
    expected, counts = from_pretrained_then_cached(path, directory, dtype)  # saves them
    read = recorded_reads(monkeypatch)
    model, loaded_counts = load_cached(directory, dtype)
    assert loaded_counts == counts == {"Q4_1": 4, "Q4_0": 2, "Q8_0": 8}
    assert_same_model(model, expected)
    replaced = {f"{name}.weight" for name in layers_of(model)}
    assert "model.embed_tokens.weight" in read and "model.layers.1.mlp.down_proj.weight" in read
    assert not replaced & set(read)  # the float weights the saved layers replace stay unread


def test_a_tied_head_left_float_is_tied_to_the_embedding_read(tmp_path):
    tied = small_llama(tie_word_embeddings=True)
    path = write_gguf(tied, tmp_path / "tied.gguf")
    directory = tmp_path / "converted"
    tied.save_pretrained(directory)  # without the head: it is the embedding
    expected, _ = from_pretrained_then_cached(path, directory, torch.float32)
    model, _ = load_cached(directory, torch.float32)
    assert isinstance(model.lm_head, torch.nn.Linear)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert_same_model(model, expected)


@pytest.mark.parametrize("change", ["a tensor the model lacks", "a float tensor missing"])
def test_a_checkpoint_that_does_not_fill_the_model_is_left_to_from_pretrained(small_gguf, change):
    from safetensors.torch import load_file, save_file

    path, directory = small_gguf
    small_llama().save_pretrained(directory)
    from_pretrained_then_cached(path, directory, torch.float32)  # saves the layers
    checkpoint = directory / "model.safetensors"
    tensors = load_file(checkpoint)
    if change == "a tensor the model lacks":
        tensors["model.extra.weight"] = torch.zeros(3)
    else:
        del tensors["model.norm.weight"]
    save_file(tensors, checkpoint, metadata={"format": "pt"})
    assert load_cached(directory, torch.float32) is None
    assert load_cached(directory / "nowhere", torch.float32) is None  # no checkpoint at all
