"""Router composition root: connect to the shard, build the engine, serve gRPC and HTTP."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from tgis.pb import generation_pb2
from tgis.router.config import RouterConfig
from tgis.router.core.batching import new_scheduler, scheduler_limits
from tgis.router.core.block_allocator import blocks_for
from tgis.router.core.engine import Engine, ShardHungError
from tgis.router.core.shard_client import ShardClient
from tgis.router.edge.http_server import start_http_server
from tgis.router.edge.reflection import enable_reflection
from tgis.router.edge.servicer import GenerationServicer, add_generation_service
from tgis.router.edge.tls import CertificateReloader, TlsError
from tgis.router.intake.adapters import adapter_kinds
from tgis.router.intake.concurrency import ConcurrencyLimiter
from tgis.router.intake.prefixes import PrefixLengths
from tgis.router.intake.tokenization import RouterTokenizer
from tgis.router.intake.validation import ServerLimits
from tgis.router.ops.drain import Drain
from tgis.router.ops.health import LIVENESS_TEXT, GenerationHealth
from tgis.router.ops.metrics import Metrics
from tgis.router.ops.stalled_streams import StalledStreams
from tgis.router.ops.tracing import Tracing, setup_tracing

log = logging.getLogger(__name__)

SERVICE_NAME = generation_pb2.DESCRIPTOR.services_by_name["GenerationService"].full_name
_MAX_MESSAGE_BYTES = 64 * 1024 * 1024
STOP_GRACE_S = 2.0
"""After the drain: how long the gRPC server lets the RPCs left (Tokenize, health) end."""
TRACING_FLUSH_S = 3.0
"""At exit: how long buffered spans may take to reach the collector."""


class StartupError(Exception):
    """Configuration or environment problem found while starting; message is one line."""


def _bind(server: grpc.aio.Server, port: int, credentials: grpc.ServerCredentials | None) -> None:
    """Bind every interface, IPv6 and IPv4; TLS when configured (then no plaintext)."""
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


class Router:
    """Owns every long-lived router object; `run` serves until SIGTERM/SIGINT, then drains:
    health NOT_SERVING (gRPC) / 503 (HTTP) at once, new generation calls refused with
    UNAVAILABLE, the calls in flight given up to ``shutdown_grace_period`` seconds (a second
    signal cuts it short), then everything stops."""

    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.tokenizer = RouterTokenizer(config.tokenizer_path, workers=config.tokenization_workers)
        self.drain = Drain()
        self.tracing: Tracing | None = None
        self._serving = False
        self._health_update: asyncio.Future[None] | None = None

    async def run(self) -> None:
        config = self.config
        # grpc.aio objects bind to the running event loop: create them here, not in __init__.
        self.shard = ShardClient(config.shard_uds_path)
        self.tracing = setup_tracing(config.tracing)
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
        if info.adapters_enabled:
            log.info("adapters: enabled, up to %d LoRA adapters per step", info.max_loras)
        limits = scheduler_limits(config, info)
        scheduler = new_scheduler(limits, info)
        capacity = scheduler.allocator.num_blocks
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
            scheduler=scheduler,
            metrics=metrics,
            output_special_tokens=config.output_special_tokens,
            pipeline_depth=config.pipeline_depth,
            step_timeout=config.step_timeout,
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
            prefixes=PrefixLengths(self.shard.prefix_length, metrics),
            adapters=adapter_kinds(info, self.shard.adapter_info),
            drain=self.drain,
            tracing=self.tracing,
            stalled_streams=StalledStreams(config.stream_stall_timeout),
        )
        server = grpc.aio.server(
            options=[
                ("grpc.max_receive_message_length", _MAX_MESSAGE_BYTES),
                ("grpc.max_send_message_length", _MAX_MESSAGE_BYTES),
            ]
        )
        add_generation_service(servicer, server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health_servicer, server)
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        enable_reflection(
            server,
            (SERVICE_NAME, health.SERVICE_NAME),
            (generation_pb2.DESCRIPTOR, health_pb2.DESCRIPTOR),
        )
        credentials = None
        if config.tls is not None:
            try:
                credentials = CertificateReloader(config.tls).credentials()
            except TlsError as err:
                raise StartupError(str(err)) from err
        _bind(server, config.grpc_port, credentials)
        engine_task = engine.start()
        await server.start()
        log.info(
            "gRPC server started on port %d%s", config.grpc_port, " (TLS)" if config.tls else ""
        )
        health_check = GenerationHealth(
            engine, self.shard, tuple(self.tokenizer.encode(LIVENESS_TEXT))
        )
        http = await start_http_server(config.port, health_check, metrics, self.drain)
        log.info("HTTP server started on port %d", config.port)
        warmup = asyncio.create_task(health_check.generate_one_token())
        signals = _signal_event()
        signalled = asyncio.ensure_future(signals.wait())
        await asyncio.wait((signalled, engine_task), return_when=asyncio.FIRST_COMPLETED)
        signalled.cancel()
        warmup.cancel()
        hung = _hung_shard(engine_task)
        if hung is None:
            await self._drain(signals)
        else:  # the requests have failed already: let their calls end, then exit non-zero
            self.drain.start()
            await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
            await self.drain.wait_idle(STOP_GRACE_S)
        await server.stop(STOP_GRACE_S)
        await http.cleanup()
        await engine.stop()
        await self.shard.close()
        self.tokenizer.close()
        if self.tracing is not None:
            self.tracing.shutdown(TRACING_FLUSH_S)
        if hung is not None:
            raise hung
        log.info("router stopped")

    async def _drain(self, signals: asyncio.Event) -> None:
        """Refuse new work, report NOT_SERVING, wait for the calls in flight."""
        grace = self.config.shutdown_grace_period
        self.drain.start()
        await self.health_servicer.enter_graceful_shutdown()
        log.info(
            "shutting down: health NOT_SERVING, new requests refused, %d in flight given up "
            "to %g s",
            self.drain.active,
            grace,
        )
        signals.clear()
        idle = asyncio.ensure_future(self.drain.wait_idle(grace))
        again = asyncio.ensure_future(signals.wait())
        await asyncio.wait((idle, again), return_when=asyncio.FIRST_COMPLETED)
        again.cancel()
        if idle.done() and idle.result():
            log.info("in-flight requests finished")
            return
        idle.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await idle
        log.warning(
            "%d requests still in flight after %s: cancelling them",
            self.drain.active,
            "a second signal" if signals.is_set() else f"the {grace:g} s grace period",
        )

    def _mark_serving(self) -> None:
        if not self._serving:
            self._serving = True
            self._health_update = asyncio.ensure_future(
                self._set_health(health_pb2.HealthCheckResponse.SERVING)
            )

    async def _set_health(self, status: int) -> None:
        for name in ("", SERVICE_NAME):
            await self.health_servicer.set(name, status)


def _hung_shard(engine_task: asyncio.Task[None]) -> ShardHungError | None:
    """Why the engine stopped, when it did: the shard hung (the only way it ends alone)."""
    if not engine_task.done() or engine_task.cancelled():
        return None
    error = engine_task.exception()
    if isinstance(error, ShardHungError):
        return error
    if error is not None:
        raise error
    return None


def _signal_event() -> asyncio.Event:
    """An event set by each SIGTERM / SIGINT."""
    loop = asyncio.get_running_loop()
    event = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, event.set)
    return event
