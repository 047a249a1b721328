"""TGI's routes in process (``edge/tgi_routes.py``, ``tgi_replies.py``) over the real
admission and a scripted engine whose requests go through the real ``RequestState``
(detokenizer, stop checker): the bodies and events in TGI's shapes (details, prefill, top
tokens, special tokens, ``POST /`` as a list), ``/tokenize`` and ``/info``; every refusal's
status and ``{"error", "error_type"}`` (422, 424, 429, 503, 401, 413); the metrics; and CORS
on every route, streams included."""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from tests.prometheus_tools import parse_exposition
from tgis.embedded_model import MODEL_DIR
from tgis.router.core.request_state import InputTokensEvent, OutputRules, RequestState
from tgis.router.edge.calls import CallGate
from tgis.router.edge.cors import Cors
from tgis.router.edge.http_server import build_app
from tgis.router.edge.replies import Replies
from tgis.router.edge.tgi_replies import TGIReplies
from tgis.router.edge.tgi_routes import TGIRoutes
from tgis.router.errors import GenerationError, UnavailableError
from tgis.router.intake.admission import Admission
from tgis.router.intake.concurrency import ConcurrencyLimiter
from tgis.router.intake.tokenization import RouterTokenizer
from tgis.router.intake.validation import ServerLimits
from tgis.router.ops.drain import Drain
from tgis.router.ops.metrics import Metrics
from tgis.router.request_types import ValidatedRequest
from tgis.shard_api.messages import TokenDetail, TopToken

EOS = 2
TEXT = " Hello wörld"
ORIGIN = "https://ui.example"


class ScriptedEngine:
    """Generates ``TEXT`` then EOS for every request, through the real request state; with
    ``fail_after`` set, fails with a GenerationError after that many tokens."""

    def __init__(self, tokenizer: RouterTokenizer) -> None:
        self.rules = OutputRules(tokenizer, (EOS,))
        self.ids = [*tokenizer.encode_batch([TEXT], add_special_tokens=False)[0], EOS]
        self.fail_after: int | None = None
        self.failure: Exception = GenerationError("the shard fell over")
        self.aborted: list[RequestState] = []
        self.submitted: list[ValidatedRequest] = []

    def submit(self, request: ValidatedRequest, arrival: float) -> RequestState:
        self.submitted.append(request)
        state = self.rules.new_state(len(self.submitted), request, arrival)
        state.started_at = arrival
        response = request.params.response
        if response.input_tokens:
            prompt = [TokenDetail(i, -1.5) for i in request.input_ids]
            prompt[0] = TokenDetail(request.input_ids[0], math.nan)
            state.emit(InputTokensEvent(tuple(prompt)))
        for n, token_id in enumerate(self.ids):
            if n == self.fail_after:
                state.emit(self.failure)
                return state
            tops = tuple(TopToken(t, -0.5 - k) for k, t in enumerate((token_id, 5, 6)))
            detail = TokenDetail(token_id, -0.25 * (n + 1), 0, tops[: response.top_n_tokens])
            event, done = state.accept_token(detail, arrival)
            if event is not None:
                state.emit(event)
            if done:
                break
        return state

    def abort(self, state: RequestState) -> None:
        self.aborted.append(state)


class Healthy:
    async def check(self) -> bool:
        return True


class Server:
    def __init__(self, client: TestClient, engine: ScriptedEngine, admission: Admission) -> None:
        self.client = client
        self.engine = engine
        self.admission = admission
        self.drain: Drain = Drain()

    async def post(self, path: str, body: Any, **headers: str) -> tuple[int, Any, Any]:
        response = await self.client.post(path, json=body, headers=headers)
        return response.status, await response.json(), response.headers

    async def events(self, path: str, body: Any) -> list[dict[str, Any]]:
        response = await self.client.post(path, json=body, headers={"Origin": ORIGIN})
        assert response.status == 200
        assert response.headers["Content-Type"] == "text/event-stream"
        assert response.headers["Access-Control-Allow-Origin"] == ORIGIN
        text = await response.text()
        chunks = [c for c in text.split("\n\n") if c]
        assert all(c.startswith("data:{") for c in chunks), chunks
        return [json.loads(c.removeprefix("data:")) for c in chunks]

    def failures(self, err: str) -> float:
        exposition = parse_exposition(self.admission.metrics.render().decode())
        return exposition.value("tgi_request_failure", err=err) or 0


Scenario = Callable[[Server], Awaitable[None]]


def serve(scenario: Scenario, *, api_key: str | None = None, permits: int = 4) -> None:
    async def main() -> None:
        async with running(api_key, permits) as server:
            await scenario(server)

    asyncio.run(main())


