"""benchmarks/publish.py: the published figures are exactly what the committed benchmark JSON
says, with the machine and the command of each."""

import json
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import publish  # noqa: E402


def test_the_published_pages_are_what_the_committed_json_says():
    stale = [path for path, text in publish.render().items() if (ROOT / path).read_text() != text]
    assert not stale, f"stale: {stale}; run python benchmarks/publish.py"
    assert publish.main(["--check"]) == 0


@pytest.fixture
def copy_of_repo(tmp_path, monkeypatch):
    for path in publish.TARGETS:
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / path, tmp_path / path)
    shutil.copytree(ROOT / "docs" / "results", tmp_path / "docs" / "results")
    monkeypatch.setattr(publish, "ROOT", tmp_path)
    return tmp_path


def figures(text: str) -> str:
    start = text.index(publish.BEGIN)
    return text[start : text.index(publish.END, start)]


@pytest.mark.parametrize("path", list(publish.TARGETS))
def test_a_hand_edited_figure_fails_the_check(copy_of_repo, path, capsys):
    target = copy_of_repo / path
    text = target.read_text()
    section = figures(text)
    digit = next(i for i, c in enumerate(section) if c.isdigit() and section[i - 1] in " (|")
    edited = section[:digit] + str((int(section[digit]) + 1) % 10) + section[digit + 1 :]
    target.write_text(text.replace(section, edited))
    assert publish.main(["--check"]) == 1
    assert path in capsys.readouterr().err
    assert publish.main([]) == 0  # rewriting restores the figure
    assert target.read_text() == text


def test_every_committed_json_is_published_with_its_machine_and_command():
    results = publish.load_results()
    assert results, "docs/results/ holds the benchmarks' JSON"
    page = figures((ROOT / "docs" / "benchmarks.md").read_text())
    for name, data in results.items():
        assert publish.kind_of(data) is not None, f"{name}: no known benchmark wrote it"
        assert f"File: `docs/results/{name}`" in page
    assert page.count("Machine: ") == len(results)
    assert page.count("Command: `python ") == len(results)
    readme = figures((ROOT / "README.md").read_text())
    rows = [line for line in readme.splitlines() if line.startswith("| ") and "---" not in line]
    assert 1 <= len(rows) - 1 <= 6  # a header, then at most six rows
    assert all(row.count("`python ") == 1 for row in rows[1:])


def test_the_command_comes_from_the_index(tmp_path):
    (tmp_path / "INDEX.txt").write_text(
        "note: quiet machine\n"
        "bench_decode_cpu.json: python benchmarks/bench_decode.py --reps 5\n"
        "- `bench_memory.json` | `python benchmarks/bench_memory.py`\n"
        "bench_serving: /opt/venv/bin/python benchmarks/bench_serving.py --json "
        "/tmp/out/bench_serving.json --plot /tmp/out/bench_serving.png (rc=0, 300 s)\n"
    )
    assert publish.index_commands(tmp_path) == {
        "bench_decode_cpu.json": "python benchmarks/bench_decode.py --reps 5",
        "bench_memory.json": "python benchmarks/bench_memory.py",
        "bench_serving.json": "python benchmarks/bench_serving.py --json "
        "docs/results/bench_serving.json --plot docs/img/bench_serving.png",
    }
    assert publish.index_notes(tmp_path) == {None: ["quiet machine"]}
    server = {"info": {"command": "benchmarks/bench_server.py --rates 1"}, "rows": [{"load": 1}]}
    assert publish.command_of("x.json", server, "server", {}) == (
        "python benchmarks/bench_server.py --rates 1"
    )
    assert publish.command_of("y.json", {}, "memory", {}) == (
        "python benchmarks/bench_memory.py (arguments not recorded)"
    )


