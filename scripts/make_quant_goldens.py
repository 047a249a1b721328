"""Generate ``tests/data/quant_goldens.safetensors`` with the real GPTQ and AWQ packers.

Run by hand (never in CI, never at test time)::

    WHEEL=auto_gptq-0.7.1-cp311-cp311-manylinux_2_17_x86_64.manylinux2014_x86_64.whl
    .venv/bin/python scripts/make_quant_goldens.py \\
        --auto-gptq-wheel /tmp/oracles/$WHEEL \\
        --autoawq-sdist /tmp/oracles/autoawq-0.2.9 \\
        --out tests/data/quant_goldens.safetensors

(``--autoawq-sdist`` also takes the ``autoawq-0.2.9.tar.gz`` itself; the tensors are the
same.) It needs torch, numpy, transformers and accelerate (for AutoAWQ's ``utils.py``), no
network and no GPU, and takes about two seconds.

What it does
------------
For each case it chooses the integers first: weights ``q`` [out, in] in ``0..2^bits-1``,
zero points [out, groups], scales [out, groups] (random, rounded to float16 so that the
checkpoint's float16 scales hold them exactly) and ``g_idx`` [in]. It builds the float
weight ``W = scale * (q - zero)`` (float16, as the tools see a float16 model), hands ``W``,
the scales and the zero points to the real packer, and keeps what the packer wrote
(``qweight``, ``qzeros``, ``scales``, ``g_idx``) and what the tool's own dequantization
gives back (float32, [out, in]).

* GPTQ v1: auto-gptq 0.7.1's ``QuantLinear`` from ``nn_modules/qlinear/qlinear_cuda.py``
  (loaded by file path from the wheel; its CUDA extension is absent and it falls back to its
  torch code on CPU). ``pack(linear, scales, zeros, g_idx)`` receives a float16
  ``nn.Linear`` and float32 ``scales``/``zeros`` [out, groups], as auto-gptq's
  ``pack_model`` passes them. Dequantized by a second ``QuantLinear`` built with
  ``weight_dtype=torch.float32`` that loads the packed buffers (scales cast to float32),
  whose ``forward`` on an identity matrix returns the weight it uses, transposed.
* AWQ GEMM: AutoAWQ 0.2.9's ``WQLinear_GEMM.from_linear(linear, 4, group_size, scales,
  zeros)`` (float16 ``linear``; ``scales``/``zeros`` float16 [groups, out], as AutoAWQ's
  quantizer passes them), dequantized by ``awq.utils.packing_utils.dequantize_gemm``
  (float16 arithmetic, stored as float32). Only the four AutoAWQ files these need are
  executed: stub packages stand in for ``awq``, ``awq.utils``, ``awq.modules`` and
  ``awq.modules.linear`` so that ``awq/__init__.py`` (the whole library) never runs.

Checks made here, each an ``assert``: the tool's dequantized weight equals
``scale * (q - zero_used)`` to the last bit (float32) or to float16 rounding (AWQ), where
``zero_used`` is read back from the tool's own output; ``zero_used`` equals the chosen zero
point everywhere except where GPTQ v1 storage cannot hold it (a zero point of 0, see
``tests/quant_fixtures/NOTES-gptq-awq.md``), and there it is exactly what that storage
predicts. The file records ``zero_used`` per case as ``<case>.zeros_used``.

Layout of the output file: tensors ``<case>.<name>`` and safetensors metadata: ``cases``
(JSON list), ``case.<case>`` (JSON: format, bits, group_size, act_order, sym, shape, the
tool and the dtypes it was given), ``tools`` and ``command``.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import shlex
import shutil
import sys
import tarfile
import tempfile
import types
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

SEED = 20240611
QLINEAR_MEMBER = "auto_gptq/nn_modules/qlinear/qlinear_cuda.py"
AWQ_FILES = (
    "awq/utils/module.py",
    "awq/utils/utils.py",
    "awq/utils/packing_utils.py",
    "awq/modules/linear/gemm.py",
)


@dataclass
class Case:
    """One packing case: the integer inputs chosen here and the metadata recorded."""

    name: str
    fmt: str  # "gptq_v1" or "awq_gemm"
    bits: int
    group_size: int  # -1: one group over all input columns
    out_features: int
    in_features: int
    act_order: bool = False
    sym: bool = False
    # (out row, group, zero point) planted on top of the random zero points
    planted_zeros: list[tuple[int, int, int]] = field(default_factory=list)

    @property
    def groups(self) -> int:
        size = self.in_features if self.group_size == -1 else self.group_size
        return -(-self.in_features // size)


CASES = [
    Case(
        "gptq_v1_4bit_g32_actorder_asym",
        "gptq_v1",
        4,
        32,
        64,
        96,
        act_order=True,
        # 15 (the top edge) in a few places; 0 (the bottom edge) at nibble 3 of a qzeros word
        # (row 3: nibbles 4-7 of that word are rows 4-7) and at nibble 7 (row 15, the last)
        planted_zeros=[(0, 0, 15), (9, 1, 15), (63, 2, 15), (3, 1, 0), (15, 2, 0)],
    ),
    Case("gptq_v1_4bit_g32_sym", "gptq_v1", 4, 32, 96, 64, sym=True),
    Case(
        "gptq_v1_8bit_perchannel_asym",
        "gptq_v1",
        8,
        -1,
        64,
        96,
        planted_zeros=[(0, 0, 255), (5, 0, 1), (62, 0, 255)],
    ),
    Case(
        "gptq_v1_4bit_perchannel_asym",
        "gptq_v1",
        4,
        -1,
        96,
        64,
        planted_zeros=[(0, 0, 15), (17, 0, 1)],
    ),
    Case(
        "awq_gemm_4bit_g32",
        "awq_gemm",
        4,
        32,
        64,
        96,
        planted_zeros=[(0, 0, 0), (1, 0, 15), (7, 1, 0), (8, 1, 15), (33, 2, 0), (63, 2, 15)],
    ),
    Case("awq_gemm_4bit_g64", "awq_gemm", 4, 64, 64, 128),
]


# ---------------------------------------------------------------------------- the real tools


def _load_module(name: str, path: Path) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def load_auto_gptq(wheel: Path, work: Path) -> tuple[type, str]:
    """auto-gptq's ``QuantLinear`` (qlinear_cuda.py, loaded by file path) and its version."""
    with zipfile.ZipFile(wheel) as archive:
        archive.extract(QLINEAR_MEMBER, work / "agptq")
        version = ""
        for member in archive.namelist():
            if member.endswith(".dist-info/METADATA"):
                for line in archive.read(member).decode().splitlines():
                    if line.startswith("Version:"):
                        version = line.split(":", 1)[1].strip()
    module = _load_module("auto_gptq_qlinear_cuda", work / "agptq" / QLINEAR_MEMBER)
    return module.QuantLinear, version


