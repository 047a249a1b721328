"""Router errors become gRPC statuses here, and only here (spec §1.11, §2).

Every refusal or failure of a public RPC goes through :func:`abort`, which ends the call
with the error's status code (:func:`status_code`) and its exact message.
"""

from __future__ import annotations

import asyncio
from typing import NoReturn

import grpc

from tgis.router.errors import (
    ConstraintError,
    GenerationError,
    OverloadedError,
    RouterError,
    TokenizationError,
    UnavailableError,
    ValidationError,
)

__all__ = ["abort", "describe_exception", "describe_failure", "status_code"]

_STATUS: dict[type[RouterError], grpc.StatusCode] = {
    ValidationError: grpc.StatusCode.INVALID_ARGUMENT,
    ConstraintError: grpc.StatusCode.INVALID_ARGUMENT,
    OverloadedError: grpc.StatusCode.RESOURCE_EXHAUSTED,
    GenerationError: grpc.StatusCode.UNKNOWN,
    UnavailableError: grpc.StatusCode.UNAVAILABLE,
    TokenizationError: grpc.StatusCode.UNKNOWN,
}


def status_code(error: RouterError) -> grpc.StatusCode:
    """The status a client gets for ``error`` (its class's, else ``UNKNOWN``)."""
    for cls in type(error).__mro__:
        code = _STATUS.get(cls)
        if code is not None:
            return code
    return grpc.StatusCode.UNKNOWN


async def abort(context: grpc.aio.ServicerContext, error: RouterError) -> NoReturn:
    """End the RPC with ``error``'s status code and message (raises grpc's AbortError)."""
    await context.abort(status_code(error), error.message)
    raise AssertionError("grpc.aio's abort returned")  # it raises


def describe_failure(error: BaseException | None, context: grpc.aio.ServicerContext) -> str | None:
    """How a call failed, for its span: the status it was aborted with, or the exception;
    None when it did not fail."""
    if isinstance(error, grpc.aio.AbortError):
        try:
            code = context.code()
            return f"{getattr(code, 'name', code)}: {context.details()}"
        except Exception:
            pass
    return describe_exception(error)


def describe_exception(error: BaseException | None) -> str | None:
    """How a call of any protocol failed with ``error``, for its span; None when it did
    not fail."""
    if error is None or isinstance(error, GeneratorExit):  # GeneratorExit: closed at the end
        return None
    if isinstance(error, asyncio.CancelledError):
        return "CANCELLED: the client went away"
    return f"{type(error).__name__}: {error}"
