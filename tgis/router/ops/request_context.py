"""The request's correlation id (``x-correlation-id`` metadata) on every log line about it.

The call gate (``edge/calls.py``) binds it for the RPC's task (``tgis.log`` contextvar
fields), so whatever is logged there, or in tasks started from there, carries
``correlation_id``; the engine, which runs in its own task, reads the id captured on the
RequestState (``request_log_extra``).
A request without the header logs ``<none>``, as TGIS does.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from tgis.log import current_log_fields, log_extra

CORRELATION_HEADER = "x-correlation-id"
NO_CORRELATION_ID = "<none>"
CORRELATION_FIELD = "correlation_id"
_MAX_LENGTH = 256


def correlation_id(metadata: Iterable[tuple[str, str | bytes]] | None) -> str:
    """The client's x-correlation-id (first one, printable, at most 256 characters)."""
    for key, value in metadata or ():
        if key.lower() == CORRELATION_HEADER:
            text = value.decode("utf-8", "replace") if isinstance(value, bytes) else value
            text = "".join(ch for ch in text if ch.isprintable())[:_MAX_LENGTH]
            return text or NO_CORRELATION_ID
    return NO_CORRELATION_ID


def current_correlation_id() -> str | None:
    """The id bound to the current task, if any (read when the engine accepts a request)."""
    value = current_log_fields().get(CORRELATION_FIELD)
    return value if isinstance(value, str) else None


def request_log_extra(correlation: str | None, request_id: int) -> dict[str, Any]:
    """``extra=`` for an engine line about one request."""
    if correlation is None:
        return log_extra(request_id=request_id)
    return log_extra(**{CORRELATION_FIELD: correlation, "request_id": request_id})
