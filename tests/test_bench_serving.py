"""The serving benchmark runs end to end on its quick configuration and reports what it says."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_serving  # noqa: E402


def test_workloads_are_seeded_and_share_the_system_prompt():
    a = bench_serving.workload_a(2048, quick=False)
    assert a == bench_serving.workload_a(2048, quick=False)
    assert len(a) == 64
    assert all(p[:512] == a[0][0][:512] for p, _ in a)
    assert all(32 <= len(p) - 512 <= 256 and s.max_new_tokens == 128 for p, s in a)
    arrivals = bench_serving.poisson_arrivals(64, rate=4.0)
    assert arrivals[0] == 0.0 and arrivals == sorted(arrivals)
    assert 8 < arrivals[-1] < 32  # about 64 / 4 seconds


def test_quick_run_reports_every_configuration(tmp_path):
    out = tmp_path / "serving.json"
    result = subprocess.run(
        [
            sys.executable,
            "benchmarks/bench_serving.py",
            "--quick",
            "--modes",
            "offline,poisson",
            "--configs",
            "prefix cache + chunked prefill,neither,transformers generate_batch()",
            "--json",
            str(out),
            "--plot",
            str(tmp_path / "serving.png"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr
    assert "| workload | arrivals | config | tokens/s |" in result.stdout
    rows = json.loads(out.read_text())["rows"]
    by_key = {(r["workload"], r["arrivals"].split()[0], r["config"]): r for r in rows}
    cached = by_key[("A", "offline", "prefix cache + chunked prefill")]
    plain = by_key[("A", "offline", "neither")]
    assert (
        cached["prompt_tokens_computed"] < plain["prompt_tokens_computed"] == plain["prompt_tokens"]
    )
    assert cached["generated_tokens"] == plain["generated_tokens"] == 8 * 16
    assert ("A", "offline", "transformers generate_batch()") in by_key
    assert ("B", "Poisson", "neither") in by_key
    assert all(r["tokens_per_s"] > 0 and r["ttft_p50_ms"] > 0 for r in rows)
    assert (tmp_path / "serving.png").read_bytes().startswith(b"\x89PNG")
