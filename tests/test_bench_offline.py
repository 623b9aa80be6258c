"""The offline benchmark against vLLM: its workload, the turns the runs take, what a run
records, the comparison with vLLM's answers, its arguments, and its published table."""

import json
import os
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_offline  # noqa: E402
import publish  # noqa: E402

from paged_attention.cli.demo import QUESTIONS  # noqa: E402
from paged_attention.engine import ChatPrompt, PromptRenderer  # noqa: E402
from paged_attention.modeling.tiny import tiny_chat_model  # noqa: E402


def test_the_prompts_are_the_demo_questions_through_the_chat_template():
    work = bench_offline.workload(quick=True)
    renderer = PromptRenderer(tiny_chat_model()[1])
    expected = [renderer.chat_ids(ChatPrompt([{"role": "user", "content": q}])) for q in QUESTIONS]
    assert work["prompts"] == expected[:4]
    assert work["new_tokens"] == 8 and work["model"] == "tiny" and work["model_dir"] is None
    # The warm-up prompt shares no leading block with a timed prompt (no prefix cache hit).
    assert all(p[:4] != work["warm_up"][:4] for p in work["prompts"])


def test_vllm_is_shown_the_float_checkpoint_only(tmp_path, monkeypatch):
    converted = tmp_path / "converted" / "SmolLM2-x"
    converted.mkdir(parents=True)
    for name in ("config.json", "model.safetensors", "quantized-auto-gguf.safetensors"):
        (converted / name).write_text(name)
    monkeypatch.setattr(bench_offline.tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))
    view = bench_offline.checkpoint_view(converted)
    assert sorted(p.name for p in view.iterdir()) == ["config.json", "model.safetensors"]
    assert (view / "model.safetensors").read_text() == "model.safetensors"
    assert bench_offline.checkpoint_view(converted) == view  # the same path every run


def fake_row(config, dtype, rate, tokens):
    return {
        "config": config,
        "dtype": dtype,
        "tok_per_s": rate,
        "generate_s": 1.0,
        "load_s": 2.0,
        "peak_rss_mb": 100.0,
        "load_before": [1.0, 1.0, 1.0],
        "load_after": [2.0, 2.0, 2.0],
        "settings": {},
        "tokens": tokens,
    }


def test_configurations_take_turns_within_each_round(monkeypatch, tmp_path):
    calls = []

    def fake_run_one(config, dtype, work, options, prepare_only=False):
        assert not prepare_only  # neither configuration compiles: no warm-up process
        calls.append((config, dtype))
        return fake_row(config, dtype, 10.0, [[1, 2]] * len(work["prompts"]))

    monkeypatch.setattr(bench_offline, "run_one", fake_run_one)
    out = tmp_path / "offline.json"
    bench_offline.main(["--quick", "--configs", "ours,ours-auto", "--json", str(out)])
    order = [(c, d) for d in ("bfloat16", "float32") for c in ("ours", "ours-auto")]
    assert calls == order * 2
    record = json.loads(out.read_text())
    assert [r["round"] for r in record["rows"]] == [0] * 4 + [1] * 4
    assert record["benchmark"] == "bench_offline" and record["machine"]["cpu_model"]
    assert record["workload"]["requests"] == 4 and "tokens" not in record["rows"][0]
    assert publish.kind_of(record) == "offline" and record["compile_warm_up"] == []


@pytest.mark.parametrize("skip", [False, True])
def test_compiling_configurations_warm_their_caches_before_the_first_round(monkeypatch, skip):
    calls = []

    def fake_run_one(config, dtype, work, options, prepare_only=False):
        calls.append((config, dtype, prepare_only))
        if prepare_only:
            return {"config": config, "dtype": dtype, "load_s": 5.0, "compile_cache": "cold"}
        return fake_row(config, dtype, 10.0, [[1, 2]] * len(work["prompts"]))

    monkeypatch.setattr(bench_offline, "run_one", fake_run_one)
    argv = ["--quick", "--configs", "ours,ours-compiled", "--rounds", "1"]
    bench_offline.main(argv + (["--no-compile-warm-up"] if skip else []))
    warm_ups = [] if skip else [("ours-compiled", d, True) for d in ("bfloat16", "float32")]
    timed = [(c, d, False) for d in ("bfloat16", "float32") for c in ("ours", "ours-compiled")]
    assert calls == warm_ups + timed


