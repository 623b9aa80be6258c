"""benchmarks/bench_server_compare.py (``bench_server.py --compare``): two servers started
alternately, never together, the same workload on each, every figure recorded; bad arguments
refused. Stub servers (tests/openai_stub_server.py) stand in for both."""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path

import pytest

pytest.importorskip("psutil")
pytest.importorskip("httpx")

ROOT = Path(__file__).resolve().parents[1]
STUB = ROOT / "tests" / "openai_stub_server.py"
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_server  # noqa: E402
import bench_server_compare  # noqa: E402
import publish  # noqa: E402


@pytest.fixture
def stubs(tmp_path, monkeypatch):
    """A fake llama-server binary (a stub that sends no usage, like a server that counts by
    chunks), a fake GGUF, and the events file both stubs write."""
    binary = tmp_path / "llama-server"
    binary.write_text(
        f'#!/bin/sh\nexec {sys.executable} {STUB} --name llama-server --no-usage "$@"\n'
    )
    binary.chmod(binary.stat().st_mode | stat.S_IXUSR)
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    events = tmp_path / "events"
    monkeypatch.setenv("STUB_EVENTS", str(events))
    return dict(binary=str(binary), gguf=str(gguf), events=events)


def compare_args(
    stubs, tmp_path, serve_extra="--start-delay 0.3 --loading-for 0.5 --cpu-ms-per-token 1"
):
    serve = f"{sys.executable} {STUB} --name serve {serve_extra}"
    return [
        "--compare", "--llama-server", stubs["binary"], "--gguf", stubs["gguf"],
        "--serve-command", serve, "--rounds", "2", "--start-timeout", "60",
        "--json", str(tmp_path / "compare.json"), "--plot", str(tmp_path / "compare.png"),
    ]  # fmt: skip


def test_the_servers_alternate_and_every_figure_is_recorded(stubs, tmp_path, capsys):
    report = bench_server.main(compare_args(stubs, tmp_path))
    # A B A B, each stopped before the next one started
    assert stubs["events"].read_text().split("\n")[:-1] == [
        "start serve", "stop serve", "start llama-server", "stop llama-server",
    ] * 2  # fmt: skip
    runs = report["runs"]
    assert [(r["server"], r["round"]) for r in runs] == [
        ("serve", 1), ("llama-server", 1), ("serve", 2), ("llama-server", 2),
    ]  # fmt: skip
    for run in runs:
        assert stubs["gguf"] in run["command"] and "--port" in run["command"]
        # serve's stub listens after 0.3 s and answers 503 for 0.5 s more: ready after both
        assert run["start_s"] > (0.8 if run["server"] == "serve" else 0)
        assert 0 < run["first_answer_s"] <= run["start_s"]
        if run["server"] == "serve":
            assert 0.3 < run["first_answer_s"] < run["start_s"] - 0.4
        assert run["peak_rss_bytes"] > 1 << 20
        chats, single = run["loads"]
        assert chats["load"] == "32 chats x 64 tokens" and single["load"] == "1 user x 128 tokens"
        assert (chats["requests"], single["requests"]) == (32, 2)
        assert (chats["output_tokens"], single["output_tokens"]) == (32 * 64, 2 * 128)
        expected = "usage" if run["server"] == "serve" else "chunks"
        assert chats["tokens_counted_from"] == single["tokens_counted_from"] == expected
        for row in run["loads"]:
            assert row["errors"] == 0 and row["output_tokens_per_s"] > 0
            assert 0 < row["ttft_p50_ms"] <= row["ttft_p90_ms"]
            assert 0 <= row["itl_p50_ms"] <= row["itl_p90_ms"]
            assert row["server_cores"] >= 0 and row["other_cores"] >= 0
            # shares of the CPU time that passed: never more than the machine's cores
            assert row["other_cores"] + row["steal_cores"] <= os.cpu_count() + 1e-6
    # the serve stub spends 1 ms of CPU a token: 2048 tokens take two seconds of CPU at least
    serve_chats = [r["loads"][0] for r in runs if r["server"] == "serve"]
    assert all(row["server_cores"] * row["seconds"] >= 1.5 for row in serve_chats)
    summary = report["summary"]
    rates = [r["loads"][0]["output_tokens_per_s"] for r in runs if r["server"] == "serve"]
    assert summary["serve"]["loads"]["32 chats x 64 tokens"]["output_tokens_per_s"] == dict(
        median=sum(rates) / 2, min=min(rates), max=max(rates)
    )
    saved = json.loads((tmp_path / "compare.json").read_text())
    assert saved["benchmark"] == "bench_server_compare" and saved["runs"] == runs
    assert saved["info"]["gguf"] == "model.gguf" and saved["info"]["rounds"] == 2
    assert saved["info"]["command"].startswith("benchmarks/bench_server.py --compare ")
    assert saved["info"]["machine"]["cpu_model"]
    assert (tmp_path / "compare.png").read_bytes().startswith(b"\x89PNG")
    out = capsys.readouterr().out
    assert "|  | serve | llama-server |" in out
    assert "32 chats x 64 tokens: output tok/s" in out and "start until /health s" in out


