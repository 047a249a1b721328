"""--hostname (TGI's flag): both ports listen on that address alone; unset, on every
interface. A port held on 127.0.0.1 alone leaves it free on 127.0.0.2 (another loopback
address), which a port held on every interface does not."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import pytest
from aiohttp import ClientSession

from tgis.procinfo import free_port
from tgis.router.edge.grpc_server import PublicGrpc, _address_host
from tgis.router.edge.http_server import start_http_server
from tgis.router.errors import StartupError


def bindable(host: str, port: int) -> bool:
    """Whether another socket may bind ``host:port`` now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


class _Service:
    """What registration needs of a GenerationService (no call is made here)."""

    metrics = None

    async def Generate(self, *_: Any) -> None: ...

    async def GenerateStream(self, *_: Any) -> None: ...

    async def Tokenize(self, *_: Any) -> None: ...

    async def ModelInfo(self, *_: Any) -> None: ...


def test_grpc_listens_on_the_hostname_alone() -> None:
    async def run() -> None:
        only, everywhere = free_port(), free_port()
        server = PublicGrpc(service=_Service())  # type: ignore[arg-type]
        server.bind(only, None, "127.0.0.1")
        server.bind(everywhere, None, None)
        await server.server.start()
        try:
            assert not bindable("127.0.0.1", only) and bindable("127.0.0.2", only)
            assert not bindable("127.0.0.2", everywhere)
        finally:
            await server.server.stop(None)

    asyncio.run(run())


def test_grpc_refuses_an_address_it_cannot_bind() -> None:
    async def run() -> None:
        server = PublicGrpc(service=_Service())  # type: ignore[arg-type]
        port = free_port()
        with pytest.raises(StartupError, match=f"could not bind port {port} on 192.0.2.1$"):
            server.bind(port, None, "192.0.2.1")  # TEST-NET-1: no interface has it

    asyncio.run(run())


@pytest.mark.parametrize(
    ("hostname", "host"),
    [("::1", "[::1]"), ("[::1]", "[::1]"), ("0.0.0.0", "0.0.0.0"), ("localhost", "localhost")],
)
def test_ipv6_addresses_are_bracketed_for_grpc(hostname: str, host: str) -> None:
    assert _address_host(hostname) == host


class _Health:
    async def check(self, *_: Any) -> bool:
        return True


def test_http_listens_on_the_hostname_alone() -> None:
    async def run() -> None:
        port = free_port()
        runner = await start_http_server(port, "127.0.0.1", _Health(), None)  # type: ignore[arg-type]
        try:
            assert not bindable("127.0.0.1", port) and bindable("127.0.0.2", port)
            url = f"http://127.0.0.1:{port}/health"
            async with ClientSession() as session, session.get(url) as reply:
                assert reply.status == 200
        finally:
            await runner.cleanup()

    asyncio.run(run())
