"""``python -m paged_attention demo``: small runs of the command line, on the tiny model."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from paged_attention.__main__ import main  # noqa: E402
from paged_attention.cli.demo import default_model  # noqa: E402

TINY = ["--model", "tiny", "--dtype", "float32"]

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
    code = main(["demo", "--json", *TINY, *args])
    report = json.loads(capsys.readouterr().out)
    return code, report


def test_small_demo_with_swapping(tmp_path, capsys):
    plot = tmp_path / "kv.png"
    code, report = run_json(capsys, "--requests", "6", "--kv-budget", "16", "--plot", str(plot))
    assert code == 0
    assert KEYS <= set(report)
    assert report["requests"] == 6 and report["rejected"] == 0
    assert report["greedy_matches_transformers"] is True
    assert report["greedy_requests"] >= 3
    assert report["swaps_out"] > 0 and report["swaps_in"] == report["swaps_out"]
    assert report["peak_blocks"] <= 16 < report["contiguous_blocks"]
    assert report["generated_tokens"] > 0 and report["tokens_per_s"] > 0
    assert plot.read_bytes().startswith(b"\x89PNG")


def test_table_output(tmp_path, capsys):
    threads = torch.get_num_threads()
    assert main(["demo", *TINY, "--requests", "4", "--plot", str(tmp_path / "kv.png")]) == 0
    assert torch.get_num_threads() == threads  # the demo's thread setting does not leak
    out, err = capsys.readouterr()
    bars = re.findall(r"serving: +\d+%\|[^|]*\| (\d+)/(\d+)", err)
    assert bars[-1] == ("4", "4")  # the bar counts finished requests, up to their number
    assert all(int(done) <= int(total) for done, total in bars)
    assert "greedy outputs == transformers generate()  yes (" in out
    assert "contiguous max-length reservation" in out


def test_local_checkpoint(tmp_path, capsys):
    model_dir = tmp_path / "model"
    default_model(seed=5).save_pretrained(model_dir)
    code = main(
        [
            "demo",
            "--json",
            "--model",
            str(model_dir),
            "--dtype",
            "float32",
            "--requests",
            "3",
            "--block-size",
            "8",
            "--threads",
            "1",
            "--plot",
            str(tmp_path / "kv.png"),
        ]
    )
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report["model"] == str(model_dir) and report["workload"] == "tokens"
    assert report["block_size"] == 8 and report["greedy_matches_transformers"] is True


def test_module_entry_point(tmp_path):
    root = Path(__file__).resolve().parents[1]
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "paged_attention",
            "demo",
            *TINY,
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
    assert "deprecated" not in result.stderr  # transformers' cache-argument rename


def usage_error(capsys, *args) -> str:
    """The one-line error of a bad argument: exit status 2, as argparse's own errors."""
    with pytest.raises(SystemExit) as exit_info:
        main(["demo", *args])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.startswith("paged-attention demo: error: ") and "Traceback" not in error
    return error


@pytest.mark.parametrize(
    "args, message",
    [
        (["--requests", "0"], "--requests"),
        (["--kv-budget", "0"], "--kv-budget"),
        (["--threads", "0"], "--threads"),
        (["--requests", "two"], "--requests"),
        (["--plot", "kv.txt"], "give a .png file or an existing directory"),
        (["--model", "/missing/dir"], "no such file or directory"),
        (["--model", "no-such-model"], "unknown model"),
        (["--seed", "18446744073709551615"], "--seed"),
        (["--seed", str(10**23)], "--seed"),
        (["--seed", "-1"], "--seed"),
        (["--dtype", "int8"], "--dtype"),
        (["--workload", "poems"], "--workload"),
    ],
)
def test_bad_arguments(args, message, capsys):
    assert message in usage_error(capsys, *args)


