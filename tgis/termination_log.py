"""The termination log: the file Kubernetes shows as the container's termination message
(`terminationMessagePolicy: FallbackToLogsOnError`).

Written by `tgis.termination.fail_startup` (expected errors), by `tgis.log`'s
uncaught-exception hook (the others) and by the launcher (why it stopped its children).
No imports from tgis, so both of those can use it.
"""

from __future__ import annotations

import os

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
