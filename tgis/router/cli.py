"""`text-generation-router`: TGIS's router flags (each also an env var) -> RouterConfig -> serve."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
from collections.abc import Mapping
from typing import Any

import click

from tgis.log import setup_logging
from tgis.router.config import (
    DEFAULT_OTLP_SERVICE_NAME,
    DEFAULT_SHUTDOWN_GRACE_S,
    DEFAULT_STEP_TIMEOUT_S,
    DEFAULT_STREAM_STALL_TIMEOUT_S,
    RouterConfig,
    TlsConfig,
    TracingConfig,
)
from tgis.termination import fail_startup

log = logging.getLogger(__name__)


def _default_tokenization_workers() -> int:
    return max(1, min((os.cpu_count() or 1) - 1, 8))


@click.command(context_settings={"show_default": True, "max_content_width": 100})
@click.option("--max-concurrent-requests", envvar="MAX_CONCURRENT_REQUESTS", default=512)
@click.option(
    "--max-sequence-length",
    "--max-total-tokens",
    "max_sequence_length",
    envvar=["MAX_SEQUENCE_LENGTH", "MAX_TOTAL_TOKENS"],
    default=2048,
    help="Input + output tokens of one request (--max-total-tokens is TGI's name).",
)
@click.option("--max-new-tokens", envvar="MAX_NEW_TOKENS", default=1024)
@click.option(
    "--max-batch-size",
    envvar="MAX_BATCH_SIZE",
    type=int,
    default=None,
    help="Most sequences in the running batch  [default: by capacity, as many as the KV "
    "cache holds, at most 256]",
)
@click.option("--max-prefill-padding", envvar="MAX_PREFILL_PADDING", default=0.2)
@click.option(
    "--max-waiting-tokens",
    envvar="MAX_WAITING_TOKENS",
    type=int,
    default=None,
    help="Steps after which queued requests join the running batch whatever their number "
    "(0: at the next step)  [default: with --waiting-served-ratio also unset, queued "
    "requests join at the next step (chunked prefill bounds their cost), else 24]",
)
@click.option(
    "--waiting-served-ratio",
    envvar="WAITING_SERVED_RATIO",
    type=float,
    default=None,
    help="Queued requests join a running batch of n sequences at once when at least "
    "floor(n × ratio) of them can  [default: 1.2 when --max-waiting-tokens is set]",
)
@click.option(
    "--max-batch-prefill-tokens",
    "--max-batch-tokens",
    "max_batch_prefill_tokens",
    envvar=["MAX_BATCH_PREFILL_TOKENS", "MAX_BATCH_TOKENS"],
    type=int,
    default=None,
    help="Prompt tokens computed per step; longer prompts are prefilled in chunks alongside "
    "the decodes  [default: 4096, or --max-batch-total-tokens if smaller]",
)
@click.option(
    "--max-batch-total-tokens",
    envvar="MAX_BATCH_TOTAL_TOKENS",
    type=int,
    default=None,
    help="KV tokens the running batch may hold  [default: the shard's capacity]",
)
@click.option(
    "--max-client-batch-size",
    envvar="MAX_CLIENT_BATCH_SIZE",
    type=int,
    default=None,
    help="Most inputs in one Generate call  [default: no limit]",
)
@click.option(
    "--max-input-tokens",
    envvar="MAX_INPUT_TOKENS",
    type=int,
    default=None,
    help="Longest input in tokens, after truncation  [default: max-sequence-length - 1]",
)
@click.option(
    "-p", "--port", envvar="PORT", default=3000, help="HTTP port (/health, /metrics, /v1)."
)
@click.option("-g", "--grpc-port", envvar="GRPC_PORT", default=8033)
@click.option(
    "--master-shard-uds-path",
    envvar="MASTER_SHARD_UDS_PATH",
    default="/tmp/text-generation-server-0",
)
@click.option("--tokenizer-path", envvar="TOKENIZER_PATH", required=True)
@click.option(
    "--model-name",
    envvar="MODEL_NAME",
    default="",
    help="The served model's name: the model id of the OpenAI routes.",
)
@click.option(
    "--model-dir",
    envvar="MODEL_DIR",
    default=None,
    help="The model's directory: chat_template.jinja and tokenizer_config.json are read there.",
)
@click.option(
    "--chat-template",
    envvar="CHAT_TEMPLATE",
    default=None,
    help="The chat template of /v1/chat/completions: a file, or the template itself "
    "(default: the model's).",
)
@click.option(
    "--api-key",
    envvar="API_KEY",
    default=None,
    help="A bearer token the /v1 routes require (default: none).",
)
@click.option(
    "--http-tls",
    envvar="HTTP_TLS",
    is_flag=True,
    help="Serve the HTTP port over TLS too, with --tls-cert-path and --tls-key-path.",
)
@click.option("--tokenization-workers", envvar="TOKENIZATION_WORKERS", type=int, default=None)
@click.option("--json-output", envvar="JSON_OUTPUT", is_flag=True)
@click.option("--tls-cert-path", envvar="TLS_CERT_PATH")
@click.option("--tls-key-path", envvar="TLS_KEY_PATH")
@click.option("--tls-client-ca-cert-path", envvar="TLS_CLIENT_CA_CERT_PATH")
@click.option("--output-special-tokens", envvar="OUTPUT_SPECIAL_TOKENS", is_flag=True)
@click.option(
    "--disable-prefix-caching",
    envvar="DISABLE_PREFIX_CACHING",
    is_flag=True,
    help="Compute every prompt in full (no reuse of cached KV blocks).",
)
@click.option(
    "--speculate",
    envvar="SPECULATE",
    type=click.IntRange(min=0),
    default=0,
    help="Speculative decoding: tokens drafted per sequence and step by prompt lookup (0: off).",
)
@click.option(
    "--speculator-max-batch-size",
    envvar="SPECULATOR_MAX_BATCH_SIZE",
    type=click.IntRange(min=1),
    default=16,
    help="Speculate while at most this many sequences run.",
)
@click.option(
    "--prompt-lookup-min", envvar="PROMPT_LOOKUP_MIN", type=click.IntRange(min=1), default=1
)
@click.option(
    "--prompt-lookup-max", envvar="PROMPT_LOOKUP_MAX", type=click.IntRange(min=1), default=3
)
@click.option("--default-include-stop-seqs", envvar="DEFAULT_INCLUDE_STOP_SEQS", is_flag=True)
@click.option(
    "--otlp-endpoint",
    envvar=["OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT"],
    help="OpenTelemetry OTLP/gRPC collector, e.g. http://otel-collector:4317 (needs "
    "`pip install 'tgis[otel]'`).",
)
@click.option(
    "--otlp-service-name",
    envvar="OTEL_SERVICE_NAME",
    default=DEFAULT_OTLP_SERVICE_NAME,
    help="service.name of the spans.",
)
@click.option(
    "--shutdown-grace-period",
    envvar="SHUTDOWN_GRACE_PERIOD",
    type=float,
    default=DEFAULT_SHUTDOWN_GRACE_S,
    help="Seconds in-flight requests may run after SIGTERM (new ones get UNAVAILABLE and "
    "health reports NOT_SERVING meanwhile).",
)
@click.option("--shard-connect-timeout", envvar="SHARD_CONNECT_TIMEOUT", default=60.0)
@click.option(
    "--pipeline-depth",
    envvar="TGIS_PIPELINE_DEPTH",
    type=int,
    default=2,
    help="Steps in flight: 2 plans and sends the next step while one runs (overlap); 1 is "
    "the serial loop (a reference for debugging).",
)
@click.option(
    "--step-timeout",
    envvar="TGIS_STEP_TIMEOUT",
    type=click.FloatRange(min=0.0, min_open=True),
    default=DEFAULT_STEP_TIMEOUT_S,
    help="Seconds the shard may take to answer one step; past them it is taken as hung: "
    "requests fail, the router exits non-zero and the launcher stops.",
)
@click.option(
    "--stream-stall-timeout",
    envvar="TGIS_STREAM_STALL_TIMEOUT",
    type=click.FloatRange(min=0.0, min_open=True),
    default=DEFAULT_STREAM_STALL_TIMEOUT_S,
    help="Seconds a streamed message may wait for a client that does not read; then the "
    "stream is cancelled, freeing its request and permit.",
)
def main(**flags: Any) -> None:
    """Serve fmaas.GenerationService, /health and /metrics in front of a running shard."""
    setup_logging(flags["json_output"], "router")
    try:
        config = router_config(flags)
    except ValueError as err:
        fail_startup(str(err))
    _serve(config)


_RENAMED = {"master_shard_uds_path": "shard_uds_path"}
"""Flags whose RouterConfig field has another name."""
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
"""Flags RouterConfig takes in another form."""


def router_config(flags: Mapping[str, Any]) -> RouterConfig:
    """The configuration from the parsed flags: most are RouterConfig fields of the same name.

    Raises:
        ValueError: inconsistent values (one line); TLS flags given without their partner
            end the process through ``fail_startup``, as TGIS's router does.
    """
    fields = {f.name for f in dataclasses.fields(RouterConfig)}
    same = {
        _RENAMED.get(name, name): value
        for name, value in flags.items()
        if name not in _BUILT and _RENAMED.get(name, name) in fields
    }
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
