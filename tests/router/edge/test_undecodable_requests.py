"""Requests whose bytes do not parse (invalid UTF-8 in a string field, corrupt or truncated
wire data) get INVALID_ARGUMENT with the decoder's reason, through the handlers that
``add_generation_service`` registers, on an in-process gRPC server. Without them grpc.aio
answers UNKNOWN (``Unexpected <class 'google.protobuf.message.DecodeError'>``).
"""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest

from tests.router.fakes import FakeEngine
from tests.router.servicers import make_servicer
from tgis.embedded_model import MODEL_DIR
from tgis.pb import generation_pb2 as pb
from tgis.router.edge.registration import add_generation_service
from tgis.router.edge.servicer import GenerationServicer
from tgis.router.edge.status import status_code
from tgis.router.intake.concurrency import ConcurrencyLimiter
from tgis.router.intake.tokenization import RouterTokenizer
from tgis.router.intake.validation import ServerLimits, undecodable_request_error
from tgis.router.ops.metrics import Metrics

PLACEHOLDER = "<<PLACEHOLDER>>"
INVALID_UTF8 = b"<<\xff\xfe\xc0\x80\xed\xa0\x80LDER>>"  # same length as PLACEHOLDER
assert len(INVALID_UTF8) == len(PLACEHOLDER)


def with_invalid_utf8(message: Any) -> bytes:
    """``message`` serialized, its only PLACEHOLDER string replaced by invalid UTF-8."""
    data: bytes = message.SerializeToString()
    assert data.count(PLACEHOLDER.encode()) == 1
    return data.replace(PLACEHOLDER.encode(), INVALID_UTF8)


def servicer() -> GenerationServicer:
    tokenizer = RouterTokenizer(str(MODEL_DIR / "tokenizer.json"))
    return make_servicer(
        engine=FakeEngine(tokenizer),
        tokenizer=tokenizer,
        limits=ServerLimits.from_args(64, 40),
        limiter=ConcurrencyLimiter(4),
        metrics=Metrics(max_sequence_length=64, max_new_tokens=40, max_batch_size=4),
        default_include_stop_seqs=True,
        is_seq2seq=False,
    )


async def call_raw(method: str, data: bytes, response: Any, stream: bool) -> tuple[str, str, int]:
    """Send ``data`` as is to ``method`` of an in-process server; (status, message, replies)."""
    server = grpc.aio.server()
    add_generation_service(servicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            path = f"/fmaas.GenerationService/{method}"
            try:
                if stream:
                    replies = [
                        r async for r in channel.unary_stream(path, None, response.FromString)(data)
                    ]
                    return "OK", "", len(replies)
                await channel.unary_unary(path, None, response.FromString)(data)
                return "OK", "", 1
            except grpc.aio.AioRpcError as err:
                return err.code().name, err.details() or "", 0
    finally:
        await server.stop(None)


CASES = [
    (
        "Generate",
        pb.BatchedGenerationRequest(requests=[pb.GenerationRequest(text=PLACEHOLDER)]),
        pb.BatchedGenerationResponse,
        False,
    ),
    (
        "Generate",
        pb.BatchedGenerationRequest(
            requests=[pb.GenerationRequest(text="a")],
            params=pb.Parameters(stopping=pb.StoppingCriteria(stop_sequences=[PLACEHOLDER])),
        ),
        pb.BatchedGenerationResponse,
        False,
    ),
    (
        "GenerateStream",
        pb.SingleGenerationRequest(adapter_id=PLACEHOLDER, request=pb.GenerationRequest(text="a")),
        pb.GenerationResponse,
        True,
    ),
    (
        "Tokenize",
        pb.BatchedTokenizeRequest(requests=[pb.TokenizeRequest(text=PLACEHOLDER)]),
        pb.BatchedTokenizeResponse,
        False,
    ),
    ("ModelInfo", pb.ModelInfoRequest(model_id=PLACEHOLDER), pb.ModelInfoResponse, False),
]


@pytest.mark.parametrize(("method", "message", "response", "stream"), CASES)
def test_invalid_utf8_is_invalid_argument(
    method: str, message: Any, response: Any, stream: bool
) -> None:
    status, details, _ = asyncio.run(call_raw(method, with_invalid_utf8(message), response, stream))
    assert status == "INVALID_ARGUMENT"
    name = type(message).DESCRIPTOR.full_name
    assert details == f"request is not a valid {name} message: String field had bad UTF-8"


def test_corrupt_wire_data_is_invalid_argument() -> None:
    status, details, _ = asyncio.run(
        call_raw("Generate", b"\xff\xff\xff", pb.BatchedGenerationResponse, False)
    )
    assert status == "INVALID_ARGUMENT"
    assert details == (
        "request is not a valid fmaas.BatchedGenerationRequest message: Wire format was corrupt"
    )


def test_valid_requests_still_served() -> None:
    request = pb.SingleGenerationRequest(request=pb.GenerationRequest(text="a"))
    status, _, replies = asyncio.run(
        call_raw("GenerateStream", request.SerializeToString(), pb.GenerationResponse, True)
    )
    assert status == "OK"
    assert replies >= 2  # the header, then the text (queued tokens may come merged)
    status, _, _ = asyncio.run(
        call_raw(
            "ModelInfo", pb.ModelInfoRequest().SerializeToString(), pb.ModelInfoResponse, False
        )
    )
    assert status == "OK"


def test_undecodable_request_error_message() -> None:
    error = undecodable_request_error(
        "fmaas.ModelInfoRequest",
        "Error parsing message with type 'fmaas.ModelInfoRequest': String field had bad UTF-8",
    )
    assert status_code(error) == grpc.StatusCode.INVALID_ARGUMENT
    assert error.message == (
        "request is not a valid fmaas.ModelInfoRequest message: String field had bad UTF-8"
    )
    # Another protobuf implementation's wording is kept whole.
    other = undecodable_request_error("fmaas.ModelInfoRequest", "truncated message")
    assert (
        other.message == "request is not a valid fmaas.ModelInfoRequest message: truncated message"
    )
