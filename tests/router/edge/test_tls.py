"""TLS certificate reload (router/edge/tls.py): the files are re-read only when they changed, a
half-written rotation is not taken, and a real gRPC server hands new connections the new
certificate and client CA (mTLS) without a restart. With the launcher and an in-flight
stream: tests/e2e/test_operations_e2e.py."""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from tests.e2e.certs import Pki, SecretMount, make_pki, server_files
from tgis.router.config import TlsConfig
from tgis.router.edge.tls import CertificateReloader, TlsError


def tls_config(mount: SecretMount, client_ca: bool = False) -> TlsConfig:
    return TlsConfig(
        cert_path=str(mount.path("tls.crt")),
        key_path=str(mount.path("tls.key")),
        client_ca_path=str(mount.path("ca.crt")) if client_ca else None,
    )


@pytest.fixture(scope="module")
def pkis(tmp_path_factory: pytest.TempPathFactory) -> tuple[Pki, Pki]:
    root = tmp_path_factory.mktemp("pki")
    return make_pki(root / "one"), make_pki(root / "two")


def test_symlink_swap_is_picked_up_once(tmp_path: Path, pkis: tuple[Pki, Pki]) -> None:
    one, two = pkis
    mount = SecretMount(tmp_path / "secret", server_files(one))
    reloader = CertificateReloader(tls_config(mount))
    assert reloader.material.cert == one.server_cert.read_bytes()
    assert reloader.reload_if_changed() is None  # nothing changed: only stat calls
    mount.update(server_files(two))
    material = reloader.reload_if_changed()
    assert material is not None and material.cert == two.server_cert.read_bytes()
    assert reloader.fetch() is None  # taken already
    assert reloader.reloads == 1


def test_half_written_rotation_keeps_the_old_certificate(
    tmp_path: Path, pkis: tuple[Pki, Pki], caplog: pytest.LogCaptureFixture
) -> None:
    """Files rewritten in place, the certificate first: until the key matches it, the old
    pair stays in use (one warning), then the new pair is taken."""
    one, two = pkis
    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    cert.write_bytes(one.server_cert.read_bytes())
    key.write_bytes(one.server_key.read_bytes())
    reloader = CertificateReloader(TlsConfig(cert_path=str(cert), key_path=str(key)))
    cert.write_bytes(two.server_cert.read_bytes())
    with caplog.at_level(logging.WARNING, logger="tgis.router.edge.tls"):
        assert reloader.reload_if_changed() is None
        assert reloader.reload_if_changed() is None
    assert len(caplog.records) == 1
    assert "not usable yet" in caplog.records[0].getMessage()
    assert reloader.material.cert == one.server_cert.read_bytes()
    key.write_bytes(two.server_key.read_bytes())
    os.utime(key, ns=(1, 1))  # a different mtime even on a coarse clock
    material = reloader.reload_if_changed()
    assert material is not None and material.key == two.server_key.read_bytes()


def test_unusable_files_at_start(tmp_path: Path, pkis: tuple[Pki, Pki]) -> None:
    one, _ = pkis
    missing = str(tmp_path / "missing.pem")
    with pytest.raises(TlsError, match=r"^couldn't load cert from .*missing\.pem"):
        CertificateReloader(TlsConfig(cert_path=missing, key_path=str(one.server_key)))
    with pytest.raises(TlsError, match=r"^tls configuration error"):
        CertificateReloader(TlsConfig(cert_path=str(one.ca_cert), key_path=str(one.server_key)))
    with pytest.raises(TlsError, match="is not a PEM CA bundle"):
        CertificateReloader(
            TlsConfig(
                cert_path=str(one.server_cert),
                key_path=str(one.server_key),
                client_ca_path=str(one.server_key),
            )
        )


def _check(target: str, pki: Pki, client: Pki) -> grpc.StatusCode | int:
    """A health call on a new connection trusting ``pki``'s CA with ``client``'s cert."""
    credentials = grpc.ssl_channel_credentials(
        pki.ca_cert.read_bytes(), client.client_key.read_bytes(), client.client_cert.read_bytes()
    )
    options = [("grpc.use_local_subchannel_pool", 1)]
    with grpc.secure_channel(target, credentials, options=options) as channel:
        try:
            stub = health_pb2_grpc.HealthStub(channel)
            return int(stub.Check(health_pb2.HealthCheckRequest(), timeout=5).status)
        except grpc.RpcError as err:
            return err.code()


def test_mtls_server_certificate_and_client_ca_are_reloaded(
    tmp_path: Path, pkis: tuple[Pki, Pki]
) -> None:
    one, two = pkis
    mount = SecretMount(tmp_path / "secret", server_files(one, client_ca=True))
    reloader = CertificateReloader(tls_config(mount, client_ca=True))
    serving = int(health_pb2.HealthCheckResponse.SERVING)

    async def scenario() -> None:
        server = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
        port = server.add_secure_port("127.0.0.1:0", reloader.credentials())
        await server.start()
        target = f"127.0.0.1:{port}"
        loop = asyncio.get_running_loop()

        async def check(pki: Pki, client: Pki) -> grpc.StatusCode | int:
            return await loop.run_in_executor(None, _check, target, pki, client)

        try:
            assert await check(one, one) == serving
            assert await check(one, two) == grpc.StatusCode.UNAVAILABLE  # unknown client CA
            mount.update(server_files(two, client_ca=True))
            assert await check(two, two) == serving
            assert await check(one, one) == grpc.StatusCode.UNAVAILABLE  # old server CA
            assert await check(two, one) == grpc.StatusCode.UNAVAILABLE  # old client CA
        finally:
            await server.stop(0)

    asyncio.run(scenario())
    assert reloader.reloads == 1
