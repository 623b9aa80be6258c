"""Compiled decode steps kept across processes: a second start of the same model configuration
loads what the first one compiled instead of compiling it again.

Compiling the decode step of one padded batch size
(:class:`~paged_attention.engine.model_runner.CompiledDecode`) goes through three stages, each
with a cache of its own: dynamo traces the Python into a graph, AOTAutograd traces that graph
into ATen operations (its cache keeps the result), inductor generates C++ from it and the C++
compiler builds it (inductor's FX graph cache keeps the generated code, its code cache the built
library). For a 30-layer model on two cores the last stage takes minutes, the first two tens of
seconds. ``torch.compiler.save_cache_artifacts()`` returns the AOTAutograd and FX graph cache
entries of one process as bytes and ``load_cache_artifacts`` puts them back into another's
caches, so the other process's compile finds them: only dynamo traces again (11-18 s of a
17-27 s warm start for SmolLM2's batch size 1 on two cores; docs/performance.md).

The steps compiled here have no frozen weights
(:meth:`~paged_attention.engine.model_runner.CompiledDecode.make_cacheable`): AOTAutograd
keeps no graph whose weights are constants, so with frozen weights a later process traced
the model through AOTAutograd again and ran freezing's passes over it again (about half of
a warm start's time).

:class:`CompileCache` keeps those bytes in one file per configuration under the project's cache
directory (:func:`~paged_attention.modeling.models.cache_root`: ``$PAGED_ATTENTION_CACHE``, else
``$XDG_CACHE_HOME/paged_attention``, else ``~/.cache/paged_attention``), in ``compiled/``. The
configuration (:class:`CompileKey`) is what changes the compiled steps or whether they exist:
the model (its file's path, size and modification time), its dtype, what its linear layers hold
(``--weights``, the kernel its quantized layers run, as resolved when they were built, and which
float layers were packed for oneDNN: :mod:`~paged_attention.modeling.packed_linear`, which
``PAGED_ATTENTION_PACK_LINEAR=0`` turns off), the padded batch sizes, the torch version and the
CPU's vector instruction set. A file is written whole under a temporary name and renamed into
place, so an interrupted start leaves no entry behind; an entry that is there is "warm".
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

CACHE_FORMAT = 2
"""Bumped when what an entry holds, or how the steps are compiled, changes."""
ARTIFACTS = "artifacts.bin"
KEY_FILE = "key.json"


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
        )

    def digest(self) -> str:
        fields = asdict(self)
        # A model with nothing packed compiles the same steps as before the field existed:
        # its entries (minutes of compiling each) keep their digest.
        if fields["packed_linear"] == "none":
            del fields["packed_linear"]
        text = json.dumps(fields, sort_keys=True)
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


class CompileCache:
    """The compiled decode steps of one :class:`CompileKey`, on disk under ``root`` (default:
    ``compiled/`` in the project's cache directory)."""

    def __init__(self, key: CompileKey, root: Path | None = None) -> None:
        if root is None:
            from paged_attention.modeling.models import cache_root

            root = cache_root() / "compiled"
        self.key = key
        self.directory = Path(root) / key.digest()[:24]

    @property
    def artifacts(self) -> Path:
        return self.directory / ARTIFACTS

    def is_warm(self) -> bool:
        """Whether an earlier process saved this key's compiled steps."""
        return self.artifacts.is_file()

    def load(self) -> bool:
        """Puts the saved steps into inductor's caches, so that compiling this key's steps finds
        them; False when there is no entry (or it cannot be read: then the steps compile)."""
        try:
            data = self.artifacts.read_bytes()
        except OSError:
            return False
        return torch.compiler.load_cache_artifacts(data) is not None

    def save(self) -> bool:
        """Saves what this process compiled (call it once every size is compiled); False when
        inductor recorded nothing to save. Raises OSError when the directory is not writable."""
        saved = torch.compiler.save_cache_artifacts()
        if saved is None:
            return False
        data = saved[0]
        self.directory.mkdir(parents=True, exist_ok=True)
        (self.directory / KEY_FILE).write_text(json.dumps(asdict(self.key), indent=1) + "\n")
        handle, staging = tempfile.mkstemp(prefix=f".{ARTIFACTS}.", dir=self.directory)
        try:
            with os.fdopen(handle, "wb") as file:
                file.write(data)
            os.replace(staging, self.artifacts)
        except BaseException:
            Path(staging).unlink(missing_ok=True)
            raise
        return True


@contextlib.contextmanager
def inductor_cache_dir(root: Path | None = None):
    """Within it, inductor's own on-disk cache (where the C++ it built lives: the saved
    artifacts hold the generated code, not the built libraries) is ``root`` (default:
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
    """Compiles every padded batch size of ``engine`` (built with ``compile=True``) now,
    through ``cache``: loaded from it when warm, saved into it when not (or when what it held
    no longer matched: the model's code changed). ``say(line)`` tells the user what happens
    (one line before, one after). Returns the seconds each size took."""
    from torch._dynamo.utils import counters

    executor = engine.runner.graphs
    executor.make_cacheable()
    sizes = ", ".join(map(str, executor.sizes))
    with inductor_cache_dir():
        if cache.load():
            say(f"loading compiled decode steps for batch sizes {sizes} from {cache.directory}")
        else:
            say(
                f"compiling decode steps for batch sizes {sizes} (minutes each on a "
                f"small CPU; once: they are cached in {cache.directory} for later starts)"
            )
        misses = _cache_misses(counters)
        seconds = engine.compile_decode_steps()
        if _cache_misses(counters) > misses or not cache.is_warm():
            try:
                cache.save()
            except OSError as error:
                say(f"could not cache the compiled decode steps: {error}")
    say(f"decode steps compiled for batch sizes {sizes} in {sum(seconds.values()):.1f} s")
    return seconds


def _cache_misses(counters) -> int:
    """How often AOTAutograd's cache and inductor's FX graph cache have missed so far."""
    return (
        counters["aot_autograd"]["autograd_cache_miss"] + counters["inductor"]["fxgraph_cache_miss"]
    )


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