def test_the_machine_is_named_from_the_json():
    machine = {
        "cpu_model": "Intel(R) Xeon(R) Platinum 8480+",
        "cpu_isa_flags": ["avx2", "avx512f", "avx512_bf16", "amx_bf16"],
        "threads": 2,
        "torch": "2.14.1",
    }
    assert publish.machine_of({"machine": machine}, "decode") == (
        "Intel(R) Xeon(R) Platinum 8480+, AVX-512/AVX512-BF16/AMX, 2 threads, torch 2.14.1"
    )
    gpu = {"machine": {"gpu": "NVIDIA H200", "sms": 132, "torch": "2.14.1"}}
    assert publish.machine_of(gpu, "decode") == "NVIDIA H200 (132 SMs), torch 2.14.1"


def test_a_cpu_without_avx512_is_named_avx2_with_its_load():
    machine = {
        "cpu_model": "AMD EPYC",
        "cpu_isa_flags": ["avx2", "fma", "f16c"],
        "threads": 2,
        "loadavg_before": "0.50 0.4 0.3 1/2 3",
        "loadavg_after": "1.25 0.4 0.3 1/2 3",
    }
    assert publish.machine_of({"machine": machine}, "quantized") == (
        "AMD EPYC, AVX2, no AVX-512, 2 threads, load average 0.50 to 1.25"
    )


def test_no_results_is_said_not_invented(tmp_path):
    (tmp_path / "docs" / "results").mkdir(parents=True)
    for path in publish.TARGETS:
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(f"x\n{publish.BEGIN}\nold 1.0\n{publish.END}\n")
    for text in publish.render(tmp_path).values():
        assert "results are committed." in text and "old 1.0" not in text


def test_a_json_of_no_known_benchmark_is_named(tmp_path):
    (tmp_path / "odd.json").write_text(json.dumps({"something": 1}))
    results = publish.load_results(tmp_path)
    assert "`odd.json`" in publish.benchmarks_page(results, {}, {})


def test_taking_new_results_replaces_their_files_commands_and_notes(copy_of_repo, tmp_path):
    source = tmp_path / "measured"
    source.mkdir()
    memory = json.loads((ROOT / "docs" / "results" / "bench_memory.json").read_text())
    memory["utilisation"]["paged, block 16"]["waste"] = 0.0123
    (source / "bench_memory.json").write_text(json.dumps(memory))
    (source / "bench_memory.png").write_bytes(b"png")
    (source / "bench_memory.log").write_text("log")
    (source / "broken.json").write_text("{")
    (source / "INDEX.txt").write_text(
        "bench_memory: /work/.venv/bin/python benchmarks/bench_memory.py --json "
        "/work/results/bench_memory.json --plot /work/results/bench_memory.png (rc=0, 20 s)\n"
        "bench_decode_cpu: /work/.venv/bin/python benchmarks/bench_decode.py (rc=1, 3 s)\n"
    )
    images = copy_of_repo / "docs" / "img"
    images.mkdir(parents=True, exist_ok=True)
    assert publish.take(source, copy_of_repo) == ["bench_memory.json"]
    assert (images / "bench_memory.png").read_bytes() == b"png"
    results = copy_of_repo / "docs" / "results"
    commands, notes = publish.index_commands(results), publish.index_notes(results)
    assert commands["bench_memory.json"] == (
        "python benchmarks/bench_memory.py --json docs/results/bench_memory.json "
        "--plot docs/img/bench_memory.png"
    )
    assert "bench_memory.json" not in notes  # the earlier run's note went with it
    assert commands.keys() == publish.index_commands(ROOT / "docs" / "results").keys()
    readme = publish.render(copy_of_repo)["README.md"]
    row = next(line for line in readme.splitlines() if line.startswith("| KV memory"))
    assert "1.2% of KV memory wasted" in row and "\\*" not in row


def decode_json(fraction: float, errors: list[str]) -> dict:
    row = dict(dtype="float32", batch=1, context=512, kv_bytes=1 << 22, method="v1")
    row.update(time_s=1e-3, bytes_per_s=4e9, fraction_of_limit=fraction)
    limit = dict(row, method="limit", time_s=0.9e-3, bytes_per_s=4.4e9, bound="memory")
    memory = dict(bytes_per_s=4.4e9, reader="sum", buffer_bytes=1 << 30, threads=2, rates={})
    machine = json.loads((ROOT / "docs" / "results" / "bench_decode_cpu_core.json").read_text())
    return dict(device="cpu", machine=machine["machine"], rows=[row, limit],
                read_limit=dict(memory=memory), measurement_errors=errors)  # fmt: skip


