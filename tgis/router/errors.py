"""The router's refusals and failures (spec §1.11, §2): one class per client-visible status.

Each instance carries the exact message a client sees. Which gRPC status each class becomes
is the edge's business (``edge/status.py``), so intake and the core loop import no grpc.
"""

from __future__ import annotations

__all__ = [
    "ConstraintError",
    "GenerationError",
    "OverloadedError",
    "RouterError",
    "StartupError",
    "TokenizationError",
    "UnavailableError",
    "ValidationError",
    "generation_failure",
]

MAX_DETAIL_CHARS = 500
"""The longest failure text from a shard a client is shown (gRPC carries it in metadata)."""


class RouterError(Exception):
    """Base class: an error with a client-visible message (``UNKNOWN`` unless a subclass
    says otherwise)."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return self.message


class ValidationError(RouterError):
    """A request failed validation: ``INVALID_ARGUMENT`` with one of the §2 messages."""


class OverloadedError(RouterError):
    """No concurrency permit (or queue full): ``RESOURCE_EXHAUSTED``.

    The default message is ``Model is overloaded``; the (practically unreachable) queue-full
    case uses ``Server too busy``.
    """

    def __init__(self, message: str = "Model is overloaded") -> None:
        super().__init__(message)


class GenerationError(RouterError):
    """Any failure after the request was enqueued: ``UNKNOWN``.

    The message is ``Request failed during generation: <detail>``; ``detail`` keeps the
    unprefixed text (e.g. ``GPU out of memory``).
    """

    def __init__(self, detail: str) -> None:
        super().__init__(f"Request failed during generation: {detail}")
        self.detail = detail


class ConstraintError(GenerationError):
    """A request's guided-decoding constraint could not be followed once generation had
    started (a parser limit reached by the text so far): ``INVALID_ARGUMENT`` / 400, with
    the ``Request failed during generation:`` message."""


class UnavailableError(RouterError):
    """The server is draining (SIGTERM): ``UNAVAILABLE``, so clients retry elsewhere."""


class TokenizationError(RouterError):
    """The tokenizer failed. ``UNKNOWN`` with the tokenizer's own error text (Tokenize RPC).

    During generation validation the caller reports it as
    ``ValidationError(f"tokenizer error {err.message}")`` (rule 13), see
    :func:`tgis.router.intake.validation.tokenizer_validation_error`.
    """


class StartupError(Exception):
    """A configuration or environment problem found while the router starts (not a client's
    error: the CLI reports its one-line message and exits non-zero)."""


def generation_failure(detail: str, *, constraint: bool = False) -> GenerationError:
    """A request's failure reported by the shard: its constraint's (``ConstraintError``)
    or the engine's, the text cut to :data:`MAX_DETAIL_CHARS`."""
    if len(detail) > MAX_DETAIL_CHARS:
        detail = detail[: MAX_DETAIL_CHARS - 3] + "..."
    return ConstraintError(detail) if constraint else GenerationError(detail)
