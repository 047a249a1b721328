"""Read a PEFT LoRA adapter directory into the pairs this rank applies (``LoraWeights``).

PEFT saves a LoRA adapter as ``adapter_config.json`` plus ``adapter_model.safetensors`` (or
the older ``adapter_model.bin``) holding, for every module it targets,
``base_model.model.<module>.lora_A.weight`` ([r, in]) and ``...lora_B.weight`` ([out, r]).
``read_lora`` checks every tensor against the model's LoRA sites (``lora_layout.py``) and
lays it out as the site expects on this rank: this rank's rows or columns only, the parts
of a fused projection side by side, the scaling folded into ``B``, in the serving dtype.

What cannot be applied exactly is refused rather than approximated: options that change
the maths (DoRA, biases, ``fan_in_fan_out``, whole replaced modules, ...), tensors other
than ``lora_A``/``lora_B`` weights, modules the model has no site for, wrong shapes, ranks
above ``--max-lora-rank`` and non-finite values. Each refusal is a StoreError(INVALID)
whose message is just the reason; the adapter cache words it for the client. Which
modules an adapter targets is read from its tensors, not from ``target_modules``.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tgis.shard.adapters.lora_layout import LoraPair, LoraPart, LoraSite, LoraWeights
from tgis.shard.adapters.store_paths import ItemStore, invalid
from tgis.shard.adapters.stored_files import read_tensors, version_of

WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")
MODEL_PREFIX = "base_model.model."  # what PEFT puts before the module name
# <module>.lora_A.weight, or with the adapter name PEFT sometimes leaves in:
# <module>.lora_A.default.weight
_KEY = re.compile(r"(?P<module>.+)\.(?P<kind>lora_A|lora_B)(?:\.[\w\-]+)?\.weight")
# The module of any other tensor PEFT saves: lora_embedding_A, lora_magnitude_vector,
# base_layer.weight (the whole base weight of a targeted embedding or lm_head), ...
_OWNER = re.compile(r"(?P<module>.+?)\.(?:lora_\w+|base_layer)(?:\.|$)")

# LoraConfig options that change what the adapter computes and that we do not implement:
# refused whenever they are set to anything but PEFT's default.
_UNSUPPORTED_OPTIONS = {
    "use_dora": "DoRA (use_dora) is not supported",
    "fan_in_fan_out": "fan_in_fan_out is not supported",
    "lora_bias": "lora_bias is not supported",
    "use_qalora": "QA-LoRA (use_qalora) is not supported",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens) is not supported",
    "layer_replication": "layer_replication is not supported",
    "target_parameters": "target_parameters is not supported",
    "use_bdlora": "use_bdlora is not supported",
}

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoraSettings:
    """What ``adapter_config.json`` says about ranks and scaling (PEFT's semantics)."""

    r: int
    lora_alpha: float
    use_rslora: bool = False
    rank_pattern: Mapping[str, int] | None = None  # module-name pattern → r
    alpha_pattern: Mapping[str, float] | None = None  # module-name pattern → lora_alpha

    def rank(self, module: str) -> int:
        """The r PEFT gives ``module``."""
        return _by_pattern(self.rank_pattern, module, self.r)

    def scaling(self, module: str) -> float:
        """``lora_alpha / r`` of ``module`` (``lora_alpha / sqrt(r)`` with rsLoRA)."""
        r = self.rank(module)
        alpha = _by_pattern(self.alpha_pattern, module, self.lora_alpha)
        return alpha / math.sqrt(r) if self.use_rslora else alpha / r


def lora_settings(config: Mapping[str, Any]) -> LoraSettings:
    """The settings of a LoRA ``adapter_config.json``; StoreError(INVALID) for options we
    cannot apply. Missing options take PEFT's defaults."""
    bias = config.get("bias", "none")
    if bias != "none":
        raise invalid(f"bias '{bias}' is not supported (only 'none')")
    for option, reason in _UNSUPPORTED_OPTIONS.items():
        if config.get(option):
            raise invalid(reason)
    if config.get("modules_to_save"):
        modules = config["modules_to_save"]
        names = ", ".join(map(str, modules)) if isinstance(modules, list) else str(modules)
        raise invalid(f"modules_to_save is not supported ({names})")
    if config.get("layers_to_transform") is not None:
        raise invalid("layers_to_transform is not supported")
    r = config.get("r", 8)
    if not _is_int(r) or r < 1:
        raise invalid(f"r must be a positive integer, got {r!r}")
    alpha = config.get("lora_alpha", 8)
    if not _is_number(alpha):
        raise invalid(f"lora_alpha must be a number, got {alpha!r}")
    use_rslora = config.get("use_rslora", False)
    if not isinstance(use_rslora, bool):
        raise invalid(f"use_rslora must be true or false, got {use_rslora!r}")
    rank_pattern = _pattern(config, "rank_pattern", lambda v: _is_int(v) and v >= 1)
    alpha_pattern = _pattern(config, "alpha_pattern", _is_number)
    return LoraSettings(r, float(alpha), use_rslora, rank_pattern, alpha_pattern)


def read_lora(
    adapter_id: str,
    item_dir: Path,
    config: Mapping[str, Any],
    store: ItemStore,
    sites: Sequence[LoraSite],
    dtype: torch.dtype,
    device: torch.device,
    max_rank: int,
) -> LoraWeights:
    """The LoRA adapter in ``item_dir`` (``store.resolve(adapter_id)``; ``config`` its
    parsed ``adapter_config.json``) laid out on ``sites``, in ``dtype`` on ``device``; its
    version is that of the weight file read.

    Raises StoreError(INVALID) with the reason when it cannot be applied exactly, and the
    store's BadIdError when a weight file is a symlink leading out of the store.
    """
    settings = lora_settings(config)
    name, state, weights_digest = _read_weights(adapter_id, item_dir, store)
    modules, others = _modules(state, name)
    where = {
        part.module: (i, j) for i, site in enumerate(sites) for j, part in enumerate(site.parts)
    }
    for module in [*modules, *(module for _, module in others if module is not None)]:
        if module not in where:
            raise invalid(f"module {module} is not supported by this model")
    if others:
        raise invalid(
            f"unsupported tensor {others[0][0]} in {name} (only lora_A and lora_B weights "
            "can be applied)"
        )
    if not modules:
        raise invalid(f"{name} holds no lora_A/lora_B weights")
    # site index → part index → (A [r, in], B scaled [out, r]) in ``dtype``
    found: dict[int, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
    largest = 0
    for module in sorted(modules, key=where.__getitem__):  # in the model's order
        i, j = where[module]
        tensors = modules[module]
        a, b = _checked_pair(module, tensors, sites[i].parts[j], settings, dtype, max_rank)
        found.setdefault(i, {})[j] = (a, b)
        largest = max(largest, a.shape[0])
    pairs = {i: _pair(sites[i], found[i], dtype, device) for i in sorted(found)}
    return LoraWeights(adapter_id, pairs, largest, version_of((weights_digest,)))


def _read_weights(
    adapter_id: str, item_dir: Path, store: ItemStore
) -> tuple[str, dict[Any, Any], str]:
    """(file name, its tensors, the digest of its bytes) of the first weight file present."""
    for name in WEIGHT_FILES:
        path = store.file(item_dir, name, adapter_id)
        if path is None:
            continue
        try:
            state, file_digest = read_tensors(path)
        except Exception as e:
            logger.warning("cannot read %s: %s", path, e)
            raise invalid(f"cannot read {name}: {_reason(e, path)}") from None
        if not isinstance(state, dict):
            raise invalid(f"{name} does not hold a dictionary of tensors")
        return name, state, file_digest
    raise invalid("no adapter_model.safetensors or adapter_model.bin")


def _modules(
    state: Mapping[Any, Any], file_name: str
) -> tuple[dict[str, dict[str, torch.Tensor]], list[tuple[str, str | None]]]:
    """module → {"lora_A": tensor, "lora_B": tensor} (either may be missing), in file order,
    and every other key with the module it belongs to, when that can be told."""
    modules: dict[str, dict[str, torch.Tensor]] = {}
    others: list[tuple[str, str | None]] = []
    for key, value in state.items():
        name = key.removeprefix(MODEL_PREFIX) if isinstance(key, str) else ""
        match = _KEY.fullmatch(name)
        if match is None:
            owner = _OWNER.match(name)
            others.append((str(key), owner["module"] if owner else None))
            continue
        if not isinstance(value, torch.Tensor):
            raise invalid(f"{key} in {file_name} is not a tensor")
        tensors = modules.setdefault(match["module"], {})
        if match["kind"] in tensors:
            raise invalid(f"module {match['module']} has more than one {match['kind']} weight")
        tensors[match["kind"]] = value
    return modules, others


def _checked_pair(
    module: str,
    tensors: Mapping[str, torch.Tensor],
    part: LoraPart,
    settings: LoraSettings,
    dtype: torch.dtype,
    max_rank: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``module``'s (A [r, in], scaling * B [out, r]) checked against its part, in ``dtype``."""
    a, b = tensors.get("lora_A"), tensors.get("lora_B")
    if a is None or b is None:
        have, lack = ("lora_A", "lora_B") if b is None else ("lora_B", "lora_A")
        raise invalid(f"module {module} has {have} but no {lack}")
    for what, t in (("lora_A", a), ("lora_B", b)):
        if not t.is_floating_point():
            raise invalid(f"{what} of {module} is not a floating-point tensor ({t.dtype})")
    r = a.shape[0] if a.dim() == 2 else 0
    if a.dim() != 2 or r == 0 or a.shape[1] != part.in_features:
        raise invalid(
            f"lora_A of {module} has shape {list(a.shape)}, expected [r, {part.in_features}]"
        )
    if tuple(b.shape) != (part.out_features, r):
        raise invalid(
            f"lora_B of {module} has shape {list(b.shape)}, expected [{part.out_features}, {r}]"
        )
    if r > max_rank:
        raise invalid(f"adapter rank {r} exceeds --max-lora-rank {max_rank}")
    expected = settings.rank(module)
    if r != expected:
        raise invalid(f"module {module} has rank {r} but adapter_config.json gives it r={expected}")
    scaled = b.float() * settings.scaling(module)
    return _converted(a, a, dtype, f"lora_A of {module}"), _converted(
        b, scaled, dtype, f"lora_B of {module}"
    )


def _converted(
    source: torch.Tensor, value: torch.Tensor, dtype: torch.dtype, what: str
) -> torch.Tensor:
    """``value`` (computed from ``source``) in ``dtype``; StoreError if not finite."""
    out = value.to(dtype)
    if not bool(out.isfinite().all()):
        if not bool(source.isfinite().all()):
            raise invalid(f"{what} contains non-finite values")
        raise invalid(
            f"{what} contains non-finite values after scaling and conversion from "
            f"{source.dtype} to {dtype}"
        )
    return out


def _pair(
    site: LoraSite,
    found: Mapping[int, tuple[torch.Tensor, torch.Tensor]],
    dtype: torch.dtype,
    device: torch.device,
) -> LoraPair:
    """One site's pair from its targeted parts' (A, scaled B), as ``lora_layout`` lays
    them out on this rank."""
    if site.row_parallel:
        if len(site.parts) != 1:
            raise ValueError(f"a row-parallel LoRA site has one part, not {len(site.parts)}")
        (part,) = site.parts
        lora_a, lora_b = found[0]
        a = torch.cat([lora_a[:, start:stop] for start, stop in part.ranges], dim=1).T
        b = lora_b.T
    else:
        targeted = [found[j] for j in range(len(site.parts)) if j in found]
        a = torch.cat([lora_a.T for lora_a, _ in targeted], dim=1)  # [in, R]
        b = torch.zeros(a.shape[1], site.out_local, dtype=dtype)
        row = col = 0
        for j, part in enumerate(site.parts):
            if j in found:
                lora_b = found[j][1]
                r = lora_b.shape[1]
                rows = torch.cat([lora_b[start:stop] for start, stop in part.ranges])
                b[row : row + r, col : col + part.local_size] = rows.T
                row += r
            col += part.local_size
    return LoraPair(a.to(device).contiguous(), b.to(device).contiguous())


def _by_pattern(patterns: Mapping[str, Any] | None, module: str, default: Any) -> Any:
    """PEFT's ``get_pattern_key``: the value of the first pattern that matches the end of
    ``module`` at a dot boundary, else ``default``."""
    for pattern, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({pattern})$", module):
            return value
    return default


def _pattern(config: Mapping[str, Any], option: str, valid: Any) -> dict[str, Any] | None:
    patterns = config.get(option)
    if not patterns:
        return None
    if not isinstance(patterns, dict) or not all(
        isinstance(k, str) and valid(v) for k, v in patterns.items()
    ):
        raise invalid(f"{option} must map module names to numbers, got {patterns!r}")
    for key in patterns:
        try:
            re.compile(key)
        except re.error as e:
            raise invalid(f"{option} has an invalid pattern {key!r} ({e})") from None
    return patterns


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _reason(error: Exception, path: Path) -> str:
    """A short, path-free reason for a file that cannot be read."""
    text = str(error)
    marker = "WeightsUnpickler error:"  # torch.load(weights_only=True)'s long message
    if marker in text:
        text = text.split(marker, 1)[1]
    text = re.sub(r"\x1b\[[0-9;]*m", "", text)
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    reason = lines[0] if lines else type(error).__name__
    for location in (str(path), str(path.parent)):
        reason = reason.replace(location, path.name)
    return reason[:200]
