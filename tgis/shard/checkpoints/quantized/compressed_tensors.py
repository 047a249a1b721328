"""compressed-tensors checkpoints (``quant_method: compressed-tensors``), what LLM
Compressor writes.

``quantization_config.config_groups`` maps schemes to ``targets`` (layer class names such
as ``Linear``, exact module names, or ``re:`` patterns); ``ignore`` lists layers left
dense (``lm_head`` at least). Each quantized linear layer ``<m>`` is stored in one of:

- ``pack-quantized`` (W4A16, W8A16): ``<m>.weight_packed`` int32 [out, in * bits / 32],
  the integers packed along the input dimension, low bits first, each stored as
  ``q + 2^(bits-1)`` (unsigned); ``<m>.weight_scale`` [out, groups] (groups = 1 per
  channel); for asymmetric schemes ``<m>.weight_zero_point`` int32 [out * bits / 32,
  groups], packed along the output dimension with the same offset; ``<m>.weight_shape``
  int64 [2]; with activation order, ``<m>.weight_g_idx`` int32 [in];
- ``int-quantized`` / ``naive-quantized``: ``<m>.weight`` holding the signed integers
  (int8, or floats with integer values), ``<m>.weight_scale``, and ``<m>.weight_zero_point``
  (signed, unpacked) when asymmetric;
- ``float-quantized`` (FP8): ``<m>.weight`` float8 e4m3 and ``<m>.weight_scale``
  (``fp8.py``).

``W = scale * (q - zero_point)`` in the signed convention, the same number as
``scale * (stored - (zero_point + 2^(bits-1)))`` in the unsigned one ``GroupQuantized``
uses. Activation quantization (``input_activations``) is not applied: activations stay in
the model's dtype.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from tgis.shard.checkpoints.quantized.fp8 import Fp8Reader
from tgis.shard.checkpoints.quantized.matrix import (
    GroupQuantized,
    expect_dtype,
    groups_in_order,
    unpack_int32,
)
from tgis.shard.checkpoints.quantized.source import LinearMatrix, TensorSource, quantized_weight
from tgis.shard.errors import StartupError

log = logging.getLogger(__name__)

FORMATS = ("pack-quantized", "int-quantized", "naive-quantized", "float-quantized", "dense")
SUPPORTED_BITS = (4, 8)
SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class Scheme:
    """One config group's weight quantization, as far as reading needs it."""

    targets: tuple[str, ...]
    kind: str  # "int" or "float"
    bits: int
    symmetric: bool
    block: tuple[int, int] | None


