"""The router's composition root: connect to the shard, build the pieces, serve gRPC and
HTTP until SIGTERM/SIGINT (or the launcher's end), drain (``shutdown.py``), stop.

Built once per process, in this order: the shard client (``core/shard_client.py``) and the
shard's facts, the start-up checks (``startup.py``), the scheduler with its budgets and KV
capacity (``core/batching.py``), the metrics, the engine (``core/engine.py``), the intake
(``intake/admission.py``), the servicer with its replies and call gate (``edge/``), the
public gRPC server (``edge/grpc_server.py``) and the HTTP app (``edge/http_server.py``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import ssl
from pathlib import Path

from aiohttp import web

from tgis.router import shutdown, startup
from tgis.router.config import RouterConfig
from tgis.router.core.batching import scheduler_limits
from tgis.router.core.engine import Engine, ShardHungError
from tgis.router.core.request_state import OutputRules
from tgis.router.core.scheduler import new_scheduler
from tgis.router.core.shard_client import ShardClient
from tgis.router.core.speculation import SpeculationConfig
from tgis.router.edge.calls import CallGate
from tgis.router.edge.cors import Cors
from tgis.router.edge.grpc_server import PublicGrpc
from tgis.router.edge.health import LIVENESS_TEXT, GenerationHealth
from tgis.router.edge.http_server import Routes, start_http_server
from tgis.router.edge.openai_replies import OpenAIReplies
from tgis.router.edge.openai_routes import OpenAIRoutes
from tgis.router.edge.openai_tool_parsers import guess_tool_call_parser
from tgis.router.edge.replies import Replies
from tgis.router.edge.servicer import GenerationServicer
from tgis.router.edge.tgi_replies import TGIReplies, server_info
from tgis.router.edge.tgi_routes import TGIRoutes
from tgis.router.edge.tracing import Tracing, setup_tracing
from tgis.router.errors import StartupError
from tgis.router.intake.adapters import adapter_kinds
from tgis.router.intake.admission import Admission
from tgis.router.intake.chat_template import ChatTemplateError, load_chat_template
from tgis.router.intake.concurrency import ConcurrencyLimiter
from tgis.router.intake.guided import GrammarCompiler
from tgis.router.intake.prefixes import PrefixInfos
from tgis.router.intake.tokenization import RouterTokenizer
from tgis.router.intake.validation import ServerLimits
from tgis.router.ops.drain import Drain
from tgis.router.ops.metrics import Metrics
from tgis.router.ops.stalled_streams import StalledStreams
from tgis.router.shutdown import StopRequests
from tgis.shard_api.messages import ShardInfo
from tgis.stop_requests import launcher_pid

log = logging.getLogger(__name__)

TRACING_FLUSH_S = 3.0
"""At exit: how long buffered spans may take to reach the collector."""


class Router:
    """Owns every long-lived router object; `run` serves until SIGTERM/SIGINT (or the
    launcher's end), then drains (``shutdown.py``) and stops."""

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
        self.shard = ShardClient(config.master_shard_uds_path)
        self.tracing = setup_tracing(config.tracing)
        info = await self._connect()
        metrics = Metrics(
            max_sequence_length=config.max_sequence_length,
            max_new_tokens=config.effective_max_new_tokens,
            max_batch_size=config.effective_max_batch_size,
        )
        engine = self._engine(info, metrics)
        admission = self._admission(metrics, info)
        replies = Replies(tokenizer=self.tokenizer, metrics=metrics, is_seq2seq=info.is_seq2seq)
        calls = CallGate(self.drain, self.tracing)
        self.grpc = PublicGrpc(self._servicer(engine, admission, replies, calls))
        await self.grpc.set_serving(False)
        self.grpc.bind(config.grpc_port, config.tls, config.hostname)
        engine_task = engine.start()
        await self.grpc.server.start()
        log.info(
            "gRPC server started on port %d%s", config.grpc_port, " (TLS)" if config.tls else ""
        )
        health_check = GenerationHealth(
            engine, self.shard, tuple(self.tokenizer.encode(LIVENESS_TEXT))
        )
        routes = self._http_routes(engine, admission, replies, calls, info)
        http = await start_http_server(
            config.port,
            config.hostname,
            health_check,
            metrics,
            self.drain,
            routes,
            self._http_ssl(),
            stop_timeout=shutdown.SERVER_STOP_S,
        )
        log.info(
            "HTTP server started on port %d%s", config.port, " (TLS)" if config.http_tls else ""
        )
        hung = await self._serve(engine, engine_task, health_check)
        await self._stop(http, engine)
        if hung is not None:
            raise hung
        log.info("router stopped")

    # ---- start-up -----------------------------------------------------------------------------

    async def _connect(self) -> ShardInfo:
        """Wait for the shard, reset it and read its facts."""
        await self.shard.wait_ready(self.config.shard_connect_timeout)
        await self.shard.reset()
        info = await self.shard.info()
        startup.log_shard(info)
        return info

    def _engine(self, info: ShardInfo, metrics: Metrics) -> Engine:
        config = self.config
        limits = scheduler_limits(config, info)
        scheduler = new_scheduler(
            limits, info, not config.disable_prefix_caching, speculation_config(config)
        )
        capacity = scheduler.blocks.num_blocks
        startup.check_capacity(config, info, capacity)
        startup.log_batching(limits, capacity, info)
        startup.log_prefix_caching(not config.disable_prefix_caching, info)
        startup.log_speculation(speculation_config(config), info)
        startup.warn_adjusted_limits(config)
        engine = Engine(
            shard=self.shard,
            scheduler=scheduler,
            output=OutputRules.for_shard(self.tokenizer, info, config.output_special_tokens),
            metrics=metrics,
            pipeline_depth=config.pipeline_depth,
            step_timeout=config.step_timeout,
        )
        engine.on_token_generated = self._mark_serving
        return engine

    def _admission(self, metrics: Metrics, info: ShardInfo) -> Admission:
        config = self.config
        return Admission(
            tokenizer=self.tokenizer,
            limits=ServerLimits.from_args(
                config.max_sequence_length,
                config.max_new_tokens,
                max_input_tokens=config.max_input_tokens,
                max_client_batch_size=config.max_client_batch_size,
                max_stop_sequences=config.max_stop_sequences,
                max_top_n_tokens=config.max_top_n_tokens,
                max_best_of=config.max_best_of,
            ),
            limiter=ConcurrencyLimiter(config.max_concurrent_requests),
            metrics=metrics,
            prefixes=PrefixInfos(self.shard.prefix_info, metrics),
            adapters=adapter_kinds(info, self.shard.adapter_info),
            grammars=(
                GrammarCompiler(
                    self.tokenizer.to_json, info.vocab_size, info.eos_token_ids, metrics
                )
                if info.eos_token_ids
                else None
            ),
            vocab_size=info.vocab_size,
        )

    def _servicer(
        self, engine: Engine, admission: Admission, replies: Replies, calls: CallGate
    ) -> GenerationServicer:
        return GenerationServicer(
            admission=admission,
            engine=engine,
            replies=replies,
            calls=calls,
            default_include_stop_seqs=self.config.default_include_stop_seqs,
            stalled_streams=StalledStreams(self.config.stream_stall_timeout),
        )

    def _http_routes(
        self,
        engine: Engine,
        admission: Admission,
        replies: Replies,
        calls: CallGate,
        info: ShardInfo,
    ) -> tuple[Routes, ...]:
        """The HTTP port's route families, OpenAI's and TGI's, and CORS over them when
        --cors-allow-origin names origins."""
        config = self.config
        kv_tokens = engine.scheduler.blocks.num_blocks * info.block_size
        tgi = TGIRoutes(
            admission=admission,
            engine=engine,
            replies=TGIReplies(replies, self.tokenizer),
            gate=calls,
            info=server_info(config, info, admission.limits, kv_tokens),
            api_key=config.api_key or None,
        )
        routes: list[Routes] = [self._openai_routes(engine, admission, replies, calls), tgi]
        if config.cors_allow_origin:
            log.info("CORS: origins allowed: %s", ", ".join(config.cors_allow_origin))
            routes.append(Cors(config.cors_allow_origin))
        return tuple(routes)

    def _openai_routes(
        self, engine: Engine, admission: Admission, replies: Replies, calls: CallGate
    ) -> OpenAIRoutes:
        """The /v1 routes; StartupError when the chat template given cannot be read."""
        config = self.config
        model_dir = Path(config.model_dir) if config.model_dir else None
        try:
            template = load_chat_template(config.chat_template, model_dir)
        except ChatTemplateError as err:
            raise StartupError(f"chat template: {err}") from None
        parser = config.tool_call_parser or guess_tool_call_parser(
            None if template is None else template.source
        )
        if template is None:
            log.info("No chat template: /v1/chat/completions refuses requests")
        else:
            log.info("Chat template from %s; tool calls read as %s", template.origin, parser)
        return OpenAIRoutes(
            admission=admission,
            engine=engine,
            replies=OpenAIReplies(replies, self.tokenizer, config.served_model_name),
            gate=calls,
            chat_template=template,
            api_key=config.api_key or None,
            tool_call_parser=parser,
        )

    def _http_ssl(self) -> ssl.SSLContext | None:
        """The HTTP port's TLS context (--http-tls): the gRPC port's cert and key."""
        tls = self.config.tls
        if not self.config.http_tls or tls is None:
            return None
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        try:
            context.load_cert_chain(tls.cert_path, tls.key_path)
        except (OSError, ssl.SSLError) as err:
            raise StartupError(f"--http-tls: {err}") from None
        return context

    def _mark_serving(self) -> None:
        if not self._serving:
            self._serving = True
            self._health_update = asyncio.ensure_future(self.grpc.set_serving(True))

    # ---- serving and shutdown -----------------------------------------------------------------

    async def _serve(
        self, engine: Engine, engine_task: asyncio.Task[None], health_check: GenerationHealth
    ) -> ShardHungError | None:
        """Serve until a stop is asked for (then drain: ``shutdown.py``) or until the shard
        hangs (then let the failed calls end); returns the hang, if that is why."""
        warmup = asyncio.create_task(health_check.generate_one_token())
        stops = StopRequests(launcher_pid(os.environ))
        asked = asyncio.ensure_future(stops.wait())
        await asyncio.wait((asked, engine_task), return_when=asyncio.FIRST_COMPLETED)
        asked.cancel()
        warmup.cancel()
        hung = _hung_shard(engine_task)
        try:
            if hung is None:
                grace = self.config.shutdown_grace_period
                await shutdown.drain(stops, self.drain, self.grpc, engine, grace)
            else:  # the requests have failed already: let their calls end, then exit non-zero
                self.drain.start()
                await self.grpc.set_serving(False)
                await self.drain.wait_idle(shutdown.END_WAIT_S)
        finally:
            stops.close()
        return hung

    async def _stop(self, http: web.AppRunner, engine: Engine) -> None:
        await asyncio.gather(self.grpc.server.stop(shutdown.SERVER_STOP_S), http.cleanup())
        await engine.stop()
        await self.shard.close()
        self.tokenizer.close()
        if self.tracing is not None:
            self.tracing.shutdown(TRACING_FLUSH_S)


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


def speculation_config(config: RouterConfig) -> SpeculationConfig | None:
    """``--speculate`` and its policy flags (None: off)."""
    if config.speculate < 1:
        return None
    return SpeculationConfig(
        tokens=config.speculate,
        max_batch_size=config.speculator_max_batch_size,
        min_ngram=config.prompt_lookup_min,
        max_ngram=max(config.prompt_lookup_min, config.prompt_lookup_max),
        always=config.speculate_always,
    )