def test_answers_are_compared_with_vllms_of_the_same_dtype_and_round():
    rows = [
        {**fake_row("vllm", "float32", 100.0, [[1, 2, 3], [4, 5, 6]]), "round": 0},
        {**fake_row("ours", "float32", 160.0, [[1, 2, 3], [4, 9, 6]]), "round": 0},
        {**fake_row("ours", "bfloat16", 200.0, [[7, 7, 7], [7, 7, 7]]), "round": 0},
    ]
    bench_offline.agreement(rows)
    ours_fp32, ours_bf16 = rows[1], rows[2]
    assert ours_fp32["same_as_vllm"] == 1
    assert ours_fp32["matching_fraction"] == pytest.approx((1 + 2 / 3) / 2)
    assert "same_as_vllm" not in ours_bf16  # no vLLM run in bfloat16 to compare with
    assert all("tokens" not in r for r in rows)


def test_the_summary_holds_each_median_and_its_ratio_to_vllms():
    rows = [
        fake_row("vllm", "float32", 100.0, []),
        fake_row("vllm", "float32", 120.0, []),
        fake_row("ours", "float32", 160.0, []),
        fake_row("ours", "float32", 180.0, []),
        fake_row("ours", "bfloat16", 300.0, []),
    ]
    summary = {(s["dtype"], s["config"]): s for s in bench_offline.summarize(rows)}
    assert summary[("float32", "vllm")]["tok_per_s_median"] == 110.0
    ours = summary[("float32", "ours")]
    assert ours["ratio_to_vllm"] == pytest.approx(170 / 110) and ours["meets_target"]
    assert "ratio_to_vllm" not in summary[("bfloat16", "ours")]
    assert "of_limit" not in ours  # no limit run


def test_the_summary_gives_each_median_and_the_target_as_shares_of_the_limit():
    rows = [
        fake_row("vllm", "float32", 100.0, []),
        fake_row("ours", "float32", 120.0, []),
        fake_row("limit", "float32", 200.0, []),
    ]
    summary = {s["config"]: s for s in bench_offline.summarize(rows)}
    assert summary["ours"]["of_limit"] == pytest.approx(0.6)
    assert summary["vllm"]["of_limit"] == pytest.approx(0.5)
    assert summary["limit"]["target_of_limit"] == pytest.approx(1.5 * 100 / 200)
    assert "ratio_to_vllm" not in summary["limit"] and "of_limit" not in summary["limit"]


def test_a_run_is_a_process_of_its_own_with_its_memory_and_load(monkeypatch):
    options = bench_offline.parse_args(["--quick", "--configs", "ours"])
    work = bench_offline.workload(quick=True)
    row = bench_offline.run_one("ours", "float32", work, options)
    assert row["generated"] == 4 * 8 and len(row["tokens"]) == 4
    assert row["settings"]["compile"] is False  # the engine's default step
    assert row["settings"]["torch_threads"] == len(options.cores)
    assert row["peak_rss_mb"] > 50 and row["load_s"] > 0
    assert len(row["load_before"]) == len(row["load_after"]) == 3


def test_ours_unpacked_is_ours_with_packing_switched_off(monkeypatch):
    monkeypatch.setenv(bench_offline.PACK_ENV, "0")  # the parent's setting reaches neither
    assert bench_offline.PACK_ENV not in bench_offline.child_environment("ours", [0], 1)
    assert bench_offline.FUSE_ENV not in bench_offline.child_environment("ours", [0], 1)
    unfused_env = bench_offline.child_environment("ours-unfused", [0], 1)
    assert unfused_env[bench_offline.FUSE_ENV] == "0" and bench_offline.PACK_ENV not in unfused_env
    unpacked_env = bench_offline.child_environment("ours-unpacked", [0], 1)
    assert unpacked_env[bench_offline.PACK_ENV] == "0"
    options = bench_offline.parse_args(["--quick", "--configs", "ours,ours-unpacked"])
    work = bench_offline.workload(quick=True)
    # bfloat16: loading packs that dtype on every CPU (float32 on an AMD one only)
    packed, unpacked = (
        bench_offline.run_one(config, "bfloat16", work, options) for config in options.configs
    )
    # the tiny model's 2 layers of 4 projections (query, key and value as one, gate and up as
    # one: modeling/fused_projections.py), and its LM head, where oneDNN runs bfloat16
    bf16 = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert packed["settings"]["packed_linear"] == (2 * 4 + 1 if bf16 else 0)
    assert unpacked["settings"]["packed_linear"] == 0
    assert packed["tokens"] == unpacked["tokens"]