def test_bad_arguments_are_found_before_the_run(tmp_path, capsys, monkeypatch):
    def no_run(args):
        raise AssertionError("the demo ran before its arguments were checked")

    monkeypatch.setattr("paged_attention.cli.demo.run", no_run)
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    assert "cannot create" in usage_error(capsys, "--plot", str(blocker / "kv.png"))
    not_a_model = tmp_path / "empty"
    not_a_model.mkdir()
    assert "no config.json" in usage_error(capsys, "--model", str(not_a_model))


def test_model_the_cache_cannot_serve_is_one_line(tmp_path, capsys):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        head_dim=16,
    )
    LlamaForCausalLM(config).save_pretrained(tmp_path / "tiny")
    error = usage_error(capsys, "--model", str(tmp_path / "tiny"), "--plot", str(tmp_path))
    assert "head_size 16 is not supported" in error


def test_plot_into_a_directory_reports_the_file_it_wrote(tmp_path, capsys):
    code, report = run_json(capsys, "--requests", "2", "--plot", str(tmp_path))
    assert code == 0
    assert report["plot"] == str(tmp_path / "demo_kv_memory.png")
    assert (tmp_path / "demo_kv_memory.png").read_bytes().startswith(b"\x89PNG")


def test_rejected_requests_fail_the_run(tmp_path, capsys):
    code = main(["demo", *TINY, "--kv-budget", "1", "--requests", "3", "--plot", str(tmp_path)])
    captured = capsys.readouterr()
    assert code == 1
    assert "n/a (no greedy request was served)" in captured.out
    assert "3 of 3 requests were rejected" in captured.err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without CUDA")
def test_cuda_without_a_gpu(capsys):
    assert "no CUDA device" in usage_error(capsys, "--device", "cuda", "--requests", "1")


def test_a_kv_budget_larger_than_memory_is_a_usage_error(tmp_path, capsys):
    error = usage_error(capsys, *TINY, "--kv-budget", "100000000", "--plot", str(tmp_path))
    assert "--kv-budget 100000000: 100000000 blocks of 16384 bytes need" in error
    assert "GiB are available" in error


