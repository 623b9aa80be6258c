"""benchmarks/bench_server_process.py: one user through serve against its own engine offline,
with the cores each process used, and its published table."""

import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_server_process  # noqa: E402
import publish  # noqa: E402


def test_core_use_counts_the_client_and_the_servers_children():
    child = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        use = bench_server_process.CoreUse(child.pid)  # the busy process stands for serve's
        deadline = time.perf_counter() + 0.5
        while time.perf_counter() < deadline:  # this process, the client, busy too
            pass
        cores = use.cores()
    finally:
        child.kill()
        child.wait()
    assert set(cores) == {"server_cores", "engine_cores", "client_cores"}
    assert cores["client_cores"] > 0.5 and cores["server_cores"] > 0.3
    assert cores["engine_cores"] == 0  # it has no children


def test_a_run_on_the_tiny_model_is_published_with_its_ratio_and_cores(tmp_path):
    out = tmp_path / "server_process.json"
    command = [sys.executable, str(ROOT / "benchmarks" / "bench_server_process.py")]
    command += ["--checkouts", f"serve={ROOT}", "--model", "tiny", "--max-tokens", "16"]
    command += ["--rounds", "1", "--serve-args", "--num-blocks 64 --no-compile"]
    command += ["--json", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert publish.kind_of(report) == "server_process"
    (entry,) = report["rounds"]
    run = entry["serve"]
    assert entry["offline"]["tok_s"] > 0 and run["tok_s"] > 0 and run["health_s"] > 0
    # The client's and the HTTP side's CPU time over a 16-token answer can fall under one clock
    # tick, so only the engine's is sure to count here; the test above proves the others count.
    assert run["engine_cores"] > 0 and run["server_cores"] >= 0 and run["client_cores"] >= 0
    section = publish.server_process_section(report)
    ratio = f"{100 * run['tok_s'] / entry['offline']['tok_s']:.0f}%"
    assert f"| {ratio} |" in section and "`--num-blocks 64 --no-compile`" in section