@pytest.mark.parametrize(
    "name, data",
    [
        ("bench_decode_cpu.json", decode_json(1.05, [])),
        ("bench_decode_cpu.json", decode_json(0.9, ["float32 1 x 512 v1: above the limit"])),
        ("bench_decode_cpu_core.json", None),
    ],
    ids=["above-100%", "recorded-error", "one-core"],
)
def test_a_figure_above_the_read_limit_is_never_published(copy_of_repo, name, data):
    path = copy_of_repo / "docs" / "results" / name
    if data is None:  # the committed one-core run, one row spoilt
        data = json.loads(path.read_text())
        data["from_memory"][0]["limit_error"] = "faster than the read limit"
    path.write_text(json.dumps(data))
    with pytest.raises(SystemExit, match=f"docs/results/{name}: .*a measurement error"):
        publish.render(copy_of_repo)
    if name == "bench_decode_cpu.json":  # the same file within the limit is published
        path.write_text(json.dumps(decode_json(0.9, [])))
        assert "1.0 ms, 4.0 GB/s (90.0%)" in publish.render(copy_of_repo)["docs/benchmarks.md"]


def test_the_committed_decode_figures_are_within_the_read_limit():
    for name, data in publish.load_results().items():
        kind = publish.kind_of(data)
        if kind == "decode":
            assert data["read_limit"]["memory"]["reader"] in ("sum", "amax", "gemv"), name
            fractions = [r["fraction_of_limit"] for r in data["rows"] if r.get("time_s")]
        elif kind == "decode_cpu_core":
            fractions = [r["fraction_of_limit"] for r in data["from_memory"]]
        else:
            continue
        assert fractions and all(0 < f <= 1.0 for f in fractions), name
        assert data["measurement_errors"] == [], name


def test_the_decode_section_says_how_the_read_limit_was_measured():
    memory = dict(bytes_per_s=20e9, reader="gemv", buffer_bytes=1 << 31, threads=2, rates={})
    data = {"read_limit": {"memory": memory, "last_level_cache_bytes": 1 << 29}}
    text = publish.read_limit_text(data)
    assert "all 2 threads the kernels use" in text and "2.00 GiB, 4.0x the last-level" in text
    assert "memory: 20.0 GB/s by `gemv`" in text and "a figure above 100%" in text


def committed(name: str) -> dict:
    return json.loads((ROOT / "docs" / "results" / name).read_text())


def section_of(page: str, name: str) -> str:
    """The part of ``page`` published from docs/results/``name``: its heading to the next."""
    at = page.index(f"File: `docs/results/{name}`")
    start = page.rindex("\n### ", 0, at)
    end = page.find("\n### ", at)
    return page[start : end if end > 0 else len(page)]


@pytest.mark.parametrize(
    "name, kind",
    [
        ("bench_gguf_linear.json", "gguf_linear"),
        ("bench_quantized.json", "quantized"),
        ("greedy_agreement.json", "greedy_agreement"),
    ],
)
def test_the_quantized_benchmarks_are_known_by_their_shape(name, kind):
    assert publish.kind_of(committed(name)) == kind
    assert publish.SCRIPTS[kind] == Path(name).stem + ".py"  # the script that wrote it


def test_the_gguf_linear_figures_are_the_json_rows():
    data = committed("bench_gguf_linear.json")
    page = figures((ROOT / "docs" / "benchmarks.md").read_text())
    text = section_of(page, "bench_gguf_linear.json")
    assert "Intel(R) Xeon(R) Processor, 2 threads, load average 1.73 to 1.67" in text
    assert "`python benchmarks/bench_gguf_linear.py --json" in text
    lines = [line for line in text.splitlines() if line.startswith("| ") and "---" not in line]
    assert len(lines) == 1 + len(data["rows"])
    for line, r in zip(lines[1:], data["rows"]):
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert cells == [
            r["layer"],
            r["format"],
            f"{r['out']} x {r['in']}",
            str(r["batch"]),
            f"{r['int4pack_us']:.1f}",
            f"{r['gguf_us']:.1f}",
            f"{r['speedup']:.2f}x",
            f"{r['int8pack_us']:.1f}",
        ]


