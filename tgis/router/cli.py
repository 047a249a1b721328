"""`text-generation-router`: TGIS's router flags (each also an env var) -> RouterConfig -> serve."""

from __future__ import annotations

import asyncio
import logging
import os

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
@click.option("-p", "--port", envvar="PORT", default=3000, help="HTTP port (/health, /metrics).")
@click.option("-g", "--grpc-port", envvar="GRPC_PORT", default=8033)
@click.option(
    "--master-shard-uds-path",
    envvar="MASTER_SHARD_UDS_PATH",
    default="/tmp/text-generation-server-0",
)
@click.option("--tokenizer-path", envvar="TOKENIZER_PATH", required=True)
@click.option("--model-name", envvar="MODEL_NAME", default="", help="For logs only.")
@click.option("--tokenization-workers", envvar="TOKENIZATION_WORKERS", type=int, default=None)
@click.option("--json-output", envvar="JSON_OUTPUT", is_flag=True)
@click.option("--tls-cert-path", envvar="TLS_CERT_PATH")
@click.option("--tls-key-path", envvar="TLS_KEY_PATH")
@click.option("--tls-client-ca-cert-path", envvar="TLS_CLIENT_CA_CERT_PATH")
@click.option("--output-special-tokens", envvar="OUTPUT_SPECIAL_TOKENS", is_flag=True)
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
def main(
    max_concurrent_requests: int,
    max_sequence_length: int,
    max_new_tokens: int,
    max_batch_size: int | None,
    max_prefill_padding: float,
    max_waiting_tokens: int | None,
    waiting_served_ratio: float | None,
    max_batch_prefill_tokens: int | None,
    max_batch_total_tokens: int | None,
    max_client_batch_size: int | None,
    max_input_tokens: int | None,
    port: int,
    grpc_port: int,
    master_shard_uds_path: str,
    tokenizer_path: str,
    model_name: str,
    tokenization_workers: int | None,
    json_output: bool,
    tls_cert_path: str | None,
    tls_key_path: str | None,
    tls_client_ca_cert_path: str | None,
    output_special_tokens: bool,
    default_include_stop_seqs: bool,
    otlp_endpoint: str | None,
    otlp_service_name: str,
    shutdown_grace_period: float,
    shard_connect_timeout: float,
    pipeline_depth: int,
    step_timeout: float,
    stream_stall_timeout: float,
) -> None:
    """Serve fmaas.GenerationService, /health and /metrics in front of a running shard."""
    setup_logging(json_output, "router")
    if bool(tls_cert_path) != bool(tls_key_path):
        fail_startup("tls: must provide both cert and key")
    if tls_client_ca_cert_path and not tls_cert_path:
        fail_startup("tls: cannot provide client ca cert without keypair")
    tls = None
    if tls_cert_path and tls_key_path:
        tls = TlsConfig(
            cert_path=tls_cert_path,
            key_path=tls_key_path,
            client_ca_path=tls_client_ca_cert_path or None,
        )
    try:
        config = RouterConfig(
            max_concurrent_requests=max_concurrent_requests,
            max_sequence_length=max_sequence_length,
            max_new_tokens=max_new_tokens,
            max_batch_size=max_batch_size,
            max_prefill_padding=max_prefill_padding,
            max_waiting_tokens=max_waiting_tokens,
            waiting_served_ratio=waiting_served_ratio,
            max_batch_prefill_tokens=max_batch_prefill_tokens,
            max_batch_total_tokens=max_batch_total_tokens,
            max_client_batch_size=max_client_batch_size,
            max_input_tokens=max_input_tokens,
            port=port,
            grpc_port=grpc_port,
            shard_uds_path=master_shard_uds_path,
            tokenizer_path=tokenizer_path,
            model_name=model_name,
            tokenization_workers=(
                _default_tokenization_workers()
                if tokenization_workers is None
                else tokenization_workers
            ),
            json_output=json_output,
            tls=tls,
            output_special_tokens=output_special_tokens,
            default_include_stop_seqs=default_include_stop_seqs,
            shard_connect_timeout=shard_connect_timeout,
            pipeline_depth=pipeline_depth,
            step_timeout=step_timeout,
            stream_stall_timeout=stream_stall_timeout,
            tracing=(
                TracingConfig(endpoint=otlp_endpoint, service_name=otlp_service_name)
                if otlp_endpoint
                else None
            ),
            shutdown_grace_period=shutdown_grace_period,
        )
    except ValueError as err:
        fail_startup(str(err))
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
