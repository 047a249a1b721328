"""TLS files that cannot serve fail the launcher at start, before any shard loads: one
line naming the file and what is wrong with it, a non-zero exit, the same line in the
termination log. The router checks the same things again at start and on every rotation
(``tgis/router/edge/tls.py: load_material``)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.e2e.certs import Pki, make_pki

from .helpers import RunLauncher


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


def garbage(tmp_path: Path) -> Path:
    path = tmp_path / "garbage.pem"
    path.write_text("-----BEGIN CERTIFICATE-----\nnot base64 at all\n-----END CERTIFICATE-----\n")
    return path


CASES: dict[str, tuple[Callable[[Pki, Path], list[str]], str]] = {
    "expired certificate": (
        lambda p, _: ["--tls-cert-path", str(p.expired_server_cert),
                      "--tls-key-path", str(p.expired_server_key)],
        "tls configuration error: certificate {cert} expired on ",
    ),
    "malformed certificate": (
        lambda p, t: ["--tls-cert-path", str(garbage(t)), "--tls-key-path", str(p.server_key)],
        "tls configuration error: {cert} and {key} are not a matching PEM certificate and key: ",
    ),
    "key of another certificate": (
        lambda p, _: ["--tls-cert-path", str(p.server_cert), "--tls-key-path", str(p.client_key)],
        "tls configuration error: {cert} and {key} are not a matching PEM certificate and key: ",
    ),
    "malformed client CA": (
        lambda p, t: ["--tls-cert-path", str(p.server_cert), "--tls-key-path", str(p.server_key),
                      "--tls-client-ca-cert-path", str(garbage(t))],
        "tls configuration error: {ca} is not a PEM CA bundle: ",
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_unusable_tls_files_fail_at_start_in_one_line(
    run_launcher: RunLauncher, model_dir: Path, tmp_path: Path, pki: Pki, case: str
) -> None:
    make_args, template = CASES[case]
    args = make_args(pki, tmp_path)
    named = dict(zip(args[::2], args[1::2], strict=True))
    expected = template.format(
        cert=named["--tls-cert-path"],
        key=named["--tls-key-path"],
        ca=named.get("--tls-client-ca-cert-path"),
    )
    run = run_launcher(["--model-name", str(model_dir), *args])
    assert run.returncode != 0
    assert run.error_line.startswith(expected), run.error_line
    assert "\n" not in run.error_line
    assert run.termination_log is not None and expected in run.termination_log
    assert "Shard 0" not in run.stdout + run.stderr  # refused before any shard started
