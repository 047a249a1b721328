"""Logging set-up shared by the three processes: plain text or one JSON object per line.

One handler on the root logger formats every record, so third-party loggers (grpc,
aiohttp, asyncio, transformers) come out like ours; ``warnings.warn`` goes through the
``py.warnings`` logger; an uncaught exception is one record with its traceback inside
(JSON: in the ``exception`` field of the same object, never extra lines), and in the main
thread also one line in the termination log (`tgis.termination_log`), since the process
is about to die.

Request fields: ``bind_log_fields(correlation_id=...)`` sets fields for the current asyncio
task (a contextvar, copied into the tasks it creates) that every record logged there
carries; ``log_extra(**fields)`` gives them to one record logged from elsewhere (the
engine's task, about a request). JSON puts them at the top level of the object, plain text
in brackets before the message.

Lines a process writes straight to file descriptor 2 (the gRPC C core, CUDA) bypass all
this; the launcher wraps each such line of its children in a JSON object.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
from collections.abc import Mapping
from contextvars import ContextVar, Token
from types import MappingProxyType, TracebackType
from typing import Any

from tgis.termination_log import write_termination_log

FIELDS_ATTR = "tgis_fields"
"""The LogRecord attribute holding a record's request fields."""

_NO_FIELDS: Mapping[str, object] = MappingProxyType({})
_fields: ContextVar[Mapping[str, object]] = ContextVar("tgis_log_fields", default=_NO_FIELDS)
_json_mode = False
_TRUE_WORDS = ("true", "1", "yes", "on")


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


def json_output_from_env() -> bool:
    """JSON_OUTPUT as the launcher passes it to its children (true/1/yes/on)."""
    return os.environ.get("JSON_OUTPUT", "").strip().lower() in _TRUE_WORDS


# ---- request fields ---------------------------------------------------------------------------


def bind_log_fields(**fields: object) -> Token[Mapping[str, object]]:
    """Add ``fields`` to every record logged from the current context (task) on; returns
    the token for ``reset_log_fields``."""
    return _fields.set(MappingProxyType({**_fields.get(), **fields}))


def reset_log_fields(token: Token[Mapping[str, object]]) -> None:
    _fields.reset(token)


def current_log_fields() -> Mapping[str, object]:
    return _fields.get()


def log_extra(**fields: object) -> dict[str, Any]:
    """``extra=`` for one record about a request, logged outside that request's task."""
    return {FIELDS_ATTR: fields}


def record_fields(record: logging.LogRecord) -> Mapping[str, object]:
    fields = getattr(record, FIELDS_ATTR, None)
    return fields if isinstance(fields, Mapping) else _NO_FIELDS


class ContextFieldsFilter(logging.Filter):
    """Stamps the current context's fields on records that carry none of their own (runs
    synchronously in the logging call, so in the caller's task)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, FIELDS_ATTR):
            setattr(record, FIELDS_ATTR, _fields.get())
        return True


# ---- formatters -------------------------------------------------------------------------------


class JsonFormatter(logging.Formatter):
    """One JSON object per record: timestamp, level, target (logger), message, the request
    fields, and the traceback (``exception``) when there is one."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, object] = {
            "timestamp": utc_timestamp(record.created),
            "level": record.levelname,
            "target": record.name,
            "message": record.getMessage(),
        }
        for key, value in record_fields(record).items():
            entry.setdefault(key, value)
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        if record.stack_info:
            entry["stack"] = self.formatStack(record.stack_info)
        return json.dumps(entry, ensure_ascii=False, default=str)


class PlainFormatter(logging.Formatter):
    """``<time> <LEVEL> <component> <logger>: [k=v ...] message``."""

    def __init__(self, component: str) -> None:
        super().__init__(f"%(asctime)s %(levelname)s {component} %(name)s: %(message)s")

    def formatMessage(self, record: logging.LogRecord) -> str:
        line = super().formatMessage(record)
        fields = record_fields(record)
        if not fields:
            return line
        head, sep, message = line.partition(f"{record.name}: ")
        tags = " ".join(f"{key}={value}" for key, value in fields.items())
        return f"{head}{sep}[{tags}] {message}"


def json_logging() -> bool:
    """Whether ``setup_logging`` chose JSON lines in this process."""
    return _json_mode


def fatal_line(message: str) -> str:
    """A fatal start-up error as this process prints it: ``error: ...`` or a JSON object."""
    if not _json_mode:
        return f"error: {message}"
    entry = {
        "timestamp": utc_timestamp(),
        "level": "ERROR",
        "target": "tgis.termination",
        "message": message,
    }
    return json.dumps(entry, ensure_ascii=False)


# ---- uncaught exceptions ----------------------------------------------------------------------


def one_line(text: str) -> str:
    """The non-blank lines of ``text``, stripped and joined by single spaces."""
    return " ".join(part.strip() for part in text.splitlines() if part.strip())


def _excepthook(
    exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None
) -> None:
    if issubclass(exc_type, KeyboardInterrupt):
        sys.__excepthook__(exc_type, exc, tb)
        return
    summary = one_line(f"{exc_type.__name__}: {exc}")
    logging.getLogger("tgis.uncaught").critical(
        "uncaught exception: %s", summary, exc_info=(exc_type, exc, tb)
    )
    write_termination_log(summary)


def _thread_excepthook(args: threading.ExceptHookArgs) -> None:
    if args.exc_type is SystemExit:
        return
    name = args.thread.name if args.thread is not None else "?"
    logging.getLogger("tgis.uncaught").error(
        "uncaught exception in thread %s: %s",
        name,
        one_line(f"{args.exc_type.__name__}: {args.exc_value}"),
        exc_info=(
            None if args.exc_value is None else (args.exc_type, args.exc_value, args.exc_traceback)
        ),
    )


def setup_logging(json_output: bool = False, component: str = "tgis") -> None:
    """Configure the root logger (every logger propagates to it) at LOG_LEVEL, warnings
    and uncaught exceptions included. JSON when ``json_output`` or JSON_OUTPUT is set."""
    global _json_mode
    _json_mode = json_output or json_output_from_env()
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(ContextFieldsFilter())
    handler.setFormatter(JsonFormatter() if _json_mode else PlainFormatter(component))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(log_level())
    logging.captureWarnings(True)
    sys.excepthook = _excepthook
    threading.excepthook = _thread_excepthook
