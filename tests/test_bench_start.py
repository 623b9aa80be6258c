"""benchmarks/bench_start.py: its --split, the steps of the engine's side of a serve start."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_start  # noqa: E402
import publish  # noqa: E402

from paged_attention.cli.serve import ENGINE_MODULES  # noqa: E402


def test_the_split_times_every_step_of_the_engines_side_in_order():
    steps = bench_start.one_split(["--model", "tiny", "--no-compile"], ROOT, ENGINE_MODULES)
    expected = [f"import {name}" for name in ENGINE_MODULES]
    expected += ["the command line", "load_model", "build_engine", "total"]
    assert list(steps) == expected  # eager: no compiled step, so no inductor graph import
    assert all(seconds >= 0 for seconds in steps.values())
    assert steps["import torch"] > 0.1  # a fresh interpreter imports torch itself
    parts = sum(seconds for name, seconds in steps.items() if name != "total")
    assert parts <= steps["total"] < parts + 0.05


def test_split_medians_keep_the_steps_order_and_skip_missing_ones():
    rows = [
        {"tree": "a", "x": 1.0, "y": 5.0, "total": 6.0},
        {"tree": "a", "x": 3.0, "total": 3.0},
        {"tree": "a", "x": 2.0, "y": 7.0, "total": 9.0},
    ]
    assert bench_start.split_medians(rows) == {"x": 2.0, "y": 6.0, "total": 6.0}


def test_the_split_command_writes_its_rounds_and_medians(tmp_path):
    out = tmp_path / "split.json"
    command = [sys.executable, str(ROOT / "benchmarks" / "bench_start.py"), "--split"]
    command += ["--rounds", "1", "--json", str(out), "--", "--model", "tiny", "--no-compile"]
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert done.returncode == 0, done.stderr
    assert "median seconds of 1 rounds" in done.stdout
    report = json.loads(out.read_text())
    assert report["benchmark"] == "bench_start_split" and len(report["rows"]) == 1
    assert report["median"]["new"]["total"] == report["rows"][0]["total"]
    assert report["serve_args"] == ["--model", "tiny", "--no-compile"]
    assert publish.kind_of(report) == "start_split"
    section = publish.start_split_section(report)
    assert "`--model tiny --no-compile`" in section
    for step in report["rows"][0]:
        if step != "tree":
            assert f"| new | {step} | " in section
