"""A two-minute soak (``benchmarks/soak.py``) of the launched embedded model: mixed load from
eight clients, no errors, tokens in every 10-second window, and bounded memory growth of
the router and the shard after the warm-up. The 30-minute run (``--duration 1800``) is the
record; this is its smoke test in CI."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow

DURATION_S = 120
# The shard's RSS climbs for the first minute while the allocator meets new shapes (prompts
# of 1 to ~400 tokens, batches of 1 to ~30 sequences), so the baseline is taken at 60 s.
WARMUP_S = 60
# Measured on 2 CPU cores shared with other jobs (load average ~6), 8 clients, three runs:
# growth from 60 s to 120 s was router +0.75 / +0.41 / +0.35 %, shard -0.61 / -0.24 / +0.81 %;
# with the baseline at 24 s instead the shard still grew 4.4 % (warm-up not over). In steady
# state the shard's RSS wanders by about ±1.5 % around its level (one sample at each end), so
# the goal, < 5 %, holds with margin. Two minutes cannot show a slow leak: the 30-minute
# record can.
MAX_GROWTH_PERCENT = 5.0


def test_two_minute_soak_has_no_errors_and_bounded_memory(tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    command = [
        sys.executable, str(ROOT / "benchmarks" / "soak.py"),
        "--duration", str(DURATION_S), "--warmup", str(WARMUP_S), "--clients", "8",
        "--json", str(out),
    ]  # fmt: skip
    result = subprocess.run(
        command, capture_output=True, text=True, timeout=DURATION_S + 300, check=False
    )
    print(result.stdout)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    figures = json.loads(out.read_text())
    assert figures["error_count"] == 0, figures["error_examples"]
    requests = figures["requests"]
    assert set(requests) == {
        "stream",
        "stream-cancelled",
        "generate-batch",
        "tokenize",
        "model-info",
    }
    assert figures["client_cancellations"] > 0
    windows = figures["throughput"]["tokens_per_window"]
    assert len(windows) == DURATION_S // 10
    assert all(tokens > 0 for tokens in windows), windows
    rss = figures["rss"]
    assert {"router", "shard"} <= set(rss), rss.keys()
    for name, figures_of in rss.items():
        assert figures_of["growth_percent"] < MAX_GROWTH_PERCENT, (name, figures_of)
