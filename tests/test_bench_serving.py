"""The serving benchmark runs end to end on its quick configurations and reports what it says."""

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
            "--workloads",
            "A,B,C",
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
    assert "| workload | dtype | arrivals | config | tokens/s |" in result.stdout
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


def test_chat_prompts_are_distinct_questions_through_the_chat_template():
    questions = bench_serving.chat_questions(100)
    assert len(set(questions)) == 100
    assert bench_serving.chat_questions(3, offset=97) == questions[97:]
    with pytest.raises(ValueError, match="distinct chat questions"):
        bench_serving.chat_questions(2, offset=159)
    from paged_attention.modeling.models import load_model

    _, tokenizer = load_model("tiny")
    (ids,) = bench_serving.chat_prompt_ids(tokenizer, questions[:1])
    text = tokenizer.decode(ids)
    assert questions[0] in text and text != questions[0]  # the template wraps the question


def test_quick_chat_run_reports_throughput_latency_and_the_step_split(tmp_path):
    out = tmp_path / "chat.json"
    result = subprocess.run(
        [
            sys.executable,
            "benchmarks/bench_serving.py",
            "--quick",
            "--model",
            "tiny",
            "--dtypes",
            "float32",
            "--requests",
            "4",
            "--configs",
            "engine,transformers generate_batch(),transformers generate()",
            "--json",
            str(out),
            "--plot",
            str(tmp_path / "chat.png"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr
    assert "One request alone, per decode step (ms):" in result.stdout
    data = json.loads(out.read_text())
    assert data["machine"]["cpu_model"] and data["machine"]["threads"] >= 1
    by_key = {(r["workload"], r["config"]): r for r in data["rows"]}
    assert set(by_key) == {
        ("chat", "engine"),
        ("chat", "transformers generate_batch()"),
        ("chat", "transformers generate()"),
        ("single", "engine"),
        ("single", "transformers generate()"),
    }
    chat = by_key[("chat", "engine")]
    assert chat["requests"] == 4 and chat["generated_tokens"] == 4 * 8
    assert chat["greedy_matching"] == 4  # float32: token for token as generate()
    assert chat["tokens_per_s"] > 0 and chat["ttft_p50_ms"] > 0 and chat["itl_p50_ms"] > 0
    split = by_key[("single", "engine")]["step_split"]
    assert split["decode_steps"] == 15  # 16 new tokens: the prompt step gives the first
    parts = ("linear_ms", "attention_ms", "other_ops_ms", "rest_of_forward_ms", "engine_ms")
    assert all(split[p] >= 0 for p in parts[:3]) and split["linear_ms"] > 0
    assert split["attention_ms"] > 0
    assert sum(split[p] for p in parts) == pytest.approx(split["step_ms"])
    assert (tmp_path / "chat.png").read_bytes().startswith(b"\x89PNG")
