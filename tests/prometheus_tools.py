"""Helpers for the metrics tests: find promtool/prometheus, parse Prometheus text exposition."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass

import pytest

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)(?:\s+-?\d+)?$")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def require_tool(name: str) -> str:
    """The path of a Prometheus binary; skip without it, but fail in CI (CI=true)."""
    path = shutil.which(name)
    if path is not None:
        return path
    message = f"{name} not found: `make prometheus-tools` installs Debian's prometheus package"
    if os.environ.get("CI") == "true":
        pytest.fail(message)
    pytest.skip(message)


def promtool_check(body: bytes) -> None:
    """`promtool check metrics` must accept the exposition without any lint problem."""
    result = subprocess.run(
        [require_tool("promtool"), "check", "metrics"],
        input=body,
        capture_output=True,
        timeout=60,
        check=False,
    )
    output = (result.stdout + result.stderr).decode(errors="replace")
    assert result.returncode == 0, output


@dataclass(frozen=True)
class Sample:
    name: str
    labels: dict[str, str]
    value: float


@dataclass
class Exposition:
    types: dict[str, str]
    helps: dict[str, str]
    samples: list[Sample]

    def of(self, name: str) -> list[Sample]:
        return [s for s in self.samples if s.name == name]

    def value(self, name: str, **labels: str) -> float:
        (sample,) = [s for s in self.of(name) if s.labels == labels]
        return sample.value


def parse_exposition(text: str) -> Exposition:
    """Prometheus text format 0.0.4, strictly: every line is a comment or a sample."""
    types: dict[str, str] = {}
    helps: dict[str, str] = {}
    samples: list[Sample] = []
    for line in text.splitlines():
        if not line:
            continue
        if line.startswith("# TYPE "):
            name, kind = line[len("# TYPE ") :].split(" ")
            assert name not in types, f"two TYPE lines for {name}"
            types[name] = kind
            continue
        if line.startswith("# HELP "):
            name, _, doc = line[len("# HELP ") :].partition(" ")
            helps[name] = doc
            continue
        assert not line.startswith("#"), line
        match = _SAMPLE.match(line)
        assert match is not None, f"not a sample line: {line!r}"
        name, labels, value = match.groups()
        parsed = dict(_LABEL.findall(labels or ""))
        samples.append(Sample(name, parsed, float(value)))
    return Exposition(types, helps, samples)