def test_loads_runs_only_the_loads_named(stubs, tmp_path):
    args = compare_args(stubs, tmp_path)
    args[args.index("--rounds") + 1] = "1"
    report = bench_server.main([*args, "--loads", "one-user"])
    assert [[row["load"] for row in run["loads"]] for run in report["runs"]] == [
        ["1 user x 128 tokens"]
    ] * 2
    assert [load["key"] for load in report["info"]["loads"]] == ["one-user"]
    assert "1 user x 128 tokens" in publish.server_compare_section(report)


def test_a_server_that_fails_to_start_is_named_with_its_output(stubs, tmp_path):
    args = compare_args(stubs, tmp_path, serve_extra="--fail-at-start")
    with pytest.raises(SystemExit, match="serve exited with status 3 before answering /health"):
        bench_server.main(args)
    with pytest.raises(SystemExit, match="failing at start as asked"):
        bench_server.main(args)
    assert "llama-server" not in stubs["events"].read_text()  # never started after a failure


def test_a_server_that_never_answers_is_stopped_at_the_timeout(stubs, tmp_path):
    args = compare_args(stubs, tmp_path, serve_extra="--start-delay 30")
    args[args.index("--start-timeout") + 1] = "1"
    with pytest.raises(SystemExit, match="did not answer /health within 1 s"):
        bench_server.main(args)
    assert stubs["events"].read_text().split("\n")[:-1] == ["start serve", "stop serve"]


@pytest.mark.parametrize(
    "change, message",
    [
        (("--llama-server", None), "--compare needs --llama-server PATH"),
        (("--llama-server", "/nonexistent/llama-server"), "is not an executable file"),
        (("--gguf", "/nonexistent/model.gguf"), "--gguf: /nonexistent/model.gguf is not a file"),
        (("--rounds", "0"), "--rounds must be at least 1, got 0"),
        (("--start-timeout", "0"), "--start-timeout must be positive"),
        (("--serve-command", "python 'unclosed"), "--serve-command: No closing quotation"),
        (("--rounds", "1 --loads chats,chats"), "is not a list of distinct loads"),
        (("--rounds", "1 --loads two-users"), "--loads: 'two-users' is not a list"),
    ],
)
def test_bad_arguments_are_refused_naming_the_argument(stubs, tmp_path, capsys, change, message):
    args = compare_args(stubs, tmp_path)
    option, value = change
    at = args.index(option)
    if value is None:
        del args[at : at + 2]
    else:
        args[at + 1] = value
    args = [part for arg in args for part in (arg.split(" ") if "--loads" in arg else [arg])]
    with pytest.raises(SystemExit) as exit_info:
        bench_server.main(args)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
    assert not stubs["events"].exists()  # nothing was started


def test_compare_excludes_url_and_launch(stubs, tmp_path, capsys):
    with pytest.raises(SystemExit):
        bench_server.main(["--url", "http://127.0.0.1:1", *compare_args(stubs, tmp_path)])
    assert "not allowed with argument" in capsys.readouterr().err


def test_a_cell_is_the_median_with_the_range_of_the_rounds():
    assert publish.spread_cell(dict(median=2.0, min=1.0, max=3.0), 1) == "2.0 (1.0-3.0)"
    assert publish.spread_cell(dict(median=2.0, min=2.0, max=2.0), 1) == "2.0"
    assert publish.spread_cell(None, 1) == "n/a"
    assert bench_server_compare.spread([None, 3, 1, 2]) == dict(median=2, min=1, max=3)
    assert bench_server_compare.spread([None, None]) is None


def test_the_comparison_is_published_from_its_json_without_machine_paths(stubs, tmp_path):
    report = bench_server.main(compare_args(stubs, tmp_path))
    assert publish.kind_of(report) == "server_compare"
    section = publish.server_compare_section(report)
    summary = report["summary"]
    rate = summary["llama-server"]["loads"]["1 user x 128 tokens"]["output_tokens_per_s"]
    row = next(line for line in section.splitlines() if "1 user x 128 tokens: output" in line)
    assert publish.spread_cell(rate, 1) in row.split(" | ")[2]
    assert "(2 rounds of A B, never both loaded)" in section and "`model.gguf`" in section
    assert "llama-server: `llama-server -m model.gguf --host 127.0.0.1 --port PORT" in section
    assert "load average" in section and "indicative" in section
    command = publish.command_of("c.json", report, "server_compare", {})
    assert command.startswith("python benchmarks/bench_server.py --compare --llama-server ")
    assert '"$(bash benchmarks/build_llama_server.sh | tail -1)"' in command
    assert str(tmp_path) not in section + command and sys.executable not in section
