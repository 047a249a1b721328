"""What every HTTP route family reads off a request the same way: its JSON body, within the
size limit, and its bearer token. Each family words the refusal in its own shape
(``refuse(status, message)``)."""

from __future__ import annotations

import hmac
import json
from collections.abc import Callable

from aiohttp import web

__all__ = ["MAX_BODY_BYTES", "bearer_matches", "read_json"]

MAX_BODY_BYTES = 32 * 1024 * 1024
"""The largest request body accepted (413 beyond; ``http_server.py`` sets it on the app)."""

Refuse = Callable[[int, str], Exception]


async def read_json(request: web.Request, refuse: Refuse) -> object:
    """The body as JSON; ``refuse(413, ...)`` past the size limit, ``refuse(400, ...)`` for
    a body that cannot be read as its headers say, that is not JSON, or that is nested too
    deeply to be read."""
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise refuse(413, f"the request body is larger than {MAX_BODY_BYTES} bytes") from None
    except web.RequestPayloadError as err:
        # aiohttp could not decode the body as its headers describe it (a Content-Encoding
        # of gzip or deflate over bytes that are not, a broken chunked encoding)
        cause = err.__cause__ if err.__cause__ is not None else err
        reason = " ".join(str(cause).split()).removeprefix("400, message: ")
        raise refuse(400, f"the request body could not be read: {reason}") from None
    try:
        return json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise refuse(400, f"the request body is not valid JSON: {err}") from None
    except RecursionError:
        raise refuse(400, "the request body is nested too deeply") from None


def bearer_matches(request: web.Request, key: str) -> bool:
    """Whether the request's ``Authorization: Bearer <token>`` is ``key`` (compared in
    constant time)."""
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key.encode())
