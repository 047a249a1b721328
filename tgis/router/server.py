"""Router composition root: connect to the shard, build the engine, serve gRPC and HTTP."""

from __future__ import annotations

import asyncio
import logging
import signal
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from tgis.pb import generation_pb2, generation_pb2_grpc
from tgis.router.block_allocator import blocks_for
from tgis.router.concurrency import ConcurrencyLimiter
from tgis.router.config import RouterConfig, TlsConfig
from tgis.router.engine import Engine
from tgis.router.generation_service import GenerationServicer
from tgis.router.health import LIVENESS_TEXT, GenerationHealth
from tgis.router.http_server import start_http_server
from tgis.router.metrics import Metrics
from tgis.router.scheduler import SchedulerLimits, kv_capacity_blocks
from tgis.router.shard_client import ShardClient
from tgis.router.tokenization import RouterTokenizer
from tgis.router.validation import ServerLimits
from tgis.shard_api.messages import ShardInfo

log = logging.getLogger(__name__)

SERVICE_NAME = generation_pb2.DESCRIPTOR.services_by_name["GenerationService"].full_name
_MAX_MESSAGE_BYTES = 64 * 1024 * 1024
SHUTDOWN_GRACE_S = 30.0


class StartupError(Exception):
    """Configuration or environment problem found while starting; message is one line."""


def _server_credentials(tls: TlsConfig) -> grpc.ServerCredentials:
    def read(kind: str, path: str) -> bytes:
        try:
            return Path(path).read_bytes()
        except OSError as err:
            raise StartupError(f"couldn't load {kind} from {path}: {err.strerror}") from err

    cert = read("cert", tls.cert_path)
    key = read("key", tls.key_path)
    client_ca = read("client ca cert", tls.client_ca_path) if tls.client_ca_path else None
    return grpc.ssl_server_credentials(
        [(key, cert)], root_certificates=client_ca, require_client_auth=client_ca is not None
    )


def _bind(server: grpc.aio.Server, port: int, tls: TlsConfig | None) -> None:
    """Bind every interface, IPv6 and IPv4; TLS when configured (then no plaintext)."""
    credentials = _server_credentials(tls) if tls else None
    for host in ("[::]", "0.0.0.0"):
        address = f"{host}:{port}"
        try:
            bound = (
                server.add_secure_port(address, credentials)
                if credentials
                else server.add_insecure_port(address)
            )
        except RuntimeError:
            bound = 0
        if bound:
            return
    raise StartupError(f"gRPC server could not bind port {port}")


def scheduler_limits(config: RouterConfig, info: ShardInfo) -> SchedulerLimits:
    """The scheduler's budgets from the flags (capacity comes from the shard)."""
    max_waiting_tokens, waiting_served_ratio = config.joining_rule
    return SchedulerLimits(
        max_batch_size=config.effective_max_batch_size,
        max_batch_prefill_tokens=config.prefill_budget(on_cpu=info.device == "cpu"),
        max_batch_total_tokens=config.max_batch_total_tokens,
        max_waiting_tokens=max_waiting_tokens,
        waiting_served_ratio=waiting_served_ratio,
        preemption=not info.is_seq2seq,
    )