def test_the_quantized_end_to_end_cells_are_medians_of_the_rounds():
    data = committed("bench_quantized.json")
    page = figures((ROOT / "docs" / "benchmarks.md").read_text())
    text = section_of(page, "bench_quantized.json")
    assert "`python benchmarks/bench_quantized.py --rounds 3 --json" in text
    assert "over 3 rounds" in text and "Sapphire Rapids" in text  # INDEX.txt's note
    for config in ("bf16", "int4pack", "gguf"):
        rows = [r for r in data["rows"] if r["config"] == config]
        assert len(rows) == 3
        for key, digits in (("tok_s_1", 1), ("tok_s_32", 1), ("load_s", 2), ("rss_mb", 0)):
            values = [r[key] for r in rows]
            middle = sorted(values)[1]
            each = ", ".join(f"{v:.{digits}f}" for v in values)
            assert f"| {middle:.{digits}f} ({each}) |" in text, (config, key)
    # The published gguf median at 32 requests, checked by hand against the JSON.
    assert "| 329.2 (348.0, 329.2, 328.7) |" in text


def test_the_greedy_agreement_is_published_per_pair():
    data = committed("greedy_agreement.json")
    page = figures((ROOT / "docs" / "benchmarks.md").read_text())
    text = section_of(page, "greedy_agreement.json")
    assert "Machine: not recorded (token ids compared, no timing)" in text
    for pair, result in data["pairs"].items():
        mean, identical = result["mean_match_fraction"], result["questions_identical"]
        assert f"| {pair} | {mean:.3f} | {identical} of {result['questions']} |" in text
    assert "| gguf vs llama-server | 0.486 | 2 of 32 |" in text


def agreement_pairs(firsts: dict[str, list], fractions: dict[str, float]) -> dict:
    return {
        name: dict(
            first_divergence=first,
            mean_match_fraction=fractions[name],
            questions_identical=first.count(None),
            questions=len(first),
        )
        for name, first in firsts.items()
    }


def test_the_agreement_remark_counts_shared_divergences_and_claims_only_what_holds():
    firsts = {
        "a vs b": [None, None, 3],
        "a vs llama-server": [4, 2, 1],
        "b vs llama-server": [4, 5, None],
    }
    pairs = agreement_pairs(firsts, {"a vs b": 0.9, "a vs llama-server": 0.4,
                                     "b vs llama-server": 0.5})  # fmt: skip
    remark = publish.agreement_remark(pairs, "llama-server", 3)
    assert "all 2 of our variants first differ at the same token position in 1 of 3" in remark
    assert "at least two of them do in 1." in remark
    assert "agree with one another on 0.90 to 0.90" in remark and "0.40 to 0.50" in remark
    # Our variants agreeing with it as much as with one another: no claim that they part together.
    pairs["a vs llama-server"]["mean_match_fraction"] = 0.95
    assert "part from it" not in publish.agreement_remark(pairs, "llama-server", 3)
    # Without a llama-server run the section has the table alone.
    mine = {"a vs b": pairs["a vs b"]}
    text = publish.greedy_agreement_section({"tokens": 8, "pairs": mine})
    assert "| a vs b | 0.900 | 2 of 3 |" in text and "llama-server`," not in text


def engine_step_json() -> dict:
    """What bench_engine_step.py writes: two trees, two rounds, both workloads."""
    rows = []
    for workload in ("tiny64", "chat"):
        for round_index in range(2):
            for tree, scale in (("old", 2.0), ("new", 1.0)):
                row = {"tree": tree, "workload": workload, "round": round_index}
                row.update(load_before=1.0 + round_index, load_after=1.5 + round_index)
                if workload == "tiny64":
                    row.update(sequences=64, decode_steps=46)
                    row.update(step_ms_median=scale * (3 + round_index),
                               step_ms_p90=scale * (4 + round_index))  # fmt: skip
                else:
                    row.update(requests=32, generated=2048, tok_per_s=100 / scale + round_index)
                rows.append(row)
    machine = committed("bench_decode_cpu_core.json")["machine"]  # a machine_info() record
    return {"machine": machine, "rows": rows}


