"""What a measurement ran on: the benchmarks and the demo record this in their JSON (under
``machine``) and print it, so that figures from different machines are never read as one."""

from __future__ import annotations

import os
import platform
from pathlib import Path

import torch

# The instruction-set features the CPU kernels' variants are chosen by (as /proc/cpuinfo names
# them).
CPU_ISA_FLAGS = (
    "sse4_2", "avx", "avx2", "fma", "f16c", "bmi2", "avx512f", "avx512bw", "avx512vl",
    "avx512dq", "avx512_vnni", "avx512_bf16", "avx512_fp16", "avx_vnni", "amx_tile", "amx_bf16",
    "amx_int8", "amx_fp16",
)  # fmt: skip


def cpu_identity(cpuinfo_path: str = "/proc/cpuinfo") -> dict:
    """The CPU's model name, vendor, and which of CPU_ISA_FLAGS it reports (Linux's
    /proc/cpuinfo; elsewhere the model from ``platform`` and no flags)."""
    fields: dict[str, str] = {}
    try:
        for line in Path(cpuinfo_path).read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if not key and fields:
                break  # the first processor's block is enough
            fields.setdefault(key, value.strip())
    except OSError:
        pass
    flags = set(fields.get("flags", "").split())
    return dict(
        cpu_model=fields.get("model name") or platform.processor() or platform.machine(),
        cpu_vendor=fields.get("vendor_id", ""),
        cpu_isa_flags=[flag for flag in CPU_ISA_FLAGS if flag in flags],
    )


def kernel_variants() -> dict:
    """The CPU kernels' variants a call makes now: the vector instruction set and the bf16 product
    (csrc/cpu/variants.h), and the bf16 products this CPU runs."""
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
