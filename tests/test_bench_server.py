"""The HTTP serving benchmark runs against a server of the tiny model and reports every run."""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("transformers")
uvicorn = pytest.importorskip("uvicorn")
pytest.importorskip("httpx")

from paged_attention.engine import Engine  # noqa: E402
from paged_attention.modeling.models import load_model  # noqa: E402
from paged_attention.server import create_app  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import bench_server  # noqa: E402


@pytest.fixture
def url():
    model, tokenizer = load_model("tiny")
    engine = Engine(model, tokenizer=tokenizer, num_blocks=128, max_num_seqs=16)
    config = uvicorn.Config(create_app(engine, tokenizer, "tiny"), port=0, log_level="warning")
    sock = config.bind_socket()
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]})
    thread.start()
    while not server.started:
        assert thread.is_alive()
        time.sleep(0.01)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    server.should_exit = True
    thread.join(30)


def test_poisson_and_closed_loop_runs_are_reported(url, tmp_path, capsys):
    report = bench_server.main(
        ["--url", url, "--rates", "20", "--concurrency", "1,4", "--requests", "6"]
        + ["--max-tokens", "16", "--json", str(tmp_path / "b.json")]
        + ["--plot", str(tmp_path / "b.png")]
    )
    rows = report["rows"]
    assert [r["load"] for r in rows] == ["Poisson 20 req/s", "closed loop x1", "closed loop x4"]
    for row in rows:
        assert row["requests"] == 6 and row["errors"] == 0
        assert 6 <= row["output_tokens"] <= 6 * 16
        assert row["requests_per_s"] > 0 and row["output_tokens_per_s"] > 0
        assert 0 < row["ttft_p50_ms"] <= row["ttft_p99_ms"]
        assert row["ttft_p50_ms"] < row["e2e_p50_ms"]
        # the tiny model's text is mostly invalid UTF-8, which the server holds back until
        # it decodes: a request may stream one chunk, which gives no inter-token gap
        assert row["itl_p50_ms"] is None or 0 < row["itl_p50_ms"] <= row["itl_p99_ms"]
        assert row["peak_kv_blocks_used"] <= 128
    assert max(r["peak_kv_blocks_used"] for r in rows) >= 1  # /metrics sampled during the runs
    saved = json.loads((tmp_path / "b.json").read_text())
    assert saved["rows"] == rows
    assert saved["info"]["model"] == "tiny" and saved["info"]["kv_blocks_total"] == 128
    assert saved["info"]["machine"]["cpu_model"]
    assert (tmp_path / "b.png").read_bytes().startswith(b"\x89PNG")
    table = capsys.readouterr().out
    assert "| load | req/s | out tok/s |" in table and "closed loop x4" in table
