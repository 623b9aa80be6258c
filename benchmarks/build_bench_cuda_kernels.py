"""Builds benchmarks/bench_cuda_kernels.cu (the attention kernels timed without torch) with one
nvcc command: the one place that command is written, for gpu_check.sh and the CI build test.

    python benchmarks/build_bench_cuda_kernels.py OUTPUT [--nvcc PATH]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def nvcc_command(nvcc: str, output: str | Path) -> list[str]:
    return [
        str(nvcc),
        "-O3",
        "-std=c++20",
        "--expt-relaxed-constexpr",
        "-gencode=arch=compute_90,code=sm_90",
        f"-I{ROOT / 'csrc'}",
        str(ROOT / "benchmarks" / "bench_cuda_kernels.cu"),
        "-o",
        str(output),
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("output")
    parser.add_argument("--nvcc", default="nvcc")
    args = parser.parse_args()
    return subprocess.run(nvcc_command(args.nvcc, args.output)).returncode


if __name__ == "__main__":
    sys.exit(main())
