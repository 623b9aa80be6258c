"""benchmarks/bench_cuda_kernels.cu builds against the kernel headers with nvcc (every CI run
has nvcc), and on a GPU it times every case."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.cpp_extension import CUDA_HOME

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import build_bench_cuda_kernels  # noqa: E402

NVCC = Path(CUDA_HOME) / "bin" / "nvcc" if CUDA_HOME else None


@pytest.mark.skipif(NVCC is None or not NVCC.exists(), reason="needs nvcc")
def test_builds_and_on_a_gpu_times_every_case(tmp_path):
    binary = tmp_path / "bench_cuda_kernels"
    # The command benchmarks/gpu_check.sh runs (stage kernels).
    build = subprocess.run(
        build_bench_cuda_kernels.nvcc_command(NVCC, binary),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert build.returncode == 0, build.stderr
    assert "warning" not in build.stderr, build.stderr
    if not torch.cuda.is_available():
        return
    report_path = tmp_path / "kernels.json"
    run = subprocess.run(
        [str(binary), "--json", str(report_path)], capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stdout + run.stderr
    rows = json.loads(report_path.read_text())["rows"]
    assert len(rows) == 9
    for row in rows:
        assert row["time_s"] > 0 and row["registers"] > 0 and row["ctas_per_sm"] > 0, row
        assert row["splits"] >= 1 and row["flops"] > 0, row
    # The long prompt chunk runs on 64-row CTAs, the short queries on the decode tiling.
    tilings = {row["case"]: row["row_warps"] for row in rows}
    assert tilings["bf16 varlen q512 4x2048"] == 4 and tilings["bf16 varlen q4 32x4096"] == 1
