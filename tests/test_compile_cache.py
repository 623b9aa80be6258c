"""The compile cache of decode steps (paged_attention/engine/compile_cache.py): the tiny model
compiled ahead of time in one process is loaded by the next, which gives the eager engine's
tokens without tracing or compiling anything, reads the weights of its own model, and compiles
again a step saved for other tensors; another key is cold; the commands' choice between
compiled and eager steps."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from paged_attention.engine.compile_cache import (  # noqa: E402
    CompileCache,
    CompileKey,
    cache_to_compile_with,
    eager_hint,
    model_identity,
    packed_layers,
    quantized_kernels,
    should_compile,
)
from paged_attention.modeling.quantized import QuantizedLinear  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

# One process of a command: the tiny model's decode steps (batch sizes 1 and 2) through the cache
# under $PAGED_ATTENTION_CACHE, then the tokens of the compiled engine and of an eager one, and
# the counters of AOTAutograd (any trace counts). $BLOCKS: the cache's blocks (a step's
# tensors); $NEGATE: negate a layer's weights first (a model the saved step did not see).
PROCESS = """
import json
import os
import torch
from torch._dynamo.utils import counters
from paged_attention.engine import Engine, SamplingParams
from paged_attention.engine.compile_cache import CompileCache, CompileKey, compile_decode_steps
from paged_attention.modeling.models import load_model

