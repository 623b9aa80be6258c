"""The memory benchmark's accounting, on traces small enough to check by hand."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import bench_memory  # noqa: E402
from bench_memory import Request  # noqa: E402


def test_trace_is_seeded_and_clipped():
    trace = bench_memory.chat_trace(500, max_len=256, seed=3)
    assert trace == bench_memory.chat_trace(500, max_len=256, seed=3)
    assert trace != bench_memory.chat_trace(500, max_len=256, seed=4)
    assert all(r.prompt_len >= 1 and r.output_len >= 1 for r in trace)
    assert all(r.prompt_len + r.output_len <= 256 for r in trace)


def test_utilisation_counts_every_step():
    # One request, prompt 3, output 2: steps see 3 then 4 tokens (the last token is never
    # cached). Block 8/16/32 reserve one block; max length reserves 10; own length 5.
    usage = bench_memory.utilisation([Request(3, 2)], concurrency=1, max_len=10)
    assert {name: (u.token_slots, u.reserved_slots) for name, u in usage.items()} == {
        "paged, block 8": (7, 16),
        "paged, block 16": (7, 32),
        "paged, block 32": (7, 64),
        "contiguous, max length": (7, 20),
        "contiguous, own length (oracle)": (7, 10),
    }


def test_paged_waste_is_at_most_one_block_per_request():
    trace = bench_memory.chat_trace(40, max_len=512, seed=0)
    usage = bench_memory.utilisation(trace, concurrency=8, max_len=512)
    for block_size in bench_memory.BLOCK_SIZES:
        u = usage[f"paged, block {block_size}"]
        steps = sum(r.output_len for r in trace)  # request-steps summed over the run
        assert 0 < u.reserved_slots - u.token_slots <= steps * (block_size - 1)
    assert usage["contiguous, max length"].utilisation < usage["paged, block 32"].utilisation


def test_parallel_sampling_shares_the_prompt():
    # Prompt of two full blocks; one output step opens a private block per sample:
    # in use 2 + n blocks, unshared 3n.
    for n in (2, 4):
        saving = bench_memory.parallel_sampling_saving([Request(32, 1)], n, 16, max_len=64)
        assert saving == pytest.approx(1 - (2 + n) / (3 * n))


def test_beam_search_sharing():
    assert bench_memory.beam_search_saving([Request(32, 1)], 4, 16, 64, seed=0) == (
        pytest.approx(1 - 6 / 12)
    )
    assert bench_memory.beam_search_saving([Request(5, 20)], 1, 16, 64, seed=0) == 0.0


def test_main_writes_json_and_plot(tmp_path, capsys):
    json_path, plot_path = tmp_path / "out.json", tmp_path / "out.png"
    argv = ["--requests", "30", "--sharing-requests", "3", "--max-len", "256"]
    assert bench_memory.main([*argv, "--json", str(json_path), "--plot", str(plot_path)]) == 0
    result = json.loads(json_path.read_text())
    assert set(result) == {"trace", "utilisation", "sharing"}
    assert set(result["sharing"]["beam_search_saving"]) == {"2", "4", "6"}
    assert plot_path.stat().st_size > 0
    assert "log-normal" in capsys.readouterr().out
