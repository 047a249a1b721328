"""Router errors carry the gRPC status code and the exact client-visible message (§1.11), and
`edge/status.py: abort` is the one place they become a status."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from tgis.router.edge.openai_routes import _openai_error
from tgis.router.edge.status import abort, status_code
from tgis.router.errors import (
    ConstraintError,
    GenerationError,
    OverloadedError,
    RouterError,
    TokenizationError,
    UnavailableError,
    ValidationError,
)


def test_codes_and_messages() -> None:
    cases: list[tuple[RouterError, grpc.StatusCode, str]] = [
        (ValidationError("temperature must be >= 0.05"), grpc.StatusCode.INVALID_ARGUMENT,
         "temperature must be >= 0.05"),
        (OverloadedError(), grpc.StatusCode.RESOURCE_EXHAUSTED, "Model is overloaded"),
        (OverloadedError("Server too busy"), grpc.StatusCode.RESOURCE_EXHAUSTED,
         "Server too busy"),
        (GenerationError("GPU out of memory"), grpc.StatusCode.UNKNOWN,
         "Request failed during generation: GPU out of memory"),
        (ConstraintError("guided decoding: row too wide"), grpc.StatusCode.INVALID_ARGUMENT,
         "Request failed during generation: guided decoding: row too wide"),
        (TokenizationError("bad input"), grpc.StatusCode.UNKNOWN, "bad input"),
        (UnavailableError("Server is shutting down"), grpc.StatusCode.UNAVAILABLE,
         "Server is shutting down"),
    ]  # fmt: skip
    for err, code, message in cases:
        assert status_code(err) == code
        assert err.message == message == str(err)
        assert isinstance(err, RouterError) and isinstance(err, Exception)


def test_a_constraint_failure_is_a_bad_request_on_the_openai_routes() -> None:
    error = _openai_error(ConstraintError("guided decoding: row too wide"))
    assert error.status == 400
    assert error.body()["error"]["message"] == (
        "Request failed during generation: guided decoding: row too wide"
    )
    assert _openai_error(GenerationError("boom")).status == 500


def test_generation_error_keeps_the_detail() -> None:
    err = GenerationError("step failed: boom")
    assert err.detail == "step failed: boom"
    assert err.message == "Request failed during generation: step failed: boom"


class _Aborted(Exception):
    pass


class _Context:
    """What grpc.aio's ServicerContext.abort does: record the status and raise."""

    def __init__(self) -> None:
        self.status: tuple[grpc.StatusCode, str] | None = None

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        self.status = (code, details)
        raise _Aborted


def test_abort_sends_the_errors_status_and_message() -> None:
    context = _Context()
    with pytest.raises(_Aborted):
        asyncio.run(abort(context, OverloadedError()))  # type: ignore[arg-type]
    assert context.status == (grpc.StatusCode.RESOURCE_EXHAUSTED, "Model is overloaded")
