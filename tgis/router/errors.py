"""Errors the router turns into gRPC statuses (spec §1.11, §2), and the one place it does.

Each exception class carries its gRPC status code and each instance the exact message a
client sees; every refusal or failure of an RPC goes through :func:`abort`.
"""

from __future__ import annotations

from typing import ClassVar, NoReturn

import grpc

__all__ = [
    "GenerationError",
    "OverloadedError",
    "RouterError",
    "TokenizationError",
    "UnavailableError",
    "ValidationError",
    "abort",
]


class RouterError(Exception):
    """Base class: an error with a gRPC status code and a client-visible message."""

    code: ClassVar[grpc.StatusCode] = grpc.StatusCode.UNKNOWN

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return self.message


class ValidationError(RouterError):
    """A request failed validation: ``INVALID_ARGUMENT`` with one of the §2 messages."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class OverloadedError(RouterError):
    """No concurrency permit (or queue full): ``RESOURCE_EXHAUSTED``.

    The default message is ``Model is overloaded``; the (practically unreachable) queue-full
    case uses ``Server too busy``.
    """

    code = grpc.StatusCode.RESOURCE_EXHAUSTED

    def __init__(self, message: str = "Model is overloaded") -> None:
        super().__init__(message)


class GenerationError(RouterError):
    """Any failure after the request was enqueued: ``UNKNOWN``.

    The message is ``Request failed during generation: <detail>``; ``detail`` keeps the
    unprefixed text (e.g. ``GPU out of memory``).
    """

    code = grpc.StatusCode.UNKNOWN

    def __init__(self, detail: str) -> None:
        super().__init__(f"Request failed during generation: {detail}")
        self.detail = detail


class UnavailableError(RouterError):
    """The server is draining (SIGTERM): ``UNAVAILABLE``, so clients retry elsewhere."""

    code = grpc.StatusCode.UNAVAILABLE


class TokenizationError(RouterError):
    """The tokenizer failed. ``UNKNOWN`` with the tokenizer's own error text (Tokenize RPC).

    During generation validation the caller reports it as
    ``ValidationError(f"tokenizer error {err.message}")`` (rule 13), see
    :func:`tgis.router.intake.validation.tokenizer_validation_error`.
    """

    code = grpc.StatusCode.UNKNOWN


async def abort(context: grpc.aio.ServicerContext, error: RouterError) -> NoReturn:
    """End the RPC with ``error``'s status code and message (raises grpc's AbortError)."""
    await context.abort(error.code, error.message)
    raise AssertionError("grpc.aio's abort returned")  # it raises
