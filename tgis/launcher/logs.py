"""The launcher's own log lines: plain text, or one JSON object per line (`--json-output`)."""

from __future__ import annotations

import json
import logging
import os
import sys
import time

LOGGER_NAME = "text_generation_launcher"


class JsonFormatter(logging.Formatter):
    """timestamp, level, target, message: the fields of the router's JSON lines."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "timestamp": utc_timestamp(record.created),
            "level": record.levelname,
            "target": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


def utc_timestamp(created: float | None = None) -> str:
    """RFC 3339 UTC with milliseconds, e.g. 2024-05-01T12:00:00.123Z."""
    created = time.time() if created is None else created
    millis = int((created % 1) * 1000)
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(created)) + f".{millis:03d}Z"


def get_logger() -> logging.Logger:
    """The launcher's logger."""
    return logging.getLogger(LOGGER_NAME)


def setup_logging(json_output: bool) -> logging.Logger:
    """Log to stderr at LOG_LEVEL (default info); return the launcher's logger."""
    level_name = os.environ.get("LOG_LEVEL", "info").split(",")[0].strip().upper() or "INFO"
    handler = logging.StreamHandler(sys.stderr)
    if json_output:
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s launcher: %(message)s"))
    log = get_logger()
    log.handlers[:] = [handler]
    log.setLevel(getattr(logging, level_name, logging.INFO))
    log.propagate = False
    return log
