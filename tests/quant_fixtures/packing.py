"""GPTQ and AWQ checkpoints of tiny models, written by the project's own packers (pure torch).

The layouts are those of auto-gptq 0.7.1 (GPTQ v1), GPTQModel (``checkpoint_format:
gptq_v2``) and AutoAWQ 0.2.9 (AWQ GEMM), checked bit for bit against the real tools by
``tests/test_quant_fixtures_gptq_awq.py`` with the goldens that
``scripts/make_quant_goldens.py`` made from them; ``NOTES-gptq-awq.md`` beside this file
describes each layout.

Conventions of this module: a quantized linear layer is ``QuantizedLinear`` with ``q``
[out, in] (integers ``0 .. 2^bits - 1``), ``zeros`` [out, groups], ``scales`` [out, groups]
(float16 values) and ``g_idx`` [in] (the group of each input column), and its weight is
``W[o, i] = scales[o, g_idx[i]] * (q[o, i] - zeros[o, g_idx[i]])`` (``dequantize``, exact in
float32). ``pack_gptq`` and ``pack_awq`` turn one into the tensors a checkpoint holds;
``unpack_gptq`` and ``unpack_awq`` read them back the way the tools' readers do.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import Tensor, nn

# AWQ GEMM: field k (bits 4k .. 4k+3) of a word holds column 8c + AWQ_ORDER[k] of its block.
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
_WORD = 0xFFFFFFFF
GPTQ_FORMATS = ("gptq", "gptq_v2")


@dataclass
class QuantizedLinear:
    """The integers and scales of one quantized ``nn.Linear`` (see the module docstring)."""

    q: Tensor  # int32 [out, in], 0 .. 2^bits - 1
    zeros: Tensor  # int32 [out, groups]
    scales: Tensor  # float16 [out, groups]
    g_idx: Tensor  # int32 [in]
    bits: int
    group_size: int  # -1: one group over all input columns


def dequantize(qlinear: QuantizedLinear) -> Tensor:
    """``scales * (q - zeros)`` per column's group, float32 [out, in]; exact, since an
    11-bit float16 scale times a difference of at most 9 bits fits float32's 24 bits."""
    g = qlinear.g_idx.long()
    diff = (qlinear.q.long() - qlinear.zeros.long()[:, g]).to(torch.float32)
    return qlinear.scales.to(torch.float32)[:, g] * diff


# ----------------------------------------------------------------------------- bit fields