class running:
    """The app with TGI's routes and CORS for ``ORIGIN``, on a test server."""

    def __init__(self, api_key: str | None, permits: int) -> None:
        self.api_key = api_key
        self.permits = permits

    async def __aenter__(self) -> Server:
        self.tokenizer = RouterTokenizer(str(MODEL_DIR / "tokenizer.json"))
        metrics = Metrics(max_sequence_length=64, max_new_tokens=40, max_batch_size=4)
        admission = Admission(
            tokenizer=self.tokenizer,
            limits=ServerLimits.from_args(64, 40, max_top_n_tokens=3),
            limiter=ConcurrencyLimiter(self.permits),
            metrics=metrics,
        )
        engine = ScriptedEngine(self.tokenizer)
        drain = Drain()
        replies = Replies(tokenizer=self.tokenizer, metrics=metrics, is_seq2seq=False)
        routes = TGIRoutes(
            admission=admission,
            engine=engine,  # type: ignore[arg-type]
            replies=TGIReplies(replies, self.tokenizer),
            gate=CallGate(drain),
            info={"model_id": "tiny", "max_best_of": 1},
            api_key=self.api_key,
        )
        app = build_app(Healthy(), metrics, drain, (routes, Cors((ORIGIN,))))  # type: ignore[arg-type]
        self.client = TestClient(TestServer(app))
        await self.client.start_server()
        server = Server(self.client, engine, admission)
        server.drain = drain
        return server

    async def __aexit__(self, *_: object) -> None:
        await self.client.close()
        self.tokenizer.close()


def token_texts(tokenizer_ids: list[int]) -> list[str]:
    tokenizer = RouterTokenizer(str(MODEL_DIR / "tokenizer.json"))
    try:
        return [tokenizer.decode([i], skip_special_tokens=False) for i in tokenizer_ids]
    finally:
        tokenizer.close()


def test_generate_answers_tgis_shape() -> None:
    async def scenario(server: Server) -> None:
        status, body, headers = await server.post("/generate", {"inputs": "Hi"})
        assert status == 200 and body == {"generated_text": TEXT}
        assert headers["x-generated-tokens"] == str(len(server.engine.ids))
        assert headers["x-prompt-tokens"] == str(len(server.engine.submitted[0].input_ids))
        # POST /: the same answer in a list, as TGI's; return_full_text puts the prompt first.
        params = {"return_full_text": True, "max_new_tokens": 3}
        status, listed, _ = await server.post("/", {"inputs": "Hi", "parameters": params})
        assert status == 200 and isinstance(listed, list) and len(listed) == 1
        prefix = server.engine.rules.tokenizer.decode(server.engine.ids[:3])  # type: ignore[attr-defined]
        assert listed[0] == {"generated_text": "Hi" + prefix}
        assert server.engine.submitted[-1].stopping.max_new_tokens == 3
        assert len(server.engine.aborted) == 2  # every request ends however it ended
        assert server.admission.limiter.in_use == 0

    serve(scenario)


def test_details_prefill_and_top_tokens() -> None:
    async def scenario(server: Server) -> None:
        params = {"details": True, "decoder_input_details": True, "top_n_tokens": 2, "seed": 9}
        status, body, _ = await server.post("/generate", {"inputs": "Hi", "parameters": params})
        assert status == 200
        details = body["details"]
        ids = server.engine.ids
        assert body["generated_text"] == TEXT
        assert details["finish_reason"] == "eos_token"
        assert details["generated_tokens"] == len(ids)
        assert details["seed"] is None  # greedy: no seed
        prompt = server.engine.submitted[0].input_ids
        assert [t["id"] for t in details["prefill"]] == list(prompt)
        assert [t["text"] for t in details["prefill"]] == token_texts(list(prompt))
        assert details["prefill"][0]["logprob"] is None  # the first prompt token's NaN
        assert all(t["logprob"] == -1.5 for t in details["prefill"][1:])
        tokens = details["tokens"]
        assert [t["id"] for t in tokens] == ids
        assert [t["logprob"] for t in tokens] == [-0.25 * (n + 1) for n in range(len(ids))]
        # The texts add up to generated_text; the special EOS shows its own text.
        assert "".join(t["text"] for t in tokens if not t["special"]) == TEXT
        assert tokens[-1] == {
            "id": EOS,
            "text": "</s>",
            "logprob": tokens[-1]["logprob"],
            "special": True,
        }
        assert [t["special"] for t in tokens[:-1]] == [False] * (len(ids) - 1)
        tops = details["top_tokens"]
        assert len(tops) == len(ids) and all(len(t) == 2 for t in tops)
        assert tops[0][1] == {
            "id": 5,
            "text": token_texts([5])[0],
            "logprob": -1.5,
            "special": False,
        }
        sampled = {"details": True, "do_sample": True, "seed": 9}
        _, body, _ = await server.post("/generate", {"inputs": "Hi", "parameters": sampled})
        assert body["details"]["seed"] == 9 and body["details"]["prefill"] == []
        assert "top_tokens" not in body["details"]

    serve(scenario)


