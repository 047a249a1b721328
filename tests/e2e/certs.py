"""Test-time PKI: a CA, a server certificate for 127.0.0.1/localhost, a client certificate;
and a directory laid out like a Kubernetes Secret mount, for certificate rotation."""

from __future__ import annotations

import datetime
import ipaddress
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class Pki:
    ca_cert: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    other_ca_cert: Path
    expired_server_cert: Path  # signed by the CA, validity ended yesterday
    expired_server_key: Path
    other_client_cert: Path  # a client certificate signed by the unrelated CA
    other_client_key: Path


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write_key(key: ec.EllipticCurvePrivateKey, path: Path) -> None:
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )


def _ca(common_name: str) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = _key()
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(common_name))
        .issuer_name(_name(common_name))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(key, hashes.SHA256())
    )
    return cert, key


def _leaf(
    common_name: str,
    ca: tuple[x509.Certificate, ec.EllipticCurvePrivateKey],
    usage: x509.ObjectIdentifier,
    server: bool,
    expired: bool = False,
) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = _key()
    now = datetime.datetime.now(datetime.UTC)
    if expired:
        now -= datetime.timedelta(days=2)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(common_name))
        .issuer_name(ca[0].subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    )
    if server:
        builder = builder.add_extension(
            x509.SubjectAlternativeName(
                [
                    x509.DNSName("localhost"),
                    x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                    x509.IPAddress(ipaddress.ip_address("::1")),
                ]
            ),
            critical=False,
        )
    return builder.sign(ca[1], hashes.SHA256()), key


def make_pki(directory: Path) -> Pki:
    directory.mkdir(parents=True, exist_ok=True)
    ca = _ca("tgis test CA")
    server = _leaf("localhost", ca, ExtendedKeyUsageOID.SERVER_AUTH, server=True)
    client = _leaf("tgis test client", ca, ExtendedKeyUsageOID.CLIENT_AUTH, server=False)
    other_ca = _ca("unrelated CA")
    expired = _leaf("localhost", ca, ExtendedKeyUsageOID.SERVER_AUTH, server=True, expired=True)
    other_client = _leaf("other client", other_ca, ExtendedKeyUsageOID.CLIENT_AUTH, server=False)
    paths = Pki(
        ca_cert=directory / "ca.pem",
        server_cert=directory / "server.pem",
        server_key=directory / "server.key",
        client_cert=directory / "client.pem",
        client_key=directory / "client.key",
        other_ca_cert=directory / "other-ca.pem",
        expired_server_cert=directory / "expired-server.pem",
        expired_server_key=directory / "expired-server.key",
        other_client_cert=directory / "other-client.pem",
        other_client_key=directory / "other-client.key",
    )
    pem = serialization.Encoding.PEM
    paths.ca_cert.write_bytes(ca[0].public_bytes(pem))
    paths.server_cert.write_bytes(server[0].public_bytes(pem))
    _write_key(server[1], paths.server_key)
    paths.client_cert.write_bytes(client[0].public_bytes(pem))
    _write_key(client[1], paths.client_key)
    paths.other_ca_cert.write_bytes(other_ca[0].public_bytes(pem))
    paths.expired_server_cert.write_bytes(expired[0].public_bytes(pem))
    _write_key(expired[1], paths.expired_server_key)
    paths.other_client_cert.write_bytes(other_client[0].public_bytes(pem))
    _write_key(other_client[1], paths.other_client_key)
    return paths


class SecretMount:
    """A directory laid out as kubelet mounts a Secret (its atomic writer): the files live in
    a timestamped ``..<version>`` directory, ``..data`` links to it, and each visible name
    (``tls.crt``) links to ``..data/<name>``. ``update`` swaps in a new version the way
    kubelet does when cert-manager renews the certificate: the paths never change."""

    def __init__(self, directory: Path, files: dict[str, bytes]) -> None:
        self.directory = directory
        self._version = 0
        directory.mkdir(parents=True, exist_ok=True)
        self.update(files)
        for name in files:
            (directory / name).symlink_to(Path("..data") / name)

    def path(self, name: str) -> Path:
        return self.directory / name

    def update(self, files: dict[str, bytes]) -> None:
        self._version += 1
        old = (self.directory / "..data").resolve() if self._version > 1 else None
        version = self.directory / f"..2026_01_01_00_00_{self._version:02d}.{os.getpid()}"
        version.mkdir()
        for name, data in files.items():
            (version / name).write_bytes(data)
        staging = self.directory / "..data_tmp"
        staging.symlink_to(version.name)
        os.replace(staging, self.directory / "..data")  # the atomic swap
        if old is not None:
            shutil.rmtree(old)


def server_files(pki: Pki, client_ca: bool = False) -> dict[str, bytes]:
    """A Secret's data as cert-manager writes it: tls.crt, tls.key, and ca.crt."""
    files = {"tls.crt": pki.server_cert.read_bytes(), "tls.key": pki.server_key.read_bytes()}
    if client_ca:
        files["ca.crt"] = pki.ca_cert.read_bytes()
    return files
