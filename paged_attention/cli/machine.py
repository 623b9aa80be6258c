"""What a measurement ran on: the benchmarks and the demo record this in their JSON (under
``machine``) and print it, so that figures from different machines are never read as one; and
the machine's read limit, the fastest streaming read of a buffer with all of torch's threads,
which the decode benchmarks measure in the same run as the kernels they bound."""

from __future__ import annotations

import dataclasses
import os
import platform
import time
from pathlib import Path

import torch

from paged_attention.ops.cpu_info import cpu_identity


def kernel_variants() -> dict:
    """The CPU kernels' variants a call makes now: the vector instruction set and the bf16 product
    (csrc/cpu/variants.h), and the bf16 products this CPU runs."""
    import paged_attention.ops.bindings  # noqa: F401  (registers torch.ops.paged_attention)

    ops = torch.ops.paged_attention
    vector, bf16_matmul = ops._cpu_kernel_variants()
    return dict(vector=vector, bf16_matmul=bf16_matmul, bf16_matmuls_usable=ops._cpu_bf16_matmuls())


def machine_info(device: torch.device | str = "cpu") -> dict:
    """The machine of a run: software versions, threads, the load average when it started (other
    work skews timings), the CPU (model, features, the kernels' variants) and the GPU if any."""
    device = torch.device(device)
    info = dict(
        platform=platform.platform(),
        python=platform.python_version(),
        torch=torch.__version__,
        cores=os.cpu_count(),
        threads=torch.get_num_threads(),
        load_average=[round(x, 2) for x in os.getloadavg()],
        **cpu_identity(),
        cpu_capability=torch.backends.cpu.get_cpu_capability(),
        kernel_variants=kernel_variants(),
    )
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(gpu=props.name, sms=props.multi_processor_count)
    return info


def describe_machine(info: dict) -> str:
    """One line naming the machine a run measured: the GPU, or the CPU's model, features and
    kernel variants."""
    if "gpu" in info:
        return f"GPU: {info['gpu']} ({info['sms']} SMs), torch {info['torch']}"
    variants = info["kernel_variants"]
    return (
        f"CPU: {info['cpu_model']} ({info['cpu_vendor']}), {info['cores']} cores, "
        f"{info['threads']} threads; features: {' '.join(info['cpu_isa_flags'])}; kernels: "
        f"{variants['vector']} vectors, bf16 products {variants['bf16_matmul']}; load average "
        f"{' '.join(map(str, info['load_average']))}"
    )


# --------------------------------------------------------------------------------------------
# The read limit: how fast this machine's threads can read a buffer, the bound of a kernel that
# must read every byte of its operands once (decode attention reads its K and V).

# On CUDA one timed sample is this many back-to-back calls, so that launch overhead overlaps the
# previous call and the time per call is the GPU's unless the host is the slower.
CUDA_CALLS_PER_SAMPLE = 10
# A read-limit buffer is a whole number of gemv rows of this many float32 values (4 KiB).
GEMV_COLUMNS = 1024
ROW_BYTES = 4 * GEMV_COLUMNS
# The buffer of the memory read limit is this many times the last-level cache, so that almost
# none of it is still cached when it is read again, and at least MEMORY_BUFFER_FLOOR bytes.
LLC_MULTIPLE = 4
MEMORY_BUFFER_FLOOR = 1 << 30


def _read_by_sum(buffer: torch.Tensor):
    return buffer.view(torch.float32).sum


def _read_by_amax(buffer: torch.Tensor):
    return buffer.view(torch.int32).amax


def _read_by_gemv(buffer: torch.Tensor):
    matrix = buffer.view(torch.float32).view(-1, GEMV_COLUMNS)
    ones = torch.ones(GEMV_COLUMNS, dtype=torch.float32, device=buffer.device)
    return lambda: torch.mv(matrix, ones)


# Streaming reads, each of every byte of a buffer once with all of torch's intra-op threads (the
# threads the kernels' at::parallel_for uses): different instruction mixes and libraries (torch's
# vectorised reductions, the BLAS's matrix-vector product), so that the limit is the fastest of
# them rather than one reduction's arithmetic.
STREAM_READERS = {"sum": _read_by_sum, "amax": _read_by_amax, "gemv": _read_by_gemv}


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def calls_per_sample(device: torch.device) -> int:
    """How many back-to-back calls one timed sample makes on ``device``."""
    return CUDA_CALLS_PER_SAMPLE if device.type == "cuda" else 1


