"""Plain HTTP on --port: GET /health (200 empty / 503 JSON), GET /metrics (Prometheus text),
the OpenAI-compatible ``/v1`` routes (``openai_routes.py``), HF TGI's REST routes
(``tgi_routes.py``) and, with ``--cors-allow-origin``, CORS on all of them (``cors.py``).

While the router drains after SIGTERM, /health answers 503 ``{"error":"shutting down"}`` at
once (no generation check), so Kubernetes stops routing to the pod before it exits.
"""

from __future__ import annotations

import logging
import ssl
from collections.abc import Sequence
from typing import Protocol

from aiohttp import web

from tgis.router.edge.health import GenerationHealth, HealthTimeoutError
from tgis.router.edge.http_bodies import MAX_BODY_BYTES
from tgis.router.ops.drain import Drain
from tgis.router.ops.metrics import Metrics

log = logging.getLogger(__name__)

# Always the 0.0.4 text format, whatever the scraper's Accept header asks for: in OpenMetrics
# a counter family `x` owns the sample `x_total`, so the plain-name twin `x` that TGIS's
# dashboards query (metrics.py: DualCounter) could not be expressed there.
_PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"


class Routes(Protocol):
    """A family of routes (``OpenAIRoutes``, ``TGIRoutes``) or what applies to them all
    (``cors.py: Cors``), added to the app."""

    def add_to(self, app: web.Application) -> None: ...


def build_app(
    health: GenerationHealth,
    metrics: Metrics,
    drain: Drain | None = None,
    routes: Sequence[Routes] = (),
) -> web.Application:
    async def get_health(_: web.Request) -> web.Response:
        if drain is not None and drain.draining:
            return web.json_response({"error": "shutting down"}, status=503)
        try:
            healthy = await health.check()
        except HealthTimeoutError:
            return web.json_response({"error": "Healthcheck timed-out"}, status=503)
        if healthy:
            return web.Response(status=200)
        return web.json_response({"error": "unhealthy"}, status=503)

    async def get_metrics(_: web.Request) -> web.Response:
        return web.Response(body=metrics.render(), headers={"Content-Type": _PROMETHEUS_TEXT})

    app = web.Application(client_max_size=MAX_BODY_BYTES)
    app.router.add_get("/health", get_health)
    app.router.add_get("/metrics", get_metrics)
    for family in routes:
        family.add_to(app)
    return app


async def start_http_server(
    port: int,
    host: str | None,
    health: GenerationHealth,
    metrics: Metrics,
    drain: Drain | None = None,
    routes: Sequence[Routes] = (),
    ssl_context: ssl.SSLContext | None = None,
    stop_timeout: float = 1.0,
) -> web.AppRunner:
    """Listen on ``host`` (``--hostname``), else on every interface, IPv4 and IPv6 (TGIS
    binds 0.0.0.0 only). A handler is cancelled when its client disconnects, which frees
    its requests at once, and when it is still running ``stop_timeout`` seconds into the
    runner's ``cleanup``."""
    app = build_app(health, metrics, drain, routes)
    runner = web.AppRunner(
        app, access_log=None, handler_cancellation=True, shutdown_timeout=stop_timeout
    )
    await runner.setup()
    host = host.strip("[]") if host else None  # an IPv6 address may come in brackets
    site = web.TCPSite(runner, host=host, port=port, ssl_context=ssl_context)
    await site.start()
    return runner
