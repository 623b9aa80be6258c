"""Gates on the machine code (SASS) of the CUDA attention kernels, for every architecture the
README promises: sm_80, sm_86, sm_89 and sm_90.

tests/cuda_sass.py reads the kernels without a GPU. An architecture the built extension
(paged_attention/_C*.so) holds is read from it; any other is compiled here from the three
attention translation units alone (csrc/cuda/attention_<dtype>.cu, no torch headers), about a
minute of CPU per architecture, cached under build/sass/. One kernel body serves decode (v1, v2) and
varlen attention (csrc/cuda/attention/): every fp16/bf16 variant, in both row tilings (one warp
of rows: 16-row CTAs; four warps: 64 rows) and each ring depth the plan picks on some GPU, must
use tensor cores (HMMA), ldmatrix (LDSM) and asynchronous copies (LDGSTS, waited with DEPBAR);
the fp32 kernels the asynchronous copies; no kernel may use local memory (spills, or its
parameters copied there: they are __grid_constant__); and every attention kernel's registers
must leave room for the CTAs per SM its __launch_bounds__ asks for (csrc/cuda/attention/plan.h:
compiled_ctas_per_sm).

CI builds the CUDA sources (PAGED_ATTENTION_CUDA=1): then a missing CUDA build or tool fails
these tests. Without that switch they skip on a CPU-only build.
"""

from __future__ import annotations

import os

import cuda_sass
import pytest

REQUIRED = os.environ.get("PAGED_ATTENTION_CUDA") == "1"
ARCHS = ("80", "86", "89", "90")
CACHES = ("auto", "fp8_e4m3", "fp8_e5m2")
BUCKETS = (64, 128, 256)
# Ring stages of each variant (plan.h): the full ring, and the compact ring for GPUs with 99 KiB
# of shared memory per CTA where the full one does not fit there:
# (tensor cores?, fp8 cache?, head bucket, warps of rows) -> stages.
RINGS = {
    (True, False, 64, 1): {3},
    (True, False, 128, 1): {3, 2},
    (True, False, 256, 1): {2, 1},
    (True, True, 64, 1): {3},
    (True, True, 128, 1): {3},
    (True, True, 256, 1): {3, 2},
    (True, False, 64, 4): {4},
    (True, False, 128, 4): {4},
    (True, False, 256, 4): {3},
    (True, True, 64, 4): {4},
    (True, True, 128, 4): {4},
    (True, True, 256, 4): {4},
    (False, False, 64, 1): {3},
    (False, False, 128, 1): {3},
    (False, False, 256, 1): {2, 1},
    (False, True, 64, 1): {3},
    (False, True, 128, 1): {3},
    (False, True, 256, 1): {3},
}
# Resident CTAs per SM each variant is compiled for (compiled_ctas_per_sm), from its shared
# memory on the largest GPU its ring runs on and its registers: (tensor cores?, fp8 cache?,
# head bucket, warps of rows, stages) -> CTAs. A compact ring runs on 99 KiB GPUs only, one CTA
# per SM.
COMPILED_CTAS = {
    (True, False, 64, 1, 3): 4,
    (True, False, 128, 1, 3): 2,
    (True, False, 256, 1, 2): 1,
    (True, True, 64, 1, 3): 3,
    (True, True, 128, 1, 3): 2,
    (True, True, 256, 1, 3): 2,
    (True, False, 64, 4, 4): 4,
    (True, False, 128, 4, 4): 3,
    (True, False, 256, 4, 3): 2,
    (True, True, 64, 4, 4): 4,
    (True, True, 128, 4, 4): 3,
    (True, True, 256, 4, 4): 2,
    (False, False, 64, 1, 3): 2,
    (False, False, 128, 1, 3): 2,
    (False, False, 256, 1, 2): 1,
    (False, True, 64, 1, 3): 2,
    (False, True, 128, 1, 3): 2,
    (False, True, 256, 1, 3): 2,
    (True, False, 128, 1, 2): 1,
    (True, False, 256, 1, 1): 1,
    (True, True, 256, 1, 2): 1,
    (False, False, 256, 1, 1): 1,
}


def unavailable(reason: str):
    if REQUIRED:
        pytest.fail(f"PAGED_ATTENTION_CUDA=1, but {reason}")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def built() -> dict[str, dict[str, cuda_sass.Kernel]]:
    """The built extension's kernels per architecture (empty for a CPU-only build)."""
    path = cuda_sass.extension_path()
    if path is None:
        unavailable("the extension paged_attention._C is not built")
    if cuda_sass.find_tool("cuobjdump") is None:
        unavailable("no cuobjdump (triton's wheel, CUDA_HOME/bin, PATH)")
    return cuda_sass.read_kernels(path)


