"""OpenAI's sampling adjustments and vLLM's extra fields on the OpenAI routes.

What clients of vLLM's OpenAI server send beyond OpenAI's own fields (benchmark tools send
``ignore_eos``; lm-eval and agents send the rest), read here into the gRPC API's terms:

* OpenAI's ``presence_penalty`` and ``frequency_penalty`` (-2 to 2, over the generated
  tokens) and ``logit_bias`` (token id to -100..100), applied by the shard
  (``shard/step/logit_adjustments.py``);
* vLLM's ``min_p`` (0 to 1), ``ignore_eos`` (EOS is masked up to ``max_tokens``),
  ``stop_token_ids`` (ids that end the output as EOS does; their text is kept unless they
  are special tokens), ``skip_special_tokens`` (default true),
  ``include_stop_str_in_output``, ``spaces_between_special_tokens`` (only true, the
  tokenizer's way, is served);
* guided decoding by vLLM's older fields (``guided_json``, ``guided_regex``,
  ``guided_choice``, ``guided_grammar``; ``guided_decoding_backend`` and
  ``guided_whitespace_pattern`` accepted and not used: llguidance compiles everything, and
  JSON is compact) and its newer ``structured_outputs`` (``json``, ``regex``, ``choice``,
  ``grammar``, ``json_object``). At most one constraint per request, OpenAI's
  ``response_format`` included (``body_constraint``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tgis.router.edge.openai_fields import (
    MAX_TOKEN_ID,
    bad_request,
    optional_bool,
    optional_number,
)
from tgis.router.request_types import GuidedKind, GuidedRequest

__all__ = [
    "EXTRA_FIELDS",
    "MAX_LOGIT_BIAS_ENTRIES",
    "Extras",
    "body_constraint",
    "guided_extra",
    "read_extras",
    "schema_text",
]

EXTRA_FIELDS = frozenset(
    {
        "ignore_eos",
        "stop_token_ids",
        "skip_special_tokens",
        "include_stop_str_in_output",
        "spaces_between_special_tokens",
        "min_p",
        "guided_json",
        "guided_regex",
        "guided_choice",
        "guided_grammar",
        "guided_decoding_backend",
        "guided_whitespace_pattern",
        "structured_outputs",
    }
)
"""vLLM's fields beyond OpenAI's that the routes take (``top_k``, ``min_tokens`` and
``repetition_penalty`` are read with the common ones)."""

MAX_LOGIT_BIAS_ENTRIES = 300  # OpenAI's limit


@dataclass(frozen=True)
class Extras:
    """The adjustments and options of one body (defaults: none)."""

    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_p: float = 0.0
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool = False


def read_extras(fields: Mapping[str, Any]) -> Extras:
    """The body's penalties, bias and vLLM options, each checked (400 naming the field)."""
    spaces = optional_bool(fields, "spaces_between_special_tokens")
    if spaces is False:
        raise bad_request(
            "spaces_between_special_tokens false is not supported", "spaces_between_special_tokens"
        )
    return Extras(
        presence_penalty=optional_number(fields, "presence_penalty", -2.0, 2.0) or 0.0,
        frequency_penalty=optional_number(fields, "frequency_penalty", -2.0, 2.0) or 0.0,
        logit_bias=_logit_bias(fields.get("logit_bias")),
        min_p=optional_number(fields, "min_p", 0.0, 1.0) or 0.0,
        ignore_eos=optional_bool(fields, "ignore_eos") or False,
        stop_token_ids=_token_ids(fields.get("stop_token_ids")),
        skip_special_tokens=optional_bool(fields, "skip_special_tokens"),
        include_stop_str_in_output=optional_bool(fields, "include_stop_str_in_output") or False,
    )


def _logit_bias(value: object) -> tuple[tuple[int, float], ...]:
    """OpenAI's ``logit_bias``: an object from token ids (as strings) to -100..100."""
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise bad_request("logit_bias must be an object from token ids to numbers", "logit_bias")
    if len(value) > MAX_LOGIT_BIAS_ENTRIES:
        raise bad_request(
            f"logit_bias may hold at most {MAX_LOGIT_BIAS_ENTRIES} tokens", "logit_bias"
        )
    bias: list[tuple[int, float]] = []
    for key, number in value.items():
        token = _token_id_key(key)
        if isinstance(number, bool) or not isinstance(number, int | float):
            raise bad_request(f"logit_bias[{key!r}] must be a number", "logit_bias")
        if not math.isfinite(number) or not -100 <= number <= 100:
            raise bad_request(f"logit_bias[{key!r}] must be between -100 and 100", "logit_bias")
        bias.append((token, float(number)))
    return tuple(sorted(bias))


def _token_id_key(key: str) -> int:
    text = key.strip()
    if not text.isdigit() or int(text) > MAX_TOKEN_ID:
        raise bad_request(f"logit_bias key {key!r} is not a token id", "logit_bias")
    return int(text)


def _token_ids(value: object) -> tuple[int, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= MAX_TOKEN_ID for t in value
    ):
        raise bad_request("stop_token_ids must be a list of token ids", "stop_token_ids")
    return tuple(value)


# ---- guided decoding -------------------------------------------------------------------------

