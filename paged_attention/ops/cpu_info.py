"""What CPU this is, from Linux's ``/proc/cpuinfo``: its model, its vendor and the
instruction-set features the CPU kernels' variants are chosen by. The benchmarks record it with
their figures (:mod:`paged_attention.cli.machine`) and the model loader chooses by the vendor
which float layers to pack (:mod:`paged_attention.modeling.packed_linear`); both read it here."""

from __future__ import annotations

import platform
from pathlib import Path

# The instruction-set features the CPU kernels' variants are chosen by (as /proc/cpuinfo names
# them).
CPU_ISA_FLAGS = (
    "sse4_2", "avx", "avx2", "fma", "f16c", "bmi2", "avx512f", "avx512bw", "avx512vl",
    "avx512dq", "avx512_vnni", "avx512_bf16", "avx512_fp16", "avx_vnni", "amx_tile", "amx_bf16",
    "amx_int8", "amx_fp16",
)  # fmt: skip


def cpu_identity(cpuinfo_path: str = "/proc/cpuinfo") -> dict:
    """The CPU's model name, vendor (``vendor_id``, "" where there is none), and which of
    :data:`CPU_ISA_FLAGS` it reports, from the first processor of ``cpuinfo_path`` (elsewhere
    than Linux: the model from ``platform`` and no flags)."""
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
