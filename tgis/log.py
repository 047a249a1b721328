"""Logging set-up shared by the three processes: plain text or one JSON object per line."""

from __future__ import annotations

import json
import logging
import os
import sys
import time


def utc_timestamp(created: float | None = None) -> str:
    """RFC 3339 UTC with milliseconds, e.g. 2024-05-01T12:00:00.123Z."""
    created = time.time() if created is None else created
    millis = int((created % 1) * 1000)
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(created)) + f".{millis:03d}Z"


def log_level() -> int:
    """LOG_LEVEL (first directive of a TGIS-style filter such as `info,tgis=debug`)."""
    name = os.environ.get("LOG_LEVEL", "info").split(",")[0].strip().upper() or "INFO"
    level = getattr(logging, name, logging.INFO)
    return level if isinstance(level, int) else logging.INFO


class JsonFormatter(logging.Formatter):
    """One JSON object per record: timestamp, level, target (logger), message."""

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


def setup_logging(json_output: bool = False, component: str = "tgis") -> None:
    """Configure the root logger once; the level comes from LOG_LEVEL (default info)."""
    handler = logging.StreamHandler(sys.stderr)
    if json_output:
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(
            logging.Formatter(f"%(asctime)s %(levelname)s {component} %(name)s: %(message)s")
        )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(log_level())
