"""A one-minute soak (``benchmarks/soak.py``) of the launched embedded model: mixed load from
eight clients (every request kind of the mix), no errors, consistent responses, tokens in
every 10-second window, and bounded memory growth of the router and the shard after the
warm-up. ``TGIS_SOAK_SECONDS`` sets a longer run (``TGIS_SOAK_SECONDS=120``: two minutes,
the CI soak until issue 36). The 30-minute run (``--duration 1800``) is the record; this is
its smoke test in CI."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow

DURATION_S = int(os.environ.get("TGIS_SOAK_SECONDS", "60"))
# The baseline is taken after a third of the run, once the allocators have met the mix's
# shapes (prompts of 1 to ~400 tokens, batches of 1 to ~30 sequences). Measured on 2 CPU
# cores shared with other jobs (load average 5-8), 8 clients, with the CPU KV cache
# committed at start-up (~1.36 GiB of shard RSS): the shard reaches its level within 5-10 s
# and then wanders by about +-1.5 % (one sample at each end); the router grows slowly, 20 s
# to 60 s +1.5 / +0.8 / +1.6 % (seeds 1-3), 20 s to 120 s +2.5 % (seed 0). The goal, < 5 %,
# holds with margin. Against the two-minute soak (growth from 60 s to 120 s) a steady leak
# shows two thirds of its growth here; a slow one shows only in the 30-minute record.
WARMUP_S = DURATION_S // 3
MAX_GROWTH_PERCENT = 5.0


def test_soak_has_no_errors_and_bounded_memory(tmp_path: Path) -> None:
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
    assert len(windows) == math.ceil(DURATION_S / 10)
    assert all(tokens > 0 for tokens in windows), windows
    rss = figures["rss"]
    assert {"router", "shard"} <= set(rss), rss.keys()
    for name, figures_of in rss.items():
        assert figures_of["growth_percent"] < MAX_GROWTH_PERCENT, (name, figures_of)
