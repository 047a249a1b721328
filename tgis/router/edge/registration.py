"""Registration of ``fmaas.GenerationService`` on a gRPC server, with lenient parsing.

The handlers are those ``generation_pb2_grpc.add_GenerationServiceServicer_to_server``
registers, except that a request that does not parse (a string field that is not valid
UTF-8, a corrupt or truncated message) reaches the handler as an :class:`Undecodable`, which
is refused with ``INVALID_ARGUMENT`` (``request is not a valid <type> message: <reason>``)
instead of grpc's ``UNKNOWN`` ``Unexpected <class 'google.protobuf.message.DecodeError'>``.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

import grpc
from google.protobuf.message import DecodeError, Message

from tgis.pb import generation_pb2
from tgis.router.edge.status import abort
from tgis.router.errors import ValidationError
from tgis.router.intake.validation import undecodable_request_error
from tgis.router.ops.metrics import Metrics

__all__ = ["SERVICE_NAME", "Undecodable", "add_generation_service", "refuse_undecodable"]

log = logging.getLogger(__name__)

pb = generation_pb2
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["GenerationService"].full_name

_Unary = Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]]


class GenerationService(Protocol):
    """What is registered: the four RPCs, and the metrics a refusal is counted in."""

    metrics: Metrics

    async def Generate(self, request: Any, context: grpc.aio.ServicerContext) -> Any: ...

    def GenerateStream(
        self, request: Any, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[Any]: ...

    async def Tokenize(self, request: Any, context: grpc.aio.ServicerContext) -> Any: ...

    async def ModelInfo(self, request: Any, context: grpc.aio.ServicerContext) -> Any: ...


@dataclass(frozen=True, slots=True)
class Undecodable:
    """What the deserializer hands the handler in place of a request it could not parse."""

    error: ValidationError


def _lenient_deserializer(message_type: Any) -> Callable[[bytes], Any]:
    """``message_type.FromString``, but a ``DecodeError`` becomes an :class:`Undecodable`
    for the handler to refuse: raised in the deserializer, grpc.aio would answer
    ``UNKNOWN``."""
    name = message_type.DESCRIPTOR.full_name

    def deserialize(data: bytes) -> Message | Undecodable:
        try:
            message: Message = message_type.FromString(data)
        except DecodeError as err:
            return Undecodable(undecodable_request_error(name, err))
        return message

    return deserialize


def _refusing_undecodable(method: _Unary, metrics: Metrics | None) -> _Unary:
    async def handle(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if isinstance(request, Undecodable):
            await refuse_undecodable(request, context, metrics)
        return await method(request, context)

    return handle


async def refuse_undecodable(
    request: Undecodable, context: grpc.aio.ServicerContext, metrics: Metrics | None
) -> None:
    """INVALID_ARGUMENT with the decoder's reason; a generation call counts as a
    validation failure (``tgi_request_failure{err="validation"}``)."""
    log.info("Refused an undecodable request: %s", request.error)
    if metrics is not None:
        metrics.request_failure("validation")
    await abort(context, request.error)


def add_generation_service(service: GenerationService, server: grpc.aio.Server) -> None:
    """Register ``service`` on ``server`` as ``fmaas.GenerationService``. GenerateStream
    refuses an :class:`Undecodable` itself (no extra hop per streamed message)."""
    metrics = service.metrics
    handlers = {
        "Generate": grpc.unary_unary_rpc_method_handler(
            _refusing_undecodable(service.Generate, metrics),
            request_deserializer=_lenient_deserializer(pb.BatchedGenerationRequest),
            response_serializer=pb.BatchedGenerationResponse.SerializeToString,
        ),
        "GenerateStream": grpc.unary_stream_rpc_method_handler(
            service.GenerateStream,
            request_deserializer=_lenient_deserializer(pb.SingleGenerationRequest),
            response_serializer=pb.GenerationResponse.SerializeToString,
        ),
        "Tokenize": grpc.unary_unary_rpc_method_handler(
            _refusing_undecodable(service.Tokenize, None),
            request_deserializer=_lenient_deserializer(pb.BatchedTokenizeRequest),
            response_serializer=pb.BatchedTokenizeResponse.SerializeToString,
        ),
        "ModelInfo": grpc.unary_unary_rpc_method_handler(
            _refusing_undecodable(service.ModelInfo, None),
            request_deserializer=_lenient_deserializer(pb.ModelInfoRequest),
            response_serializer=pb.ModelInfoResponse.SerializeToString,
        ),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)