def test_the_engine_step_section_is_written_from_its_json(tmp_path):
    data = engine_step_json()
    assert publish.kind_of(data) == "engine_step"
    (tmp_path / "bench_engine_step.json").write_text(json.dumps(data))
    (tmp_path / "INDEX.txt").write_text(
        "bench_engine_step: python benchmarks/bench_engine_step.py --trees old=../old,new=. "
        "--json docs/results/bench_engine_step.json\n"
    )
    results = publish.load_results(tmp_path)
    page = publish.benchmarks_page(
        results, publish.index_commands(tmp_path), publish.index_notes(tmp_path)
    )
    assert "Files of no known benchmark" not in page
    assert publish.machine_of(data, "engine_step") in page
    assert "`python benchmarks/bench_engine_step.py --trees old=../old,new=. --json" in page
    assert "over 2 rounds" in page
    assert "| tiny64 | old | step ms, median | 7.00 (6.00, 8.00) | 1.0 to 1.5; 2.0 to 2.5 |" in page
    assert "| tiny64 | new | step ms, p90 | 4.50 (4.00, 5.00) |" in page
    assert "| chat | old | tokens/s | 50.50 (50.00, 51.00) |" in page
    assert "| chat | new | tokens/s | 100.50 (100.00, 101.00) |" in page


def test_a_proc_machine_record_is_named():
    machine = {"cpu": "Some CPU", "threads": 1, "loadavg_before": "0.50 0.4 0.3 1/2 3",
               "loadavg_after": "0.75 0.4 0.3 1/2 3"}  # fmt: skip
    assert publish.machine_of({"machine": machine}, "quantized") == (
        "Some CPU, 1 thread, load average 0.50 to 0.75"
    )


def test_the_spec_decode_section_is_written_from_its_json(tmp_path):
    rows = []
    for shape in ("single", "batch"):
        for round_index in range(2):
            for config, drafted, accepted in (("plain", 0, 0), ("ngram k=3", 90, 60)):
                rows.append(
                    {"shape": shape, "config": config, "round": round_index, "requests": 4,
                     "prompt_tokens": 600, "generated": 384, "seconds": 4.0,
                     "tok_per_s": 100.0 + round_index + (50 if drafted else 0),
                     "steps": 100 if drafted else 384, "drafted": drafted,
                     "accepted": accepted,
                     "acceptance_rate": accepted / drafted if drafted else None,
                     "same_tokens_as_plain": 4 if not drafted else 3,
                     "load_before": 1.0, "load_after": 2.0}
                )  # fmt: skip
    machine = committed("bench_decode_cpu_core.json")["machine"]
    data = {"machine": machine, "model": "smollm2", "rows": rows}
    assert publish.kind_of(data) == "spec_decode"
    (tmp_path / "bench_spec_decode.json").write_text(json.dumps(data))
    (tmp_path / "INDEX.txt").write_text(
        "bench_spec_decode: python benchmarks/bench_spec_decode.py "
        "--json docs/results/bench_spec_decode.json\n"
    )
    page = publish.benchmarks_page(
        publish.load_results(tmp_path),
        publish.index_commands(tmp_path),
        publish.index_notes(tmp_path),
    )
    assert "Files of no known benchmark" not in page
    assert "`python benchmarks/bench_spec_decode.py --json" in page
    assert "96 new tokens each" in page and "over 2 rounds" in page
    assert "| single | plain | 100.5 (100.0, 101.0) | 384 (384, 384) | - | 8 of 8 |" in page
    assert (
        "| batch | ngram k=3 | 150.5 (150.0, 151.0) | 100 (100, 100) | 67% (120 of 180) |" in page
    )
