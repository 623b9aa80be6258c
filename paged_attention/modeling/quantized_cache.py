"""The quantized layers of a converted GGUF model, saved once in its cache directory.

``quantize_model(model, "auto", gguf)`` reads the GGUF file's blocks and lays each projection
out for its kernel (:mod:`paged_attention.modeling.quantized`): for SmolLM2-135M 0.4 s of CPU at
every start. :func:`quantize_cached` does it once and saves the layers' buffers in the converted
model's directory (:func:`~paged_attention.modeling.models.converted_gguf`, itself keyed by the
GGUF file's path, size and modification time) as one safetensors file per kernel, in its
``quantized/`` subdirectory; later loads
read that file instead.

The file's metadata holds a key: the layout's version (:data:`LAYOUT_VERSION`), this package's
and torch's versions, the CPU capability torch dispatches to, and the kernel. A file whose key
differs from the running one, that cannot be read, or whose layers do not fit the model, is
rebuilt from the GGUF file and replaced (written to a temporary file, then renamed into place,
so a reader never sees half of one). A cache directory that cannot be written leaves the model
as quantized as ever, with a warning.

:func:`load_cached` builds the whole model from that file and the converted checkpoint without
``from_pretrained``: it reads only the float tensors the saved layers do not replace.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import torch
from torch import nn

from paged_attention.modeling.quantized import QuantizedLinear, quantize_model, selected_kernel

logger = logging.getLogger("paged_attention.modeling")

LAYOUT_VERSION = 3
"""Raised when what :class:`QuantizedLinear` keeps in its buffers changes meaning."""


def cache_key(kernel: str) -> str:
    """What a saved file must have been written under to be read for ``kernel``."""
    import paged_attention

    return json.dumps(
        {
            "layout": LAYOUT_VERSION,
            "package": paged_attention.__version__,
            "torch": torch.__version__,
            "cpu": torch.backends.cpu.get_cpu_capability(),
            "kernel": kernel,
        },
        sort_keys=True,
    )


def cache_file(directory: Path | str, kernel: str) -> Path:
    """The file under ``directory`` that holds the ``auto`` weights' layers for ``kernel``: in a
    subdirectory, so that tools loading the converted checkpoint (which take every
    ``*.safetensors`` file at its top, as vLLM does) see only the float weights."""
    return Path(directory) / "quantized" / f"auto-{kernel}.safetensors"


def quantize_cached(model: nn.Module, gguf: Path, directory: Path | str) -> dict[str, int]:
    """``quantize_model(model, "auto", gguf)``, with the layers read from ``directory`` when a
    file of the running key is there, else built from ``gguf`` and saved there. Returns the
    count of layers per format, as ``quantize_model``."""
    kernel = selected_kernel()
    path = cache_file(directory, kernel)
    key = cache_key(kernel)
    saved = _read(path, key)
    layers = _layers_for(model, saved, kernel) if saved is not None else None
    if layers is not None:
        return _install(model, layers)
    counts = quantize_model(model, "auto", gguf)
    built = {n: m for n, m in model.named_modules() if isinstance(m, QuantizedLinear)}
    if built:
        _write(path, key, built)
    return counts


def load_cached(directory: Path | str, dtype: torch.dtype) -> tuple[nn.Module, dict] | None:
    """The model converted in ``directory``, in ``dtype``, with its ``auto`` layers read from
    the file :func:`quantize_cached` saved, built without the float weights those layers
    replace: ``from_pretrained`` reads, casts and assigns every tensor of the float32
    checkpoint first, most of them to be thrown away (docs/performance.md, the start).
    Returns ``(model, counts)`` as ``from_pretrained`` and then :func:`quantize_cached` leave
    them; None, for the caller to load the usual way, when no file of the running key fits the
    checkpoint, or the checkpoint is not one ``model.safetensors`` that fills the model."""
    directory = Path(directory)
    kernel = selected_kernel()
    checkpoint = directory / "model.safetensors"
    if not checkpoint.is_file():
        return None
    saved = _read(cache_file(directory, kernel), cache_key(kernel))
    if saved is None:
        return None
    model = _model_without_weights(directory, dtype)
    # the biases of the replaced projections stay float: the quantized layers take them
    if not _assign_float_tensors(model, checkpoint, {f"{name}.weight" for name in saved[0]}):
        return None
    layers = _layers_for(model, saved, kernel)
    if layers is None:
        return None
    return model.eval(), _install(model, layers)


def _model_without_weights(directory: Path, dtype: torch.dtype) -> nn.Module:
    """The model of ``directory``'s configuration in ``dtype``, its weights left uninitialized
    (each is assigned or replaced next), with the generation settings saved beside it."""
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig
    from transformers.initialization import no_init_weights

    config = AutoConfig.from_pretrained(directory)
    with no_init_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.name_or_path = config._name_or_path = str(directory)
    if (directory / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(directory)
    return model


def _assign_float_tensors(model: nn.Module, checkpoint: Path, replaced: set[str]) -> bool:
    """Assign ``model`` the tensors of ``checkpoint`` but ``replaced``, each in its parameter's
    dtype, and tie its weights; whether every other parameter and buffer it saves is then one
    read from the checkpoint (or tied to one)."""
    from safetensors import safe_open

    own = model.state_dict()
    state = {}
    with safe_open(str(checkpoint), framework="pt") as handle:
        for name in handle.keys():
            if name in replaced:
                continue
            if name not in own:
                return False
            state[name] = handle.get_tensor(name).to(own[name].dtype)
    missing = set(model.load_state_dict(state, strict=False, assign=True).missing_keys)
    model.tie_weights()
    read = {tensor.data_ptr() for tensor in state.values()}
    parameters = dict(model.named_parameters(remove_duplicate=False))
    return all(
        name in parameters and parameters[name].data_ptr() in read for name in missing - replaced
    )


def _install(model: nn.Module, layers: dict[str, QuantizedLinear]) -> dict[str, int]:
    """Put ``layers`` in ``model`` in place of its projections; the count per format."""
    counts: dict[str, int] = {}
    for name, layer in layers.items():
        model.set_submodule(name, layer)
        counts[layer.format] = counts.get(layer.format, 0) + 1
    return counts


def _read(path: Path, key: str) -> tuple[dict, dict[str, torch.Tensor]] | None:
    """``(layout, tensors)`` of the file at ``path`` written under ``key``, else None. The
    file is read whole (0.1-0.2 s of CPU for SmolLM2's 110 MiB), not mapped: a mapped file's
    pages would be faulted in one by one by the first steps instead."""
    from safetensors.torch import load

    if not path.is_file():
        return None
    try:
        data = path.read_bytes()
        header_size = int.from_bytes(data[:8], "little")
        metadata = json.loads(data[8 : 8 + header_size]).get("__metadata__") or {}
        if metadata.get("key") != key:
            logger.info("%s was written by another version or machine: rebuilding it", path)
            return None
        layout = json.loads(metadata["layers"])
        tensors = load(data)
    except Exception as error:  # a damaged file fails in the reader's own ways: rebuild it
        logger.warning("cannot read %s (%s): rebuilding it", path, error)
        return None
    return layout, tensors


def _layers_for(model: nn.Module, saved, kernel: str) -> dict[str, QuantizedLinear] | None:
    """The saved layers, each for the ``nn.Linear`` of ``model`` it replaces; None (and the
    model left as it is) when any does not fit."""
    layout, tensors = saved
    layers = {}
    try:
        for name, spec in layout.items():
            linear = model.get_submodule(name)
            fits = isinstance(linear, nn.Linear) and (linear.in_features, linear.out_features) == (
                spec["in"],
                spec["out"],
            )
            if not fits:
                return None
            # in the layer's own order: its state dict's keys stay those of a fresh build
            buffers = {buffer: tensors[f"{name}.{buffer}"] for buffer in spec["buffers"]}
            bias = linear.bias if spec["bias"] else None
            layers[name] = QuantizedLinear(
                buffers, spec["in"], spec["out"], spec["format"], kernel, bias
            )
    except (AttributeError, KeyError, TypeError):  # a layout of another model
        return None
    return layers


def _write(path: Path, key: str, layers: dict[str, QuantizedLinear]) -> None:
    from safetensors.torch import save

    tensors = {
        f"{name}.{buffer}": tensor.contiguous()
        for name, layer in layers.items()
        for buffer, tensor in layer.named_buffers(recurse=False)
    }
    layout = {
        name: {
            "format": layer.format,
            "in": layer.in_features,
            "out": layer.out_features,
            "bias": layer.bias is not None,
            "buffers": [buffer for buffer, _ in layer.named_buffers(recurse=False)],
        }
        for name, layer in layers.items()
    }
    # a name of this process's own (created with the umask's permissions, as the converted
    # model's other files), renamed into place when whole
    staging = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(exist_ok=True)
        staging.write_bytes(save(tensors, metadata={"key": key, "layers": json.dumps(layout)}))
        os.replace(staging, path)
    except OSError as error:
        logger.warning("cannot save the quantized layers in %s: %s", path.parent, error)
    finally:
        staging.unlink(missing_ok=True)
