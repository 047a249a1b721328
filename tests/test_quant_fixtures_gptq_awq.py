"""The project's GPTQ/AWQ test writers (``tests/quant_fixtures/packing.py``) against the real
tools, and the checkpoints they write.

``tests/data/quant_goldens.safetensors`` holds, per case, the integers given to auto-gptq
0.7.1 or AutoAWQ 0.2.9, what the tool packed from them and the tool's own dequantized
weight (``scripts/make_quant_goldens.py`` made it; nothing is downloaded or run from those
tools here). The writers must reproduce the packed tensors bit for bit, read them back to
the same integers, and agree with the tool's dequantization; the checkpoint writers must
produce the names, shapes, dtypes and configs of real checkpoints, and an oracle model whose
weights are exactly what the checkpoint decodes to.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from safetensors import safe_open
from safetensors.torch import load_file

from tests.quant_fixtures.packing import (
    AWQ_ORDER,
    QuantizedLinear,
    decoder_linears,
    dequantize,
    pack_awq,
    pack_gptq,
    quantize_rtn,
    save_awq_checkpoint,
    save_gptq_checkpoint,
    unpack_awq,
    unpack_gptq,
)

GOLDENS = Path(__file__).parent / "data" / "quant_goldens.safetensors"


def _load_goldens() -> dict[str, dict[str, Any]]:
    cases: dict[str, dict[str, Any]] = {}
    with safe_open(str(GOLDENS), "pt") as f:
        metadata = f.metadata()
        for name in json.loads(metadata["cases"]):
            tensors = {
                key.split(".", 1)[1]: f.get_tensor(key)
                for key in f.keys()  # noqa: SIM118 (safe_open is not a dict)
                if key.startswith(f"{name}.")
            }
            cases[name] = {"meta": json.loads(metadata[f"case.{name}"]), **tensors}
    return cases


CASES = _load_goldens()
GPTQ_CASES = [n for n, c in CASES.items() if c["meta"]["format"] == "gptq_v1"]
AWQ_CASES = [n for n, c in CASES.items() if c["meta"]["format"] == "awq_gemm"]


def _inputs(case: dict[str, Any], zeros: str = "zeros_in") -> QuantizedLinear:
    meta = case["meta"]
    return QuantizedLinear(
        q=case["q"].to(torch.int32),
        zeros=case[zeros],
        scales=case["scales_in"],
        g_idx=case["g_idx_in"],
        bits=meta["bits"],
        group_size=meta["group_size"],
    )


def test_goldens_cover_the_cases_asked_for() -> None:
    """The file holds GPTQ v1 4-bit act-order, symmetric, 8-bit and 4-bit per-channel
    cases and two AWQ GEMM cases, with zero points at both edges where asymmetric."""
    assert GOLDENS.stat().st_size < 300_000
    metas = {name: case["meta"] for name, case in CASES.items()}
    assert any(m["act_order"] and m["bits"] == 4 and not m["sym"] for m in metas.values())
    assert any(m["sym"] and m["format"] == "gptq_v1" for m in metas.values())
    assert any(m["bits"] == 8 and m["group_size"] == -1 for m in metas.values())
    assert any(m["bits"] == 4 and m["group_size"] == -1 for m in metas.values())
    assert sorted(metas[n]["group_size"] for n in AWQ_CASES) == [32, 64]
    act = CASES["gptq_v1_4bit_g32_actorder_asym"]
    assert {0, 15} <= set(act["zeros_in"].unique().tolist())
    assert not torch.equal(act["g_idx_in"], torch.arange(96, dtype=torch.int32) // 32)
    assert torch.bincount(act["g_idx_in"]).tolist() == [32, 32, 32]
    assert {0, 15} <= set(CASES["awq_gemm_4bit_g32"]["zeros_in"].unique().tolist())


@pytest.mark.parametrize("name", GPTQ_CASES)
def test_pack_gptq_is_auto_gptq_bit_for_bit(name: str) -> None:
    case = CASES[name]
    ql = _inputs(case)
    packed = pack_gptq(ql.q, ql.zeros, ql.scales, ql.g_idx, ql.bits, "gptq")
    assert sorted(packed) == ["g_idx", "qweight", "qzeros", "scales"]
    for key, value in packed.items():
        assert value.dtype == case[key].dtype, key
        assert torch.equal(value, case[key]), key


@pytest.mark.parametrize("name", AWQ_CASES)
def test_pack_awq_is_autoawq_bit_for_bit(name: str) -> None:
    case = CASES[name]
    ql = _inputs(case)
    packed = pack_awq(ql.q, ql.zeros, ql.scales)
    assert sorted(packed) == ["qweight", "qzeros", "scales"]
    for key, value in packed.items():
        assert value.dtype == case[key].dtype, key
        assert torch.equal(value, case[key]), key


@pytest.mark.parametrize("name", GPTQ_CASES)
def test_tool_gptq_dequantization_is_dequantize(name: str) -> None:
    """auto-gptq's forward (float32) computes exactly ``dequantize`` of the integers, with
    the zero points a v1 reader gets (the chosen ones, except where 0 was chosen)."""
    case = CASES[name]
    assert torch.equal(case["dequant"], dequantize(_inputs(case, "zeros_used")))
    unpacked = unpack_gptq(case, case["meta"]["bits"], case["meta"]["group_size"], "gptq")
    assert torch.equal(unpacked.q, case["q"].to(torch.int32))
    assert torch.equal(unpacked.zeros, case["zeros_used"])
    assert torch.equal(unpacked.scales.float(), case["scales_in"])
    assert torch.equal(dequantize(unpacked), case["dequant"])
    if not (case["zeros_in"] == 0).any():
        assert torch.equal(case["dequant"], dequantize(_inputs(case)))


@pytest.mark.parametrize("name", AWQ_CASES)
def test_tool_awq_dequantization_is_dequantize(name: str) -> None:
    """AutoAWQ's ``dequantize_gemm`` works in float16: it equals ``dequantize`` rounded
    once to float16."""
    case = CASES[name]
    exact = dequantize(_inputs(case))
    assert torch.equal(case["zeros_used"], case["zeros_in"])
    assert torch.equal(case["dequant"], exact.half().float())
    assert (case["dequant"] - exact).abs().max() <= exact.abs().max() * 2**-11
    unpacked = unpack_awq(case)
    assert torch.equal(unpacked.q, case["q"].to(torch.int32))
    assert torch.equal(unpacked.zeros, case["zeros_in"])
    assert unpacked.group_size == case["meta"]["group_size"]
    assert torch.equal(dequantize(unpacked), exact)


def test_gptq_v1_zero_point_of_zero_reads_as_sixteen() -> None:
    """v1 stores ``zero - 1``: a 0 becomes -1 = 0xFFFFFFFF, ORed in at its field, so that
    field and every higher field of its qzeros word read as 15 + 1 = 16 in auto-gptq's own
    forward. Planted: row 3 of group 1 (field 3: rows 3-7 read 16), row 15 of group 2
    (field 7, the top: only itself)."""
    case = CASES["gptq_v1_4bit_g32_actorder_asym"]
    zin, used = case["zeros_in"], case["zeros_used"]
    assert (zin == 0).nonzero().tolist() == [[3, 1], [15, 2]]
    expected = zin.clone()
    expected[3:8, 1] = 16
    expected[15, 2] = 16
    assert torch.equal(used, expected)
    word = int(case["qzeros"][1, 0]) & 0xFFFFFFFF
    assert word >> 12 == 0xFFFFF  # fields 3..7 all ones
    columns = case["g_idx_in"] == 1
    q = case["q"][3, columns].float()
    assert torch.equal(case["dequant"][3, columns], case["scales_in"][3, 1] * (q - 16))


@pytest.mark.parametrize("name", [n for n in GPTQ_CASES if not (CASES[n]["zeros_in"] == 0).any()])
def test_gptq_v2_is_v1_plus_one_per_field(name: str) -> None:
    """GPTQModel converts v1 to v2 by adding 1 to every qzeros field (0x11111111 at 4 bits,
    0x01010101 at 8) - exact where no zero point is 0; qweight, scales, g_idx are shared."""
    case = CASES[name]
    ql = _inputs(case)
    v2 = pack_gptq(ql.q, ql.zeros, ql.scales, ql.g_idx, ql.bits, "gptq_v2")
    offset = 0x11111111 if ql.bits == 4 else 0x01010101
    converted = (case["qzeros"].long() + offset) & 0xFFFFFFFF
    assert torch.equal(v2["qzeros"].long() & 0xFFFFFFFF, converted)
    for key in ("qweight", "scales", "g_idx"):
        assert torch.equal(v2[key], case[key])
    back = unpack_gptq(v2, ql.bits, ql.group_size, "gptq_v2")
    assert torch.equal(back.zeros, ql.zeros)


def test_gptq_v2_stores_a_zero_point_of_zero() -> None:
    case = CASES["gptq_v1_4bit_g32_actorder_asym"]
    ql = _inputs(case)
    v2 = pack_gptq(ql.q, ql.zeros, ql.scales, ql.g_idx, 4, "gptq_v2")
    back = unpack_gptq(v2, 4, 32, "gptq_v2")
    assert torch.equal(back.zeros, case["zeros_in"])
    assert torch.equal(dequantize(back), dequantize(ql))


def test_awq_field_order() -> None:
    """One word by hand: output column j of a block of 8 sits in field AWQ_ORDER.index(j)."""
    q = torch.zeros(8, 1, dtype=torch.int32)
    q[:, 0] = torch.arange(8) + 1  # column 0..7 of the packed row hold 1..8
    packed = pack_awq(q, torch.zeros(8, 1, dtype=torch.int32), torch.ones(8, 1))
    word = int(packed["qweight"][0, 0]) & 0xFFFFFFFF
    fields = [(word >> (4 * k)) & 0xF for k in range(8)]
    assert fields == [AWQ_ORDER[k] + 1 for k in range(8)] == [1, 3, 5, 7, 2, 4, 6, 8]


def test_packers_refuse_what_no_checkpoint_can_hold() -> None:
    q = torch.zeros(8, 32, dtype=torch.int32)
    zeros = torch.ones(8, 1, dtype=torch.int32)
    scales = torch.ones(8, 1)
    g_idx = torch.zeros(32, dtype=torch.int32)
    with pytest.raises(ValueError, match="q outside"):
        pack_gptq(q + 16, zeros, scales, g_idx, 4)
    with pytest.raises(ValueError, match="float16"):
        pack_gptq(q, zeros, scales + 1e-4, g_idx, 4)
    with pytest.raises(ValueError, match="zero points"):
        pack_awq(q, zeros * 16, scales)
    with pytest.raises(ValueError, match="bits"):
        pack_gptq(q, zeros, scales, g_idx, 3)


@pytest.mark.parametrize(
    ("bits", "group_size", "symmetric", "act_order", "min_zero"),
    [
        (4, 32, False, True, 1),
        (4, 32, False, False, 1),
        (4, 32, True, False, 0),
        (8, -1, False, False, 0),
        (4, 64, False, False, 0),
    ],
)
def test_quantize_rtn(
    bits: int, group_size: int, symmetric: bool, act_order: bool, min_zero: int
) -> None:
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(64, 128, generator=gen) * 0.2
    weight[:4, :64] = weight[:4, :64].abs()  # groups with no negative weight: zero point 0
    ql = quantize_rtn(weight, bits, group_size, symmetric, act_order, gen, min_zero=min_zero)
    size = 128 if group_size == -1 else group_size
    assert torch.bincount(ql.g_idx).tolist() == [size] * (128 // size)
    assert act_order == (not torch.equal(ql.g_idx, (torch.arange(128) // size).int()))
    assert ql.scales.dtype == torch.float16 and int(ql.zeros.min()) >= min_zero
    if symmetric:
        assert (ql.zeros == 2 ** (bits - 1)).all()
    elif min_zero == 0 and group_size != -1:
        assert (ql.zeros[:4, 0] == 0).all()
    elif min_zero and not act_order:  # all-positive groups widen their range downwards
        assert (ql.zeros[:4, :2] == min_zero).all()
    error = (dequantize(ql) - weight).abs()
    bound = ql.scales.float()[:, ql.g_idx.long()] * (0.5 + (2**bits - 1) * 2**-10)
    assert (error <= bound).all()
    assert error.max() > 0


# ----------------------------------------------------------------------------- checkpoints

_LLAMA = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    bos_token_id=1,
    eos_token_id=2,
)


def _tiny(kind: str) -> Any:
    torch.manual_seed(0)
    if kind == "llama-tied":
        config: Any = transformers.LlamaConfig(**_LLAMA, tie_word_embeddings=True)
        model = transformers.LlamaForCausalLM(config)
    else:  # qwen2: q/k/v biases, untied
        config = transformers.Qwen2Config(**_LLAMA, tie_word_embeddings=False)
        model = transformers.Qwen2ForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.15)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.1)
    return model.eval()


def _check_reference(model: Any, reference: Any, qlinears: dict[str, QuantizedLinear]) -> None:
    """The reference holds exactly the checkpoint's dequantized weights, within the
    quantization error of the original; everything else is the original's."""
    ref_params = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        module = name.rsplit(".", 1)[0]
        if module not in qlinears:
            assert torch.equal(ref_params[name], p), name
            continue
        ql = qlinears[module]
        if name.endswith(".bias"):
            assert torch.equal(ref_params[name], p.half().float()), name
            continue
        assert torch.equal(ref_params[name], dequantize(ql)), name
        bound = ql.scales.float()[:, ql.g_idx.long()] * (0.5 + (2**ql.bits - 1) * 2**-10)
        error = (ref_params[name] - p).abs()
        assert (error <= bound).all() and error.max() > 0, name
    prompt = torch.tensor([[1, 17, 42, 99, 5]])
    out = reference.generate(
        prompt, max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    assert out.shape == (1, 11)
    with torch.no_grad():
        logits = reference(out).logits[0]
    assert out[0, 5:].tolist() == logits[4:10].argmax(-1).tolist()


def _expected_shapes(model: Any, bits: int, group_size: int, fmt: str) -> dict[str, Any]:
    shapes: dict[str, Any] = {}
    for name, linear in decoder_linears(model).items():
        out, inp = linear.weight.shape
        groups = 1 if group_size == -1 else -(-inp // group_size)
        if fmt == "awq":
            shapes[f"{name}.qweight"] = ([inp, out // 8], torch.int32)
            shapes[f"{name}.qzeros"] = ([groups, out // 8], torch.int32)
        else:
            shapes[f"{name}.qweight"] = ([inp * bits // 32, out], torch.int32)
            shapes[f"{name}.qzeros"] = ([groups, out * bits // 32], torch.int32)
            shapes[f"{name}.g_idx"] = ([inp], torch.int32)
        shapes[f"{name}.scales"] = ([groups, out], torch.float16)
        if linear.bias is not None:
            shapes[f"{name}.bias"] = ([out], torch.float16)
    for name, tensor in model.state_dict().items():
        if name.rsplit(".", 1)[0] not in decoder_linears(model):
            shapes[name] = (list(tensor.shape), torch.float32)
    if model.config.tie_word_embeddings:
        del shapes["lm_head.weight"]
    return shapes


GPTQ_CHECKPOINTS = [
    ("llama-tied", 4, 32, False, True, "gptq"),
    ("qwen2", 8, -1, True, False, "gptq"),
    ("llama-tied", 4, 64, False, False, "gptq_v2"),
]


@pytest.mark.parametrize(
    ("kind", "bits", "group_size", "sym", "act_order", "fmt"), GPTQ_CHECKPOINTS
)
def test_save_gptq_checkpoint(
    tmp_path: Path, kind: str, bits: int, group_size: int, sym: bool, act_order: bool, fmt: str
) -> None:
    model = _tiny(kind)
    reference = save_gptq_checkpoint(model, tmp_path, bits, group_size, sym, act_order, fmt)
    tensors = load_file(tmp_path / "model.safetensors")
    got = {k: (list(v.shape), v.dtype) for k, v in tensors.items()}
    assert got == _expected_shapes(model, bits, group_size, "gptq")
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == [type(model).__name__]
    qc = config["quantization_config"]
    assert qc["quant_method"] == "gptq" and qc["checkpoint_format"] == fmt
    assert (qc["bits"], qc["group_size"], qc["sym"], qc["desc_act"]) == (
        bits,
        group_size,
        sym,
        act_order,
    )
    assert {"damp_percent", "true_sequential", "static_groups"} <= set(qc)
    qlinears = {}
    for name in decoder_linears(model):
        own = {k: tensors[f"{name}.{k}"] for k in ("qweight", "qzeros", "scales", "g_idx")}
        qlinears[name] = unpack_gptq(own, bits, group_size, fmt)
        if fmt == "gptq" and not sym:
            assert int(qlinears[name].zeros.min()) >= 1  # v1 never needs to store 0
    assert act_order == any(
        not torch.equal(ql.g_idx, torch.sort(ql.g_idx).values) for ql in qlinears.values()
    )
    _check_reference(model, reference, qlinears)


@pytest.mark.parametrize(("kind", "group_size"), [("llama-tied", 32), ("qwen2", 64)])
def test_save_awq_checkpoint(tmp_path: Path, kind: str, group_size: int) -> None:
    model = _tiny(kind)
    reference = save_awq_checkpoint(model, tmp_path, group_size)
    tensors = load_file(tmp_path / "model.safetensors")
    got = {k: (list(v.shape), v.dtype) for k, v in tensors.items()}
    assert got == _expected_shapes(model, 4, group_size, "awq")
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["quantization_config"] == {
        "quant_method": "awq",
        "zero_point": True,
        "group_size": group_size,
        "bits": 4,
        "version": "gemm",
        "modules_to_not_convert": None,
    }
    qlinears = {
        name: unpack_awq({k: tensors[f"{name}.{k}"] for k in ("qweight", "qzeros", "scales")})
        for name in decoder_linears(model)
    }
    assert all(ql.group_size == group_size for ql in qlinears.values())
    _check_reference(model, reference, qlinears)


def test_tied_embeddings_stay_tied(tmp_path: Path) -> None:
    model = _tiny("llama-tied")
    reference = save_gptq_checkpoint(model, tmp_path, 4, 32, True, False)
    tensors = load_file(tmp_path / "model.safetensors")
    assert "lm_head.weight" not in tensors
    assert torch.equal(tensors["model.embed_tokens.weight"], model.model.embed_tokens.weight)
    assert reference.lm_head.weight is reference.model.embed_tokens.weight
    assert json.loads((tmp_path / "config.json").read_text())["tie_word_embeddings"] is True