def test_generate_stream_is_one_event_per_token() -> None:
    async def scenario(server: Server) -> None:
        body = {"inputs": "Hi", "parameters": {"details": True, "top_n_tokens": 1}}
        events = await server.events("/generate_stream", body)
        ids = server.engine.ids
        assert [e["index"] for e in events] == list(range(1, len(ids) + 1))
        assert [e["token"]["id"] for e in events] == ids
        assert all(e["generated_text"] is None and e["details"] is None for e in events[:-1])
        assert all(len(e["top_tokens"]) == 1 for e in events)
        last = events[-1]
        assert last["generated_text"] == TEXT
        assert last["details"] == {
            "finish_reason": "eos_token",
            "generated_tokens": len(ids),
            "input_length": len(server.engine.submitted[0].input_ids),
            "seed": None,
        }
        assert "".join(e["token"]["text"] for e in events if not e["token"]["special"]) == TEXT
        # Without details: no details on the last event, no top tokens; POST / streams too.
        plain = await server.events("/", {"inputs": "Hi", "stream": True})
        assert [e["token"]["id"] for e in plain] == ids and "top_tokens" not in plain[0]
        assert plain[-1]["details"] is None and plain[-1]["generated_text"] == TEXT
        assert all(isinstance(e["token"]["logprob"], float) for e in plain)
        # A stop sequence ends it, and stays in the text (TGI's).
        stop = {"inputs": "Hi", "parameters": {"stop": ["llo"], "details": True}}
        stopped = await server.events("/generate_stream", stop)
        assert stopped[-1]["generated_text"] == " Hello"
        assert stopped[-1]["details"]["finish_reason"] == "stop_sequence"
        # max_new_tokens: finish reason length.
        short = {"inputs": "Hi", "parameters": {"max_new_tokens": 2, "details": True}}
        ended = await server.events("/generate_stream", short)
        assert len(ended) == 2 and ended[-1]["details"]["finish_reason"] == "length"

    serve(scenario)


def test_refusals_have_tgis_statuses_and_shape() -> None:
    async def scenario(server: Server) -> None:
        status, body, _ = await server.post(
            "/generate", {"inputs": "Hi", "parameters": {"best_of": 2}}
        )
        assert status == 422 and body["error_type"] == "validation"
        assert body["error"].startswith("Input validation error: `best_of` > 1")
        # TGIS's own validation, in TGI's shape.
        too_many = {"inputs": "Hi", "parameters": {"max_new_tokens": 41}}
        status, body, _ = await server.post("/generate", too_many)
        assert (status, body) == (
            422,
            {
                "error": "Input validation error: max_new_tokens must be <= 40",
                "error_type": "validation",
            },
        )
        # --max-top-n-tokens, checked at admission as for every API.
        top_n = {"inputs": "Hi", "parameters": {"details": True, "top_n_tokens": 4}}
        status, body, _ = await server.post("/generate", top_n)
        assert (status, body["error"]) == (
            422,
            "Input validation error: top_n_tokens (4) must be <= 3",
        )
        response = await server.client.post("/generate", data=b"{not json")
        assert response.status == 422
        assert (await response.json())["error"].startswith(
            "Input validation error: the request body is not valid JSON"
        )
        response = await server.client.post("/generate", data=b"x" * (33 * 1024 * 1024))
        assert response.status == 413
        assert (await response.json())["error_type"] == "validation"
        assert server.failures("validation") == 5
        # A failure during generation: 424 unary; an error event once a stream has begun.
        server.engine.fail_after = 2
        status, body, _ = await server.post("/generate", {"inputs": "Hi"})
        assert status == 424 and body == {
            "error": "Request failed during generation: the shard fell over",
            "error_type": "generation",
        }
        events = await server.events("/generate_stream", {"inputs": "Hi"})
        assert [e["index"] for e in events[:-1]] == [1, 2]
        assert events[-1] == body
        assert server.failures("generate") == 2
        # The drain's end (Engine.close) ends a live stream with an event saying why.
        server.engine.failure = UnavailableError("Server is shutting down: ended")
        events = await server.events("/generate_stream", {"inputs": "Hi"})
        assert events[-1] == {
            "error": "Server is shutting down: ended",
            "error_type": "unavailable",
        }
        status, body, _ = await server.post("/generate", {"inputs": "Hi"})
        assert (status, body["error_type"]) == (503, "unavailable")
        server.engine.fail_after = None
        # No permit left: 429; draining: 503 (and /info is still answered).
        assert server.admission.limiter.try_acquire(4)
        status, body, _ = await server.post("/generate_stream", {"inputs": "Hi"})
        assert (status, body) == (429, {"error": "Model is overloaded", "error_type": "overloaded"})
        server.admission.limiter.release(4)
        assert server.failures("conc_limit") == 1
        server.drain.start()
        status, body, _ = await server.post("/", {"inputs": "Hi"})
        assert (status, body) == (
            503,
            {"error": "Server is shutting down", "error_type": "unavailable"},
        )
        assert (await server.client.get("/info")).status == 200

    serve(scenario, permits=4)