_GUIDED = {
    "guided_json": GuidedKind.JSON_SCHEMA,
    "guided_regex": GuidedKind.REGEX,
    "guided_choice": GuidedKind.CHOICE,
    "guided_grammar": GuidedKind.GRAMMAR,
}
_STRUCTURED = {
    "json": GuidedKind.JSON_SCHEMA,
    "regex": GuidedKind.REGEX,
    "choice": GuidedKind.CHOICE,
    "grammar": GuidedKind.GRAMMAR,
}


def guided_extra(fields: Mapping[str, Any]) -> tuple[str, GuidedRequest] | None:
    """vLLM's guided-decoding field of the body, if any: (its name, the constraint)."""
    found = [(name, fields[name]) for name in _GUIDED if fields.get(name) is not None]
    structured = fields.get("structured_outputs")
    if structured is not None:
        if not isinstance(structured, dict):
            raise bad_request("structured_outputs must be an object", "structured_outputs")
        if structured.get("json_object"):
            found.append(("structured_outputs", None))
        found += [
            (f"structured_outputs.{key}", structured[key])
            for key in _STRUCTURED
            if structured.get(key) is not None
        ]
    if not found:
        return None
    if len(found) > 1:
        names = ", ".join(name for name, _ in found)
        raise bad_request(f"only one guided-decoding constraint is allowed, got {names}", names)
    name, value = found[0]
    if value is None:
        return name, GuidedRequest(GuidedKind.JSON_OBJECT)
    kind = _GUIDED.get(name) or _STRUCTURED[name.rpartition(".")[2]]
    return name, _constraint(name, kind, value)


def _constraint(name: str, kind: GuidedKind, value: object) -> GuidedRequest:
    if kind is GuidedKind.JSON_SCHEMA:
        if isinstance(value, str):  # vLLM takes the schema as JSON text too
            return GuidedRequest(kind, text=value)
        if not isinstance(value, dict | bool):
            raise bad_request(f"{name} must be a JSON schema", name)
        return GuidedRequest(kind, text=schema_text(value, name))
    if kind is GuidedKind.CHOICE:
        if not isinstance(value, list) or not all(isinstance(c, str) for c in value):
            raise bad_request(f"{name} must be a list of strings", name)
        return GuidedRequest(kind, choices=tuple(value))
    if not isinstance(value, str):
        raise bad_request(f"{name} must be a string", name)
    return GuidedRequest(kind, text=value)


def schema_text(schema: object, name: str) -> str:
    """A schema object as JSON text (400 when too deep to serialize)."""
    try:
        return json.dumps(schema)
    except RecursionError:
        raise bad_request(f"{name} is nested too deeply", name) from None


def body_constraint(fields: Mapping[str, Any]) -> GuidedRequest | None:
    """The body's constraint: ``response_format`` or one of vLLM's guided fields (at
    most one of them)."""
    formatted = _response_format(fields.get("response_format"))
    extra = guided_extra(fields)
    if extra is None:
        return formatted
    if formatted is not None:
        raise bad_request(f"response_format and {extra[0]} cannot be combined", extra[0])
    return extra[1]


def _response_format(value: object) -> GuidedRequest | None:
    """OpenAI's forms (``text``, ``json_object``, ``json_schema``) and HF TGI's, which
    ``huggingface_hub.InferenceClient`` sends: ``{"type": "json", "value": schema}`` (the
    schema or its text), ``{"type": "regex", "value": pattern}`` and ``json_object`` with a
    ``value`` (TGI's alias of ``json``; the client rewrites OpenAI's ``json_schema`` so)."""
    if value is None:
        return None
    fields: dict[str, Any] = value if isinstance(value, dict) else {}
    kind = fields.get("type")
    if kind == "text":
        return None
    if kind == "json" or (kind == "json_object" and fields.get("value") is not None):
        return _tgi_schema(fields.get("value"))
    if kind == "regex":
        pattern = fields.get("value")
        if not isinstance(pattern, str) or not pattern:
            raise bad_request(
                "response_format.value must be a non-empty regular expression", "response_format"
            )
        return GuidedRequest(GuidedKind.REGEX, text=pattern)
    if kind == "json_object":
        return GuidedRequest(GuidedKind.JSON_OBJECT)
    if kind == "json_schema":
        spec = fields.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict | bool):  # true and false: JSON Schema's own forms
            raise bad_request(
                "response_format.json_schema.schema must be an object, true or false",
                "response_format",
            )
        text = schema_text(schema, "response_format")
        return GuidedRequest(GuidedKind.JSON_SCHEMA, text=text)
    raise bad_request(
        "response_format.type must be text, json_object, json_schema, or TGI's json or regex",
        "response_format",
    )


def _tgi_schema(schema: object) -> GuidedRequest:
    """TGI's ``json`` value: a JSON schema (an object, true or false) or its text."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except (json.JSONDecodeError, RecursionError):
            schema = None
    if not isinstance(schema, dict | bool):
        raise bad_request(
            "response_format.value must be a JSON schema (an object, true or false, or its text)",
            "response_format",
        )
    return GuidedRequest(GuidedKind.JSON_SCHEMA, text=schema_text(schema, "response_format"))
