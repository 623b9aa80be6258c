"""Every Python example of README.md and docs/*.md runs as written, and the README keeps what a
newcomer needs on its first screen.

A block that cannot run here (it needs a GPU or a running server) is preceded by
``<!-- not run: REASON -->``; the reason must be given, and such blocks stay few."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
GENERATED = {ROOT / "docs" / "cuda.md"}  # written by tests/cuda_emulator.py --write-docs
NOT_RUN = re.compile(r"<!--\s*not run:(?P<reason>.*?)-->\s*$", re.S)
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def python_blocks(path: Path) -> list[tuple[int, str, str | None]]:
    """``(line, code, reason it is not run or None)`` of every ```python block of ``path``."""
    text = path.read_text()
    blocks = []
    for match in BLOCK.finditer(text):
        before = text[: match.start()].rstrip("\n").splitlines()
        marker = NOT_RUN.match(before[-1].strip()) if before else None
        reason = marker.group("reason").strip() if marker else None
        blocks.append((text.count("\n", 0, match.start()) + 1, match.group(1), reason))
    return blocks


EXAMPLES = [
    (path, line, code, reason) for path in PAGES for line, code, reason in python_blocks(path)
]
RUN = [e for e in EXAMPLES if e[3] is None]
SKIPPED = [e for e in EXAMPLES if e[3] is not None]


def example_id(example) -> str:
    path, line, _, _ = example
    return f"{path.relative_to(ROOT)}:{line}"


@pytest.mark.parametrize("example", RUN, ids=[example_id(e) for e in RUN])
def test_example_runs(example):
    path, line, code, _ = example
    # Line numbers of a failure point into the page.
    exec(compile("\n" * line + code, str(path), "exec"), {"__name__": "docs_example"})


@pytest.mark.parametrize("example", RUN, ids=[example_id(e) for e in RUN])
def test_example_asserts_what_it_shows(example):
    assert re.search(r"\bassert(_close)?\b", example[2]), "an example checks what it shows"


def test_examples_exist_in_the_readme_and_the_docs():
    assert len([e for e in RUN if e[0] == README]) >= 4  # the five ways in, less the commands
    assert len({e[0] for e in RUN}) >= 8


def test_blocks_not_run_say_why_and_stay_few():
    for example in SKIPPED:
        assert len(example[3]) >= 10, f"{example_id(example)}: give the reason it is not run"
    assert len(SKIPPED) <= 4, [example_id(e) for e in SKIPPED]


def test_the_readme_is_short_and_says_first_what_ran_where():
    lines = README.read_text().splitlines()
    assert len(lines) <= 250
    first_screen = "\n".join(lines[:30])
    assert "have not run on a GPU" in first_screen
    assert "CPU kernels" in first_screen and "CUDA kernels" in first_screen


def test_the_quick_start_is_make_demo_then_make_test():
    text = README.read_text()
    block = re.search(r"```bash\n(make demo.*?)```", text, re.S).group(1)
    assert [line.split("#")[0].strip() for line in block.splitlines()] == ["make demo", "make test"]
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^demo:", makefile, re.M) and re.search(r"^test:", makefile, re.M)


@pytest.mark.parametrize("path", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_local_links_resolve(path):
    for target in re.findall(r"\]\(([^)\s]+)\)", path.read_text()):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        assert (path.parent / target.split("#")[0]).exists(), f"{path.name}: {target}"


@pytest.mark.parametrize(
    "path", [p for p in PAGES if p not in GENERATED], ids=lambda p: str(p.relative_to(ROOT))
)
def test_user_docs_name_no_issue_or_commit(path):
    text = path.read_text()
    assert not re.search(r"\b[Ii]ssue \d+|#\d{2,}\b", text)
    assert not re.search(r"\bcommit [0-9a-f]{7,40}\b|\bat [0-9a-f]{7}\b", text)


def test_pip_install_is_from_source():
    for path in PAGES:
        assert "pip install 'paged_attention[" not in path.read_text(), path.name


def test_the_family_count_is_that_of_the_models_page():
    models = (ROOT / "docs" / "models.md").read_text()
    table = models[models.index("## Tested families") : models.index("## Refused")]
    rows = [line.split("|")[1] for line in table.splitlines() if line.startswith("| `")]
    families = {name for cell in rows for name in re.findall(r"`(\w+)`", cell)} - {"model_type"}
    for path in (README, ROOT / "docs" / "index.md", ROOT / "docs" / "integration.md"):
        counts = re.findall(
            r"\b(\d+) (?:transformers decoder|decoder-only model) families", path.read_text()
        )
        assert counts and all(int(n) == len(families) for n in counts), path.name
