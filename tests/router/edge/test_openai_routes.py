"""The OpenAI routes in process (``edge/openai_routes.py`` and its replies) over the real
admission and a scripted engine whose requests go through the real ``RequestState``: ``n``
choices in OpenAI's order with their own seeds and usage, ``echo`` with the prompt's
logprobs and ``max_tokens: 0``, tool calls in replies and streams (the stream's deltas
reassemble into the unary reply), and a stream's ``text_offset`` running on from chunk to
chunk."""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from aiohttp.test_utils import TestClient, TestServer

from tgis.embedded_model import MODEL_DIR
from tgis.router.core.request_state import InputTokensEvent, OutputRules, RequestState
from tgis.router.edge.calls import CallGate
from tgis.router.edge.http_server import build_app
from tgis.router.edge.openai_replies import OpenAIReplies
from tgis.router.edge.openai_routes import OpenAIRoutes
from tgis.router.edge.replies import Replies
from tgis.router.intake.admission import Admission
from tgis.router.intake.chat_template import ChatTemplate
from tgis.router.intake.concurrency import ConcurrencyLimiter
from tgis.router.intake.guided import GrammarCompiler
from tgis.router.intake.tokenization import RouterTokenizer
from tgis.router.intake.validation import ServerLimits
from tgis.router.ops.drain import Drain
from tgis.router.ops.metrics import Metrics
from tgis.router.request_types import ValidatedRequest
from tgis.shard_api.messages import TokenDetail, TopToken

EOS = 2
TEMPLATE = Path(__file__).parents[2] / "data" / "chat_templates" / "hermes_tools.jinja"
CALL = 'Sure.<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>'
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]


class ScriptedEngine:
    """Generates ``text`` then EOS for every request (up to its max_new_tokens), through
    the real request state; the prompt's details first when asked for (the first one's
    logprob NaN, as the shard gives it)."""

    def __init__(self, tokenizer: RouterTokenizer) -> None:
        self.tokenizer = tokenizer
        self.rules = OutputRules(tokenizer, (EOS,))
        self.submitted: list[ValidatedRequest] = []
        self.text = " Hello world"

    def submit(self, request: ValidatedRequest, arrival: float) -> RequestState:
        self.submitted.append(request)
        state = self.rules.new_state(len(self.submitted), request, arrival)
        state.started_at = arrival
        response = request.params.response
        if response.input_tokens:
            tops = tuple(TopToken(5, -0.5) for _ in range(response.top_n_tokens))
            prompt = [TokenDetail(i, -1.5, 0, tops) for i in request.input_ids]
            prompt[0] = TokenDetail(request.input_ids[0], math.nan)
            state.emit(InputTokensEvent(tuple(prompt)))
        ids = [*self.tokenizer.encode_batch([self.text], add_special_tokens=False)[0], EOS]
        for n, token_id in enumerate(ids):
            tops = tuple(TopToken(t, -0.5 - k) for k, t in enumerate((token_id, 5, 6)))
            detail = TokenDetail(token_id, -0.25 * (n + 1), 0, tops[: response.top_n_tokens])
            event, done = state.accept_token(detail, arrival)
            if event is not None:
                state.emit(event)
            if done:
                break
        return state

    def abort(self, state: RequestState) -> None:
        pass


class Healthy:
    async def check(self) -> bool:
        return True


class Server:
    def __init__(self, client: TestClient, engine: ScriptedEngine) -> None:
        self.client = client
        self.engine = engine

    async def post(self, path: str, body: Any) -> Any:
        response = await self.client.post(path, json=body)
        assert response.status == 200, await response.text()
        return await response.json()

    async def events(self, path: str, body: Any) -> list[dict[str, Any]]:
        response = await self.client.post(path, json={**body, "stream": True})
        assert response.status == 200
        chunks = [c for c in (await response.text()).split("\n\n") if c]
        assert chunks[-1] == "data: [DONE]"
        return [json.loads(c.removeprefix("data: ")) for c in chunks[:-1]]


