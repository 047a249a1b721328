"""Stand-ins for what the router's servicer talks to, for the tests that drive it
in-process (``servicers.py: make_servicer``): a gRPC servicer context that records the
abort, an engine that answers every input at once, and the request parameters they send."""

from __future__ import annotations

import itertools

import grpc

from tgis.pb import generation_pb2 as pb
from tgis.router.core.detokenizer import IncrementalDetokenizer
from tgis.router.core.request_state import RequestState, TokenEvent
from tgis.router.core.stopping import StopChecker
from tgis.router.errors import GenerationError
from tgis.router.intake.tokenization import RouterTokenizer
from tgis.router.request_types import StopReason, ValidatedRequest


class Aborted(Exception):
    pass


class FakeContext:
    """A servicer context that records the abort; ``metadata`` is the call's metadata."""

    def __init__(self, *metadata: tuple[str, str]) -> None:
        self.code: grpc.StatusCode | None = None
        self.details = ""
        self.metadata = metadata

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        self.code, self.details = code, details
        raise Aborted(details)

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self.metadata


class FakeEngine:
    """Admits every input 10 ms after arrival and answers "a b" (EOS), or fails it."""

    def __init__(self, tokenizer: RouterTokenizer) -> None:
        self.tokenizer = tokenizer
        self.fail = False
        self.aborted: list[RequestState] = []
        self._ids = itertools.count(1)

    def submit(self, request: ValidatedRequest, arrival: float) -> RequestState:
        state = RequestState(
            request_id=next(self._ids),
            request=request,
            arrival=arrival,
            detokenizer=IncrementalDetokenizer(self.tokenizer, True),
            stop_checker=StopChecker(request.stopping, (2,)),
        )
        state.started_at = arrival + 0.01
        if self.fail:
            state.emit(GenerationError("boom"))
            return state
        state.emit(TokenEvent("a", 1))
        state.emit(TokenEvent(" b", 2, (), StopReason.EOS_TOKEN))
        state.finish_reason = StopReason.EOS_TOKEN
        return state

    def abort(self, state: RequestState) -> None:
        self.aborted.append(state)


def params(max_new_tokens: int = 0, truncate: int = 0) -> pb.Parameters:
    return pb.Parameters(
        stopping=pb.StoppingCriteria(max_new_tokens=max_new_tokens),
        truncate_input_tokens=truncate,
    )