@dataclass(frozen=True)
class CompressedTensorsReader:
    """compressed-tensors layers, from its ``quantization_config``."""

    schemes: tuple[Scheme, ...]
    ignore: tuple[str, ...]

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> CompressedTensorsReader:
        groups = config.get("config_groups") or {}
        if not isinstance(groups, Mapping):
            raise StartupError("compressed-tensors config_groups is not an object")
        # the whole checkpoint's format, or "mixed-precision" and one per config group
        formats = [str(config.get("format") or "dense")] + [
            str(g["format"]) for g in groups.values() if isinstance(g, Mapping) and g.get("format")
        ]
        for fmt in formats:
            if fmt not in FORMATS and fmt != "mixed-precision":
                raise StartupError(
                    f"compressed-tensors format '{fmt}' is not supported; tgis reads "
                    f"{', '.join(FORMATS[:-1])}"
                )
        schemes = tuple(_scheme(str(name), group) for name, group in groups.items())
        if config.get("kv_cache_scheme"):
            log.info("compressed-tensors kv_cache_scheme ignored: the KV cache stays unquantized")
        if any(g.get("input_activations") for g in groups.values() if isinstance(g, Mapping)):
            log.info(
                "compressed-tensors input_activations not applied: weights are dequantized "
                "or multiplied weight-only, activations stay in the model's dtype"
            )
        return cls(schemes, tuple(str(i) for i in config.get("ignore") or ()))

    def holds(self, source: TensorSource, module: str) -> bool:
        if _matches(module, self.ignore) or f"{module}.weight_packed" in source:
            return not _matches(module, self.ignore)
        return quantized_weight(source, module, "weight_scale")

    def shape(self, source: TensorSource, module: str) -> tuple[int, int]:
        if f"{module}.weight_shape" in source:
            out, in_ = (int(v) for v in source.raw(f"{module}.weight_shape").tolist())
            return out, in_
        out, in_ = source.shape(f"{module}.weight")[:2]
        return out, in_

    def read(self, source: TensorSource, module: str, compute_dtype: torch.dtype) -> LinearMatrix:
        scheme = self._scheme_of(module)
        if f"{module}.weight_packed" in source:
            return self._packed(source, module, scheme, compute_dtype)
        weight = source.raw(f"{module}.weight")
        if weight.dtype == torch.float8_e4m3fn:
            return Fp8Reader(scheme.block if scheme else None).read(source, module, compute_dtype)
        return self._unpacked(source, module, weight, scheme, compute_dtype)

    def _scheme_of(self, module: str) -> Scheme | None:
        """The config group whose targets name ``module`` (patterns and names before the
        ``Linear`` class), if any."""
        for scheme in self.schemes:
            named = [t for t in scheme.targets if t.startswith("re:") or "." in t]
            if _matches(module, tuple(named)):
                return scheme
        return next((s for s in self.schemes if "Linear" in s.targets), None)

    def _packed(
        self,
        source: TensorSource,
        module: str,
        scheme: Scheme | None,
        compute_dtype: torch.dtype,
    ) -> GroupQuantized:
        out, in_ = self.shape(source, module)
        packed = source.raw(f"{module}.weight_packed")
        expect_dtype(f"{module}.weight_packed", packed, (torch.int32,))
        bits = scheme.bits if scheme else packed.shape[1] * 32 // max(in_, 1)
        if bits not in SUPPORTED_BITS or packed.shape[1] * 32 < in_ * bits:
            raise StartupError(
                f"{module}.weight_packed has shape {list(packed.shape)}: not {in_} inputs of "
                f"4 or 8 bits (the scheme says {bits})"
            )
        q = unpack_int32(packed, bits, dim=1)[:, :in_]
        scales = self._scales(source, module, out, in_)
        name = f"{module}.weight_zero_point"
        if name in source:
            zero_words = source.raw(name)
            expect_dtype(name, zero_words, (torch.int32,))
            zeros = unpack_int32(zero_words, bits, dim=0)[:out].float()
        else:
            zeros = torch.full_like(scales, float(1 << (bits - 1)))
        return self._matrix(source, module, q, scales, zeros, bits, compute_dtype)

    def _unpacked(
        self,
        source: TensorSource,
        module: str,
        weight: torch.Tensor,
        scheme: Scheme | None,
        compute_dtype: torch.dtype,
    ) -> GroupQuantized:
        bits = scheme.bits if scheme else 8
        if bits not in SUPPORTED_BITS or (scheme is not None and scheme.kind != "int"):
            raise StartupError(
                f"{module}.weight: {scheme.kind if scheme else 'int'} {bits}-bit weights in "
                "int- or naive-quantized form are not supported (4- and 8-bit integers are)"
            )
        offset = 1 << (bits - 1)
        out, in_ = weight.shape[0], weight.shape[1]
        q = (weight.to(torch.int32) + offset).clamp(0, 2 * offset - 1).to(torch.uint8)
        scales = self._scales(source, module, out, in_)
        name = f"{module}.weight_zero_point"
        zeros = torch.full_like(scales, float(offset))
        if name in source:
            zero_point = source.raw(name).float().reshape(out, -1)
            zeros = zero_point.expand_as(scales) + offset
        return self._matrix(source, module, q, scales, zeros, bits, compute_dtype)

    def _scales(self, source: TensorSource, module: str, out: int, in_: int) -> torch.Tensor:
        """``weight_scale`` as float32 [out, groups]."""
        name = f"{module}.weight_scale"
        scale = source.raw(name)
        expect_dtype(name, scale, SCALE_DTYPES)
        scale = scale.float()
        if scale.numel() == 1:
            return scale.reshape(1, 1).expand(out, 1).contiguous()
        if scale.dim() == 2 and scale.shape[0] == out:
            return scale.contiguous()
        raise StartupError(
            f"{name} has shape {list(scale.shape)}; expected [1], [{out}, 1] or [{out}, "
            f"groups] for a weight of [{out}, {in_}]"
        )

    def _matrix(
        self,
        source: TensorSource,
        module: str,
        q: torch.Tensor,
        scales: torch.Tensor,
        zeros: torch.Tensor,
        bits: int,
        compute_dtype: torch.dtype,
    ) -> GroupQuantized:
        in_ = q.shape[1]
        groups = scales.shape[1]
        name = f"{module}.weight_g_idx"
        if name in source:
            g_idx = source.raw(name).long()
            if tuple(g_idx.shape) != (in_,) or int(g_idx.min()) < 0 or int(g_idx.max()) >= groups:
                raise StartupError(
                    f"{name} has shape {list(g_idx.shape)}, values in [{int(g_idx.min())}, "
                    f"{int(g_idx.max())}]; expected [{in_}] with values in [0, {groups})"
                )
        else:
            group_size = -(-in_ // groups)  # ceil: the last group may be short
            g_idx = groups_in_order(in_, group_size, q.device)
        if tuple(zeros.shape) != tuple(scales.shape):
            raise StartupError(
                f"{module}.weight_zero_point has {list(zeros.shape)} values; expected "
                f"{list(scales.shape)} like {module}.weight_scale"
            )
        return GroupQuantized(q, scales, zeros, g_idx, bits, compute_dtype)


def _scheme(name: str, group: Any) -> Scheme:
    if not isinstance(group, Mapping):
        raise StartupError(f"compressed-tensors config group '{name}' is not an object")
    weights = group.get("weights") or {}
    kind = str(weights.get("type", "int"))
    bits = int(weights.get("num_bits", 8))
    if (kind, bits) not in (("int", 4), ("int", 8), ("float", 8)):
        raise StartupError(
            f"compressed-tensors group '{name}': {kind} {bits}-bit weights are not supported; "
            "tgis reads int 4-bit, int 8-bit and float 8-bit (FP8) weights"
        )
    block = weights.get("block_structure")
    return Scheme(
        targets=tuple(str(t) for t in group.get("targets") or ()),
        kind=kind,
        bits=bits,
        symmetric=bool(weights.get("symmetric", True)),
        block=(int(block[0]), int(block[1])) if block else None,
    )


def _matches(module: str, patterns: tuple[str, ...]) -> bool:
    """Whether ``module`` is named by one of ``patterns`` (``re:`` regular expressions, or
    exact names, or a name's last component such as ``lm_head``)."""
    for pattern in patterns:
        if pattern.startswith("re:"):
            if re.match(pattern[3:], module):
                return True
        elif module == pattern or module.endswith(f".{pattern}"):
            return True
    return False
