"""A shard that has stopped serving exits without finalizing the interpreter
(``cli.exit_after_serving``), but still runs its atexit handlers and flushes its output."""

from __future__ import annotations

import subprocess
import sys

CHILD = """
import atexit, logging, sys
from tgis.shard.cli import exit_after_serving
logging.basicConfig(stream=sys.stderr, level=logging.INFO, format="%(message)s")
atexit.register(lambda: print("atexit handler ran", file=sys.stderr))
print("buffered stdout", end="")
logging.getLogger("shard").info("logged")
exit_after_serving(int(sys.argv[1]))
print("never reached")
"""


def test_exit_after_serving_runs_atexit_flushes_and_keeps_the_code() -> None:
    for code in (0, 3):
        done = subprocess.run(
            [sys.executable, "-c", CHILD, str(code)], capture_output=True, text=True, timeout=60
        )
        assert done.returncode == code
        assert done.stdout == "buffered stdout"  # block-buffered to a pipe, yet flushed
        assert done.stderr.splitlines() == ["logged", "atexit handler ran"]