def _extract_awq(sdist: Path, work: Path) -> tuple[Path, str]:
    """Copy AWQ_FILES out of the sdist (a directory or a .tar.gz) into ``work/awq_src``."""
    dest = work / "awq_src"
    if sdist.is_dir():
        for rel in AWQ_FILES:
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(sdist / rel, dest / rel)
        pkg_info = (sdist / "PKG-INFO").read_text()
    else:
        with tarfile.open(sdist) as archive:
            root = archive.getnames()[0].split("/")[0]
            for rel in AWQ_FILES:
                data = archive.extractfile(f"{root}/{rel}")
                assert data is not None, rel
                (dest / rel).parent.mkdir(parents=True, exist_ok=True)
                (dest / rel).write_bytes(data.read())
            info = archive.extractfile(f"{root}/PKG-INFO")
            assert info is not None
            pkg_info = info.read().decode()
    version = next(
        (ln.split(":", 1)[1].strip() for ln in pkg_info.splitlines() if ln.startswith("Version:")),
        "",
    )
    return dest, version


def load_autoawq(sdist: Path, work: Path) -> tuple[Any, Any, str]:
    """AutoAWQ's ``WQLinear_GEMM`` and ``dequantize_gemm`` without running ``awq/__init__``."""
    src, version = _extract_awq(sdist, work)
    for package in ("awq", "awq.utils", "awq.modules", "awq.modules.linear"):
        stub = types.ModuleType(package)
        stub.__path__ = [str(src / package.replace(".", "/"))]
        sys.modules[package] = stub
    gemm = importlib.import_module("awq.modules.linear.gemm")
    packing_utils = importlib.import_module("awq.utils.packing_utils")
    assert gemm.awq_ext is None and not gemm.TRITON_AVAILABLE, "expected the torch fallback"
    return gemm.WQLinear_GEMM, packing_utils.dequantize_gemm, version


# ----------------------------------------------------------------------- the chosen integers


