"""The decode benchmark runs as benchmarks/gpu_check.sh calls it, on the CPU and a tiny grid."""

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

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
    out += ["--memory-buffer-mib", "64"]  # a small memory read limit keeps the test fast
    return out + (["--reps", "3"] if "--reps" not in out else [])


def run_bench_decode(args: list[str]) -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_decode.py"), *args],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_gpu_check_runs_the_benchmark_three_times():
    """The grid against the peers, one 128K-token sequence (v2's reduce) and FlexAttention."""
    commands = gpu_check_bench_commands()
    assert len(commands) == 3
    assert all(shlex.join(c).count("--device cuda") == 1 for c in commands)


@pytest.mark.parametrize("index", [0, 1, 2], ids=["grid", "reduce", "flex"])
def test_gpu_check_bench_arguments_run(index, tmp_path):
    args = on_a_tiny_cpu_grid(gpu_check_bench_commands()[index], tmp_path)
    run_bench_decode(args)
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


def load_bench_decode():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import bench_decode
    finally:
        sys.path.pop(0)
    return bench_decode


@pytest.mark.parametrize("version", [1, 2])
def test_shape_reaches_ours_and_gather_sdpa(version):
    """A non-default shape, and a context that ends inside a block, through ours and gather+SDPA."""
    bench = load_bench_decode()
    shape = bench.Shape(num_heads=6, num_kv_heads=2, head_size=64, block_size=32)
    case = bench.build_case(torch.device("cpu"), torch.float32, 3, 1000, shape)
    assert case["key_cache"].shape == (3 * 32, 2, 16, 32, 4)
    assert case["query"].shape == (3, 6, 64)
    ours = bench.method_ours(case, version)()
    expected = bench.method_gather_sdpa(case)().squeeze(2)
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-5)
    assert bench.kv_bytes(3, 1000, torch.float32, shape) == 2 * 3 * 1000 * 2 * 64 * 4


def test_shape_flags_are_recorded(tmp_path):
    json_path = tmp_path / "shape.json"
    flags = ["--heads", "8", "--kv-heads", "1", "--head-size", "96", "--block-size", "8"]
    run_bench_decode(
        flags
        + ["--batches", "2", "--contexts", "300", "--methods", "v1,gather+sdpa", "--reps", "2"]
        + ["--dtypes", "bfloat16", "--json", str(json_path), "--memory-buffer-mib", "64"]
    )
    report = json.loads(json_path.read_text())
    assert report["shape"] == {"num_heads": 8, "num_kv_heads": 1, "head_size": 96, "block_size": 8}
    assert [r["method"] for r in report["rows"]] == ["v1", "gather+sdpa", "limit"]
    machine = report["machine"]  # the CPU is recorded, so runs on different CPUs stay apart
    assert machine["cpu_model"] and isinstance(machine["cpu_isa_flags"], list)
    variants = machine["kernel_variants"]
    assert variants["vector"] in ("avx512", "avx2", "baseline")
    assert variants["bf16_matmul"] in ("amx", "avx512bf16", "none")
    assert variants["bf16_matmuls_usable"][-1] == "reference"
    assert all(r.get("error") is None for r in report["rows"])
    assert report["rows"][0]["kv_bytes"] == 2 * 2 * 300 * 1 * 96 * 2


def test_the_read_limit_is_measured_in_the_run_and_bounds_every_method(tmp_path):
    """The limit row is the fastest reader over the row's bytes or over the memory buffer; no
    method reads faster (the run would have failed)."""
    json_path = tmp_path / "limit.json"
    run_bench_decode(
        ["--batches", "2", "--contexts", "1024", "--methods", "v1,v2,gather+sdpa", "--reps", "3"]
        + ["--dtypes", "float32", "--json", str(json_path), "--memory-buffer-mib", "32"]
    )
    report = json.loads(json_path.read_text())
    assert report["measurement_errors"] == []
    memory = report["read_limit"]["memory"]
    assert memory["buffer_bytes"] == 32 << 20 and memory["threads"] == torch.get_num_threads()
    assert memory["reader"] in memory["rates"] and set(memory["rates"]) == {"sum", "amax", "gemv"}
    (limit,) = [r for r in report["rows"] if r["method"] == "limit"]
    assert limit["bytes_per_s"] == max(memory["bytes_per_s"], limit["same_size"]["bytes_per_s"])
    assert limit["same_size"]["buffer_bytes"] == limit["kv_bytes"] == 2 * 2 * 1024 * 8 * 128 * 4
    for row in report["rows"]:
        assert 0 < row["fraction_of_limit"] <= 1.0
        assert row["bytes_per_s"] <= limit["bytes_per_s"]