@pytest.fixture(scope="module", params=ARCHS, ids=[f"sm_{a}" for a in ARCHS])
def kernels(request, built) -> dict[str, cuda_sass.Kernel]:
    arch = request.param
    if arch in built:
        return built[arch]
    if not built and not REQUIRED:
        pytest.skip("a CPU-only build (PAGED_ATTENTION_CUDA=1 builds and checks the CUDA code)")
    if cuda_sass.nvcc() is None:
        unavailable(f"the extension holds no sm_{arch} code and nvcc is not found to compile it")
    return cuda_sass.cubin_kernels(arch)


def shape_key(query: str, cache: str, bucket: int, row_warps: int) -> tuple:
    return (query != "Float32", cache != "auto", bucket, row_warps)


def test_every_attention_variant_is_built(kernels):
    mma = cuda_sass.attention_variants(kernels, "mma")
    core = cuda_sass.attention_variants(kernels, "core")
    assert set(mma) == {
        (q, c, b, w, stages)
        for q in ("Float16", "BFloat16")
        for c in CACHES
        for b in BUCKETS
        for w in (1, 4)
        for stages in RINGS[shape_key(q, c, b, w)]
    }
    assert set(core) == {
        ("Float32", c, b, 1, stages)
        for c in CACHES
        for b in BUCKETS
        for stages in RINGS[shape_key("Float32", c, b, 1)]
    }
    reduces = [n for n in kernels if "reduce_partials_kernel" in n]
    assert len(reduces) == 6  # per query dtype: fp32 partials (v1, varlen) and v2's
    assert any("schedule_varlen_kernel" in n for n in kernels)


def test_keys_and_values_arrive_by_cp_async_only(kernels):
    # The plain global loads of an attention kernel (the query, seq_lens, query_start_loc, the
    # work item, one block id per tile, ALiBi slopes, sinks, fp8 scales) are few, and as many
    # for every head size: keys and values, whose loads would grow with the head size, come by
    # cp.async (LDGSTS) alone.
    for family in ("mma", "core"):
        variants = cuda_sass.attention_variants(kernels, family)
        for (query, cache, bucket, row_warps, stages), kernel in variants.items():
            plain = kernel.count("LDG.")
            assert plain <= 48, (query, cache, bucket, row_warps, stages, plain)
            full = max(RINGS[shape_key(query, cache, 64, row_warps)])
            smallest = variants[(query, cache, 64, row_warps, full)]
            assert plain == smallest.count("LDG."), (query, cache, bucket, row_warps, stages)


def test_fp16_bf16_kernels_run_on_tensor_cores_fed_by_ldmatrix_and_cp_async(kernels):
    for key, kernel in cuda_sass.attention_variants(kernels, "mma").items():
        query, cache, bucket = key[:3]
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
    for key, kernel in cuda_sass.attention_variants(kernels, "core").items():
        assert kernel.count("LDGSTS") > 0 and kernel.count("DEPBAR") > 0, key
        assert kernel.count("HMMA") == 0, key  # TF32 would miss fp32's tolerance


def test_no_kernel_uses_local_memory(kernels):
    # No spill and no copy of the parameters (about 300 bytes, __grid_constant__) to local
    # memory: no stack frame in the resource usage, and no instruction that makes or uses one,
    # whether through LDL/STL or generic loads and stores of an address based on the stack
    # pointer.
    assert kernels
    for name, kernel in kernels.items():
        assert kernel.stack == 0 and kernel.local == 0, (name, kernel.stack, kernel.local)
        frame = cuda_sass.local_frame(kernel)
        assert not frame, (name, [f"{i.opcode} {i.operands}" for i in frame[:4]])


@pytest.mark.parametrize("family", ["mma", "core"])
def test_registers_leave_room_for_the_ctas_they_are_compiled_for(kernels, family):
    for key, kernel in cuda_sass.attention_variants(kernels, family).items():
        query, cache, bucket, row_warps, stages = key
        variant = (*shape_key(query, cache, bucket, row_warps), stages)
        ctas = COMPILED_CTAS[variant]
        budget = min(255, 65536 // (128 * ctas) // 8 * 8)  # registers go by 8 per thread
        assert 0 < kernel.registers <= budget, (*key, kernel.registers, budget)


def test_the_main_loop_is_found_in_every_attention_kernel(kernels):
    # tests/cuda_sass.py's main loop (the per-tile instruction count it reports) holds one tile's
    # MMAs: S = Q K^T and one pass of P V.
    for key, kernel in cuda_sass.attention_variants(kernels, "mma").items():
        loop = cuda_sass.main_loop(kernel, "HMMA")
        bucket = key[2]
        assert kernel.count("HMMA", loop.tile) == bucket // 16 * 2 + bucket // 8, key
        assert kernel.count("LDGSTS", loop.tile) > 0, key
    for key, kernel in cuda_sass.attention_variants(kernels, "core").items():
        loop = cuda_sass.main_loop(kernel, "FFMA")
        assert kernel.count("LDGSTS", loop.tile) > 0 and kernel.count("FFMA", loop.tile) > 0, key