def choose_integers(case: Case, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Random q, zero points, fp16-exact scales and g_idx for ``case``."""
    maxq = 2**case.bits - 1
    out, inp, groups = case.out_features, case.in_features, case.groups
    q = torch.randint(0, maxq + 1, (out, inp), generator=gen, dtype=torch.int32)
    if case.sym:
        zeros = torch.full((out, groups), 2 ** (case.bits - 1), dtype=torch.int32)
    else:
        # 1..maxq-1 at random (GPTQ v1 cannot store 0; the edges are planted below)
        zeros = torch.randint(1, maxq, (out, groups), generator=gen, dtype=torch.int32)
    for row, group, value in case.planted_zeros:
        zeros[row, group] = value
    exponent = torch.rand((out, groups), generator=gen) * 4.0 - 8.0  # 2^-8 .. 2^-4
    scales = torch.exp2(exponent).to(torch.float16).to(torch.float32)
    size = inp if case.group_size == -1 else case.group_size
    if case.act_order:
        rank = torch.argsort(torch.randperm(inp, generator=gen))
        g_idx = (rank // size).to(torch.int32)
    else:
        g_idx = (torch.arange(inp) // size).to(torch.int32)
    return {"q": q, "zeros": zeros, "scales": scales, "g_idx": g_idx}


def exact_weight(ints: dict[str, torch.Tensor], zeros: torch.Tensor) -> torch.Tensor:
    """``scale * (q - zeros)`` [out, in] in float32 (exact: an 11-bit scale times <= 9 bits)."""
    g = ints["g_idx"].long()
    return ints["scales"][:, g] * (ints["q"] - zeros[:, g]).to(torch.float32)


def zeros_read_back(
    ints: dict[str, torch.Tensor], dequant: torch.Tensor, groups: int
) -> torch.Tensor:
    """The zero point the tool used, from its dequantized weight: ``q - W / scale``, which
    must be one integer across every column of a group."""
    g = ints["g_idx"].long()
    per_column = ints["q"].double() - dequant.double() / ints["scales"][:, g].double()
    used = torch.round(per_column)
    assert (per_column - used).abs().max() < 1e-2, "tool weight is not scale * (q - z)"
    zeros = torch.empty(dequant.shape[0], groups, dtype=torch.int32)
    for group in range(groups):
        columns = used[:, g == group]
        assert (columns == columns[:, :1]).all(), "zero point varies inside a group"
        zeros[:, group] = columns[:, 0].to(torch.int32)
    return zeros


def v1_storage_prediction(zeros: torch.Tensor, bits: int) -> torch.Tensor:
    """What a GPTQ v1 reader (``(field & mask) + 1``) gets back for ``zeros``, predicted from
    auto-gptq's code: it stores ``zero - 1`` as uint32 (0 becomes 0xFFFFFFFF) and ORs it in at
    ``bits * k``, so a stored -1 sets its own field and every higher field of the word."""
    per_word = 32 // bits
    used = zeros.clone()
    for row_start in range(0, zeros.shape[0], per_word):
        block = zeros[row_start : row_start + per_word]  # one packed word per group
        for group in range(zeros.shape[1]):
            hits = (block[:, group] == 0).nonzero()
            if len(hits):
                used[row_start + int(hits[0]) : row_start + per_word, group] = 2**bits
    return used


# --------------------------------------------------------------------------------- packing


def run_gptq(case: Case, ints: dict[str, torch.Tensor], quant_linear: type) -> dict[str, Any]:
    """Pack with auto-gptq's QuantLinear, dequantize with its forward (float32)."""
    linear = torch.nn.Linear(case.in_features, case.out_features, bias=False)
    linear.weight.data = exact_weight(ints, ints["zeros"]).to(torch.float16)
    packer = quant_linear(case.bits, case.group_size, case.in_features, case.out_features, False)
    packer.pack(linear, ints["scales"].clone(), ints["zeros"].to(torch.float32), ints["g_idx"])
    packed = {
        "qweight": packer.qweight,
        "qzeros": packer.qzeros,
        "scales": packer.scales,
        "g_idx": packer.g_idx,
    }
    reader = quant_linear(
        case.bits,
        case.group_size,
        case.in_features,
        case.out_features,
        False,
        weight_dtype=torch.float32,
    )
    reader.load_state_dict({**packed, "scales": packed["scales"].to(torch.float32)})
    with torch.no_grad():
        dequant = reader(torch.eye(case.in_features, dtype=torch.float32)).t().contiguous()
    used = zeros_read_back(ints, dequant, case.groups)
    assert torch.equal(used, v1_storage_prediction(ints["zeros"], case.bits)), case.name
    assert torch.equal(dequant, exact_weight(ints, used)), case.name
    return {"packed": packed, "dequant": dequant, "zeros_used": used}


def run_awq(
    case: Case, ints: dict[str, torch.Tensor], wqlinear: Any, dequantize_gemm: Any
) -> dict[str, Any]:
    """Pack with AutoAWQ's WQLinear_GEMM.from_linear, dequantize with dequantize_gemm."""
    linear = torch.nn.Linear(case.in_features, case.out_features, bias=False)
    linear.weight.data = exact_weight(ints, ints["zeros"]).to(torch.float16)
    scales = ints["scales"].t().contiguous().to(torch.float16)
    zeros = ints["zeros"].t().contiguous().to(torch.float16)
    packer = wqlinear.from_linear(linear, case.bits, case.group_size, scales=scales, zeros=zeros)
    packed = {"qweight": packer.qweight, "qzeros": packer.qzeros, "scales": packer.scales}
    dequant16 = dequantize_gemm(
        packer.qweight, packer.qzeros, packer.scales, case.bits, case.group_size
    )
    assert dequant16.dtype == torch.float16
    dequant = dequant16.t().to(torch.float32).contiguous()
    used = zeros_read_back(ints, dequant, case.groups)
    assert torch.equal(used, ints["zeros"]), case.name
    expected = exact_weight(ints, ints["zeros"]).to(torch.float16).to(torch.float32)
    assert torch.equal(dequant, expected), case.name
    return {"packed": packed, "dequant": dequant, "zeros_used": used}


def case_metadata(case: Case, tool: str) -> str:
    return json.dumps(
        {
            "format": case.fmt,
            "bits": case.bits,
            "group_size": case.group_size,
            "act_order": case.act_order,
            "sym": case.sym,
            "out_features": case.out_features,
            "in_features": case.in_features,
            "tool": tool,
            "tool_inputs": (
                "float16 nn.Linear weight = scale*(q-zero); scales and zeros float32 "
                "[out, groups]; g_idx int32 [in]"
                if case.fmt == "gptq_v1"
                else "float16 nn.Linear weight = scale*(q-zero); scales and zeros float16 "
                "[groups, out]"
            ),
            "dequant": (
                "QuantLinear(weight_dtype=float32).forward(eye(in)).T, float32"
                if case.fmt == "gptq_v1"
                else "dequantize_gemm(...) in float16, .T, stored as float32"
            ),
        },
        sort_keys=True,
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--auto-gptq-wheel", type=Path, required=True)
    parser.add_argument("--autoawq-sdist", type=Path, required=True, help="directory or .tar.gz")
    parser.add_argument("--out", type=Path, default=Path("tests/data/quant_goldens.safetensors"))
    args = parser.parse_args(argv)

    torch.manual_seed(SEED)
    gen = torch.Generator().manual_seed(SEED)
    tensors: dict[str, torch.Tensor] = {}
    metadata: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as tmp:
        quant_linear, gptq_version = load_auto_gptq(args.auto_gptq_wheel, Path(tmp))
        wqlinear, dequantize_gemm, awq_version = load_autoawq(args.autoawq_sdist, Path(tmp))
        for case in CASES:
            ints = choose_integers(case, gen)
            if case.fmt == "gptq_v1":
                result = run_gptq(case, ints, quant_linear)
                tool = f"auto-gptq {gptq_version} qlinear_cuda.QuantLinear.pack"
            else:
                result = run_awq(case, ints, wqlinear, dequantize_gemm)
                tool = f"autoawq {awq_version} WQLinear_GEMM.from_linear"
            tensors[f"{case.name}.q"] = ints["q"].to(torch.uint8)
            tensors[f"{case.name}.zeros_in"] = ints["zeros"]
            tensors[f"{case.name}.scales_in"] = ints["scales"]
            tensors[f"{case.name}.g_idx_in"] = ints["g_idx"]
            for key, value in result["packed"].items():
                tensors[f"{case.name}.{key}"] = value.contiguous()
            tensors[f"{case.name}.dequant"] = result["dequant"]
            tensors[f"{case.name}.zeros_used"] = result["zeros_used"]
            metadata[f"case.{case.name}"] = case_metadata(case, tool)
            changed = int((result["zeros_used"] != ints["zeros"]).sum())
            print(f"{case.name}: ok ({changed} zero points not stored as given)")
    metadata["cases"] = json.dumps([case.name for case in CASES])
    metadata["tools"] = json.dumps({"auto-gptq": gptq_version, "autoawq": awq_version})
    metadata["command"] = shlex.join(
        [".venv/bin/python", "scripts/make_quant_goldens.py", *(argv or sys.argv[1:])]
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(args.out), metadata=metadata)
    print(f"wrote {args.out} ({args.out.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
