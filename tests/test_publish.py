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
