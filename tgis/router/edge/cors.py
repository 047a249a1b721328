"""Cross-origin requests on the HTTP port (``--cors-allow-origin``, TGI's flag): browsers'
pages from the origins allowed may call every route.

A preflight (``OPTIONS`` with ``Access-Control-Request-Method``) from an allowed origin is
answered 204 with the methods (GET, POST) and headers (``Content-Type``, ``Authorization``,
``X-Correlation-Id``) allowed; from another origin, 403. Every response to an allowed
origin, streams included (the headers are added as the response is prepared), carries
``Access-Control-Allow-Origin``. ``*`` allows every origin. With no origin given nothing is
added, and browsers refuse cross-origin calls (as TGI without the flag).
"""

from __future__ import annotations

from collections.abc import Iterable

from aiohttp import web
from aiohttp.typedefs import Handler

__all__ = ["Cors", "allowed_origins"]

ALLOW_ORIGIN = "Access-Control-Allow-Origin"
ALLOWED_METHODS = "GET, POST, OPTIONS"
ALLOWED_HEADERS = "Content-Type, Authorization, X-Correlation-Id"
PREFLIGHT_MAX_AGE_S = 600


def allowed_origins(value: str | Iterable[str] | None) -> tuple[str, ...]:
    """The origins of ``--cors-allow-origin``: comma-separated (or several values), blanks
    around them and empty ones dropped, each once, in order."""
    if value is None:
        return ()
    values = [value] if isinstance(value, str) else list(value)
    parts = (part.strip() for v in values for part in v.split(","))
    return tuple(dict.fromkeys(p for p in parts if p))


class Cors:
    """The CORS rules of one app: ``add_to`` installs its middleware (preflights) and its
    hook that adds the header to every response."""

    def __init__(self, origins: Iterable[str]) -> None:
        self.origins = frozenset(origins)
        self.any = "*" in self.origins

    def add_to(self, app: web.Application) -> None:
        app.middlewares.append(self.preflight)
        app.on_response_prepare.append(self.add_headers)

    def allowed(self, request: web.Request) -> str | None:
        """The value of ``Access-Control-Allow-Origin`` for ``request`` (None: not allowed,
        or no ``Origin``)."""
        origin = request.headers.get("Origin")
        if origin is None or not (self.any or origin in self.origins):
            return None
        return "*" if self.any else origin

    @web.middleware
    async def preflight(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.method != "OPTIONS" or "Access-Control-Request-Method" not in request.headers:
            return await handler(request)
        if self.allowed(request) is None:
            return web.json_response({"error": "origin not allowed"}, status=403)
        headers = {
            "Access-Control-Allow-Methods": ALLOWED_METHODS,
            "Access-Control-Allow-Headers": ALLOWED_HEADERS,
            "Access-Control-Max-Age": str(PREFLIGHT_MAX_AGE_S),
        }
        return web.Response(status=204, headers=headers)

    async def add_headers(self, request: web.Request, response: web.StreamResponse) -> None:
        origin = self.allowed(request)
        if origin is None:
            return
        response.headers[ALLOW_ORIGIN] = origin
        if origin != "*":
            response.headers.add("Vary", "Origin")
