"""gRPC server TLS from PEM files, reloaded when the files change on disk.

cert-manager (or any Kubernetes Secret mount) rotates the mounted certificate in place:
kubelet writes the new files into a fresh ``..<timestamp>`` directory and swaps the ``..data``
symlink, so the paths stay the same while what they resolve to changes. grpcio asks the
``certificate_configuration_fetcher`` of ``grpc.dynamic_ssl_server_credentials`` before
every new TLS handshake; ours stats the files (following symlinks: device, inode, size,
mtime) and only when that changed reads them again, checks that they form a usable key
pair (and CA bundle), and hands grpcio the new configuration. Established connections, and
the streams on them, keep the session they negotiated. A half-written rotation (cert
replaced, key not yet) is not taken: the old certificate stays in use and the files are
tried again at the next handshake.
"""

from __future__ import annotations

import logging
import os
import ssl
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import grpc

from tgis.router.config import TlsConfig

log = logging.getLogger(__name__)

Fingerprint = tuple[tuple[int, int, int, int], ...]


class TlsError(Exception):
    """The files cannot be read or do not form a usable certificate (one line)."""


@dataclass(frozen=True, slots=True)
class TlsMaterial:
    cert: bytes
    key: bytes
    client_ca: bytes | None


def _paths(tls: TlsConfig) -> list[tuple[str, str]]:
    named = [("cert", tls.cert_path), ("key", tls.key_path)]
    if tls.client_ca_path:
        named.append(("client ca cert", tls.client_ca_path))
    return named


def fingerprint(tls: TlsConfig) -> Fingerprint:
    """What identifies the files' current versions; OSError if one is missing."""
    stats = (os.stat(path) for _, path in _paths(tls))
    return tuple((s.st_dev, s.st_ino, s.st_size, s.st_mtime_ns) for s in stats)


def load_material(tls: TlsConfig) -> TlsMaterial:
    """Read and check the PEM files; TlsError naming the file that is wrong."""
    data: dict[str, bytes] = {}
    for kind, path in _paths(tls):
        try:
            data[kind] = Path(path).read_bytes()
        except OSError as err:
            raise TlsError(f"couldn't load {kind} from {path}: {err.strerror}") from err
    _check_not_expired(tls.cert_path)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(tls.cert_path, tls.key_path)
    except (ssl.SSLError, OSError) as err:
        raise TlsError(
            f"tls configuration error: {tls.cert_path} and {tls.key_path} are not a matching "
            f"PEM certificate and key: {err}"
        ) from err
    client_ca = data.get("client ca cert")
    if client_ca is not None:
        try:
            context.load_verify_locations(cadata=client_ca.decode("ascii", "replace"))
        except (ssl.SSLError, ValueError) as err:
            raise TlsError(
                f"tls configuration error: {tls.client_ca_path} is not a PEM CA bundle: {err}"
            ) from err
    return TlsMaterial(cert=data["cert"], key=data["key"], client_ca=client_ca)


def _check_not_expired(cert_path: str) -> None:
    """TlsError when the certificate's validity has ended (clients would refuse it at every
    handshake). The stdlib decodes the PEM; a file it cannot decode is left to
    ``load_cert_chain``, which says what is wrong with it."""
    decode = getattr(ssl._ssl, "_test_decode_cert", None)  # type: ignore[attr-defined]
    if decode is None:
        return
    try:
        not_after = decode(cert_path)["notAfter"]
    except (ssl.SSLError, OSError, KeyError, ValueError):
        return
    if ssl.cert_time_to_seconds(not_after) <= time.time():
        raise TlsError(f"tls configuration error: certificate {cert_path} expired on {not_after}")


def _configuration(material: TlsMaterial) -> grpc.ServerCertificateConfiguration:
    return grpc.ssl_server_certificate_configuration(
        [(material.key, material.cert)], root_certificates=material.client_ca
    )


class CertificateReloader:
    """Serves the files' current certificate to every new connection."""

    def __init__(self, tls: TlsConfig) -> None:
        self.tls = tls
        self._lock = threading.Lock()
        try:
            self._fingerprint = fingerprint(tls)
        except OSError:
            self._fingerprint = ()
        self.material = load_material(tls)  # TlsError: a start-up error
        self._refused: Fingerprint | None = None
        self.reloads = 0

    def credentials(self) -> grpc.ServerCredentials:
        return grpc.dynamic_ssl_server_credentials(
            _configuration(self.material),
            self.fetch,
            require_client_authentication=self.tls.client_ca_path is not None,
        )

    def fetch(self) -> grpc.ServerCertificateConfiguration | None:
        """grpcio's fetcher (called before each handshake, from its own threads): a new
        configuration when the files changed and are usable, else None (keep the current
        one). Never raises: an exception would fail the handshake."""
        try:
            material = self.reload_if_changed()
        except Exception:
            log.exception("TLS certificate reload failed; keeping the current certificate")
            return None
        return None if material is None else _configuration(material)

    def reload_if_changed(self) -> TlsMaterial | None:
        """The new material when the files changed since the last load, else None."""
        with self._lock:
            try:
                current = fingerprint(self.tls)
            except OSError:
                return None  # mid-swap: a file is missing for a moment
            if current == self._fingerprint or current == self._refused:
                return None
            try:
                material = load_material(self.tls)
                if fingerprint(self.tls) != current:
                    return None  # changed while being read: try again next handshake
            except (TlsError, OSError) as err:
                self._refused = current
                log.warning("TLS files changed but are not usable yet, keeping the old: %s", err)
                return None
            self._fingerprint = current
            self._refused = None
            if material == self.material:
                return None
            self.material = material
            self.reloads += 1
            log.info("TLS certificate reloaded from %s", self.tls.cert_path)
            return material
