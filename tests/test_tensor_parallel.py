"""PagedCache and the engine on a tensor-parallel model: a tiny Llama saved to a directory and
loaded with transformers' ``tp_plan="auto"`` by two CPU processes (torchrun, gloo) gives token
for token what one process gives, with half the KV bytes on each rank; every step is compared
across the ranks (PAGED_ATTENTION_DEBUG_CHECKS=1), and what cannot be served raises a clear
error on every rank."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip(
    "accelerate",
    reason="transformers loads tensor-parallel models (tp_plan) only with accelerate: "
    "pip install 'paged_attention[tp]' (make test installs it)",
)
if not (torch.distributed.is_available() and torch.distributed.is_gloo_available()):
    pytest.skip("this torch build has no torch.distributed gloo backend", allow_module_level=True)

from tensor_parallel_worker import HOST_AVAILABLE, scenarios  # noqa: E402

from paged_attention.modeling.tiny import tiny_llama_config  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
WORKER = Path(__file__).resolve().parent / "tensor_parallel_worker.py"
RANKS = 2
TIMEOUT_S = 300

CHECKPOINTS = {
    "model": tiny_llama_config(),  # 8 query heads over 2 KV heads: 4 and 1 per rank
    "mqa": tiny_llama_config(num_key_value_heads=1),
    "odd_kv_heads": tiny_llama_config(
        hidden_size=192, num_attention_heads=6, num_key_value_heads=3
    ),
}


def torchrun(args: list[str], env: dict[str, str] | None = None, timeout: float = TIMEOUT_S):
    """``torchrun --standalone --nproc-per-node 2 ARGS`` in the repository root, each rank on
    one thread; returns the finished process (its output on failure in the assertion)."""
    environment = dict(os.environ, OMP_NUM_THREADS="1", **(env or {}))
    environment["PYTHONPATH"] = os.pathsep.join(
        [str(REPO), str(WORKER.parent), environment.get("PYTHONPATH", "")]
    )
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc-per-node", str(RANKS), *args]
    done = subprocess.run(
        command, cwd=REPO, env=environment, capture_output=True, text=True, timeout=timeout
    )
    assert done.returncode == 0, f"{' '.join(command)} failed:\n{done.stdout}\n{done.stderr}"
    return done


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("checkpoints")
    for name, config in CHECKPOINTS.items():
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config))
        model.save_pretrained(root / name)
    return root


@pytest.fixture(scope="module")
def one_process(checkpoints):
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoints / "model").eval()
    return scenarios(model)


@pytest.fixture(scope="module")
def ranks(checkpoints, tmp_path_factory):
    out = tmp_path_factory.mktemp("ranks")
    torchrun([str(WORKER), str(checkpoints), str(out)], env={"PAGED_ATTENTION_DEBUG_CHECKS": "1"})
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(RANKS)]


def test_the_model_is_split_and_every_step_was_compared(ranks):
    for rank, result in enumerate(ranks):
        assert result["tensor_parallel"]["size"] == RANKS
        assert result["tensor_parallel"]["rank"] == rank
        checks = result["tensor_parallel"]["checks"]
        assert checks["the step's block tables, seq lens and slot mapping"] > 100
        assert checks["the engine step's plan"] > 100


@pytest.mark.parametrize("scenario", ["greedy", "beam_search", "sampling"])
def test_generate_through_paged_cache_equals_one_process(ranks, one_process, scenario):
    assert [r[scenario] for r in ranks] == [one_process[scenario]] * RANKS


@pytest.mark.parametrize("scenario", ["engine_swap", "engine_recompute"])
def test_engine_equals_one_process(ranks, one_process, scenario):
    expected = dict(one_process[scenario], device_bytes=one_process[scenario]["device_bytes"] // 2)
    assert [r[scenario] for r in ranks] == [expected] * RANKS


def test_the_engine_workload_preempts_and_shares(one_process):
    assert one_process["engine_swap"]["swaps_out"] > 0
    assert one_process["engine_recompute"]["swaps_out"] == 0
    assert one_process["engine_recompute"]["preemptions_by_recompute"] > 0
    assert one_process["engine_swap"]["prompt_tokens_cached"] > 0


def test_each_rank_holds_half_the_kv_heads_and_bytes(ranks, one_process):
    single = one_process["kv"]
    for result in ranks:
        assert result["kv"]["kv_heads"] * RANKS == single["kv_heads"]
        assert result["kv"]["bytes_per_block"] * RANKS == single["bytes_per_block"]
        # a budget in bytes (per rank) holds twice the blocks of half the size
        assert result["kv"]["blocks_for_budget"] == RANKS * single["blocks_for_budget"]
        engine_bytes = one_process["engine_swap"]["device_bytes"]
        assert result["engine_swap"]["device_bytes"] * RANKS == engine_bytes
        # the ranks share the host: the CPU default gives each half the bytes, as many blocks
        assert result["kv"]["default_device_bytes"] * RANKS == single["default_device_bytes"]
        assert single["default_device_bytes"] == HOST_AVAILABLE // 4  # below the 4 GiB cap


def test_ranks_with_different_budgets_take_the_same_blocks(ranks, one_process):
    fewest = RANKS * one_process["kv"]["blocks_for_budget"]  # rank 0's budget
    assert [r["blocks_for_rank_dependent_budget"] for r in ranks] == [fewest] * RANKS


def test_ranks_that_disagree_raise_on_every_rank(ranks):
    disagree = "tensor-parallel ranks disagree on "
    for result in ranks:
        assert result["diverged_requests"].startswith(disagree + "the engine step's plan")
        assert result["diverged_padding"].startswith(
            disagree + "the step's block tables, seq lens and slot mapping"
        )
        assert "different cache sizes (num_blocks 8..9" in result["different_num_blocks"]


def test_kv_heads_that_do_not_split_get_a_clear_error(ranks):
    for result in ranks:
        assert result["mqa"].startswith(
            "the model has 1 KV head and a tensor-parallel size of 2: each rank would need a "
            "replica of a KV head"
        )
        assert result["odd_kv_heads"].startswith(
            "the model has 3 KV heads and a tensor-parallel size of 2: they do not divide"
        )


TIMING = {"tokens_per_s", "seconds", "wall_seconds", "ttft_p50_ms", "ttft_p99_ms"}
TIMING |= {"itl_p50_ms", "itl_p99_ms"}
PER_RANK = {"tensor_parallel_ranks", "kv_bytes_per_block", "kv_bytes_per_rank"}
PER_PROCESS = {"plot", "machine"}  # the machine record holds the process's threads and load


def test_demo_on_two_ranks_reports_what_one_process_does(tmp_path, capsys):
    from paged_attention.__main__ import main

    args = ["demo", "--json", "--model", "tiny", "--dtype", "float32", "--requests", "8"]
    args += ["--kv-budget", "16"]
    assert main([*args, "--plot", str(tmp_path / "one.png")]) == 0
    single = json.loads(capsys.readouterr().out)
    done = torchrun(["-m", "paged_attention", *args, "--tp", "--plot", str(tmp_path / "tp.png")])
    split = json.loads(done.stdout)  # rank 0 alone prints
    assert single["swaps_out"] > 0 and single["greedy_matches_transformers"] is True
    assert {k: v for k, v in split.items() if k not in TIMING | PER_RANK | PER_PROCESS} == {
        k: v for k, v in single.items() if k not in TIMING | PER_RANK | PER_PROCESS
    }
    assert split["machine"]["cpu_model"] == single["machine"]["cpu_model"]
    assert split["tensor_parallel_ranks"] == RANKS and single["tensor_parallel_ranks"] == 1
    assert split["kv_bytes_per_rank"] * RANKS == single["kv_bytes_per_rank"]
    assert (tmp_path / "tp.png").read_bytes().startswith(b"\x89PNG")


def test_demo_tp_outside_torchrun_is_a_usage_error(monkeypatch, capsys):
    from paged_attention.__main__ import main

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(SystemExit) as exit_info:
        main(["demo", "--tp"])
    assert exit_info.value.code == 2
    assert "--tp runs as one rank of a torchrun job: torchrun --nproc-per-node" in (
        capsys.readouterr().err
    )


def test_example_on_two_ranks_prints_the_tokens_of_one_process(monkeypatch, capsys):
    example = REPO / "examples" / "tp_generate.py"
    spec = importlib.util.spec_from_file_location("tp_generate", example)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(sys, "argv", [str(example)])
    module.main()
    single = capsys.readouterr().out.splitlines()
    split = torchrun([str(example)]).stdout.splitlines()
    assert single[0] == "ranks: 1" and split[0] == f"ranks: {RANKS}"
    assert split[1:-2] == single[1:-2] and len(single) == 7  # generate() and 3 requests
    assert single[-2:] == ["KV heads per rank: 2", "KV cache bytes per rank: 1048576"]
    assert split[-2:] == ["KV heads per rank: 1", "KV cache bytes per rank: 524288"]
