"""The launcher's own log lines: plain text, or one JSON object per line (`--json-output`)."""

from __future__ import annotations

import logging

from tgis.log import setup_logging as setup_process_logging
from tgis.log import utc_timestamp

__all__ = ["LOGGER_NAME", "get_logger", "setup_logging", "utc_timestamp"]

LOGGER_NAME = "text_generation_launcher"


def get_logger() -> logging.Logger:
    """The launcher's logger."""
    return logging.getLogger(LOGGER_NAME)


def setup_logging(json_output: bool) -> logging.Logger:
    """Log to stderr at LOG_LEVEL (default info), every logger of the process alike (the
    root handler, uncaught exceptions included); return the launcher's logger."""
    setup_process_logging(json_output, "launcher")
    log = get_logger()
    log.handlers.clear()
    log.propagate = True
    return log
