"""``python -m paged_attention demo``: small runs of the command line."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from paged_attention.__main__ import main  # noqa: E402
from paged_attention.demo import default_model  # noqa: E402

KEYS = {
    "requests",
    "generated_tokens",
    "tokens_per_s",
    "peak_blocks",
    "contiguous_blocks",
    "blocks_saved_by_sharing",
    "cow_copies",
    "swaps_out",
    "swaps_in",
    "greedy_matches_transformers",
}


def run_json(capsys, *args):
    code = main(["demo", "--json", *args])
    report = json.loads(capsys.readouterr().out)
    return code, report


def test_small_demo_with_swapping(tmp_path, capsys):
    plot = tmp_path / "kv.png"
    code, report = run_json(capsys, "--requests", "6", "--kv-budget", "12", "--plot", str(plot))
    assert code == 0
    assert KEYS <= set(report)
    assert report["requests"] == 6 and report["rejected"] == 0
    assert report["greedy_matches_transformers"] is True
    assert report["greedy_requests"] >= 3
    assert report["swaps_out"] > 0 and report["swaps_in"] == report["swaps_out"]
    assert report["peak_blocks"] <= 12 < report["contiguous_blocks"]
    assert report["generated_tokens"] > 0 and report["tokens_per_s"] > 0
    assert plot.read_bytes().startswith(b"\x89PNG")


def test_table_output(tmp_path, capsys):
    threads = torch.get_num_threads()
    assert main(["demo", "--requests", "4", "--plot", str(tmp_path / "kv.png")]) == 0
    assert torch.get_num_threads() == threads  # the demo's thread setting does not leak
    out = capsys.readouterr().out
    assert "greedy outputs == transformers generate()  yes (" in out
    assert "contiguous max-length reservation" in out


def test_local_checkpoint(tmp_path, capsys):
    model_dir = tmp_path / "model"
    default_model(seed=5).save_pretrained(model_dir)
    code, report = run_json(
        capsys,
        "--model",
        str(model_dir),
        "--requests",
        "3",
        "--block-size",
        "8",
        "--threads",
        "1",
        "--plot",
        str(tmp_path / "kv.png"),
    )
    assert code == 0 and report["model"] == str(model_dir)
    assert report["block_size"] == 8 and report["greedy_matches_transformers"] is True


def test_module_entry_point(tmp_path):
    root = Path(__file__).resolve().parents[1]
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "paged_attention",
            "demo",
            "--requests",
            "2",
            "--json",
            "--plot",
            str(tmp_path / "kv.png"),
        ],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["requests"] == 2


@pytest.mark.parametrize(
    "args, message",
    [
        (["--requests", "0"], "--requests"),
        (["--kv-budget", "0"], "--kv-budget"),
        (["--threads", "0"], "--threads"),
    ],
)
def test_bad_arguments(args, message, capsys):
    with pytest.raises(SystemExit, match=message):
        main(["demo", *args])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without CUDA")
def test_cuda_without_a_gpu():
    with pytest.raises(SystemExit, match="no CUDA device"):
        main(["demo", "--device", "cuda", "--requests", "1"])
