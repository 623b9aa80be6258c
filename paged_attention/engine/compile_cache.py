"""Compiled decode steps kept across processes: a second start of the same model configuration
loads what the first one compiled instead of compiling it again.

Compiling the decode step of one padded batch size
(:class:`~paged_attention.engine.model_runner.CompiledDecode`) goes through three stages:
dynamo traces the Python into a graph (and rewrites the function's bytecode around it),
AOTAutograd traces that graph into ATen operations, inductor generates C++ from it and the C++
compiler builds it. For a 30-layer model on two cores the last stage takes minutes, the first
two tens of seconds. Each size is compiled ahead of time (``torch.compile(...).aot_compile``,
the mechanism vLLM's compile cache uses), which gives an ``AOTCompiledFunction``: dynamo's
rewritten bytecode, the guards on its tensors and inductor's compiled graph, saved whole to one
file per size. Another process loads that file and runs it: nothing is traced or generated
again, and the built C++ comes from inductor's own on-disk cache (:func:`inductor_cache_dir`),
else it is built again from the saved code.

The steps compiled here have no frozen weights
(:meth:`~paged_attention.engine.model_runner.CompiledDecode.make_cacheable`): the weights are
inputs, read from the loading process's modules. A loaded step keeps only its guards on
tensors (every input's shape, dtype and strides), checked once when it is adopted: a step saved
for another cache size or buffer width is refused and compiled again. What no guard sees is in
the key: the code the step was traced from (:func:`code_identity`).

:class:`CompileCache` keeps the files under the project's cache directory
(:func:`~paged_attention.modeling.models.cache_root`: ``$PAGED_ATTENTION_CACHE``, else
``$XDG_CACHE_HOME/paged_attention``, else ``~/.cache/paged_attention``), in ``compiled/``, one
directory per configuration (:class:`CompileKey`): the model (its file's path, size and
modification time), its dtype, what its linear layers hold (``--weights``, the kernel its
quantized layers run, as resolved when they were built, and which float layers were packed for
oneDNN: :mod:`~paged_attention.modeling.packed_linear`, which ``PAGED_ATTENTION_PACK_LINEAR=0``
turns off), the padded batch sizes, the torch version, the CPU's vector instruction set, torch's
thread count and the code. A file is written whole under a temporary name and renamed into
place, each size as soon as it is compiled, so an interrupted start keeps the sizes it
finished; a configuration whose every size is there is "warm".
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib
import json
import os
import pickle
import sys
import tempfile
import time
import types
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

CACHE_FORMAT = 3
"""Bumped when what an entry holds, or how the steps are compiled, changes."""
KEY_FILE = "key.json"
STEP_FILE = "step-{size}.aot"


@dataclass(frozen=True)
class CompileKey:
    """What the compiled decode steps of an engine depend on (see the module docstring)."""

    model: str
    """The model's identity: :func:`model_identity`."""
    dtype: str
    weights: str
    sizes: tuple[int, ...]
    torch_version: str
    cpu_capability: str
    quantized_kernel: str
    """The kernels its quantized linear layers run (:func:`quantized_kernels`)."""
    packed_linear: str = "none"
    """Its packed float linear layers (:func:`packed_layers`): a packed layer is a custom op in
    the compiled graph, an unpacked one a matrix product, so the two compile differently."""
    code: str = ""
    """The code a step was traced from: :func:`code_identity`."""
    threads: int = 0
    """torch's CPU threads: inductor splits the loops it generates for that many (and the
    compiled steps' dynamo guards held it before they were saved ahead of time)."""
    format: int = CACHE_FORMAT

    @classmethod
    def of(cls, name: str, model: torch.nn.Module, weights: str | None, sizes) -> CompileKey:
        """The key of ``model``, loaded from ``name`` (as ``--model`` takes it) with
        ``weights``, compiled for the padded batch sizes ``sizes``, on this machine."""
        return cls(
            model=model_identity(name),
            dtype=str(model.dtype).removeprefix("torch."),
            weights=weights or "float",
            sizes=tuple(int(size) for size in sizes),
            torch_version=torch.__version__,
            cpu_capability=torch.backends.cpu.get_cpu_capability(),
            quantized_kernel=quantized_kernels(model),
            packed_linear=packed_layers(model),
            code=code_identity(),
            threads=torch.get_num_threads(),
        )

    def digest(self) -> str:
        text = json.dumps(asdict(self), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()


def quantized_kernels(model: torch.nn.Module) -> str:
    """The kernels ``model``'s quantized linear layers run, as they were resolved when the
    layers were built (``PAGED_ATTENTION_QUANTIZED_KERNEL=auto`` is one of them, not a kernel
    of its own), comma-separated; ``none`` when it has no quantized layer."""
    from paged_attention.modeling.quantized import QuantizedLinear

    kernels = {m.kernel for m in model.modules() if isinstance(m, QuantizedLinear)}
    return ",".join(sorted(kernels)) or "none"


def packed_layers(model: torch.nn.Module) -> str:
    """``model``'s packed linear layers (:class:`~paged_attention.modeling.packed_linear.
    PackedLinear`) as ``dtype:count`` per dtype, comma-separated; ``none`` when it has none
    (``PAGED_ATTENTION_PACK_LINEAR=0``, or nothing to pack). What was packed, not the variable:
    a layer the machine could not pack is a plain one."""
    from paged_attention.modeling.packed_linear import PackedLinear

    counts: dict[str, int] = {}
    for module in model.modules():
        if isinstance(module, PackedLinear):
            name = str(module.dtype).removeprefix("torch.")
            counts[name] = counts.get(name, 0) + 1
    return ",".join(f"{name}:{counts[name]}" for name in sorted(counts)) or "none"


def model_identity(name: str) -> str:
    """``name``'s model as a string that changes when its weights may have: ``tiny`` as it is
    (built in code), a file's or a model directory's resolved path with the size and
    modification time of each file that holds weights or configuration."""
    from paged_attention.modeling.models import TINY_MODEL, model_source

    source = model_source(name)
    if source == TINY_MODEL:
        return TINY_MODEL
    source = source.resolve()
    files = [source] if source.is_file() else sorted(p for p in source.iterdir() if p.is_file())
    parts = [str(source)]
    for path in files:
        if path.is_file() and path.suffix in (".gguf", ".safetensors", ".bin", ".json", ".pt"):
            stat = path.stat()
            parts.append(f"{path.name}:{stat.st_size}:{stat.st_mtime_ns}")
    return "\0".join(parts)


@functools.cache
def code_identity() -> str:
    """transformers' version and the digest of this package's sources a decode step runs
    (:func:`sources_digest`): a saved step is bytecode rewritten from them, run without being
    traced again, so a change to any of them selects another entry."""
    import transformers

    package = Path(__file__).resolve().parents[1]
    return f"transformers {transformers.__version__}, sources {sources_digest(package)}"


def sources_digest(package: Path) -> str:
    """A digest of the Python files under ``package`` but those of its ``server`` and ``cli``
    (which no decode step runs)."""
    digest = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        relative = path.relative_to(package)
        if relative.parts[0] not in ("server", "cli"):
            digest.update(str(relative).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


class CompileCache:
    """The compiled decode steps of one :class:`CompileKey`, on disk under ``root`` (default:
    ``compiled/`` in the project's cache directory): one file per padded batch size."""

    def __init__(self, key: CompileKey, root: Path | None = None) -> None:
        if root is None:
            from paged_attention.modeling.models import cache_root

            root = cache_root() / "compiled"
        self.key = key
        self.directory = Path(root) / key.digest()[:24]

    def step_file(self, size: int) -> Path:
        return self.directory / STEP_FILE.format(size=size)

    def is_warm(self) -> bool:
        """Whether earlier processes saved the step of every size of this key."""
        return all(self.step_file(size).is_file() for size in self.key.sizes)

    def load_into(self, executor, say) -> list[int]:
        """Adopts into ``executor`` (a :class:`~paged_attention.engine.model_runner.
        CompiledDecode` of this key) every saved step it accepts; returns their sizes. A step
        that cannot be read or loaded (written by another torch, say) or that ``executor``
        refuses is skipped with a line to ``say``: it is compiled again."""
        adopted = []
        for size in executor.sizes:
            path = self.step_file(size)
            if not path.is_file():
                continue
            try:
                executor.adopt(size, _load_step(path))
            except Exception as error:  # noqa: BLE001 -- a stale entry must not stop a start
                say(f"compiling batch size {size} again: its saved step did not load ({error})")
                continue
            adopted.append(size)
        return adopted

    def save(self, size: int, step) -> None:
        """Saves ``step``, the ``AOTCompiledFunction`` of ``size``. Raises OSError when the
        directory is not writable."""
        saved = type(step).serialize(step).serialized_data
        data = pickle.dumps({"step": saved, "modules": _installed_modules(step)})
        self.directory.mkdir(parents=True, exist_ok=True)
        (self.directory / KEY_FILE).write_text(json.dumps(asdict(self.key), indent=1) + "\n")
        target = self.step_file(size)
        handle, staging = tempfile.mkstemp(prefix=f".{target.name}.", dir=self.directory)
        try:
            with os.fdopen(handle, "wb") as file:
                file.write(data)
            os.replace(staging, target)
        except BaseException:
            Path(staging).unlink(missing_ok=True)
            raise


def _installed_modules(step) -> dict[str, str]:
    """The modules dynamo put into the globals of ``step``'s function under names of its own
    (``___module_<name>_<id>``), by those names: a loading process imports them again."""
    names = step.fn.__globals__
    return {
        name: value.__name__
        for name, value in names.items()
        if name.startswith("___module_") and isinstance(value, types.ModuleType)
    }


def _load_step(path: Path):
    """The ``AOTCompiledFunction`` saved in ``path``, its function's globals those of the
    module that defines the compiled steps, with the modules it names."""
    from torch._dynamo.aot_compile import AOTCompiledFunction

    entry = pickle.loads(path.read_bytes())
    names = dict(vars(sys.modules["paged_attention.engine.model_runner"]))
    for name, module in entry["modules"].items():
        names[name] = importlib.import_module(module)
    return AOTCompiledFunction.deserialize(entry["step"], names)


@contextlib.contextmanager
def inductor_cache_dir(root: Path | None = None):
    """Within it, inductor's own on-disk cache (where the C++ it built lives: a saved step
    holds the generated code, not the built library) is ``root`` (default:
    ``inductor/`` in the project's cache directory), so that it outlives ``/tmp``; unless
    ``TORCHINDUCTOR_CACHE_DIR`` names a directory of the user's. Yields the directory in
    use."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir, temporary_cache_dir

    current = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    # inductor writes its default into the variable at its first use: that one is not the user's
    if current and os.path.abspath(current) != os.path.abspath(default_cache_dir()):
        yield current
        return
    if root is None:
        from paged_attention.modeling.models import cache_root

        root = cache_root() / "inductor"
    with temporary_cache_dir(str(root)):
        yield str(root)


def should_compile(requested: bool | None, device: str, cache: CompileCache) -> bool:
    """Whether a command compiles its decode steps: ``requested`` when it says (``--compile``,
    ``--no-compile``), else (the default) on the CPU when ``cache`` is warm."""
    if requested is not None:
        return requested
    return str(device).startswith("cpu") and cache.is_warm()


def compile_decode_steps(engine, cache: CompileCache, say) -> dict[int, float]:
    """Readies every padded batch size of ``engine`` (built with ``compile=True``) now,
    through ``cache``: each size's saved step is loaded, each one missing (or refused) is
    compiled, run once on padding rows and saved at once. A loaded step first runs with the
    first step of its size (the engine's warm-up runs the first of all, which pays the
    kernels' one-time set-up). ``say(line)`` tells the user what happens (a line before, one
    per size compiled, one after). Returns the seconds each size compiled here took."""
    executor = engine.runner.graphs
    executor.make_cacheable()
    sizes = ", ".join(map(str, executor.sizes))
    started = time.perf_counter()
    with inductor_cache_dir():
        if cache.is_warm():
            say(f"loading compiled decode steps for batch sizes {sizes} from {cache.directory}")
        else:
            say(
                f"compiling decode steps for batch sizes {sizes} (minutes each on a "
                f"small CPU; once: they are cached in {cache.directory} for later starts)"
            )
        adopted = cache.load_into(executor, say)
        missing = [size for size in executor.sizes if size not in adopted]
        for number, size in enumerate(missing, 1):
            seconds = executor.ready(size)
            say(f"compiled batch size {size} in {seconds:.1f} s ({number} of {len(missing)})")
            try:
                cache.save(size, executor.ahead_steps[size])
            except OSError as error:
                say(f"could not cache the compiled decode step of batch size {size}: {error}")
    say(f"decode steps ready for batch sizes {sizes} in {time.perf_counter() - started:.1f} s")
    return {size: executor.compile_seconds[size] for size in missing}


def eager_hint(cache: CompileCache) -> str:
    """The line a command prints when it runs eagerly for want of a warm cache."""
    return (
        "decode steps run eagerly: none are compiled for this model yet; start once with "
        "--compile to compile them (minutes per batch size) and cache them in "
        f"{cache.directory}; later starts load them instead of compiling again"
    )


def cache_to_compile_with(
    name: str, model, *, weights, device, requested: bool | None, max_num_seqs: int, say
) -> CompileCache | None:
    """What a command (``serve``, ``chat``) does with its decode steps: the
    :class:`CompileCache` to compile them through (:func:`compile_decode_steps`) when they are
    to be compiled (:func:`should_compile`), else None, having told ``say`` how to compile
    them when that is only for want of a warm cache. ``name``: the model as ``--model`` gave
    it. Raises ValueError when ``requested`` on a device other than the CPU."""
    from paged_attention.engine.model_runner import CompiledDecode

    if requested is False:
        return None
    if not str(device).startswith("cpu"):
        if requested:
            raise ValueError(f"compiled decode steps are for the CPU, not device {device}")
        return None
    sizes = CompiledDecode.sizes_for(max_num_seqs)
    cache = CompileCache(CompileKey.of(name, model, weights, sizes))
    if should_compile(requested, device, cache):
        return cache
    say(eager_hint(cache))
    return None