def limit_entries(kernel_bytes_per_s: float, same_size: float, memory: float):
    from paged_attention.cli.machine import ReadLimit

    nbytes = 1 << 20
    common = dict(dtype="float32", batch=1, context=512, kv_bytes=nbytes)
    same = ReadLimit(same_size, "amax", nbytes, 2, {"amax": same_size})
    kernel = dict(common, method="v1", time_s=nbytes / kernel_bytes_per_s)
    kernel["bytes_per_s"] = kernel_bytes_per_s
    limit = dict(common, method="limit", same_size=same.as_dict())
    return [kernel, limit], ReadLimit(memory, "gemv", 1 << 30, 2, {"gemv": memory})


def test_a_method_faster_than_the_read_limit_is_a_measurement_error():
    bench = load_bench_decode()
    entries, memory = limit_entries(kernel_bytes_per_s=30e9, same_size=25e9, memory=20e9)
    errors = bench.apply_limits(entries, memory)
    kernel, limit = entries
    assert errors == ["float32 1 x 512 v1: 30.00 GB/s, above the read limit 25.00 GB/s (amax)"]
    assert "fraction_of_limit" not in kernel and "measurement error" in kernel["limit_error"]
    assert limit["bound"] == "same-size buffer" and limit["bytes_per_s"] == 25e9


def test_the_faster_of_the_memory_and_the_same_size_read_is_the_limit():
    bench = load_bench_decode()
    entries, memory = limit_entries(kernel_bytes_per_s=10e9, same_size=15e9, memory=20e9)
    assert bench.apply_limits(entries, memory) == []
    kernel, limit = entries
    assert limit["bound"] == "memory" and limit["reader"] == "gemv"
    assert kernel["fraction_of_limit"] == pytest.approx(0.5)
    assert limit["fraction_of_limit"] == pytest.approx(1.0)


def test_the_run_fails_loudly_when_a_method_beats_the_limit(tmp_path, monkeypatch, capsys):
    """A reader slowed down by other work must not publish a kernel at more than 100%: the JSON
    keeps the figures, and the run exits with an error naming the rows."""
    from paged_attention.cli.machine import ReadLimit

    bench = load_bench_decode()
    slow = ReadLimit(1e6, "sum", 4096, 1, {"sum": 1e6})  # 1 MB/s: every kernel beats it
    monkeypatch.setattr(bench, "read_limit", lambda *args, **kwargs: slow)
    json_path = tmp_path / "error.json"
    monkeypatch.setattr(
        sys,
        "argv",
        ["bench_decode.py", "--batches", "1", "--contexts", "64", "--methods", "v1"]
        + ["--dtypes", "float32", "--reps", "1", "--json", str(json_path)],
    )
    with pytest.raises(SystemExit, match="faster than the read limit: a measurement error"):
        bench.main()
    assert "measurement error: float32 1 x 64 v1" in capsys.readouterr().err
    report = json.loads(json_path.read_text())
    assert report["measurement_errors"] and "fraction_of_limit" not in report["rows"][0]


def test_a_bad_memory_buffer_size_is_refused(monkeypatch):
    bench = load_bench_decode()
    monkeypatch.setattr(sys, "argv", ["bench_decode.py", "--memory-buffer-mib", "0"])
    with pytest.raises(SystemExit, match="--memory-buffer-mib must be at least 1"):
        bench.main()