def test_chat_workload_prints_answers(tmp_path, capsys):
    args = [*TINY, "--workload", "chat", "--requests", "4", "--kv-budget", "160"]
    code, report = run_json(capsys, *args[4:], "--plot", str(tmp_path))
    assert code == 0 and report["workload"] == "chat" and report["rejected"] == 0
    assert report["prompt_tokens_cached"] >= 600  # the second system prompt's blocks
    assert [a["decoding"] for a in report["answers"]] == [
        "greedy",
        "greedy",
        "greedy",
        "3 samples, temperature 0.8",
    ]
    assert [a["system_prompt"] for a in report["answers"]] == [True, False, True, False]
    assert report["answers"][0]["question"] == "What is the capital of France?"
    assert len(report["answers"][3]["answers"]) == 3
    assert main(["demo", *args, "--plot", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "\n> What is the capital of France? (after the system prompt) [greedy]\n" in out


def test_tiny_model_in_bfloat16_matches_up_to_ties(tmp_path, capsys):
    code = main(
        [
            "demo",
            "--json",
            "--model",
            "tiny",
            "--dtype",
            "bfloat16",
            "--requests",
            "6",
            "--plot",
            str(tmp_path),
        ]
    )
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report["dtype"] == "bfloat16"
    assert report["greedy_matching"] + report["greedy_ties"] == report["greedy_requests"]


def test_compare_greedy():
    from paged_attention.cli.demo import compare_greedy

    logits = torch.tensor([[0.0, 5.0, 1.0], [3.0, 3.0 - 2**-6, 0.0], [0.0, 1.0, 4.0]])
    assert compare_greedy([1, 0, 2], [1, 0, 2], logits, torch.bfloat16) == "equal"
    assert compare_greedy([1, 1], [1, 0, 2], logits, torch.bfloat16) == "tie"  # within 2 ulps
    assert compare_greedy([1, 1], [1, 0, 2], logits, torch.float32) == "differs"
    assert compare_greedy([1, 2], [1, 0, 2], logits, torch.bfloat16) == "differs"
    assert compare_greedy([1], [1, 0, 2], logits, torch.bfloat16) == "differs"  # ended early


def test_ctrl_c_in_a_command_is_one_line_and_status_130(capsys, monkeypatch):
    from paged_attention.cli import chat

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(chat, "main", interrupted)
    try:
        status = main(["chat", "--model", "tiny", "hello"])
    except KeyboardInterrupt:  # not pytest's own: its run must go on
        pytest.fail("the interrupt escaped the command line's main")
    assert status == 130
    assert capsys.readouterr().err == "paged-attention chat: interrupted\n"


@pytest.mark.parametrize("command", [["chat", *TINY, "--no-compile", "hello"], ["demo", *TINY]])
def test_ctrl_c_while_a_command_imports_torch(command):
    """Ctrl+C from the terminal once the command line's main is imported (``-X importtime``
    says when), while the command imports torch or runs, ends in the command's one line, not
    a traceback."""
    import os
    import signal

    process = subprocess.Popen(
        [sys.executable, "-X", "importtime", "-m", "paged_attention", *command],
        cwd=Path(__file__).resolve().parents[1],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    for line in process.stderr:
        if line.rstrip().endswith("| paged_attention.cli.main"):
            break
    os.killpg(process.pid, signal.SIGINT)
    errors = process.communicate(timeout=120)[1]
    assert process.returncode == 130, errors[-2000:]
    assert errors.endswith(f"paged-attention {command[0]}: interrupted\n"), errors[-2000:]
    assert "Traceback" not in errors


CTRL_C_BEFORE_MAIN = """
import os, signal, sys, time
sys.argv = ["-m", "chat", "--model", "tiny", "hello"]
import paged_attention
from paged_attention.cli import main as command_line
{then}
"""


def run_ctrl_c_probe(then: str) -> subprocess.CompletedProcess:
    probe = CTRL_C_BEFORE_MAIN.format(then=then)
    return subprocess.run(
        [sys.executable, "-c", probe],
        cwd=Path(__file__).resolve().parents[1],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_ctrl_c_between_the_packages_import_and_main_is_the_commands_line_and_130():
    """The command line's process imported the package and main's module but has not entered
    main's handling yet (the moment ``-X importtime`` cannot see past): one line, status 130."""
    from paged_attention.cli.main import INTERRUPTED

    done = run_ctrl_c_probe("os.kill(os.getpid(), signal.SIGINT)\ntime.sleep(30)\nprint('ran on')")
    assert (done.returncode, done.stdout) == (INTERRUPTED, "")
    assert done.stderr == "paged-attention chat: interrupted\n"


def test_the_command_lines_main_takes_ctrl_c_over_from_the_package():
    """Inside main Ctrl+C is a KeyboardInterrupt again (a command may handle it, and what it
    printed is flushed): main returns 130 with its line, rather than the package ending the
    process."""
    then = (
        "def interrupted(words, argv):\n"
        "    os.kill(os.getpid(), signal.SIGINT)\n"
        "    time.sleep(30)\n"
        "command_line._run = interrupted\n"
        "print('main returned', command_line.main())"
    )
    done = run_ctrl_c_probe(then)
    assert (done.returncode, done.stdout) == (0, "main returned 130\n"), done.stderr
    assert done.stderr == "paged-attention chat: interrupted\n"


@pytest.mark.parametrize("argv0", ["-m", "/usr/bin/paged-attention"])
@pytest.mark.parametrize("command", ["serve", "chat", "demo", "other"])
def test_the_package_leaves_torch_to_a_command_of_the_command_line(argv0, command):
    """Imported for a command of the command line, the package imports no torch (the command
    does, inside its Ctrl+C handling); imported otherwise it registers the ops."""
    probe = (
        f"import sys; sys.argv = [{argv0!r}, {command!r}]; import paged_attention; "
        "print('torch' in sys.modules)"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True
    )
    assert result.stdout.strip() == str(command == "other")
