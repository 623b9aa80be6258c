"""Gates on the machine code (SASS) of the built extension's CUDA attention kernels.

``cuobjdump`` (shipped in triton's wheel, or the CUDA toolkit's) reads the kernels embedded in
paged_attention/_C*.so without a GPU. One kernel body serves decode (v1, v2) and varlen attention
(csrc/cuda/attention/): every fp16/bf16 variant, in both row tilings (one warp of rows: 16-row
CTAs; four warps: 64 rows), must use tensor cores (HMMA), ldmatrix (LDSM) and asynchronous
copies (LDGSTS, waited with DEPBAR); the fp32 kernels the asynchronous copies; no kernel may
spill to local memory; and every attention kernel's registers must leave room for the CTAs per
SM its __launch_bounds__ asks for (csrc/cuda/attention/plan.h: compiled_ctas_per_sm).

CI builds the CUDA sources (PAGED_ATTENTION_CUDA=1): then a missing CUDA build or tool fails
these tests. Without that switch they skip on a CPU-only build.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

REQUIRED = os.environ.get("PAGED_ATTENTION_CUDA") == "1"
CACHES = {0: "auto", 1: "fp8_e4m3", 2: "fp8_e5m2"}
BUCKETS = (64, 128, 256)
# Resident CTAs per SM each variant is compiled for (compiled_ctas_per_sm in plan.h), from its
# shared memory on an H100/H200 and its registers:
# (tensor cores?, fp8 cache?, head bucket, warps of rows) -> CTAs.
COMPILED_CTAS = {
    (True, False, 64, 1): 4,
    (True, False, 128, 1): 2,
    (True, False, 256, 1): 1,
    (True, True, 64, 1): 3,
    (True, True, 128, 1): 2,
    (True, True, 256, 1): 2,
    (True, False, 64, 4): 4,
    (True, False, 128, 4): 3,
    (True, False, 256, 4): 2,
    (True, True, 64, 4): 4,
    (True, True, 128, 4): 3,
    (True, True, 256, 4): 2,
    (False, False, 64, 1): 2,
    (False, False, 128, 1): 2,
    (False, False, 256, 1): 1,
    (False, True, 64, 1): 2,
    (False, True, 128, 1): 2,
    (False, True, 256, 1): 2,
}
ROW_WARPS = (1, 4)


def unavailable(reason: str):
    if REQUIRED:
        pytest.fail(f"PAGED_ATTENTION_CUDA=1, but {reason}")
    pytest.skip(reason)


def cuobjdump() -> str | None:
    candidates = []
    spec = importlib.util.find_spec("triton")
    if spec and spec.origin:
        candidates.append(Path(spec.origin).parent / "backends" / "nvidia" / "bin" / "cuobjdump")
    for home in (os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if home:
            candidates.append(Path(home) / "bin" / "cuobjdump")
    found = shutil.which("cuobjdump")
    if found:
        candidates.append(Path(found))
    return next((str(c) for c in candidates if c.exists()), None)


def demangle(names: list[str]) -> list[str]:
    cxxfilt = shutil.which("c++filt")
    if cxxfilt is None:
        unavailable("c++filt is not installed")
    out = subprocess.run([cxxfilt], input="\n".join(names), capture_output=True, text=True)
    return out.stdout.splitlines()


class Kernel:
    def __init__(self, name: str):
        self.name = name
        self.opcodes: list[str] = []
        self.registers = self.stack = self.local = -1

    def count(self, prefix: str) -> int:
        return sum(op.startswith(prefix) for op in self.opcodes)


@pytest.fixture(scope="module")
def kernels() -> dict[str, Kernel]:
    spec = importlib.util.find_spec("paged_attention._C")
    if spec is None or spec.origin is None:
        unavailable("the extension paged_attention._C is not built")
    tool = cuobjdump()
    if tool is None:
        unavailable("no cuobjdump (triton's wheel, CUDA_HOME/bin, PATH)")
    sass = subprocess.run([tool, "-sass", spec.origin], capture_output=True, text=True)
    usage = subprocess.run([tool, "-res-usage", spec.origin], capture_output=True, text=True)
    if "Function :" not in sass.stdout:
        unavailable(f"{spec.origin} holds no CUDA machine code (a CPU-only build)")
    mangled: dict[str, Kernel] = {}
    current = None
    for line in sass.stdout.splitlines():
        header = re.match(r"\s*Function : (\S+)", line)
        if header:
            current = mangled.setdefault(header.group(1), Kernel(header.group(1)))
            continue
        instruction = re.match(r"\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", line)
        if instruction and current is not None:
            current.opcodes.append(instruction.group(1))
    name = None
    for line in usage.stdout.splitlines():
        header = re.search(r"Function (\S+):", line)
        if header:
            name = header.group(1)
            continue
        resources = re.search(r"REG:(\d+) STACK:(\d+) SHARED:\d+ LOCAL:(\d+)", line)
        if resources and name in mangled:
            kernel = mangled[name]
            kernel.registers, kernel.stack, kernel.local = map(int, resources.groups())
    readable = demangle(list(mangled))
    return {pretty: mangled[m] for pretty, m in zip(readable, mangled)}


def attention_kernels(kernels, family: str) -> dict[tuple, Kernel]:
    """(query dtype, cache, bucket, warps of rows) -> kernel, for mma_attention_kernel ("mma") or
    cuda_core_attention_kernel ("core", one warp of rows)."""
    found = {}
    for name, kernel in kernels.items():
        mma = re.search(
            r"mma_attention_kernel<paged_attention::cuda::(\w+), \(paged_attention::"
            r"CacheDtype\)(\d), (\d+), (\d+)>",
            name,
        )
        core = re.search(
            r"cuda_core_attention_kernel<\(paged_attention::CacheDtype\)(\d), (\d+)>", name
        )
        if family == "mma" and mma:
            key = (mma.group(1), CACHES[int(mma.group(2))], int(mma.group(3)), int(mma.group(4)))
            found[key] = kernel
        if family == "core" and core:
            found[("Float32", CACHES[int(core.group(1))], int(core.group(2)), 1)] = kernel
    return found


def test_keys_and_values_arrive_by_cp_async_only(kernels):
    # The plain global loads of an attention kernel (the query, seq_lens, query_start_loc, the
    # work item, one block id per tile, ALiBi slopes, sinks, fp8 scales) are few, and as many
    # for every head size: keys and values, whose loads would grow with the head size, come by
    # cp.async (LDGSTS) alone.
    for family in ("mma", "core"):
        variants = attention_kernels(kernels, family)
        for (query, cache, bucket, row_warps), kernel in variants.items():
            plain = kernel.count("LDG.")
            assert plain <= 48, (query, cache, bucket, row_warps, plain)
            smallest = variants[(query, cache, 64, row_warps)]
            assert plain == smallest.count("LDG."), (query, cache, bucket, row_warps)


def test_every_attention_variant_is_built(kernels):
    mma = attention_kernels(kernels, "mma")
    core = attention_kernels(kernels, "core")
    assert set(mma) == {
        (q, c, b, w)
        for q in ("Float16", "BFloat16")
        for c in CACHES.values()
        for b in BUCKETS
        for w in ROW_WARPS
    }
    assert set(core) == {("Float32", c, b, 1) for c in CACHES.values() for b in BUCKETS}
    reduces = [n for n in kernels if "reduce_partials_kernel" in n]
    assert len(reduces) == 6  # per query dtype: fp32 partials (v1, varlen) and v2's
    assert any("schedule_varlen_kernel" in n for n in kernels)


def test_fp16_bf16_kernels_run_on_tensor_cores_fed_by_ldmatrix_and_cp_async(kernels):
    for (query, cache, bucket, row_warps), kernel in attention_kernels(kernels, "mma").items():
        key = (query, cache, bucket, row_warps)
        # fp8 caches are converted to fp16 for the MMA; 16-bit caches keep the query's type.
        bf16 = query == "BFloat16" and cache == "auto"
        hmma = [op for op in kernel.opcodes if op.startswith("HMMA.16816.F32")]
        # Per 16-token tile: head_size / 16 k-steps of Q K^T and head_size / 8 n-blocks of P V,
        # two MMAs each (a 16-row tile of 2 x 8 columns) in the first; P V twice (masked tiles).
        assert len(hmma) >= bucket // 16 * 2 + bucket // 8 * 2, key
        assert all(op.endswith(".BF16") == bf16 for op in hmma), key
        assert kernel.count("LDSM") > 0 and kernel.count("LDGSTS") > 0, key
        assert kernel.count("DEPBAR") > 0, key  # cp.async.wait_group


def test_fp32_kernels_use_cp_async_and_no_tensor_cores(kernels):
    for key, kernel in attention_kernels(kernels, "core").items():
        assert kernel.count("LDGSTS") > 0 and kernel.count("DEPBAR") > 0, key
        assert kernel.count("HMMA") == 0, key  # TF32 would miss fp32's tolerance


def test_no_kernel_spills_to_local_memory(kernels):
    assert kernels
    for name, kernel in kernels.items():
        assert kernel.stack == 0 and kernel.local == 0, (name, kernel.stack, kernel.local)
        assert kernel.count("LDL") == 0 and kernel.count("STL") == 0, name


@pytest.mark.parametrize("family", ["mma", "core"])
def test_registers_leave_room_for_the_ctas_they_are_compiled_for(kernels, family):
    for (query, cache, bucket, row_warps), kernel in attention_kernels(kernels, family).items():
        ctas = COMPILED_CTAS[(family == "mma", cache != "auto", bucket, row_warps)]
        budget = min(255, 65536 // (128 * ctas) // 8 * 8)  # registers go by 8 per thread
        key = (query, cache, bucket, row_warps, kernel.registers, budget)
        assert 0 < kernel.registers <= budget, key