class Router:
    """Owns every long-lived router object; `run` serves until SIGTERM/SIGINT."""

    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.tokenizer = RouterTokenizer(config.tokenizer_path, workers=config.tokenization_workers)
        self._serving = False
        self._health_update: asyncio.Future[None] | None = None

    async def run(self) -> None:
        config = self.config
        # grpc.aio objects bind to the running event loop: create them here, not in __init__.
        self.shard = ShardClient(config.shard_uds_path)
        self.health_servicer = health.aio.HealthServicer()
        await self.shard.wait_ready(config.shard_connect_timeout)
        await self.shard.reset()
        info = await self.shard.info()
        log.info(
            "shard: %s on %s (%s, %s attention), %d KV blocks of %d tokens, %d rank(s)",
            info.model_type,
            info.device,
            info.dtype,
            info.attention_backend,
            info.num_blocks,
            info.block_size,
            info.world_size,
        )
        limits = scheduler_limits(config, info)
        capacity = kv_capacity_blocks(limits, info)
        needed = blocks_for(config.max_sequence_length, info.block_size)
        if needed > capacity:
            raise StartupError(
                f"The provided max_sequence length ({config.max_sequence_length}) needs "
                f"{needed} KV blocks, more than the KV capacity ({capacity} blocks of "
                f"{info.block_size} tokens)"
            )
        total = config.max_batch_total_tokens
        if total is not None and blocks_for(total, info.block_size) > info.num_blocks:
            log.warning(
                "max_batch_total_tokens (%d) is more than the shard's KV capacity (%d tokens)",
                total,
                info.num_blocks * info.block_size,
            )
        log.info(
            "batching: up to %d sequences and %d KV tokens, %d prompt tokens per step, "
            "max_waiting_tokens %d, waiting_served_ratio %g, %s",
            limits.max_batch_size,
            capacity * info.block_size,
            limits.max_batch_prefill_tokens,
            limits.max_waiting_tokens,
            limits.waiting_served_ratio,
            "worst case reserved (encoder-decoder)" if info.is_seq2seq else "preemption",
        )
        if config.max_new_tokens >= config.max_sequence_length:
            log.warning(
                "adjusting max_new_tokens (%d) down to max_sequence_length - 1 (%d)",
                config.max_new_tokens,
                config.max_sequence_length - 1,
            )
        metrics = Metrics(
            max_sequence_length=config.max_sequence_length,
            max_new_tokens=config.effective_max_new_tokens,
            max_batch_size=config.effective_max_batch_size,
        )
        engine = Engine(
            shard=self.shard,
            info=info,
            tokenizer=self.tokenizer,
            limits=limits,
            metrics=metrics,
            output_special_tokens=config.output_special_tokens,
            pipeline_depth=config.pipeline_depth,
        )
        engine.on_token_generated = self._mark_serving
        servicer = GenerationServicer(
            engine=engine,
            tokenizer=self.tokenizer,
            limits=ServerLimits.from_args(
                config.max_sequence_length,
                config.max_new_tokens,
                max_input_tokens=config.max_input_tokens,
                max_client_batch_size=config.max_client_batch_size,
            ),
            limiter=ConcurrencyLimiter(config.max_concurrent_requests),
            metrics=metrics,
            default_include_stop_seqs=config.default_include_stop_seqs,
            is_seq2seq=info.is_seq2seq,
        )
        server = grpc.aio.server(
            options=[
                ("grpc.max_receive_message_length", _MAX_MESSAGE_BYTES),
                ("grpc.max_send_message_length", _MAX_MESSAGE_BYTES),
            ]
        )
        generation_pb2_grpc.add_GenerationServiceServicer_to_server(servicer, server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health_servicer, server)
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server
        )
        _bind(server, config.grpc_port, config.tls)
        engine.start()
        await server.start()
        log.info(
            "gRPC server started on port %d%s", config.grpc_port, " (TLS)" if config.tls else ""
        )
        health_check = GenerationHealth(
            engine, self.shard, tuple(self.tokenizer.encode(LIVENESS_TEXT))
        )
        http = await start_http_server(config.port, health_check, metrics)
        log.info("HTTP server started on port %d", config.port)
        warmup = asyncio.create_task(health_check.generate_one_token())
        await _wait_for_signal()
        log.info("shutting down: draining in-flight requests")
        warmup.cancel()
        await http.cleanup()
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        await server.stop(SHUTDOWN_GRACE_S)
        await engine.stop()
        await self.shard.close()
        self.tokenizer.close()
        log.info("router stopped")

    def _mark_serving(self) -> None:
        if not self._serving:
            self._serving = True
            self._health_update = asyncio.ensure_future(
                self._set_health(health_pb2.HealthCheckResponse.SERVING)
            )

    async def _set_health(self, status: int) -> None:
        for name in ("", SERVICE_NAME):
            await self.health_servicer.set(name, status)


async def _wait_for_signal() -> None:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
