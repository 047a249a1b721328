"""The public gRPC server: fmaas.GenerationService, grpc.health.v1 and reflection on
``--grpc-port``, TLS (and mTLS) when configured.

The health status of both the overall server ("") and ``fmaas.GenerationService`` starts
``NOT_SERVING``; the router marks them ``SERVING`` once the model has produced its first
token, and ``enter_graceful_shutdown`` makes ``NOT_SERVING`` sticky while draining.
"""

from __future__ import annotations

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from tgis.pb import generation_pb2
from tgis.router.config import TlsConfig
from tgis.router.edge.reflection import enable_reflection
from tgis.router.edge.registration import (
    SERVICE_NAME,
    GenerationService,
    add_generation_service,
)
from tgis.router.edge.tls import CertificateReloader, TlsError
from tgis.router.errors import StartupError

__all__ = ["MAX_MESSAGE_BYTES", "PublicGrpc"]

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
"""Largest request or response message the public server takes."""


class PublicGrpc:
    """The server and its health service. Build it inside the running event loop (grpc.aio
    objects bind to it)."""

    def __init__(self, service: GenerationService) -> None:
        self.server = grpc.aio.server(
            options=[
                ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ]
        )
        self.health = health.aio.HealthServicer()
        add_generation_service(service, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        enable_reflection(
            self.server,
            (SERVICE_NAME, health.SERVICE_NAME),
            (generation_pb2.DESCRIPTOR, health_pb2.DESCRIPTOR),
        )

    async def set_serving(self, serving: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in ("", SERVICE_NAME):
            await self.health.set(name, status)

    async def enter_graceful_shutdown(self) -> None:
        """NOT_SERVING from now on, whatever ``set_serving`` is asked later."""
        await self.health.enter_graceful_shutdown()

    def bind(self, port: int, tls: TlsConfig | None, hostname: str | None = None) -> None:
        """Bind ``hostname`` (``--hostname``), else every interface, IPv6 and IPv4; TLS when
        configured (then no plaintext).

        Raises:
            StartupError: the certificate files are unusable, or the port cannot be bound
                on any interface (on ``hostname``).
        """
        credentials = None
        if tls is not None:
            try:
                credentials = CertificateReloader(tls).credentials()
            except TlsError as err:
                raise StartupError(str(err)) from err
        hosts = ("[::]", "0.0.0.0") if not hostname else (_address_host(hostname),)
        for host in hosts:
            address = f"{host}:{port}"
            try:
                bound = (
                    self.server.add_secure_port(address, credentials)
                    if credentials
                    else self.server.add_insecure_port(address)
                )
            except RuntimeError:
                bound = 0
            if bound:
                return
        where = f" on {hostname}" if hostname else ""
        raise StartupError(f"gRPC server could not bind port {port}{where}")


def _address_host(hostname: str) -> str:
    """``hostname`` as the host part of a gRPC address (an IPv6 address in brackets)."""
    if ":" in hostname and not hostname.startswith("["):
        return f"[{hostname}]"
    return hostname
