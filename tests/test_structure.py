"""The rules the code base checks itself against, run here so that CI enforces them too
(``make lint`` runs the same tools): ruff (style, and the C901/PLR size rules), the import
contracts in pyproject.toml (import-linter), and ``scripts/check_structure.py`` (function
and file sizes, ARCHITECTURE.md's ``file: name`` references).

Each check is also shown to fail on a violation planted in a copy of the package, so a
rule that stopped checking anything would be noticed.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from scripts import check_structure

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
LINTED = ("tgis", "tests", "scripts", "benchmarks", "examples")


def _run(*argv: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=300)


def test_ruff_is_clean() -> None:
    check = _run(str(BIN / "ruff"), "check", *LINTED)
    assert check.returncode == 0, check.stdout + check.stderr
    formatted = _run(str(BIN / "ruff"), "format", "--check", *LINTED)
    assert formatted.returncode == 0, formatted.stdout + formatted.stderr


def test_import_contracts_are_kept() -> None:
    result = _run(str(BIN / "lint-imports"), "--no-cache")
    assert result.returncode == 0, result.stdout + result.stderr


def test_sizes_and_architecture_references() -> None:
    assert [str(v) for v in check_structure.violations()] == []


@pytest.fixture(scope="module")
def package_copy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The package, its pyproject.toml and ARCHITECTURE.md in a fresh directory."""
    root = tmp_path_factory.mktemp("copy")
    shutil.copytree(
        ROOT / "tgis", root / "tgis", ignore=shutil.ignore_patterns("__pycache__", "data")
    )
    for name in ("pyproject.toml", "ARCHITECTURE.md"):
        shutil.copy(ROOT / name, root / name)
    return root


def _plant(path: Path, text: str) -> str:
    """Append ``text`` to ``path``; returns the original content."""
    original = path.read_text()
    path.write_text(original + text)
    return original


@pytest.mark.parametrize(
    ("module", "planted", "contract"),
    [
        ("router/errors.py", "\nimport torch  # noqa\n", "The router imports neither torch"),
        ("router/ops/drain.py", "\nfrom tgis.shard import config  # noqa\n", "nor the shard"),
        (
            "shard/errors.py",
            "\nfrom tgis.router import errors  # noqa\n",
            "The shard does not import the router",
        ),
        (
            "router/core/engine.py",
            "\nfrom tgis.pb import generation_pb2  # noqa\n",
            "Protobuf-generated modules only",
        ),
        (
            "router/core/block_pool.py",
            "\ndef _late() -> None:\n    from tgis.router.core import scheduler  # noqa\n",
            "No import cycles",
        ),
        (
            "router/ops/metrics.py",
            "\nfrom tgis.router.intake import limits  # noqa\n",
            "The router's parts follow a request's life downward",
        ),
    ],
)
def test_a_planted_import_breaks_its_contract(
    package_copy: Path, module: str, planted: str, contract: str
) -> None:
    path = package_copy / "tgis" / module
    original = _plant(path, planted)
    try:
        result = _run(str(BIN / "lint-imports"), "--no-cache", cwd=package_copy)
    finally:
        path.write_text(original)
    assert result.returncode == 1, result.stdout
    broken = result.stdout.split("Broken contracts", 1)[-1]
    assert contract in " ".join(broken.split()), result.stdout


def test_planted_size_and_reference_violations_are_reported(package_copy: Path) -> None:
    module = package_copy / "tgis" / "router" / "ops" / "drain.py"
    body = "".join(f"    x{i} = {i}\n" for i in range(check_structure.MAX_FUNCTION_LINES))
    original = _plant(module, "\n\ndef _long() -> None:\n" + body)
    doc = package_copy / "ARCHITECTURE.md"
    doc_original = _plant(doc, "\n`router/ops/drain.py: Drain.no_such_method`\n")
    try:
        found = [str(v) for v in check_structure.violations(package_copy)]
    finally:
        module.write_text(original)
        doc.write_text(doc_original)
    assert any("function _long has 61 lines (at most 60)" in v for v in found), found
    assert any("drain.py defines no Drain.no_such_method" in v for v in found), found
    long_module = package_copy / "tgis" / "router" / "ops" / "padding.py"
    long_module.write_text("# line\n" * (check_structure.MAX_FILE_LINES + 1))
    try:
        found = [str(v) for v in check_structure.violations(package_copy)]
    finally:
        long_module.unlink()
    assert any("padding.py: 401 lines (at most 400)" in v for v in found), found
