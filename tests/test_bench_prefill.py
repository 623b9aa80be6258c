"""The prefill benchmark runs, on the CPU and a tiny grid, with every method and shape flag."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_bench_prefill(args: list[str]) -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_prefill.py"), *args],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_row_and_method_on_a_tiny_grid(tmp_path):
    json_path, png_path = tmp_path / "prefill.json", tmp_path / "prefill.png"
    run_bench_prefill(
        ["--max-batch", "2", "--max-context", "160", "--reps", "2", "--dtypes", "float32,bfloat16"]
        + ["--methods", "ours,gather+sdpa,sdpa-contig,v1", "--json", str(json_path)]
        + ["--plot", str(png_path)]
    )
    report = json.loads(json_path.read_text())
    assert report["machine"]["cpu_model"] and "kernel_variants" in report["machine"]
    rows = report["rows"]
    assert all(r.get("error") is None and r["time_s"] > 0 for r in rows), rows
    for dtype in ("float32", "bfloat16"):
        methods = {(r["row"], r["method"]) for r in rows if r["dtype"] == dtype}
        for row in "abcd":
            assert {(row, m) for m in ("ours", "gather+sdpa", "sdpa-contig")} <= methods
        assert ("d", "v1") in methods and ("a", "v1") not in methods
        assert {("a", "limit"), ("d", "limit")} <= methods and ("b", "limit") not in methods
        assert {(row, "flop-limit") for row in "abcd"} <= methods
        if dtype == "bfloat16":  # the product in the row's own dtype as well
            assert {(row, "flop-limit-bfloat16") for row in "abcd"} <= methods
    ours = {r["row"]: r for r in rows if r["method"] == "ours" and r["dtype"] == "float32"}
    assert [ours[row]["query_len"] for row in "abcd"] == [4, 40, 160, 1]  # b: 512 / 2048 of 160
    assert ours["a"]["fraction_of_limit"] > 0 and ours["d"]["speedup_vs_v1"] > 0
    assert ours["b"]["speedup_vs_gather_sdpa"] > 0 and ours["c"]["speedup_vs_sdpa_contig"] > 0
    assert png_path.stat().st_size > 0
    # the roof: the slower of the read limit and the dense product scaled to the row's FLOPs
    for row in "abcd":
        f32 = {r["method"]: r for r in rows if r["row"] == row and r["dtype"] == "float32"}
        gemm = f32["flop-limit"]
        arithmetic = gemm["time_s"] * f32["ours"]["flops"] / gemm["flops"]
        expected = max(arithmetic, f32["limit"]["time_s"] if "limit" in f32 else 0.0)
        assert abs(gemm["flops"] - f32["ours"]["flops"]) <= 16 * 2 * 2048 * 2048
        for method in ("ours", "gather+sdpa", "sdpa-contig"):
            assert f32[method]["roof_s"] == expected
            assert f32[method]["fraction_of_roof"] == expected / f32[method]["time_s"]


def test_shape_flags_and_flex(tmp_path):
    json_path = tmp_path / "shape.json"
    flags = ["--heads", "8", "--kv-heads", "2", "--head-size", "64", "--block-size", "32"]
    run_bench_prefill(
        flags
        + ["--rows", "b", "--max-batch", "1", "--max-context", "200", "--reps", "2"]
        + ["--dtypes", "float32", "--methods", "ours,flex", "--json", str(json_path)]
    )
    report = json.loads(json_path.read_text())
    assert report["shape"] == {"num_heads": 8, "num_kv_heads": 2, "head_size": 64, "block_size": 32}
    assert [r["method"] for r in report["rows"]] == ["ours", "flex", "flop-limit"]
    assert all(r.get("error") is None for r in report["rows"]), report["rows"]
    assert report["rows"][0]["kv_bytes"] == 2 * 1 * 200 * 2 * 64 * 4
