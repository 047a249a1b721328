"""The launcher's own log lines: plain text, or one JSON object per line (`--json-output`)."""

from __future__ import annotations

import logging
import sys

from tgis.log import JsonFormatter, log_level, utc_timestamp

__all__ = ["LOGGER_NAME", "get_logger", "setup_logging", "utc_timestamp"]

LOGGER_NAME = "text_generation_launcher"


def get_logger() -> logging.Logger:
    """The launcher's logger."""
    return logging.getLogger(LOGGER_NAME)


def setup_logging(json_output: bool) -> logging.Logger:
    """Log to stderr at LOG_LEVEL (default info); return the launcher's logger."""
    handler = logging.StreamHandler(sys.stderr)
    if json_output:
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s launcher: %(message)s"))
    log = get_logger()
    log.handlers[:] = [handler]
    log.setLevel(log_level())
    log.propagate = False
    return log