def test_the_api_key_guards_the_generation_routes_not_info() -> None:
    async def scenario(server: Server) -> None:
        for path in ("/generate", "/generate_stream", "/", "/tokenize"):
            status, body, _ = await server.post(path, {"inputs": "Hi"})
            assert (status, body) == (401, {"error": "Unauthorized", "error_type": "authorization"})
        status, body, _ = await server.post("/generate", {"inputs": "Hi"}, Authorization="Bearer k")
        assert status == 200 and body["generated_text"] == TEXT
        response = await server.client.get("/info")
        assert response.status == 200 and await response.json() == {
            "model_id": "tiny",
            "max_best_of": 1,
        }

    serve(scenario, api_key="k")


def test_tokenize_answers_ids_texts_and_character_offsets() -> None:
    async def scenario(server: Server) -> None:
        status, tokens, _ = await server.post("/tokenize", {"inputs": "héllo wörld"})
        assert status == 200
        tokenizer = server.admission.tokenizer
        encoding = tokenizer.tokenizer.encode("héllo wörld", add_special_tokens=True)
        assert [t["id"] for t in tokens] == encoding.ids and tokens[0]["id"] == 1  # BOS
        assert tokens[0] == {"id": 1, "text": "", "start": 0, "stop": 0}
        assert tokens[1] == {"id": encoding.ids[1], "text": "h", "start": 0, "stop": 1}
        assert tokens[2]["text"] == "é" and (tokens[2]["start"], tokens[2]["stop"]) == (1, 2)
        body = {"inputs": "héllo wörld", "parameters": {"truncate": 3}, "add_special_tokens": False}
        _, truncated, _ = await server.post("/tokenize", body)
        assert [t["id"] for t in truncated] == encoding.ids[-3:]
        status, body, _ = await server.post("/tokenize", {"inputs": ""})
        assert status == 422 and body["error_type"] == "validation"

    serve(scenario)


def test_cors_preflights_and_headers() -> None:
    async def scenario(server: Server) -> None:
        client = server.client
        preflight = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST"}
        response = await client.options("/generate", headers=preflight)
        assert response.status == 204
        assert response.headers["Access-Control-Allow-Origin"] == ORIGIN
        assert "POST" in response.headers["Access-Control-Allow-Methods"]
        assert "Authorization" in response.headers["Access-Control-Allow-Headers"]
        other = {"Origin": "https://evil.example", "Access-Control-Request-Method": "POST"}
        response = await client.options("/generate", headers=other)
        assert response.status == 403 and "Access-Control-Allow-Origin" not in response.headers
        # Every route: health, metrics, refusals and answers alike; not for other origins.
        for method, path in (("GET", "/health"), ("GET", "/metrics"), ("GET", "/info")):
            response = await client.request(method, path, headers={"Origin": ORIGIN})
            assert response.headers["Access-Control-Allow-Origin"] == ORIGIN, path
            assert response.headers["Vary"] == "Origin"
        response = await client.post("/generate", json={"inputs": ""}, headers={"Origin": ORIGIN})
        assert response.status == 422 and response.headers["Access-Control-Allow-Origin"] == ORIGIN
        response = await client.get("/info", headers={"Origin": "https://evil.example"})
        assert "Access-Control-Allow-Origin" not in response.headers
        response = await client.get("/info")
        assert "Access-Control-Allow-Origin" not in response.headers

    serve(scenario)


def test_any_origin() -> None:
    async def main() -> None:
        async def get_info(_: web.Request) -> web.Response:
            return web.json_response({})

        app = web.Application()
        app.router.add_get("/info", get_info)
        Cors(("*",)).add_to(app)
        async with TestClient(TestServer(app)) as client:
            response = await client.get("/info", headers={"Origin": "https://any.example"})
            assert response.headers["Access-Control-Allow-Origin"] == "*"
            assert "Vary" not in response.headers

    asyncio.run(main())
