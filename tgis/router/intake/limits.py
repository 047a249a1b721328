"""Per-call limits checked before validation: ``--max-client-batch-size``.

``Admission.check_batch_size`` applies it right after the servicer counts the inputs and
before concurrency permits are taken. Unset (the default) means no limit, as in TGIS.
"""

from __future__ import annotations


def client_batch_size_error(count: int, limit: int | None) -> str | None:
    """Why a Generate call with ``count`` inputs is refused, or None."""
    if limit is None or count <= limit:
        return None
    return (
        f"batch size {count} exceeds the limit of {limit} inputs per request "
        "(max_client_batch_size)"
    )
