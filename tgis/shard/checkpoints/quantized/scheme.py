"""Which quantization a model is served with: the checkpoint's own, read from config.json's
``quantization_config`` (or ``quantize_config.json``, as TGIS reads GPTQ), and the
``--quantize`` / ``QUANTIZE`` flag, checked against each other at start-up.

Formats named here: ``gptq``, ``awq``, ``compressed-tensors`` and ``fp8`` (pre-quantized
checkpoints), ``mxfp4`` (gpt-oss's experts, dequantized at load by the family itself:
``native/models/gpt_oss.py``), and ``int8`` / ``fp8`` quantized at load from a dense checkpoint;
``bitsandbytes`` and ``eetq`` are TGIS's and TGI's names for weight-only int8. How each
format's tensors are read is in the layout modules beside this one (``readers.py``).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tgis.shard.errors import StartupError

log = logging.getLogger(__name__)

QUANTIZE_FLAGS = ("gptq", "awq", "compressed-tensors", "fp8", "int8")
"""What ``--quantize`` accepts (besides the aliases)."""

QUANTIZE_ALIASES = {"bitsandbytes": "int8", "eetq": "int8"}
"""TGIS's and TGI's names for weight-only int8 quantized at load."""

# The checkpoint formats (quant_method) tgis knows.
_METHOD_FAMILIES = ("gptq", "awq", "compressed-tensors", "fp8", "mxfp4")
# Checkpoint formats other servers read and tgis will not: named in the error.
_UNSUPPORTED_METHODS = (
    "gptq_marlin",
    "awq_marlin",
    "marlin",
    "exl2",
    "gguf",
    "bitsandbytes",
    "torchao",
    "hqq",
    "aqlm",
    "squeezellm",
    "eetq",
)


@dataclass(frozen=True)
class QuantScheme:
    """A quantization scheme: ``method`` (one of ``QUANTIZE_FLAGS``), whether the
    checkpoint holds it (``pre_quantized``) or it is applied at load, and the details that
    name it in logs and errors (bits, group size, the checkpoint's format)."""

    method: str
    pre_quantized: bool
    bits: int | None = None
    group_size: int | None = None
    variant: str = ""  # e.g. compressed-tensors' format, GPTQ's checkpoint_format
    source: str = ""  # where it was read: "config.json quantization_config", ...
    config: Mapping[str, Any] = field(default_factory=dict, compare=False, hash=False)
    """The checkpoint's quantization config as read (empty for quantization at load)."""

    def describe(self) -> str:
        parts = [self.method]
        if self.bits is not None:
            parts.append(f"{self.bits}-bit")
        if self.group_size is not None:
            parts.append("per channel" if self.group_size <= 0 else f"group {self.group_size}")
        if self.variant:
            parts.append(self.variant)
        text = ", ".join(parts)
        return f"{text} ({'in ' + self.source if self.source else 'at load'})"


def checkpoint_scheme(model_dir: Path, config: Mapping[str, Any]) -> QuantScheme | None:
    """The checkpoint's quantization (None for a dense checkpoint); StartupError for a
    quantization_config that names no method tgis knows."""
    raw = config.get("quantization_config")
    source = "config.json quantization_config"
    if raw is None:
        path = model_dir / "quantize_config.json"
        if not path.is_file():
            return None
        try:
            raw = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise StartupError(f"{path} is not readable JSON: {e}") from e
        source = "quantize_config.json"
        if isinstance(raw, dict):
            raw.setdefault("quant_method", "gptq")  # auto-gptq's file, as TGIS reads it
    if not isinstance(raw, dict):
        raise StartupError(f"{source} is not a JSON object")
    method = str(raw.get("quant_method", "")).strip().lower()
    if not method:
        raise StartupError(f"{source} names no quant_method")
    if method in _UNSUPPORTED_METHODS:
        raise StartupError(
            f"the checkpoint is quantized as {method} ({source}), a format tgis does not "
            f"serve; formats: {', '.join(_METHOD_FAMILIES)}"
        )
    if method not in _METHOD_FAMILIES:
        raise StartupError(
            f"unknown quant_method '{method}' in {source}; formats: {', '.join(_METHOD_FAMILIES)}"
        )
    return QuantScheme(
        method=method,
        pre_quantized=True,
        bits=_int_or_none(raw.get("bits")),
        group_size=_int_or_none(raw.get("group_size")),
        variant=str(raw.get("format") or raw.get("checkpoint_format") or ""),
        source=source,
        config=raw,
    )


def canonical_quantize_flag(flag: str | None) -> str | None:
    """``--quantize`` as one of ``QUANTIZE_FLAGS`` (None when unset); the aliases map to
    int8 with a log line; StartupError for anything else."""
    if flag is None or not flag.strip():
        return None
    value = flag.strip().lower()
    if value in QUANTIZE_ALIASES:
        log.info("--quantize %s: TGIS's name for weight-only int8, served as int8", value)
        return QUANTIZE_ALIASES[value]
    if value not in QUANTIZE_FLAGS:
        raise StartupError(
            f"unknown quantize '{flag}': expected one of {', '.join(QUANTIZE_FLAGS)} "
            f"({' and '.join(QUANTIZE_ALIASES)} mean int8)"
        )
    return value


DUMMY_BITS = 4
DUMMY_GROUP_SIZE = 128


def resolve_quantization(
    flag: str | None, checkpoint: QuantScheme | None, dummy: bool = False
) -> QuantScheme | None:
    """The scheme to serve: the checkpoint's, which a flag may only repeat, or the flag's
    at-load scheme on a dense checkpoint (int8, fp8); StartupError on a contradiction.
    With dummy weights (``dummy``) a pre-quantized format on a dense config.json means
    random weights in that format's usual layout: 4-bit, groups of 128."""
    method = canonical_quantize_flag(flag)
    if checkpoint is not None:
        if method is not None and method != checkpoint.method:
            raise StartupError(
                f"--quantize {method} contradicts the checkpoint, which is "
                f"{checkpoint.describe()}: leave --quantize unset or give {checkpoint.method}"
            )
        return checkpoint
    if method is None:
        return None
    if method in ("gptq", "awq", "compressed-tensors") and dummy:
        return QuantScheme(
            method,
            pre_quantized=True,
            bits=DUMMY_BITS,
            group_size=DUMMY_GROUP_SIZE,
            source="--quantize with dummy weights",
        )
    if method in ("gptq", "awq", "compressed-tensors"):
        raise StartupError(
            f"--quantize {method} needs a {method} checkpoint, and this one is dense (no "
            "quantization_config in config.json, no quantize_config.json); int8 and fp8 "
            "quantize a dense checkpoint at load"
        )
    return QuantScheme(method=method, pre_quantized=False)


def _int_or_none(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None
