"""The decode benchmark runs as benchmarks/gpu_check.sh calls it, on the CPU and a tiny grid."""

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def gpu_check_bench_commands() -> list[list[str]]:
    """The arguments of every bench_decode.py call in gpu_check.sh (line continuations joined)."""
    script = (ROOT / "benchmarks" / "gpu_check.sh").read_text().replace("\\\n", " ")
    commands = []
    for line in script.splitlines():
        if "$PY benchmarks/bench_decode.py" in line:
            words = shlex.split(line.split("$PY benchmarks/bench_decode.py", 1)[1])
            commands.append(words)
    return commands


def on_a_tiny_cpu_grid(args: list[str], tmp_path: Path) -> list[str]:
    """The same options, with the device, grid and output paths swapped for a quick CPU run."""
    replaced = {"--device": "cpu", "--batches": "1", "--contexts": "512", "--reps": "3"}
    out = []
    words = iter(args)
    for word in words:
        if word in replaced or word in ("--json", "--plot"):
            value = next(words)
            if word in ("--json", "--plot"):
                value = str(tmp_path / Path(value.replace("$OUT/", "")).name)
            out += [word, replaced.get(word, value)]
        else:
            out.append(word)
    return out + (["--reps", "3"] if "--reps" not in out else [])


def test_gpu_check_runs_the_benchmark_twice():
    commands = gpu_check_bench_commands()
    assert len(commands) == 2
    assert all(shlex.join(c).count("--device cuda") == 1 for c in commands)


@pytest.mark.parametrize("index", [0, 1], ids=["grid", "flex"])
def test_gpu_check_bench_arguments_run(index, tmp_path):
    args = on_a_tiny_cpu_grid(gpu_check_bench_commands()[index], tmp_path)
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_decode.py"), *args],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    json_path = Path(args[args.index("--json") + 1])
    report = json.loads(json_path.read_text())
    methods = args[args.index("--methods") + 1].split(",")
    dtypes = args[args.index("--dtypes") + 1].split(",")
    rows = report["rows"]
    assert {(r["dtype"], r["method"]) for r in rows} == {
        (d, m) for d in dtypes for m in [*methods, "limit"]
    }
    for row in rows:
        assert row.get("error") is None, row
        assert row["time_s"] > 0 and row["fraction_of_limit"] > 0
    if "--plot" in args:
        assert Path(args[args.index("--plot") + 1]).stat().st_size > 0
