"""OpenAI's error shape and the typed reading of a request body's fields, for the OpenAI
routes' parsers (``openai_requests.py``, ``openai_extras.py``): every wrong type or range is
a 400 naming the field."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

__all__ = [
    "OpenAIError",
    "bad_request",
    "fields_of",
    "optional_bool",
    "optional_int",
    "optional_number",
    "read_prompt",
    "refuse_unless",
]

MAX_TOKEN_ID = (1 << 32) - 1  # the shard's ids are uint32 (admission checks the vocabulary)


class OpenAIError(Exception):
    """A refusal in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``
    with an HTTP status the ``openai`` client maps to its exception classes."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def bad_request(message: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param=param)


def fields_of(body: object, known: frozenset[str]) -> Mapping[str, Any]:
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    for name in body:
        if name not in known:
            raise bad_request(f"Unrecognized request argument supplied: {name}", name)
    return body


def refuse_unless(
    fields: Mapping[str, Any], name: str, accepted: Callable[[Any], bool], message: str
) -> None:
    if not accepted(fields.get(name)):
        raise bad_request(message, name)


def optional_bool(fields: Mapping[str, Any], name: str) -> bool | None:
    value = fields.get(name)
    if value is None or isinstance(value, bool):
        return value
    raise bad_request(f"{name} must be a boolean", name)


def optional_int(fields: Mapping[str, Any], name: str, low: int, high: int | None) -> int | None:
    value = fields.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_request(f"{name} must be an integer", name)
    if value < low or (high is not None and value > high):
        bounds = f"between {low} and {high}" if high is not None else f"at least {low}"
        raise bad_request(f"{name} must be {bounds}", name)
    return value


def optional_number(
    fields: Mapping[str, Any], name: str, low: float, high: float | None
) -> float | None:
    value = fields.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise bad_request(f"{name} must be a number", name)
    if value < low or (high is not None and value > high):
        bounds = f"between {low:g} and {high:g}" if high is not None else f"at least {low:g}"
        raise bad_request(f"{name} must be {bounds}", name)
    return float(value)


def read_prompt(value: object) -> tuple[tuple[str, ...], tuple[tuple[int, ...], ...] | None]:
    """``prompt``'s texts, and its token ids when given as ids (a list of ids, or a list of
    lists of them: their texts are decoded later, by the route)."""
    if isinstance(value, str):
        return (value,), None
    if value is None:
        raise bad_request("you must provide a prompt", "prompt")
    if isinstance(value, list) and value:
        if all(isinstance(p, str) for p in value):
            return tuple(value), None
        if all(_is_token_id(t) for t in value):
            return ("",), (tuple(value),)
        if all(isinstance(p, list) and p and all(_is_token_id(t) for t in p) for p in value):
            return ("",) * len(value), tuple(tuple(p) for p in value)
    raise bad_request(
        "prompt must be a string, a list of strings, a list of token ids or a list of "
        "non-empty lists of token ids",
        "prompt",
    )


def _is_token_id(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_TOKEN_ID