def test_the_default_configurations_leave_packings_a_b_out():
    args = bench_offline.parse_args(["--vllm-python", sys.executable])
    assert args.configs == ["ours", "ours-compiled", "vllm", "limit"]


def test_the_prefill_limit_counts_each_distinct_prefix_once():
    # [1], [1, 2], [1, 2, 3], [1, 2, 4], [5]: the shared first tokens are computed once
    assert bench_offline.prefix_tree_size([[1, 2, 3], [1, 2, 4], [5], [1, 2, 3]]) == 5


def test_the_products_limit_adds_its_passes_the_way_a_run_makes_them():
    from paged_attention.modeling.tiny import tiny_llama

    config = tiny_llama().config
    rows = {"prefill": 40, "decode": 4}
    seconds, times = bench_offline.product_seconds(config, torch.float32, rows, new_tokens=8)
    assert set(times) == {f"{name}_{kind}_s" for name in ("layers", "lm_head") for kind in rows}
    assert all(0 < t < 1 for t in times.values())
    expected = times["layers_prefill_s"] + 7 * times["layers_decode_s"]
    assert seconds == pytest.approx(expected + 8 * times["lm_head_decode_s"])


def test_the_limit_is_a_process_of_its_own_and_above_the_engine(monkeypatch):
    options = bench_offline.parse_args(["--quick", "--configs", "ours,limit"])
    work = bench_offline.workload(quick=True)
    ours, limit = (bench_offline.run_one(c, "float32", work, options) for c in options.configs)
    assert limit["generated"] == ours["generated"] == 4 * 8 and limit["tokens"] == []
    # the tiny model's steps are mostly the engine's own work: its products alone are faster
    assert limit["tok_per_s"] > ours["tok_per_s"]
    assert limit["settings"]["torch_threads"] == len(options.cores)


def test_ours_compiled_loads_the_steps_its_warm_up_compiled(monkeypatch, tmp_path):
    monkeypatch.setenv("PAGED_ATTENTION_CACHE", str(tmp_path))  # a cold cache of its own
    options = bench_offline.parse_args(["--quick", "--configs", "ours,ours-compiled"])
    work = bench_offline.workload(quick=True)
    warm_up = bench_offline.run_one("ours-compiled", "float32", work, options, prepare_only=True)
    assert warm_up["compile_cache"] == "cold" and warm_up["compile_sizes"] == [1]
    assert "tok_per_s" not in warm_up  # nothing generated, nothing timed
    compiled = bench_offline.run_one("ours-compiled", "float32", work, options)
    settings = compiled["settings"]
    assert settings["compile"] is True and settings["compile_cache"] == "warm"
    assert settings["compile_sizes"] == [1] and settings["max_num_seqs"] == 1
    assert compiled["load_s"] > settings["compile_s"] > 0  # compiling is part of getting ready
    eager = bench_offline.run_one("ours", "float32", work, options)
    assert compiled["tokens"] == eager["tokens"] and compiled["generated"] == 4 * 8


def test_the_resident_memory_of_a_process_tree():
    assert bench_offline.tree_rss_bytes(os.getpid()) > 10 * 2**20
    assert bench_offline.tree_rss_bytes(2**22 + 7) == 0  # no such process


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--configs", "ours,llama"], "--configs"),
        (["--dtypes", "float16"], "--dtypes"),
        (["--rounds", "0"], "--rounds"),
        (["--kv-gib", "0"], "--kv-gib"),
        (["--quick"], "--quick"),
        (["--configs", "vllm", "--vllm-python", "/nonexistent/python"], "--vllm-python"),
        (["--configs", "ours", "--cores", "zero"], "--cores"),
        (["--configs", "ours", "--cores", "4096"], "--cores"),
    ],
)
def test_bad_arguments_are_refused_naming_the_argument(argv, message):
    with pytest.raises(SystemExit, match=message):
        bench_offline.parse_args(argv)


