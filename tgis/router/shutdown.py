"""How the router stops: one drain for both protocols.

What asks for a stop (``StopRequests``): SIGTERM or SIGINT, each counted, and the end of the
launcher that started the router (``tgis/stop_requests.py``). The drain (``drain``):

1. at the first request, health turns NOT_SERVING (gRPC) and 503 (HTTP) at once, and new
   generation calls are refused on both APIs (``UNAVAILABLE`` / 503, "Server is shutting
   down"), so clients and Kubernetes go to another replica;
2. the calls in flight run on to their end, for up to ``--shutdown-grace-period`` seconds;
   a second signal, or the launcher's end, cuts this short at once;
3. every request still live is then ended by the engine (``Engine.close``) with a message
   that says why: a gRPC call ends with ``UNAVAILABLE`` and that message, an OpenAI stream
   with an error event in OpenAI's shape and no ``data: [DONE]``, a unary OpenAI call with
   503; the calls get ``END_WAIT_S`` to deliver that and return.

Then the server stops (``Router._stop``: whatever call is still open is cut after
``SERVER_STOP_S``) and the process exits 0.
"""

from __future__ import annotations

import asyncio
import logging

from tgis.router.core.engine import Engine
from tgis.router.edge.grpc_server import PublicGrpc
from tgis.router.ops.drain import SHUTTING_DOWN_MESSAGE, Drain
from tgis.stop_requests import ignore_stop_signals, on_stop_signals, wait_until_orphaned

__all__ = ["END_WAIT_S", "SERVER_STOP_S", "StopRequests", "drain"]

log = logging.getLogger(__name__)

END_WAIT_S = 3.0
"""After the engine has ended the calls left: how long they get to tell their clients."""
SERVER_STOP_S = 1.0
"""Then: how long the servers give what is still open (Tokenize, health, a stuck client)."""


class StopRequests:
    """SIGTERM / SIGINT (counted) and the launcher's end, seen from the event loop."""

    def __init__(self, launcher_pid: int | None) -> None:
        self.signals = 0
        self.orphaned = False
        self._changed = asyncio.Event()
        on_stop_signals(self._on_signal)
        self._watch = asyncio.ensure_future(self._watch_launcher(launcher_pid))

    def _on_signal(self) -> None:
        self.signals += 1
        self._changed.set()

    async def _watch_launcher(self, pid: int | None) -> None:
        await wait_until_orphaned(pid)
        log.warning("the launcher (pid %s) is gone: stopping now", pid)
        self.orphaned = True
        self._changed.set()

    @property
    def urgent(self) -> bool:
        """No more waiting: a second signal came, or the launcher is gone."""
        return self.signals >= 2 or self.orphaned

    @property
    def any(self) -> bool:
        return self.signals >= 1 or self.orphaned

    async def wait(self, urgent: bool = False) -> None:
        """Until a stop is asked for (``urgent``: an urgent one)."""
        while not (self.urgent if urgent else self.any):
            self._changed.clear()
            await self._changed.wait()

    def why_urgent(self) -> str:
        return "the launcher is gone" if self.orphaned else "a second signal"

    def close(self) -> None:
        """The drain is over: the process exits now, and a late signal (the launcher passes
        each one on) must not kill it on the way out."""
        self._watch.cancel()
        ignore_stop_signals()


async def drain(
    stops: StopRequests, drain: Drain, grpc: PublicGrpc, engine: Engine, grace: float
) -> None:
    """Steps 1-3 of the module's docstring."""
    drain.start()
    await grpc.enter_graceful_shutdown()
    log.info(
        "shutting down: health NOT_SERVING, new requests refused, %d in flight given up to %g s",
        drain.active,
        grace,
    )
    idle = asyncio.ensure_future(drain.wait_idle(grace))
    urgent = asyncio.ensure_future(stops.wait(urgent=True))
    await asyncio.wait((idle, urgent), return_when=asyncio.FIRST_COMPLETED)
    urgent.cancel()
    if idle.done() and idle.result():
        log.info("in-flight requests finished")
        return
    idle.cancel()
    why = stops.why_urgent() if stops.urgent else f"the {grace:g} s grace period"
    ended = engine.close(f"{SHUTTING_DOWN_MESSAGE}: the request was ended after {why}")
    log.warning("%d calls still in flight after %s: %d requests ended", drain.active, why, ended)
    if await drain.wait_idle(END_WAIT_S):
        log.info("every call ended")
    else:
        log.warning("%d calls did not end within %g s: cutting them", drain.active, END_WAIT_S)