def seconds_per_call(fn, device: torch.device) -> float:
    """One timed sample of ``fn``, in seconds per call: one call by the wall clock on the CPU,
    ``CUDA_CALLS_PER_SAMPLE`` calls timed with events on CUDA."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(CUDA_CALLS_PER_SAMPLE):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / CUDA_CALLS_PER_SAMPLE
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def best_call_seconds(fn, device, reps: int, budget_s: float = 2.0) -> float:
    """Best time per call of ``fn`` in seconds over up to ``reps`` samples (at least 3, fewer once
    ``budget_s`` is spent), after one warm-up run; each sample is :func:`seconds_per_call`."""
    device = torch.device(device)
    fn()
    synchronize(device)
    best = float("inf")
    spent = 0.0
    for i in range(max(reps, 3)):
        per_call = seconds_per_call(fn, device)
        best = min(best, per_call)
        spent += per_call * calls_per_sample(device)
        if i >= 2 and spent > budget_s:
            break
    return best


@dataclasses.dataclass(frozen=True)
class ReadLimit:
    """The fastest streaming read measured over a buffer of ``buffer_bytes``: ``bytes_per_s`` by
    ``reader`` with ``threads`` threads; ``rates`` holds every reader's bytes per second."""

    bytes_per_s: float
    reader: str
    buffer_bytes: int
    threads: int
    rates: dict[str, float]

    def seconds(self, nbytes: int) -> float:
        """The least time reading ``nbytes`` at this limit takes."""
        return nbytes / self.bytes_per_s

    def faster(self, other: ReadLimit | None) -> ReadLimit:
        """The faster of two measurements (a shared machine only ever slows a read down)."""
        return self if other is None or self.bytes_per_s >= other.bytes_per_s else other

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def measure_read_limit(
    nbytes: int, device="cpu", reps: int = 5, allocate=None, budget_s: float = 2.0
) -> ReadLimit:
    """Time every STREAM_READERS reader over one buffer of about ``nbytes`` (rounded down to whole
    4 KiB rows, at least one) and return the fastest, as bytes per second. ``allocate(nbytes,
    device)`` makes the uint8 buffer (default: ``torch.empty``), e.g. on huge pages; it is filled
    before the first read, so that no timed read pays for page faults."""
    if not isinstance(nbytes, int) or nbytes <= 0:
        raise ValueError(f"nbytes must be a positive int, got {nbytes!r}")
    if not isinstance(reps, int) or reps < 1:
        raise ValueError(f"reps must be a positive int, got {reps!r}")
    device = torch.device(device)
    size = max(ROW_BYTES, nbytes // ROW_BYTES * ROW_BYTES)
    buffer = (allocate or _plain_buffer)(size, device)
    if buffer.dtype != torch.uint8 or buffer.numel() != size:
        raise ValueError(f"allocate must return {size} uint8 elements, got {tuple(buffer.shape)}")
    buffer.view(torch.float32).fill_(1.0)
    rates = {
        name: size / best_call_seconds(make(buffer), device, reps, budget_s)
        for name, make in STREAM_READERS.items()
    }
    reader = max(rates, key=rates.get)
    return ReadLimit(rates[reader], reader, size, torch.get_num_threads(), rates)


def _plain_buffer(nbytes: int, device: torch.device) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, device=device)


def last_level_cache_bytes(device="cpu", cache_dir: str = "/sys/devices/system/cpu/cpu0/cache"):
    """The largest cache of the first CPU (Linux's sysfs; 0 where it is not found), or the GPU's
    L2."""
    device = torch.device(device)
    if device.type == "cuda":
        return int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0))
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    best = 0
    for index in Path(cache_dir).glob("index*"):
        try:
            size = (index / "size").read_text().strip()
            value = int(size[:-1]) * units[size[-1]] if size[-1] in units else int(size)
        except (OSError, ValueError, IndexError):
            continue
        best = max(best, value)
    return best


def memory_buffer_bytes(device="cpu") -> int:
    """The size of the memory read limit's buffer: LLC_MULTIPLE times the last-level cache, and at
    least MEMORY_BUFFER_FLOOR."""
    return max(LLC_MULTIPLE * last_level_cache_bytes(device), MEMORY_BUFFER_FLOOR)
