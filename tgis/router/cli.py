"""`text-generation-router`: the settings the router reads (``tgis/settings``: flags, each
also an env var) -> RouterConfig -> serve."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Mapping
from typing import Any

import click

from tgis.log import setup_logging
from tgis.router.config import RouterConfig, TlsConfig, TracingConfig
from tgis.settings.declaration import Process
from tgis.settings.options import setting_options, version_option
from tgis.termination import fail_startup

log = logging.getLogger(__name__)


def _default_tokenization_workers() -> int:
    return max(1, min((os.cpu_count() or 1) - 1, 8))


@click.command(context_settings={"show_default": True, "max_content_width": 100})
@setting_options(Process.ROUTER)
@version_option()
def main(**flags: Any) -> None:
    """Serve fmaas.GenerationService, /health and /metrics in front of a running shard."""
    setup_logging(flags["json_output"], "router")
    try:
        config = router_config(flags)
    except ValueError as err:
        fail_startup(str(err))
    _serve(config)


_BUILT = frozenset(
    {
        "tokenization_workers",  # a default by CPU count
        "tls_cert_path",  # the three TLS flags -> tls
        "tls_key_path",
        "tls_client_ca_cert_path",
        "otlp_endpoint",  # the two OTLP flags -> tracing
        "otlp_service_name",
    }
)
"""Settings RouterConfig takes in another form."""


def router_config(flags: Mapping[str, Any]) -> RouterConfig:
    """The configuration from the parsed flags: each a RouterConfig field of the same name,
    but for the few built into another form (``_BUILT``).

    Raises:
        ValueError: inconsistent values (one line); TLS flags given without their partner
            end the process through ``fail_startup``, as TGIS's router does.
    """
    same = {name: value for name, value in flags.items() if name not in _BUILT}
    workers = flags["tokenization_workers"]
    return RouterConfig(
        **same,
        tokenization_workers=_default_tokenization_workers() if workers is None else workers,
        tls=_tls(flags["tls_cert_path"], flags["tls_key_path"], flags["tls_client_ca_cert_path"]),
        tracing=(
            TracingConfig(endpoint=flags["otlp_endpoint"], service_name=flags["otlp_service_name"])
            if flags["otlp_endpoint"]
            else None
        ),
    )


def _tls(cert: str | None, key: str | None, client_ca: str | None) -> TlsConfig | None:
    if bool(cert) != bool(key):
        fail_startup("tls: must provide both cert and key")
    if client_ca and not cert:
        fail_startup("tls: cannot provide client ca cert without keypair")
    if not (cert and key):
        return None
    return TlsConfig(cert_path=cert, key_path=key, client_ca_path=client_ca or None)


def _serve(config: RouterConfig) -> None:
    """Run the router until it stops; start-up failures end the process with one line."""
    from tgis.router.core.engine import ShardHungError
    from tgis.router.core.shard_client import ShardError
    from tgis.router.errors import StartupError
    from tgis.router.server import Router

    try:
        asyncio.run(Router(config).run())
    except StartupError as err:
        fail_startup(str(err))
    except ShardError as err:
        fail_startup(f"Could not connect to server: {err.detail}")
    except ShardHungError as err:
        fail_startup(str(err))
    except OSError as err:  # e.g. the HTTP port is taken
        log.debug("fatal error", exc_info=True)
        fail_startup(f"{type(err).__name__}: {err}")
    # Anything else is a bug: tgis.log's hook logs its traceback (one record) and writes
    # the termination log.