def _to_int32(words: Tensor) -> Tensor:
    """int64 words in ``0 .. 2^32 - 1`` as the int32 with the same bits."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _pack_rows(values: Tensor, bits: int) -> Tensor:
    """Pack ``values`` [n, m] along dim 0: word ``r`` of column ``j`` holds rows
    ``r*32/bits .. (r+1)*32/bits - 1``, the first in the lowest bits. Each value is taken as
    a uint32 (so -1 is 0xFFFFFFFF) shifted left and truncated to 32 bits, then ORed in, as
    auto-gptq's numpy code does; a value outside ``0 .. 2^bits - 1`` thus spills into the
    higher fields of its word (GPTQ v1's stored zero point of -1 does)."""
    per = 32 // bits
    if values.shape[0] % per:
        raise ValueError(f"{values.shape[0]} rows do not pack into words of {per}")
    fields = (values.long() & _WORD).reshape(values.shape[0] // per, per, values.shape[1])
    words = torch.zeros(fields.shape[0], fields.shape[2], dtype=torch.long)
    for k in range(per):
        words |= (fields[:, k] << (bits * k)) & _WORD
    return _to_int32(words)


def _unpack_rows(words: Tensor, bits: int) -> Tensor:
    """Inverse of ``_pack_rows`` for in-range fields: int64 [rows * 32/bits, m]."""
    per = 32 // bits
    shifts = torch.arange(per, dtype=torch.long) * bits
    fields = ((words.long() & _WORD)[:, None, :] >> shifts[None, :, None]) & (2**bits - 1)
    return fields.reshape(words.shape[0] * per, words.shape[1])


def _check_integers(ql: QuantizedLinear) -> None:
    """Shapes and ranges that every layout needs; scales must be float16 values."""
    maxq = 2**ql.bits - 1
    out, inp = ql.q.shape
    groups = ql.zeros.shape[1]
    if ql.zeros.shape != (out, groups) or ql.scales.shape != (out, groups):
        raise ValueError(f"zeros {list(ql.zeros.shape)} / scales {list(ql.scales.shape)}")
    if ql.g_idx.shape != (inp,) or int(ql.g_idx.min()) < 0 or int(ql.g_idx.max()) >= groups:
        raise ValueError("g_idx must give each input column a group in 0 .. groups-1")
    if int(ql.q.min()) < 0 or int(ql.q.max()) > maxq:
        raise ValueError(f"q outside 0 .. {maxq}")
    if int(ql.zeros.min()) < 0 or int(ql.zeros.max()) > maxq:
        raise ValueError(f"zero points outside 0 .. {maxq}")
    as_half = ql.scales.to(torch.float16)
    if not torch.equal(as_half.to(ql.scales.dtype), ql.scales):
        raise ValueError("scales are not float16 values; checkpoints store them as float16")


# ----------------------------------------------------------------------------- GPTQ


def pack_gptq(
    q: Tensor,
    zeros: Tensor,
    scales: Tensor,
    g_idx: Tensor,
    bits: int,
    checkpoint_format: str = "gptq",
) -> dict[str, Tensor]:
    """The GPTQ tensors of one linear layer, as auto-gptq (``"gptq"``, v1) or GPTQModel
    (``"gptq_v2"``) store them.

    ``qweight`` int32 [in * bits / 32, out]: ``q`` packed along the input dimension, row
    ``i`` of a word at bits ``bits * (i % (32 / bits))``. ``qzeros`` int32 [groups, out * bits
    / 32]: zero points packed the same way along the output dimension; v1 stores ``zero - 1``
    (a zero point of 0 becomes -1, which corrupts its word: see NOTES-gptq-awq.md; this
    function reproduces that, byte for byte), v2 stores ``zero``. ``scales`` float16
    [groups, out]; ``g_idx`` int32 [in].
    """
    if bits not in (4, 8):
        raise ValueError(f"GPTQ bits {bits}: 4 or 8 supported here")
    if checkpoint_format not in GPTQ_FORMATS:
        raise ValueError(f"checkpoint_format {checkpoint_format!r}: one of {GPTQ_FORMATS}")
    ql = QuantizedLinear(q, zeros, scales, g_idx, bits, -1)
    _check_integers(ql)
    stored_zeros = zeros.long() - (1 if checkpoint_format == "gptq" else 0)
    return {
        "qweight": _pack_rows(q.t(), bits),
        "qzeros": _pack_rows(stored_zeros, bits).t().contiguous(),
        "scales": scales.to(torch.float16).t().contiguous(),
        "g_idx": g_idx.to(torch.int32).contiguous(),
    }


def unpack_gptq(
    tensors: dict[str, Tensor], bits: int, group_size: int, checkpoint_format: str = "gptq"
) -> QuantizedLinear:
    """Read ``pack_gptq``'s tensors back as the tools' readers do: each field masked to
    ``bits`` bits, plus 1 for v1 (so a v1 field of all ones reads as ``2^bits``)."""
    qweight, qzeros = tensors["qweight"], tensors["qzeros"]
    q = _unpack_rows(qweight, bits).t()
    zeros = _unpack_rows(qzeros.t(), bits) + (1 if checkpoint_format == "gptq" else 0)
    return QuantizedLinear(
        q=q.to(torch.int32).contiguous(),
        zeros=zeros.to(torch.int32).contiguous(),
        scales=tensors["scales"].t().contiguous(),
        g_idx=tensors["g_idx"].to(torch.int32),
        bits=bits,
        group_size=group_size,
    )


# ----------------------------------------------------------------------------- AWQ


def _pack_awq_columns(values: Tensor) -> Tensor:
    """[n, m] 4-bit values to int32 [n, m / 8], AWQ's field order within each word."""
    if values.shape[1] % 8:
        raise ValueError(f"{values.shape[1]} columns do not pack into words of 8")
    blocks = values.long().reshape(values.shape[0], -1, 8)[:, :, list(AWQ_ORDER)]
    return _pack_rows(blocks.reshape(values.shape[0], -1).t(), 4).t().contiguous()


def _unpack_awq_columns(words: Tensor) -> Tensor:
    fields = _unpack_rows(words.t(), 4).t().reshape(words.shape[0], -1, 8)
    inverse = [AWQ_ORDER.index(k) for k in range(8)]
    return fields[:, :, inverse].reshape(words.shape[0], -1)


def pack_awq(q: Tensor, zeros: Tensor, scales: Tensor) -> dict[str, Tensor]:
    """The AWQ GEMM tensors of one 4-bit linear layer, as AutoAWQ stores them.

    ``qweight`` int32 [in, out / 8] and ``qzeros`` int32 [groups, out / 8]: packed along the
    output dimension, 8 columns a word, field ``k`` (bits ``4k``) holding column
    ``8c + AWQ_ORDER[k]``; zero points stored as they are. ``scales`` float16 [groups, out].
    Groups are contiguous runs of ``in / groups`` input columns (AWQ has no ``g_idx``).
    """
    inp, groups = q.shape[1], zeros.shape[1]
    if inp % groups:
        raise ValueError(f"{inp} input columns do not split into {groups} equal groups")
    g_idx = (torch.arange(inp) // (inp // groups)).to(torch.int32)
    _check_integers(QuantizedLinear(q, zeros, scales, g_idx, 4, inp // groups))
    return {
        "qweight": _pack_awq_columns(q.t()),
        "qzeros": _pack_awq_columns(zeros.t()),
        "scales": scales.to(torch.float16).t().contiguous(),
    }


def unpack_awq(tensors: dict[str, Tensor]) -> QuantizedLinear:
    """Read ``pack_awq``'s tensors back (contiguous groups, group size ``in / groups``)."""
    q = _unpack_awq_columns(tensors["qweight"]).t()
    zeros = _unpack_awq_columns(tensors["qzeros"]).t()
    inp, groups = q.shape[1], zeros.shape[1]
    return QuantizedLinear(
        q=q.to(torch.int32).contiguous(),
        zeros=zeros.to(torch.int32).contiguous(),
        scales=tensors["scales"].t().contiguous(),
        g_idx=(torch.arange(inp) // (inp // groups)).to(torch.int32),
        bits=4,
        group_size=inp // groups,
    )


# ----------------------------------------------------------------------------- quantization


def _group_index(inp: int, size: int, act_order: bool, generator: torch.Generator | None) -> Tensor:
    """``g_idx``: contiguous groups, or (act order) the groups of a random column order,
    ``g_idx[i] = rank of column i in the permutation // size``: each group has exactly
    ``size`` columns (the last one may have fewer), scattered over the matrix."""
    if not act_order:
        return (torch.arange(inp) // size).to(torch.int32)
    rank = torch.argsort(torch.randperm(inp, generator=generator))
    return (rank // size).to(torch.int32)


def _group_params(
    block: Tensor, bits: int, symmetric: bool, min_zero: int
) -> tuple[Tensor, Tensor]:
    """float16 scales and int zero points of the rows of ``block`` (auto-gptq's min/max rule:
    the range always includes 0; an all-zero row gets [-1, 1])."""
    maxq = 2**bits - 1
    xmin = block.min(dim=1).values.clamp(max=0.0)
    xmax = block.max(dim=1).values.clamp(min=0.0)
    if symmetric:
        xmax = torch.maximum(xmax, -xmin)
        xmin = -xmax
    empty = (xmin == 0) & (xmax == 0)
    xmin, xmax = xmin.masked_fill(empty, -1.0), xmax.masked_fill(empty, 1.0)
    scale = (xmax - xmin) / maxq
    if symmetric:
        scale16 = scale.to(torch.float16).clamp(min=2**-14)
        return scale16, torch.full_like(scale16, 2 ** (bits - 1), dtype=torch.int32)
    # A zero point below min_zero (GPTQ v1 cannot store 0) widens the range downwards instead.
    low = torch.round(-xmin / scale) < min_zero
    scale = torch.where(low, xmax / (maxq - min_zero), scale)
    scale16 = scale.to(torch.float16).clamp(min=2**-14)
    zero = torch.round(-xmin / scale16.float())
    zero = torch.where(low, torch.full_like(zero, min_zero), zero).clamp(min_zero, maxq)
    return scale16, zero.to(torch.int32)


def quantize_rtn(
    weight: Tensor,
    bits: int,
    group_size: int,
    symmetric: bool,
    act_order: bool,
    generator: torch.Generator | None = None,
    min_zero: int = 0,
) -> QuantizedLinear:
    """Round-to-nearest quantization of ``weight`` [out, in] (no calibration data).

    Per group of input columns (``group_size``; -1: all columns) and output row: the scale
    is ``(max - min) / (2^bits - 1)`` over a range that includes 0, rounded to float16
    *before* ``q = clamp(round(w / scale) + zero, 0, 2^bits - 1)`` is computed, so a checkpoint
    (float16 scales) dequantizes to exactly ``dequantize(result)``. Symmetric: zero point
    ``2^(bits-1)`` and range ``[-max|w|, max|w|]``. ``act_order``: the groups follow a
    random column permutation drawn from ``generator`` (see ``_group_index``), as GPTQ's
    ``desc_act`` does. ``min_zero``: the smallest zero point allowed (1 for GPTQ v1).
    """
    out, inp = weight.shape
    size = inp if group_size == -1 else group_size
    g_idx = _group_index(inp, size, act_order, generator)
    groups = -(-inp // size)
    w = weight.detach().to(torch.float32)
    scales = torch.empty(out, groups, dtype=torch.float16)
    zeros = torch.empty(out, groups, dtype=torch.int32)
    q = torch.empty(out, inp, dtype=torch.int32)
    for group in range(groups):
        columns = g_idx == group
        scale16, zero = _group_params(w[:, columns], bits, symmetric, min_zero)
        scales[:, group], zeros[:, group] = scale16, zero
        ints = torch.round(w[:, columns] / scale16.float()[:, None]) + zero[:, None]
        q[:, columns] = ints.clamp(0, 2**bits - 1).to(torch.int32)
    return QuantizedLinear(q, zeros, scales, g_idx, bits, group_size)


# ----------------------------------------------------------------------------- checkpoints


def decoder_linears(model: nn.Module) -> dict[str, nn.Linear]:
    """Every ``nn.Linear`` inside the decoder layers (the ``nn.ModuleList`` of
    ``config.num_hidden_layers`` blocks), by its full name; never the embeddings or lm_head."""
    count = model.config.get_text_config().num_hidden_layers
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) == count:
            return {
                f"{name}.{sub}": m for sub, m in module.named_modules() if isinstance(m, nn.Linear)
            }
    raise ValueError(f"no ModuleList of {count} decoder layers in {type(model).__name__}")


def _dense_tensors(model: nn.Module, replaced: set[str]) -> dict[str, Tensor]:
    """The state dict minus the quantized layers' weights and biases; a tensor that shares
    storage with an earlier one (tied output embeddings) is left out, as save_pretrained
    leaves it out."""
    tensors: dict[str, Tensor] = {}
    seen: set[int] = set()
    for name, tensor in model.state_dict().items():
        module = name.rsplit(".", 1)[0]
        if module in replaced or tensor.data_ptr() in seen:
            continue
        seen.add(tensor.data_ptr())
        tensors[name] = tensor.detach().clone().contiguous()
    return tensors


def _write(
    model: nn.Module, path: Path, tensors: dict[str, Tensor], quantization_config: dict
) -> None:
    """``model.safetensors``, then config.json and generation_config.json as
    ``save_pretrained`` writes them, with ``quantization_config`` added."""
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = copy.deepcopy(model.config)
    config.architectures = [type(model).__name__]
    config.dtype = next(model.parameters()).dtype
    config.quantization_config = quantization_config
    config.save_pretrained(path)
    generation_config = getattr(model, "generation_config", None)
    if generation_config is not None:
        generation_config.save_pretrained(path)


def _quantize_model(
    model: nn.Module, quantize: Any, pack: Any
) -> tuple[dict[str, Tensor], nn.Module]:
    """Quantize every decoder linear with ``quantize(name, weight)``, pack it with
    ``pack(qlinear)``; return the checkpoint's tensors and the dequantized reference."""
    reference = copy.deepcopy(model).eval()
    linears = decoder_linears(model)
    tensors = _dense_tensors(model, set(linears))
    for name, linear in linears.items():
        qlinear = quantize(name, linear.weight)
        for key, value in pack(qlinear).items():
            tensors[f"{name}.{key}"] = value
        target = reference.get_submodule(name)
        with torch.no_grad():
            target.weight.copy_(dequantize(qlinear))
            if linear.bias is not None:
                # the tools store a quantized layer's bias in float16
                tensors[f"{name}.bias"] = linear.bias.detach().to(torch.float16).contiguous()
                target.bias.copy_(tensors[f"{name}.bias"].to(torch.float32))
    return tensors, reference


def gptq_quantization_config(
    bits: int, group_size: int, symmetric: bool, act_order: bool, checkpoint_format: str
) -> dict[str, Any]:
    """``quantization_config`` as auto-gptq 0.7.1's ``BaseQuantizeConfig.to_dict`` writes it,
    plus ``checkpoint_format`` (GPTQModel and transformers; absent means ``gptq``) and, for
    v2, GPTQModel's ``meta``."""
    config: dict[str, Any] = {
        "bits": bits,
        "group_size": group_size,
        "damp_percent": 0.01,
        "desc_act": act_order,
        "static_groups": False,
        "sym": symmetric,
        "true_sequential": True,
        "model_name_or_path": None,
        "model_file_base_name": "model",
        "is_marlin_format": False,
        "quant_method": "gptq",
        "checkpoint_format": checkpoint_format,
    }
    if checkpoint_format == "gptq_v2":
        config["meta"] = {
            "quantizer": ["gptqmodel:1.0.0"],
            "uri": "https://github.com/modelcloud/gptqmodel",
        }
    return config


def save_gptq_checkpoint(
    model: nn.Module,
    path: Path | str,
    bits: int,
    group_size: int,
    symmetric: bool,
    act_order: bool,
    checkpoint_format: str = "gptq",
    seed: int = 0,
) -> nn.Module:
    """Write ``model`` (a float32 transformers causal LM) to ``path`` as a GPTQ checkpoint;
    return the transformers oracle: a copy of ``model`` whose quantized layers hold the
    dequantized weights (and float16-rounded biases).

    Every decoder ``nn.Linear`` becomes ``<m>.qweight``, ``<m>.qzeros``, ``<m>.scales``,
    ``<m>.g_idx`` (and ``<m>.bias``, float16); everything else is saved as it is. For v1
    (``"gptq"``) asymmetric zero points are kept >= 1, since v1 cannot store 0.
    """
    if bits not in (4, 8) or checkpoint_format not in GPTQ_FORMATS:
        raise ValueError(f"bits {bits} / checkpoint_format {checkpoint_format!r}")
    generator = torch.Generator().manual_seed(seed)
    min_zero = 1 if checkpoint_format == "gptq" and not symmetric else 0

    def quantize(name: str, weight: Tensor) -> QuantizedLinear:
        per_word = 32 // bits
        if weight.shape[0] % per_word or weight.shape[1] % per_word:
            raise ValueError(f"{name}: shape {list(weight.shape)} does not pack at {bits} bits")
        return quantize_rtn(weight, bits, group_size, symmetric, act_order, generator, min_zero)

    def pack(ql: QuantizedLinear) -> dict[str, Tensor]:
        return pack_gptq(ql.q, ql.zeros, ql.scales, ql.g_idx, bits, checkpoint_format)

    tensors, reference = _quantize_model(model, quantize, pack)
    config = gptq_quantization_config(bits, group_size, symmetric, act_order, checkpoint_format)
    _write(model, Path(path), tensors, config)
    return reference


def save_awq_checkpoint(
    model: nn.Module, path: Path | str, group_size: int, seed: int = 0
) -> nn.Module:
    """Write ``model`` (a float32 transformers causal LM) to ``path`` as a 4-bit AWQ GEMM
    checkpoint (asymmetric, zero points 0..15); return the transformers oracle (see
    ``save_gptq_checkpoint``). ``seed`` is accepted for symmetry: AWQ has no act order, so
    nothing is random."""
    del seed

    def quantize(name: str, weight: Tensor) -> QuantizedLinear:
        size = weight.shape[1] if group_size == -1 else group_size
        if weight.shape[1] % size or weight.shape[0] % 8:
            raise ValueError(f"{name}: shape {list(weight.shape)} does not pack (group {size})")
        return quantize_rtn(weight, 4, group_size, symmetric=False, act_order=False)

    def pack(ql: QuantizedLinear) -> dict[str, Tensor]:
        return pack_awq(ql.q, ql.zeros, ql.scales)

    tensors, reference = _quantize_model(model, quantize, pack)
    config = {
        "quant_method": "awq",
        "zero_point": True,
        "group_size": group_size,
        "bits": 4,
        "version": "gemm",
        "modules_to_not_convert": None,
    }
    _write(model, Path(path), tensors, config)
    return reference


__all__ = [
    "AWQ_ORDER",
    "QuantizedLinear",
    "decoder_linears",
    "dequantize",
    "gptq_quantization_config",
    "pack_awq",
    "pack_gptq",
    "quantize_rtn",
    "save_awq_checkpoint",
    "save_gptq_checkpoint",
    "unpack_awq",
    "unpack_gptq",
]
