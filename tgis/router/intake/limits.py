"""Per-call limits the servicer enforces before validation: ``--max-client-batch-size``.

``GenerationServicer.Generate`` calls ``enforce_client_batch_size`` right after counting
the inputs and before taking concurrency permits. Unset (the default) means no limit, as
in TGIS.
"""

from __future__ import annotations

from typing import Protocol

import grpc

from tgis.router.errors import ValidationError, abort
from tgis.router.intake.validation import ServerLimits


class _FailureCounter(Protocol):
    def request_failure(self, err: str) -> None: ...


def client_batch_size_error(count: int, limit: int | None) -> str | None:
    """Why a Generate call with ``count`` inputs is refused, or None."""
    if limit is None or count <= limit:
        return None
    return (
        f"batch size {count} exceeds the limit of {limit} inputs per request "
        "(max_client_batch_size)"
    )


async def enforce_client_batch_size(
    count: int,
    limits: ServerLimits,
    context: grpc.aio.ServicerContext,
    metrics: _FailureCounter,
) -> None:
    """Abort the call with INVALID_ARGUMENT (counted as a validation failure) when it has
    more inputs than ``--max-client-batch-size``."""
    error = client_batch_size_error(count, limits.max_client_batch_size)
    if error is not None:
        metrics.request_failure("validation")
        await abort(context, ValidationError(error))