def serve(scenario: Callable[[Server], Awaitable[None]]) -> None:
    async def main() -> None:
        tokenizer = RouterTokenizer(str(MODEL_DIR / "tokenizer.json"))
        metrics = Metrics(max_sequence_length=512, max_new_tokens=100, max_batch_size=8)
        grammars = GrammarCompiler(
            lambda: (MODEL_DIR / "tokenizer.json").read_text(), 4096, (EOS,), metrics
        )
        admission = Admission(
            tokenizer=tokenizer,
            limits=ServerLimits.from_args(512, 100),
            limiter=ConcurrencyLimiter(16),
            metrics=metrics,
            grammars=grammars,
            vocab_size=4096,
        )
        engine = ScriptedEngine(tokenizer)
        drain = Drain()
        replies = Replies(tokenizer=tokenizer, metrics=metrics, is_seq2seq=False)
        routes = OpenAIRoutes(
            admission=admission,
            engine=engine,  # type: ignore[arg-type]
            replies=OpenAIReplies(replies, tokenizer, "tiny"),
            gate=CallGate(drain),
            chat_template=ChatTemplate(TEMPLATE.read_text(), "test"),
            tool_call_parser="hermes",
        )
        app = build_app(Healthy(), metrics, drain, (routes,))  # type: ignore[arg-type]
        client = TestClient(TestServer(app))
        await client.start_server()
        try:
            await scenario(Server(client, engine))
        finally:
            await client.close()
            grammars.close()
            tokenizer.close()

    asyncio.run(main())


def test_n_choices_in_openai_order_with_seeds_and_usage() -> None:
    async def scenario(server: Server) -> None:
        body = {"prompt": ["a b", "c d e f"], "n": 3, "max_tokens": 2, "seed": 10}
        reply = await server.post("/v1/completions", body)
        assert [c["index"] for c in reply["choices"]] == list(range(6))
        assert len({c["text"] for c in reply["choices"]}) == 1  # the script ignores seeds
        texts = [r.text for r in server.engine.submitted]
        assert texts == ["a b"] * 3 + ["c d e f"] * 3
        assert [r.sampling.seed for r in server.engine.submitted] == [10, 11, 12] * 2
        lengths = [len(r.input_ids) for r in server.engine.submitted]
        usage = reply["usage"]
        assert usage["prompt_tokens"] == lengths[0] + lengths[3]  # each prompt once
        assert usage["completion_tokens"] == 6 * 2
        # streamed: interleaved by index, the same texts
        chunks = await server.events("/v1/completions", body)
        streamed = [""] * 6
        for chunk in chunks:
            streamed[chunk["choices"][0]["index"]] += chunk["choices"][0]["text"]
        assert streamed == [c["text"] for c in reply["choices"]]
        chat = await server.post(
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "n": 2, "temperature": 0},
        )
        assert [c["index"] for c in chat["choices"]] == [0, 1]
        assert chat["choices"][0]["message"] == chat["choices"][1]["message"]
        assert server.engine.submitted[-1].sampling.seed is None  # greedy

    serve(scenario)


def test_echo_with_logprobs_and_max_tokens_zero() -> None:
    async def scenario(server: Server) -> None:
        body = {"prompt": "one two", "echo": True, "logprobs": 1, "max_tokens": 0}
        reply = await server.post("/v1/completions", body)
        [choice] = reply["choices"]
        prompt_ids = server.engine.submitted[-1].input_ids
        assert server.engine.submitted[-1].stopping.max_new_tokens == 1  # one, dropped
        assert choice["text"] == "one two" and choice["finish_reason"] == "length"
        logprobs = choice["logprobs"]
        assert len(logprobs["tokens"]) == len(prompt_ids)
        assert logprobs["token_logprobs"] == [None] + [-1.5] * (len(prompt_ids) - 1)
        assert logprobs["top_logprobs"][0] is None
        assert all(len(top) == 1 for top in logprobs["top_logprobs"][1:])
        offsets = [0]
        for token in logprobs["tokens"][:-1]:
            offsets.append(offsets[-1] + len(token))
        assert logprobs["text_offset"] == offsets
        assert reply["usage"]["completion_tokens"] == 0
        assert reply["usage"]["prompt_tokens"] == len(prompt_ids)
        # max_tokens 2: the prompt's logprobs, then the output's
        both = await server.post("/v1/completions", {**body, "max_tokens": 2})
        [choice] = both["choices"]
        assert choice["logprobs"]["token_logprobs"][len(prompt_ids) :] == [-0.25, -0.5]
        assert choice["text"].startswith("one two") and choice["text"] != "one two"
        # streamed: the prompt's chunk (with its logprobs), then the output's, offsets running on
        chunks = await server.events("/v1/completions", {**body, "max_tokens": 2})
        joined: dict[str, list[Any]] = {k: [] for k in choice["logprobs"]}
        text = ""
        for chunk in chunks:
            text += chunk["choices"][0]["text"]
            for key, values in chunk["choices"][0]["logprobs"].items():
                joined[key] += values
        assert text == choice["text"] and joined == choice["logprobs"]
        zero = await server.events("/v1/completions", body)
        assert [c["choices"][0]["text"] for c in zero] == ["one two", ""]
        assert zero[-1]["choices"][0]["finish_reason"] == "length"

    serve(scenario)


