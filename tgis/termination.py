"""Fatal errors: one line on stderr, the same line in /dev/termination-log, non-zero exit.

Used by all three processes: `fail_startup` for errors they expect (configuration, model,
ports), and `tgis.log`'s uncaught-exception hook for the others.

Kubernetes shows the termination log as the container's termination message
(`terminationMessagePolicy: FallbackToLogsOnError`).
"""

from __future__ import annotations

import os
import sys
from typing import NoReturn

from tgis.log import fatal_line, one_line

TERMINATION_LOG = "/dev/termination-log"


def termination_log_path() -> str:
    """Kubernetes' path, unless TGIS_TERMINATION_LOG names another (tests use a temp file)."""
    return os.environ.get("TGIS_TERMINATION_LOG", TERMINATION_LOG)


def write_termination_log(message: str, path: str | None = None) -> None:
    """Best effort: the file only exists (and is writable) inside a Kubernetes container."""
    path = path or termination_log_path()
    if path == TERMINATION_LOG and not os.path.exists(path):
        return  # outside Kubernetes: do not create files under /dev
    try:
        with open(path, "w", encoding="utf-8") as f:
            f.write(message + "\n")
    except OSError:
        pass


def fail_startup(message: str, exit_code: int = 1) -> NoReturn:
    """Report a configuration or start-up error (one line; a JSON object under
    --json-output) and exit."""
    message = one_line(message)
    print(fatal_line(message), file=sys.stderr, flush=True)
    write_termination_log(message)
    sys.exit(exit_code)
