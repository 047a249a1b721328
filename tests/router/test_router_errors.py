"""Router errors carry the gRPC status code and the exact client-visible message (§1.11)."""

from __future__ import annotations

import grpc

from tgis.router.errors import (
    DetokenizationError,
    GenerationError,
    OverloadedError,
    RouterError,
    TokenizationError,
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
        (DetokenizationError("Unsupported tokenizer type: X"), grpc.StatusCode.UNKNOWN,
         "Request failed during detokenization: Unsupported tokenizer type: X"),
        (TokenizationError("bad input"), grpc.StatusCode.UNKNOWN, "bad input"),
    ]  # fmt: skip
    for err, code, message in cases:
        assert err.code == code
        assert err.message == message == str(err)
        assert isinstance(err, RouterError) and isinstance(err, Exception)


def test_generation_error_keeps_the_detail_and_wraps_detokenization_errors() -> None:
    inner = DetokenizationError("boom")
    outer = GenerationError(str(inner))
    assert outer.detail == "Request failed during detokenization: boom"
    assert outer.message == (
        "Request failed during generation: Request failed during detokenization: boom"
    )
