"""Build `paged_attention._C` against the PyTorch already installed.

Environment switches:
  PAGED_ATTENTION_CUDA   unset: build the CUDA sources when this torch has CUDA and nvcc is found;
                         1: build them, and fail if that is impossible; 0: CPU only.
  TORCH_CUDA_ARCH_LIST   the GPU architectures to compile for (e.g. "9.0"). When unset and no GPU
                         is visible, DEFAULT_CUDA_ARCH_LIST below is used.
  MAX_JOBS               parallel compile jobs (ninja); NVCC_THREADS: nvcc --threads (default 1).
  PAGED_ATTENTION_DEBUG_BUILD=1   -O0 -g host code, for debugging.
  PAGED_ATTENTION_SANITIZE=address   host code built with AddressSanitizer (CPU-only builds; load
                         it with libasan preloaded: see `make test-asan`).
"""

import glob
import os
import shutil
import sys
from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).resolve().parent
# Ampere and Hopper machine code, plus Hopper PTX that newer GPUs compile at load time.
DEFAULT_CUDA_ARCH_LIST = "8.0;9.0+PTX"


def _find_cuda_home():
    """The CUDA toolkit root, or None. A `nvcc` on PATH may be a wrapper script, so probe dirs."""
    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(str(Path(nvcc).resolve().parent.parent))
    for candidate in candidates:
        if (
            candidate
            and (Path(candidate) / "bin" / "nvcc").exists()
            and (Path(candidate) / "include" / "cuda_runtime.h").exists()
        ):
            return candidate
    return None


def _want_cuda(torch, cuda_home):
    switch = os.environ.get("PAGED_ATTENTION_CUDA", "").strip()
    if switch == "0":
        return False
    available = torch.version.cuda is not None and cuda_home is not None
    if switch == "1":
        if torch.version.cuda is None:
            sys.exit("PAGED_ATTENTION_CUDA=1 but the installed torch has no CUDA support")
        if cuda_home is None:
            sys.exit("PAGED_ATTENTION_CUDA=1 but nvcc was not found (set CUDA_HOME)")
        return True
    if switch not in ("", "auto"):
        sys.exit(f"PAGED_ATTENTION_CUDA must be 0, 1 or unset, got {switch!r}")
    return available


def _extensions():
    cuda_home = _find_cuda_home()
    if cuda_home and "CUDA_HOME" not in os.environ:
        os.environ["CUDA_HOME"] = cuda_home  # read by torch.utils.cpp_extension at import
    import torch
    from torch.utils.cpp_extension import CppExtension, CUDAExtension

    with_cuda = _want_cuda(torch, cuda_home)
    debug = os.environ.get("PAGED_ATTENTION_DEBUG_BUILD") == "1"
    sanitizer = os.environ.get("PAGED_ATTENTION_SANITIZE", "").strip()
    if sanitizer not in ("", "address"):
        sys.exit(f"PAGED_ATTENTION_SANITIZE must be 'address' or unset, got {sanitizer!r}")
    if sanitizer and with_cuda:
        sys.exit("PAGED_ATTENTION_SANITIZE=address needs a CPU-only build (PAGED_ATTENTION_CUDA=0)")
    # -g0: Python's own build flags may carry -g; with it, csrc/cpu/attention.cpp compiled in 56 s
    # instead of 39 s on a 2-core machine, for debug information a release build does not need.
    host_flags = ["-O0", "-g"] if debug else ["-O3", "-g0"]
    # -Wno-psabi: the CPU kernels are built per instruction set and picked at run time; gcc warns
    # that vector arguments change ABI across those builds, which never call one another.
    host_flags += ["-std=c++20", "-fvisibility=hidden", "-Wno-psabi"]
    link_flags = []
    if sanitizer:
        # and reused scratch poisoned with NaN (csrc/cpu/simd.h, AlignedArray::grow)
        host_flags += ["-fsanitize=address", "-fno-omit-frame-pointer"]
        host_flags.append("-DPA_POISON_REUSED_SCRATCH")
        if not debug:
            host_flags.append("-g1")  # line tables, so that the reports name file and line
        link_flags.append("-fsanitize=address")
    # at::parallel_for is inline in ATen's headers: with torch's OpenMP backend it only runs in
    # parallel when the extension itself is compiled with OpenMP (otherwise it runs serially).
    if torch.backends.openmp.is_available():
        host_flags.append("-fopenmp")
        link_flags.append("-fopenmp")
    sources = ["csrc/torch_bindings.cpp", "csrc/checks.cpp", *sorted(glob.glob("csrc/cpu/*.cpp"))]
    include_dirs = [str(ROOT / "csrc")]
    if not with_cuda:
        return [
            CppExtension(
                "paged_attention._C",
                sources,
                include_dirs=include_dirs,
                extra_compile_args={"cxx": host_flags},
                extra_link_args=link_flags,
                py_limited_api=False,
            )
        ]

    if not os.environ.get("TORCH_CUDA_ARCH_LIST") and not torch.cuda.is_available():
        os.environ["TORCH_CUDA_ARCH_LIST"] = DEFAULT_CUDA_ARCH_LIST
        print(f"paged_attention: no GPU visible, building for {DEFAULT_CUDA_ARCH_LIST}")
    # torch's CUDA wheels ship some CUDA library headers (cusparse.h, ...) only here.
    wheel_headers = Path(torch.__file__).resolve().parent.parent / "nvidia" / "cu13" / "include"
    if wheel_headers.is_dir():
        include_dirs.append(str(wheel_headers))
    sources += sorted(glob.glob("csrc/cuda/*.cpp")) + sorted(glob.glob("csrc/cuda/*.cu"))
    nvcc_flags = [
        "-O3",
        "-std=c++20",
        "--expt-relaxed-constexpr",
        f"--threads={os.environ.get('NVCC_THREADS', '1')}",
        "-U__CUDA_NO_HALF_OPERATORS__",
        "-U__CUDA_NO_HALF_CONVERSIONS__",
        "-U__CUDA_NO_BFLOAT16_OPERATORS__",
        "-U__CUDA_NO_BFLOAT16_CONVERSIONS__",
    ]
    return [
        CUDAExtension(
            "paged_attention._C",
            sources,
            include_dirs=include_dirs,
            define_macros=[("PAGED_ATTENTION_WITH_CUDA", "1")],
            extra_compile_args={"cxx": host_flags, "nvcc": nvcc_flags},
            extra_link_args=link_flags,
            py_limited_api=False,
        )
    ]


def _cmdclass():
    from torch.utils.cpp_extension import BuildExtension

    return {"build_ext": BuildExtension.with_options(use_ninja=True)}


setup(ext_modules=_extensions(), cmdclass=_cmdclass())