torch.set_num_threads(1)
model, _ = load_model("tiny", dtype="float32")
if os.environ.get("NEGATE"):
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight.neg_()
blocks = int(os.environ.get("BLOCKS", "16"))
cache = CompileCache(CompileKey.of("tiny", model, None, [1, 2]))
warm = cache.is_warm()
# two sequences, then one: steps of both sizes
prompt, params = [[5, 6, 7, 8], [9, 4]], [SamplingParams(max_new_tokens=n) for n in (8, 4)]
eager = Engine(model, num_blocks=blocks, max_num_seqs=2, eos_token_id=[]).generate(prompt, params)
engine = Engine(model, num_blocks=blocks, max_num_seqs=2, eos_token_id=[], compile=True)
said = []
compile_decode_steps(engine, cache, said.append)
compiled = engine.generate(prompt, params)
others = [
    CompileCache(CompileKey.of("tiny", load_model("tiny", dtype="bfloat16")[0], None, [1, 2])),
    CompileCache(CompileKey.of("tiny", model, None, [1, 8])),
]
print(json.dumps({
    "warm": warm,
    "said": said,
    "eager": [out.outputs for out in eager],
    "compiled": [out.outputs for out in compiled],
    "aot_autograd": dict(counters["aot_autograd"]),
    "others_warm": [other.is_warm() for other in others],
    "directories": [str(c.directory) for c in [cache, *others]],
}))
"""


def run_process(cache: Path, **variables: str) -> dict:
    env = dict(os.environ, PAGED_ATTENTION_CACHE=str(cache), PYTHONPATH=str(ROOT), **variables)
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)  # the project's cache holds inductor's too
    result = subprocess.run(
        [sys.executable, "-c", PROCESS], capture_output=True, text=True, env=env, timeout=900
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_a_second_process_loads_the_compiled_steps_and_another_key_misses(tmp_path):
    first = run_process(tmp_path)
    assert not first["warm"] and first["said"][0].startswith("compiling decode steps")
    assert first["said"][1].startswith("compiled batch size 1 in ")
    assert first["said"][2].startswith("compiled batch size 2 in ")
    assert first["aot_autograd"].get("autograd_cache_miss", 0) >= 1
    assert first["compiled"] == first["eager"]
    entries = sorted(p.name for p in (tmp_path / "compiled").glob("*/step-*.aot"))
    assert entries == ["step-1.aot", "step-2.aot"] and (tmp_path / "inductor").is_dir()

    second = run_process(tmp_path)
    assert second["warm"] and second["said"][0].startswith("loading compiled decode steps")
    assert len(second["said"]) == 2 and second["said"][1].startswith("decode steps ready")
    # nothing was traced: a process that compiled would count AOTAutograd's cache lookups
    assert second["aot_autograd"] == {}
    assert second["compiled"] == second["eager"] == first["eager"]
    # another dtype, other batch sizes: other entries, cold
    assert second["others_warm"] == [False, False]
    assert len(set(second["directories"])) == 3

    # the loaded step multiplies the weights of the model it serves, not those it was saved with
    negated = run_process(tmp_path, NEGATE="1")
    assert negated["warm"] and negated["aot_autograd"] == {}
    assert negated["compiled"] == negated["eager"] != first["eager"]

    # a step saved for other tensors (a cache of another size) is refused, compiled again and
    # saved over the old one
    resized = run_process(tmp_path, BLOCKS="24")
    assert resized["warm"] and "compiling batch size 1 again" in resized["said"][1]
    assert "other tensors" in resized["said"][1]
    assert "compiling batch size 2 again" in resized["said"][2]
    assert resized["compiled"] == resized["eager"] == first["eager"]
    assert resized["said"][3].startswith("compiled batch size 1 in ")
    assert run_process(tmp_path, BLOCKS="24")["aot_autograd"] == {}


def test_a_step_that_does_not_load_is_compiled_again_and_an_entry_is_warm_when_whole(tmp_path):
    from paged_attention.modeling.models import load_model

    model, _ = load_model("tiny", dtype="float32")
    cache = CompileCache(CompileKey.of("tiny", model, None, [1, 8]), tmp_path)

    class Executor:
        sizes = [1, 8]

        def adopt(self, size, step):
            raise AssertionError("a step that did not load cannot be adopted")

    said = []
    assert not cache.is_warm() and cache.load_into(Executor(), said.append) == [] and not said
    cache.directory.mkdir(parents=True)
    cache.step_file(8).write_bytes(b"not a saved step")
    assert not cache.is_warm()  # size 1 is missing
    assert cache.load_into(Executor(), said.append) == []
    assert len(said) == 1 and said[0].startswith("compiling batch size 8 again")
    cache.step_file(1).write_bytes(b"")
    assert cache.is_warm()


def test_the_key_names_what_the_steps_depend_on(tmp_path):
    from paged_attention.modeling.models import load_model

    model, _ = load_model("tiny", dtype="float32")
    key = CompileKey.of("tiny", model, "auto", [1, 8])
    assert (key.model, key.dtype, key.weights, key.sizes) == ("tiny", "float32", "auto", (1, 8))
    assert key.torch_version == torch.__version__ and key.quantized_kernel == "none"
    assert key.threads == torch.get_num_threads()
    assert CompileKey.of("tiny", model, "auto", (1, 8)).digest() == key.digest()
    assert CompileKey.of("tiny", model, "q8", (1, 8)).digest() != key.digest()
    # a model file's identity changes with its contents' size and time
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"x")
    before = model_identity(str(gguf))
    gguf.write_bytes(b"xy")
    assert model_identity(str(gguf)) != before and str(gguf.resolve()) in before


def test_the_key_holds_the_kernel_the_layers_run_not_the_variable_that_chose_it(monkeypatch):
    from paged_attention.modeling.models import load_model

    model, _ = load_model("tiny", dtype="float32")
    assert quantized_kernels(model) == "none"
    layers = model.model.layers
    layers[0].mlp.down_proj = QuantizedLinear({}, 32, 32, "Q8_0", kernel="gguf")
    assert quantized_kernels(model) == "gguf"
    keys = {}
    for variable in ("auto", "gguf", "int4pack"):
        # the variable chooses the kernel of layers built from now on, not of these
        monkeypatch.setenv("PAGED_ATTENTION_QUANTIZED_KERNEL", variable)
        keys[variable] = CompileKey.of("tiny", model, "auto", [1]).digest()
    assert len(set(keys.values())) == 1
    layers[1].mlp.down_proj = QuantizedLinear({}, 32, 32, "Q8_0", kernel="int4pack")
    assert quantized_kernels(model) == "gguf,int4pack"
    assert CompileKey.of("tiny", model, "auto", [1]).digest() != keys["gguf"]


def test_the_key_names_the_packed_layers():
    from paged_attention.modeling.models import load_model
    from paged_attention.modeling.packed_linear import pack_model

    model, _ = load_model("tiny", dtype="float32")
    plain = CompileKey.of("tiny", model, "auto", [1])
    assert plain.packed_linear == packed_layers(model) == "none"
    report = pack_model(model, (torch.float32,))
    assert report.packed, "oneDNN packs float32 layers wherever torch has oneDNN"
    assert packed_layers(model) == f"float32:{len(report.packed)}"
    packed = CompileKey.of("tiny", model, "auto", [1])
    assert packed.packed_linear == f"float32:{len(report.packed)}"
    assert packed.digest() != plain.digest()


def test_toggling_packing_between_loads_selects_another_entry(monkeypatch, tmp_path):
    from paged_attention.modeling.models import load_model
    from paged_attention.modeling.packed_linear import PACK_ENV, why_not_packable

    digests, packable = {}, None
    for value in ("1", "0"):
        monkeypatch.setenv(PACK_ENV, value)
        model, _ = load_model("tiny", weights="bf16")
        if value == "0":  # the layers left plain: could this machine have packed them?
            packable = why_not_packable(model.model.layers[0].mlp.down_proj) is None
        digests[value] = CompileCache(CompileKey.of("tiny", model, "bf16", [1]), tmp_path)
    assert digests["0"].key.packed_linear == "none"
    # packed where oneDNN runs bfloat16 on this CPU; else both loads hold the same plain layers
    assert (digests["1"].directory != digests["0"].directory) == packable
    assert (digests["1"].key.packed_linear != "none") == packable


def test_the_key_names_the_code_a_step_was_traced_from(tmp_path):
    import transformers

    from paged_attention.engine.compile_cache import code_identity, sources_digest

    assert transformers.__version__ in code_identity()
    assert sources_digest(ROOT / "paged_attention") in code_identity()
    (tmp_path / "modeling").mkdir()
    (tmp_path / "server").mkdir()
    (tmp_path / "modeling" / "layer.py").write_text("x = 1\n")
    (tmp_path / "server" / "app.py").write_text("y = 1\n")
    before = sources_digest(tmp_path)
    (tmp_path / "server" / "app.py").write_text("y = 2\n")  # the server is not traced
    assert sources_digest(tmp_path) == before
    (tmp_path / "modeling" / "layer.py").write_text("x = 2\n")
    assert sources_digest(tmp_path) != before


@pytest.mark.parametrize(
    "requested, device, warm, expected",
    [
        (None, "cpu", True, True),
        (None, "cpu", False, False),
        (None, "cuda", True, False),
        (True, "cpu", False, True),
        (False, "cpu", True, False),
    ],
)
def test_commands_compile_when_asked_or_when_the_cache_is_warm(requested, device, warm, expected):
    class Cache:
        def is_warm(self):
            return warm

    assert should_compile(requested, device, Cache()) is expected


def test_a_cold_default_runs_eagerly_and_says_how_to_compile(tmp_path, monkeypatch):
    from paged_attention.modeling.models import load_model

    monkeypatch.setenv("PAGED_ATTENTION_CACHE", str(tmp_path))
    model, _ = load_model("tiny", dtype="float32")
    said = []
    options = dict(weights=None, device="cpu", max_num_seqs=8, say=said.append)
    assert cache_to_compile_with("tiny", model, requested=None, **options) is None
    assert len(said) == 1 and "--compile" in said[0] and str(tmp_path) in said[0]
    cache = cache_to_compile_with("tiny", model, requested=True, **options)
    assert cache.key.sizes == (1, 8) and str(cache.directory).startswith(str(tmp_path))
    assert eager_hint(cache) == said[0]
    on_cuda = {**options, "device": "cuda"}
    with pytest.raises(ValueError, match="for the CPU, not device cuda"):
        cache_to_compile_with("tiny", model, requested=True, **on_cuda)
    assert cache_to_compile_with("tiny", model, requested=None, **on_cuda) is None
