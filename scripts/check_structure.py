"""Size rules and documentation references that ruff and import-linter do not check.

* No function or method in ``tgis/`` longer than ``MAX_FUNCTION_LINES`` (from its ``def``
  line to its last line, decorators not counted), except the GPU kernels named in
  ``KERNEL_EXEMPTIONS``, each with its reason.
* No module in ``tgis/`` longer than ``MAX_FILE_LINES`` lines.
* Every ``path.py: Name`` (or ``path.py: Class.member``) that ARCHITECTURE.md names exists:
  some file whose path ends with ``path.py`` defines ``Name`` at its top level (and
  ``member`` in that class).

Run by ``make lint`` and by ``tests/test_structure.py``; prints one line per violation and
exits 1 when there is any.
"""

from __future__ import annotations

import ast
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "tgis"
MAX_FUNCTION_LINES = 60
MAX_FILE_LINES = 400

KERNEL_EXEMPTIONS: dict[str, str] = {
    # "path relative to tgis/::function": why it may be longer
    "shard/native/attention/triton_kernels.py::prefill_kernel": (
        "one Triton program: its loads, masks and online softmax share registers, so a helper "
        "split would not change what the GPU runs and would hide the data flow"
    ),
    "shard/native/attention/triton_kernels.py::decode_kernel": (
        "one Triton program (split-K flash decoding), kept whole for the same reason"
    ),
}

_DOC_REFERENCE = re.compile(r"`?([A-Za-z_][\w/.]*\.py): ([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)?)")


@dataclass(frozen=True, slots=True)
class Violation:
    where: str
    what: str

    def __str__(self) -> str:
        return f"{self.where}: {self.what}"


def package_modules(package: Path = PACKAGE) -> Iterator[Path]:
    """Every hand-written module of the package (generated protobuf stubs excluded)."""
    for path in sorted(package.rglob("*.py")):
        if "pb" not in path.relative_to(package).parts[:1]:
            yield path


def long_functions(path: Path, package: Path = PACKAGE) -> Iterator[Violation]:
    relative = path.relative_to(package).as_posix()
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        lines = (node.end_lineno or node.lineno) - node.lineno + 1
        if lines <= MAX_FUNCTION_LINES or f"{relative}::{node.name}" in KERNEL_EXEMPTIONS:
            continue
        yield Violation(
            f"tgis/{relative}:{node.lineno}",
            f"function {node.name} has {lines} lines (at most {MAX_FUNCTION_LINES})",
        )


def long_file(path: Path, package: Path = PACKAGE) -> Violation | None:
    lines = len(path.read_text().splitlines())
    if lines <= MAX_FILE_LINES:
        return None
    relative = path.relative_to(package).as_posix()
    return Violation(f"tgis/{relative}", f"{lines} lines (at most {MAX_FILE_LINES})")


def stale_exemptions(package: Path = PACKAGE) -> Iterator[Violation]:
    """Exemptions that no longer name a function (renamed or deleted kernels)."""
    for key in KERNEL_EXEMPTIONS:
        relative, name = key.split("::")
        path = package / relative
        names = set()
        if path.exists():
            tree = ast.parse(path.read_text())
            names = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
        if name not in names:
            yield Violation("scripts/check_structure.py", f"exemption {key} names no function")


def _defined_names(body: list[ast.stmt]) -> set[str]:
    names: set[str] = set()
    for node in body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return names


def _class_members(files: list[Path]) -> dict[str, tuple[set[str], list[str]]]:
    """Every top-level class of ``files`` by name: its members (methods, class attributes,
    attributes assigned through ``self``) and the names of its bases."""
    classes: dict[str, tuple[set[str], list[str]]] = {}
    for path in files:
        for node in ast.parse(path.read_text()).body:
            if not isinstance(node, ast.ClassDef):
                continue
            members = _defined_names(node.body)
            for item in ast.walk(node):
                if isinstance(item, ast.Attribute) and isinstance(item.ctx, ast.Store):
                    members.add(item.attr)
            bases = [ast.unparse(b).split("[")[0].split(".")[-1] for b in node.bases]
            known = classes.setdefault(node.name, (set(), []))
            known[0].update(members)
            known[1].extend(bases)
    return classes


def _has_member(classes: dict[str, tuple[set[str], list[str]]], cls: str, member: str) -> bool:
    """``member`` defined by class ``cls`` or one of its bases (found by name)."""
    seen: set[str] = set()
    pending = [cls]
    while pending:
        name = pending.pop()
        if name in seen or name not in classes:
            continue
        seen.add(name)
        members, bases = classes[name]
        if member in members:
            return True
        pending.extend(bases)
    return False


def _defines(path: Path, name: str, classes: dict[str, tuple[set[str], list[str]]]) -> bool:
    """Whether ``path`` defines ``name`` (``Class.member``: a member of a top-level class of
    ``path`` or of one of its bases)."""
    tree = ast.parse(path.read_text())
    top, _, member = name.partition(".")
    if top not in _defined_names(tree.body):
        return False
    return not member or _has_member(classes, top, member)


def stale_doc_references(doc: Path, root: Path = ROOT) -> Iterator[Violation]:
    """``file.py: Name`` references in ``doc`` that name no existing file or definition."""
    files = [p for p in root.rglob("*.py") if ".venv" not in p.parts]
    classes = _class_members([p for p in files if "tgis" in p.parts])
    for number, line in enumerate(doc.read_text().splitlines(), 1):
        for match in _DOC_REFERENCE.finditer(line):
            file, name = match.groups()
            candidates = [p for p in files if p.as_posix().endswith("/" + file.lstrip("/"))]
            where = f"{doc.name}:{number}"
            if not candidates:
                yield Violation(where, f"{file} does not exist")
            elif not any(_defines(p, name, classes) for p in candidates):
                yield Violation(where, f"{file} defines no {name}")


def violations(root: Path = ROOT) -> list[Violation]:
    package = root / "tgis"
    found: list[Violation] = []
    for path in package_modules(package):
        found.extend(long_functions(path, package))
        file_violation = long_file(path, package)
        if file_violation is not None:
            found.append(file_violation)
    found.extend(stale_exemptions(package))
    found.extend(stale_doc_references(root / "ARCHITECTURE.md", root))
    return found


def main() -> int:
    found = violations()
    for violation in found:
        print(violation)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
