"""The step benchmark: its workloads at quick sizes, the A B A B order, its arguments."""

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_engine_step  # noqa: E402


def test_tiny64_times_only_the_steps_where_every_sequence_decodes():
    row = bench_engine_step.run_tiny64(quick=True)
    # 8 new tokens: the first comes from the prefill step, 7 decode steps follow.
    assert row["sequences"] == 8 and row["decode_steps"] == 7
    assert 0 < row["step_ms_median"] <= row["step_ms_p90"]


def test_chat_makes_every_token_it_asks_for():
    row = bench_engine_step.run_chat(quick=True)
    assert row["generated"] == 4 * 8  # no end tokens: every request makes all its tokens
    assert row["tok_per_s"] > 0


def test_trees_alternate_within_each_round(monkeypatch, tmp_path):
    calls = []

    def fake_run_tree(name, tree, workload, quick):
        calls.append((workload, name))
        return {
            "tree": name,
            "workload": workload,
            "tok_per_s": 1.0,
            "step_ms_median": 1.0,
            "step_ms_p90": 1.0,
            "load_before": 0.0,
            "load_after": 0.0,
        }

    monkeypatch.setattr(bench_engine_step, "run_tree", fake_run_tree)
    out = tmp_path / "steps.json"
    argv = ["x", "--trees", f"a={ROOT},b={ROOT}", "--rounds", "2", "--json", str(out)]
    monkeypatch.setattr(sys, "argv", argv)
    bench_engine_step.main()
    assert calls == [(w, t) for w in ("tiny64", "chat") for _ in (0, 1) for t in ("a", "b")]
    record = json.loads(out.read_text())
    assert [row["round"] for row in record["rows"]] == [0, 0, 1, 1] * 2
    assert record["machine"]


def test_a_tree_runs_in_its_own_process():
    row = bench_engine_step.run_tree("here", str(ROOT), "tiny64", quick=True)
    assert row["tree"] == "here" and row["decode_steps"] == 7


@pytest.mark.parametrize(
    "args, message",
    [
        (["--trees", "a=/nonexistent"], "--trees"),
        (["--workloads", "nope"], "--workloads"),
        (["--rounds", "0"], "--rounds"),
    ],
)
def test_bad_arguments_name_the_argument(monkeypatch, args, message):
    monkeypatch.setattr(sys, "argv", ["x", *args])
    with pytest.raises(SystemExit, match=message):
        bench_engine_step.main()
