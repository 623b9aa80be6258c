"""The import-linter contracts of pyproject.toml ([tool.importlinter]): each layer of the package
imports only the layers below it, and none imports the tests' helpers. ``make lint`` runs
``lint-imports`` on the package; here it also runs on a copy with an upward import planted, which
must break the contract."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LINT_IMPORTS = "from importlinter.cli import lint_imports_command; lint_imports_command()"


def lint_imports(root: Path) -> subprocess.CompletedProcess:
    """``lint-imports`` over the ``paged_attention`` found first from ``root``, with ``root``'s
    pyproject.toml."""
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run(
        [sys.executable, "-c", LINT_IMPORTS, "--config", str(root / "pyproject.toml")],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.fixture
def package_copy(tmp_path: Path) -> Path:
    """The package's Python files and pyproject.toml, copied (no compiled library: the contracts
    read the imports, nothing is imported)."""
    shutil.copytree(ROOT / "paged_attention", tmp_path / "paged_attention",
                    ignore=shutil.ignore_patterns("*.so", "__pycache__"))  # fmt: skip
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path


def plant(root: Path, module: str, line: str) -> None:
    path = root / (module.replace(".", "/") + ".py")
    path.write_text(path.read_text() + f"\n\ndef _planted():\n    {line}\n")


def test_the_package_keeps_its_layers():
    result = lint_imports(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "2 kept, 0 broken" in result.stdout


def test_the_copy_keeps_them_too(package_copy):
    result = lint_imports(package_copy)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize(
    ("module", "line", "broken"),
    [
        (
            "paged_attention.kv.cache",
            "from paged_attention.engine import Engine  # noqa: F401",
            "paged_attention.kv is not allowed to import paged_attention.engine",
        ),
        (
            "paged_attention.modeling.geometry",
            "import paged_attention.integrations.transformers  # noqa: F401",
            "paged_attention.modeling is not allowed to import paged_attention.integrations",
        ),
        (
            "paged_attention.server.engine_process",
            "from paged_attention.cli.demo import run  # noqa: F401",
            "paged_attention.server is not allowed to import paged_attention.cli",
        ),
        (
            "paged_attention.engine.engine",
            "from paged_attention.integrations.transformers import PagedCache  # noqa: F401",
            "paged_attention.engine is not allowed to import paged_attention.integrations",
        ),
        (
            "paged_attention.modeling.models",
            "from paged_attention.testing import make_paged_kv  # noqa: F401",
            "paged_attention.modeling is not allowed to import paged_attention.testing",
        ),
    ],
)
def test_an_upward_import_breaks_the_contract(package_copy, module, line, broken):
    """Also an import inside a function (the lazy imports of the command line count)."""
    plant(package_copy, module, line)
    result = lint_imports(package_copy)
    assert result.returncode == 1, result.stdout + result.stderr
    assert broken in result.stdout
    assert f"{module} -> " in result.stdout  # the planted import is named