def fake_settings(config: str, compile_cache: str = "warm") -> dict:
    """The settings a run of ``config`` records (``compile_cache``: ours-compiled's)."""
    return {
        "ours": {"torch": "2.14", "torch_threads": 2, "compile": False, "block_size": 16,
                 "max_num_seqs": 64},
        "ours-compiled": {"compile": True, "max_num_seqs": 64, "compile_sizes": [1, 8, 32, 64],
                          "compile_cache": compile_cache},
        "vllm": {"vllm": "0.32.0", "torch": "2.13", "enforce_eager": False,
                 "compile_backend": "inductor", "compilation_mode": "2",
                 "omp_threads_bind": "0,1", "block_size": 128, "max_num_seqs": 256,
                 "max_num_batched_tokens": 4096, "compile_cache": "warm"},
        "limit": {"torch_threads": 2},
    }[config]  # fmt: skip


def fake_record(rows: list[dict], rounds: int, **extra) -> dict:
    """What bench_offline writes for ``rows`` (their agreement with vLLM's answers added)."""
    bench_offline.agreement(rows)
    return {
        "benchmark": "bench_offline",
        "workload": {"model": "smollm2", "requests": 2, "prompt_tokens": 40, "new_tokens": 2},
        "settings": {"cores": [0, 1], "kv_gib": 1, "rounds": rounds},
        "target_ratio": 1.5,
        **extra,
        "rows": rows,
        "summary": bench_offline.summarize(rows),
    }


def test_the_published_table_marks_a_ratio_below_the_target():
    rows = []
    for round_index in (0, 1):
        for config, rate in (("ours", 150.0), ("ours-compiled", 310.0), ("vllm", 200.0)):
            row = fake_row(config, "float32", rate + round_index, [[1, 2]] * 2)
            row["settings"] = fake_settings(config, "warm" if round_index else "cold")
            rows.append({**row, "round": round_index})
    warm_up = {"config": "ours-compiled", "dtype": "float32", "load_s": 600}
    warm_up["compile_cache"] = "cold"
    record = fake_record(rows, rounds=2, compile_warm_up=[warm_up])
    text = publish.offline_section(record)
    assert "The limit rows" not in text  # no limit run
    ours_line = next(line for line in text.splitlines() if line.startswith("| float32 | ours |"))
    assert "150.5 (150.0, 151.0)" in ours_line and "0.75x ✗" in ours_line
    assert "2 of 2, 2 of 2" in ours_line
    assert "compiled by inductor" in text and "eager steps (the default)" in text
    assert "vLLM's: loading its compiled steps from its compile cache, in every run" in text
    compiled = next(line for line in text.splitlines() if "| ours, compiled decode" in line)
    assert "310.5 (310.0, 311.0)" in compiled and "1.55x |" in compiled  # meets the target
    assert "per padded batch size (1, 8, 32, 64; max 64 sequences)" in text
    assert "ours compiled: compiling in 1 of 2 runs, else loading" in text
    assert "(ours, compiled decode steps float32 cold (600 s))" in text


@pytest.mark.parametrize(
    "log, state",
    [
        ("INFO [decorators.py:320] Directly load AOT compilation from path /x", "warm"),
        ("INFO [decorators.py:743] [backbone] saved AOT compiled function to /x", "cold"),
        ("INFO nothing about compiling", "unknown"),
    ],
)
def test_vllms_compile_cache_is_read_from_its_log(log, state):
    assert bench_offline.vllm_compile_cache(log) == state


def test_the_published_table_gives_the_shares_of_the_limit():
    rows = []
    for config, rate in (("ours", 300.0), ("vllm", 200.0), ("limit", 400.0)):
        row = fake_row(config, "float32", rate, [[1, 2]] * 2 if config != "limit" else [])
        row["settings"] = fake_settings(config)
        rows.append({**row, "round": 0})
    record = fake_record(rows, rounds=1)
    text = publish.offline_section(record)
    lines = {line.split(" | ")[1]: line for line in text.splitlines() if line.startswith("| ")}
    assert "| 1.50x | 75% |" in lines["ours"] and "| 50% |" in lines["vLLM"]
    assert "| 1.5x vLLM: 75% |" in lines["limit: the matrix products alone"]
    assert "The limit rows run no engine" in text