def reassembled(chunks: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    messages: dict[int, dict[str, Any]] = {}
    for chunk in chunks:
        for choice in chunk["choices"]:
            message = messages.setdefault(choice["index"], {"content": "", "calls": {}})
            delta = choice["delta"]
            message["content"] += delta.get("content") or ""
            for entry in delta.get("tool_calls", []):
                call = message["calls"].setdefault(entry["index"], {"arguments": ""})
                for key in ("id", "type"):
                    if key in entry:
                        call[key] = entry[key]
                if "name" in entry["function"]:
                    call["name"] = entry["function"]["name"]
                call["arguments"] += entry["function"]["arguments"]
            if choice["finish_reason"]:
                message["finish"] = choice["finish_reason"]
    return messages


def test_tool_calls_in_replies_and_streams() -> None:
    async def scenario(server: Server) -> None:
        server.engine.text = CALL
        body = {
            "messages": [{"role": "user", "content": "Weather in Rome?"}],
            "tools": TOOLS,
            "n": 2,
        }
        reply = await server.post("/v1/chat/completions", body)
        assert '<tools>\n{"type": "function"' in server.engine.submitted[-1].text  # the template's
        for choice in reply["choices"]:
            assert choice["finish_reason"] == "tool_calls"
            message = choice["message"]
            assert message["content"] == "Sure."
            [call] = message["tool_calls"]
            assert call["id"].startswith("call_") and call["type"] == "function"
            assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Rome"}'}
        streamed = reassembled(await server.events("/v1/chat/completions", body))
        for index, choice in enumerate(reply["choices"]):
            [call] = streamed[index]["calls"].values()
            want = choice["message"]["tool_calls"][0]
            assert call["name"] == want["function"]["name"] and call["type"] == "function"
            assert call["arguments"] == want["function"]["arguments"]
            assert streamed[index]["content"] == "Sure."
            assert streamed[index]["finish"] == "tool_calls"
        # tool_choice none: the same text is content
        none = await server.post("/v1/chat/completions", {**body, "tool_choice": "none"})
        assert none["choices"][0]["message"] == {"role": "assistant", "content": CALL}
        assert none["choices"][0]["finish_reason"] == "stop"

    serve(scenario)


def test_forced_calls_are_read_back() -> None:
    async def scenario(server: Server) -> None:
        named = {"type": "function", "function": {"name": "get_weather"}}
        base = {"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS}
        server.engine.text = '{"city": "Paris"}'  # what the constraint would have made
        reply = await server.post("/v1/chat/completions", {**base, "tool_choice": named})
        [choice] = reply["choices"]
        assert choice["finish_reason"] == "stop"  # OpenAI's, for a call it was told to make
        assert choice["message"]["content"] is None
        assert choice["message"]["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris"}'
        assert server.engine.submitted[-1].sampling.grammar  # compiled by admission
        chunks = await server.events("/v1/chat/completions", {**base, "tool_choice": named})
        [call] = reassembled(chunks)[0]["calls"].values()
        assert call["arguments"] == '{"city": "Paris"}' and call["name"] == "get_weather"
        server.engine.text = '[{"name":"get_weather","arguments":{"city":"Rome"}}]'
        reply = await server.post("/v1/chat/completions", {**base, "tool_choice": "required"})
        [choice] = reply["choices"]
        assert choice["finish_reason"] == "tool_calls"
        assert choice["message"]["tool_calls"][0]["function"]["arguments"] == '{"city": "Rome"}'

    serve(scenario)


def test_prompts_as_token_ids() -> None:
    async def scenario(server: Server) -> None:
        ids = server.engine.tokenizer.encode_batch(["one two"], add_special_tokens=True)[0]
        body = {"prompt": [ids, ids[1:]], "echo": True, "logprobs": 0, "max_tokens": 0}
        reply = await server.post("/v1/completions", body)
        assert [r.input_ids for r in server.engine.submitted] == [tuple(ids), tuple(ids[1:])]
        texts = [c["text"] for c in reply["choices"]]
        decode = server.engine.tokenizer.decode
        assert texts == [decode(ids, skip_special_tokens=False), "one two"]
        assert texts[0].startswith("<s>")  # the prompt's own BOS, no second one added
        assert reply["usage"]["prompt_tokens"] == 2 * len(ids) - 1
        response = await server.client.post("/v1/completions", json={"prompt": [5, 4096]})
        assert response.status == 400
        error = (await response.json())["error"]
        assert "prompt token id 4096 is not in the model's vocabulary" in error["message"]

    serve(scenario)
